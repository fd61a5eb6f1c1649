"""One training batch, as a pure function of (samples, settings, seed, iteration, size).

Which images a batch holds (Darknet's ``get_random_paths``): every image slot draws its
image uniformly, with replacement, from the whole list (``sampling="random"``, Darknet's
rule), or takes the next image of a seeded permutation of the list, a new one each epoch
(``sampling="epoch"``: every image once per epoch). A mosaic's or blend's other images are
always drawn at random, as in Darknet. All draws of a slot come from its own generator
(:mod:`darknet_metal.training.loading.draws`), so a batch does not depend on who computes it.
"""

from __future__ import annotations

import os
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, field
from functools import lru_cache
from typing import Any, Literal

import numpy as np

from darknet_metal.errors import ArgumentError

from .augment import augment_pixels, capped_blur, check_boxes, draw_image, place, transform_truths
from .draws import STREAM_EPOCH, STREAM_IMAGE, rand_bool, stream
from .images import read_image
from .mosaic import blend_truths, draw_cut, mosaic_truths, paste_piece, shifts
from .settings import MIXUP_BLEND, MIXUP_MOSAIC, LoaderSettings

__all__ = ["Batch", "SampleSource", "Sampling", "load_batch", "load_slot"]

Sampling = Literal["random", "epoch"]
SAMPLINGS: tuple[str, ...] = ("random", "epoch")

# OpenCV's 8-bit to float conversion with scale 1/255 multiplies in float32.
_INV_255 = np.float32(1.0 / 255.0)


def _to_unit(pixels: np.ndarray, out: np.ndarray) -> None:
    """uint8 (H, W, C) -> float32 (C, H, W) in [0, 1], into ``out``."""
    np.multiply(pixels.transpose(2, 0, 1), _INV_255, out=out, dtype=np.float32)


@dataclass
class Batch:
    """One iteration's batch. ``x``: float32 (batch, C, H, W), RGB planar in [0, 1];
    ``truths``: per image a float32 (k, 5) array (class, cx, cy, w, h) normalised to the
    network input, at most ``max_boxes`` rows; ``images``: per image the index in the
    sample list of its (first) image. Unpacks as ``x, truths = batch``."""

    x: np.ndarray
    truths: list[np.ndarray]
    iteration: int
    width: int
    height: int
    images: list[int] = field(default_factory=list)

    def __iter__(self) -> Iterator[Any]:
        return iter((self.x, self.truths))


class SampleSource:
    """The training samples: a sequence of ``(image_path, boxes)`` pairs, or any sequence
    of samples with ``boxes(sample) -> (k, 5) array`` (then a sample is an image path, a
    pair whose first item is one, or an object with an ``image`` attribute, e.g. a dataset
    ``Sample``). Boxes are rows (class, cx, cy, w, h) normalised to the image; the callable
    is called each time the image is loaded (Darknet reads label files each time too)."""

    def __init__(
        self,
        samples: Sequence[Any],
        boxes: Callable[[Any], np.ndarray] | None = None,
        classes: int | None = None,
    ) -> None:
        if isinstance(samples, str | bytes) or not isinstance(samples, Sequence):
            raise ArgumentError(
                f"samples must be a sequence of (image_path, boxes) pairs or of samples, "
                f"not {type(samples).__name__}"
            )
        if len(samples) == 0:
            raise ArgumentError("samples is empty: there is no image to train on")
        if boxes is not None and not callable(boxes):
            raise ArgumentError(f"boxes must be callable (sample -> (k, 5) array), not {boxes!r}")
        self.samples = samples
        self.boxes_of = boxes
        self.classes = classes

    def __len__(self) -> int:
        return len(self.samples)

    def path(self, index: int) -> str:
        """The image path of sample ``index``."""
        sample = self.samples[index]
        if hasattr(sample, "image"):
            sample = sample.image
        elif isinstance(sample, tuple | list):
            sample = sample[0]
        try:
            return os.fspath(sample)
        except TypeError:
            raise ArgumentError(
                f"sample {index} ({sample!r}) has no image path: expected (image_path, boxes) "
                "pairs, paths, or samples with an 'image' attribute"
            ) from None

    def boxes(self, index: int) -> np.ndarray:
        """The validated (k, 5) float32 boxes of sample ``index`` (see ``check_boxes``)."""
        sample = self.samples[index]
        if self.boxes_of is not None:
            raw = self.boxes_of(sample)
        elif isinstance(sample, tuple | list) and len(sample) == 2:
            raw = sample[1]
        else:
            raise ArgumentError(
                f"sample {index} ({sample!r}) is not an (image_path, boxes) pair; pass "
                "boxes=callable to read the boxes of such samples"
            )
        return check_boxes(raw, self.path(index), self.classes)


@lru_cache(maxsize=8)
def _epoch_order(seed: int, epoch: int, count: int) -> np.ndarray:
    order = stream(seed, STREAM_EPOCH, epoch).permutation(count)
    order.setflags(write=False)
    return order


