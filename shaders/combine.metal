// Layers combining inputs: [shortcut], [scale_channels], [sam]. None applies the layer's
// activation; the host follows with activation_fwd (Darknet's order). T: the storage type
// (float, or half for fp16 networks); arithmetic in float.
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
