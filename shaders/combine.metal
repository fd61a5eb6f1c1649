// Layers combining inputs: [shortcut], [scale_channels], [sam], forward and backward. No
// forward kernel applies the layer's activation; the host follows with activation_fwd
// (Darknet's order). T: the storage type (float, or half for fp16 networks); arithmetic in
// float.
//
// Every backward pass ADDS into the gradients it writes (a layer's input may feed several
// consumers). No float atomics: an element written by several contributions is formed by
// one thread, gathering them in a fixed order, so results never depend on scheduling.
#include <metal_stdlib>
#include "dm_args.h"
using namespace metal;

// Normalised shortcut weights: table[i * channels + c] for input i (0 = x, then the sources)
// at channel c. normalization 1 (relu): max(w, 0) / (1e-4 + sum max(w_j, 0)); 2 (softmax):
// exp(w - max) / (1e-4 + sum exp(w_j - max)); 0: w. Grid: channels.
template <typename T>
kernel void shortcut_weights_fwd(constant dm_shortcut_weights_args& args [[buffer(0)]],
                                 device const T* weights [[buffer(1)]],
                                 device T* table [[buffer(2)]],
                                 uint c [[thread_position_in_grid]]) {
    if (c >= args.channels) return;
    const uint base = args.per_channel != 0u ? c : 0u;
    const uint step = args.per_channel != 0u ? args.channels : 1u;
    float max_val = -FLT_MAX;
    if (args.normalization == 2u) {
        for (uint i = 0; i < args.n_inputs; ++i) {
            max_val = max(max_val, float(weights[base + i * step]));
        }
    }
    float total = 0.0001f;
    for (uint i = 0; i < args.n_inputs; ++i) {
        float v = weights[base + i * step];
        if (args.normalization == 1u) total += v > 0.0f ? v : 0.0f;
        if (args.normalization == 2u) total += exp(v - max_val);
    }
    for (uint i = 0; i < args.n_inputs; ++i) {
        float v = weights[base + i * step];
        float w = v;
        if (args.normalization == 1u) w = (v > 0.0f ? v : 0.0f) / total;
        if (args.normalization == 2u) w = exp(v - max_val) / total;
        table[i * args.channels + c] = w;
    }
}

// One source of a shortcut (see dm_shortcut_args). y may alias x. Sums happen in Darknet's
// order: x term first, then the sources one dispatch at a time. Grid (spatial, channels,
// batch).
template <typename T>
kernel void shortcut_fwd(constant dm_shortcut_args& args [[buffer(0)]],
                         device const T* x [[buffer(1)]],
                         device const T* source [[buffer(2)]],
                         device const T* table [[buffer(3)]],
                         device T* y [[buffer(4)]],
                         uint3 gid [[thread_position_in_grid]]) {
    if (gid.x >= args.spatial || gid.y >= args.channels || gid.z >= args.batch) return;
    const uint c = gid.y;
    const uint idx = (gid.z * args.channels + c) * args.spatial + gid.x;
    float v = x[idx];
    if (args.first != 0u && args.weighted != 0u) v = v * table[c];
    if (c < args.src_channels) {
        float s = source[(gid.z * args.src_channels + c) * args.spatial + gid.x];
        if (args.weighted != 0u) s = s * table[args.source * args.channels + c];
        v = v + s;
    }
    y[idx] = v;
}

// y = scale * x_from, scale per channel (N, C, 1, 1) or, scale_wh, per pixel (N, 1, H, W).
// Grid (spatial, channels, batch).
template <typename T>
kernel void scale_channels_fwd(constant dm_scale_channels_args& args [[buffer(0)]],
                               device const T* x_from [[buffer(1)]],
                               device const T* scale [[buffer(2)]],
                               device T* y [[buffer(3)]],
                               uint3 gid [[thread_position_in_grid]]) {
    if (gid.x >= args.spatial || gid.y >= args.channels || gid.z >= args.batch) return;
    const uint idx = (gid.z * args.channels + gid.y) * args.spatial + gid.x;
    const float s = args.scale_wh != 0u ? scale[gid.z * args.spatial + gid.x]
                                        : scale[gid.z * args.channels + gid.y];
    y[idx] = s * x_from[idx];
}

// y = x * x_from elementwise. Grid: n.
template <typename T>
kernel void sam_fwd(constant dm_sam_args& args [[buffer(0)]],
                    device const T* x_from [[buffer(1)]],
                    device const T* x [[buffer(2)]],
                    device T* y [[buffer(3)]],
                    uint gid [[thread_position_in_grid]]) {
    if (gid >= args.n) return;
    y[gid] = float(x[gid]) * float(x_from[gid]);
}

typedef decltype(shortcut_weights_fwd<float>) shortcut_weights_fwd_f32_t;
typedef decltype(shortcut_weights_fwd<half>) shortcut_weights_fwd_f16_t;
template [[host_name("shortcut_weights_fwd_f32")]] kernel shortcut_weights_fwd_f32_t shortcut_weights_fwd<float>;
template [[host_name("shortcut_weights_fwd_f16")]] kernel shortcut_weights_fwd_f16_t shortcut_weights_fwd<half>;

