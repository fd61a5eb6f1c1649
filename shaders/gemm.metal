// GEMM with a fused epilogue: C[M, N] = act(op(A)[M, K] @ op(B)[K, N] + bias + beta*C).
//
// A convolution is C = W (filters x K) @ col (K x out_h*out_w) with a bias per row (gemm_nn);
// a connected layer is out (batch x outputs) = x (batch x inputs) @ W^T with a bias per column
// (gemm_nt). Grid slice z covers one (image, group) pair, see dm_gemm_args.
//
// Two implementations of the same contract:
// - gemm_*_f32: portable, 64x64 output tile per threadgroup of 16x8 threads (8x4 outputs each,
//   in registers), K in steps of 16 through two threadgroup buffers;
// - gemm_*_simd_f32: for Apple7+ GPUs, the same tiles and loads, the arithmetic on
//   simdgroup_float8x8 matrices (4 simdgroups in 2x2, each owning 32x32 = 4x4 accumulators).
// Both zero-pad the tiles past M, N and K, so any sizes work; only in-range outputs are written.
// gemm_splits_fwd_f32 finishes a product split along K into slots (the epilogue run once).
#include <metal_stdlib>
#include "dm_args.h"
#include "dm_activation.h"
using namespace metal;

constant uint GEMM_TK = 16;              // K per step (both kernels)
constant uint GEMM_SIMD_THREADS = 128;
constant uint GEMM_SIMD_BLOCK = 32;      // a simdgroup's block of the tile, per side
constant uint GEMM_SIMD_FRAGMENTS = GEMM_SIMD_BLOCK / 8;

// Element (r, k) of op(A) and (k, n) of op(B); TA/TB: the operand is stored transposed.
// T is the storage type of A, B, bias and C (float, or half for fp16 networks); tiles and
// sums are float either way.
template <bool TA, typename T>
inline float gemm_load_a(device const T* a, uint lda, uint r, uint k) {
    return float(TA ? a[k * lda + r] : a[r * lda + k]);
}

template <bool TB, typename T>
inline float gemm_load_b(device const T* b, uint ldb, uint k, uint n) {
    return float(TB ? b[n * ldb + k] : b[k * ldb + n]);
}

// C is read only when beta != 0: with beta = 0 it may be uninitialised, and 0 * NaN would
// otherwise leak NaN into the result.
template <typename T>
inline float gemm_epilogue(constant dm_gemm_args& args, device const T* bias,
                           device const T* c, uint zg, uint r, uint n, float v) {
    if (args.bias_mode == DM_BIAS_ROWS) {
        v += float(bias[zg * args.bias_group_stride + r]);
    } else if (args.bias_mode == DM_BIAS_COLS) {
        v += float(bias[zg * args.bias_group_stride + n]);
    }
    if (args.beta != 0.0f) v += args.beta * float(c[r * args.ldc + n]);
    return dm_activate(v, args.act);
}

// The tiled kernel's shape: a 64x64 output tile per threadgroup of 16x8 threads, each owning
// 8 rows x 4 columns of it in registers, so a step of K costs a thread three 16-byte
// threadgroup loads for 32 multiply-adds (the 32x32 tile with 2x2 a thread cost 4 loads for 4
// and ran at a quarter of cuBLAS on NVIDIA: shared-memory bound). Two K tiles are held, one
// read while the next is stored, so a K step needs one barrier.
constant uint GEMM_TILED_M = 64;
constant uint GEMM_TILED_N = 64;
constant uint GEMM_TILED_ROWS = 8;      // outputs a thread owns per column
constant uint GEMM_TILED_COLS = 4;      // ... and per row (one float4)
constant uint GEMM_TILED_X = GEMM_TILED_N / GEMM_TILED_COLS;  // 16 threads across
constant uint GEMM_TILED_THREADS = GEMM_TILED_X * (GEMM_TILED_M / GEMM_TILED_ROWS);  // 128
// A tile row holds 64 floats + 4 of padding (as float4s: 17), so that threads storing down a
// column of the tile (the transposed operands) fall on different banks.
constant uint GEMM_TILED_PITCH4 = GEMM_TILED_M / 4 + 1;
constant uint GEMM_TILED_BUFFER4 = GEMM_TK * GEMM_TILED_PITCH4;
constant uint GEMM_TILED_TILES4 = 2 * GEMM_TILED_BUFFER4;
// The simdgroup kernel keeps both operands' tiles in one array, reused for C's tile after.
constant uint GEMM_SIMD_TILES4 = 2 * GEMM_TILED_TILES4;
// Elements of one operand's K tile each thread moves from device memory.
constant uint GEMM_TILED_LOADS = GEMM_TK * GEMM_TILED_M / GEMM_TILED_THREADS;  // 8