def _first_index(
    sampling: str, count: int, seed: int, iteration: int, slot: int, batch: int,
    rng: np.random.Generator,
) -> int:
    if sampling == "epoch":
        position = iteration * batch + slot
        return int(_epoch_order(seed, position // count, count)[position % count])
    return int(rng.integers(0, count))


def _load_piece(
    source: SampleSource, index: int, settings: LoaderSettings, rng: np.random.Generator,
    net_w: int, net_h: int, piece: int | None,
) -> tuple[np.ndarray, np.ndarray, Any, Any]:
    """One augmented image: uint8 (h, w, C), its truths, its draws and its placement."""
    path = source.path(index)
    boxes = source.boxes(index)
    rgb = read_image(path, settings.channels)
    draws = draw_image(rng, settings, mosaic=piece is not None)
    oh, ow = rgb.shape[:2]
    placement = place(ow, oh, settings, draws, net_w=net_w, net_h=net_h, piece=piece)
    truths, min_w_h = transform_truths(
        boxes, placement, flip=draws.flip, net_w=net_w, net_h=net_h,
        max_boxes=settings.max_boxes, rng=rng,
    )
    blur = capped_blur(draws.blur, min_w_h)
    pixels = augment_pixels(
        rgb, placement, draws, truths, blur, net_w=net_w, net_h=net_h, rng=rng
    )
    return pixels, truths, draws, placement


def load_slot(
    source: SampleSource,
    settings: LoaderSettings,
    seed: int,
    iteration: int,
    slot: int,
    *,
    width: int,
    height: int,
    sampling: str = "random",
    out: np.ndarray | None = None,
) -> tuple[np.ndarray, np.ndarray, int]:
    """Image ``slot`` of batch ``iteration`` at ``width`` x ``height``.

    Returns float32 (C, height, width) in [0, 1] (written into ``out`` when given), its
    truths (k, 5) and the index of its (first) sample. Depends only on the arguments.
    """
    rng = stream(seed, STREAM_IMAGE, iteration, slot)
    count = len(source)
    mixup = settings.mixup
    # Darknet turns mosaic / blend off for half of its loads.
    if mixup and rand_bool(rng):
        mixup = 0
    first = _first_index(sampling, count, seed, iteration, slot, settings.batch, rng)
    if out is None:
        out = np.empty((settings.channels, height, width), np.float32)

    if mixup == MIXUP_MOSAIC:
        cut_x, cut_y = draw_cut(rng, width, height)
        canvas = np.zeros((height, width, settings.channels), np.uint8)
        truths = np.zeros((0, 5), np.float32)
        for piece in range(4):
            index = first if piece == 0 else int(rng.integers(0, count))
            pixels, piece_truths, draws, placement = _load_piece(
                source, index, settings, rng, width, height, piece
            )
            cut = shifts(cut_x, cut_y, placement, draws.flip, width, height)
            paste_piece(canvas, pixels, piece, cut)
            truths = mosaic_truths(
                truths, piece_truths, piece, cut, net_w=width, net_h=height,
                max_boxes=settings.max_boxes, mosaic_bound=bool(settings.mosaic_bound),
            )
        _to_unit(canvas, out)
        return out, truths, first

    pixels, truths, _, _ = _load_piece(source, first, settings, rng, width, height, None)
    _to_unit(pixels, out)
    if mixup == MIXUP_BLEND:
        second = int(rng.integers(0, count))
        pixels2, truths2, _, _ = _load_piece(source, second, settings, rng, width, height, None)
        second_x = np.empty_like(out)
        _to_unit(pixels2, second_x)
        half = np.float32(0.5)
        out *= half
        second_x *= half
        out += second_x
        truths = blend_truths(truths, truths2, settings.max_boxes)
    return out, truths, first


def load_batch(
    source: SampleSource,
    settings: LoaderSettings,
    seed: int,
    iteration: int,
    *,
    width: int | None = None,
    height: int | None = None,
    sampling: str = "random",
    slots: range | None = None,
) -> Batch:
    """Batch ``iteration`` (``settings.batch`` images; with ``slots``, only those rows of
    it, as a process training on a share of each batch loads) made in the calling thread;
    the loader's workers produce exactly this, image by image."""
    width = settings.width if width is None else width
    height = settings.height if height is None else height
    slots = range(settings.batch) if slots is None else slots
    x = np.empty((len(slots), settings.channels, height, width), np.float32)
    truths: list[np.ndarray] = []
    images: list[int] = []
    for row, slot in enumerate(slots):
        _, slot_truths, index = load_slot(
            source, settings, seed, iteration, slot, width=width, height=height,
            sampling=sampling, out=x[row],
        )
        truths.append(slot_truths)
        images.append(index)
    return Batch(x, truths, iteration, width, height, images)
