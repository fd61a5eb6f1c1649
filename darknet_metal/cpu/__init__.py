"""Cython CPU reference kernels: im2col, convolution, activations and the other layers.

Shared contract of the Python entry points (``*_forward``, ``activate``, ``gradient``): arrays
are C-contiguous numpy arrays, float32 or float64, all of one dtype, checked by ``checks``
before any kernel runs: TypeError for something that is not an array, ValueError for a wrong
shape, dtype, contiguity or a read-only array the call writes. Outputs are written in full
(but for ``route_forward``, which fills one run of channels of the route's output).
The loops then run without the GIL.

Training: where a layer's training forward differs from inference there is a
``*_forward_train_step`` (maxpool also records the index of each maximum; ``dropout``, with
its uniform draws, exists only there), and each layer kind has ``*_backward_step`` kernels.
They are linear in the incoming delta and ADD into the deltas of the layer's inputs and into
its parameter gradients, never assign (a layer's output may feed several consumers).
Deltas carry Darknet's sign (truth minus prediction, the negative gradient), which only the
loss steps of ``heads`` fix.

The cdef kernels other modules call are declared in ``.pxd`` files, all ``noexcept nogil``
and generic over float32/float64 through Cython's ``floating`` fused type:

- ``blas.pxd``: ``gemm_rowmajor``, the only way into BLAS (OpenBLAS).
- ``im2col.pxd``: ``im2col``, the unfolding of convolution windows.
- ``activation.pxd``: the ``ACT_*`` ids and the in-place activation/gradient kernels.
- ``kernels.pxd``: declarations of ``kernels.h``, the float32 loops written in C.
- ``fmath.pxd``: precision-matched libm wrappers and the logistic, defined inline.
"""
