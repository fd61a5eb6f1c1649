"""Paths into ../shared for the GPU-backend tests."""

import pathlib

SHARED = pathlib.Path(__file__).resolve().parents[3] / "shared"
YOLOV3_TINY = SHARED / "models" / "yolov3-tiny"
CFG_DIR = SHARED / "models" / "cfg"
GOLDEN = SHARED / "golden" / "darknet-v5-cpu-yolov3-tiny"
IMAGES = SHARED / "images"
