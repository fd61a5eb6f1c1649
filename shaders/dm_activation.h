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

/* ---- derivatives (activation_bwd_f32), as Darknet's gradient_array and the CPU reference's
 * _gradient: the argument is the activation's output, or its input for gelu, mish, swish and
 * hard_mish. The CPU reference evaluates parts of gelu's and mish's derivatives in double;
 * here those parts are computed in float with compensation where a single float rounding
 * would be amplified (gelu's exp argument, mish's 1 - exp(-softplus)). Every exp and tanh
 * argument is bounded first, so saturating inputs stay finite without IEEE infinities. */

/* Largest float whose exp is finite: logistic(x) below -DM_EXP_MAX is 1/(1 + inf) = 0. */
#define DM_EXP_MAX 88.72283f

static inline float dm_logistic_bounded(float x) {
    if (x < -DM_EXP_MAX) return 0.0f;
    return 1.0f / (1.0f + metal::exp(-x));
}

/* tanh saturates to +-1 in float beyond |x| = 9.01: bounding the argument changes nothing. */
static inline float dm_tanh_bounded(float x) {
    return metal::tanh(metal::clamp(x, -10.0f, 10.0f));
}

/* x^3 rounded once (as powf(x, 3)), from x*x kept exactly as a head and a tail. */
static inline float dm_cube(float x) {
    float x2 = x * x;
    float x2_tail = metal::fma(x, x, -x2);
    return metal::fma(x2, x, x2_tail * x);
}

/* c*x + d*y for constants given as float head + tail pairs (c = ch + cl), rounded once up
 * to a rare double rounding: the double-precision sum the CPU reference rounds to float. */
static inline float dm_dot2_exact(float ch, float cl, float x, float dh, float dl, float y) {
    float p = ch * x;
    float p_err = metal::fma(ch, x, -p) + cl * x;
    float q = dh * y;
    float q_err = metal::fma(dh, y, -q) + dl * y;
    float s = p + q;
    float bq = s - p;
    float s_err = (p - (s - bq)) + (q - bq);
    return s + (s_err + (p_err + q_err));
}

/* 1 - exp(-s) for s >= 0 without cancellation for small s: Kahan's expm1 from exp and log. */
static inline float dm_one_minus_exp_neg(float s) {
    if (s > 1.0f) return 1.0f - metal::exp(-s);
    float u = metal::exp(-s);
    if (u == 1.0f) return s;
    return (1.0f - u) * (s / -metal::log(u));
}

static inline float dm_gelu_gradient(float x) {
    const float x3 = dm_cube(x);
    /* a = 0.0356774*x^3 + 0.797885*x, the constants as doubles in the reference. */
    const float a = dm_dot2_exact(0.0356774f, 5.1369664e-10f, x3, 0.797885f, -7.0571904e-10f, x);
    /* 2/(exp(a) + exp(-a)): its square vanishes in float long before exp overflows. */
    const float s = metal::fabs(a) > 88.0f ? 0.0f : 2.0f / (metal::exp(a) + metal::exp(-a));
    /* 0.5*tanh(a) + 0.5 first: exact where the result is small (a < 0), so the cancellation
     * the reference avoids by summing in double does not occur here either. */
    const float half_sum = 0.5f * dm_tanh_bounded(a) + 0.5f;
    return half_sum + (0.0535161f * x3 + 0.398942f * x) * (s * s);
}

static inline float dm_mish_gradient(float x) {
    const float sp = dm_softplus(x);
    const float t = dm_one_minus_exp_neg(sp);
    const float tsp = dm_tanh_bounded(sp);
    return x * ((1.0f - tsp * tsp) * t) + tsp;
}

/* f'(v) for an elementwise activation id (1 for the channel ones and unknown ids). */
static inline float dm_gradient(float v, int act) {
    switch (act) {
        case DM_ACT_LINEAR:
            return 1.0f;
        case DM_ACT_LEAKY:
        case DM_ACT_REVLEAKY:
            return v > 0.0f ? 1.0f : 0.1f;
        case DM_ACT_RELU:
            return float(v > 0.0f);
        case DM_ACT_RELU6:
            return float(v > 0.0f && v < 6.0f);
        case DM_ACT_LOGISTIC:
            return (1.0f - v) * v;
        case DM_ACT_LOGGY: {
            float t = (v + 1.0f) / 2.0f;
            return 2.0f * (1.0f - t) * t;
        }
        case DM_ACT_TANH:
            return 1.0f - v * v;
        case DM_ACT_ELU:
            return float(v >= 0.0f) + float(v < 0.0f) * (v + 1.0f);
        case DM_ACT_SELU:
            return float(v >= 0.0f) * 1.0507f + float(v < 0.0f) * (v + 1.0507f * 1.6732f);
        case DM_ACT_GELU:
            return dm_gelu_gradient(v);
        case DM_ACT_MISH:
            return dm_mish_gradient(v);
        case DM_ACT_SWISH: {
            float s = dm_logistic_bounded(v);
            float sw = v * s;
            return sw + s * (1.0f - sw);
        }
        case DM_ACT_HARD_MISH:
            if (v > 0.0f) return 1.0f;
            if (v > -2.0f) return v + 1.0f;
            return 0.0f;
        case DM_ACT_HARDTAN:
            return (v > -1.0f && v < 1.0f) ? 1.0f : 0.0f;
        case DM_ACT_LHTAN:
            return (v > 0.0f && v < 1.0f) ? 1.0f : 0.001f;
        case DM_ACT_PLSE:
            return (v < 0.0f || v > 1.0f) ? 0.01f : 0.125f;
        case DM_ACT_STAIR:
            return metal::floor(v) == v ? 0.0f : 1.0f;
        case DM_ACT_RAMP:
            return float(v > 0.0f) + 0.1f;
        case DM_ACT_RELIE:
            return v > 0.0f ? 1.0f : 0.01f;
        default:
            return 1.0f;
    }
}

#endif /* DM_ACTIVATION_H */
