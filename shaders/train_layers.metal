// Training kernels of the data-movement and combining layers: [maxpool] with its argmax,
// the backward passes of the pooling, resampling, [route], [shortcut], [scale_channels] and
// [sam] layers, and the loss heads' forward ([softmax] with a truth, [cost] type=sse).
//
// Every backward pass ADDS into the gradients it writes (a layer's input may feed several
// consumers). No float atomics: an element written by several contributions is formed by
// one thread, gathering them in a fixed order, so results never depend on scheduling.
#include <metal_stdlib>
#include "dm_args.h"
using namespace metal;

// ---- max pooling -------------------------------------------------------------------------

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
// the CPU's loop over the outputs adds into it. The index buffer is only compared with the
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
    float total = x_grad[e];
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

// ---- resampling, route ---------------------------------------------------------------------

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

// x_grad[b, src_offset + c] += delta[b, dst_offset + c]: route_fwd_f32's arguments, one
// dispatch per routed layer. Grid (spatial, channels, batch).
kernel void route_bwd_f32(constant dm_route_args& args [[buffer(0)]],
                          device const float* delta [[buffer(1)]],
                          device float* x_grad [[buffer(2)]],
                          uint3 gid [[thread_position_in_grid]]) {
    if (gid.x >= args.spatial || gid.y >= args.channels || gid.z >= args.batch) return;
    const uint src = (gid.z * args.src_channels + args.src_offset + gid.y) * args.spatial + gid.x;
    const uint dst = (gid.z * args.dst_channels + args.dst_offset + gid.y) * args.spatial + gid.x;
    x_grad[src] = x_grad[src] + delta[dst];
}

// ---- shortcut ------------------------------------------------------------------------------

// One input of a shortcut (row 0 = x, then the sources): grad[b, c] += delta[b, c] * table[row,
// c] (weighted) or delta[b, c], for c < min(channels, src_channels). One dispatch per input,
// x first: where one array receives two inputs' gradients, they add in the CPU's order.
// Grid (spatial, channels, batch).
kernel void shortcut_bwd_f32(constant dm_shortcut_bwd_args& args [[buffer(0)]],
                             device const float* delta [[buffer(1)]],
                             device const float* table [[buffer(2)]],
                             device float* grad [[buffer(3)]],
                             uint3 gid [[thread_position_in_grid]]) {
    const uint c = gid.y;
    if (gid.x >= args.spatial || c >= min(args.channels, args.src_channels) ||
        gid.z >= args.batch) {
        return;
    }
    const float d = delta[(gid.z * args.channels + c) * args.spatial + gid.x];
    const uint at = (gid.z * args.src_channels + c) * args.spatial + gid.x;
    if (args.weighted != 0u) {
        grad[at] = grad[at] + d * table[args.row * args.channels + c];
    } else {
        grad[at] = grad[at] + d;
    }
}

// First stage of a weight gradient: partial[b*channels + c] = sum over the pixels, in order,
// of delta[b, c] * input[b, c], for one input and c < min(channels, src_channels).
// Grid (channels, batch).
kernel void shortcut_bwd_dot_f32(constant dm_shortcut_bwd_args& args [[buffer(0)]],
                                 device const float* delta [[buffer(1)]],
                                 device const float* input [[buffer(2)]],
                                 device float* partial [[buffer(3)]],
                                 uint2 gid [[thread_position_in_grid]]) {
    const uint c = gid.x;
    if (c >= min(args.channels, args.src_channels) || gid.y >= args.batch) return;
    device const float* d = delta + (gid.y * args.channels + c) * args.spatial;
    device const float* v = input + (gid.y * args.src_channels + c) * args.spatial;
    float total = 0.0f;
    for (uint i = 0; i < args.spatial; ++i) total = total + d[i] * v[i];
    partial[gid.y * args.channels + c] = total;
}

