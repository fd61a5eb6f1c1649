# cython: language_level=3
"""Output heads: the CPU reference for ``[softmax]`` and ``[yolo]`` forward passes.

``softmax_forward`` is Darknet's softmax_cpu as forward_softmax_layer calls it (no
hierarchical ``tree=`` softmax). ``yolo_forward`` produces Darknet's ``[yolo]``
``layer.output`` (forward_yolo_layer at inference): box decoding and NMS are separate.

Contract: the package's (``darknet_metal.cpu``): C-contiguous float32 or float64 arrays,
checked by ``checks``; ``out`` has the shape and dtype of ``x`` and may be ``x``; the loops
run without the GIL.
"""

cimport cython
from cython cimport floating
from libc.float cimport FLT_MAX
from libc.math cimport exp

from darknet_metal.cpu.fmath cimport logistic

import numpy as np

from darknet_metal.errors import ArgumentError
from darknet_metal.cpu.checks import check_input, check_out


# ----------------------------------------------------------------------------------------
# softmax

@cython.cdivision(True)
def _softmax(const floating[:, ::1] x, floating[:, ::1] out, int groups, floating temp):
    cdef Py_ssize_t batch = x.shape[0], inputs = x.shape[1]
    cdef Py_ssize_t n = inputs // groups, task, i
    cdef floating largest, total, e, zero = 0
    if batch * inputs == 0:
        return
    cdef const floating* src = &x[0, 0]
    cdef floating* dst = &out[0, 0]
    with nogil:
        # Group g of sample b starts at b*inputs + g*n == (b*groups + g)*n.
        for task in range(batch * groups):
            largest = -FLT_MAX
            for i in range(n):
                if src[task * n + i] > largest:
                    largest = src[task * n + i]
            total = zero
            for i in range(n):
                # Darknet calls the double exp on a float argument and stores a float.
                e = <floating>exp(<double>(src[task * n + i] / temp - largest / temp))
                total = total + e
                dst[task * n + i] = e
            for i in range(n):
                dst[task * n + i] = dst[task * n + i] / total


def softmax_forward(x, out, int groups=1, double temperature=1.0) -> None:
    """Darknet ``[softmax]`` forward: softmax_cpu(x, F/groups, N, F, groups, F/groups, 1, T).

    x: (N, F) or (N, C, H, W) float32/float64, C-contiguous, each sample taken as F values
    in memory order; out: same shape and dtype (may be x). Each sample is split into
    ``groups`` consecutive runs of F/groups values and each run becomes
    ``exp(x/T - max/T) / sum``, the maximum taken over the run.
    """
    check_input("x", x, (2, 4))
    check_out(out, x, x.shape)
    features = x.shape[1] if x.ndim == 2 else x.shape[1] * x.shape[2] * x.shape[3]
    if groups < 1 or features % groups:
        raise ArgumentError(f"softmax groups={groups} must be >= 1 and divide the {features} "
                         "inputs per sample")
    if temperature == 0 or not np.isfinite(temperature):
        raise ArgumentError(f"softmax temperature must be finite and non-zero, got {temperature}")
    _softmax(x.reshape(x.shape[0], -1), out.reshape(out.shape[0], -1), groups, temperature)


# ----------------------------------------------------------------------------------------
# yolo

@cython.cdivision(True)
def _yolo(const floating[:, :, :, ::1] x, floating[:, :, :, ::1] out, int n, int classes,
          floating alpha, floating beta, bint new_coords):
    cdef Py_ssize_t batch = x.shape[0], channels = x.shape[1]
    cdef Py_ssize_t spatial = x.shape[2] * x.shape[3], entries = 5 + classes
    cdef Py_ssize_t task, i, base
    if batch * channels * spatial == 0:
        return
    cdef const floating* src = &x[0, 0, 0, 0]
    cdef floating* dst = &out[0, 0, 0, 0]
    with nogil:
        for task in range(batch * n):
            # Anchor a of sample b owns channels [a*entries, (a+1)*entries) of that sample.
            base = task * entries * spatial
            for i in range(entries * spatial):
                dst[base + i] = src[base + i]
            if not new_coords:
                for i in range(2 * spatial):
                    dst[base + i] = logistic(dst[base + i])
                for i in range(4 * spatial, entries * spatial):
                    dst[base + i] = logistic(dst[base + i])
            for i in range(2 * spatial):
                dst[base + i] = dst[base + i] * alpha + beta


def yolo_forward(x, out, int n, int classes, double scale_x_y=1.0, bint new_coords=False) -> None:
    """Darknet ``[yolo]`` forward: the layer's ``output`` as forward_yolo_layer leaves it.

    x: (N, n*(5+classes), H, W), the preceding convolution's output; out: same shape and
    dtype (may be x). n is the number of anchors in ``mask``. Per anchor the channels are
    x, y, w, h, objectness, classes. Unless new_coords, the logistic ``1/(1+exp(-v))`` is
    applied to x, y, objectness and the classes (w, h are left raw); then, always,
    ``x, y = v*scale_x_y - 0.5*(scale_x_y - 1)`` (computed in float32 for float32 input,
    as Darknet's scal_add_cpu does).
    """
    check_input("x", x)
    check_out(out, x, x.shape)
    if n < 1 or classes < 0:
        raise ArgumentError(f"yolo needs n >= 1 anchors and classes >= 0, got n={n} "
                         f"classes={classes}")
    if x.shape[1] != n * (5 + classes):
        raise ArgumentError(f"yolo with n={n} anchors and classes={classes} needs "
                         f"{n * (5 + classes)} input channels, got {x.shape[1]}")
    if x.dtype == np.float32:
        alpha = np.float32(scale_x_y)
        beta = np.float32(-0.5) * (alpha - np.float32(1))
    else:
        alpha = scale_x_y
        beta = -0.5 * (scale_x_y - 1.0)
    _yolo(x, out, n, classes, alpha, beta, new_coords)
