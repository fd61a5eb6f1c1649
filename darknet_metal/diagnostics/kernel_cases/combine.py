"""Cases of ``shaders/combine.metal``: [shortcut] (unweighted and with every weights type and
normalisation, sources with fewer and more channels than its input), [scale_channels] both
ways and [sam], forward and backward, and the half twins.

Where a kernel sums in the reference's order its result is the reference's bit for bit. The
weighted shortcut's table goes through exp (an ulp from the CPU's), and its weight gradient
sums in two stages (pixels, then images and channels): those are held within a relative
bound."""

from __future__ import annotations

from collections.abc import Mapping

import numpy as np

from darknet_metal.cpu import combine
from darknet_metal.diagnostics.kernel_cases.batchnorm import sum_checks
from darknet_metal.diagnostics.kernel_cases.half import half_twin
from darknet_metal.diagnostics.kernel_parity import (
    NCHW,
    CaseData,
    Check,
    Close,
    Exact,
    KernelCase,
    RelL2,
    Step,
    dims,
    nan_filled,
    normal,
)

NORMS = combine.WEIGHTS_NORMALIZATIONS
#: (weights type, normalisation) of every shortcut the cases run.
WEIGHTINGS = (("none", "none"),
              *((wtype, norm) for wtype in ("per_feature", "per_channel") for norm in NORMS))
#: The shortcut's weight gradient, summed in another order than the CPU's: relative L2 on
#: small cases, and per weight relative to the sum of its products' magnitudes.
WGRAD_RTOL = 1e-5
WGRAD_TERMS_RTOL = 2e-7

def weights_step(n_inputs: int, channels: int, wtype: str, norm: str) -> Step:
    """The normalised weights table (``table``) of raw ``weights``."""
    return Step("shortcut_weights_fwd_f32",
                {"n_inputs": n_inputs, "channels": channels,
                 "per_channel": int(wtype == "per_channel"), "normalization": NORMS.index(norm)},
                {"channels": channels})

_, RELU_NORM, SOFTMAX_NORM = NORMS


def _shortcut_name(kernel: str, shape: NCHW, wtype: str, norm: str) -> str:
    weights = "unweighted" if wtype == "none" else f"{wtype}-{norm}"
    return f"{kernel}-{dims(shape)}-{weights}"


def _shortcut_forward(wtype: str, norm: str) -> KernelCase:
    """x plus a source with fewer channels and one with more, the second added in place."""
    shape = n, c, h, w = (2, 5, 7, 3)
    sources = (3, 7)
    weighted = wtype != "none"
    steps = (weights_step(len(sources) + 1, c, wtype, norm),) if weighted else ()
    steps += tuple(
        Step("shortcut_fwd_f32",
             {"batch": n, "channels": c, "spatial": h * w, "src_channels": sc, "source": i + 1,
              "first": int(i == 0), "weighted": int(weighted)},
             {"spatial": h * w, "channels": c, "batch": n},
             {"x": "x" if i == 0 else "y", "source": f"source{i}",
              "table": "table" if weighted else None, "y": "y"})
        for i, sc in enumerate(sources))

    def make(rng: np.random.Generator) -> CaseData:
        x = normal(rng, shape, 3.0)
        srcs = [normal(rng, (n, sc, h, w), 3.0) for sc in sources]
        arrays = {"x": x, "source0": srcs[0], "source1": srcs[1], "y": nan_filled(shape)}
        weights = None
        if weighted:
            weights = normal(rng, 3 * (c if wtype == "per_channel" else 1))
            arrays.update(weights=weights, table=nan_filled((3, c)))
        want = np.empty_like(x)
        combine.shortcut_forward(x, srcs, weights, wtype, norm, want)
        return CaseData(arrays, (Check("y", want, Close(1e-5, 1e-6)),))

    return KernelCase(_shortcut_name("shortcut_fwd_f32", shape, wtype, norm), steps, make)


