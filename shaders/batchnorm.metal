// Per-channel training kernels of convolutional and connected layers: the bias gradient and
// batch normalisation with mini-batch statistics (forward and backward). The convolution's
// weight and input gradients are GEMMs (gemm.metal) and col2im (im2col.metal); see
// shaders/README.md for the dispatches.
//
// Every reduction here is one thread per channel summing in Darknet's serial order, so
// results never depend on scheduling and match Darknet's float sums; no output element is
// written by two threads.
#include <metal_stdlib>
#include "dm_args.h"
using namespace metal;

// The j-th of the batch*spatial values of channel c in a (batch, channels, spatial) array.
inline uint dm_channel_index(constant dm_batchnorm_args& args, uint c, uint j) {
    return ((j / args.spatial) * args.channels + c) * args.spatial + j % args.spatial;
}

// bias_grad[c] += the sum of delta over positions, image by image (Darknet's backward_bias):
// one thread per channel, in Darknet's serial order. Grid (channels).
kernel void bias_bwd_f32(constant dm_bias_args& args [[buffer(0)]],
                         device const float* delta [[buffer(1)]],
                         device float* bias_grad [[buffer(2)]],
                         uint c [[thread_position_in_grid]]) {
    if (c >= args.channels) return;
    float acc = bias_grad[c];
    for (uint b = 0; b < args.batch; ++b) {
        device const float* row = delta + (b * args.channels + c) * args.spatial;
        float total = 0.0f;
        for (uint i = 0; i < args.spatial; ++i) total += row[i];
        acc += total;
    }
    bias_grad[c] = acc;
}

// Mini-batch statistics of channel c: mean, then the unbiased variance around it (a second
// pass, as the CPU does), and the running averages r = momentum*r + (1 - momentum)*stat in
// the CPU's two roundings. One thread per channel sums in Darknet's serial float order:
// some of these sums cancel, and a value a hair's breadth from an activation's kink or a
// loss threshold moves the whole training step, so the order is Darknet's, not a tree's.
// Grid (channels).
kernel void batchnorm_fwd_stats_f32(constant dm_batchnorm_args& args [[buffer(0)]],
                                    device const float* x [[buffer(1)]],
                                    device float* mean [[buffer(2)]],
                                    device float* variance [[buffer(3)]],
                                    device float* rolling_mean [[buffer(4)]],
                                    device float* rolling_variance [[buffer(5)]],
                                    uint c [[thread_position_in_grid]]) {
    if (c >= args.channels) return;
    const uint n = args.batch * args.spatial;
    float acc = 0.0f;
    for (uint j = 0; j < n; ++j) acc += x[dm_channel_index(args, c, j)];
    // The CPU multiplies by the rounded reciprocal rather than dividing.
    const float m = acc * (1.0f / float(n));
    acc = 0.0f;
    for (uint j = 0; j < n; ++j) {
        const float dev = x[dm_channel_index(args, c, j)] - m;
        // One rounding per term, as the CPU's float sum of double squares has.
        acc = fma(dev, dev, acc);
    }
    const float v = acc * (1.0f / float(n - 1));
    mean[c] = m;
    variance[c] = v;
    float r = rolling_mean[c] * args.momentum;
    rolling_mean[c] = r + args.one_minus_momentum * m;
    r = rolling_variance[c] * args.momentum;
    rolling_variance[c] = r + args.one_minus_momentum * v;
}

// x_norm = (x - mean)/sqrt(variance + eps) and out = x_norm*scale + bias. out may be x: each
// element is read before it is written. Grid (spatial, channels, batch).
kernel void batchnorm_fwd_norm_f32(constant dm_batchnorm_args& args [[buffer(0)]],
                                   device const float* x [[buffer(1)]],
                                   device const float* mean [[buffer(2)]],
                                   device const float* variance [[buffer(3)]],
                                   device const float* scale [[buffer(4)]],
                                   device const float* bias [[buffer(5)]],
                                   device float* x_norm [[buffer(6)]],
                                   device float* out [[buffer(7)]],
                                   uint3 gid [[thread_position_in_grid]]) {
    if (gid.x >= args.spatial || gid.y >= args.channels || gid.z >= args.batch) return;
    const uint c = gid.y;
    const uint i = (gid.z * args.channels + c) * args.spatial + gid.x;
    const float value = (x[i] - mean[c]) / sqrt(variance[c] + args.eps);
    x_norm[i] = value;
    out[i] = value * scale[c] + bias[c];
}

