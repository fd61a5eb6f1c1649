// Per-channel training kernels of convolutional and connected layers: the bias gradient and
// batch normalisation with mini-batch statistics (forward and backward). The convolution's
// weight and input gradients are GEMMs (gemm.metal) and col2im (im2col.metal); see
// shaders/README.md for the dispatches.
//
// Every per-channel sum is two dispatches over the whole tensor, parallel and in a fixed
// order: *_part kernels, one threadgroup of DM_SUM_THREADS per run of `chunk` values of a
// channel (dm_bias_args), each thread adding every DM_SUM_THREADS-th value of the run in
// order, then the threads' sums in a fixed tree; then one threadgroup per channel adds the
// runs' partial sums the same way and finishes the statistic. The order depends only on the
// sizes, never on scheduling, and no float atomics are used: the same inputs give the same
// bits on a device. It is not Darknet's serial order (the CPU path keeps that): a tree's sum
// is closer to the exact one. No output element is written by two threads.
#include <metal_stdlib>
#include "dm_args.h"
#include "dm_activation.h"
using namespace metal;

// Threads of a *_part threadgroup, and of a threadgroup adding one channel's partial sums.
constant uint DM_SUM_THREADS = 64;
constant uint DM_FINISH_THREADS = 32;

// (image, position) of the j-th of a channel's batch*spatial values, flattened image by
// image.
inline uint2 dm_split(uint j, uint spatial) { return uint2(j / spatial, j % spatial); }

// (image, position) DM_SUM_THREADS values further on; step = dm_split(DM_SUM_THREADS, spatial).
inline uint2 dm_advance(uint2 at, uint2 step, uint spatial) {
    at += step;
    if (at.y >= spatial) {
        at.y -= spatial;
        at.x += 1;
    }
    return at;
}

// Index of value (image, position) of channel c in a (batch, channels, spatial) array.
inline uint dm_at(uint2 at, uint channels, uint spatial, uint c) {
    return (at.x * channels + c) * spatial + at.y;
}

// The sum of v over the threadgroup's `width` threads (a power of two): halves added
// pairwise, a fixed tree. Every thread must call it (it has barriers); every thread gets the
// sum.
inline float dm_group_sum(threadgroup float* scratch, float v, uint lid, uint width) {
    scratch[lid] = v;
    for (uint half_width = width / 2; half_width > 0; half_width /= 2) {
        threadgroup_barrier(mem_flags::mem_threadgroup);
        if (lid < half_width) scratch[lid] = scratch[lid] + scratch[lid + half_width];
    }
    threadgroup_barrier(mem_flags::mem_threadgroup);
    const float sum = scratch[0];
    threadgroup_barrier(mem_flags::mem_threadgroup);  // scratch may be reused at once
    return sum;
}

// The sum of channel c's `chunks` partial sums starting at partials[first], on one
// threadgroup of DM_FINISH_THREADS: each thread adds every DM_FINISH_THREADS-th in order,
// then the tree.
inline float dm_sum_partials(device const float* partials, uint first, uint chunks,
                             threadgroup float* scratch, uint lid) {
    float acc = 0.0f;
    for (uint g = lid; g < chunks; g += DM_FINISH_THREADS) acc += partials[first + g];
    return dm_group_sum(scratch, acc, lid, DM_FINISH_THREADS);
}

// The sum of run g of channel c of a (batch, channels, spatial) array `a` (runs of `chunk`
// values), on a threadgroup of DM_SUM_THREADS: each thread adds every DM_SUM_THREADS-th value
// of the run in order, then the tree. Every thread gets the sum.
inline float dm_run_sum(device const float* a, uint batch, uint channels, uint spatial,
                        uint chunk, uint g, uint c, threadgroup float* scratch, uint lid) {
    const uint end = min((g + 1) * chunk, batch * spatial);
    const uint2 step = dm_split(DM_SUM_THREADS, spatial);
    uint j = g * chunk + lid;
    uint2 at = dm_split(j, spatial);
    float acc = 0.0f;
    for (; j < end; j += DM_SUM_THREADS) {
        acc += a[dm_at(at, channels, spatial, c)];
        at = dm_advance(at, step, spatial);
    }
    return dm_group_sum(scratch, acc, lid, DM_SUM_THREADS);
}

