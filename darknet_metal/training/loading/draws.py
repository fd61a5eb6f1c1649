"""Random draws: one generator per image, and Darknet's random helpers in float32.

Darknet draws every augmentation from one ``std::mt19937`` per loading thread, seeded by the
OS, so its batches depend on the number of threads and cannot be reproduced. Here each image
slot of each iteration has its own generator, seeded by (seed, iteration, slot): a seed gives
the same batches whatever the number of workers and whichever worker runs which image.
The helpers keep the distributions of Darknet's ``utils.cpp`` (``rand_uniform``,
``rand_scale``, ``rand_int``, ``rand_bool``, ``rand_precalc_random``), computed in float32.
"""

from __future__ import annotations

import numpy as np

from darknet_metal.errors import ArgumentError

__all__ = [
    "check_seed",
    "rand_bool",
    "rand_float",
    "rand_int",
    "rand_precalc_random",
    "rand_scale",
    "rand_uniform",
    "stream",
]

# Distinct streams for the different users of one (seed, iteration): image slots, the
# random input size, the epoch permutations.
STREAM_IMAGE = 0x494D47
STREAM_SIZE = 0x53495A
STREAM_EPOCH = 0x45504F


def check_seed(seed: object) -> int:
    """``seed`` as a non-negative int; ``ArgumentError`` otherwise."""
    if isinstance(seed, bool) or not isinstance(seed, int | np.integer) or seed < 0:
        raise ArgumentError(f"seed must be a non-negative integer, not {seed!r}")
    return int(seed)


def stream(seed: int, kind: int, *keys: int) -> np.random.Generator:
    """A generator that depends only on (seed, kind, keys): PCG64 from a SeedSequence."""
    return np.random.Generator(np.random.PCG64(np.random.SeedSequence([seed, kind, *keys])))


def rand_float(rng: np.random.Generator) -> np.float32:
    """Uniform float32 in [0, 1) (Darknet's ``rand_float``)."""
    return rng.random(dtype=np.float32)


def rand_uniform(rng: np.random.Generator, low: float, high: float) -> np.float32:
    """Uniform float32 in [low, high), bounds swapped if reversed (``rand_uniform``)."""
    low32, high32 = np.float32(low), np.float32(high)
    if high32 < low32:
        low32, high32 = high32, low32
    return (high32 - low32) * rand_float(rng) + low32


def rand_bool(rng: np.random.Generator) -> bool:
    """True or False, each with probability 1/2 (``rand_bool``)."""
    return bool(rng.integers(0, 2) == 0)


def rand_int(rng: np.random.Generator, low: int, high: int) -> int:
    """Uniform integer in [low, high], both included, swapped if reversed (``rand_int``)."""
    if high < low:
        low, high = high, low
    return int(rng.integers(low, high, endpoint=True))


def rand_scale(rng: np.random.Generator, s: float) -> np.float32:
    """A factor in [1, s) or its reciprocal, each half the time (``rand_scale``)."""
    scale = rand_uniform(rng, 1.0, s)
    if rand_bool(rng):
        scale = np.float32(1.0) / scale
    return scale


def rand_precalc_random(low: float, high: float, random_part: np.float32) -> np.float32:
    """``random_part * (high - low) + low`` in float32, bounds swapped if reversed
    (``rand_precalc_random``: a uniform draw made earlier, mapped to a range)."""
    low32, high32 = np.float32(low), np.float32(high)
    if high32 < low32:
        low32, high32 = high32, low32
    return np.float32(random_part) * (high32 - low32) + low32
