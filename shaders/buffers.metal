// Buffer utilities: fill, copy (float and half: inference copies too), accumulate, the sum of
// slices (split-K GEMMs), and a
// finiteness check, as fill.{fill,copy,add}_step and update.all_finite_step of
// darknet_metal/cpu/. One thread per element; no thread reads what another writes.
#include <metal_stdlib>
#include "dm_args.h"
using namespace metal;

// x[i] = value. Grid: n.
kernel void fill_buf_f32(constant dm_fill_args& args [[buffer(0)]],
                         device float* x [[buffer(1)]],
                         uint gid [[thread_position_in_grid]]) {
    if (gid >= args.n) return;
    x[gid] = args.value;
}

// dst[i] = src[i] (the buffers must not overlap). Grid: n.
template <typename T>
kernel void copy_buf(constant dm_copy_args& args [[buffer(0)]],
                     device const T* src [[buffer(1)]],
                     device T* dst [[buffer(2)]],
                     uint gid [[thread_position_in_grid]]) {
    if (gid >= args.n) return;
    dst[gid] = src[gid];
}

// dst[i] = dst[i] + scale*src[i]; scale = 1 adds exactly (1*src is src). Grid: n.
kernel void add_buf_f32(constant dm_add_args& args [[buffer(0)]],
                        device const float* src [[buffer(1)]],
                        device float* dst [[buffer(2)]],
                        uint gid [[thread_position_in_grid]]) {
    if (gid >= args.n) return;
    dst[gid] = dst[gid] + args.scale * src[gid];
}

// dst[i] += the sum of the slices' element i, added in slice order first (a fixed order: the
// split-K partial products of a GEMM, each summed over its part of K). Grid: n.
kernel void sum_slices_buf_f32(constant dm_sum_slices_args& args [[buffer(0)]],
                               device const float* src [[buffer(1)]],
                               device float* dst [[buffer(2)]],
                               uint gid [[thread_position_in_grid]]) {
    if (gid >= args.n) return;
    float acc = 0.0f;
    for (uint z = 0; z < args.slices; ++z) acc += src[z * args.stride + gid];
    dst[gid] = dst[gid] + acc;
}

// flag[0] = 0 when x holds a NaN or an infinity (all exponent bits set), tested on the bits
// so that fast math cannot fold the test away. The flag is only ever cleared, so one flag
// set to 1 by the host collects the checks of several arrays; every thread that finds a bad
// element stores the same 0, so the result does not depend on which one stores last.
// Grid: n.
kernel void finite_buf_f32(constant dm_finite_args& args [[buffer(0)]],
                           device const float* x [[buffer(1)]],
                           device float* flag [[buffer(2)]],
                           uint gid [[thread_position_in_grid]]) {
    if (gid >= args.n) return;
    if ((as_type<uint>(x[gid]) & 0x7F800000u) == 0x7F800000u) flag[0] = 0.0f;
}

typedef decltype(copy_buf<float>) copy_buf_f32_t;
typedef decltype(copy_buf<half>) copy_buf_f16_t;
template [[host_name("copy_buf_f32")]] kernel copy_buf_f32_t copy_buf<float>;
template [[host_name("copy_buf_f16")]] kernel copy_buf_f16_t copy_buf<half>;
