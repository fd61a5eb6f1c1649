"""Argument types of the ``darknet-metal`` commands (argparse ``type=`` callables): each
returns the value or raises ``argparse.ArgumentTypeError`` saying what was expected."""

from __future__ import annotations

import argparse


def unit_float(text: str) -> float:
    """A number in [0, 1]."""
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"not a number: '{text}'") from None
    if not 0.0 <= value <= 1.0:
        raise argparse.ArgumentTypeError(f"must be between 0 and 1, got {text}")
    return value


def positive_int(text: str) -> int:
    """An integer >= 1."""
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"not an integer: '{text}'") from None
    if value < 1:
        raise argparse.ArgumentTypeError(f"must be at least 1, got {text}")
    return value


def non_negative_int(text: str) -> int:
    """An integer >= 0."""
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"not an integer: '{text}'") from None
    if value < 0:
        raise argparse.ArgumentTypeError(f"must be at least 0, got {text}")
    return value


def multiple_of_32(text: str) -> int:
    """A positive multiple of 32 (a network size in pixels)."""
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"not an integer: '{text}'") from None
    if value < 32 or value % 32:
        raise argparse.ArgumentTypeError(f"must be a positive multiple of 32, got {text}")
    return value


def seed(text: str) -> int:
    """A random seed: an integer in [0, 2**63)."""
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"not an integer: '{text}'") from None
    if not 0 <= value < 2**63:
        raise argparse.ArgumentTypeError(f"must be in 0..2**63-1, got {text}")
    return value


def size(text: str) -> tuple[int, int]:
    """``WxH`` in pixels, each side 32..4096."""
    parts = text.lower().split("x")
    try:
        width, height = (int(p) for p in parts)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected WxH such as 224x224, got '{text}'") from None
    if not (32 <= width <= 4096 and 32 <= height <= 4096):
        raise argparse.ArgumentTypeError(f"each side must be 32..4096 pixels, got '{text}'")
    return width, height
