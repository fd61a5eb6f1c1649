"""The ultralytics dataset YAML layout (``coco8.yaml`` and the like).

Keys, as ultralytics' ``check_det_dataset`` reads them:

- ``path``: the dataset root; relative to the working directory when it exists there,
  else to the YAML file's folder (ultralytics tries its own ``datasets_dir`` setting
  instead); the YAML file's folder when absent.
- ``train``, ``val`` (``validation`` is taken as ``val``), ``test`` (optional): each, relative
  to the root, a folder of images (searched recursively), a ``.txt`` list of image paths
  (``./x`` relative to the list's folder, other relative paths as in ``.data`` lists), or a
  YAML list of those. Files whose extension is not an image extension are skipped (a
  warning for listed ones), and each set is sorted by path, as ultralytics does.
- ``names``: a list, or a mapping ``{id: name}`` with ids 0..n-1; ``nc``: the number of
  classes, which must match ``names`` when both are given; without ``names`` the classes are
  ``class_0``, ``class_1``, ...

Labels: the last ``/images/`` of an image path replaced by ``/labels/``, the extension by
``.txt`` (ultralytics' ``img2label_paths``).
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

from darknet_metal.datasets.dataset import Dataset, Sample
from darknet_metal.datasets.paths import locate, yolo_label_path
from darknet_metal.datasets.problems import Problems
from darknet_metal.datasets.textfile import read_bytes, split_lines
from darknet_metal.errors import DatasetError

__all__ = ["IMAGE_EXTENSIONS", "load_yaml_dataset"]

#: Image file extensions of the layout (ultralytics' ``IMG_FORMATS``), compared lowercased.
IMAGE_EXTENSIONS = frozenset(
    {"bmp", "dng", "jpeg", "jpg", "mpo", "png", "tif", "tiff", "webp", "pfm", "heic"}
)


def load_yaml_dataset(path: Path) -> Dataset:
    """The dataset an ultralytics YAML file describes (problems in ``Dataset.problems``)."""
    path = Path(path)
    problems = Problems()
    data = _load_yaml(path)
    key_lines = _key_lines(path)

    def line_of(key: str) -> int | None:
        return key_lines.get(key)

    if "val" not in data and "validation" in data:
        data["val"] = data.pop("validation")
        key_lines["val"] = key_lines.get("validation", 0)
    for key in ("train", "val"):
        if not data.get(key):
            problems.error(path, line_of(key), f"no '{key}' images: 'train' and 'val' are "
                           "required in a dataset YAML")

    names, classes = _read_names(path, data, line_of, problems)

    root_text = data.get("path")
    if root_text is None or root_text == "":
        root = path.absolute().parent
    elif not isinstance(root_text, str):
        problems.error(path, line_of("path"), f"path: expected a folder, got {root_text!r}")
        root = path.absolute().parent
    else:
        root, _ = locate(root_text, path.parent)
        if not root.is_dir():
            problems.error(path, line_of("path"), f"path: {root_text}: the dataset folder "
                           f"{root} does not exist")

    sets: dict[str, list[Sample]] = {}
    for key in ("train", "val", "test"):
        value = data.get(key)
        if value is None or value == "" or value == []:
            sets[key] = []
            continue
        entries = value if isinstance(value, list) else [value]
        samples: list[Sample] = []
        errors_before = len(problems.errors)
        for entry in entries:
            if not isinstance(entry, str):
                problems.error(path, line_of(key), f"{key}: expected a folder or a .txt list, "
                               f"got {entry!r}")
                continue
            source = Path(os.path.abspath(os.path.join(root, entry)))
            samples += _images_of(source, key, path, line_of(key), problems)
        samples.sort(key=lambda s: str(s.image))
        if not samples and len(problems.errors) == errors_before:
            listed = ", ".join(map(str, entries))
            problems.error(path, line_of(key), f"{key}: no images in {listed}")
        sets[key] = samples

    return Dataset(
        path=path.absolute(),
        format="ultralytics",
        names=names,
        classes=classes,
        backup=None,
        train=sets["train"],
        valid=sets["val"],
        test=sets["test"],
        options=dict(data),
        problems=problems,
    )


def _load_yaml(path: Path) -> dict[str, Any]:
    try:
        import yaml
    except ImportError:  # pragma: no cover - PyYAML comes with the train and test extras
        raise DatasetError(
            "reading a dataset YAML needs PyYAML: pip install 'darknet-metal[train]'", path=path
        ) from None
    text = read_bytes(path, "dataset YAML").decode("utf-8", errors="replace")
    try:
        data = yaml.safe_load(text)
    except yaml.YAMLError as exc:
        mark = getattr(exc, "problem_mark", None)
        line = mark.line + 1 if mark is not None else None
        reason = getattr(exc, "problem", None) or str(exc)
        raise DatasetError(f"not valid YAML: {reason}", path=path, line=line) from None
    if not isinstance(data, dict):
        raise DatasetError(
            f"expected a mapping of keys (path, train, val, names), got {type(data).__name__}",
            path=path,
        )
    return {str(k): v for k, v in data.items()}


def _key_lines(path: Path) -> dict[str, int]:
    """The 1-based line of each top-level key, for messages."""
    import yaml

    text = read_bytes(path, "dataset YAML").decode("utf-8", errors="replace")
    node = yaml.compose(text, Loader=yaml.SafeLoader)
    lines: dict[str, int] = {}
    if isinstance(node, yaml.MappingNode):
        for key_node, _ in node.value:
            lines[str(key_node.value)] = key_node.start_mark.line + 1
    return lines


def _read_names(path: Path, data: dict[str, Any], line_of: Any, problems: Problems
                ) -> tuple[list[str], int]:
    raw_names = data.get("names")
    nc = data.get("nc")
    if nc is not None and (isinstance(nc, bool) or not isinstance(nc, int) or nc < 1):
        problems.error(path, line_of("nc"), f"nc: expected a positive integer, got {nc!r}")
        nc = None
    if raw_names is None:
        if nc is None:
            problems.error(path, None, "neither 'names' nor 'nc' is given: the number of "
                           "classes is unknown")
            return [], 0
        return [f"class_{i}" for i in range(nc)], nc
    if isinstance(raw_names, list):
        names = [str(n) for n in raw_names]
    elif isinstance(raw_names, dict):
        names = _names_from_mapping(raw_names, path, line_of("names"), problems)
    else:
        problems.error(path, line_of("names"), "names: expected a list or a mapping "
                       f"{{id: name}}, got {raw_names!r}")
        names = []
    if nc is not None and nc != len(names):
        problems.error(path, line_of("nc"), f"nc is {nc} but names has {len(names)} "
                       f"name{'s' if len(names) != 1 else ''}")
    if not names and nc is None:
        problems.error(path, line_of("names"), "names is empty: no classes")
    return names, len(names) if names else (nc or 0)


def _names_from_mapping(mapping: dict[Any, Any], path: Path, line: int | None,
                        problems: Problems) -> list[str]:
    by_id: dict[int, str] = {}
    for key, name in mapping.items():
        try:
            class_id = int(key)
        except (TypeError, ValueError):
            problems.error(path, line, f"names: key {key!r} is not a class id")
            continue
        by_id[class_id] = str(name)
    expected = set(range(len(by_id)))
    if set(by_id) != expected:
        problems.error(path, line, f"names: ids must be 0..{len(by_id) - 1}, got "
                       f"{sorted(by_id)}")
        return [by_id[k] for k in sorted(by_id)]
    return [by_id[i] for i in range(len(by_id))]


def _images_of(source: Path, key: str, yaml_path: Path, line: int | None,
               problems: Problems) -> list[Sample]:
    if source.is_dir():
        found = []
        for folder, _, files in os.walk(source):
            for name in files:
                if name.rpartition(".")[2].lower() in IMAGE_EXTENSIONS and "." in name:
                    image = Path(folder) / name
                    found.append(Sample(image, Path(yolo_label_path(str(image))), source))
        return found
    if source.is_file():
        try:
            return _images_of_list(source, problems)
        except DatasetError as exc:
            problems.error(yaml_path, line, f"{key}: {exc}")
            return []
    problems.error(yaml_path, line, f"{key}: {source} does not exist")
    return []


def _images_of_list(list_path: Path, problems: Problems) -> list[Sample]:
    samples = []
    parent = list_path.parent
    for number, raw in split_lines(read_bytes(list_path, "image list")):
        text = raw.strip()
        if not text:
            continue
        if text.startswith("./"):
            image = Path(os.path.abspath(os.path.join(parent, text)))
        else:
            image, _ = locate(text, parent)
        if text.rpartition(".")[2].lower() not in IMAGE_EXTENSIONS or "." not in text:
            problems.warning(list_path, number, f"not an image extension, skipped: {text}")
            continue
        samples.append(Sample(image, Path(yolo_label_path(str(image))), list_path, number))
    return samples
