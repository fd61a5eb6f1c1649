from cython cimport floating

# Row-major GEMM over SciPy's BLAS; see blas.pyx for the contract.
cdef void gemm_rowmajor(bint trans_a, bint trans_b, int m, int n, int k,
                        const floating* a, int lda, const floating* b, int ldb,
                        floating beta, floating* c, int ldc) noexcept nogil

# ``count`` GEMMs C_i = op(A_i) @ op(B_i) + beta*C_i, the i-th operands ``stride_*`` elements
# after the (i-1)-th; float32 batches share one job of the GEMM threads (one GEMM a part).
cdef void gemm_rowmajor_batch(int count, bint trans_a, bint trans_b, int m, int n, int k,
                              const floating* a, int lda, size_t stride_a,
                              const floating* b, int ldb, size_t stride_b,
                              floating beta, floating* c, int ldc,
                              size_t stride_c) noexcept nogil
