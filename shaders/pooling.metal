// Pooling: [maxpool] (windows and maxpool_depth) and global [avgpool].
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
