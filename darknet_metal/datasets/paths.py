"""Paths in dataset files: where a relative path points, and where an image's labels are.

Relative paths: Darknet opens every path it reads from a ``.data`` file or an image list
relative to the working directory. :func:`resolve` does that first and, when nothing is
there, tries the folder of the file that named the path, so a dataset also works from
another working directory.

Label files, by three rules:

- :func:`darknet_label_path`: Darknet V5's ``replace_image_to_label`` (``src-lib/utils.cpp``
  since commit 6bf8a238, 2024): the image path with its extension replaced by ``.txt``, so
  the labels lie beside the image.
- :func:`legacy_darknet_label_path`: the same function before that commit (AlexeyAB's
  Darknet and hank-ai's up to 2024): folder substitutions (``/images/train2017/`` to
  ``/labels/train2017/``, ``/JPEGImages/`` to ``/labels/``, ...) then twelve extensions to
  ``.txt``. Used when the V5 label file does not exist and this one does, so datasets laid
  out for the older Darknet keep working.
- :func:`yolo_label_path`: the ultralytics layout's ``img2label_paths``: the last
  ``/images/`` replaced by ``/labels/`` and the extension by ``.txt``.
"""

from __future__ import annotations

import os
from pathlib import Path

__all__ = [
    "darknet_label_path",
    "legacy_darknet_label_path",
    "locate",
    "resolve",
    "yolo_label_path",
]


def resolve(text: str, base_dir: str | os.PathLike[str]) -> Path:
    """The absolute path ``text`` names: as given if absolute; else relative to the working
    directory when something exists there, else relative to ``base_dir`` when something
    exists there, else relative to the working directory (so a missing file is reported
    where Darknet would look for it)."""
    return locate(text, base_dir)[0]


def locate(text: str, base_dir: str | os.PathLike[str]) -> tuple[Path, Path | None]:
    """``(resolve(text, base_dir), folder it was resolved against)``; the folder is None
    for an absolute ``text``."""
    if Path(text).is_absolute():
        return Path(text), None
    cwd = Path(os.getcwd())
    in_cwd = Path(os.path.abspath(text))
    if in_cwd.exists():
        return in_cwd, cwd
    base = Path(os.path.abspath(base_dir))
    beside = Path(os.path.abspath(os.path.join(base, text)))
    if beside.exists():
        return beside, base
    return in_cwd, cwd


def _split_name(path: str) -> tuple[str, str]:
    """(folder part with its trailing separator, file name)."""
    cut = max(path.rfind("/"), path.rfind(os.sep), path.rfind(os.altsep or "/"))
    return path[: cut + 1], path[cut + 1 :]


def darknet_label_path(image: str) -> str:
    """Darknet V5's label file for ``image``: the file name's extension (from its last
    ``.``) replaced by ``.txt``, or ``.txt`` appended when the name has no ``.``.

    Darknet cuts at the last ``.`` of the whole path, so an extension-less file in a folder
    with a dot (``data.v2/img``) gets ``data.txt``; here only the file name is cut
    (``data.v2/img.txt``). Every path whose file name has a dot maps as in Darknet.
    """
    folder, name = _split_name(image)
    dot = name.rfind(".")
    stem = name[:dot] if dot >= 0 else name
    return folder + stem + ".txt"


# The substitutions of Darknet's replace_image_to_label before commit 6bf8a238 (utils.cpp),
# in its order; each replaces the first occurrence only.
_LEGACY_FOLDERS = (
    ("/images/train2017/", "/labels/train2017/"),
    ("/images/val2017/", "/labels/val2017/"),
    ("/JPEGImages/", "/labels/"),
    ("\\images\\train2017\\", "\\labels\\train2017\\"),
    ("\\images\\val2017\\", "\\labels\\val2017\\"),
    ("\\images\\train2014\\", "\\labels\\train2014\\"),
    ("\\images\\val2014\\", "\\labels\\val2014\\"),
    ("/images/train2014/", "/labels/train2014/"),
    ("/images/val2014/", "/labels/val2014/"),
    ("\\JPEGImages\\", "\\labels\\"),
)
_LEGACY_EXTENSIONS = (
    ".jpg", ".JPG", ".jpeg", ".JPEG", ".png", ".PNG",
    ".bmp", ".BMP", ".ppm", ".PPM", ".tiff", ".TIFF",
)  # fmt: skip


def legacy_darknet_label_path(image: str) -> str | None:
    """The older Darknet's label file for ``image``, or None when that rule finds none.

    As ``replace_image_to_label`` before commit 6bf8a238: the folder substitutions above
    (first occurrence of each), spaces and tabs trimmed from both ends, then each of twelve
    extensions replaced by ``.txt`` when its *first* occurrence ends the path (so
    ``a.jpg.jpg`` is left alone). Darknet then warned and used the unchanged path as the
    label file; here a result not ending in ``.txt`` gives None.
    """
    path = image
    for old, new in _LEGACY_FOLDERS:
        path = path.replace(old, new, 1)
    path = path.strip(" \t")
    for ext in _LEGACY_EXTENSIONS:
        at = path.find(ext)
        if at >= 0 and at + len(ext) == len(path):
            path = path[:at] + ".txt"
    if len(path) <= 4 or not path.endswith(".txt"):
        return None
    return path


def yolo_label_path(image: str) -> str:
    """The ultralytics layout's label file for ``image`` (``img2label_paths``): the last
    ``/images/`` (with the platform's separator) becomes ``/labels/``, then everything from
    the last ``.`` of the path becomes ``.txt``."""
    images, labels = f"{os.sep}images{os.sep}", f"{os.sep}labels{os.sep}"
    head, found, tail = image.rpartition(images)
    path = head + labels + tail if found else image
    dot = path.rfind(".")
    return (path[:dot] if dot >= 0 else path) + ".txt"