// Second stage: the gradient of input `row`'s weight(s) from the partial sums, added in
// batch order (then channel order, per_feature) onto acc's old value (accumulate=1) or onto
// zero (accumulate=0). per_channel: acc[row*channels + c] for every c (channels the input
// lacks get no term); else acc[row], written by thread 0. Grid: columns (channels
// per_channel, else 1).
kernel void shortcut_bwd_weights_f32(constant dm_shortcut_wgrad_args& args [[buffer(0)]],
                                     device const float* partial [[buffer(1)]],
                                     device float* acc [[buffer(2)]],
                                     uint gid [[thread_position_in_grid]]) {
    const uint used = min(args.channels, args.src_channels);
    if (args.per_channel != 0u) {
        if (gid >= args.channels) return;
        const uint at = args.row * args.channels + gid;
        float total = args.accumulate != 0u ? acc[at] : 0.0f;
        if (gid < used) {
            for (uint b = 0; b < args.batch; ++b) total = total + partial[b * args.channels + gid];
        }
        acc[at] = total;
        return;
    }
    if (gid != 0u) return;
    float total = args.accumulate != 0u ? acc[args.row] : 0.0f;
    for (uint b = 0; b < args.batch; ++b) {
        for (uint c = 0; c < used; ++c) total = total + partial[b * args.channels + c];
    }
    acc[args.row] = total;
}

// The gradient with respect to the raw weights from that of the normalised ones (g, laid out
// like the weights), through the exact derivative of the normalisation, added into
// weight_grad. With S = 1e-4 + the sum of the terms and dot = sum_k w_k*g_k: relu gives
// [v_j > 0]*(g_j - dot)/S; softmax (terms exp(v - m), m the first maximum) gives
// w_j*(g_j - dot), less 1e-4/S*dot at the maximum; none passes g through. One thread per
// column of weights. Grid: columns (channels per_channel, else 1).
kernel void shortcut_bwd_norm_f32(constant dm_shortcut_weights_args& args [[buffer(0)]],
                                  device const float* weights [[buffer(1)]],
                                  device const float* g [[buffer(2)]],
                                  device float* weight_grad [[buffer(3)]],
                                  uint col [[thread_position_in_grid]]) {
    if (col >= (args.per_channel != 0u ? args.channels : 1u)) return;
    const uint step = args.per_channel != 0u ? args.channels : 1u;
    const uint norm = args.normalization;
    float max_val = -FLT_MAX;
    uint top = 0;
    if (norm == 2u) {
        for (uint i = 0; i < args.n_inputs; ++i) {
            const float v = weights[col + i * step];
            if (max_val < v) {
                max_val = v;
                top = i;
            }
        }
    }
    float total = 0.0001f;
    for (uint i = 0; i < args.n_inputs; ++i) {
        const float v = weights[col + i * step];
        if (norm == 1u) total = total + (v > 0.0f ? v : 0.0f);
        if (norm == 2u) total = total + exp(v - max_val);
    }
    float dot = 0.0f;
    for (uint i = 0; i < args.n_inputs; ++i) {
        const uint at = col + i * step;
        const float v = weights[at];
        float w = v;
        if (norm == 1u) w = (v > 0.0f ? v : 0.0f) / total;
        if (norm == 2u) w = exp(v - max_val) / total;
        dot = dot + w * g[at];
    }
    for (uint j = 0; j < args.n_inputs; ++j) {
        const uint at = col + j * step;
        const float v = weights[at];
        float d = g[at];
        if (norm == 1u) {
            d = v > 0.0f ? (g[at] - dot) / total : 0.0f;
        } else if (norm == 2u) {
            d = exp(v - max_val) / total * (g[at] - dot);
            if (j == top) d = d - 0.0001f / total * dot;
        }
        weight_grad[at] = weight_grad[at] + d;
    }
}

// ---- scale_channels, sam -------------------------------------------------------------------