def _shortcut_yolo() -> KernelCase:
    """The unweighted same-shape shortcut of the YOLO models: exactly x + source."""
    shape = n, c, h, w = (1, 7, 13, 13)

    def make(rng: np.random.Generator) -> CaseData:
        x, source = normal(rng, shape, 3.0), normal(rng, shape, 3.0)
        return CaseData({"x": x, "source": source, "y": nan_filled(shape)},
                        (Check("y", x + source, Exact()),))

    return KernelCase(f"shortcut_fwd_f32-{dims(shape)}-x_plus_source",
                      (Step("shortcut_fwd_f32",
                            {"batch": n, "channels": c, "spatial": h * w, "src_channels": c,
                             "source": 1, "first": 1, "weighted": 0},
                            {"spatial": h * w, "channels": c, "batch": n},
                            {"x": "x", "source": "source", "table": None, "y": "y"}),), make)


def shortcut_backward_steps(shape: NCHW, inputs: tuple[tuple[str, str, int], ...], wtype: str,
                            norm: str) -> tuple[Step, ...]:
    """What a host dispatches for a shortcut's backward: the table; each input's delta (x
    first; ``inputs``: (input array, its gradient, its channels)); then, weighted, each
    input's weight gradient and the normalisation's derivative into ``weight_grad``.
    Normalised, the gradient of the normalised weights goes to ``scratch`` (assigned row by
    row) first; ``partial`` holds each input's per-image sums."""
    n, c, h, w = shape
    weighted = wtype != "none"
    per_channel = int(wtype == "per_channel")
    columns = c if per_channel else 1
    steps = [weights_step(len(inputs), c, wtype, norm)] if weighted else []
    for row, (_, grad, ci) in enumerate(inputs):
        steps.append(Step("shortcut_bwd_f32",
                          {"batch": n, "channels": c, "spatial": h * w, "src_channels": ci,
                           "row": row, "weighted": int(weighted)},
                          {"spatial": h * w, "channels": min(c, ci), "batch": n},
                          {"delta": "delta", "table": "table" if weighted else None,
                           "grad": grad}))
    if not weighted:
        return tuple(steps)
    acc = "weight_grad" if norm == "none" else "scratch"
    for row, (inp, _, ci) in enumerate(inputs):
        steps.append(Step("shortcut_bwd_dot_f32",
                          {"batch": n, "channels": c, "spatial": h * w, "src_channels": ci,
                           "row": row, "weighted": 1},
                          {"channels": min(c, ci), "batch": n},
                          {"delta": "delta", "input": inp, "partial": "partial"}))
        steps.append(Step("shortcut_bwd_weights_f32",
                          {"batch": n, "channels": c, "src_channels": ci, "row": row,
                           "per_channel": per_channel, "accumulate": int(norm == "none")},
                          {"columns": columns}, {"partial": "partial", "acc": acc}))
    if norm != "none":
        steps.append(Step("shortcut_bwd_norm_f32",
                          {"n_inputs": len(inputs), "channels": c, "per_channel": per_channel,
                           "normalization": NORMS.index(norm)},
                          {"columns": columns},
                          {"weights": "weights", "g": "scratch", "weight_grad": "weight_grad"}))
    return tuple(steps)


def shortcut_backward_case(wtype: str, norm: str, *, shape: NCHW = (2, 5, 7, 3),
                           twice: bool = False, weight_scale: float = 1.0) -> KernelCase:
    """A shortcut's backward against the CPU's: x, a source with 3 channels (``twice``: x's
    producer again, its gradient x's) and one with 7, each adding into a random gradient.
    Unweighted, bit for bit; weighted, the input gradients within 1e-5 and the weight
    gradient within ``WGRAD_RTOL`` relative L2."""
    n, c, h, w = shape
    weighted = wtype != "none"
    first = ("x", "x_grad", c) if twice else ("source0", "grad0", 3)
    inputs = (("x", "x_grad", c), first, ("source1", "grad1", 7))
    steps = shortcut_backward_steps(shape, inputs, wtype, norm)

    def make(rng: np.random.Generator) -> CaseData:
        arrays = shortcut_backward_arrays(rng, shape, inputs, wtype, weight_scale)
        want = shortcut_backward_reference(arrays, inputs, wtype, norm)
        if not weighted:
            return CaseData(arrays, tuple(Check(g, want[g], Exact()) for g in want))
        # The table's exp may differ from the CPU's by an ulp.
        checks = [Check(g, want[g], Close(1e-5, 1e-5)) for g in want if g != "weight_grad"]
        checks.append(Check("weight_grad", want["weight_grad"], RelL2(WGRAD_RTOL)))
        return CaseData(arrays, tuple(checks))

    name = _shortcut_name("shortcut_bwd_f32", shape, wtype, norm) + ("-twice" if twice else "")
    return KernelCase(name, steps, make)


