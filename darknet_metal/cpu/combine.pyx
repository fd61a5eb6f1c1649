# cython: language_level=3
"""Layers that combine two or more inputs: ``[shortcut]``, ``[scale_channels]``, ``[sam]``.

The arithmetic is Darknet's (``shortcut_multilayer_cpu`` in ``blas.cpp``,
``forward_scale_channels_layer``, ``forward_sam_layer``). None of these apply the layer's
activation: the caller does, with ``darknet_metal.cpu.activations.activate``.

Contract: the package's (``darknet_metal.cpu``): C-contiguous float32 or float64
(N, C, H, W) arrays of one dtype, checked by ``checks``; the loops run without the GIL.
"""

cimport cython
from cython cimport floating
from libc.float cimport FLT_MAX

from darknet_metal.cpu.fmath cimport fexp

import numpy as np

from darknet_metal.errors import ArgumentError, ArgumentTypeError
from darknet_metal.cpu.checks import check_input, check_like, check_out

WEIGHTS_TYPES = ("none", "per_feature", "per_channel")
WEIGHTS_NORMALIZATIONS = ("none", "relu", "softmax")
# Darknet accepts these spellings too.
_TYPE_ALIASES = {"per_layer": "per_feature"}
_NORM_ALIASES = {"avg_relu": "relu"}


# ----------------------------------------------------------------------------------------
# shortcut

@cython.cdivision(True)
def _normalized_weights(const floating[::1] w, floating[:, ::1] table, int n_inputs,
                        int channels, bint per_channel, int norm):
    """table[i, c]: the weight of input i (0 = x, 1.. = sources) at channel c.

    Darknet recomputes this per element; the operations and their order are the same
    for every element of a channel, so computing it once per channel gives equal values.
    """
    cdef int c, i, base, step = channels if per_channel else 1
    cdef floating max_val, total, v, eps = <floating>0.0001, zero = 0
    for c in range(channels):
        base = c if per_channel else 0
        max_val = -FLT_MAX
        if norm == 2:
            for i in range(n_inputs):
                v = w[base + i * step]
                if max_val < v:
                    max_val = v
        total = eps
        for i in range(n_inputs):
            v = w[base + i * step]
            if norm == 1:
                total = total + (v if v > zero else zero)
            elif norm == 2:
                total = total + fexp(v - max_val)
        for i in range(n_inputs):
            v = w[base + i * step]
            if norm == 1:
                table[i, c] = (v if v > zero else zero) / total
            elif norm == 2:
                table[i, c] = fexp(v - max_val) / total
            else:
                table[i, c] = v


def _shortcut_add(floating[:, :, :, ::1] out, const floating[:, :, :, ::1] add,
                  const floating[:, ::1] table, int row, bint weighted):
    """out[:, :min(C, C_add)] += add[:, :min(C, C_add)] (* table[row, channel])."""
    cdef Py_ssize_t batch = out.shape[0], c_out = out.shape[1], c_add = add.shape[1]
    cdef Py_ssize_t spatial = out.shape[2] * out.shape[3]
    cdef Py_ssize_t c_min = min(c_out, c_add), task, b, c, i
    cdef floating wt
    if batch * c_min * spatial == 0:
        return
    cdef floating* dst = &out[0, 0, 0, 0]
    cdef const floating* src = &add[0, 0, 0, 0]
    with nogil:
        for task in range(batch * c_min):
            b = task // c_min
            c = task % c_min
            if weighted:
                wt = table[row, c]
                for i in range(spatial):
                    dst[(b * c_out + c) * spatial + i] = (dst[(b * c_out + c) * spatial + i]
                                                          + src[(b * c_add + c) * spatial + i]
                                                          * wt)
            else:
                for i in range(spatial):
                    dst[(b * c_out + c) * spatial + i] = (dst[(b * c_out + c) * spatial + i]
                                                          + src[(b * c_add + c) * spatial + i])


def _shortcut_scale(const floating[:, :, :, ::1] x, floating[:, :, :, ::1] out,
                    const floating[:, ::1] table):
    """out = x * table[0, channel]."""
    cdef Py_ssize_t batch = x.shape[0], channels = x.shape[1]
    cdef Py_ssize_t spatial = x.shape[2] * x.shape[3], task, c, i
    cdef floating wt
    if batch * channels * spatial == 0:
        return
    cdef const floating* src = &x[0, 0, 0, 0]
    cdef floating* dst = &out[0, 0, 0, 0]
    with nogil:
        for task in range(batch * channels):
            c = task % channels
            wt = table[0, c]
            for i in range(spatial):
                dst[task * spatial + i] = src[task * spatial + i] * wt


