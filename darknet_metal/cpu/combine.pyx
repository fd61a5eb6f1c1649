# cython: language_level=3
"""Layers that combine two or more inputs: ``[shortcut]``, ``[scale_channels]``, ``[sam]``,
forward and backward.

The arithmetic is Darknet's (``shortcut_multilayer_cpu`` in ``blas.cpp``,
``forward_scale_channels_layer``, ``forward_sam_layer``). None of these apply the layer's
activation: the caller does, with ``darknet_metal.cpu.activation.activate_step``; and the
``*_backward_step`` kernels take the delta already multiplied by its derivative
(``activation_gradient_step``). Backward kernels add into every delta and weight gradient
they write (a layer's output may feed several consumers).

Contract: the package's (``darknet_metal.cpu``): C-contiguous float32 or float64
(N, C, H, W) arrays of one dtype, checked by ``checks``. Each ``*_step`` checks its
arguments and returns the ``NativeStep`` (``step.pyx``; for shortcut, a list of them) that
runs the loop without the GIL; ``*_forward`` makes the step(s) and runs them once.
"""

cimport cython
from cython cimport floating
from libc.float cimport FLT_MAX
from libc.string cimport memmove, memset

from darknet_metal.cpu.blas cimport cpu_threads, run_parts
from darknet_metal.cpu.fmath cimport fexp
from darknet_metal.cpu.step cimport STEP_BUFFERS, NativeStep, StepData, StepFn, new_step

import numpy as np

from darknet_metal.errors import ArgumentError, ArgumentTypeError
from darknet_metal.cpu.checks import (check_disjoint, check_input, check_out,
                                      check_shaped_like)

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
    # Backward: the slots of the sources' deltas, and whether this is the layer's last step
    # (which turns the gradient of the normalised weights into that of the raw ones).
    int grad_role[STEP_BUFFERS]
    bint last


cdef floating _norm_total(const floating* w, Py_ssize_t base, Py_ssize_t stride,
                          const ShortcutParams* p, floating* max_val,
                          Py_ssize_t* top) noexcept nogil:
    """The normalisation's denominator ``1e-4 + sum`` over the weights ``w[base + i*stride]``
    of the inputs; softmax also gives their maximum and the first input holding it."""
    cdef Py_ssize_t i
    cdef floating total, v, zero = 0
    max_val[0] = -FLT_MAX
    top[0] = 0
    if p.norm == NORM_SOFTMAX:
        for i in range(p.n_inputs):
            v = w[base + i * stride]
            if max_val[0] < v:
                max_val[0] = v
                top[0] = i
    total = <floating>0.0001
    for i in range(p.n_inputs):
        v = w[base + i * stride]
        if p.norm == NORM_RELU:
            total = total + (v if v > zero else zero)
        elif p.norm == NORM_SOFTMAX:
            total = total + fexp(v - max_val[0])
    return total


@cython.cdivision(True)
cdef inline floating _norm_weight(floating v, floating max_val, floating total,
                                  int norm) noexcept nogil:
    cdef floating zero = 0
    if norm == NORM_RELU:
        return (v if v > zero else zero) / total
    elif norm == NORM_SOFTMAX:
        return fexp(v - max_val) / total
    return v


cdef void _normalize_weights(const floating* w, floating* table,
                             const ShortcutParams* p) noexcept nogil:
    # table[i*C + c]: the weight of input i (0 = x, 1.. = sources) at channel c. Darknet
    # recomputes it per element; the operations and their order are the same for every
    # element of a channel, so computing it once per channel gives equal values. Computed
    # on every run because training changes the weights between passes.
    cdef Py_ssize_t channels = p.channels, c, i, base, top
    cdef Py_ssize_t stride = channels if p.per_channel else 1
    cdef floating max_val, total
    for c in range(channels):
        base = c if p.per_channel else 0
        total = _norm_total(w, base, stride, p, &max_val, &top)
        for i in range(p.n_inputs):
            table[i * channels + c] = _norm_weight(w[base + i * stride], max_val, total, p.norm)