// The same x_norm alone, recomputed for the backward from what the forward read.
// Grid (spatial, channels, batch).
kernel void batchnorm_fwd_xnorm_f32(constant dm_batchnorm_args& args [[buffer(0)]],
                                    device const float* x [[buffer(1)]],
                                    device const float* mean [[buffer(2)]],
                                    device const float* variance [[buffer(3)]],
                                    device float* x_norm [[buffer(4)]],
                                    uint3 gid [[thread_position_in_grid]]) {
    if (gid.x >= args.spatial || gid.y >= args.channels || gid.z >= args.batch) return;
    const uint c = gid.y;
    const uint i = (gid.z * args.channels + c) * args.spatial + gid.x;
    x_norm[i] = (x[i] - mean[c]) / sqrt(variance[c] + args.eps);
}

// The per-channel sums of the backward, from the incoming delta (the gradient with respect to
// the batch norm's output): bias_grad += sum delta (image by image), scale_grad += sum
// delta*x_norm, and, with delta scaled by scale[c] as the CPU scales it, Darknet's
// mean_delta and variance_delta for batchnorm_bwd_delta_f32. One thread per channel, each
// sum in Darknet's serial order (see batchnorm_fwd_stats_f32). Grid (channels).
kernel void batchnorm_bwd_sums_f32(constant dm_batchnorm_args& args [[buffer(0)]],
                                   device const float* delta [[buffer(1)]],
                                   device const float* x [[buffer(2)]],
                                   device const float* mean [[buffer(3)]],
                                   device const float* variance [[buffer(4)]],
                                   device const float* x_norm [[buffer(5)]],
                                   device const float* scale [[buffer(6)]],
                                   device float* scale_grad [[buffer(7)]],
                                   device float* bias_grad [[buffer(8)]],
                                   device float* mean_delta [[buffer(9)]],
                                   device float* var_delta [[buffer(10)]],
                                   uint c [[thread_position_in_grid]]) {
    if (c >= args.channels) return;
    const uint n = args.batch * args.spatial;
    const float s = scale[c], m = mean[c];
    float bias_acc = bias_grad[c];
    for (uint b = 0; b < args.batch; ++b) {
        device const float* row = delta + (b * args.channels + c) * args.spatial;
        float total = 0.0f;
        for (uint i = 0; i < args.spatial; ++i) total += row[i];
        bias_acc += total;
    }
    bias_grad[c] = bias_acc;
    float scale_acc = 0.0f, mean_acc = 0.0f, var_acc = 0.0f;
    for (uint j = 0; j < n; ++j) {
        const uint i = dm_channel_index(args, c, j);
        scale_acc += delta[i] * x_norm[i];
    }
    scale_grad[c] = scale_grad[c] + scale_acc;
    for (uint j = 0; j < n; ++j) {
        const uint i = dm_channel_index(args, c, j);
        const float scaled = delta[i] * s;
        mean_acc += scaled;
        var_acc += scaled * (x[i] - m);
    }
    const float ve = variance[c] + args.eps;
    const float root = sqrt(ve);
    mean_delta[c] = mean_acc * (-1.0f / root);
    var_delta[c] = var_acc * (-0.5f / (ve * root));  // -1/2 (var + eps)^(-3/2)
}

// delta = delta*scale/den + var_delta*2(x - mean)/var_den + mean_delta/N, in place: Darknet's
// normalize_delta_cpu has den = sqrt(var) + eps and var_den = N; exact != 0 gives the true
// gradient of the forward, den = sqrt(var + eps) and var_den = N - 1. Run after
// batchnorm_bwd_sums_f32, which read the incoming delta. Grid (spatial, channels, batch).
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
