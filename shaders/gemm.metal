// GEMM with a fused epilogue: C[M, N] = act(op(A)[M, K] @ op(B)[K, N] + bias + beta*C).
//
// A convolution is C = W (filters x K) @ col (K x out_h*out_w) with a bias per row (gemm_nn);
// a connected layer is out (batch x outputs) = x (batch x inputs) @ W^T with a bias per column
// (gemm_nt). Grid slice z covers one (image, group) pair, see dm_gemm_args.
//
// Two implementations of the same contract:
// - gemm_*_f32: portable, 32x32 output tile per threadgroup of 16x16 threads (2x2 outputs
//   each), K in steps of 16 through threadgroup memory;
// - gemm_*_simd_f32: for Apple7+ GPUs, 32x32 tile per threadgroup of 128 threads (4 simdgroups
//   in 2x2, each owning 16x16 = 2x2 simdgroup_float8x8 accumulators).
// Both zero-pad the tiles past M, N and K, so any sizes work; only in-range outputs are written.
#include <metal_stdlib>
#include "dm_args.h"
#include "dm_activation.h"
using namespace metal;

constant uint GEMM_TILE = 32;
constant uint GEMM_TK = 16;
constant uint GEMM_SIDE = 16;
constant uint GEMM_SIMD_THREADS = 128;
// Tile sizes in floats, named because threadgroup array sizes stay single identifiers.
constant uint GEMM_PADDED_TILE = GEMM_TK * (GEMM_TILE + 1);
constant uint GEMM_K_TILE = GEMM_TK * GEMM_TILE;
constant uint GEMM_C_TILE = GEMM_TILE * GEMM_TILE;

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

// Fills a (GEMM_TK x GEMM_TILE) tile of op(A)^T (as[k][m]) and of op(B) (bs[k][n]) for the
// K step k0, zero outside the matrices. The thread mapping follows the stored layout so that
// neighbouring threads read neighbouring addresses.
template <bool TA, bool TB, typename T>
inline void gemm_fill_tiles(constant dm_gemm_args& args, device const T* a,
                            device const T* b, uint row0, uint col0, uint k0, uint tid,
                            uint nthreads, threadgroup float* as, threadgroup float* bs,
                            uint pitch) {
    for (uint i = tid; i < GEMM_TK * GEMM_TILE; i += nthreads) {
        uint r = TA ? i % GEMM_TILE : i / GEMM_TK;
        uint k = TA ? i / GEMM_TILE : i % GEMM_TK;
        uint gr = row0 + r, gk = k0 + k;
        as[k * pitch + r] = (gr < args.M && gk < args.K) ? gemm_load_a<TA, T>(a, args.lda, gr, gk)
                                                           : 0.0f;
        uint n = TB ? i / GEMM_TK : i % GEMM_TILE;
        uint kb = TB ? i % GEMM_TK : i / GEMM_TILE;
        uint gn = col0 + n, gkb = k0 + kb;
        bs[kb * pitch + n] = (gn < args.N && gkb < args.K)
                                 ? gemm_load_b<TB, T>(b, args.ldb, gkb, gn) : 0.0f;
    }
}

// Grid: threads (ceil(N/32)*16, ceil(M/32)*16, slices), threadgroup (16, 16, 1).
template <bool TA, bool TB, typename T>
kernel void gemm_tiled(constant dm_gemm_args& args [[buffer(0)]],
                       device const T* a [[buffer(1)]],
                       device const T* b [[buffer(2)]],
                       device const T* bias [[buffer(3)]],
                       device T* c [[buffer(4)]],
                       uint3 tg [[threadgroup_position_in_grid]],
                       uint2 lid [[thread_position_in_threadgroup]]) {
    threadgroup float a_tile[GEMM_PADDED_TILE];
    threadgroup float b_tile[GEMM_PADDED_TILE];
    const uint zb = tg.z / args.groups, zg = tg.z % args.groups;
    a += zb * args.a_batch_stride + zg * args.a_group_stride;
    b += zb * args.b_batch_stride + zg * args.b_group_stride;
    c += zb * args.c_batch_stride + zg * args.c_group_stride;
    const uint row0 = tg.y * GEMM_TILE, col0 = tg.x * GEMM_TILE;
    const uint tid = lid.y * GEMM_SIDE + lid.x;
    float acc00 = 0.0f, acc01 = 0.0f, acc10 = 0.0f, acc11 = 0.0f;
    for (uint k0 = 0; k0 < args.K; k0 += GEMM_TK) {
        gemm_fill_tiles<TA, TB, T>(args, a, b, row0, col0, k0, tid, GEMM_SIDE * GEMM_SIDE, a_tile,
                                   b_tile, GEMM_TILE + 1);
        threadgroup_barrier(mem_flags::mem_threadgroup);
        for (uint k = 0; k < GEMM_TK; ++k) {
            const uint o = k * (GEMM_TILE + 1);
            float a0 = a_tile[o + lid.y], a1 = a_tile[o + lid.y + GEMM_SIDE];
            float b0 = b_tile[o + lid.x], b1 = b_tile[o + lid.x + GEMM_SIDE];
            acc00 += a0 * b0;
            acc01 += a0 * b1;
            acc10 += a1 * b0;
            acc11 += a1 * b1;
        }
        threadgroup_barrier(mem_flags::mem_threadgroup);
    }
    const float acc[2][2] = {{acc00, acc01}, {acc10, acc11}};
    for (uint i = 0; i < 2; ++i) {
        for (uint j = 0; j < 2; ++j) {
            uint r = row0 + lid.y + i * GEMM_SIDE, n = col0 + lid.x + j * GEMM_SIDE;
            if (r < args.M && n < args.N) {
                c[r * args.ldc + n] = T(gemm_epilogue<T>(args, bias, c, zg, r, n, acc[i][j]));
            }
        }
    }
}

