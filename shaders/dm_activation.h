/* Darknet's elementwise activations for the Metal kernels (the activation kernel and the GEMM
 * epilogue). Formulas and float32 order of operations are those of the CPU reference
 * (darknet_metal/cpu/activations.pyx), which follows Darknet:
 * - tanh is 2/(1 + exp(-2x)) - 1, also inside mish; softplus switches at |x| > 20;
 * - gelu uses the hardware tanh (Darknet calls tanhf there) and float constants (the CPU
 *   reference computes parts in double, so the two agree to rounding only);
 * - elu/selu choose their branch (Darknet's 0/1 masks give NaN once exp overflows).
 *
 * Plain functions only, no address-space qualifiers: this header is compiled unchanged by the
 * Metal compiler and, through the emulator, as C++ (where the .metal rewrite does not reach).
 */
#ifndef DM_ACTIVATION_H
#define DM_ACTIVATION_H

#include "dm_args.h"

#if defined(__METAL_VERSION__)
#include <metal_stdlib>
#endif

static inline float dm_logistic(float x) {
    return 1.0f / (1.0f + metal::exp(-x));
}

static inline float dm_tanh_darknet(float x) {
    return 2.0f / (1.0f + metal::exp(-2.0f * x)) - 1.0f;
}

static inline float dm_softplus(float x) {
    if (x > 20.0f) return x;
    if (x < -20.0f) return metal::exp(x);
    return metal::log(metal::exp(x) + 1.0f);
}

static inline float dm_stair(float x) {
    float fl = metal::floor(x);
    float half_fl = metal::floor(x / 2.0f);
    if (metal::floor(fl / 2.0f) * 2.0f == fl) return half_fl;
    return (x - fl) + half_fl;
}

/* f(x) for an elementwise activation id; channel activations and unknown ids return x
 * (they are applied by their own kernels). */
static inline float dm_activate(float x, int act) {
    switch (act) {
        case DM_ACT_LINEAR:
            return x;
        case DM_ACT_LEAKY:
        case DM_ACT_REVLEAKY:
            return x > 0.0f ? x : 0.1f * x;
        case DM_ACT_RELU:
            return x * float(x > 0.0f);
        case DM_ACT_RELU6: {
            float a = x > 0.0f ? x : 0.0f;
            return a < 6.0f ? a : 6.0f;
        }
        case DM_ACT_LOGISTIC:
            return dm_logistic(x);
        case DM_ACT_LOGGY:
            return 2.0f / (1.0f + metal::exp(-x)) - 1.0f;
        case DM_ACT_TANH:
            return dm_tanh_darknet(x);
        case DM_ACT_ELU:
            return x >= 0.0f ? x : metal::exp(x) - 1.0f;
        case DM_ACT_SELU:
            return x >= 0.0f ? 1.0507f * x : 1.0507f * 1.6732f * (metal::exp(x) - 1.0f);
        case DM_ACT_GELU:
            return 0.5f * x * (1.0f + metal::tanh(0.797885f * x + 0.035677f * (x * x * x)));
        case DM_ACT_MISH:
            return x * dm_tanh_darknet(dm_softplus(x));
        case DM_ACT_SWISH:
            return x * dm_logistic(x);
        case DM_ACT_HARD_MISH:
            if (x > 0.0f) return x;
            if (x > -2.0f) return x * x / 2.0f + x;
            return 0.0f;
        case DM_ACT_HARDTAN:
            if (x < -1.0f) return -1.0f;
            if (x > 1.0f) return 1.0f;
            return x;
        case DM_ACT_LHTAN:
            if (x < 0.0f) return 0.001f * x;
            if (x > 1.0f) return 0.001f * (x - 1.0f) + 1.0f;
            return x;
        case DM_ACT_PLSE:
            if (x < -4.0f) return 0.01f * (x + 4.0f);
            if (x > 4.0f) return 0.01f * (x - 4.0f) + 1.0f;
            return 0.125f * x + 0.5f;
        case DM_ACT_STAIR:
            return dm_stair(x);
        case DM_ACT_RAMP:
            return x * float(x > 0.0f) + 0.1f * x;
        case DM_ACT_RELIE:
            return x > 0.0f ? x : 0.01f * x;
        default:
            return x;
    }
}

#endif /* DM_ACTIVATION_H */
