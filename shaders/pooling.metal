// Pooling: [maxpool] (windows and maxpool_depth) and global [avgpool], forward and backward.
// Training's forward also records each maximum's index for the backward pass.
//
// Window geometry is Darknet's: window (i, j) starts at (i*stride_y - padding/2,
// j*stride_x - padding/2) and positions outside the image are skipped, so a window wholly
// outside gives -FLT_MAX, as in Darknet.
#include <metal_stdlib>
#include "dm_args.h"
using namespace metal;

// Grid (out_w, out_h, planes).
template <typename T>
kernel void maxpool_fwd(constant dm_pool_args& args [[buffer(0)]],
                        device const T* x [[buffer(1)]],
                        device T* y [[buffer(2)]],
                        uint3 gid [[thread_position_in_grid]]) {
    if (gid.x >= args.out_w || gid.y >= args.out_h || gid.z >= args.planes) return;
    const int offset = int(args.padding / 2);
    device const T* src = x + gid.z * args.height * args.width;
    float best = -FLT_MAX;
    for (uint n = 0; n < args.size; ++n) {
        int yy = int(gid.y * args.stride_y + n) - offset;
        if (yy < 0 || yy >= int(args.height)) continue;
        for (uint m = 0; m < args.size; ++m) {
            int xx = int(gid.x * args.stride_x + m) - offset;
            if (xx < 0 || xx >= int(args.width)) continue;
            float v = src[uint(yy) * args.width + uint(xx)];
            // Strict ">" is Darknet's: NaN never wins and ties keep the first position.
            if (v > best) best = v;
        }
    }
    y[(gid.z * args.out_h + gid.y) * args.out_w + gid.x] = best;
}

// maxpool_depth=1: output channel g is the maximum of input channels g, g + out_channels, ...
// Grid (spatial, out_channels, batch).
template <typename T>
kernel void maxpool_depth_fwd(constant dm_maxpool_depth_args& args [[buffer(0)]],
                              device const T* x [[buffer(1)]],
                              device T* y [[buffer(2)]],
                              uint3 gid [[thread_position_in_grid]]) {
    if (gid.x >= args.spatial || gid.y >= args.out_channels || gid.z >= args.batch) return;
    float best = -FLT_MAX;
    for (uint k = gid.y; k < args.channels; k += args.out_channels) {
        float v = x[(gid.z * args.channels + k) * args.spatial + gid.x];
        if (v > best) best = v;
    }
    y[(gid.z * args.out_channels + gid.y) * args.spatial + gid.x] = best;
}

// Global average: one thread per plane sums its values in order (as Darknet does), then
// divides by their count. Grid: planes.
template <typename T>
kernel void avgpool_fwd(constant dm_avgpool_args& args [[buffer(0)]],
                        device const T* x [[buffer(1)]],
                        device T* y [[buffer(2)]],
                        uint gid [[thread_position_in_grid]]) {
    if (gid >= args.planes) return;
    device const T* src = x + gid * args.spatial;
    float total = 0.0f;
    for (uint i = 0; i < args.spatial; ++i) total += src[i];
    y[gid] = total / float(args.spatial);
}

typedef decltype(maxpool_fwd<float>) maxpool_fwd_f32_t;
typedef decltype(maxpool_fwd<half>) maxpool_fwd_f16_t;
template [[host_name("maxpool_fwd_f32")]] kernel maxpool_fwd_f32_t maxpool_fwd<float>;
template [[host_name("maxpool_fwd_f16")]] kernel maxpool_fwd_f16_t maxpool_fwd<half>;

typedef decltype(maxpool_depth_fwd<float>) maxpool_depth_fwd_f32_t;
typedef decltype(maxpool_depth_fwd<half>) maxpool_depth_fwd_f16_t;
template [[host_name("maxpool_depth_fwd_f32")]] kernel maxpool_depth_fwd_f32_t maxpool_depth_fwd<float>;
template [[host_name("maxpool_depth_fwd_f16")]] kernel maxpool_depth_fwd_f16_t maxpool_depth_fwd<half>;

typedef decltype(avgpool_fwd<float>) avgpool_fwd_f32_t;
typedef decltype(avgpool_fwd<half>) avgpool_fwd_f16_t;
template [[host_name("avgpool_fwd_f32")]] kernel avgpool_fwd_f32_t avgpool_fwd<float>;
template [[host_name("avgpool_fwd_f16")]] kernel avgpool_fwd_f16_t avgpool_fwd<half>;

// ---- training ------------------------------------------------------------------------------

// Every backward pass ADDS into the gradients it writes (a layer's input may feed several
// consumers). No float atomics: an element written by several contributions is formed by
// one thread, gathering them in a fixed order, so results never depend on scheduling.

// maxpool_fwd_f32 plus, per output, the flat index into x (over the whole batch) of the
// element taken: the first strictly greater one in window order, -1 when no element is
// (a window wholly outside the image, or only values not above -FLT_MAX).
// Grid (out_w, out_h, planes).
kernel void maxpool_fwd_train_f32(constant dm_pool_args& args [[buffer(0)]],
                                  device const float* x [[buffer(1)]],
                                  device float* y [[buffer(2)]],
                                  device int* indexes [[buffer(3)]],
                                  uint3 gid [[thread_position_in_grid]]) {
    if (gid.x >= args.out_w || gid.y >= args.out_h || gid.z >= args.planes) return;
    const int offset = int(args.padding / 2);
    const uint base = gid.z * args.height * args.width;
    float best = -FLT_MAX;
    int best_at = -1;
    for (uint n = 0; n < args.size; ++n) {
        int yy = int(gid.y * args.stride_y + n) - offset;
        if (yy < 0 || yy >= int(args.height)) continue;
        for (uint m = 0; m < args.size; ++m) {
            int xx = int(gid.x * args.stride_x + m) - offset;
            if (xx < 0 || xx >= int(args.width)) continue;
            const uint at = base + uint(yy) * args.width + uint(xx);
            const float v = x[at];
            if (v > best) {
                best = v;
                best_at = int(at);
            }
        }
    }
    const uint out = (gid.z * args.out_h + gid.y) * args.out_w + gid.x;
    y[out] = best;
    indexes[out] = best_at;
}

