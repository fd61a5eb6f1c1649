"""Parameter initialisation and inference-time folding of batch normalisation."""

from __future__ import annotations

import numpy as np

from darknet_metal.layers import LayerSpec

Params = dict[str, np.ndarray]

#: Darknet's epsilon under the square root of the rolling variance.
BATCHNORM_EPSILON = 1e-5


def init_params(specs: list[LayerSpec], seed: int | None = None) -> dict[int, Params]:
    """Initialise every layer's parameters as Darknet does for a network without weights.

    Convolution weights ~ U(-s, s) with ``s = sqrt(2 / (size*size*C/groups))``, connected
    weights ~ U(-s, s) with ``s = sqrt(2 / inputs)``; biases 0; batch-norm scales 1, rolling
    mean 0, rolling variance 1; shortcut weights 1. ``seed`` makes it reproducible.
    """
    rng = np.random.default_rng(seed)
    params: dict[int, Params] = {}
    for spec in specs:
        if not spec.param_shapes:
            continue
        layer: Params = {}
        for name, shape in spec.param_shapes.items():
            if name == "weights" and spec.kind in ("convolutional", "connected"):
                scale = np.sqrt(2.0 / shape[1])
                layer[name] = (scale * rng.uniform(-1.0, 1.0, shape)).astype(np.float32)
            elif name in ("scales", "rolling_variance") or spec.kind == "shortcut":
                layer[name] = np.ones(shape, np.float32)
            else:
                layer[name] = np.zeros(shape, np.float32)
        params[spec.index] = layer
    return params


def fold_batchnorm(layer: Params) -> tuple[np.ndarray, np.ndarray]:
    """Fold batch normalisation into (weights, biases) for inference.

    ``weights`` is (F, K), the other arrays (F,). With BN, ``y = scales*(Wx - mean)/sqrt(var +
    eps) + biases`` becomes ``W'x + b'`` with ``W' = W*scales/std`` and ``b' = biases -
    scales*mean/std``; computed in float64, returned as float64.
    """
    weights = layer["weights"].astype(np.float64)
    biases = layer["biases"].astype(np.float64)
    if "scales" not in layer:
        return weights, biases
    std = np.sqrt(layer["rolling_variance"].astype(np.float64) + BATCHNORM_EPSILON)
    factor = layer["scales"].astype(np.float64) / std
    return (weights * factor[:, None],
            biases - factor * layer["rolling_mean"].astype(np.float64))
