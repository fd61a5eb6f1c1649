// Resampling: [upsample] (nearest neighbour, and Darknet's reverse/sum mode) and [reorg],
// forward and backward (added into the input's gradient).
// Index arithmetic is Darknet's flat one (upsample_cpu, reorg_cpu), quirks included.
#include <metal_stdlib>
#include "dm_args.h"
using namespace metal;

// Grid (out_w, out_h, planes). stride > 0: y = scale * x[.., j/s, i/s]. stride < 0: y is the
// sum, in row-major block order, of scale * x over an s x s block, the input read with rows
// out_w*s long and planes out_h*out_w*s*s long (exactly the input's when s divides its size).
template <typename T>
kernel void upsample_fwd(constant dm_upsample_args& args [[buffer(0)]],
                         device const T* x [[buffer(1)]],
                         device T* y [[buffer(2)]],
                         uint3 gid [[thread_position_in_grid]]) {
    if (gid.x >= args.out_w || gid.y >= args.out_h || gid.z >= args.planes) return;
    const uint dst = (gid.z * args.out_h + gid.y) * args.out_w + gid.x;
    if (args.stride > 0) {
        const uint s = uint(args.stride);
        y[dst] = args.scale * x[(gid.z * args.height + gid.y / s) * args.width + gid.x / s];
        return;
    }
    const uint s = uint(-args.stride);
    const uint row = args.out_w * s;
    device const T* src = x + gid.z * args.out_h * args.out_w * s * s;
    float total = 0.0f;
    for (uint dj = 0; dj < s; ++dj) {
        for (uint di = 0; di < s; ++di) {
            total += args.scale * src[(gid.y * s + dj) * row + gid.x * s + di];
        }
    }
    y[dst] = total;
}

// Darknet's reorg_cpu(x, width, height, channels, batch, stride, forward), called by [reorg]
// with the layer's reverse flag as `forward`: the small side is indexed (batch, channels,
// height, width), the large side read as (channels/s^2, height*s, width*s). reverse=0 copies
// large -> small, reverse=1 small -> large. Grid (width, height, batch*channels).
template <typename T>
kernel void reorg_fwd(constant dm_reorg_args& args [[buffer(0)]],
                      device const T* x [[buffer(1)]],
                      device T* y [[buffer(2)]],
                      uint3 gid [[thread_position_in_grid]]) {
    if (gid.x >= args.width || gid.y >= args.height || gid.z >= args.batch * args.channels) {
        return;
    }
    const uint s = args.stride;
    const uint in_c = args.channels / (s * s);
    const uint b = gid.z / args.channels, k = gid.z % args.channels;
    const uint c2 = k % in_c, offset = k / in_c;
    const uint small = gid.x + args.width * (gid.y + args.height * gid.z);
    const uint large_y = gid.y * s + offset / s;
    const uint large = (gid.x * s + offset % s) +
                       args.width * s * (large_y + args.height * s * (c2 + in_c * b));
    if (args.reverse != 0u) {
        y[large] = x[small];
    } else {
        y[small] = x[large];
    }
}

typedef decltype(upsample_fwd<float>) upsample_fwd_f32_t;
typedef decltype(upsample_fwd<half>) upsample_fwd_f16_t;
template [[host_name("upsample_fwd_f32")]] kernel upsample_fwd_f32_t upsample_fwd<float>;
template [[host_name("upsample_fwd_f16")]] kernel upsample_fwd_f16_t upsample_fwd<half>;

typedef decltype(reorg_fwd<float>) reorg_fwd_f32_t;
typedef decltype(reorg_fwd<half>) reorg_fwd_f16_t;
template [[host_name("reorg_fwd_f32")]] kernel reorg_fwd_f32_t reorg_fwd<float>;
template [[host_name("reorg_fwd_f16")]] kernel reorg_fwd_f16_t reorg_fwd<half>;

// ---- backward ------------------------------------------------------------------------------

// The transpose of upsample_fwd_f32, added into x_grad. stride > 0: each input pixel sums
// scale * delta over its s x s block, rows then columns, onto its old value; grid (width,
// height, planes) of the input. stride < 0: each output sends scale * delta to the s x s
// inputs the forward summed (read with rows out_w*s long, as the forward reads them); no two
// outputs share an input, so one thread per output; grid (out_w, out_h, planes).
kernel void upsample_bwd_f32(constant dm_upsample_args& args [[buffer(0)]],
                             device const float* delta [[buffer(1)]],
                             device float* x_grad [[buffer(2)]],
                             uint3 gid [[thread_position_in_grid]]) {
    if (gid.z >= args.planes || args.stride == 0) return;
    if (args.stride > 0) {
        if (gid.x >= args.width || gid.y >= args.height) return;
        const uint s = uint(args.stride);
        const uint at = (gid.z * args.height + gid.y) * args.width + gid.x;
        device const float* block =
            delta + gid.z * args.out_h * args.out_w + gid.y * s * args.out_w + gid.x * s;
        float total = x_grad[at];
        for (uint dy = 0; dy < s; ++dy) {
            for (uint dx = 0; dx < s; ++dx) total = total + args.scale * block[dy * args.out_w + dx];
        }
        x_grad[at] = total;
        return;
    }
    if (gid.x >= args.out_w || gid.y >= args.out_h) return;
    const uint s = uint(-args.stride);
    const uint row = args.out_w * s;
    const float v = args.scale * delta[(gid.z * args.out_h + gid.y) * args.out_w + gid.x];
    device float* dst = x_grad + gid.z * args.out_h * args.out_w * s * s;
    for (uint dj = 0; dj < s; ++dj) {
        for (uint di = 0; di < s; ++di) {
            const uint at = (gid.y * s + dj) * row + gid.x * s + di;
            dst[at] = dst[at] + v;
        }
    }
}

// The transpose of reorg_fwd_f32 (a permutation when s^2 divides channels, as the layer
// requires), added into x_grad: the same index map with the roles of the two sides swapped.
// Same arguments and grid as the forward.
kernel void reorg_bwd_f32(constant dm_reorg_args& args [[buffer(0)]],
                          device const float* delta [[buffer(1)]],
                          device float* x_grad [[buffer(2)]],
                          uint3 gid [[thread_position_in_grid]]) {
    if (gid.x >= args.width || gid.y >= args.height || gid.z >= args.batch * args.channels) {
        return;
    }
    const uint s = args.stride;
    const uint in_c = args.channels / (s * s);
    if (in_c == 0u) return;
    const uint b = gid.z / args.channels, k = gid.z % args.channels;
    const uint c2 = k % in_c, offset = k / in_c;
    const uint small = gid.x + args.width * (gid.y + args.height * gid.z);
    const uint large_y = gid.y * s + offset / s;
    const uint large = (gid.x * s + offset % s) +
                       args.width * s * (large_y + args.height * s * (c2 + in_c * b));
    if (args.reverse != 0u) {
        x_grad[small] = x_grad[small] + delta[large];
    } else {
        x_grad[large] = x_grad[large] + delta[small];
    }
}
