// Layers combining inputs: [shortcut], [scale_channels], [sam]. None applies the layer's
// activation; the host follows with activation_fwd_f32 (Darknet's order).
#include <metal_stdlib>
#include "dm_args.h"
using namespace metal;

// Normalised shortcut weights: table[i * channels + c] for input i (0 = x, then the sources)
// at channel c. normalization 1 (relu): max(w, 0) / (1e-4 + sum max(w_j, 0)); 2 (softmax):
// exp(w - max) / (1e-4 + sum exp(w_j - max)); 0: w. Grid: channels.
kernel void shortcut_weights_fwd_f32(constant dm_shortcut_weights_args& args [[buffer(0)]],
                                     device const float* weights [[buffer(1)]],
                                     device float* table [[buffer(2)]],
                                     uint c [[thread_position_in_grid]]) {
    if (c >= args.channels) return;
    const uint base = args.per_channel != 0u ? c : 0u;
    const uint step = args.per_channel != 0u ? args.channels : 1u;
    float max_val = -FLT_MAX;
    if (args.normalization == 2u) {
        for (uint i = 0; i < args.n_inputs; ++i) max_val = max(max_val, weights[base + i * step]);
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
kernel void shortcut_fwd_f32(constant dm_shortcut_args& args [[buffer(0)]],
                             device const float* x [[buffer(1)]],
                             device const float* source [[buffer(2)]],
                             device const float* table [[buffer(3)]],
                             device float* y [[buffer(4)]],
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
kernel void scale_channels_fwd_f32(constant dm_scale_channels_args& args [[buffer(0)]],
                                   device const float* x_from [[buffer(1)]],
                                   device const float* scale [[buffer(2)]],
                                   device float* y [[buffer(3)]],
                                   uint3 gid [[thread_position_in_grid]]) {
    if (gid.x >= args.spatial || gid.y >= args.channels || gid.z >= args.batch) return;
    const uint idx = (gid.z * args.channels + gid.y) * args.spatial + gid.x;
    const float s = args.scale_wh != 0u ? scale[gid.z * args.spatial + gid.x]
                                        : scale[gid.z * args.channels + gid.y];
    y[idx] = s * x_from[idx];
}

// y = x * x_from elementwise. Grid: n.
kernel void sam_fwd_f32(constant dm_sam_args& args [[buffer(0)]],
                        device const float* x_from [[buffer(1)]],
                        device const float* x [[buffer(2)]],
                        device float* y [[buffer(3)]],
                        uint gid [[thread_position_in_grid]]) {
    if (gid >= args.n) return;
    y[gid] = x[gid] * x_from[gid];
}