// partials[c*chunks + g] = the sum of delta over run g of channel c. Threadgroups (chunks,
// channels) of DM_SUM_THREADS.
kernel void bias_bwd_part_f32(constant dm_bias_args& args [[buffer(0)]],
                              device const float* delta [[buffer(1)]],
                              device float* partials [[buffer(2)]],
                              uint2 group [[threadgroup_position_in_grid]],
                              uint lid [[thread_index_in_threadgroup]]) {
    threadgroup float scratch[DM_SUM_THREADS];
    const float sum = dm_run_sum(delta, args.batch, args.channels, args.spatial, args.chunk,
                                 group.x, group.y, scratch, lid);
    if (lid == 0) partials[group.y * args.chunks + group.x] = sum;
}

// partials[c*chunks + g] = the sum of x over run g of channel c, for the mean. Threadgroups
// (chunks, channels) of DM_SUM_THREADS.
kernel void batchnorm_fwd_mean_part_f32(constant dm_batchnorm_args& args [[buffer(0)]],
                                        device const float* x [[buffer(1)]],
                                        device float* partials [[buffer(2)]],
                                        uint2 group [[threadgroup_position_in_grid]],
                                        uint lid [[thread_index_in_threadgroup]]) {
    threadgroup float scratch[DM_SUM_THREADS];
    const float sum = dm_run_sum(x, args.batch, args.channels, args.spatial, args.chunk,
                                 group.x, group.y, scratch, lid);
    if (lid == 0) partials[group.y * args.chunks + group.x] = sum;
}

// bias_grad[c] += the sum of channel c's partials (bias_bwd_part_f32). Threadgroups
// (channels) of DM_FINISH_THREADS.
kernel void bias_bwd_f32(constant dm_bias_args& args [[buffer(0)]],
                         device const float* partials [[buffer(1)]],
                         device float* bias_grad [[buffer(2)]],
                         uint c [[threadgroup_position_in_grid]],
                         uint lid [[thread_index_in_threadgroup]]) {
    threadgroup float scratch[DM_FINISH_THREADS];
    const float sum = dm_sum_partials(partials, c * args.chunks, args.chunks, scratch, lid);
    if (lid == 0) bias_grad[c] = bias_grad[c] + sum;
}

// mean[c] = the channel's sum times the rounded reciprocal of its count (as the CPU
// multiplies). Threadgroups (channels) of DM_FINISH_THREADS.
kernel void batchnorm_fwd_mean_f32(constant dm_batchnorm_args& args [[buffer(0)]],
                                   device const float* partials [[buffer(1)]],
                                   device float* mean [[buffer(2)]],
                                   uint c [[threadgroup_position_in_grid]],
                                   uint lid [[thread_index_in_threadgroup]]) {
    threadgroup float scratch[DM_FINISH_THREADS];
    const float sum = dm_sum_partials(partials, c * args.chunks, args.chunks, scratch, lid);
    if (lid == 0) mean[c] = sum * (1.0f / float(args.batch * args.spatial));
}

// Partial sums of (x - mean[c])^2, each term rounded once (fma), around the mean the previous
// dispatches found: the variance in a second pass, as the CPU computes it. Threadgroups
// (chunks, channels) of DM_SUM_THREADS.
kernel void batchnorm_fwd_var_part_f32(constant dm_batchnorm_args& args [[buffer(0)]],
                                       device const float* x [[buffer(1)]],
                                       device const float* mean [[buffer(2)]],
                                       device float* partials [[buffer(3)]],
                                       uint2 group [[threadgroup_position_in_grid]],
                                       uint lid [[thread_index_in_threadgroup]]) {
    threadgroup float scratch[DM_SUM_THREADS];
    const uint c = group.y, n = args.batch * args.spatial;
    const uint end = min((group.x + 1) * args.chunk, n);
    const uint2 step = dm_split(DM_SUM_THREADS, args.spatial);
    const float m = mean[c];
    uint j = group.x * args.chunk + lid;
    uint2 at = dm_split(j, args.spatial);
    float acc = 0.0f;
    for (; j < end; j += DM_SUM_THREADS) {
        const float dev = x[dm_at(at, args.channels, args.spatial, c)] - m;
        acc = fma(dev, dev, acc);
        at = dm_advance(at, step, args.spatial);
    }
    const float sum = dm_group_sum(scratch, acc, lid, DM_SUM_THREADS);
    if (lid == 0) partials[c * args.chunks + group.x] = sum;
}

