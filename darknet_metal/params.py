"""Layer parameters: the arrays of each layer, and Darknet's initialisation of a network."""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING

import numpy as np

if TYPE_CHECKING:
    from darknet_metal.ops.base import LayerSpec

#: A layer's parameter arrays by name (``LayerSpec.param_shapes``).
Params = dict[str, np.ndarray]

#: Darknet's epsilon under the square root of the rolling variance.
BATCHNORM_EPSILON = 1e-5


def init_params(specs: Sequence[LayerSpec], seed: int | None = None) -> dict[int, Params]:
    """Every layer's parameters as Darknet initialises a network without weights (each op's
    ``init_params``, in layer order from one generator); ``seed`` makes it reproducible."""
    rng = np.random.default_rng(seed)
    return {spec.index: spec.init_params(rng) for spec in specs if spec.param_shapes}
