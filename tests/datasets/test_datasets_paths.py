"""Label-file rules against Darknet's ``replace_image_to_label`` (both versions) and
ultralytics' ``img2label_paths``, and the relative-path rule.

Each rule is checked twice: against a table of hand-worked cases, and against a literal
Python transcription of the original function (the C of Darknet's ``src-lib/utils.cpp``,
the Python of ``ultralytics/data/utils.py``) over many generated paths.
"""

from __future__ import annotations

import itertools
import os

import pytest

from darknet_metal.datasets.paths import (
    darknet_label_path,
    legacy_darknet_label_path,
    locate,
    resolve,
    yolo_label_path,
)

# --- transcriptions of the originals ------------------------------------------------------


def darknet_v5_replace_image_to_label(input_path: str) -> str:
    """Darknet V5, src-lib/utils.cpp replace_image_to_label (since commit 6bf8a238):
    strcpy; ptr = strrchr(output, '.'); if (ptr) *ptr = '\\0'; strcat(output, ".txt")."""
    ptr = input_path.rfind(".")
    out = input_path[:ptr] if ptr >= 0 else input_path
    return out + ".txt"


def _c_find_replace(s: str, orig: str, rep: str) -> str:
    # utils.cpp find_replace: strstr (first occurrence), replaced once.
    p = s.find(orig)
    return s if p < 0 else s[:p] + rep + s[p + len(orig):]


def _c_find_replace_extension(s: str, orig: str, rep: str) -> str:
    # utils.cpp find_replace_extension: strstr, and only when that occurrence ends the string.
    p = s.find(orig)
    if p < 0 or len(s) - p != len(orig):
        return s
    return s[:p] + rep + s[p + len(orig):]


def darknet_legacy_replace_image_to_label(input_path: str) -> str:
    """replace_image_to_label as it was before commit 6bf8a238 (src-lib/utils.cpp)."""
    out = _c_find_replace(input_path, "/images/train2017/", "/labels/train2017/")
    out = _c_find_replace(out, "/images/val2017/", "/labels/val2017/")
    out = _c_find_replace(out, "/JPEGImages/", "/labels/")
    out = _c_find_replace(out, "\\images\\train2017\\", "\\labels\\train2017\\")
    out = _c_find_replace(out, "\\images\\val2017\\", "\\labels\\val2017\\")
    out = _c_find_replace(out, "\\images\\train2014\\", "\\labels\\train2014\\")
    out = _c_find_replace(out, "\\images\\val2014\\", "\\labels\\val2014\\")
    out = _c_find_replace(out, "/images/train2014/", "/labels/train2014/")
    out = _c_find_replace(out, "/images/val2014/", "/labels/val2014/")
    out = _c_find_replace(out, "\\JPEGImages\\", "\\labels\\")
    # trim(): spaces and tabs at both ends
    out = out.lstrip(" \t").rstrip(" \t")
    for ext in (".jpg", ".JPG", ".jpeg", ".JPEG", ".png", ".PNG", ".bmp", ".BMP", ".ppm",
                ".PPM", ".tiff", ".TIFF"):
        out = _c_find_replace_extension(out, ext, ".txt")
    return out


def ultralytics_img2label_paths(img_paths: list[str]) -> list[str]:
    """ultralytics/data/utils.py img2label_paths, verbatim in logic."""
    sa, sb = f"{os.sep}images{os.sep}", f"{os.sep}labels{os.sep}"
    return [sb.join(x.rsplit(sa, 1)).rsplit(".", 1)[0] + ".txt" for x in img_paths]


def _generated_paths() -> list[str]:
    folders = ["", "data/", "/abs/", "./rel/", "/d/images/", "/d/images/train2017/",
               "/d/images/val2014/", "VOC/JPEGImages/", "a/images/x/images/", "my.data/",
               "C:\\d\\JPEGImages\\", "\\\\srv\\images\\train2014\\", " lead/"]
    names = ["a.jpg", "b.JPG", "c.jpeg", "d.JPEG", "e.png", "f.PNG", "g.bmp", "h.BMP",
             "i.ppm", "j.tiff", "k.TIFF", "l.webp", "m.tif", "n.Jpg", "o.jpg.jpg",
             "p.q.png", "r.png.jpg", "s.jpg ", ".jpg", "t"]
    return [f + n for f, n in itertools.product(folders, names)]


# --- Darknet V5 ---------------------------------------------------------------------------