// A thread's share of one operand's K tile (64 along M or N, GEMM_TK along K): element j is at
// (outer, k) = (outer0 + j*outer_step, k) or (outer0, k0 + j*k_step) in the tile, whichever
// keeps neighbouring threads on neighbouring addresses of the stored layout.
struct gemm_share {
    uint outer, k, outer_step, k_step;
};

// TRANSPOSED: the operand is stored with its outer index (M for A, N for B) contiguous.
template <bool CONTIGUOUS_OUTER>
inline gemm_share gemm_share_of(uint tid) {
    gemm_share s;
    if (CONTIGUOUS_OUTER) {
        s.outer = tid % GEMM_TILED_M;
        s.k = tid / GEMM_TILED_M;
        s.outer_step = 0;
        s.k_step = GEMM_TILED_THREADS / GEMM_TILED_M;
    } else {
        s.outer = tid / GEMM_TK;
        s.k = tid % GEMM_TK;
        s.outer_step = GEMM_TILED_THREADS / GEMM_TK;
        s.k_step = 0;
    }
    return s;
}

// Reads a thread's share of the K tiles at k0 into registers, zero outside the matrices.
// WHOLE: the tiles lie inside the matrices, so no load needs a guard.
template <bool TA, bool TB, typename T>
inline void gemm_tiled_read(constant dm_gemm_args& args, device const T* a, device const T* b,
                            uint row0, uint col0, uint k0, gemm_share sa, gemm_share sb,
                            bool whole, thread float* ra, thread float* rb) {
    if (whole) {
        for (uint j = 0; j < GEMM_TILED_LOADS; ++j) {
            ra[j] = gemm_load_a<TA, T>(a, args.lda, row0 + sa.outer + j * sa.outer_step,
                                       k0 + sa.k + j * sa.k_step);
            rb[j] = gemm_load_b<TB, T>(b, args.ldb, k0 + sb.k + j * sb.k_step,
                                       col0 + sb.outer + j * sb.outer_step);
        }
        return;
    }
    for (uint j = 0; j < GEMM_TILED_LOADS; ++j) {
        const uint r = row0 + sa.outer + j * sa.outer_step, ka = k0 + sa.k + j * sa.k_step;
        ra[j] = (r < args.M && ka < args.K) ? gemm_load_a<TA, T>(a, args.lda, r, ka) : 0.0f;
        const uint n = col0 + sb.outer + j * sb.outer_step, kb = k0 + sb.k + j * sb.k_step;
        rb[j] = (n < args.N && kb < args.K) ? gemm_load_b<TB, T>(b, args.ldb, kb, n) : 0.0f;
    }
}

// Stores a thread's share into one buffer of the tiles: tile[k][outer], K-major.
inline void gemm_tiled_store(gemm_share sa, gemm_share sb, thread const float* ra,
                             thread const float* rb, threadgroup float4* as,
                             threadgroup float4* bs) {
    for (uint j = 0; j < GEMM_TILED_LOADS; ++j) {
        const uint ma = sa.outer + j * sa.outer_step, ka = sa.k + j * sa.k_step;
        as[ka * GEMM_TILED_PITCH4 + ma / 4][ma % 4] = ra[j];
        const uint nb = sb.outer + j * sb.outer_step, kb = sb.k + j * sb.k_step;
        bs[kb * GEMM_TILED_PITCH4 + nb / 4][nb % 4] = rb[j];
    }
}

