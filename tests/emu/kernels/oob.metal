// Reads one element past the end of its input.
#include <metal_stdlib>
using namespace metal;

kernel void oob_read(device const float* x [[buffer(0)]],
                     device float* out [[buffer(1)]],
                     uint gid [[thread_position_in_grid]]) {
    out[gid] = x[gid + 1];
}