V5_TABLE = [
    ("data/obj/img1.jpg", "data/obj/img1.txt"),
    ("/x/images/train2017/a.jpg", "/x/images/train2017/a.txt"),  # no folder substitution
    ("VOC/JPEGImages/000005.jpg", "VOC/JPEGImages/000005.txt"),
    ("a.b.c.png", "a.b.c.txt"),  # only the last extension
    ("img.JPG", "img.txt"),
    ("img.webp", "img.txt"),  # any extension
    ("img.Jpg", "img.txt"),
    ("noext", "noext.txt"),
    ("./data/x.jpg", "./data/x.txt"),
]


@pytest.mark.parametrize(("image", "label"), V5_TABLE)
def test_v5_rule_table(image, label):
    assert darknet_label_path(image) == label


def test_v5_rule_matches_darknet_wherever_the_file_name_has_a_dot():
    for image in _generated_paths():
        name = image.replace("\\", "/").rsplit("/", 1)[-1]
        if "." in name:
            assert darknet_label_path(image) == darknet_v5_replace_image_to_label(image), image


def test_v5_rule_differs_only_for_a_dotless_name_in_a_dotted_folder():
    # Darknet cuts at the last '.' of the whole path: my.data/t -> my.txt. Here the file name.
    assert darknet_v5_replace_image_to_label("my.data/t") == "my.txt"
    assert darknet_label_path("my.data/t") == "my.data/t.txt"
    assert darknet_label_path("./t") == "./t.txt"  # Darknet: ".txt"


# --- Darknet before V5 --------------------------------------------------------------------

LEGACY_TABLE = [
    ("/data/coco/images/train2017/0001.jpg", "/data/coco/labels/train2017/0001.txt"),
    ("/data/coco/images/val2014/0001.JPEG", "/data/coco/labels/val2014/0001.txt"),
    ("VOCdevkit/VOC2007/JPEGImages/000005.jpg", "VOCdevkit/VOC2007/labels/000005.txt"),
    ("C:\\d\\JPEGImages\\a.png", "C:\\d\\labels\\a.txt"),
    ("/x/images/a.jpg", "/x/images/a.txt"),  # '/images/' alone is not substituted
    ("/images/train2017/images/train2017/a.jpg", "/labels/train2017/images/train2017/a.txt"),
    (" a.bmp \t", "a.txt"),  # trimmed before the extension
    ("a.tiff", "a.txt"),
    ("a.jpg.jpg", None),  # the first '.jpg' does not end the path: left alone
    ("a.Jpg", None),
    ("a.tif", None),
    ("a.webp", None),
]


@pytest.mark.parametrize(("image", "label"), LEGACY_TABLE)
def test_legacy_rule_table(image, label):
    assert legacy_darknet_label_path(image) == label


def test_legacy_rule_matches_the_old_darknet():
    for image in _generated_paths():
        old = darknet_legacy_replace_image_to_label(image)
        expected = old if len(old) > 4 and old.endswith(".txt") else None
        assert legacy_darknet_label_path(image) == expected, image


# --- ultralytics --------------------------------------------------------------------------

YOLO_TABLE = [
    ("/d/images/train/a.jpg", "/d/labels/train/a.txt"),
    ("/d/images/x/images/b.png", "/d/images/x/labels/b.txt"),  # the last /images/
    ("/d/imgs/a.jpg", "/d/imgs/a.txt"),
    ("/d/images/a.b.jpeg", "/d/labels/a.b.txt"),
]


@pytest.mark.parametrize(("image", "label"), YOLO_TABLE)
def test_yolo_rule_table(image, label):
    assert yolo_label_path(image) == label


def test_yolo_rule_matches_ultralytics():
    paths = [p for p in _generated_paths() if "\\" not in p]
    assert [yolo_label_path(p) for p in paths] == ultralytics_img2label_paths(paths)


# --- relative paths -----------------------------------------------------------------------


def test_resolve_prefers_the_working_directory_then_the_file_folder(tmp_path, monkeypatch):
    work, data = tmp_path / "work", tmp_path / "data"
    work.mkdir()
    data.mkdir()
    (data / "only_beside.txt").write_text("x")
    (data / "both.txt").write_text("x")
    (work / "both.txt").write_text("x")
    monkeypatch.chdir(work)
    assert resolve("both.txt", data) == work / "both.txt"  # Darknet's rule first
    assert resolve("only_beside.txt", data) == data / "only_beside.txt"
    assert locate("only_beside.txt", data) == (data / "only_beside.txt", data)
    # Missing everywhere: where Darknet would look, so the message names that path.
    assert resolve("missing.txt", data) == work / "missing.txt"
    assert resolve(str(data / "both.txt"), work) == data / "both.txt"
    assert locate(str(data / "both.txt"), work) == (data / "both.txt", None)