// Grid: threads (ceil(N/64)*16, ceil(M/64)*8, slices), threadgroup (16, 8, 1). Thread (x, y)
// owns rows 8y..8y+7 and columns 4x..4x+3 of the group's tile. Each output sums its K
// products in K order, one fused multiply-add (one rounding) a product.
template <bool TA, bool TB, typename T>
kernel void gemm_tiled(constant dm_gemm_args& args [[buffer(0)]],
                       device const T* a [[buffer(1)]],
                       device const T* b [[buffer(2)]],
                       device const T* bias [[buffer(3)]],
                       device T* c [[buffer(4)]],
                       uint3 tg [[threadgroup_position_in_grid]],
                       uint2 lid [[thread_position_in_threadgroup]]) {
    threadgroup float4 a_tiles[GEMM_TILED_TILES4];
    threadgroup float4 b_tiles[GEMM_TILED_TILES4];
    const uint zb = tg.z / args.groups, zg = tg.z % args.groups;
    a += zb * args.a_batch_stride + zg * args.a_group_stride;
    b += zb * args.b_batch_stride + zg * args.b_group_stride;
    c += zb * args.c_batch_stride + zg * args.c_group_stride;
    const uint row0 = tg.y * GEMM_TILED_M, col0 = tg.x * GEMM_TILED_N;
    const uint tid = lid.y * GEMM_TILED_X + lid.x;
    const gemm_share sa = gemm_share_of<TA>(tid), sb = gemm_share_of<!TB>(tid);
    float acc[GEMM_TILED_ROWS][GEMM_TILED_COLS];
    for (uint i = 0; i < GEMM_TILED_ROWS; ++i) {
        for (uint j = 0; j < GEMM_TILED_COLS; ++j) acc[i][j] = 0.0f;
    }
    // A thread whose outputs all lie past M or N still loads and meets the barriers, but
    // skips the arithmetic (only the edge tiles have such threads).
    const bool live = row0 + GEMM_TILED_ROWS * lid.y < args.M &&
                      col0 + GEMM_TILED_COLS * lid.x < args.N;
    // Inside tiles (all but the edges) load, and store C, without guards.
    const bool inside = row0 + GEMM_TILED_M <= args.M && col0 + GEMM_TILED_N <= args.N;
    float ra[GEMM_TILED_LOADS], rb[GEMM_TILED_LOADS];
    gemm_tiled_read<TA, TB, T>(args, a, b, row0, col0, 0, sa, sb, inside && GEMM_TK <= args.K,
                               ra, rb);
    gemm_tiled_store(sa, sb, ra, rb, a_tiles, b_tiles);
    threadgroup_barrier(mem_flags::mem_threadgroup);
    uint buffer = 0;
    for (uint k0 = 0; k0 < args.K; k0 += GEMM_TK) {
        const bool more = k0 + GEMM_TK < args.K;
        // The next tiles' device loads are issued before this tile's arithmetic hides them.
        if (more) {
            gemm_tiled_read<TA, TB, T>(args, a, b, row0, col0, k0 + GEMM_TK, sa, sb,
                                       inside && k0 + 2 * GEMM_TK <= args.K, ra, rb);
        }
        threadgroup const float4* as = a_tiles + buffer * GEMM_TILED_BUFFER4;
        threadgroup const float4* bs = b_tiles + buffer * GEMM_TILED_BUFFER4;
        for (uint k = 0; live && k < GEMM_TK; ++k) {
            const float4 a_lo = as[k * GEMM_TILED_PITCH4 + 2 * lid.y];
            const float4 a_hi = as[k * GEMM_TILED_PITCH4 + 2 * lid.y + 1];
            const float4 bv = bs[k * GEMM_TILED_PITCH4 + lid.x];
            for (uint i = 0; i < GEMM_TILED_ROWS; ++i) {
                const float av = i < 4 ? a_lo[i] : a_hi[i - 4];
                for (uint j = 0; j < GEMM_TILED_COLS; ++j) acc[i][j] = fma(av, bv[j], acc[i][j]);
            }
        }
        if (more) {
            buffer ^= 1u;
            gemm_tiled_store(sa, sb, ra, rb, a_tiles + buffer * GEMM_TILED_BUFFER4,
                             b_tiles + buffer * GEMM_TILED_BUFFER4);
        }
        // Orders this step's reads of one buffer before the next step's stores into it, and
        // the stores above before the next step's reads.
        threadgroup_barrier(mem_flags::mem_threadgroup);
    }
    if (inside && args.bias_mode == DM_BIAS_NONE && args.beta == 0.0f &&
        args.act == DM_ACT_LINEAR) {
        // The plain product (a layer's input gradient, a batch-normalised layer's forward):
        // stores only. The general epilogue below inlines the activation's switch per
        // element, which made every short-K tile pay for it.
        #pragma unroll
        for (uint i = 0; i < GEMM_TILED_ROWS; ++i) {
            const uint r = row0 + GEMM_TILED_ROWS * lid.y + i;
            #pragma unroll
            for (uint j = 0; j < GEMM_TILED_COLS; ++j) {
                c[r * args.ldc + col0 + GEMM_TILED_COLS * lid.x + j] = T(acc[i][j]);
            }
        }
        return;
    }
    if (TA || TB) {
        // Unrolled, so that acc stays in registers: a loop the compiler keeps indexes acc,
        // which then lives in local memory (on NVIDIA: the gradients' GEMMs ran 10-20% slower).
        #pragma unroll
        for (uint i = 0; i < GEMM_TILED_ROWS; ++i) {
            const uint r = row0 + GEMM_TILED_ROWS * lid.y + i;
            #pragma unroll
            for (uint j = 0; j < GEMM_TILED_COLS; ++j) {
                const uint n = col0 + GEMM_TILED_COLS * lid.x + j;
                if (r < args.M && n < args.N) {
                    c[r * args.ldc + n] =
                        T(gemm_epilogue<T>(args, bias, c, zg, r, n, acc[i][j]));
                }
            }
        }
        return;
    }
    // The forward GEMM measured faster with the loop (1024^3: 86% of cuBLAS against 71%).
    for (uint i = 0; i < GEMM_TILED_ROWS; ++i) {
        const uint r = row0 + GEMM_TILED_ROWS * lid.y + i;
        if (r >= args.M) break;
        for (uint j = 0; j < GEMM_TILED_COLS; ++j) {
            const uint n = col0 + GEMM_TILED_COLS * lid.x + j;
            if (n < args.N) {
                c[r * args.ldc + n] = T(gemm_epilogue<T>(args, bias, c, zg, r, n, acc[i][j]));
            }
        }
    }
}