// x_from_grad += scale * delta, the factor per channel or, scale_wh, per pixel.
// Grid (spatial, channels, batch).
kernel void scale_channels_bwd_f32(constant dm_scale_channels_args& args [[buffer(0)]],
                                   device const float* delta [[buffer(1)]],
                                   device const float* scale [[buffer(2)]],
                                   device float* x_from_grad [[buffer(3)]],
                                   uint3 gid [[thread_position_in_grid]]) {
    if (gid.x >= args.spatial || gid.y >= args.channels || gid.z >= args.batch) return;
    const uint idx = (gid.z * args.channels + gid.y) * args.spatial + gid.x;
    const float s = args.scale_wh != 0u ? scale[gid.z * args.spatial + gid.x]
                                        : scale[gid.z * args.channels + gid.y];
    x_from_grad[idx] = x_from_grad[idx] + s * delta[idx];
}

// scale_grad[k] += sum of delta * x_from over factor k's elements, one thread per factor in
// the CPU's element order (the pixels of channel (b, c); scale_wh: the channels of pixel
// (b, i)). Grid: factors (batch*channels, or batch*spatial with scale_wh).
kernel void scale_channels_bwd_scale_f32(constant dm_scale_channels_args& args [[buffer(0)]],
                                         device const float* delta [[buffer(1)]],
                                         device const float* x_from [[buffer(2)]],
                                         device float* scale_grad [[buffer(3)]],
                                         uint k [[thread_position_in_grid]]) {
    if (args.scale_wh != 0u) {
        if (k >= args.batch * args.spatial) return;
        const uint b = k / args.spatial, i = k % args.spatial;
        float total = scale_grad[k];
        for (uint c = 0; c < args.channels; ++c) {
            const uint at = (b * args.channels + c) * args.spatial + i;
            total = total + delta[at] * x_from[at];
        }
        scale_grad[k] = total;
        return;
    }
    if (k >= args.batch * args.channels) return;
    const uint at = k * args.spatial;
    float total = scale_grad[k];
    for (uint i = 0; i < args.spatial; ++i) total = total + delta[at + i] * x_from[at + i];
    scale_grad[k] = total;
}

// x_grad += delta * x_from, then x_from_grad += x * delta: in that order, so the two may be
// one array (a layer feeding [sam] twice). Grid: n.
kernel void sam_bwd_f32(constant dm_sam_args& args [[buffer(0)]],
                        device const float* delta [[buffer(1)]],
                        device const float* x_from [[buffer(2)]],
                        device const float* x [[buffer(3)]],
                        device float* x_from_grad [[buffer(4)]],
                        device float* x_grad [[buffer(5)]],
                        uint gid [[thread_position_in_grid]]) {
    if (gid >= args.n) return;
    const float d = delta[gid];
    x_grad[gid] = x_grad[gid] + d * x_from[gid];
    x_from_grad[gid] = x_from_grad[gid] + x[gid] * d;
}

// ---- loss heads ----------------------------------------------------------------------------

// [softmax] given a truth: delta = t - p and loss = -log(p) where t != 0, else 0 (both
// assigned). Grid: n.
kernel void softmax_fwd_xent_f32(constant dm_loss_args& args [[buffer(0)]],
                                 device const float* pred [[buffer(1)]],
                                 device const float* truth [[buffer(2)]],
                                 device float* delta [[buffer(3)]],
                                 device float* loss [[buffer(4)]],
                                 uint gid [[thread_position_in_grid]]) {
    if (gid >= args.n) return;
    const float t = truth[gid], p = pred[gid];
    loss[gid] = t != 0.0f ? -log(p) : 0.0f;
    delta[gid] = t - p;
}

// [cost] type=sse: delta = t - p and loss = (t - p)^2 (both assigned). Grid: n.
kernel void cost_fwd_sse_f32(constant dm_loss_args& args [[buffer(0)]],
                             device const float* pred [[buffer(1)]],
                             device const float* truth [[buffer(2)]],
                             device float* delta [[buffer(3)]],
                             device float* loss [[buffer(4)]],
                             uint gid [[thread_position_in_grid]]) {
    if (gid >= args.n) return;
    const float diff = truth[gid] - pred[gid];
    loss[gid] = diff * diff;
    delta[gid] = diff;
}
