// im2col: unfold convolution windows into the columns of the GEMM operand, in Darknet's
// layout: row (c*ksize + ky)*ksize + kx, column oy*out_w + ox holds the input at
// (oy*stride_y - pad*dilation + ky*dilation, ox*stride_x - pad*dilation + kx*dilation) of
// channel c, or 0 outside the image.
// col2im_bwd_f32 is its adjoint, the convolution's input gradient.
#include <metal_stdlib>
#include "dm_args.h"
using namespace metal;

// Grid (out_h*out_w, channels, images*groups): one thread per column and channel writes that
// column's ksize*ksize rows (c, ky, kx) in order, so a thread's two integer divisions serve
// all of them (divisions were most of this kernel's work) and its reads are neighbours in
// the input rows. Slice z reads channels [0, channels) of its own input slice (groups are
// consecutive channel blocks of one image, so image b group g is slice b*groups + g).
template <typename T>
kernel void im2col_fwd(constant dm_im2col_args& args [[buffer(0)]],
                       device const T* image [[buffer(1)]],
                       device T* col [[buffer(2)]],
                       uint3 gid [[thread_position_in_grid]]) {
    const uint spatial = args.out_h * args.out_w;
    if (gid.x >= spatial || gid.y >= args.channels) return;
    const uint c = gid.y;
    const uint oy = gid.x / args.out_w;
    const uint ox = gid.x % args.out_w;
    const int pad = int(args.pad * args.dilation);
    const int iy0 = int(oy * args.stride_y) - pad;
    const int ix0 = int(ox * args.stride_x) - pad;
    const uint plane = args.height * args.width;
    device const T* src = image + (gid.z * args.channels + c) * plane;
    device T* dst = col + (gid.z * args.channels + c) * args.ksize * args.ksize * spatial + gid.x;
    for (uint ky = 0; ky < args.ksize; ++ky) {
        const int iy = iy0 + int(ky * args.dilation);
        const bool row_inside = iy >= 0 && iy < int(args.height);
        for (uint kx = 0; kx < args.ksize; ++kx) {
            const int ix = ix0 + int(kx * args.dilation);
            float v = 0.0f;
            if (row_inside && ix >= 0 && ix < int(args.width)) {
                v = src[uint(iy) * args.width + uint(ix)];
            }
            dst[(ky * args.ksize + kx) * spatial] = v;
        }
    }
}

typedef decltype(im2col_fwd<float>) im2col_fwd_f32_t;
typedef decltype(im2col_fwd<half>) im2col_fwd_f16_t;
template [[host_name("im2col_fwd_f32")]] kernel im2col_fwd_f32_t im2col_fwd<float>;
template [[host_name("im2col_fwd_f16")]] kernel im2col_fwd_f16_t im2col_fwd<half>;

// ---- backward ------------------------------------------------------------------------------

// The output position o (< out) that reads input offset t through a tap, o*stride = t, if
// there is one. Strides 1 and 2 (Darknet's convolutions) need no division: the branch goes the
// same way for every thread of a dispatch, and integer divisions were most of this kernel's
// work.
inline bool col2im_output_of(int t, uint stride, uint out, thread uint& o) {
    if (t < 0) return false;
    if (stride == 1u) {
        o = uint(t);
    } else if (stride == 2u) {
        if ((uint(t) & 1u) != 0u) return false;
        o = uint(t) >> 1;
    } else {
        if (uint(t) % stride != 0u) return false;
        o = uint(t) / stride;
    }
    return o < out;
}

// The taps of a 3x3 kernel (most of Darknet's) unrolled: the nine loads are issued before
// the first add needs one, where the general loop waited for each load in turn. A tap no
// output reaches loads nothing and adds nothing, so the sum's terms and order are the loop's.
inline float col2im_taps3(constant dm_im2col_args& args, device const float* src, uint spatial,
                          int iy, int ix, float acc) {
    float v[9];
    bool hit[9];
    for (uint ky = 0; ky < 3; ++ky) {
        uint oy = 0;
        const bool row = col2im_output_of(iy - int(ky * args.dilation), args.stride_y,
                                          args.out_h, oy);
        for (uint kx = 0; kx < 3; ++kx) {
            uint ox = 0;
            const uint t = ky * 3 + kx;
            hit[t] = row && col2im_output_of(ix - int(kx * args.dilation), args.stride_x,
                                             args.out_w, ox);
            v[t] = hit[t] ? src[t * spatial + oy * args.out_w + ox] : 0.0f;
        }
    }
    for (uint t = 0; t < 9; ++t) {
        if (hit[t]) acc += v[t];
    }
    return acc;
}

// col2im as a gather, the adjoint of im2col_fwd_f32 with the same arguments: each image
// element adds the column entries that im2col copied from it, in (ky, kx) order, to its old
// value (accumulate) or to 0 (every element is written: a delta's first writer). A tap
// (ky, kx) reaches pixel (iy, ix) from at most one output position, so this is the order in
// which the CPU's col2im adds them and the sums agree bit for bit.
// Grid (height*width, channels, images*groups); channels is per group, as in im2col.
kernel void col2im_bwd_f32(constant dm_im2col_args& args [[buffer(0)]],
                           device const float* col [[buffer(1)]],
                           device float* image [[buffer(2)]],
                           uint3 gid [[thread_position_in_grid]]) {
    const uint plane = args.height * args.width;
    if (gid.x >= plane || gid.y >= args.channels) return;
    const uint spatial = args.out_h * args.out_w;
    const uint k2 = args.ksize * args.ksize;
    const int pad = int(args.pad * args.dilation);
    const int iy = int(gid.x / args.width) + pad;
    const int ix = int(gid.x % args.width) + pad;
    device const float* src = col + (gid.z * args.channels + gid.y) * k2 * spatial;
    const uint at = (gid.z * args.channels + gid.y) * plane + gid.x;
    float acc = args.accumulate != 0u ? image[at] : 0.0f;
    if (args.ksize == 3u) {
        image[at] = col2im_taps3(args, src, spatial, iy, ix, acc);
        return;
    }
    for (uint ky = 0; ky < args.ksize; ++ky) {
        // Output row oy reads this pixel through tap ky when oy*stride_y = iy + pad - ky*dil.
        uint oy;
        if (!col2im_output_of(iy - int(ky * args.dilation), args.stride_y, args.out_h, oy)) {
            continue;
        }
        for (uint kx = 0; kx < args.ksize; ++kx) {
            uint ox;
            if (!col2im_output_of(ix - int(kx * args.dilation), args.stride_x, args.out_w, ox)) {
                continue;
            }
            acc += src[(ky * args.ksize + kx) * spatial + oy * args.out_w + ox];
        }
    }
    image[at] = acc;
}
