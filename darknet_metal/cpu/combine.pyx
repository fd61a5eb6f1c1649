# cython: language_level=3
"""Layers that combine two or more inputs: ``[shortcut]``, ``[scale_channels]``, ``[sam]``.

The arithmetic is Darknet's (``shortcut_multilayer_cpu`` in ``blas.cpp``,
``forward_scale_channels_layer``, ``forward_sam_layer``). None of these apply the layer's
activation: the caller does, with ``darknet_metal.cpu.activations.activate_step``.

Contract: the package's (``darknet_metal.cpu``): C-contiguous float32 or float64
(N, C, H, W) arrays of one dtype, checked by ``checks``. Each ``*_step`` checks its
arguments and returns the ``NativeStep`` (``step.pyx``; for shortcut, a list of them) that
runs the loop without the GIL; ``*_forward`` makes the step(s) and runs them once.
"""

cimport cython
from cython cimport floating
from libc.float cimport FLT_MAX
from libc.string cimport memmove

from darknet_metal.cpu.fmath cimport fexp
from darknet_metal.cpu.step cimport STEP_BUFFERS, NativeStep, StepData, new_step

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

cdef enum:  # buffer roles; the slots a step leaves unused hold its sources (source_role)
    SHORTCUT_X, SHORTCUT_OUT, SHORTCUT_WEIGHTS, SHORTCUT_TABLE

cdef enum:  # weights normalisations, indices in WEIGHTS_NORMALIZATIONS
    NORM_NONE, NORM_RELU, NORM_SOFTMAX

cdef struct ShortcutParams:
    Py_ssize_t batch
    Py_ssize_t channels  # C of x and out
    Py_ssize_t spatial   # H * W
    Py_ssize_t n_inputs  # x and every source of the layer: the rows of the table
    int norm
    bint weighted
    bint per_channel
    # The layer's first step writes x (scaled) into out and, weighted, fills the table
    # from the weights; the others only add further sources.
    bint first
    int first_row        # table row of this step's first source
    int n_sources
    int source_role[STEP_BUFFERS]
    Py_ssize_t source_channels[STEP_BUFFERS]


@cython.cdivision(True)
cdef void _normalize_weights(const floating* w, floating* table,
                             const ShortcutParams* p) noexcept nogil:
    # table[i*C + c]: the weight of input i (0 = x, 1.. = sources) at channel c. Darknet
    # recomputes it per element; the operations and their order are the same for every
    # element of a channel, so computing it once per channel gives equal values. Computed
    # on every run because training changes the weights between passes.
    cdef Py_ssize_t channels = p.channels, n_inputs = p.n_inputs, c, i, base
    cdef Py_ssize_t stride = channels if p.per_channel else 1
    cdef floating max_val, total, v, eps = <floating>0.0001, zero = 0
    for c in range(channels):
        base = c if p.per_channel else 0
        max_val = -FLT_MAX
        if p.norm == NORM_SOFTMAX:
            for i in range(n_inputs):
                v = w[base + i * stride]
                if max_val < v:
                    max_val = v
        total = eps
        for i in range(n_inputs):
            v = w[base + i * stride]
            if p.norm == NORM_RELU:
                total = total + (v if v > zero else zero)
            elif p.norm == NORM_SOFTMAX:
                total = total + fexp(v - max_val)
        for i in range(n_inputs):
            v = w[base + i * stride]
            if p.norm == NORM_RELU:
                table[i * channels + c] = (v if v > zero else zero) / total
            elif p.norm == NORM_SOFTMAX:
                table[i * channels + c] = fexp(v - max_val) / total
            else:
                table[i * channels + c] = v


cdef void _shortcut_scale(const floating* src, floating* dst, const floating* table,
                          const ShortcutParams* p) noexcept nogil:
    # out = x * table[0, channel]
    cdef Py_ssize_t channels = p.channels, spatial = p.spatial, b, c, i, at
    cdef floating wt
    for b in range(p.batch):
        for c in range(channels):
            wt = table[c]
            at = (b * channels + c) * spatial
            for i in range(spatial):
                dst[at + i] = src[at + i] * wt


cdef void _shortcut_add(floating* dst, const floating* src, Py_ssize_t c_add,
                        const floating* table, Py_ssize_t row,
                        const ShortcutParams* p) noexcept nogil:
    # out[:, :min(C, C_add)] += add[:, :min(C, C_add)] (* table[row, channel])
    cdef Py_ssize_t c_out = p.channels, spatial = p.spatial, b, c, i, at, at_add
    cdef Py_ssize_t c_min = c_out if c_out < c_add else c_add
    cdef floating wt
    for b in range(p.batch):
        for c in range(c_min):
            at = (b * c_out + c) * spatial
            at_add = (b * c_add + c) * spatial
            if p.weighted:
                wt = table[row * c_out + c]
                for i in range(spatial):
                    dst[at + i] = dst[at + i] + src[at_add + i] * wt
            else:
                for i in range(spatial):
                    dst[at + i] = dst[at + i] + src[at_add + i]


