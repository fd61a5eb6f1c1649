# cython: language_level=3
"""Row-major GEMM for the CPU layers, over OpenBLAS as the ``scipy-openblas32`` package ships
it (the build SciPy and NumPy use, with its symbols prefixed ``scipy_``), loaded at import:
building needs no BLAS.

The only place the CPU reference calls BLAS; other modules ``cimport`` from ``blas.pxd``.

``gemm_rowmajor(trans_a, trans_b, m, n, k, a, lda, b, ldb, beta, c, ldc)`` computes
``C[m, n] = op(A)[m, k] @ op(B)[k, n] + beta*C`` on row-major float32 or float64 matrices
(the ``floating`` fused type; sgemm or dgemm), ``op`` transposing when ``trans_*`` is set.
Leading dimensions are row strides in elements, as for a row-major ``?gemm``. It is
``noexcept nogil``: callers run it inside their own ``with nogil`` blocks.

BLAS is column-major: a row-major ``C = A @ B`` is issued as the column-major
``C^T = B^T A^T``, which reads the same memory without copies.

Threads: float32 GEMMs run on our own threads (``gemm_threads.h``), BLAS on one thread per
call; float64 (the gradient-checking reference) stays one BLAS call threaded by BLAS. A float32
GEMM of at least ``SPLIT_WORK`` multiply-adds is cut into parts of whole blocks of output
columns (or, when there are too few columns, of output rows), each at least ``PART_WORK``
multiply-adds and ``BLOCK`` columns or rows wide, and the parts are shared by the pool;
smaller GEMMs are one call. Every output element is still the sum over the same ``K``
computed by the same single-threaded BLAS kernel, so the cut never changes a result.
"""

from cython cimport floating

from darknet_metal.cpu.kernels cimport dm_fma_level

import ctypes
import os

import scipy_openblas32

ctypedef void (*sgemm_fn)(char *transa, char *transb, int *m, int *n, int *k, float *alpha,
                          float *a, int *lda, float *b, int *ldb, float *beta, float *c,
                          int *ldc) noexcept nogil
ctypedef void (*dgemm_fn)(char *transa, char *transb, int *m, int *n, int *k, double *alpha,
                          double *a, int *lda, double *b, int *ldb, double *beta, double *c,
                          int *ldc) noexcept nogil


#: The OpenBLAS library, loaded once; it stays loaded while this module lives.
_openblas = ctypes.CDLL(os.path.join(scipy_openblas32.get_lib_dir(),
                                     scipy_openblas32.get_library(fullname=True)))


cdef void* _openblas_function(str name) except NULL:
    """The address of OpenBLAS's Fortran-interface function ``name`` (``scipy_<name>_``)."""
    try:
        function = getattr(_openblas, f"scipy_{name}_")
    except AttributeError:
        raise ImportError(f"{_openblas._name} has no function scipy_{name}_: is "
                          "scipy-openblas32 installed whole?") from None
    return <void*><size_t>ctypes.cast(function, ctypes.c_void_p).value


cdef sgemm_fn sgemm = <sgemm_fn>_openblas_function("sgemm")
cdef dgemm_fn dgemm = <dgemm_fn>_openblas_function("dgemm")


cdef extern from "gemm_threads.h" nogil:
    ctypedef void (*dm_part_fn)(void* ctx, int part) noexcept nogil
    int dm_gemm_threads(void* probe)
    void dm_gemm_run(dm_part_fn fn, void* ctx, int parts)
    void dm_blas_single_enter()
    void dm_blas_single_exit()


#: Below this many multiply-adds (m*n*k) a GEMM is one BLAS call.
cdef double SPLIT_WORK = 4.0 * (1 << 20)
#: Least multiply-adds of one part.
cdef double PART_WORK = 1.0 * (1 << 20)
#: Parts are whole multiples of this many columns (or rows); 64 bytes of float32.
cdef int BLOCK = 16
#: Least columns (or rows) of one part, so each BLAS call keeps its efficiency.
cdef int MIN_SPAN = 64
#: Parts per thread: more parts than threads, so a thread that gets fewer cycles (the cores
#: shared with other processes) takes fewer of them.
cdef int PARTS_PER_THREAD = 1


ctypedef struct GemmJob:
    bint is_float, trans_a, trans_b, split_n
    int m, n, k, lda, ldb, ldc, span, total
    const void* a
    const void* b
    void* c
    double beta


cdef inline void _gemm1(bint is_float, bint trans_a, bint trans_b, int m, int n, int k,
                        const void* a, int lda, const void* b, int ldb, double beta, void* c,
                        int ldc) noexcept nogil:
    # Swapping the operands (and their transpose flags) turns the row-major product into
    # the column-major one BLAS computes.
    cdef char ta = b"T" if trans_b else b"N"
    cdef char tb = b"T" if trans_a else b"N"
    cdef float fone = 1, fbeta = <float>beta
    cdef double done = 1
    if is_float:
        sgemm(&ta, &tb, &n, &m, &k, &fone, <float*>b, &ldb, <float*>a, &lda, &fbeta,
              <float*>c, &ldc)
    else:
        dgemm(&ta, &tb, &n, &m, &k, &done, <double*>b, &ldb, <double*>a, &lda, &beta,
              <double*>c, &ldc)


