"""Cython CPU reference kernels: im2col, convolution, activations and the other layers.

Shared contract of the Python entry points (``*_forward``, ``activate``, ``gradient``): arrays
are C-contiguous numpy arrays, float32 or float64, all of one dtype, checked by ``checks``
before any kernel runs: TypeError for something that is not an array, ValueError for a wrong
shape, dtype, contiguity or a read-only array the call writes. Outputs are written in full
(but for ``route_forward``, which fills one run of channels of the route's output).
The loops then run without the GIL.

The cdef kernels other modules call are declared in ``.pxd`` files, all ``noexcept nogil``
and generic over float32/float64 through Cython's ``floating`` fused type:

- ``blas.pxd``: ``gemm_rowmajor``, the only way into SciPy's BLAS.
- ``im2col.pxd``: ``im2col``, the unfolding of convolution windows.
- ``activations.pxd``: the ``ACT_*`` ids and the in-place activation/gradient kernels.
- ``kernels.pxd``: declarations of ``kernels.h``, the float32 loops written in C.
- ``fmath.pxd``: precision-matched libm wrappers and the logistic, defined inline.
"""
