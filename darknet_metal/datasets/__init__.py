"""Datasets: Darknet ``.data`` files, image lists, YOLO label files, the ultralytics dataset
YAML layout, the dataset check and the shapes demo set.

``load_dataset(path)`` gives a ``Dataset`` (``names``, ``classes``, ``backup``, ``train``,
``valid`` as lists of ``Sample(image, labels)``); ``read_boxes(sample)`` a sample's (k, 5)
boxes; ``check_dataset(dataset)`` a ``Report`` of every problem; ``make_shapes(out)`` writes
the demo set.

Owns: what a labelled dataset is on disk and whether it is sound. May import: ``errors``,
``files``, ``inference`` (image decoding); nothing of networks.
"""

from darknet_metal.datasets.check import Report, SetSummary, check_dataset
from darknet_metal.datasets.dataset import Dataset, Sample
from darknet_metal.datasets.labels import read_boxes
from darknet_metal.datasets.load import load_dataset
from darknet_metal.datasets.paths import (
    darknet_label_path,
    legacy_darknet_label_path,
    yolo_label_path,
)
from darknet_metal.datasets.problems import Problem
from darknet_metal.datasets.shapes import SHAPE_NAMES, make_shapes

__all__ = [
    "SHAPE_NAMES",
    "Dataset",
    "Problem",
    "Report",
    "Sample",
    "SetSummary",
    "check_dataset",
    "darknet_label_path",
    "legacy_darknet_label_path",
    "load_dataset",
    "make_shapes",
    "read_boxes",
    "yolo_label_path",
]