// The unbiased variance from the partials, and the running averages
// r = momentum*r + (1 - momentum)*stat in the CPU's two roundings. Threadgroups (channels) of
// DM_FINISH_THREADS.
kernel void batchnorm_fwd_var_f32(constant dm_batchnorm_args& args [[buffer(0)]],
                                  device const float* partials [[buffer(1)]],
                                  device const float* mean [[buffer(2)]],
                                  device float* variance [[buffer(3)]],
                                  device float* rolling_mean [[buffer(4)]],
                                  device float* rolling_variance [[buffer(5)]],
                                  uint c [[threadgroup_position_in_grid]],
                                  uint lid [[thread_index_in_threadgroup]]) {
    threadgroup float scratch[DM_FINISH_THREADS];
    const float sum = dm_sum_partials(partials, c * args.chunks, args.chunks, scratch, lid);
    if (lid != 0) return;
    const float v = sum * (1.0f / float(args.batch * args.spatial - 1));
    variance[c] = v;
    float r = rolling_mean[c] * args.momentum;
    rolling_mean[c] = r + args.one_minus_momentum * mean[c];
    r = rolling_variance[c] * args.momentum;
    rolling_variance[c] = r + args.one_minus_momentum * v;
}

// out = act(x_norm*scale + bias), x_norm = (x - mean)/sqrt(variance + eps). x_norm itself is
// not stored: the backward recomputes it where it needs it (batchnorm_bwd_part_f32); the
// layer's activation is applied here when it is element-wise and differentiated from its
// output, so the forward moves two tensors once, not three and then one twice. out may be x:
// each element is read before it is written.
// Grid (spatial, channels, batch).
kernel void batchnorm_fwd_norm_f32(constant dm_batchnorm_args& args [[buffer(0)]],
                                   device const float* x [[buffer(1)]],
                                   device const float* mean [[buffer(2)]],
                                   device const float* variance [[buffer(3)]],
                                   device const float* scale [[buffer(4)]],
                                   device const float* bias [[buffer(5)]],
                                   device float* out [[buffer(6)]],
                                   uint3 gid [[thread_position_in_grid]]) {
    if (gid.x >= args.spatial || gid.y >= args.channels || gid.z >= args.batch) return;
    const uint c = gid.y;
    const uint i = (gid.z * args.channels + c) * args.spatial + gid.x;
    const float value = (x[i] - mean[c]) / sqrt(variance[c] + args.eps);
    out[i] = dm_activate(value * scale[c] + bias[c], args.act);
}

// Partial sums of the backward from the incoming delta (the gradient with respect to the
// batch norm's output), three per run: delta, delta*x_norm and delta*(x - mean[c]), at
// partials[(k*channels + c)*chunks + g] for k = 0, 1, 2. x_norm is recomputed here, with
// batchnorm_fwd_norm_f32's arithmetic (the same bits as the CPU's), not read: a tensor
// written by one pass and read by the next cost a full pass of its own.
// Threadgroups (chunks, channels) of DM_SUM_THREADS.
kernel void batchnorm_bwd_part_f32(constant dm_batchnorm_args& args [[buffer(0)]],
                                   device const float* delta [[buffer(1)]],
                                   device const float* x [[buffer(2)]],
                                   device const float* mean [[buffer(3)]],
                                   device const float* variance [[buffer(4)]],
                                   device float* partials [[buffer(5)]],
                                   uint2 group [[threadgroup_position_in_grid]],
                                   uint lid [[thread_index_in_threadgroup]]) {
    threadgroup float scratch[DM_SUM_THREADS];
    const uint c = group.y, n = args.batch * args.spatial;
    const uint end = min((group.x + 1) * args.chunk, n);
    const uint2 step = dm_split(DM_SUM_THREADS, args.spatial);
    const float m = mean[c], root = sqrt(variance[c] + args.eps);
    uint j = group.x * args.chunk + lid;
    uint2 at = dm_split(j, args.spatial);
    float sum_delta = 0.0f, sum_scale = 0.0f, sum_var = 0.0f;
    for (; j < end; j += DM_SUM_THREADS) {
        const uint i = dm_at(at, args.channels, args.spatial, c);
        const float d = delta[i], centred = x[i] - m;
        sum_delta += d;
        sum_scale += d * (centred / root);
        sum_var += d * centred;
        at = dm_advance(at, step, args.spatial);
    }
    const uint out = c * args.chunks + group.x, stride = args.channels * args.chunks;
    const float s0 = dm_group_sum(scratch, sum_delta, lid, DM_SUM_THREADS);
    const float s1 = dm_group_sum(scratch, sum_scale, lid, DM_SUM_THREADS);
    const float s2 = dm_group_sum(scratch, sum_var, lid, DM_SUM_THREADS);
    if (lid == 0) {
        partials[out] = s0;
        partials[stride + out] = s1;
        partials[2 * stride + out] = s2;
    }
}