cdef void _shortcut(floating* out, floating* table, const StepData* d,
                    const ShortcutParams* p) noexcept nogil:
    cdef const floating* x = <const floating*>d.buf[SHORTCUT_X]
    cdef int k
    if p.first:
        if p.weighted:
            _normalize_weights(<const floating*>d.buf[SHORTCUT_WEIGHTS], table, p)
            _shortcut_scale(x, out, table, p)
        elif x != out:
            memmove(out, x, p.batch * p.channels * p.spatial * sizeof(floating))
    # Sources one after the other, as Darknet adds them: the sums round alike.
    for k in range(p.n_sources):
        _shortcut_add(out, <const floating*>d.buf[p.source_role[k]], p.source_channels[k],
                      table, p.first_row + k, p)


cdef void _shortcut_step(const StepData* d) noexcept nogil:
    cdef const ShortcutParams* p = <const ShortcutParams*>d.params
    if d.f32:
        _shortcut(<float*>d.buf[SHORTCUT_OUT], <float*>d.buf[SHORTCUT_TABLE], d, p)
    else:
        _shortcut(<double*>d.buf[SHORTCUT_OUT], <double*>d.buf[SHORTCUT_TABLE], d, p)


def shortcut_step(x, sources, weights, str weights_type, str weights_normalization,
                  out) -> list:
    """Darknet ``[shortcut]`` forward before its activation (shortcut_multilayer_cpu), as a
    list of NativeSteps to run in order.

    x: (N, C, H, W), the previous layer's output; sources: non-empty list of the ``from=``
    layers' outputs, each (N, C_i, H, W) with the dtype of x (C_i may differ from C: only
    the first min(C, C_i) channels are added, the rest of x passes through); out: same
    shape and dtype as x (may be x itself, must not share memory with a source).

    weights_type "none" adds plainly (weights must be None); "per_feature" (alias
    "per_layer") takes one weight per input, ``weights`` of n+1 values (x first, then the
    sources in order); "per_channel" takes (n+1)*C values, input-major. The weights are
    normalised per channel by weights_normalization: "none"; "relu" (alias "avg_relu"):
    ``max(w, 0) / (1e-4 + sum max(w_i, 0))``; "softmax": ``exp(w - m) / (1e-4 + sum
    exp(w_i - m))`` with m the maximum. Then ``out = x*w_0 + sum_i source_i*w_i``, added in
    source order.

    The steps read ``weights`` (a C-contiguous array of x's dtype, any shape) on every run,
    so changing it in place changes the next run's result. A step binds at most
    ``STEP_BUFFERS`` arrays, so many sources take several steps: the first writes x into out
    and adds the sources that fit, the others add the rest.
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
    table = None
    if weighted:
        expected = n_inputs * (c if wtype == "per_channel" else 1)
        if weights is None or np.size(weights) != expected:
            raise ArgumentError(f"weights_type={wtype} with {len(sources)} source(s) and {c} "
                             f"channels needs {expected} weights, got "
                             f"{'None' if weights is None else np.size(weights)}")
        if (not isinstance(weights, np.ndarray) or weights.dtype != x.dtype
                or not weights.flags.c_contiguous):
            given = (f"a{'' if weights.flags.c_contiguous else ' non-contiguous'} "
                     f"{weights.dtype} array" if isinstance(weights, np.ndarray)
                     else f"a {type(weights).__name__}")
            raise ArgumentError(f"weights must be a C-contiguous {x.dtype} array (the steps "
                                f"read it on every run), not {given}")
        table = np.empty(n_inputs * max(c, 1), x.dtype)
    elif weights is not None:
        raise ArgumentError("weights must be None when weights_type is 'none'")
    # Every source is read before out is written, so out may alias x but not a source.
    for k, src in enumerate(sources):
        if np.shares_memory(out, src):
            raise ArgumentError(f"out must not share memory with sources[{k}]")

    f32 = x.dtype == np.float32
    steps = []
    cdef NativeStep step
    cdef ShortcutParams* p
    cdef int role, i
    cdef int done = 0  # sources bound so far
    while not steps or done < len(sources):
        first = not steps
        arrays = [None] * STEP_BUFFERS
        arrays[SHORTCUT_OUT] = out
        if first:
            arrays[SHORTCUT_X] = x
        if weighted:
            arrays[SHORTCUT_TABLE] = table
            if first:
                arrays[SHORTCUT_WEIGHTS] = weights
        roles = []  # the slots this step leaves free, for the next sources
        for role in range(STEP_BUFFERS):
            if arrays[role] is None and done + len(roles) < len(sources):
                arrays[role] = sources[done + len(roles)]
                roles.append(role)
        step = new_step(_shortcut_step, "shortcut" if first else "shortcut_add", tuple(arrays),
                        f32, sizeof(ShortcutParams))
        p = <ShortcutParams*>step.data.params
        p.batch, p.channels, p.spatial = n, c, h * w
        p.n_inputs = n_inputs
        p.norm = WEIGHTS_NORMALIZATIONS.index(norm)
        p.weighted = weighted
        p.per_channel = wtype == "per_channel"
        p.first = first
        p.first_row = done + 1
        p.n_sources = len(roles)
        for i, role in enumerate(roles):
            p.source_role[i] = role
            p.source_channels[i] = sources[done + i].shape[1]
        done += len(roles)
        steps.append(step)
    return steps


def shortcut_forward(x, sources, weights, str weights_type, str weights_normalization,
                     out) -> None:
    """``shortcut_step(x, sources, weights, weights_type, weights_normalization, out)`` run
    once; ``weights`` may be any array-like of the right size (it is converted to x's
    dtype)."""
    if weights is not None and isinstance(x, np.ndarray):
        try:
            weights = np.ascontiguousarray(weights, dtype=x.dtype)
        except (TypeError, ValueError):
            pass  # shortcut_step says what is wrong with it
    for step in shortcut_step(x, sources, weights, weights_type, weights_normalization, out):
        step.run()


# ----------------------------------------------------------------------------------------
# scale_channels

cdef enum:  # buffer roles
    SCALE_X_FROM, SCALE_SCALE, SCALE_OUT

cdef struct ScaleChannelsParams:
    Py_ssize_t batch
    Py_ssize_t channels
    Py_ssize_t spatial  # H * W
    bint scale_wh       # one factor per pixel (else one per channel)


cdef void _scale_channels(const floating* src, const floating* sc, floating* dst,
                          const ScaleChannelsParams* p) noexcept nogil:
    cdef Py_ssize_t channels = p.channels, spatial = p.spatial, b, c, i, at
    cdef floating s
    for b in range(p.batch):
        for c in range(channels):
            at = (b * channels + c) * spatial
            if p.scale_wh:
                for i in range(spatial):
                    dst[at + i] = sc[b * spatial + i] * src[at + i]
            else:
                s = sc[b * channels + c]
                for i in range(spatial):
                    dst[at + i] = s * src[at + i]


cdef void _scale_channels_step(const StepData* d) noexcept nogil:
    cdef const ScaleChannelsParams* p = <const ScaleChannelsParams*>d.params
    if d.f32:
        _scale_channels(<const float*>d.buf[SCALE_X_FROM], <const float*>d.buf[SCALE_SCALE],
                        <float*>d.buf[SCALE_OUT], p)
    else:
        _scale_channels(<const double*>d.buf[SCALE_X_FROM], <const double*>d.buf[SCALE_SCALE],
                        <double*>d.buf[SCALE_OUT], p)


def scale_channels_step(x_from, scale, out, bint scale_wh=False) -> NativeStep:
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
    cdef NativeStep step = new_step(_scale_channels_step, "scale_channels",
                                    (x_from, scale, out), x_from.dtype == np.float32,
                                    sizeof(ScaleChannelsParams))
    cdef ScaleChannelsParams* p = <ScaleChannelsParams*>step.data.params
    p.batch, p.channels, p.spatial = n, c, h * w
    p.scale_wh = scale_wh
    return step


def scale_channels_forward(x_from, scale, out, bint scale_wh=False) -> None:
    """``scale_channels_step(x_from, scale, out, scale_wh)`` run once."""
    scale_channels_step(x_from, scale, out, scale_wh).run()


# ----------------------------------------------------------------------------------------
# sam

cdef enum:  # buffer roles
    SAM_X_FROM, SAM_X, SAM_OUT

cdef struct SamParams:
    Py_ssize_t n  # elements


cdef void _sam(const floating* x_from, const floating* x, floating* out,
               const SamParams* p) noexcept nogil:
    cdef Py_ssize_t i
    for i in range(p.n):
        out[i] = x[i] * x_from[i]


cdef void _sam_step(const StepData* d) noexcept nogil:
    cdef const SamParams* p = <const SamParams*>d.params
    if d.f32:
        _sam(<const float*>d.buf[SAM_X_FROM], <const float*>d.buf[SAM_X],
             <float*>d.buf[SAM_OUT], p)
    else:
        _sam(<const double*>d.buf[SAM_X_FROM], <const double*>d.buf[SAM_X],
             <double*>d.buf[SAM_OUT], p)


def sam_step(x_from, x, out) -> NativeStep:
    """Darknet ``[sam]`` forward before its activation: ``out = x * x_from`` elementwise.

    x_from: (N, C, H, W), the ``from=`` layer's output; x: the previous layer's output, same
    shape and dtype; out: same shape and dtype.
    """
    check_input("x_from", x_from)
    check_input("x", x)
    check_like("x", x, x_from, "x_from")
    check_out(out, x_from, x_from.shape, like_name="x_from")
    cdef NativeStep step = new_step(_sam_step, "sam", (x_from, x, out),
                                    x_from.dtype == np.float32, sizeof(SamParams))
    cdef SamParams* p = <SamParams*>step.data.params
    p.n = x_from.size
    return step


def sam_forward(x_from, x, out) -> None:
    """``sam_step(x_from, x, out)`` run once."""
    sam_step(x_from, x, out).run()
