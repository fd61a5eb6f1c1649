"""``random=1`` multi-scale training: Darknet's choice of the next input size.

Darknet's ``train_detector`` (detector.cpp), with ``random`` taken from the last ``[yolo]``
layer: on the first iteration of a run and every 10 iterations after it, a factor
``f = rand_scale(coef)`` (uniform in [1, coef), or its reciprocal, each half the time;
``coef`` = 1.4 for ``random=1``, else the value of ``random``) gives

    size = round(f * initial / resize_step + 1) * resize_step

(round half away from zero), for width and height with the same factor. A shrinking factor
that rounds above the initial size gives the initial size; the run's first resize and every
resize in the last 100 iterations (``iteration > max_batches - 100``) use the largest size,
``round(coef * initial / resize_step + 1) * resize_step``, so that a memory shortage shows
at once and the final batch-norm statistics are gathered at full size; a size below
``resize_step`` becomes ``resize_step``.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from typing import Any

import numpy as np

from darknet_metal.errors import ArgumentError

from .draws import STREAM_SIZE, check_seed, rand_scale, stream
from .settings import LoaderSettings

__all__ = ["RESIZE_EVERY", "random_size"]

#: Darknet picks a new size every this many iterations.
RESIZE_EVERY = 10
_F32 = np.float32


def _round_away(value: float) -> int:
    """C's ``roundl``: halves away from zero."""
    return int(math.floor(abs(value) + 0.5)) * (1 if value >= 0 else -1)


def _value(values: LoaderSettings | Mapping[str, Any], name: str, default: Any) -> Any:
    if isinstance(values, LoaderSettings):
        return getattr(values, name)
    return values.get(name, default)


def random_size(
    iteration: int,
    values: LoaderSettings | Mapping[str, Any],
    max_batches: int,
    rng: np.random.Generator | int,
    *,
    start_iteration: int = 0,
) -> tuple[int, int] | None:
    """The input size to train iteration ``iteration`` at, or None to keep the current one.

    ``values``: :class:`LoaderSettings`, or a mapping with ``width``, ``height`` (the cfg's
    initial size), ``random`` (the last ``[yolo]`` layer's) and ``resize_step``
    (``[net]``, default 32). ``iteration``: the number of iterations done before this one
    (``Network.iteration``); ``start_iteration``: the iteration the run started (or resumed)
    at, where Darknet's count of ten begins. ``rng``: a generator to draw from, or an int
    seed (the draw then comes from a generator of (seed, iteration) alone, so a resumed run
    picks the same sizes). Returns (width, height) in pixels, or None when ``random`` is 0
    or this iteration is not a multiple of 10 after ``start_iteration``.
    """
    random = float(_value(values, "random", 0.0))
    if not random:
        return None
    if iteration < start_iteration:
        raise ArgumentError(
            f"iteration={iteration} is before start_iteration={start_iteration}"
        )
    if (iteration - start_iteration) % RESIZE_EVERY:
        return None
    if isinstance(rng, int | np.integer):
        rng = stream(check_seed(rng), STREAM_SIZE, iteration)
    init_w = int(_value(values, "width", 0))
    init_h = int(_value(values, "height", 0))
    step = _F32(_value(values, "resize_step", 32.0))
    coef = _F32(1.4) if random == 1.0 else _F32(random)

    factor = rand_scale(rng, coef)

    def scaled(f: np.float32, initial: int) -> int:
        # (float) f * initial / step + 1, rounded as long double, times the step, to int.
        return int(_round_away(float(f * _F32(initial) / step + _F32(1))) * float(step))

    dim_w, dim_h = scaled(factor, init_w), scaled(factor, init_h)
    if factor < 1 and (dim_w > init_w or dim_h > init_h):
        dim_w, dim_h = init_w, init_h
    if iteration == start_iteration or iteration > max_batches - 100:
        dim_w, dim_h = scaled(coef, init_w), scaled(coef, init_h)
    if dim_w < step:
        dim_w = int(step)
    if dim_h < step:
        dim_h = int(step)
    return dim_w, dim_h
