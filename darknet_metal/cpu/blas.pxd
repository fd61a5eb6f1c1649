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

# A parallel loop on the executor's GEMM threads: fn(ctx, part) for part in [0, parts), the
# parts handed out one at a time to the caller and the helpers (see blas.pyx); returns when
# all are done. A GEMM called inside a part is one single-threaded BLAS call.
ctypedef void (*part_fn)(void* ctx, int part) noexcept nogil
cdef void run_parts(part_fn fn, void* ctx, int parts) noexcept nogil
# Threads run_parts uses, the caller included.
cdef int cpu_threads() noexcept nogil
