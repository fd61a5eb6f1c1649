"""A network's layers: the op class of each layer kind (``OPS``), the layers of a parsed cfg
(each section's op checks its shapes), and Darknet's initialisation of their parameters."""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np

from darknet_metal.model.cfg import NetConfig, Section, Shape, input_shape
from darknet_metal.model.weights import Params
from darknet_metal.ops.base import Op

#: Layer kind (cfg section name) -> its op class.
OPS: dict[str, type[Op]] = {}


def register(cls: type[Op]) -> type[Op]:
    """Adds an op class to ``OPS`` under its ``kind``; returns it (usable as a decorator)."""
    if not cls.kind:
        raise ValueError(f"{cls.__name__} has no kind")
    OPS[cls.kind] = cls
    return cls


def op_class(kind: str) -> type[Op]:
    """The op class of layer kind ``kind``; KeyError naming the known kinds otherwise."""
    try:
        return OPS[kind]
    except KeyError:
        raise KeyError(f"no op for layer kind {kind!r}; known: {sorted(OPS)}") from None


def build_layer(section: Section, shape: Shape, shapes: list[Shape]) -> Op:
    """The layer of ``section`` (its op's ``build``); CfgError for a kind without an op."""
    op = OPS.get(section.kind)
    if op is None:
        raise section.error(f"layer kind '{section.kind}' is not supported")
    return op.build(section, shape, shapes)


def build_layers(config: NetConfig) -> list[Op]:
    """Shape-check a parsed cfg and return one ``Op`` per layer, in cfg order."""
    shape = input_shape(config)
    if min(shape) < 1:
        raise config.net.error(f"the network input {shape} (channels, height, width) is empty")
    specs: list[Op] = []
    shapes: list[Shape] = []
    for section in config.layers:
        spec = build_layer(section, shape, shapes)
        specs.append(spec)
        shapes.append(spec.out_shape)
        shape = spec.out_shape
    return specs


def init_params(specs: Sequence[Op], seed: int | None = None) -> dict[int, Params]:
    """Every layer's parameters as Darknet initialises a network without weights (each op's
    ``init_params``, in layer order from one generator); ``seed`` makes it reproducible."""
    rng = np.random.default_rng(seed)
    return {spec.index: spec.init_params(rng) for spec in specs if spec.param_shapes}