def shortcut_forward(x, sources, weights, str weights_type, str weights_normalization,
                     out) -> None:
    """Darknet ``[shortcut]`` forward before its activation (shortcut_multilayer_cpu).

    x: (N, C, H, W), the previous layer's output; sources: non-empty list of the ``from=``
    layers' outputs, each (N, C_i, H, W) with the dtype of x (C_i may differ from C: only
    the first min(C, C_i) channels are added, the rest of x passes through); out: same
    shape and dtype as x (may be x itself).

    weights_type "none" adds plainly (weights must be None); "per_feature" (alias
    "per_layer") takes one weight per input, ``weights`` of n+1 values (x first, then the
    sources in order); "per_channel" takes (n+1)*C values, input-major. The weights are
    normalised per channel by weights_normalization: "none"; "relu" (alias "avg_relu"):
    ``max(w, 0) / (1e-4 + sum max(w_i, 0))``; "softmax": ``exp(w - m) / (1e-4 + sum
    exp(w_i - m))`` with m the maximum. Then ``out = x*w_0 + sum_i source_i*w_i``, added in
    source order.
    """
    check_input("x", x)
    if isinstance(sources, np.ndarray) or not isinstance(sources, (list, tuple)):
        raise ArgumentTypeError("sources must be a list of arrays")
    if len(sources) == 0:
        raise ArgumentError("shortcut needs at least one source (the from= layers)")
    n, c, h, w = x.shape
    for k, src in enumerate(sources):
        check_input(f"sources[{k}]", src, like=x)
        if src.shape[0] != n or src.shape[2:] != x.shape[2:]:
            raise ArgumentError(f"sources[{k}] must have shape ({n}, C_{k}, {h}, {w}) like x, "
                             f"not {src.shape}")
    check_out(out, x, x.shape)
    wtype = _TYPE_ALIASES.get(weights_type, weights_type)
    norm = _NORM_ALIASES.get(weights_normalization, weights_normalization)
    if wtype not in WEIGHTS_TYPES:
        raise ArgumentError(f"weights_type must be one of {WEIGHTS_TYPES}, not {weights_type!r}")
    if norm not in WEIGHTS_NORMALIZATIONS:
        raise ArgumentError(f"weights_normalization must be one of {WEIGHTS_NORMALIZATIONS}, "
                         f"not {weights_normalization!r}")
    n_inputs = len(sources) + 1
    weighted = wtype != "none"
    table = np.zeros((n_inputs, max(c, 1)), dtype=x.dtype)
    if weighted:
        expected = n_inputs * (c if wtype == "per_channel" else 1)
        if weights is None or np.size(weights) != expected:
            raise ArgumentError(f"weights_type={wtype} with {len(sources)} source(s) and {c} "
                             f"channels needs {expected} weights, got "
                             f"{'None' if weights is None else np.size(weights)}")
        flat = np.ascontiguousarray(weights, dtype=x.dtype).reshape(-1)
        _normalized_weights(flat, table, n_inputs, max(c, 1), wtype == "per_channel",
                            WEIGHTS_NORMALIZATIONS.index(norm))
    elif weights is not None:
        raise ArgumentError("weights must be None when weights_type is 'none'")
    # Every source is read before out is written, so out may alias x but not a source.
    for k, src in enumerate(sources):
        if np.shares_memory(out, src):
            raise ArgumentError(f"out must not share memory with sources[{k}]")
    if weighted:
        _shortcut_scale(x, out, table)
    elif out is not x:
        np.copyto(out, x)
    for k, src in enumerate(sources):
        _shortcut_add(out, src, table, k + 1, weighted)


# ----------------------------------------------------------------------------------------
# scale_channels and sam

def _scale_channels(const floating[:, :, :, ::1] x_from, const floating[:, :, :, ::1] scale,
                    floating[:, :, :, ::1] out, bint scale_wh):
    cdef Py_ssize_t batch = x_from.shape[0], channels = x_from.shape[1]
    cdef Py_ssize_t spatial = x_from.shape[2] * x_from.shape[3], task, b, c, i
    cdef floating s
    if batch * channels * spatial == 0:
        return
    cdef const floating* src = &x_from[0, 0, 0, 0]
    cdef const floating* sc = &scale[0, 0, 0, 0]
    cdef floating* dst = &out[0, 0, 0, 0]
    with nogil:
        for task in range(batch * channels):
            if scale_wh:
                b = task // channels
                for i in range(spatial):
                    dst[task * spatial + i] = sc[b * spatial + i] * src[task * spatial + i]
            else:
                s = sc[task]
                for i in range(spatial):
                    dst[task * spatial + i] = s * src[task * spatial + i]


def scale_channels_forward(x_from, scale, out, bint scale_wh=False) -> None:
    """Darknet ``[scale_channels]`` forward before its activation.

    x_from: (N, C, H, W), the ``from=`` layer's output; scale: the previous layer's output,
    (N, C, 1, 1) (one factor per channel) or, with scale_wh, (N, 1, H, W) (one factor per
    pixel, shared by all channels); out: like x_from. ``out = scale * x_from`` broadcast.
    """
    check_input("x_from", x_from)
    check_input("scale", scale, like=x_from, like_name="x_from")
    n, c, h, w = x_from.shape
    expected = (n, 1, h, w) if scale_wh else (n, c, 1, 1)
    if tuple(scale.shape) != expected:
        raise ArgumentError(f"scale must have shape {expected} "
                         f"({'scale_wh' if scale_wh else 'per channel'}), not {scale.shape}")
    check_out(out, x_from, x_from.shape, like_name="x_from")
    _scale_channels(x_from, scale, out, scale_wh)


def _sam(const floating[::1] x_from, const floating[::1] x, floating[::1] out):
    cdef Py_ssize_t n = x.shape[0], i
    with nogil:
        for i in range(n):
            out[i] = x[i] * x_from[i]


def sam_forward(x_from, x, out) -> None:
    """Darknet ``[sam]`` forward before its activation: ``out = x * x_from`` elementwise.

    x_from: (N, C, H, W), the ``from=`` layer's output; x: the previous layer's output, same
    shape and dtype; out: same shape and dtype.
    """
    check_input("x_from", x_from)
    check_input("x", x)
    check_like("x", x, x_from, "x_from")
    check_out(out, x_from, x_from.shape, like_name="x_from")
    _sam(x_from.reshape(-1), x.reshape(-1), out.reshape(-1))
