// Activations: Darknet's elementwise functions, and the normalize_channels family that mixes
// the channels of each pixel.
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
