"""The dataset API's entry: :func:`load_dataset` reads a Darknet ``.data`` file or an
ultralytics dataset ``.yaml`` into a ``Dataset``."""

from __future__ import annotations

import os
from pathlib import Path

from darknet_metal.datasets.datafile import load_data_file
from darknet_metal.datasets.dataset import Dataset
from darknet_metal.datasets.problems import raise_first_error
from darknet_metal.datasets.yaml_layout import load_yaml_dataset

__all__ = ["load_dataset"]


def load_dataset(path: str | os.PathLike[str], *, strict: bool = True) -> Dataset:
    """Read a dataset: a Darknet ``.data`` file, or an ultralytics dataset ``.yaml``/``.yml``.

    Reads the dataset file, the names file and the image lists (or lists the image
    folders) and finds each image's label file; it opens no image and no label file (see
    ``Dataset.read_boxes`` and ``check_dataset``). With ``strict`` (the default) the first
    error found raises ``DatasetError`` naming the file and line; with ``strict=False``
    errors are kept in ``Dataset.problems`` with the warnings and the dataset is built from
    what could be read. A dataset file that is missing or unreadable always raises.
    """
    p = Path(path)
    suffix = p.suffix.lower()
    if suffix in (".yaml", ".yml"):
        dataset = load_yaml_dataset(p)
    else:
        dataset = load_data_file(p)
    if strict:
        raise_first_error(dataset.problems)
    return dataset
