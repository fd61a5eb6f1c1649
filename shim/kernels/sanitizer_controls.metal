// Planted bugs: the positive controls of tools/sanitize.py, one per sanitizer tool, each shown
// to be caught with this file and line. Never dispatched by the package; every one is wrong
// on purpose (on Apple GPUs too).
#include <metal_stdlib>
using namespace metal;

// racecheck: the barrier between the write and the neighbour's read is missing.
kernel void control_missing_barrier_f32(device const float* x [[buffer(1)]],
                                        device float* out [[buffer(2)]],
                                        uint gid [[thread_position_in_grid]],
                                        uint lid [[thread_index_in_threadgroup]],
                                        uint width [[threads_per_threadgroup]]) {
    threadgroup float scratch[256];
    scratch[lid] = x[gid];
    out[gid] = scratch[(lid + 1u) % width];
}

// synccheck: a barrier only some threads of the group reach.
kernel void control_divergent_barrier_f32(device float* out [[buffer(2)]],
                                          uint gid [[thread_position_in_grid]],
                                          uint lid [[thread_index_in_threadgroup]]) {
    threadgroup float scratch[256];
    scratch[lid] = float(gid);
    if (lid < 16u) {
        threadgroup_barrier(mem_flags::mem_threadgroup);
    }
    out[gid] = scratch[lid];
}

// memcheck: a write far past the end of the buffer.
kernel void control_write_past_end_f32(device float* out [[buffer(2)]],
                                       uint gid [[thread_position_in_grid]]) {
    out[gid + 64u * 1024u * 1024u] = 1.0f;
}

// initcheck: a read of device memory nothing ever wrote.
kernel void control_read_unwritten_f32(device const float* never [[buffer(1)]],
                                       device float* out [[buffer(2)]],
                                       uint gid [[thread_position_in_grid]]) {
    out[gid] = never[gid] + 1.0f;
}
