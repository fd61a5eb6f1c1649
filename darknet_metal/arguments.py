"""Checks of the arguments public calls receive: each names the argument, what was given and
what is allowed, and raises ``ArgumentTypeError`` (wrong type) or ``ArgumentError`` (wrong
value), both ``DarknetMetalError``s that are also ``TypeError`` / ``ValueError``."""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import Any

import numpy as np

from darknet_metal.errors import ArgumentError, ArgumentTypeError


def _given(value: Any) -> str:
    return f"{value!r} ({type(value).__name__})"


def is_integer(value: Any) -> bool:
    """An int or NumPy integer, not a bool."""
    return isinstance(value, int | np.integer) and not isinstance(value, bool | np.bool_)


def number(name: str, value: Any, lo: float | None = None, hi: float | None = None) -> float:
    """``value`` as a float: a finite real number (not a string or bool) in [lo, hi]."""
    if isinstance(value, bool | np.bool_) or not isinstance(value, int | float | np.integer
                                                                | np.floating):
        raise ArgumentTypeError(f"{name} must be a number, not {_given(value)}")
    value = float(value)
    if not math.isfinite(value) or (lo is not None and value < lo) or (
        hi is not None and value > hi
    ):
        bounds = f" in [{lo:g}, {hi:g}]" if lo is not None and hi is not None else ""
        raise ArgumentError(f"{name} must be a finite number{bounds}, not {value!r}")
    return value


def _int_at_least(name: str, value: Any, lo: int, what: str) -> int:
    if not is_integer(value):
        raise ArgumentTypeError(f"{name} must be a {what} integer, not {_given(value)}")
    if value < lo:
        raise ArgumentError(f"{name} must be a {what} integer, not {value!r}")
    return int(value)


def positive_int(name: str, value: Any) -> int:
    """``value`` as an int >= 1 (not a float, string or bool)."""
    return _int_at_least(name, value, 1, "positive")


def non_negative_int(name: str, value: Any) -> int:
    """``value`` as an int >= 0 (not a float, string or bool)."""
    return _int_at_least(name, value, 0, "non-negative")


def size_pair(name: str, value: Any) -> tuple[int, int]:
    """``value`` as (width, height): a sequence of two positive integers."""
    if isinstance(value, str | bytes) or not isinstance(value, Sequence | np.ndarray) or len(
        value
    ) != 2:
        raise ArgumentTypeError(
            f"{name} must be (width, height), two positive integers, not {_given(value)}"
        )
    width, height = value
    if not (is_integer(width) and is_integer(height)) or width < 1 or height < 1:
        raise ArgumentError(
            f"{name} must be (width, height), two positive integers, not {tuple(value)!r}"
        )
    return int(width), int(height)


def layer_indices(name: str, values: Any, count: int) -> list[int]:
    """``values`` as 0-based layer indices of a network of ``count`` layers (negative ones
    count from the end)."""
    if isinstance(values, str | bytes) or not hasattr(values, "__iter__"):
        raise ArgumentTypeError(f"{name} must be a sequence of layer indices, not "
                                f"{_given(values)}")
    from darknet_metal.errors import LayerIndexError

    result = []
    for position, i in enumerate(values):
        if not is_integer(i):
            raise ArgumentTypeError(
                f"{name}[{position}] must be a layer index (int), not {_given(i)}"
            )
        if not -count <= i < count:
            raise LayerIndexError(
                f"{name}[{position}]: layer index {int(i)} out of range: the network has "
                f"{count} layers (0..{count - 1}, or negative from the end)"
            )
        result.append(int(i) % count)
    return result