// Grid: threads (ceil(N/64)*128, ceil(M/64), slices), threadgroup (128, 1, 1). The tiled
// kernel's 64x64 tile, loads and two K buffers, its arithmetic on simdgroup matrices: the 4
// simdgroups in 2x2 each own a 32x32 block as 4x4 simdgroup_float8x8 accumulators (the shape
// of MLX's float32 GEMM, 64x64x16 with 2x2 simdgroups), 16 multiply-accumulates per 8 of K
// for 8 fragment loads. The accumulators then pass through threadgroup memory (the tiles'
// own) so that the epilogue runs per element.
template <bool TA, bool TB, typename T>
kernel void gemm_simd(constant dm_gemm_args& args [[buffer(0)]],
                      device const T* a [[buffer(1)]],
                      device const T* b [[buffer(2)]],
                      device const T* bias [[buffer(3)]],
                      device T* c [[buffer(4)]],
                      uint3 tg [[threadgroup_position_in_grid]],
                      uint tid [[thread_index_in_threadgroup]],
                      uint sg [[simdgroup_index_in_threadgroup]]) {
    threadgroup float4 tiles[GEMM_SIMD_TILES4];
    threadgroup float4* a_tiles = tiles;
    threadgroup float4* b_tiles = tiles + GEMM_TILED_TILES4;
    const uint zb = tg.z / args.groups, zg = tg.z % args.groups;
    a += zb * args.a_batch_stride + zg * args.a_group_stride;
    b += zb * args.b_batch_stride + zg * args.b_group_stride;
    c += zb * args.c_batch_stride + zg * args.c_group_stride;
    const uint row0 = tg.y * GEMM_TILED_M, col0 = tg.x * GEMM_TILED_N;
    const uint sr = (sg / 2) * GEMM_SIMD_BLOCK, sc = (sg % 2) * GEMM_SIMD_BLOCK;
    const gemm_share sa = gemm_share_of<TA>(tid), sb = gemm_share_of<!TB>(tid);
    simdgroup_float8x8 acc[GEMM_SIMD_FRAGMENTS][GEMM_SIMD_FRAGMENTS];
    for (uint i = 0; i < GEMM_SIMD_FRAGMENTS; ++i) {
        for (uint j = 0; j < GEMM_SIMD_FRAGMENTS; ++j) {
            acc[i][j] = make_filled_simdgroup_matrix<float, 8, 8>(0.0f);
        }
    }
    // A simdgroup whose block lies wholly past M or N skips the arithmetic (the same for its
    // 32 lanes, as simdgroup functions need).
    const bool live = row0 + sr < args.M && col0 + sc < args.N;
    float ra[GEMM_TILED_LOADS], rb[GEMM_TILED_LOADS];
    gemm_tiled_read<TA, TB, T>(args, a, b, row0, col0, 0, sa, sb, false, ra, rb);
    gemm_tiled_store(sa, sb, ra, rb, a_tiles, b_tiles);
    threadgroup_barrier(mem_flags::mem_threadgroup);
    uint buffer = 0;
    for (uint k0 = 0; k0 < args.K; k0 += GEMM_TK) {
        const bool more = k0 + GEMM_TK < args.K;
        if (more) {
            gemm_tiled_read<TA, TB, T>(args, a, b, row0, col0, k0 + GEMM_TK, sa, sb, false, ra,
                                       rb);
        }
        // The tiles hold op(A)^T and op(B) K-major, GEMM_TILED_PITCH4 float4s a row: A's 8x8
        // blocks are read transposed.
        threadgroup const float* as =
            (threadgroup const float*)(a_tiles + buffer * GEMM_TILED_BUFFER4);
        threadgroup const float* bs =
            (threadgroup const float*)(b_tiles + buffer * GEMM_TILED_BUFFER4);
        for (uint k = 0; live && k < GEMM_TK; k += 8) {
            simdgroup_float8x8 ma[GEMM_SIMD_FRAGMENTS];
            simdgroup_float8x8 mb[GEMM_SIMD_FRAGMENTS];
            for (uint i = 0; i < GEMM_SIMD_FRAGMENTS; ++i) {
                const ulong2 a_origin = ulong2(ulong(sr + 8 * i), ulong(k));
                const ulong2 b_origin = ulong2(ulong(sc + 8 * i), ulong(k));
                simdgroup_load(ma[i], as, 4 * GEMM_TILED_PITCH4, a_origin, true);
                simdgroup_load(mb[i], bs, 4 * GEMM_TILED_PITCH4, b_origin);
            }
            for (uint i = 0; i < GEMM_SIMD_FRAGMENTS; ++i) {
                for (uint j = 0; j < GEMM_SIMD_FRAGMENTS; ++j) {
                    simdgroup_multiply_accumulate(acc[i][j], ma[i], mb[j], acc[i][j]);
                }
            }
        }
        if (more) {
            buffer ^= 1u;
            gemm_tiled_store(sa, sb, ra, rb, a_tiles + buffer * GEMM_TILED_BUFFER4,
                             b_tiles + buffer * GEMM_TILED_BUFFER4);
        }
        threadgroup_barrier(mem_flags::mem_threadgroup);
    }
    // The last barrier ended every read of the tiles: they now hold C's 64x64 tile.
    threadgroup float* c_tile = (threadgroup float*)tiles;
    for (uint i = 0; i < GEMM_SIMD_FRAGMENTS; ++i) {
        for (uint j = 0; j < GEMM_SIMD_FRAGMENTS; ++j) {
            simdgroup_store(acc[i][j], c_tile, GEMM_TILED_N,
                            ulong2(ulong(sc + 8 * j), ulong(sr + 8 * i)));
        }
    }
    threadgroup_barrier(mem_flags::mem_threadgroup);
    for (uint e = tid; e < GEMM_TILED_M * GEMM_TILED_N; e += GEMM_SIMD_THREADS) {
        const uint r = row0 + e / GEMM_TILED_N, n = col0 + e % GEMM_TILED_N;
        if (r < args.M && n < args.N) {
            c[r * args.ldc + n] = T(gemm_epilogue<T>(args, bias, c, zg, r, n, c_tile[e]));
        }
    }
}

