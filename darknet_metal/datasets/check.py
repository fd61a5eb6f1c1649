"""Checking a whole dataset at once: :func:`check_dataset` behind ``darknet-metal check-data``.

Every image is opened and decoded with Pillow (a JPEG at 1/8 scale: the whole compressed
stream is still read, so a truncated file is found, at a fraction of the cost), every label
file parsed with the image's size at hand. Images are checked on threads (Pillow decodes
without the GIL); the report is in list order whatever the threads' timing.
"""

from __future__ import annotations

import sys
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np

from darknet_metal.datasets.dataset import Dataset, Sample
from darknet_metal.datasets.labels import parse_labels
from darknet_metal.datasets.problems import Problem, Problems, raise_first_error
from darknet_metal.image_errors import decode_failure

__all__ = ["Report", "SetSummary", "check_dataset", "check_image"]

# EXIF orientations that swap width and height (transposed and rotated by 90 or 270 degrees).
_SWAPPING_ORIENTATIONS = frozenset({5, 6, 7, 8})
_EXIF_ORIENTATION = 0x0112


@dataclass
class SetSummary:
    """Counts for one set: ``images`` listed, ``boxes`` read (valid lines only), per class
    ``boxes_per_class`` (length ``classes``), images with no label file, and images whose
    label file holds no box."""

    images: int = 0
    boxes: int = 0
    boxes_per_class: list[int] = field(default_factory=list)
    missing_labels: int = 0
    without_boxes: int = 0

    def to_dict(self) -> dict[str, object]:
        """JSON-ready counts (boxes per class as a list indexed by class id)."""
        return {
            "images": self.images,
            "boxes": self.boxes,
            "boxes_per_class": list(self.boxes_per_class),
            "missing_labels": self.missing_labels,
            "without_boxes": self.without_boxes,
        }


@dataclass
class Report:
    """What ``check_dataset`` found: every ``problems`` entry (errors and warnings, load-time
    ones first, then in list order) and a ``SetSummary`` per set."""

    dataset: Path
    format: str
    names: list[str]
    problems: list[Problem]
    sets: dict[str, SetSummary]

    @property
    def errors(self) -> list[Problem]:
        """The problems that make the dataset unusable as it is."""
        return [p for p in self.problems if p.severity == "error"]

    @property
    def warnings(self) -> list[Problem]:
        """The problems that do not stop training."""
        return [p for p in self.problems if p.severity == "warning"]

    @property
    def ok(self) -> bool:
        """True when there is no error (warnings allowed)."""
        return not self.errors

    def raise_for_errors(self) -> None:
        """Raise ``DatasetError`` for the first error (saying how many more), if any."""
        raise_first_error(self.problems)

    def to_dict(self) -> dict[str, object]:
        """The report as JSON-ready values."""
        return {
            "dataset": str(self.dataset),
            "format": self.format,
            "classes": len(self.names),
            "names": list(self.names),
            "ok": self.ok,
            "errors": len(self.errors),
            "warnings": len(self.warnings),
            "problems": [p.to_dict() for p in self.problems],
            "sets": {name: s.to_dict() for name, s in self.sets.items()},
        }

    def lines(self) -> Iterator[str]:
        """The report as text: one line per problem, then the summary."""
        for p in self.problems:
            yield f"{p.severity}: {p}"
        yield f"dataset: {self.dataset} ({self.format}, {len(self.names)} classes)"
        for name, s in self.sets.items():
            per_class = ", ".join(
                f"{_name(self.names, i)} {n}" for i, n in enumerate(s.boxes_per_class)
            )
            yield (
                f"{name}: {s.images} images, {s.boxes} boxes ({per_class}); "
                f"{s.missing_labels} without a label file, {s.without_boxes} without boxes"
            )
        n_err, n_warn = len(self.errors), len(self.warnings)
        yield f"{_count(n_err, 'error')}, {_count(n_warn, 'warning')}"


@dataclass
class _SampleResult:
    problems: Problems
    boxes: np.ndarray | None  # None: no label file


