"""Paths of the reference material in ../shared that tests read (never write)."""

import pathlib

SHARED = pathlib.Path(__file__).resolve().parents[2] / "shared"
MODELS = SHARED / "models"
IMAGES = SHARED / "images"
GOLDEN = SHARED / "golden" / "darknet-v5-cpu-yolov3-tiny"
YOLOV3_TINY = MODELS / "yolov3-tiny"
CFG_DIR = MODELS / "cfg"