// The epilogue of a GEMM split along K (see dm_gemm_splits_args): a product with too few
// output tiles to fill the GPU (a late layer at batch 1) runs as `splits` GEMMs over runs of
// K, each into a slot of its own, and this adds the slots in a fixed order (a seeded run
// repeats) before the bias and the activation. Grid: images * per_image.
kernel void gemm_splits_fwd_f32(constant dm_gemm_splits_args& args [[buffer(0)]],
                                device const float* part [[buffer(1)]],
                                device const float* bias [[buffer(2)]],
                                device float* c [[buffer(3)]],
                                uint gid [[thread_position_in_grid]]) {
    if (gid >= args.images * args.per_image) return;
    const uint z = gid / args.per_image, i = gid - z * args.per_image;
    device const float* p = part + z * args.splits * args.per_image + i;
    float v = 0.0f;
    for (uint s = 0; s < args.splits; ++s) v += p[s * args.per_image];
    if (args.bias_mode == DM_BIAS_ROWS) v += bias[i / args.spatial];
    c[gid] = dm_activate(v, args.act);
}

typedef decltype(gemm_tiled<false, false, float>) gemm_tiled_t;
template [[host_name("gemm_nn_f32")]] kernel gemm_tiled_t gemm_tiled<false, false, float>;
template [[host_name("gemm_nt_f32")]] kernel gemm_tiled_t gemm_tiled<false, true, float>;
template [[host_name("gemm_tn_f32")]] kernel gemm_tiled_t gemm_tiled<true, false, float>;
typedef decltype(gemm_tiled<false, false, half>) gemm_tiled_f16_t;
template [[host_name("gemm_nn_f16")]] kernel gemm_tiled_f16_t gemm_tiled<false, false, half>;
template [[host_name("gemm_nt_f16")]] kernel gemm_tiled_f16_t gemm_tiled<false, true, half>;

typedef decltype(gemm_simd<false, false, float>) gemm_simd_t;
template [[host_name("gemm_nn_simd_f32")]] kernel gemm_simd_t gemm_simd<false, false, float>;
template [[host_name("gemm_nt_simd_f32")]] kernel gemm_simd_t gemm_simd<false, true, float>;
template [[host_name("gemm_tn_simd_f32")]] kernel gemm_simd_t gemm_simd<true, false, float>;
typedef decltype(gemm_simd<false, false, half>) gemm_simd_f16_t;
template [[host_name("gemm_nn_simd_f16")]] kernel gemm_simd_f16_t gemm_simd<false, false, half>;
template [[host_name("gemm_nt_simd_f16")]] kernel gemm_simd_f16_t gemm_simd<false, true, half>;
