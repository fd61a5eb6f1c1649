# cython: language_level=3
"""Row-major GEMM for the CPU layers, over SciPy's BLAS (``scipy.linalg.cython_blas``).

The only place the CPU reference calls BLAS; other modules ``cimport`` from ``blas.pxd``.

``gemm_rowmajor(trans_a, trans_b, m, n, k, a, lda, b, ldb, beta, c, ldc)`` computes
``C[m, n] = op(A)[m, k] @ op(B)[k, n] + beta*C`` on row-major float32 or float64 matrices
(the ``floating`` fused type; sgemm or dgemm), ``op`` transposing when ``trans_*`` is set.
Leading dimensions are row strides in elements, as for a row-major ``?gemm``. It is
``noexcept nogil``: callers run it inside their own ``with nogil`` blocks, and BLAS may use
its own threads.

BLAS is column-major: a row-major ``C = A @ B`` is issued as the column-major
``C^T = B^T A^T``, which reads the same memory without copies.
"""

from cython cimport floating
from scipy.linalg.cython_blas cimport dgemm, sgemm


cdef void gemm_rowmajor(bint trans_a, bint trans_b, int m, int n, int k,
                        const floating* a, int lda, const floating* b, int ldb,
                        floating beta, floating* c, int ldc) noexcept nogil:
    # Swapping the operands (and their transpose flags) turns the row-major product into
    # the column-major one BLAS computes.
    cdef char ta = b"T" if trans_b else b"N"
    cdef char tb = b"T" if trans_a else b"N"
    cdef floating one = 1
    if floating is float:
        sgemm(&ta, &tb, &n, &m, &k, &one, <float*>b, &ldb, <float*>a, &lda, &beta, c, &ldc)
    else:
        dgemm(&ta, &tb, &n, &m, &k, &one, <double*>b, &ldb, <double*>a, &lda, &beta, c, &ldc)
