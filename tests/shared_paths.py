"""Paths of the repository and of the reference material in ../shared that tests read (never
write). Tests find files through these names, not through their own ``__file__``: a test's
depth under tests/ is not part of what it means."""

import pathlib

ROOT = pathlib.Path(__file__).resolve().parents[1]  # the repository
SHARED = ROOT.parent / "shared"
MODELS = SHARED / "models"
IMAGES = SHARED / "images"
GOLDEN = SHARED / "golden" / "darknet-v5-cpu-yolov3-tiny"
YOLOV3_TINY = MODELS / "yolov3-tiny"
CFG_DIR = MODELS / "cfg"