def check_image(path: Path) -> tuple[tuple[int, int] | None, str | None]:
    """``((width, height), None)`` for an image Pillow decodes whole, the size as Darknet sees
    it (EXIF rotation applied); ``(None, reason)`` for a missing, unreadable, truncated or
    corrupt file."""
    from PIL import Image

    if not path.exists():
        return None, "image not found"
    if not path.is_file():
        return None, "not a regular file"
    try:
        with Image.open(path) as im:
            width, height = im.size
            orientation = im.getexif().get(_EXIF_ORIENTATION)
            if im.format == "JPEG":
                im.draft(None, (max(1, width // 8), max(1, height // 8)))
            im.load()
    except Image.DecompressionBombError as exc:
        return None, f"image too large to decode safely ({exc})"
    except Exception as exc:  # Pillow raises many types for corrupt data
        return None, f"cannot decode image ({decode_failure(exc)})"
    if orientation in _SWAPPING_ORIENTATIONS:
        width, height = height, width
    if width == 0 or height == 0:
        return None, f"the image is empty ({width}x{height})"
    return (width, height), None


def _check_sample(sample: Sample, classes: int) -> _SampleResult:
    problems = Problems()
    size, reason = check_image(sample.image)
    if reason is not None:
        problems.error(sample.where(), None, f"{reason}: {sample.image}")
    try:
        data = sample.labels.read_bytes()
    except FileNotFoundError:
        problems.warning(sample.where(), None, f"no label file {sample.labels}: read as an "
                         "image without objects")
        return _SampleResult(problems, None)
    except OSError as exc:
        problems.error(sample.labels, None, f"cannot read label file: {exc.strerror or exc}")
        return _SampleResult(problems, None)
    boxes = parse_labels(data, sample.labels, problems, classes=classes, image_size=size)
    return _SampleResult(problems, boxes)


def check_dataset(
    dataset: Dataset, *, workers: int = 8, progress: bool = False
) -> Report:
    """Check every image and label file of ``dataset`` and report every problem at once.

    Errors: problems found while loading (``Dataset.problems``), missing, unreadable or
    truncated images, malformed label lines, class ids out of range, boxes beyond the image
    or of zero or negative size. Warnings: images without a label file (read as having no
    objects), an image listed twice in a set or in both train and valid, boxes under one
    pixel, repeated boxes. ``workers`` threads decode images; ``progress`` shows a bar on
    stderr. Returns a ``Report``; nothing is raised for a faulty dataset (see
    ``Report.raise_for_errors``).
    """
    problems = Problems()
    problems.extend(dataset.problems)
    sets = dataset.sets()
    unique: dict[Path, Sample] = {}
    for samples in sets.values():
        for sample in samples:
            unique.setdefault(sample.image, sample)

    results = _run_checks(list(unique.values()), dataset.classes, workers, progress)

    summaries: dict[str, SetSummary] = {}
    reported: set[Path] = set()
    first_in_set: dict[str, dict[Path, Sample]] = {}
    for set_name, samples in sets.items():
        summary = SetSummary(boxes_per_class=[0] * dataset.classes)
        firsts = first_in_set.setdefault(set_name, {})
        for sample in samples:
            summary.images += 1
            if sample.image in firsts:
                problems.warning(sample.where(), None, f"image listed again in {set_name} "
                                 f"(first at {firsts[sample.image].where()}): {sample.image}")
            else:
                firsts[sample.image] = sample
                if set_name == "valid" and sample.image in first_in_set.get("train", {}):
                    problems.warning(sample.where(), None, "image also in train (at "
                                     f"{first_in_set['train'][sample.image].where()}): "
                                     f"{sample.image}")
            result = results[sample.image]
            if sample.image not in reported:
                reported.add(sample.image)
                problems.extend(result.problems)
            if result.boxes is None:
                summary.missing_labels += 1
                continue
            summary.boxes += len(result.boxes)
            if len(result.boxes) == 0:
                summary.without_boxes += 1
            ids = result.boxes[:, 0].astype(np.int64)
            for class_id in ids[(ids >= 0) & (ids < dataset.classes)]:
                summary.boxes_per_class[class_id] += 1
        summaries[set_name] = summary
    return Report(dataset.path, dataset.format, list(dataset.names), list(problems), summaries)


def _run_checks(
    samples: list[Sample], classes: int, workers: int, progress: bool
) -> dict[Path, _SampleResult]:
    from tqdm import tqdm

    workers = max(1, min(workers, len(samples) or 1))
    with tqdm(total=len(samples), desc="checking images", unit="img", file=sys.stderr,
              disable=not progress, leave=False) as bar:
        results = {}
        if workers == 1:
            for sample in samples:
                results[sample.image] = _check_sample(sample, classes)
                bar.update()
            return results
        with ThreadPoolExecutor(max_workers=workers) as pool:
            for sample, result in zip(
                samples, pool.map(lambda s: _check_sample(s, classes), samples), strict=True
            ):
                results[sample.image] = result
                bar.update()
    return results


def _count(n: int, noun: str) -> str:
    return f"{n} {noun}{'s' if n != 1 else ''}"


def _name(names: list[str], index: int) -> str:
    return names[index] if index < len(names) and names[index] else str(index)
