"""Darknet's activation functions: the one list every backend indexes.

The position of a name in ``ACTIVATIONS`` is the integer id passed to the Cython
reference (and later to the Metal kernels). Names are those of Darknet's cfg files.
"""

from __future__ import annotations

__all__ = ["ACTIVATIONS", "ACTIVATION_ID", "CHANNEL_ACTIVATIONS"]

ACTIVATIONS: tuple[str, ...] = (
    "linear",
    "leaky",
    "relu",
    "relu6",
    "logistic",
    "loggy",
    "tanh",
    "elu",
    "selu",
    "gelu",
    "mish",
    "swish",
    "hard_mish",
    "hardtan",
    "lhtan",
    "plse",
    "stair",
    "ramp",
    "relie",
    "revleaky",
    "normalize_channels",
    "normalize_channels_softmax",
    "normalize_channels_softmax_maxval",
)

ACTIVATION_ID: dict[str, int] = {name: i for i, name in enumerate(ACTIVATIONS)}

#: Activations that mix channels at each pixel, so they cannot run elementwise.
CHANNEL_ACTIVATIONS: frozenset[str] = frozenset(
    {"normalize_channels", "normalize_channels_softmax", "normalize_channels_softmax_maxval"}
)