cdef void _shortcut_planes(floating* out, const floating* table, const StepData* d,
                           const ShortcutParams* p, Py_ssize_t first,
                           Py_ssize_t last) noexcept nogil:
    # Planes [first, last) of out (plane b*C + c): x (scaled) written first, then the sources
    # added one after the other, as Darknet adds them, so every element rounds alike however
    # the planes are shared out.
    cdef const floating* x = <const floating*>d.buf[SHORTCUT_X]
    cdef const floating* src
    cdef floating* dst
    cdef Py_ssize_t channels = p.channels, spatial = p.spatial, q, b, c, c_add, i
    cdef floating wt
    cdef int k
    cdef const floating* xq
    cdef floating w0
    cdef int k0
    for q in range(first, last):
        b, c = q // channels, q % channels
        dst = out + q * spatial
        xq = x + q * spatial
        k0 = 0
        if p.first and p.n_sources > 0 and c < p.source_channels[0]:
            # x and the first source in one pass over the plane (the same two roundings as
            # writing x, then adding the source).
            k0 = 1
            src = (<const floating*>d.buf[p.source_role[0]]
                   + (b * p.source_channels[0] + c) * spatial)
            if p.weighted:
                w0, wt = table[c], table[p.first_row * channels + c]
                for i in range(spatial):
                    dst[i] = xq[i] * w0 + src[i] * wt
            else:
                for i in range(spatial):
                    dst[i] = xq[i] + src[i]
        elif p.first:
            if p.weighted:
                wt = table[c]
                for i in range(spatial):
                    dst[i] = xq[i] * wt
            elif xq != dst:
                memmove(dst, xq, spatial * sizeof(floating))
        for k in range(k0, p.n_sources):
            c_add = p.source_channels[k]
            if c >= c_add:
                continue
            src = <const floating*>d.buf[p.source_role[k]] + (b * c_add + c) * spatial
            if p.weighted:
                wt = table[(p.first_row + k) * channels + c]
                for i in range(spatial):
                    dst[i] = dst[i] + src[i] * wt
            else:
                for i in range(spatial):
                    dst[i] = dst[i] + src[i]


#: Least elements of a shortcut whose planes are shared out among the executor's threads.
cdef Py_ssize_t SHORTCUT_SPLIT_ELEMENTS = 1 << 16


ctypedef struct ShortcutJob:
    const StepData* d
    const ShortcutParams* p
    Py_ssize_t span  # planes per part


cdef void _shortcut_part(void* ctx, int part) noexcept nogil:
    cdef ShortcutJob* j = <ShortcutJob*>ctx
    cdef Py_ssize_t first = part * j.span
    cdef Py_ssize_t last = min(j.p.batch * j.p.channels, first + j.span)
    if j.d.f32:
        _shortcut_planes(<float*>j.d.buf[SHORTCUT_OUT], <const float*>j.d.buf[SHORTCUT_TABLE],
                         j.d, j.p, first, last)
    else:
        _shortcut_planes(<double*>j.d.buf[SHORTCUT_OUT],
                         <const double*>j.d.buf[SHORTCUT_TABLE], j.d, j.p, first, last)


