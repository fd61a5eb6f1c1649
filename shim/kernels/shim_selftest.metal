// Kernels of the shim itself: they check that a device builds pipelines, binds arguments,
// threadgroup memory and buffers, and runs threads in the expected order. Not model kernels.
#include <metal_stdlib>
using namespace metal;

struct selftest_axpy_args {
    uint n;
    float alpha;
};

// out = alpha * x + y over n elements; the grid may exceed n.
kernel void selftest_axpy_f32(constant selftest_axpy_args& args [[buffer(0)]],
                              device const float* x [[buffer(1)]],
                              device const float* y [[buffer(2)]],
                              device float* out [[buffer(3)]],
                              uint gid [[thread_position_in_grid]]) {
    if (gid >= args.n) return;
    out[gid] = args.alpha * x[gid] + y[gid];
}

// sums[g] = sum of the n-bounded elements handled by threadgroup g, through threadgroup
// memory whose length the host sets (one float per thread).
kernel void selftest_group_sum_f32(constant uint& n [[buffer(0)]],
                                   device const float* x [[buffer(1)]],
                                   device float* sums [[buffer(2)]],
                                   threadgroup float* scratch [[threadgroup(0)]],
                                   uint gid [[thread_position_in_grid]],
                                   uint lid [[thread_index_in_threadgroup]],
                                   uint group [[threadgroup_position_in_grid]],
                                   uint width [[threads_per_threadgroup]]) {
    scratch[lid] = gid < n ? x[gid] : 0.0f;
    threadgroup_barrier(mem_flags::mem_threadgroup);
    if (lid == 0) {
        float s = 0.0f;
        for (uint i = 0; i < width; i++) {
            s += scratch[i];
        }
        sums[group] = s;
    }
}

// out[gid] = the order in which the thread ran, from a shared counter.
kernel void selftest_order_probe_u32(device atomic_uint* counter [[buffer(0)]],
                                     device uint* out [[buffer(1)]],
                                     uint gid [[thread_position_in_grid]]) {
    out[gid] = atomic_fetch_add_explicit(counter, 1u, memory_order_relaxed);
}
