"""What a dataset is: a :class:`Dataset` of :class:`Sample` (image, label file) pairs, and the
image lists and label-file rules both dataset formats share (``datasets.load`` reads
them)."""

from __future__ import annotations

import os
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Literal

import numpy as np

from darknet_metal.datasets.labels import read_boxes as _read_boxes
from darknet_metal.datasets.paths import darknet_label_path, legacy_darknet_label_path, locate
from darknet_metal.datasets.problems import Problems
from darknet_metal.datasets.textfile import read_lines

__all__ = ["Dataset", "Sample", "darknet_labels", "read_image_list"]

SetName = Literal["train", "valid", "test"]


@dataclass(frozen=True)
class Sample:
    """One image and its label file (absolute paths; the label file may not exist: no
    objects). ``source`` and ``line`` say where the image was listed (the list file, or the
    folder it was found in, and the 1-based line), for messages; they take no part in
    equality."""

    image: Path
    labels: Path
    source: Path | None = field(default=None, compare=False)
    line: int | None = field(default=None, compare=False)

    def where(self) -> str:
        """``list:line`` (or the image path when it was not listed in a file)."""
        if self.source is None:
            return str(self.image)
        return f"{self.source}:{self.line}" if self.line is not None else str(self.source)


@dataclass
class Dataset:
    """A dataset read from ``path``, a Darknet ``.data`` file (``format`` "darknet") or an
    ultralytics dataset YAML ("ultralytics").

    ``names`` (one per class) and ``classes`` (their number); ``backup``: the folder for
    checkpoints (``.data`` key ``backup``; None when not given); ``train``, ``valid``,
    ``test``: the samples of each set, in list order (``test`` only from a YAML layout);
    ``options``: every key of a ``.data`` file as read (the YAML's top-level keys);
    ``problems``: what was found wrong while reading (with ``strict=False``, errors too).
    """

    path: Path
    format: Literal["darknet", "ultralytics"]
    names: list[str]
    classes: int
    backup: Path | None
    train: list[Sample]
    valid: list[Sample]
    test: list[Sample] = field(default_factory=list)
    options: dict[str, object] = field(default_factory=dict)
    problems: Problems = field(default_factory=Problems)
    #: The valid set is the train set (a ``.data`` file without ``valid``, as Darknet does).
    valid_is_train: bool = False

    def sets(self) -> dict[SetName, list[Sample]]:
        """The non-empty sets by name (``valid`` left out when it is the train set)."""
        out: dict[SetName, list[Sample]] = {}
        if self.train:
            out["train"] = self.train
        if self.valid and not self.valid_is_train:
            out["valid"] = self.valid
        if self.test:
            out["test"] = self.test
        return out

    def read_boxes(self, sample: Sample) -> np.ndarray:
        """``read_boxes(sample)`` with class ids checked against ``classes``: (k, 5) float32
        rows (class, cx, cy, w, h); ``DatasetError`` at the first faulty line."""
        return _read_boxes(sample, self.classes)


def read_image_list(
    path: Path,
    problems: Problems,
    *,
    label_rule: Callable[[str, Path | None], Path],
) -> list[Sample]:
    """The samples of an image list file: one image path per line, as Darknet's
    ``get_paths`` reads it, except that spaces and tabs around a path are removed and blank
    lines skipped with a warning (Darknet takes them as file names). There is no comment
    syntax: a line starting with ``#`` is a file name, as in Darknet. Relative paths by
    :func:`~darknet_metal.datasets.paths.resolve` against the list's folder.

    ``label_rule(text, base)`` gives an image's label file from the path as written and
    the folder a relative one was found in (None for an absolute path).
    ``DatasetError`` when the list cannot be read; a list without any image is an error in
    ``problems``."""
    lines = read_lines(path, "image list")
    base_dir = path.parent
    samples = []
    for number, raw in lines:
        text = raw.strip(" \t")
        if not text:
            problems.warning(path, number, "blank line skipped (Darknet reads it as an image path)")
            continue
        image, base = locate(text, base_dir)
        samples.append(Sample(image, label_rule(text, base), path, number))
    if not samples:
        problems.error(path, None, "the image list has no images")
    return samples


def darknet_labels(text: str, base: Path | None) -> Path:
    """The label file Darknet reads for the image written ``text`` in a list (relative to
    ``base``): V5's rule, or the older Darknet's when only its file exists."""
    def absolute(label_text: str) -> Path:
        joined = label_text if base is None else os.path.join(base, label_text)
        return Path(os.path.abspath(joined))

    primary = absolute(darknet_label_path(text))
    if not primary.exists():
        legacy_text = legacy_darknet_label_path(text)
        if legacy_text is not None:
            legacy = absolute(legacy_text)
            if legacy != primary and legacy.exists():
                return legacy
    return primary