def shortcut_backward_arrays(rng: np.random.Generator, shape: NCHW,
                             inputs: tuple[tuple[str, str, int], ...], wtype: str,
                             weight_scale: float = 1.0) -> dict[str, np.ndarray]:
    """The arrays of ``shortcut_backward_steps``: every input and gradient 3 * N(0, 1), the
    weights ``weight_scale`` * N(0, 1)."""
    n, c, h, w = shape
    arrays = {"delta": normal(rng, shape, 3.0)}
    for inp, grad, ci in inputs:
        arrays.setdefault(inp, normal(rng, (n, ci, h, w), 3.0))
        arrays.setdefault(grad, normal(rng, (n, ci, h, w), 3.0))
    if wtype != "none":
        count = len(inputs) * (c if wtype == "per_channel" else 1)
        arrays.update(weights=normal(rng, count, weight_scale),
                      weight_grad=normal(rng, count, 3.0), table=nan_filled((len(inputs), c)),
                      partial=nan_filled(n * c), scratch=nan_filled(count))
    return arrays


def shortcut_backward_reference(arrays: Mapping[str, np.ndarray],
                                inputs: tuple[tuple[str, str, int], ...], wtype: str,
                                norm: str) -> dict[str, np.ndarray]:
    """The CPU's gradients after a shortcut's backward from ``arrays`` (by name; an input's
    gradient named twice is one array)."""
    want = {grad: arrays[grad].copy() for _, grad, _ in inputs}
    weights = arrays.get("weights")
    if weights is not None:
        want["weight_grad"] = arrays["weight_grad"].copy()
    (x, x_grad, _), *sources = inputs
    combine.shortcut_backward(arrays["delta"], arrays[x], [arrays[s] for s, _, _ in sources],
                              weights, wtype, norm, want[x_grad],
                              [want[g] for _, g, _ in sources], want.get("weight_grad"))
    return want


def _weight_gradient_large() -> KernelCase:
    """2 x 9 x 61 x 61 = 66978 products per input summed into one weight each: with that much
    cancellation the CPU's serial sum and the two-stage one differ by ~1e-4 relative to the
    result, but both stay within ``WGRAD_TERMS_RTOL`` of the sum of the products'
    magnitudes."""
    shape = n, c, h, w = (2, 9, 61, 61)
    inputs = (("x", "x_grad", c), ("source0", "grad0", 3), ("source1", "grad1", 7))

    def make(rng: np.random.Generator) -> CaseData:
        arrays = shortcut_backward_arrays(rng, shape, inputs, "per_feature")
        want = shortcut_backward_reference(arrays, inputs, "per_feature", "none")
        delta = arrays["delta"].astype(np.float64)
        magnitude = np.abs(arrays["weight_grad"].astype(np.float64)) + [
            np.abs(delta[:, :ci] * arrays[inp][:, :c]).sum() for inp, _, ci in inputs]
        return CaseData(arrays, (
            Check("x_grad", want["x_grad"], Exact()),
            *(Check(g, want[g], Close(1e-5, 1e-5)) for g in ("grad0", "grad1")),
            Check("weight_grad", want["weight_grad"], Close(0.0, WGRAD_TERMS_RTOL * magnitude)),
        ))

    return KernelCase(_shortcut_name("shortcut_bwd_f32", shape, "per_feature", "none"),
                      shortcut_backward_steps(shape, inputs, "per_feature", "none"), make)


def _scale_shape(shape: NCHW, scale_wh: bool) -> NCHW:
    n, c, h, w = shape
    return (n, 1, h, w) if scale_wh else (n, c, 1, 1)


def _scale_channels(shape: NCHW, scale_wh: bool) -> KernelCase:
    n, c, h, w = shape

    def make(rng: np.random.Generator) -> CaseData:
        x_from = normal(rng, shape, 3.0)
        scale = normal(rng, _scale_shape(shape, scale_wh), 3.0)
        want = np.empty_like(x_from)
        combine.scale_channels_forward(x_from, scale, want, scale_wh)
        return CaseData({"x_from": x_from, "scale": scale, "y": nan_filled(shape)},
                        (Check("y", want, Exact()),))

    return KernelCase(f"scale_channels_fwd_f32-{dims(shape)}" + ("-wh" if scale_wh else ""),
                      (Step("scale_channels_fwd_f32",
                            {"batch": n, "channels": c, "spatial": h * w,
                             "scale_wh": int(scale_wh)},
                            {"spatial": h * w, "channels": c, "batch": n}),), make)