// The backward's per-channel results from batchnorm_bwd_part_f32's partials: bias_grad +=
// sum delta, scale_grad += sum delta*x_norm, and Darknet's mean_delta and variance_delta for
// batchnorm_bwd_delta_f32 (with delta scaled by scale[c], as the CPU scales it).
// Threadgroups (channels) of DM_FINISH_THREADS.
kernel void batchnorm_bwd_sums_f32(constant dm_batchnorm_args& args [[buffer(0)]],
                                   device const float* partials [[buffer(1)]],
                                   device const float* variance [[buffer(2)]],
                                   device const float* scale [[buffer(3)]],
                                   device float* scale_grad [[buffer(4)]],
                                   device float* bias_grad [[buffer(5)]],
                                   device float* mean_delta [[buffer(6)]],
                                   device float* var_delta [[buffer(7)]],
                                   uint c [[threadgroup_position_in_grid]],
                                   uint lid [[thread_index_in_threadgroup]]) {
    threadgroup float scratch[DM_FINISH_THREADS];
    const uint first = c * args.chunks, stride = args.channels * args.chunks;
    const float sum_delta = dm_sum_partials(partials, first, args.chunks, scratch, lid);
    const float sum_scale = dm_sum_partials(partials, stride + first, args.chunks, scratch, lid);
    const float sum_var = dm_sum_partials(partials, 2 * stride + first, args.chunks, scratch, lid);
    if (lid != 0) return;
    bias_grad[c] = bias_grad[c] + sum_delta;
    scale_grad[c] = scale_grad[c] + sum_scale;
    const float s = scale[c];
    const float ve = variance[c] + args.eps;
    const float root = sqrt(ve);
    mean_delta[c] = (sum_delta * s) * (-1.0f / root);
    var_delta[c] = (sum_var * s) * (-0.5f / (ve * root));  // -1/2 (var + eps)^(-3/2)
}

// delta = delta*scale/den + var_delta*2(x - mean)/var_den + mean_delta/N, in place: Darknet's
// normalize_delta_cpu has den = sqrt(var) + eps and var_den = N; exact != 0 gives the true
// gradient of the forward, den = sqrt(var + eps) and var_den = N - 1. Run after
// batchnorm_bwd_part_f32, which read the incoming delta. Grid (spatial, channels, batch).
kernel void batchnorm_bwd_delta_f32(constant dm_batchnorm_args& args [[buffer(0)]],
                                    device const float* x [[buffer(1)]],
                                    device const float* mean [[buffer(2)]],
                                    device const float* variance [[buffer(3)]],
                                    device const float* scale [[buffer(4)]],
                                    device const float* mean_delta [[buffer(5)]],
                                    device const float* var_delta [[buffer(6)]],
                                    device float* delta [[buffer(7)]],
                                    uint3 gid [[thread_position_in_grid]]) {
    if (gid.x >= args.spatial || gid.y >= args.channels || gid.z >= args.batch) return;
    const uint c = gid.y;
    const uint i = (gid.z * args.channels + c) * args.spatial + gid.x;
    const uint n = args.batch * args.spatial;
    const float v = variance[c];
    const bool exact = args.exact != 0u;
    const float den = exact ? sqrt(v + args.eps) : sqrt(v) + args.eps;
    const float var_den = float(exact ? n - 1 : n);
    const float scaled = delta[i] * scale[c];
    delta[i] = scaled / den + var_delta[c] * 2.0f * (x[i] - mean[c]) / var_den
               + mean_delta[c] / float(n);
}
