// Correct kernels exercising the emulated Metal compute model.
#include <metal_stdlib>
using namespace metal;

struct ew_args {
    uint n;
    float alpha;
};

constant uint TILE = 16;

// out = a + alpha * b; the grid need not be a multiple of the group size.
kernel void vadd_f32(constant ew_args& args [[buffer(0)]],
                     device const float* a [[buffer(1)]],
                     device const float* b [[buffer(2)]],
                     device float* out [[buffer(3)]],
                     uint gid [[thread_position_in_grid]]) {
    if (gid >= args.n) return;
    out[gid] = a[gid] + args.alpha * b[gid];
}

// Records, per thread of a 2-D dispatch, the built-ins Metal would give it.
kernel void builtins_probe(device uint* out [[buffer(0)]],
                           uint2 gid [[thread_position_in_grid]],
                           uint2 lid [[thread_position_in_threadgroup]],
                           uint2 tg [[threadgroup_position_in_grid]],
                           uint2 tptg [[threads_per_threadgroup]],
                           uint2 grid [[threads_per_grid]],
                           uint2 ngroups [[threadgroups_per_grid]],
                           uint tiitg [[thread_index_in_threadgroup]],
                           ushort lane [[thread_index_in_simdgroup]],
                           ushort sg [[simdgroup_index_in_threadgroup]]) {
    device uint* o = out + (gid.y * grid.x + gid.x) * 12;
    o[0] = lid.x;
    o[1] = lid.y;
    o[2] = tg.x;
    o[3] = tg.y;
    o[4] = tptg.x;
    o[5] = tptg.y;
    o[6] = ngroups.x;
    o[7] = ngroups.y;
    o[8] = tiitg;
    o[9] = lane;
    o[10] = sg;
    o[11] = 1u;
}

// Tree reduction of 256 values per group in threadgroup memory.
kernel void reduce_sum_f32(device const float* x [[buffer(0)]],
                           device float* out [[buffer(1)]],
                           uint lid [[thread_position_in_threadgroup]],
                           uint tg [[threadgroup_position_in_grid]],
                           uint ntg [[threads_per_threadgroup]]) {
    threadgroup float buf[256];
    buf[lid] = x[tg * ntg + lid];
    threadgroup_barrier(mem_flags::mem_threadgroup);
    for (uint s = ntg / 2; s > 0; s >>= 1) {
        if (lid < s) buf[lid] += buf[lid + s];
        threadgroup_barrier(mem_flags::mem_threadgroup);
    }
    if (lid == 0) out[tg] = buf[0];
}

// Two-level reduction: simd_sum inside each simdgroup, then across simdgroups.
kernel void simd_reduce_f32(device const float* x [[buffer(0)]],
                            device float* out [[buffer(1)]],
                            uint gid [[thread_position_in_grid]],
                            uint tg [[threadgroup_position_in_grid]],
                            ushort lane [[thread_index_in_simdgroup]],
                            ushort sg [[simdgroup_index_in_threadgroup]],
                            ushort nsg [[simdgroups_per_threadgroup]]) {
    threadgroup float partial[32];
    float v = simd_sum(x[gid]);
    if (lane == 0) partial[sg] = v;
    threadgroup_barrier(mem_flags::mem_threadgroup);
    if (sg == 0) {
        float p = lane < nsg ? partial[lane] : 0.0f;
        p = simd_sum(p);
        if (lane == 0) out[tg] = p;
    }
}

// Shuffles and prefix sums within one simdgroup of 32.
kernel void simd_shuffles(device const float* x [[buffer(0)]],
                          device float* out [[buffer(1)]],
                          uint gid [[thread_position_in_grid]]) {
    float v = x[gid];
    out[gid * 5 + 0] = simd_shuffle_down(v, 1);
    out[gid * 5 + 1] = simd_shuffle_xor(v, 3);
    out[gid * 5 + 2] = simd_prefix_exclusive_sum(v);
    out[gid * 5 + 3] = simd_broadcast(v, 5);
    out[gid * 5 + 4] = simd_max(v);
}

struct gemm_args {
    uint M;
    uint N;
    uint K;
};

// C[M,N] = A[M,K] * B[K,N], row-major, TILE x TILE tiles staged in threadgroup memory.
template <typename T>
kernel void gemm_tiled(constant gemm_args& args [[buffer(0)]],
                       device const T* A [[buffer(1)]],
                       device const T* B [[buffer(2)]],
                       device T* C [[buffer(3)]],
                       uint2 gid [[thread_position_in_grid]],
                       uint2 lid [[thread_position_in_threadgroup]]) {
    threadgroup T As[TILE][TILE];
    threadgroup T Bs[TILE][TILE];
    const uint row = gid.y;
    const uint col = gid.x;
    float acc = 0.0f;
    for (uint k0 = 0; k0 < args.K; k0 += TILE) {
        uint ka = k0 + lid.x;
        uint kb = k0 + lid.y;
        As[lid.y][lid.x] = (row < args.M && ka < args.K) ? A[row * args.K + ka] : T(0);
        Bs[lid.y][lid.x] = (kb < args.K && col < args.N) ? B[kb * args.N + col] : T(0);
        threadgroup_barrier(mem_flags::mem_threadgroup);
        for (uint k = 0; k < TILE; ++k) acc = fma(float(As[lid.y][k]), float(Bs[k][lid.x]), acc);
        threadgroup_barrier(mem_flags::mem_threadgroup);
    }
    if (row < args.M && col < args.N) C[row * args.N + col] = T(acc);
}