// Grid: threads (ceil(N/32)*128, ceil(M/32), slices), threadgroup (128, 1, 1).
template <bool TA, bool TB, typename T>
kernel void gemm_simd(constant dm_gemm_args& args [[buffer(0)]],
                      device const T* a [[buffer(1)]],
                      device const T* b [[buffer(2)]],
                      device const T* bias [[buffer(3)]],
                      device T* c [[buffer(4)]],
                      uint3 tg [[threadgroup_position_in_grid]],
                      uint tid [[thread_index_in_threadgroup]],
                      uint sg [[simdgroup_index_in_threadgroup]]) {
    threadgroup float a_tile[GEMM_K_TILE];
    threadgroup float b_tile[GEMM_K_TILE];
    threadgroup float c_tile[GEMM_C_TILE];
    const uint zb = tg.z / args.groups, zg = tg.z % args.groups;
    a += zb * args.a_batch_stride + zg * args.a_group_stride;
    b += zb * args.b_batch_stride + zg * args.b_group_stride;
    c += zb * args.c_batch_stride + zg * args.c_group_stride;
    const uint row0 = tg.y * GEMM_TILE, col0 = tg.x * GEMM_TILE;
    const uint sr = (sg / 2) * 16, sc = (sg % 2) * 16;
    simdgroup_float8x8 acc[2][2];
    for (uint i = 0; i < 2; ++i) {
        for (uint j = 0; j < 2; ++j) acc[i][j] = make_filled_simdgroup_matrix<float, 8, 8>(0.0f);
    }
    for (uint k0 = 0; k0 < args.K; k0 += GEMM_TK) {
        gemm_fill_tiles<TA, TB, T>(args, a, b, row0, col0, k0, tid, GEMM_SIMD_THREADS, a_tile,
                                   b_tile, GEMM_TILE);
        threadgroup_barrier(mem_flags::mem_threadgroup);
        for (uint k = 0; k < GEMM_TK; k += 8) {
            simdgroup_float8x8 ma[2];
            simdgroup_float8x8 mb[2];
            // a_tile holds op(A)^T (k-major), so A's 8x8 blocks are read transposed.
            for (uint i = 0; i < 2; ++i) {
                ulong2 a_origin = ulong2(ulong(sr + 8 * i), ulong(k));
                ulong2 b_origin = ulong2(ulong(sc + 8 * i), ulong(k));
                simdgroup_load(ma[i], a_tile, GEMM_TILE, a_origin, true);
                simdgroup_load(mb[i], b_tile, GEMM_TILE, b_origin);
            }
            for (uint i = 0; i < 2; ++i) {
                for (uint j = 0; j < 2; ++j) {
                    simdgroup_multiply_accumulate(acc[i][j], ma[i], mb[j], acc[i][j]);
                }
            }
        }
        threadgroup_barrier(mem_flags::mem_threadgroup);
    }
    for (uint i = 0; i < 2; ++i) {
        for (uint j = 0; j < 2; ++j) {
            ulong2 origin = ulong2(ulong(sc + 8 * j), ulong(sr + 8 * i));
            simdgroup_store(acc[i][j], c_tile, GEMM_TILE, origin);
        }
    }
    threadgroup_barrier(mem_flags::mem_threadgroup);
    for (uint e = tid; e < GEMM_TILE * GEMM_TILE; e += GEMM_SIMD_THREADS) {
        uint r = row0 + e / GEMM_TILE, n = col0 + e % GEMM_TILE;
        if (r < args.M && n < args.N) {
            c[r * args.ldc + n] = T(gemm_epilogue<T>(args, bias, c, zg, r, n, c_tile[e]));
        }
    }
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
