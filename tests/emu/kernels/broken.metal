// Kernels with bugs the emulator must expose.
#include <metal_stdlib>
using namespace metal;

// Missing barrier between the store and the neighbour's load: correct only when threads run
// in a favourable order.
kernel void missing_barrier(device const float* x [[buffer(0)]],
                            device float* out [[buffer(1)]],
                            uint lid [[thread_position_in_threadgroup]],
                            uint ntg [[threads_per_threadgroup]]) {
    threadgroup float buf[256];
    buf[lid] = x[lid];
    threadgroup_barrier(mem_flags::mem_threadgroup);
    float v = buf[lid] + buf[(lid + 1) % ntg];
    buf[lid] = v;
    out[lid] = buf[(lid + 1) % ntg];
}

// Threads past the data return early, the others wait at a barrier forever on a GPU.
kernel void return_before_barrier(device const float* x [[buffer(0)]],
                                  device float* out [[buffer(1)]],
                                  constant uint& n [[buffer(2)]],
                                  uint gid [[thread_position_in_grid]],
                                  uint lid [[thread_position_in_threadgroup]]) {
    threadgroup float buf[64];
    if (gid >= n) return;
    buf[lid] = x[gid];
    threadgroup_barrier(mem_flags::mem_threadgroup);
    out[gid] = buf[lid ^ 1];
}

// Half of the simdgroup calls simd_sum.
kernel void partial_simd(device const float* x [[buffer(0)]],
                         device float* out [[buffer(1)]],
                         uint gid [[thread_position_in_grid]],
                         ushort lane [[thread_index_in_simdgroup]]) {
    float v = x[gid];
    if (lane < 16) v = simd_sum(v);
    out[gid] = v;
}

// The two halves reach different collectives.
kernel void mismatched_simd(device const float* x [[buffer(0)]],
                            device float* out [[buffer(1)]],
                            uint gid [[thread_position_in_grid]],
                            ushort lane [[thread_index_in_simdgroup]]) {
    float v = x[gid];
    if (lane < 16) {
        v = simd_sum(v);
    } else {
        v = simd_max(v);
    }
    out[gid] = v;
}

// 40 KiB of threadgroup memory: over the 32 KiB limit.
kernel void too_much_tg(device float* out [[buffer(0)]],
                        uint lid [[thread_position_in_threadgroup]]) {
    threadgroup float big[10240];
    big[lid] = 1.0f;
    threadgroup_barrier(mem_flags::mem_threadgroup);
    out[lid] = big[lid];
}

// The same, but the size is only known when the template is instantiated.
template <typename T, int N>
kernel void too_much_tg_tmpl(device T* out [[buffer(0)]],
                             uint lid [[thread_position_in_threadgroup]]) {
    threadgroup T big[N];
    big[lid] = T(1);
    out[lid] = big[lid];
}

typedef decltype(too_much_tg_tmpl<float, 9000>) too_much_t;
template [[host_name("too_much_tg_tmpl_f32")]] kernel too_much_t too_much_tg_tmpl<float, 9000>;