// maxpool_depth_fwd_f32 plus the flat index of each maximum (the lowest channel on ties).
// Grid (spatial, out_channels, batch).
kernel void maxpool_depth_fwd_train_f32(constant dm_maxpool_depth_args& args [[buffer(0)]],
                                        device const float* x [[buffer(1)]],
                                        device float* y [[buffer(2)]],
                                        device int* indexes [[buffer(3)]],
                                        uint3 gid [[thread_position_in_grid]]) {
    if (gid.x >= args.spatial || gid.y >= args.out_channels || gid.z >= args.batch) return;
    float best = -FLT_MAX;
    int best_at = -1;
    for (uint k = gid.y; k < args.channels; k += args.out_channels) {
        const uint at = (gid.z * args.channels + k) * args.spatial + gid.x;
        const float v = x[at];
        if (v > best) {
            best = v;
            best_at = int(at);
        }
    }
    const uint out = (gid.z * args.out_channels + gid.y) * args.spatial + gid.x;
    y[out] = best;
    indexes[out] = best_at;
}

// x_grad[e] += delta[o] for every output o whose recorded argmax is e. Overlapping windows
// make that a scatter with collisions, so each input element gathers instead: it visits the
// outputs whose window covers it in output order (rows, then columns), the order in which
// the CPU's loop over the outputs adds into it (or into 0, when not accumulate: every
// element is written). The index buffer is only compared with the
// element's own index, never used to address memory. Grid (width, height, planes).
kernel void maxpool_bwd_f32(constant dm_pool_args& args [[buffer(0)]],
                            device const float* delta [[buffer(1)]],
                            device const int* indexes [[buffer(2)]],
                            device float* x_grad [[buffer(3)]],
                            uint3 gid [[thread_position_in_grid]]) {
    if (gid.x >= args.width || gid.y >= args.height || gid.z >= args.planes) return;
    if (args.out_h == 0u || args.out_w == 0u || args.stride_x == 0u || args.stride_y == 0u) return;
    const int offset = int(args.padding / 2);
    const int size = int(args.size);
    // Window i covers rows [i*stride_y - offset, i*stride_y - offset + size).
    const int ry = int(gid.y) + offset, rx = int(gid.x) + offset;
    const int sy = int(args.stride_y), sx = int(args.stride_x);
    const int i_lo = ry - size + 1 > 0 ? (ry - size + 1 + sy - 1) / sy : 0;
    const int i_hi = min(ry / sy, int(args.out_h) - 1);
    const int j_lo = rx - size + 1 > 0 ? (rx - size + 1 + sx - 1) / sx : 0;
    const int j_hi = min(rx / sx, int(args.out_w) - 1);
    const uint e = (gid.z * args.height + gid.y) * args.width + gid.x;
    const int self = int(e);
    float total = args.accumulate != 0u ? x_grad[e] : 0.0f;
    for (int i = i_lo; i <= i_hi; ++i) {
        for (int j = j_lo; j <= j_hi; ++j) {
            const uint o = (gid.z * args.out_h + uint(i)) * args.out_w + uint(j);
            if (indexes[o] == self) total = total + delta[o];
        }
    }
    x_grad[e] = total;
}

// maxpool_depth's backward: input channel k can only be the maximum of output channel
// k % out_channels at its pixel, so each input element has at most one contributor.
// Grid (spatial, channels, batch).
kernel void maxpool_depth_bwd_f32(constant dm_maxpool_depth_args& args [[buffer(0)]],
                                  device const float* delta [[buffer(1)]],
                                  device const int* indexes [[buffer(2)]],
                                  device float* x_grad [[buffer(3)]],
                                  uint3 gid [[thread_position_in_grid]]) {
    if (gid.x >= args.spatial || gid.y >= args.channels || gid.z >= args.batch) return;
    if (args.out_channels == 0u) return;
    const uint e = (gid.z * args.channels + gid.y) * args.spatial + gid.x;
    const uint o = (gid.z * args.out_channels + gid.y % args.out_channels) * args.spatial + gid.x;
    if (indexes[o] == int(e)) x_grad[e] = x_grad[e] + delta[o];
}

// Global average pooling: x_grad[p, i] += delta[p] / spatial. Grid (spatial, planes).
kernel void avgpool_bwd_f32(constant dm_avgpool_args& args [[buffer(0)]],
                            device const float* delta [[buffer(1)]],
                            device float* x_grad [[buffer(2)]],
                            uint2 gid [[thread_position_in_grid]]) {
    if (gid.x >= args.spatial || gid.y >= args.planes) return;
    const float share = delta[gid.y] / float(args.spatial);
    const uint at = gid.y * args.spatial + gid.x;
    x_grad[at] = x_grad[at] + share;
}