cdef void _gemm_part(void* ctx, int part) noexcept nogil:
    cdef GemmJob* j = <GemmJob*>ctx
    cdef int lo = part * j.span
    cdef int width = min(j.span, j.total - lo)
    cdef size_t size = sizeof(float) if j.is_float else sizeof(double)
    cdef const char* a = <const char*>j.a
    cdef const char* b = <const char*>j.b
    cdef char* c = <char*>j.c
    if j.split_n:
        # Columns lo..lo+width of C and op(B).
        b += size * (<size_t>lo * j.ldb if j.trans_b else <size_t>lo)
        _gemm1(j.is_float, j.trans_a, j.trans_b, j.m, width, j.k, a, j.lda, b, j.ldb,
               j.beta, c + size * lo, j.ldc)
    else:
        # Rows lo..lo+width of C and op(A).
        a += size * (<size_t>lo if j.trans_a else <size_t>lo * j.lda)
        _gemm1(j.is_float, j.trans_a, j.trans_b, width, j.n, j.k, a, j.lda, b, j.ldb,
               j.beta, c + size * <size_t>lo * j.ldc, j.ldc)


cdef inline int _span(int total, int max_parts) noexcept nogil:
    """Width of each part when ``total`` columns (or rows) go into at most ``max_parts``
    parts of at least MIN_SPAN, rounded up to BLOCK; 0 when fewer than two parts fit."""
    cdef int parts = min(max_parts, total // MIN_SPAN)
    cdef int span
    if parts < 2:
        return 0
    span = (total + parts - 1) // parts
    span = (span + BLOCK - 1) // BLOCK * BLOCK
    return span if (total + span - 1) // span >= 2 else 0


cdef void gemm_rowmajor(bint trans_a, bint trans_b, int m, int n, int k,
                        const floating* a, int lda, const floating* b, int ldb,
                        floating beta, floating* c, int ldc) noexcept nogil:
    cdef GemmJob job
    cdef double work = <double>m * n * k
    cdef int threads
    if floating is double:
        # float64 is the gradient-checking reference: one BLAS call as BLAS threads it, so
        # its results do not depend on how the work is cut.
        _gemm1(False, trans_a, trans_b, m, n, k, a, lda, b, ldb, beta, c, ldc)
        return
    threads = dm_gemm_threads(<void*>sgemm)
    cdef int max_parts = min(threads * PARTS_PER_THREAD, <int>(work / PART_WORK))
    cdef int span = 0
    job.is_float = floating is float
    job.trans_a = trans_a
    job.trans_b = trans_b
    job.m, job.n, job.k = m, n, k
    job.a, job.b, job.c = a, b, c
    job.lda, job.ldb, job.ldc = lda, ldb, ldc
    job.beta = beta
    job.split_n = True
    if threads > 1 and work >= SPLIT_WORK:
        span = _span(n, max_parts)
        if span == 0:
            job.split_n = False
            span = _span(m, max_parts)
    dm_blas_single_enter()
    if span == 0:
        _gemm1(job.is_float, trans_a, trans_b, m, n, k, a, lda, b, ldb, beta, c, ldc)
    else:
        job.span = span
        job.total = n if job.split_n else m
        dm_gemm_run(_gemm_part, &job, (job.total + span - 1) // span)
    dm_blas_single_exit()


ctypedef struct BatchJob:
    bint trans_a, trans_b
    int m, n, k, lda, ldb, ldc
    size_t stride_a, stride_b, stride_c
    const float* a
    const float* b
    float* c
    float beta


cdef void _batch_part(void* ctx, int part) noexcept nogil:
    cdef BatchJob* j = <BatchJob*>ctx
    _gemm1(True, j.trans_a, j.trans_b, j.m, j.n, j.k, j.a + part * j.stride_a, j.lda,
           j.b + part * j.stride_b, j.ldb, j.beta, j.c + part * j.stride_c, j.ldc)


cdef void gemm_rowmajor_batch(int count, bint trans_a, bint trans_b, int m, int n, int k,
                              const floating* a, int lda, size_t stride_a,
                              const floating* b, int ldb, size_t stride_b,
                              floating beta, floating* c, int ldc,
                              size_t stride_c) noexcept nogil:
    cdef BatchJob job
    cdef int i
    if floating is double:
        for i in range(count):
            gemm_rowmajor(trans_a, trans_b, m, n, k, a + i * stride_a, lda, b + i * stride_b,
                          ldb, beta, c + i * stride_c, ldc)
    else:
        # One pool job for the whole batch: each part is one whole GEMM, so a batch of small
        # GEMMs (a Winograd layer's 16) wakes the helpers once instead of once per GEMM.
        dm_gemm_threads(<void*>sgemm)
        job.trans_a, job.trans_b = trans_a, trans_b
        job.m, job.n, job.k = m, n, k
        job.lda, job.ldb, job.ldc = lda, ldb, ldc
        job.stride_a, job.stride_b, job.stride_c = stride_a, stride_b, stride_c
        job.a, job.b, job.c = a, b, c
        job.beta = beta
        dm_blas_single_enter()
        dm_gemm_run(_batch_part, &job, count)
        dm_blas_single_exit()


cdef int cpu_threads() noexcept nogil:
    return dm_gemm_threads(<void*>sgemm)


def cpu_kernels() -> str:
    """The variant of the hand-written FMA kernels (the packed product, the direct
    convolution) this process runs: ``"avx512"``, ``"avx2"`` or ``"portable"``, the widest
    the CPU has unless ``DARKNET_METAL_CPU_KERNELS`` caps it. All compute the same bits."""
    return {4: "avx512", 3: "avx2"}.get(dm_fma_level(), "portable")


cdef void run_parts(part_fn fn, void* ctx, int parts) noexcept nogil:
    dm_gemm_threads(<void*>sgemm)
    dm_blas_single_enter()
    dm_gemm_run(<dm_part_fn>fn, ctx, parts)
    dm_blas_single_exit()
