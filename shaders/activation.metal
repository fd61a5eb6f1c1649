// Activations: Darknet's elementwise functions, and the normalize_channels family that mixes
// the channels of each pixel; forward, and backward (delta multiplied in place by the
// derivative, as activations.activation_gradient_step of darknet_metal/cpu/). Every
// per-pixel sum runs in channel order, so results never depend on scheduling.
#include <metal_stdlib>
#include "dm_args.h"
#include "dm_activation.h"
using namespace metal;

// y[i] = f(x[i]); y may be bound to the same buffer as x (each thread reads before it writes
// its own element). Grid: n threads.
template <typename T>
kernel void activation_fwd(constant dm_activation_args& args [[buffer(0)]],
                           device const T* x [[buffer(1)]],
                           device T* y [[buffer(2)]],
                           uint gid [[thread_position_in_grid]]) {
    if (gid >= args.n) return;
    y[gid] = dm_activate(x[gid], args.act);
}

// One thread per pixel (x: pixel, y: image) normalises that pixel across its channels with
// Darknet's epsilon 1e-4 in the denominator. MODE: 0 normalize_channels (positive parts over
// their sum), 1 normalize_channels_softmax, 2 normalize_channels_softmax_maxval (softmax
// shifted by the pixel's maximum). y may alias x. T: the storage type (float or half).
template <int MODE, typename T>
kernel void normalize_channels_fwd(constant dm_normalize_channels_args& args [[buffer(0)]],
                                   device const T* x [[buffer(1)]],
                                   device T* y [[buffer(2)]],
                                   uint2 gid [[thread_position_in_grid]]) {
    if (gid.x >= args.spatial || gid.y >= args.batch) return;
    const uint step = args.spatial;
    const uint base = gid.y * args.channels * args.spatial + gid.x;
    float total = 0.0001f;
    if (MODE == 0) {
        for (uint k = 0; k < args.channels; ++k) {
            float v = x[base + k * step];
            if (v > 0.0f) total += v;
        }
        for (uint k = 0; k < args.channels; ++k) {
            float v = x[base + k * step];
            y[base + k * step] = v > 0.0f ? v / total : 0.0f;
        }
        return;
    }
    float max_val = 0.0f;
    if (MODE == 2) {
        max_val = -FLT_MAX;
        for (uint k = 0; k < args.channels; ++k) {
            float v = x[base + k * step];
            if (v > max_val || k == 0) max_val = v;
        }
    }
    for (uint k = 0; k < args.channels; ++k) total += exp(float(x[base + k * step]) - max_val);
    for (uint k = 0; k < args.channels; ++k) {
        y[base + k * step] = exp(float(x[base + k * step]) - max_val) / total;
    }
}

typedef decltype(normalize_channels_fwd<0, float>) normalize_channels_fwd_t;
template [[host_name("normalize_channels_fwd_f32")]] kernel normalize_channels_fwd_t
    normalize_channels_fwd<0, float>;
template [[host_name("normalize_channels_softmax_fwd_f32")]] kernel normalize_channels_fwd_t
    normalize_channels_fwd<1, float>;
template [[host_name("normalize_channels_softmax_maxval_fwd_f32")]] kernel
    normalize_channels_fwd_t normalize_channels_fwd<2, float>;
typedef decltype(normalize_channels_fwd<0, half>) normalize_channels_fwd_f16_t;
template [[host_name("normalize_channels_fwd_f16")]] kernel normalize_channels_fwd_f16_t
    normalize_channels_fwd<0, half>;
template [[host_name("normalize_channels_softmax_fwd_f16")]] kernel
    normalize_channels_fwd_f16_t normalize_channels_fwd<1, half>;
template [[host_name("normalize_channels_softmax_maxval_fwd_f16")]] kernel
    normalize_channels_fwd_f16_t normalize_channels_fwd<2, half>;

typedef decltype(activation_fwd<float>) activation_fwd_f32_t;
typedef decltype(activation_fwd<half>) activation_fwd_f16_t;
template [[host_name("activation_fwd_f32")]] kernel activation_fwd_f32_t activation_fwd<float>;
template [[host_name("activation_fwd_f16")]] kernel activation_fwd_f16_t activation_fwd<half>;

// ---- activation derivatives --------------------------------------------------------------

// delta[i] *= f'(y_or_x[i]) (the output, or the input for gelu/mish/swish/hard_mish). The
// linear and channel activations leave delta alone, as the reference does. Grid: n.
kernel void activation_bwd_f32(constant dm_activation_args& args [[buffer(0)]],
                               device const float* y_or_x [[buffer(1)]],
                               device float* delta [[buffer(2)]],
                               uint gid [[thread_position_in_grid]]) {
    if (gid >= args.n) return;
    if (args.act == DM_ACT_LINEAR || args.act < 0 || args.act >= DM_ACT_NORM_CHAN) return;
    delta[gid] = delta[gid] * dm_gradient(y_or_x[gid], args.act);
}

// Darknet's derivative of the normalize_channels family, per pixel from the output y:
// g = sum_k y_k * delta_k in channel order, then delta_k *= g (MODE 0, plain
// normalize_channels: only where y_k > 0; 1 and 2, the softmax variants, are the same rule).
// Grid (spatial, batch).
template <int MODE>
kernel void normalize_channels_bwd(constant dm_normalize_channels_args& args [[buffer(0)]],
                                   device const float* y [[buffer(1)]],
                                   device float* delta [[buffer(2)]],
                                   uint2 gid [[thread_position_in_grid]]) {
    if (gid.x >= args.spatial || gid.y >= args.batch) return;
    const uint step = args.spatial;
    const uint base = gid.y * args.channels * args.spatial + gid.x;
    float grad = 0.0f;
    for (uint k = 0; k < args.channels; ++k) {
        grad = grad + y[base + k * step] * delta[base + k * step];
    }
    for (uint k = 0; k < args.channels; ++k) {
        const uint idx = base + k * step;
        if (MODE != 0 || y[idx] > 0.0f) delta[idx] = delta[idx] * grad;
    }
}

typedef decltype(normalize_channels_bwd<0>) normalize_channels_bwd_t;
template [[host_name("normalize_channels_bwd_f32")]] kernel normalize_channels_bwd_t
    normalize_channels_bwd<0>;
template [[host_name("normalize_channels_softmax_bwd_f32")]] kernel normalize_channels_bwd_t
    normalize_channels_bwd<1>;
template [[host_name("normalize_channels_softmax_maxval_bwd_f32")]] kernel
    normalize_channels_bwd_t normalize_channels_bwd<2>;