def _sam(shape: NCHW) -> KernelCase:
    size = int(np.prod(shape))

    def make(rng: np.random.Generator) -> CaseData:
        x_from, x = normal(rng, shape, 3.0), normal(rng, shape, 3.0)
        want = np.empty_like(x)
        combine.sam_forward(x_from, x, want)
        return CaseData({"x_from": x_from, "x": x, "y": nan_filled(shape)},
                        (Check("y", want, Exact()),))

    return KernelCase(f"sam_fwd_f32-{dims(shape)}",
                      (Step("sam_fwd_f32", {"n": size}, {"n": size}),), make)


def _scale_channels_backward(shape: NCHW, scale_wh: bool) -> KernelCase:
    n, c, h, w = shape
    scale_shape = _scale_shape(shape, scale_wh)
    args = {"batch": n, "channels": c, "spatial": h * w, "scale_wh": int(scale_wh)}
    steps = (Step("scale_channels_bwd_f32", args, {"spatial": h * w, "channels": c, "batch": n}),
             Step("scale_channels_bwd_scale_f32", args, {"factors": int(np.prod(scale_shape))}))

    def make(rng: np.random.Generator) -> CaseData:
        arrays = {"x_from": normal(rng, shape, 3.0), "scale": normal(rng, scale_shape, 3.0),
                  "delta": normal(rng, shape, 3.0), "x_from_grad": normal(rng, shape, 3.0),
                  "scale_grad": normal(rng, scale_shape, 3.0)}
        want_x, want_s = arrays["x_from_grad"].copy(), arrays["scale_grad"].copy()
        combine.scale_channels_backward(arrays["delta"], arrays["x_from"], arrays["scale"],
                                        want_x, want_s, scale_wh)
        # The factors' sums are trees on the device: judged against the exact sums.
        products = arrays["delta"].astype(np.float64) * arrays["x_from"]
        exact = arrays["scale_grad"] + products.sum(axis=1 if scale_wh else (2, 3),
                                                    keepdims=True).reshape(scale_shape)
        return CaseData(arrays, (Check("x_from_grad", want_x, Exact()),
                                 *sum_checks("scale_grad", want_s, exact)))

    return KernelCase(f"scale_channels_bwd_f32-{dims(shape)}" + ("-wh" if scale_wh else ""),
                      steps, make)


def _sam_backward(shape: NCHW, same_grad: bool) -> KernelCase:
    """``same_grad``: x_from and x are one layer's output, with one gradient."""
    size = int(np.prod(shape))
    grads = {"x_from_grad": "x_grad" if same_grad else "x_from_grad", "x_grad": "x_grad"}

    def make(rng: np.random.Generator) -> CaseData:
        arrays = {"x_from": normal(rng, shape, 3.0), "x": normal(rng, shape, 3.0),
                  "delta": normal(rng, shape, 3.0), "x_grad": normal(rng, shape, 3.0)}
        if not same_grad:
            arrays["x_from_grad"] = normal(rng, shape, 3.0)
        want = {name: arrays[name].copy() for name in set(grads.values())}
        combine.sam_backward(arrays["delta"], arrays["x_from"], arrays["x"],
                             want[grads["x_from_grad"]], want["x_grad"])
        return CaseData(arrays, tuple(Check(name, w, Exact()) for name, w in want.items()))

    return KernelCase(f"sam_bwd_f32-{dims(shape)}" + ("-one_grad" if same_grad else ""),
                      (Step("sam_bwd_f32", {"n": size}, {"n": size},
                            {"delta": "delta", "x_from": "x_from", "x": "x", **grads}),), make)


