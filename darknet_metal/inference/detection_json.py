"""Detections in the JSON layout of Darknet's ``-out result.json`` (``darknet detector test``)
and of its video example's per-frame output.

The file is a JSON array with one object per image or frame::

    {"frame_id": 1, "filename": "data/dog.jpg", "objects": [
        {"class_id": 16, "name": "dog",
         "relative_coordinates": {"center_x": 0.288, "center_y": 0.637,
                                  "width": 0.243, "height": 0.539},
         "confidence": 0.97}, ...]}

``frame_id`` counts from 1; ``filename`` is left out for video frames, as Darknet does.
``objects`` holds one entry per (box, class) above the threshold, boxes in their NMS order
and classes by id within a box; coordinates are the box's centre and size as fractions of
the image (null where not finite); classes whose name starts with ``dont_show`` are left
out.
"""

from __future__ import annotations

import json
import math
import os
from collections.abc import Iterable, Sequence
from typing import Any

from darknet_metal.files import atomic_write
from darknet_metal.inference.boxes import Detection, shown

__all__ = ["frame_entry", "write_detections_json"]


def frame_entry(frame_id: int, detections: Iterable[Detection], width: int, height: int,
                filename: str | None = None) -> dict[str, Any]:
    """The JSON object of one image (``filename`` given) or video frame: ``detections`` in
    pixels of a ``width`` x ``height`` image."""
    objects = []
    for d in shown(detections):
        objects.append({
            "class_id": d.class_id,
            "name": d.name,
            "relative_coordinates": {
                "center_x": _number((d.left + d.width / 2) / width),
                "center_y": _number((d.top + d.height / 2) / height),
                "width": _number(d.width / width),
                "height": _number(d.height / height),
            },
            "confidence": _number(d.confidence),
        })
    entry: dict[str, Any] = {"frame_id": frame_id}
    if filename is not None:
        entry["filename"] = filename
    entry["objects"] = objects
    return entry


def _number(value: float) -> float | None:
    # JSON has no infinity or NaN (an untrained network's box can overflow): null.
    return float(value) if math.isfinite(value) else None


def write_detections_json(path: str | os.PathLike[str], entries: Sequence[dict[str, Any]]
                          ) -> None:
    """Write ``entries`` (from ``frame_entry``) as the array Darknet writes, atomically."""
    text = json.dumps(list(entries), indent=1, allow_nan=False) + "\n"
    atomic_write(path, lambda f: f.write(text.encode()))