typedef decltype(shortcut_fwd<float>) shortcut_fwd_f32_t;
typedef decltype(shortcut_fwd<half>) shortcut_fwd_f16_t;
template [[host_name("shortcut_fwd_f32")]] kernel shortcut_fwd_f32_t shortcut_fwd<float>;
template [[host_name("shortcut_fwd_f16")]] kernel shortcut_fwd_f16_t shortcut_fwd<half>;

typedef decltype(scale_channels_fwd<float>) scale_channels_fwd_f32_t;
typedef decltype(scale_channels_fwd<half>) scale_channels_fwd_f16_t;
template [[host_name("scale_channels_fwd_f32")]] kernel scale_channels_fwd_f32_t scale_channels_fwd<float>;
template [[host_name("scale_channels_fwd_f16")]] kernel scale_channels_fwd_f16_t scale_channels_fwd<half>;

typedef decltype(sam_fwd<float>) sam_fwd_f32_t;
typedef decltype(sam_fwd<half>) sam_fwd_f16_t;
template [[host_name("sam_fwd_f32")]] kernel sam_fwd_f32_t sam_fwd<float>;
template [[host_name("sam_fwd_f16")]] kernel sam_fwd_f16_t sam_fwd<half>;

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

// Threads of a threadgroup summing one row of products.
constant uint DM_DOT_THREADS = 64;

// The sum of a[i*step]*b[i*step] for i < n, on a threadgroup of DM_DOT_THREADS: each thread
// adds every DM_DOT_THREADS-th product in order, then the threads' sums are added pairwise,
// halves at a time (a fixed tree, as batchnorm.metal's sums: no float atomics, the same bits
// whatever the scheduling). Every thread must call it; thread 0 gets the sum.
inline float dm_dot(device const float* a, device const float* b, uint n, uint step,
                    threadgroup float* scratch, uint lid) {
    float acc = 0.0f;
    for (uint i = lid; i < n; i += DM_DOT_THREADS) acc += a[i * step] * b[i * step];
    scratch[lid] = acc;
    for (uint half_width = DM_DOT_THREADS / 2; half_width > 0; half_width /= 2) {
        threadgroup_barrier(mem_flags::mem_threadgroup);
        if (lid < half_width) scratch[lid] = scratch[lid] + scratch[lid + half_width];
    }
    return lid == 0 ? scratch[0] : 0.0f;
}

// First stage of a weight gradient: partial[b*channels + c] = the sum over the pixels of
// delta[b, c] * input[b, c], for one input and c < min(channels, src_channels).
// Threadgroups (channels, batch) of DM_DOT_THREADS.
kernel void shortcut_bwd_dot_f32(constant dm_shortcut_bwd_args& args [[buffer(0)]],
                                 device const float* delta [[buffer(1)]],
                                 device const float* input [[buffer(2)]],
                                 device float* partial [[buffer(3)]],
                                 uint2 group [[threadgroup_position_in_grid]],
                                 uint lid [[thread_index_in_threadgroup]]) {
    threadgroup float scratch[DM_DOT_THREADS];
    const uint c = group.x, b = group.y;
    // The same for the whole group, so its threads leave (or reach the barriers) together.
    if (c >= min(args.channels, args.src_channels) || b >= args.batch) return;
    const float total = dm_dot(delta + (b * args.channels + c) * args.spatial,
                               input + (b * args.src_channels + c) * args.spatial,
                               args.spatial, 1, scratch, lid);
    if (lid == 0) partial[b * args.channels + c] = total;
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

// scale_grad[k] += the sum of delta * x_from over factor k's elements: the pixels of channel
// (b, c), or with scale_wh the channels of pixel (b, i). Threadgroups (factors) of
// DM_DOT_THREADS (batch*channels factors, or batch*spatial with scale_wh).
kernel void scale_channels_bwd_scale_f32(constant dm_scale_channels_args& args [[buffer(0)]],
                                         device const float* delta [[buffer(1)]],
                                         device const float* x_from [[buffer(2)]],
                                         device float* scale_grad [[buffer(3)]],
                                         uint k [[threadgroup_position_in_grid]],
                                         uint lid [[thread_index_in_threadgroup]]) {
    threadgroup float scratch[DM_DOT_THREADS];
    const bool per_pixel = args.scale_wh != 0u;
    if (k >= args.batch * (per_pixel ? args.spatial : args.channels)) return;
    // Factor k's first element, its count and the distance between its elements.
    const uint first = per_pixel ? (k / args.spatial) * args.channels * args.spatial
                                       + k % args.spatial
                                 : k * args.spatial;
    const uint n = per_pixel ? args.channels : args.spatial;
    const uint step = per_pixel ? args.spatial : 1u;
    const float total = dm_dot(delta + first, x_from + first, n, step, scratch, lid);
    if (lid == 0) scale_grad[k] = scale_grad[k] + total;
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