template [[host_name("gemm_tiled_f32")]] kernel void gemm_tiled<float>(
    constant gemm_args& args [[buffer(0)]], device const float* A [[buffer(1)]],
    device const float* B [[buffer(2)]], device float* C [[buffer(3)]],
    uint2 gid [[thread_position_in_grid]], uint2 lid [[thread_position_in_threadgroup]]);

typedef decltype(gemm_tiled<half>) gemm_tiled_t;
template [[host_name("gemm_tiled_f16")]] kernel gemm_tiled_t gemm_tiled<half>;

// One simdgroup per 8x8 output tile: simdgroup_matrix multiply-accumulate over K.
kernel void gemm_simdgroup_f32(constant gemm_args& args [[buffer(0)]],
                               device const float* A [[buffer(1)]],
                               device const float* B [[buffer(2)]],
                               device float* C [[buffer(3)]],
                               uint2 tg [[threadgroup_position_in_grid]]) {
    simdgroup_float8x8 acc = make_filled_simdgroup_matrix<float, 8, 8>(0.0f);
    simdgroup_float8x8 a;
    simdgroup_float8x8 b;
    for (uint k = 0; k < args.K; k += 8) {
        simdgroup_load(a, A, args.K, ulong2(k, tg.y * 8));
        simdgroup_load(b, B, args.N, ulong2(tg.x * 8, k));
        simdgroup_multiply_accumulate(acc, a, b, acc);
    }
    simdgroup_store(acc, C, args.N, ulong2(tg.x * 8, tg.y * 8));
}

// B^T loaded with the transpose flag: C = A * B where B is given as Bt[N,K].
kernel void gemm_simdgroup_nt_f32(constant gemm_args& args [[buffer(0)]],
                                  device const float* A [[buffer(1)]],
                                  device const float* Bt [[buffer(2)]],
                                  device float* C [[buffer(3)]],
                                  uint2 tg [[threadgroup_position_in_grid]]) {
    simdgroup_float8x8 acc = simdgroup_float8x8(0.0f);
    simdgroup_float8x8 a;
    simdgroup_float8x8 b;
    for (uint k = 0; k < args.K; k += 8) {
        simdgroup_load(a, A, args.K, ulong2(k, tg.y * 8));
        simdgroup_load(b, Bt, args.K, ulong2(k, tg.x * 8), true);
        simdgroup_multiply_accumulate(acc, a, b, acc);
    }
    simdgroup_store(acc, C, args.N, ulong2(tg.x * 8, tg.y * 8));
}

// Histogram with device atomics, after a per-group histogram in threadgroup atomics.
kernel void histogram_u32(device const uint* x [[buffer(0)]],
                          device atomic_uint* hist [[buffer(1)]],
                          constant uint& n [[buffer(2)]],
                          uint gid [[thread_position_in_grid]],
                          uint lid [[thread_index_in_threadgroup]],
                          uint ntg [[threads_per_threadgroup]]) {
    threadgroup atomic_uint local[16];
    for (uint i = lid; i < 16; i += ntg) atomic_store_explicit(&local[i], 0u, memory_order_relaxed);
    threadgroup_barrier(mem_flags::mem_threadgroup);
    if (gid < n) atomic_fetch_add_explicit(&local[x[gid] % 16], 1u, memory_order_relaxed);
    threadgroup_barrier(mem_flags::mem_threadgroup);
    for (uint i = lid; i < 16; i += ntg) {
        uint c = atomic_load_explicit(&local[i], memory_order_relaxed);
        if (c) atomic_fetch_add_explicit(&hist[i], c, memory_order_relaxed);
    }
}

// Float atomics straight to device memory.
kernel void atomic_sum_f32(device const float* x [[buffer(0)]],
                           device atomic_float* total [[buffer(1)]],
                           uint gid [[thread_position_in_grid]]) {
    atomic_fetch_add_explicit(total, x[gid], memory_order_relaxed);
}

// Vector types, swizzles and component-wise math.
kernel void vector_ops(device const float4* x [[buffer(0)]],
                       device float4* out [[buffer(1)]],
                       device packed_float3* p [[buffer(2)]],
                       uint gid [[thread_position_in_grid]]) {
    float4 v = x[gid];
    float4 r = float4(v.yx, v.zw * 2.0f);
    r.xy += 1.0f;
    r = max(r, 0.5f) + select(float4(0.0f), float4(10.0f), v > 2.0f);
    half4 h = half4(r);
    out[gid] = float4(h) + float4(dot(v.xyz, float3(1.0f)), 0.0h, 0.0f, 0.0f).wzyx;
    float3 q = float3(v.x, v.y, v.z) * clamp(v.w, 0.0f, 1.0f);
    p[gid] = packed_float3(q);
}

// Threadgroup memory must hold NaN before it is written: reads it back unwritten.
kernel void tg_poison(device float* out [[buffer(0)]],
                      uint lid [[thread_position_in_threadgroup]]) {
    threadgroup float scratch[64];
    out[lid] = isnan(scratch[lid]) ? 1.0f : 0.0f;
}

// Dynamic threadgroup memory bound by the host ([[threadgroup(0)]]).
kernel void reverse_in_group(device const float* x [[buffer(0)]],
                             device float* out [[buffer(1)]],
                             threadgroup float* tmp [[threadgroup(0)]],
                             uint gid [[thread_position_in_grid]],
                             uint lid [[thread_position_in_threadgroup]],
                             uint ntg [[threads_per_threadgroup]]) {
    tmp[lid] = x[gid];
    threadgroup_barrier(mem_flags::mem_threadgroup);
    out[gid] = tmp[ntg - 1 - lid];
}
