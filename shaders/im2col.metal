// im2col: unfold convolution windows into the columns of the GEMM operand, in Darknet's
// layout: row (c*ksize + ky)*ksize + kx, column oy*out_w + ox holds the input at
// (oy*stride_y - pad*dilation + ky*dilation, ox*stride_x - pad*dilation + kx*dilation) of
// channel c, or 0 outside the image.
#include <metal_stdlib>
#include "dm_args.h"
using namespace metal;

// Grid (out_h*out_w, channels*ksize*ksize, images*groups): one thread per column element;
// slice z reads channels [0, channels) of its own input slice (groups are consecutive
// channel blocks of one image, so image b group g is slice b*groups + g).
template <typename T>
kernel void im2col_fwd(constant dm_im2col_args& args [[buffer(0)]],
                       device const T* image [[buffer(1)]],
                       device T* col [[buffer(2)]],
                       uint3 gid [[thread_position_in_grid]]) {
    const uint spatial = args.out_h * args.out_w;
    const uint k2 = args.ksize * args.ksize;
    const uint rows = args.channels * k2;
    if (gid.x >= spatial || gid.y >= rows) return;
    const uint row = gid.y;
    const uint c = row / k2;
    const uint ky = (row / args.ksize) % args.ksize;
    const uint kx = row % args.ksize;
    const uint oy = gid.x / args.out_w;
    const uint ox = gid.x % args.out_w;
    const int pad = int(args.pad * args.dilation);
    const int iy = int(oy * args.stride_y + ky * args.dilation) - pad;
    const int ix = int(ox * args.stride_x + kx * args.dilation) - pad;
    const uint plane = args.height * args.width;
    device const T* src = image + gid.z * args.channels * plane;
    float v = 0.0f;
    if (iy >= 0 && iy < int(args.height) && ix >= 0 && ix < int(args.width)) {
        v = src[c * plane + uint(iy) * args.width + uint(ix)];
    }
    col[(gid.z * rows + row) * spatial + gid.x] = v;
}

typedef decltype(im2col_fwd<float>) im2col_fwd_f32_t;
typedef decltype(im2col_fwd<half>) im2col_fwd_f16_t;
template [[host_name("im2col_fwd_f32")]] kernel im2col_fwd_f32_t im2col_fwd<float>;
template [[host_name("im2col_fwd_f16")]] kernel im2col_fwd_f16_t im2col_fwd<half>;