cdef void _shortcut_step(const StepData* d) noexcept nogil:
    cdef const ShortcutParams* p = <const ShortcutParams*>d.params
    cdef ShortcutJob job
    cdef Py_ssize_t planes = p.batch * p.channels, parts = 1
    if p.first and p.weighted:
        # The normalised weights, once for every plane.
        if d.f32:
            _normalize_weights(<const float*>d.buf[SHORTCUT_WEIGHTS],
                               <float*>d.buf[SHORTCUT_TABLE], p)
        else:
            _normalize_weights(<const double*>d.buf[SHORTCUT_WEIGHTS],
                               <double*>d.buf[SHORTCUT_TABLE], p)
    if planes < 1:
        return
    if planes * p.spatial >= SHORTCUT_SPLIT_ELEMENTS:
        parts = min(planes, <Py_ssize_t>cpu_threads() * 4)
    job.d, job.p = d, p
    job.span = (planes + parts - 1) // parts
    run_parts(_shortcut_part, &job, <int>((planes + job.span - 1) // job.span))


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
    wtype, norm, weighted = _shortcut_config(x, sources, weights, weights_type,
                                             weights_normalization)
    check_out(out, x, x.shape)
    table = np.empty((len(sources) + 1) * max(x.shape[1], 1), x.dtype) if weighted else None
    # Every source is read before out is written, so out may alias x but not a source.
    for k, src in enumerate(sources):
        if np.shares_memory(out, src):
            raise ArgumentError(f"out must not share memory with sources[{k}]")

    return _shortcut_steps(_shortcut_step, "shortcut",
                           {SHORTCUT_OUT: out, SHORTCUT_TABLE: table},
                           {SHORTCUT_X: x, SHORTCUT_WEIGHTS: weights},
                           [(src,) for src in sources], True, False, x, sources, wtype, norm)


cdef list _shortcut_steps(StepFn fn, str kind, dict always, dict first_only, list groups,
                          bint outputs, bint grads, x, sources, str wtype, str norm):
    """The steps of one shortcut pass: every step binds ``always``, the first one also
    ``first_only`` (role -> array, None for unbound), and each takes the next source
    groups that fit its free slots: (source output if ``outputs``, its delta if
    ``grads``). The first step is ``kind``, the others ``kind + "_add"``."""
    steps = []
    done = 0  # sources bound so far
    while not steps or done < len(sources):
        first = not steps
        arrays = [None] * STEP_BUFFERS
        for role, a in (always | first_only if first else always).items():
            arrays[role] = a
        roles = [(slots[0] if outputs else -1, slots[len(slots) - 1] if grads else -1)
                 for slots in _bind_groups(arrays, groups, done)]
        steps.append(_shortcut_new(fn, kind if first else kind + "_add", arrays, x, sources,
                                   wtype, norm, first, done, roles))
        done += len(roles)
    return steps


cdef NativeStep _shortcut_new(StepFn fn, str kind, list arrays, x, sources, str wtype,
                              str norm, bint first, int done, list roles):
    """A step of ``fn`` on ``arrays`` handling the sources from ``sources[done]`` on, one per
    entry of ``roles``: (slot of its output or -1, slot of its delta or -1)."""
    cdef NativeStep step = new_step(fn, kind, tuple(arrays), x.dtype == np.float32,
                                    sizeof(ShortcutParams))
    cdef ShortcutParams* p = <ShortcutParams*>step.data.params
    cdef int i
    n, c, h, w = x.shape
    p.batch, p.channels, p.spatial = n, c, h * w
    p.n_inputs = len(sources) + 1
    p.norm = WEIGHTS_NORMALIZATIONS.index(norm)
    p.weighted = wtype != "none"
    p.per_channel = wtype == "per_channel"
    p.first = first
    p.first_row = done + 1
    p.n_sources = len(roles)
    for i, (source_role, grad_role) in enumerate(roles):
        p.source_role[i] = source_role
        p.grad_role[i] = grad_role
        p.source_channels[i] = sources[done + i].shape[1]
    p.last = done + len(roles) == len(sources)
    return step


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


def _shortcut_config(x, sources, weights, str weights_type, str weights_normalization):
    """Check a shortcut's x, sources and weights; return (weights type, normalisation,
    weighted) with Darknet's aliases resolved."""
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
    wtype = _TYPE_ALIASES.get(weights_type, weights_type)
    norm = _NORM_ALIASES.get(weights_normalization, weights_normalization)
    if wtype not in WEIGHTS_TYPES:
        raise ArgumentError(f"weights_type must be one of {WEIGHTS_TYPES}, not {weights_type!r}")
    if norm not in WEIGHTS_NORMALIZATIONS:
        raise ArgumentError(f"weights_normalization must be one of {WEIGHTS_NORMALIZATIONS}, "
                         f"not {weights_normalization!r}")
    weighted = wtype != "none"
    if weighted:
        expected = (len(sources) + 1) * (c if wtype == "per_channel" else 1)
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
    elif weights is not None:
        raise ArgumentError("weights must be None when weights_type is 'none'")
    return wtype, norm, weighted


def _bind_groups(arrays, groups, start):
    """Put whole groups (tuples of arrays), from groups[start] on, into the None slots of
    ``arrays`` in order, as many as fit; return the slots of each group placed."""
    free = [role for role in range(STEP_BUFFERS) if arrays[role] is None]
    placed = []
    for group in groups[start:]:
        if len(group) > len(free):
            break
        slots, free = free[:len(group)], free[len(group):]
        for role, a in zip(slots, group):
            arrays[role] = a
        placed.append(slots)
    return placed


# ----------------------------------------------------------------------------------------
# shortcut backward

cdef enum:  # buffer roles; the slots a step leaves unused hold sources and their deltas
    SHORTCUT_B_DELTA, SHORTCUT_B_X, SHORTCUT_B_X_GRAD, SHORTCUT_B_WEIGHTS,
    SHORTCUT_B_WEIGHT_GRAD, SHORTCUT_B_SCRATCH


cdef void _shortcut_input_backward(const floating* delta, const floating* inp, floating* grad,
                                   Py_ssize_t c_in, const floating* table, Py_ssize_t row,
                                   floating* acc, const ShortcutParams* p) noexcept nogil:
    # One input of the layer (row 0 = x): grad[:, :c_min] += delta * w_row, and, weighted,
    # acc[weight index] += sum(delta * input), in Darknet's element order.
    cdef Py_ssize_t c_out = p.channels, spatial = p.spatial, b, c, i, at, at_in, wi
    cdef Py_ssize_t c_min = c_out if c_out < c_in else c_in
    cdef floating wt, total
    for b in range(p.batch):
        for c in range(c_min):
            at = (b * c_out + c) * spatial
            at_in = (b * c_in + c) * spatial
            if not p.weighted:
                for i in range(spatial):
                    grad[at_in + i] = grad[at_in + i] + delta[at + i]
                continue
            wt = table[row * c_out + c]
            for i in range(spatial):
                grad[at_in + i] = grad[at_in + i] + delta[at + i] * wt
            wi = row * c_out + c if p.per_channel else row
            total = acc[wi]
            for i in range(spatial):
                total = total + delta[at + i] * inp[at_in + i]
            acc[wi] = total


@cython.cdivision(True)
cdef void _normalization_backward(const floating* w, const floating* g, floating* w_grad,
                                  const ShortcutParams* p) noexcept nogil:
    # w_grad[j] += sum_k g[k] * d(normalised w_k)/d(raw w_j), per channel for per_channel
    # (weights and gradients indexed input-major, like the weights). With S = 1e-4 + sum of
    # the terms: relu: d/dv_j = [v_j > 0]/S * (delta_kj - w_k); softmax (terms exp(v - m),
    # m the first maximum): w_k*(delta_kj - w_j), less w_k*1e-4/S for j the maximum, since
    # shifting by m scales the 1e-4 with exp(m).
    cdef Py_ssize_t col, j, at, top
    cdef Py_ssize_t columns = p.channels if p.per_channel else 1
    cdef Py_ssize_t stride = p.channels if p.per_channel else 1
    cdef floating max_val, total, dot, v, d, zero = 0
    for col in range(columns):
        total = _norm_total(w, col, stride, p, &max_val, &top)
        dot = zero
        for j in range(p.n_inputs):
            at = col + j * stride
            dot = dot + _norm_weight(w[at], max_val, total, p.norm) * g[at]
        for j in range(p.n_inputs):
            at = col + j * stride
            v = w[at]
            if p.norm == NORM_RELU:
                d = (g[at] - dot) / total if v > zero else zero
            else:
                d = _norm_weight(v, max_val, total, p.norm) * (g[at] - dot)
                if j == top:
                    d = d - <floating>0.0001 / total * dot
            w_grad[at] = w_grad[at] + d


cdef void _shortcut_backward(const floating* delta, floating* scratch, const StepData* d,
                             const ShortcutParams* p) noexcept nogil:
    cdef floating* weight_grad = <floating*>d.buf[SHORTCUT_B_WEIGHT_GRAD]
    cdef const floating* weights = <const floating*>d.buf[SHORTCUT_B_WEIGHTS]
    cdef Py_ssize_t n_weights = p.n_inputs * (p.channels if p.per_channel else 1)
    # Normalised, the gradient of the normalised weights is summed in the scratch after the
    # table, and the last step maps it to the raw weights; else it is the raw one.
    cdef floating* acc = weight_grad
    cdef int k
    cdef const floating* source
    if p.weighted and p.norm != NORM_NONE:
        acc = scratch + p.n_inputs * p.channels
    if p.first:
        if p.weighted:
            _normalize_weights(weights, scratch, p)
            if p.norm != NORM_NONE:
                memset(acc, 0, n_weights * sizeof(floating))
        _shortcut_input_backward(delta, <const floating*>d.buf[SHORTCUT_B_X],
                                 <floating*>d.buf[SHORTCUT_B_X_GRAD], p.channels, scratch, 0,
                                 acc, p)
    for k in range(p.n_sources):
        # Unweighted, the sources' outputs are not bound (role -1) and not read.
        source = <const floating*>d.buf[p.source_role[k]] if p.source_role[k] >= 0 else NULL
        _shortcut_input_backward(delta, source, <floating*>d.buf[p.grad_role[k]],
                                 p.source_channels[k], scratch, p.first_row + k, acc, p)
    if p.last and p.weighted and p.norm != NORM_NONE:
        _normalization_backward(weights, acc, weight_grad, p)


cdef void _shortcut_backward_step(const StepData* d) noexcept nogil:
    cdef const ShortcutParams* p = <const ShortcutParams*>d.params
    if d.f32:
        _shortcut_backward(<const float*>d.buf[SHORTCUT_B_DELTA],
                           <float*>d.buf[SHORTCUT_B_SCRATCH], d, p)
    else:
        _shortcut_backward(<const double*>d.buf[SHORTCUT_B_DELTA],
                           <double*>d.buf[SHORTCUT_B_SCRATCH], d, p)


def shortcut_backward_step(delta, x, sources, weights, str weights_type,
                           str weights_normalization, x_grad, source_grads,
                           weight_grad=None) -> list:
    """Darknet ``[shortcut]`` backward after its activation's derivative
    (backward_shortcut_multilayer_cpu), as a list of NativeSteps to run in order; every
    gradient is ADDED into its array.

    delta: (N, C, H, W), the layer's delta, already multiplied by the activation's
    derivative; x, sources, weights, weights_type, weights_normalization: as given to
    ``shortcut_step`` (x and the sources are read only for the weight gradient); x_grad:
    like x, the previous layer's delta; source_grads: one array like each source, the
    ``from=`` layers' deltas (x_grad and these may be the same array when a layer feeds the
    shortcut twice); weight_grad: weighted, an array of x's dtype with as many elements as
    weights, laid out like them (Darknet's ``weight_updates``), else None.

    With w_k the normalised weights: ``x_grad += delta * w_0`` and ``source_grads[k][:, :m]
    += delta[:, :m] * w_k`` (m = min(C, C_k): channels beyond a source's get nothing);
    unweighted, w_k = 1. ``weight_grad`` gets the gradient of ``sum(delta * out)`` with
    respect to the RAW weights: the sums ``sum(delta * input_k)`` per weight (per channel
    for per_channel) taken through the exact derivative of the relu or softmax
    normalisation. Darknet's CPU leaves that derivative out (its GPU build keeps only the
    diagonal), so the two agree for weights_normalization "none" only.
    """
    wtype, norm, weighted = _shortcut_config(x, sources, weights, weights_type,
                                             weights_normalization)
    check_shaped_like("delta", delta, x, "x")
    check_shaped_like("x_grad", x_grad, x, "x", writable=True)
    if isinstance(source_grads, np.ndarray) or not isinstance(source_grads, (list, tuple)):
        raise ArgumentTypeError("source_grads must be a list of arrays")
    if len(source_grads) != len(sources):
        raise ArgumentError(f"source_grads must have one array per source ({len(sources)}), "
                            f"not {len(source_grads)}")
    for k, grad in enumerate(source_grads):
        check_shaped_like(f"source_grads[{k}]", grad, sources[k], f"sources[{k}]",
                          writable=True)
    if weighted:
        if not isinstance(weight_grad, np.ndarray):
            raise ArgumentTypeError(f"weight_grad must be a numpy array when weights_type is "
                                    f"{wtype!r}, not {type(weight_grad).__name__}")
        if (weight_grad.dtype != x.dtype or weight_grad.size != weights.size
                or not weight_grad.flags.c_contiguous or not weight_grad.flags.writeable):
            raise ArgumentError(f"weight_grad must be a writable C-contiguous {x.dtype} array "
                                f"of {weights.size} elements like weights, not a "
                                f"{weight_grad.dtype} array of {weight_grad.size}")
    elif weight_grad is not None:
        raise ArgumentError("weight_grad must be None when weights_type is 'none'")
    grads = {"x_grad": x_grad}
    grads.update({f"source_grads[{k}]": g for k, g in enumerate(source_grads)})
    read = {"delta": delta, "x": x, "weights": weights}
    read.update({f"sources[{k}]": src for k, src in enumerate(sources)})
    check_disjoint(grads, read)
    if weighted:
        check_disjoint({"weight_grad": weight_grad}, {**read, **grads})

    # The table of normalised weights, then (normalised) their gradient.
    scratch = (np.empty((len(sources) + 1) * x.shape[1] + weights.size, x.dtype) if weighted
               else None)
    # Weighted, a source needs its output (for the weight gradient) beside its delta.
    groups = [(src, grad) if weighted else (grad,) for src, grad in zip(sources, source_grads)]
    always = {SHORTCUT_B_DELTA: delta}
    if weighted:
        always |= {SHORTCUT_B_WEIGHTS: weights, SHORTCUT_B_WEIGHT_GRAD: weight_grad,
                   SHORTCUT_B_SCRATCH: scratch}
    return _shortcut_steps(_shortcut_backward_step, "shortcut_backward", always,
                           {SHORTCUT_B_X_GRAD: x_grad, SHORTCUT_B_X: x if weighted else None},
                           groups, weighted, True, x, sources, wtype, norm)


def shortcut_backward(delta, x, sources, weights, str weights_type, str weights_normalization,
                      x_grad, source_grads, weight_grad=None) -> None:
    """``shortcut_backward_step(...)`` with the same arguments, run once."""
    for step in shortcut_backward_step(delta, x, sources, weights, weights_type,
                                       weights_normalization, x_grad, source_grads,
                                       weight_grad):
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
    _check_scale_channels(x_from, scale, scale_wh)
    check_out(out, x_from, x_from.shape, like_name="x_from")
    return _scale_channels_new(_scale_channels_step, "scale_channels", (x_from, scale, out),
                               x_from, scale_wh)


def _check_scale_channels(x_from, scale, bint scale_wh):
    check_input("x_from", x_from)
    check_input("scale", scale, like=x_from, like_name="x_from")
    n, c, h, w = x_from.shape
    expected = (n, 1, h, w) if scale_wh else (n, c, 1, 1)
    if tuple(scale.shape) != expected:
        raise ArgumentError(f"scale must have shape {expected} "
                         f"({'scale_wh' if scale_wh else 'per channel'}), not {scale.shape}")


cdef NativeStep _scale_channels_new(StepFn fn, str kind, tuple arrays, x_from,
                                    bint scale_wh):
    cdef NativeStep step = new_step(fn, kind, arrays, x_from.dtype == np.float32,
                                    sizeof(ScaleChannelsParams))
    cdef ScaleChannelsParams* p = <ScaleChannelsParams*>step.data.params
    n, c, h, w = x_from.shape
    p.batch, p.channels, p.spatial = n, c, h * w
    p.scale_wh = scale_wh
    return step


def scale_channels_forward(x_from, scale, out, bint scale_wh=False) -> None:
    """``scale_channels_step(x_from, scale, out, scale_wh)`` run once."""
    scale_channels_step(x_from, scale, out, scale_wh).run()


cdef enum:  # buffer roles
    SCALE_B_DELTA, SCALE_B_X_FROM, SCALE_B_SCALE, SCALE_B_X_FROM_GRAD, SCALE_B_SCALE_GRAD


cdef void _scale_channels_backward(const floating* delta, const floating* src,
                                   const floating* sc, floating* src_grad, floating* sc_grad,
                                   const ScaleChannelsParams* p) noexcept nogil:
    # Darknet's loop: element by element, each product added straight into its delta, so
    # a factor's sum rounds as Darknet's single-threaded loop rounds it.
    cdef Py_ssize_t channels = p.channels, spatial = p.spatial, b, c, i, at, k
    for b in range(p.batch):
        for c in range(channels):
            at = (b * channels + c) * spatial
            for i in range(spatial):
                k = b * spatial + i if p.scale_wh else b * channels + c
                sc_grad[k] = sc_grad[k] + delta[at + i] * src[at + i]
                src_grad[at + i] = src_grad[at + i] + sc[k] * delta[at + i]


cdef void _scale_channels_backward_step(const StepData* d) noexcept nogil:
    cdef const ScaleChannelsParams* p = <const ScaleChannelsParams*>d.params
    if d.f32:
        _scale_channels_backward(
            <const float*>d.buf[SCALE_B_DELTA], <const float*>d.buf[SCALE_B_X_FROM],
            <const float*>d.buf[SCALE_B_SCALE], <float*>d.buf[SCALE_B_X_FROM_GRAD],
            <float*>d.buf[SCALE_B_SCALE_GRAD], p)
    else:
        _scale_channels_backward(
            <const double*>d.buf[SCALE_B_DELTA], <const double*>d.buf[SCALE_B_X_FROM],
            <const double*>d.buf[SCALE_B_SCALE], <double*>d.buf[SCALE_B_X_FROM_GRAD],
            <double*>d.buf[SCALE_B_SCALE_GRAD], p)


def scale_channels_backward_step(delta, x_from, scale, x_from_grad, scale_grad,
                                 bint scale_wh=False) -> NativeStep:
    """Darknet ``[scale_channels]`` backward after its activation's derivative
    (backward_scale_channels_layer), both gradients ADDED into their arrays.

    delta: like x_from, the layer's delta times the activation's derivative; x_from,
    scale, scale_wh: as given to ``scale_channels_step``; x_from_grad: like x_from, the
    ``from=`` layer's delta; scale_grad: like scale, the previous layer's delta.
    ``x_from_grad += scale * delta`` (broadcast) and ``scale_grad += sum(delta * x_from)``
    over each factor's pixels (H*W per channel, or the C channels of a pixel with
    scale_wh).
    """
    _check_scale_channels(x_from, scale, scale_wh)
    check_shaped_like("delta", delta, x_from, "x_from")
    check_shaped_like("x_from_grad", x_from_grad, x_from, "x_from", writable=True)
    check_shaped_like("scale_grad", scale_grad, scale, "scale", writable=True)
    check_disjoint({"x_from_grad": x_from_grad, "scale_grad": scale_grad},
                   {"delta": delta, "x_from": x_from, "scale": scale})
    return _scale_channels_new(_scale_channels_backward_step, "scale_channels_backward",
                               (delta, x_from, scale, x_from_grad, scale_grad), x_from,
                               scale_wh)


def scale_channels_backward(delta, x_from, scale, x_from_grad, scale_grad,
                            bint scale_wh=False) -> None:
    """``scale_channels_backward_step(delta, x_from, scale, x_from_grad, scale_grad,
    scale_wh)`` run once."""
    scale_channels_backward_step(delta, x_from, scale, x_from_grad, scale_grad, scale_wh).run()



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
    _check_sam(x_from, x)
    check_out(out, x_from, x_from.shape, like_name="x_from")
    return _sam_new(_sam_step, "sam", (x_from, x, out), x_from)


def _check_sam(x_from, x):
    check_input("x_from", x_from)
    check_shaped_like("x", x, x_from, "x_from")


cdef NativeStep _sam_new(StepFn fn, str kind, tuple arrays, x_from):
    cdef NativeStep step = new_step(fn, kind, arrays, x_from.dtype == np.float32,
                                    sizeof(SamParams))
    (<SamParams*>step.data.params).n = x_from.size
    return step


def sam_forward(x_from, x, out) -> None:
    """``sam_step(x_from, x, out)`` run once."""
    sam_step(x_from, x, out).run()


cdef enum:  # buffer roles
    SAM_B_DELTA, SAM_B_X_FROM, SAM_B_X, SAM_B_X_FROM_GRAD, SAM_B_X_GRAD


cdef void _sam_backward(const floating* delta, const floating* x_from, const floating* x,
                        floating* x_from_grad, floating* x_grad,
                        const SamParams* p) noexcept nogil:
    cdef Py_ssize_t i
    for i in range(p.n):
        x_grad[i] = x_grad[i] + delta[i] * x_from[i]
        x_from_grad[i] = x_from_grad[i] + x[i] * delta[i]


cdef void _sam_backward_step(const StepData* d) noexcept nogil:
    cdef const SamParams* p = <const SamParams*>d.params
    if d.f32:
        _sam_backward(<const float*>d.buf[SAM_B_DELTA], <const float*>d.buf[SAM_B_X_FROM],
                      <const float*>d.buf[SAM_B_X], <float*>d.buf[SAM_B_X_FROM_GRAD],
                      <float*>d.buf[SAM_B_X_GRAD], p)
    else:
        _sam_backward(<const double*>d.buf[SAM_B_DELTA], <const double*>d.buf[SAM_B_X_FROM],
                      <const double*>d.buf[SAM_B_X], <double*>d.buf[SAM_B_X_FROM_GRAD],
                      <double*>d.buf[SAM_B_X_GRAD], p)


def sam_backward_step(delta, x_from, x, x_from_grad, x_grad) -> NativeStep:
    """Darknet ``[sam]`` backward after its activation's derivative (backward_sam_layer with
    its "from" delta added to, as the golden data's Darknet does), both ADDED into:
    ``x_grad += delta * x_from`` and ``x_from_grad += x * delta``.

    All arrays have x_from's shape and dtype: delta, the layer's delta times the
    activation's derivative; x_from and x as given to ``sam_step``; x_from_grad and x_grad,
    the deltas of the ``from=`` and the previous layer (they may be one array).
    """
    _check_sam(x_from, x)
    check_shaped_like("delta", delta, x_from, "x_from")
    check_shaped_like("x_from_grad", x_from_grad, x_from, "x_from", writable=True)
    check_shaped_like("x_grad", x_grad, x_from, "x_from", writable=True)
    check_disjoint({"x_from_grad": x_from_grad, "x_grad": x_grad},
                   {"delta": delta, "x_from": x_from, "x": x})
    return _sam_new(_sam_backward_step, "sam_backward",
                    (delta, x_from, x, x_from_grad, x_grad), x_from)


def sam_backward(delta, x_from, x, x_from_grad, x_grad) -> None:
    """``sam_backward_step(delta, x_from, x, x_from_grad, x_grad)`` run once."""
    sam_backward_step(delta, x_from, x, x_from_grad, x_grad).run()