def weights_table(weights: np.ndarray, n_inputs: int, channels: int, per_channel: bool,
                  norm: str) -> np.ndarray:
    """Darknet's normalised shortcut weights in float64: ``(n_inputs, channels)``, each input's
    weight divided by 1e-4 plus the sum over the inputs (after relu, or exp less the
    maximum for softmax)."""
    v = np.asarray(weights, np.float64).reshape(n_inputs, channels if per_channel else 1)
    # The cfg's names (``weights_normalization``): none, relu, softmax.
    if norm == RELU_NORM:
        v = np.maximum(v, 0.0)
    elif norm == SOFTMAX_NORM:
        v = np.exp(v - v.max(axis=0))
    if norm != "none":
        v = v / (1e-4 + v.sum(axis=0))
    return np.broadcast_to(v, (n_inputs, channels)).copy()


def _half_weights(per_channel: bool, norm: str) -> KernelCase:
    return half_twin(
        "shortcut_weights_fwd", f"3x6-{'per_channel' if per_channel else 'per_feature'}-{norm}",
        {"n_inputs": 3, "channels": 6, "per_channel": int(per_channel),
         "normalization": NORMS.index(norm)}, {"channels": 6},
        lambda a: {"table": weights_table(a["weights"], 3, 6, per_channel, norm)})


def _half_shortcut(a: Mapping[str, np.ndarray]) -> dict[str, np.ndarray]:
    # The kernel reads the source's row only where it has channels: 10 weights of 12.
    weights = np.concatenate([a["table"], np.zeros(2, np.float32)])
    y = np.empty((2, 6, 35, 1), np.float32)
    combine.shortcut_forward(a["x"].reshape(2, 6, 35, 1), [a["source"].reshape(2, 4, 35, 1)],
                             weights, "per_channel", "none", y)
    return {"y": y}


def _half_scale_channels(scale_wh: bool) -> KernelCase:
    def reference(a: Mapping[str, np.ndarray]) -> dict[str, np.ndarray]:
        y = np.empty((2, 5, 21, 1), np.float32)
        scale = a["scale"].reshape((2, 1, 21, 1) if scale_wh else (2, 5, 1, 1))
        combine.scale_channels_forward(a["x_from"].reshape(2, 5, 21, 1), scale, y, scale_wh)
        return {"y": y}

    return half_twin("scale_channels_fwd", "2x5x21" + ("-wh" if scale_wh else ""),
                     {"batch": 2, "channels": 5, "spatial": 21, "scale_wh": int(scale_wh)},
                     {"spatial": 21, "channels": 5, "batch": 2}, reference)


def _half_sam(a: Mapping[str, np.ndarray]) -> dict[str, np.ndarray]:
    y = np.empty((1, 300, 1, 1), np.float32)
    combine.sam_forward(a["x_from"].reshape(1, 300, 1, 1), a["x"].reshape(1, 300, 1, 1), y)
    return {"y": y}


CASES: tuple[KernelCase, ...] = (
    *(_shortcut_forward(wtype, norm) for wtype, norm in WEIGHTINGS),
    _shortcut_yolo(),
    *(_scale_channels((2, 7, 5, 3), scale_wh) for scale_wh in (False, True)),
    _sam((1, 5, 7, 7)),
    *(shortcut_backward_case(wtype, norm, twice=twice) for wtype, norm in WEIGHTINGS
      for twice in (False, True)),
    _weight_gradient_large(),
    # Sums longer than a threadgroup (64 threads) along pixels and along channels.
    *(_scale_channels_backward(shape, scale_wh) for shape in ((2, 7, 5, 3), (1, 5, 1, 1),
                                                               (2, 37, 31, 31), (2, 130, 3, 3))
      for scale_wh in (False, True)),
    *(_sam_backward(shape, same) for shape in ((1, 5, 7, 7), (2, 35, 31, 31))
      for same in (False, True)),
    *(_half_weights(per_channel, norm) for per_channel, norm in ((True, SOFTMAX_NORM),
                                                                 (False, RELU_NORM))),
    half_twin("shortcut_fwd", "2x6x35-from4-weighted",
              {"batch": 2, "channels": 6, "spatial": 35, "src_channels": 4, "source": 1,
               "first": 1, "weighted": 1}, {"spatial": 35, "channels": 6, "batch": 2},
              _half_shortcut),
    *(_half_scale_channels(scale_wh) for scale_wh in (False, True)),
    half_twin("sam_fwd", "300", {"n": 300}, {"n": 300}, _half_sam),
)
