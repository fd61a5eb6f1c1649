from cython cimport floating

# Row-major GEMM over SciPy's BLAS; see blas.pyx for the contract.
cdef void gemm_rowmajor(bint trans_a, bint trans_b, int m, int n, int k,
                        const floating* a, int lda, const floating* b, int ldb,
                        floating beta, floating* c, int ldc) noexcept nogil
