/* Hot float32 loops of the CPU reference, written so the compiler vectorises them.
 *
 * On x86-64 Linux each function is compiled three times (AVX-512, AVX2, baseline SSE2) and
 * the loader picks the widest the CPU supports, so the extension stays portable while the
 * loops get wide vectors. Elsewhere (macOS arm64: NEON is the baseline) they compile once.
 * The build disables floating-point contraction, so every variant performs the same
 * operations in the same order and rounds identically: the choice of variant never changes
 * a result.
 *
 * Layouts are NCHW planes, float32, contiguous.
 */
#ifndef DARKNET_METAL_CPU_KERNELS_H
#define DARKNET_METAL_CPU_KERNELS_H

#include <float.h>
#include <math.h>
#include <stddef.h>
#include <stdlib.h>
#include <string.h>

#if defined(__x86_64__) && defined(__linux__) && defined(__GNUC__)
#define DM_CLONES __attribute__((target_clones("avx512f", "avx2", "default"), unused))
#else
#define DM_CLONES __attribute__((unused))
#endif

/* Helpers of the cloned kernels: always inlined, so each clone compiles them for its own
 * instruction set (a call would reach one baseline copy). */
#define DM_INLINE static inline __attribute__((always_inline))

/* Activation ids: the positions in darknet_metal.model.activations.ACTIVATIONS (activation.pyx
 * refuses to load if they disagree). */
enum {
    DM_ACT_LINEAR = 0, DM_ACT_LEAKY = 1, DM_ACT_RELU = 2, DM_ACT_RELU6 = 3,
    DM_ACT_LOGISTIC = 4, DM_ACT_LOGGY = 5, DM_ACT_TANH = 6, DM_ACT_ELU = 7, DM_ACT_SELU = 8,
    DM_ACT_GELU = 9, DM_ACT_MISH = 10, DM_ACT_SWISH = 11, DM_ACT_HARD_MISH = 12,
    DM_ACT_HARDTAN = 13, DM_ACT_LHTAN = 14, DM_ACT_PLSE = 15, DM_ACT_STAIR = 16,
    DM_ACT_RAMP = 17, DM_ACT_RELIE = 18, DM_ACT_REVLEAKY = 19
};

DM_INLINE float dm_f32_from_bits(unsigned int u)
{
    float f;
    memcpy(&f, &u, sizeof f);
    return f;
}

DM_INLINE unsigned int dm_bits_from_f32(float f)
{
    unsigned int u;
    memcpy(&u, &f, sizeof u);
    return u;
}

/* e^x in float without libm, branch-free so loops calling it vectorise: x = n*ln2 + r with
 * n = round(x/ln2) (by the 1.5*2^23 shift, exact in round-to-nearest) and |r| <= ln2/2
 * (Cody-Waite, ln2 split so n*ln2_hi is exact), e^r by Cephes' degree-7 polynomial, and 2^n
 * applied as two exact power-of-two factors so the result rounds once even when it is
 * subnormal. x is clamped to [-104, 89] first: e^x is +inf above ~88.72 and 0 below ~-103.97
 * as the correctly rounded function gives; NaN stays NaN. Relative error at most 8.2e-8
 * (every 97th float with |x| <= 87.3 against double exp); tests/cpu/test_cpu_fused_activations.py
 * bounds the activations built on it. */
DM_INLINE float dm_expf(float x)
{
    const float xc = x < -104.0f ? -104.0f : (x > 89.0f ? 89.0f : x);
    const float t = xc * 1.44269504088896341f + 12582912.0f;
    const float n = t - 12582912.0f;
    /* n as an integer in [-150, 128] (garbage for NaN, whose result is NaN anyway). */
    const unsigned int k = dm_bits_from_f32(t) - 0x4B400000u;
    float r = xc - n * 0.693359375f;
    r = r - n * -2.12194440e-4f;
    float p = 1.9875691500e-4f;
    p = p * r + 1.3981999507e-3f;
    p = p * r + 8.3334519073e-3f;
    p = p * r + 4.1665795894e-2f;
    p = p * r + 1.6666665459e-1f;
    p = p * r + 5.0000001201e-1f;
    p = p * (r * r) + r + 1.0f;
    /* 2^n = 2^k1 * 2^k2 with k1 = floor(n/2), k2 = n - k1, both in [-75, 64]. */
    const unsigned int k1 = (unsigned int)((int)k >> 1), k2 = k - k1;
    return p * dm_f32_from_bits((k1 + 127u) << 23) * dm_f32_from_bits((k2 + 127u) << 23);
}

/* The float32 activations fused into the convolution epilogues, each Darknet's formula with
 * libm's exp replaced by dm_expf (so they agree with activation.pyx's scalar functions to
 * within the exp's few ulps; the exp-free ones are the same arithmetic, bit for bit):
 * - logistic 1/(1 + e^-x), swish x*logistic(x), loggy 2/(1 + e^-x) - 1, and Darknet's
 *   tanh 2/(1 + e^-2x) - 1: e^-x = +inf for very negative x gives 0 (or -1), never NaN;
 * - mish x*tanh(softplus(x)) as x*n/(n + 2) with n = e^x(e^x + 2) (the same function,
 *   tanh(log(1 + e^x)) written without log or a second exp), and x itself above Darknet's
 *   softplus threshold 20 (where Darknet's float result is x exactly);
 * - elu, selu choosing their branch (Darknet adds both branches times 0/1 masks, and
 *   0 * e^x is NaN once e^x overflows: the same values wherever Darknet's are finite);
 * gelu as x / (1 + e^(-2a)), a = 0.797885x + 0.035677x^3, which equals Darknet's
 *   0.5x(1 + tanh(a)) without the cancellation of 1 + tanh(a) for negative a;
 * stair with Darknet's floors, the parity of floor(x) tested on the float (as the scalar
 *   function does).
 * The channel activations are not here: dm_act_fusable() is 0 for them and the callers
 * apply them separately. */
#define DM_ACT_CASES(LOOP)                                                                  \
    case DM_ACT_LINEAR: LOOP(x); break;                                                     \
    case DM_ACT_LEAKY: case DM_ACT_REVLEAKY: LOOP(x > 0.0f ? x : 0.1f * x); break;          \
    case DM_ACT_RELU: LOOP(x * (float)(x > 0.0f)); break;                                   \
    case DM_ACT_RELU6: LOOP(dm_relu6(x)); break;                                            \
    case DM_ACT_LOGISTIC: LOOP(1.0f / (1.0f + dm_expf(-x))); break;                         \
    case DM_ACT_LOGGY: LOOP(2.0f / (1.0f + dm_expf(-x)) - 1.0f); break;                     \
    case DM_ACT_TANH: LOOP(2.0f / (1.0f + dm_expf(-2.0f * x)) - 1.0f); break;               \
    case DM_ACT_ELU: LOOP(x >= 0.0f ? x : dm_expf(x) - 1.0f); break;                        \
    case DM_ACT_SELU:                                                                       \
        LOOP(x >= 0.0f ? 1.0507f * x : 1.0507f * 1.6732f * (dm_expf(x) - 1.0f)); break;     \
    case DM_ACT_MISH: LOOP(dm_mish(x)); break;                                              \
    case DM_ACT_SWISH: LOOP(x * (1.0f / (1.0f + dm_expf(-x)))); break;                      \
    case DM_ACT_HARD_MISH: LOOP(dm_hard_mish(x)); break;                                    \
    case DM_ACT_HARDTAN: LOOP(x < -1.0f ? -1.0f : (x > 1.0f ? 1.0f : x)); break;            \
    case DM_ACT_LHTAN: LOOP(dm_lhtan(x)); break;                                            \
    case DM_ACT_PLSE: LOOP(dm_plse(x)); break;                                              \
    case DM_ACT_RAMP: LOOP(x * (float)(x > 0.0f) + 0.1f * x); break;                        \
    case DM_ACT_RELIE: LOOP(x > 0.0f ? x : 0.01f * x); break;                              \
    case DM_ACT_GELU: LOOP(dm_gelu(x)); break;                                              \
    case DM_ACT_STAIR: LOOP(dm_stair(x)); break;

DM_INLINE float dm_relu6(float x)
{
    const float a = x > 0.0f ? x : 0.0f;
    return a < 6.0f ? a : 6.0f;
}

DM_INLINE float dm_mish(float x)
{
    const float e = dm_expf(x < 20.0f ? x : 20.0f);
    const float n = e * (e + 2.0f);
    const float y = x * (n / (n + 2.0f));
    return x > 20.0f ? x : y;
}

DM_INLINE float dm_gelu(float x)
{
    const float a = 0.797885f * x + 0.035677f * (x * x * x);
    return x / (1.0f + dm_expf(-2.0f * a));
}

DM_INLINE float dm_stair(float x)
{
    const float fl = floorf(x), half = floorf(x / 2.0f);
    return floorf(fl / 2.0f) * 2.0f == fl ? half : (x - fl) + half;
}

DM_INLINE float dm_hard_mish(float x)
{
    const float q = x * x / 2.0f + x;
    return x > 0.0f ? x : (x > -2.0f ? q : 0.0f);
}

DM_INLINE float dm_lhtan(float x)
{
    const float hi = 0.001f * (x - 1.0f) + 1.0f;
    return x < 0.0f ? 0.001f * x : (x > 1.0f ? hi : x);
}

DM_INLINE float dm_plse(float x)
{
    const float lo = 0.01f * (x + 4.0f), hi = 0.01f * (x - 4.0f) + 1.0f;
    const float mid = 0.125f * x + 0.5f;
    return x < -4.0f ? lo : (x > 4.0f ? hi : mid);
}

/* 1 when the activation has a float32 loop here (every elementwise one). */
static inline int dm_act_fusable(int act)
{
    return act >= DM_ACT_LINEAR && act <= DM_ACT_REVLEAKY;
}

/* p[i] = act(p[i]) for i < n; an activation dm_act_fusable() rejects is left undone.
 * Inlined into the cloned kernels, so it is vectorised with their instruction set. */
DM_INLINE void dm_act_inplace(float *p, ptrdiff_t n, int act)
{
#define DM_LOOP(EXPR)                           \
    for (ptrdiff_t i = 0; i < n; i++) {         \
        const float x = p[i];                   \
        p[i] = (EXPR);                          \
    }
    switch (act) {
        DM_ACT_CASES(DM_LOOP)
    default:
        break;
    }
#undef DM_LOOP
}

/* x[i] = act(x[i]) for i < n (the activation of the convolution epilogues on its own). */
static DM_CLONES void dm_act_f32(float *x, ptrdiff_t n, int act)
{
    dm_act_inplace(x, n, act);
}

/* out[c, i] = act(out[c, i] + bias[c]) for c < channels, i < spatial, act one that
 * dm_act_fusable() accepts (any other is left undone: only the bias is added). */
static DM_CLONES void dm_bias_act_f32(float *out, const float *bias, ptrdiff_t channels,
                                      ptrdiff_t spatial, int act)
{
    const int fused = dm_act_fusable(act);
    for (ptrdiff_t c = 0; c < channels; c++) {
        float *row = out + c * spatial;
        const float b = bias[c];
#define DM_LOOP(EXPR)                           \
    for (ptrdiff_t i = 0; i < spatial; i++) {   \
        const float x = row[i] + b;             \
        row[i] = (EXPR);                        \
    }
        switch (fused ? act : DM_ACT_LINEAR) {
            DM_ACT_CASES(DM_LOOP)
        default:
            break;
        }
#undef DM_LOOP
    }
}

/* 2x2 max pooling with stride 2 over `planes` planes of h x w, every window inside the
 * plane (2*out_h <= h, 2*out_w <= w). The comparisons are Darknet's: a strict ">" in the
 * window order (0,0), (0,1), (1,0), (1,1) starting from -FLT_MAX, so NaN never wins. */
static DM_CLONES void dm_maxpool2x2s2_f32(const float *src, float *dst, ptrdiff_t planes,
                                          ptrdiff_t h, ptrdiff_t w, ptrdiff_t out_h,
                                          ptrdiff_t out_w)
{
    for (ptrdiff_t p = 0; p < planes; p++) {
        for (ptrdiff_t i = 0; i < out_h; i++) {
            const float *r0 = src + (p * h + 2 * i) * w;
            const float *r1 = r0 + w;
            float *o = dst + (p * out_h + i) * out_w;
            for (ptrdiff_t j = 0; j < out_w; j++) {
                float best = -FLT_MAX;
                best = r0[2 * j] > best ? r0[2 * j] : best;
                best = r0[2 * j + 1] > best ? r0[2 * j + 1] : best;
                best = r1[2 * j] > best ? r1[2 * j] : best;
                best = r1[2 * j + 1] > best ? r1[2 * j + 1] : best;
                o[j] = best;
            }
        }
    }
}

/* dst[j] = src[2 * j] for j in [0, n): a row of a stride-2 unfolding (im2col), which the
 * scalar loop of im2col.pyx copied at a fraction of the speed of the product after it. */
static DM_CLONES void dm_copy_even_f32(const float *src, float *dst, ptrdiff_t n)
{
    for (ptrdiff_t j = 0; j < n; j++)
        dst[j] = src[2 * j];
}

/* Sixteen floats as one value (GCC/Clang vector extension); the compiler splits it into
 * the widest registers the variant has. dm_v16u may be unaligned and alias float arrays. */
typedef float dm_v16 __attribute__((vector_size(64)));
typedef float dm_v16u __attribute__((vector_size(64), aligned(4), may_alias));

typedef float dm_v8 __attribute__((vector_size(32)));
typedef float dm_v8u __attribute__((vector_size(32), aligned(4), may_alias));

/* Filters computed together by the direct convolution, and the column multiple its padded
 * rows are laid out to (a multiple of every variant's block). */
#define DM_DIRECT_FB 8
#define DM_DIRECT_XPAD 32

/* Floats of one phase of a padded input row of the direct convolution: whole blocks of
 * output columns plus the taps past the last. */
static inline ptrdiff_t dm_direct_phase_width(ptrdiff_t out_w)
{
    return (out_w + DM_DIRECT_XPAD - 1) / DM_DIRECT_XPAD * DM_DIRECT_XPAD + 2;
}

/* Floats of scratch the direct convolution needs: the padded input, then the weights. */
static inline ptrdiff_t dm_conv3x3_direct_scratch(ptrdiff_t channels, ptrdiff_t filters,
                                                  ptrdiff_t height, ptrdiff_t width,
                                                  ptrdiff_t stride)
{
    const ptrdiff_t out_w = (width - 1) / stride + 1;
    const ptrdiff_t fblocks = (filters + DM_DIRECT_FB - 1) / DM_DIRECT_FB;
    return channels * (height + 2) * stride * dm_direct_phase_width(out_w)
           + fblocks * channels * 9 * DM_DIRECT_FB;
}

/* 3x3, pad 1, stride 1 or 2 convolution of one image computed directly (no im2col), for
 * few input channels where the GEMM's inner dimension would be too thin for BLAS, in parts
 * that can be shared out among threads. Scratch (dm_conv3x3_direct_scratch() floats) holds
 * the input zero-padded, each padded row split into `stride` phases (phase p, column j =
 * padded column stride*j + p) so every tap of a run of output columns is a contiguous
 * read, then the weights regrouped by blocks of DM_DIRECT_FB filters.
 * dm_conv3x3_direct_pad_f32 fills the padded planes of channels [c0, c1);
 * dm_conv3x3_direct_weights_f32 the weights; then dm_conv3x3_direct_rows_f32 computes output
 * rows [y0, y1) of filter blocks [fb0, fb1).
 * x: (channels, height, width); weights: (filters, channels*9) in (c, ky, kx) order;
 * out: (filters, out_h, out_w), out = (in - 1) / stride + 1, = act(sum_{c,ky,kx} w*x +
 * bias), the sum taken in (c, ky, kx) order from 0 (Darknet's GEMM order) and the bias added
 * last, act one dm_act_fusable() accepts (any other is left undone). Each product is rounded
 * and then added (Darknet's arithmetic, which training reproduces) or, with `fused`, fused
 * multiply-adds rounded once (inference: on Intel CPUs a separate multiply and add take both
 * FMA ports for half the work). */
static inline void dm_conv3x3_direct_pad_f32(const float *x, ptrdiff_t height,
                                             ptrdiff_t width, ptrdiff_t stride, ptrdiff_t c0,
                                             ptrdiff_t c1, float *scratch)
{
    const ptrdiff_t pw = dm_direct_phase_width((width - 1) / stride + 1);
    const ptrdiff_t row_len = stride * pw, plane = (height + 2) * row_len;
    for (ptrdiff_t c = c0; c < c1; c++) {
        float *dst = scratch + c * plane;
        memset(dst, 0, (size_t)row_len * sizeof(float));
        memset(dst + (height + 1) * row_len, 0, (size_t)row_len * sizeof(float));
        for (ptrdiff_t y = 0; y < height; y++) {
            const float *src = x + (c * height + y) * width;
            float *row = dst + (y + 1) * row_len;
            memset(row, 0, (size_t)row_len * sizeof(float));
            if (stride == 1) {
                memcpy(row + 1, src, (size_t)width * sizeof(float));
                continue;
            }
            /* Phase 0 holds input columns -1, 1, 3, ...; phase 1 columns 0, 2, 4, ... */
            for (ptrdiff_t j = 1; 2 * j - 1 < width; j++)
                row[j] = src[2 * j - 1];
            for (ptrdiff_t j = 0; 2 * j < width; j++)
                row[pw + j] = src[2 * j];
        }
    }
}

static inline void dm_conv3x3_direct_weights_f32(const float *weights, ptrdiff_t channels,
                                                 ptrdiff_t height, ptrdiff_t width,
                                                 ptrdiff_t stride, ptrdiff_t filters,
                                                 float *scratch)
{
    const ptrdiff_t k = channels * 9;
    const ptrdiff_t pw = dm_direct_phase_width((width - 1) / stride + 1);
    const ptrdiff_t fblocks = (filters + DM_DIRECT_FB - 1) / DM_DIRECT_FB;
    float *wblk = scratch + channels * (height + 2) * stride * pw;
    /* wblk[fb][kk][f]: the FB filters of a block side by side for each tap; filters past
     * the end get zero weights and are never stored. */
    for (ptrdiff_t fb = 0; fb < fblocks; fb++)
        for (ptrdiff_t kk = 0; kk < k; kk++)
            for (ptrdiff_t f = 0; f < DM_DIRECT_FB; f++) {
                ptrdiff_t ff = fb * DM_DIRECT_FB + f;
                wblk[(fb * k + kk) * DM_DIRECT_FB + f] = ff < filters ? weights[ff * k + kk]
                                                                      : 0.0f;
            }
}

/* The row kernel's variants: AVX-512 8 filters x 16 columns in Darknet's arithmetic (8 x 32,
 * 16 accumulators, measured 1.2-1.4x slower: with a separate multiply and add the weight
 * broadcasts no longer fold into the multiplies) and 8 x 32 fused (against 8 x 16: 22% less
 * time for yolov3-tiny's 16-channel 208x208 layer on an AMD EPYC Zen 5, 11% for its first
 * layer; 8 x 48 leaves a third of 208 columns' last block idle: 13% slower than 8 x 32);
 * AVX2 4 filters x 16 columns in two turns; elsewhere 8 x 8 (NEON's 32 registers hold 8 of
 * two vectors). */
/* The direct kernel's two arithmetics: Darknet's (the product rounded, then added) and fused
 * multiply-adds, rounded once (inference only). */
#define DM_DR_MAC_DARKNET(acc, w, s) ((acc) = (acc) + (w) * (s))
#define DM_DR_MAC_FUSED_BASE(acc, w, s)                                                    \
    for (int l_ = 0; l_ < (int)(sizeof(acc) / sizeof(float)); l_++)                       \
        (acc)[l_] = __builtin_fmaf((w)[l_], (s)[l_], (acc)[l_])
#if defined(__x86_64__) && defined(__linux__) && defined(__GNUC__)
#define DM_DR_NAME dm_direct_rows_v4
#define DM_DR_ATTR __attribute__((target("arch=x86-64-v4"), unused))
#define DM_DR_VEC dm_v16
#define DM_DR_VECU dm_v16u
#define DM_DR_XV 1
#define DM_DR_FH 8
#define DM_DR_MAC DM_DR_MAC_DARKNET
#include "direct_rows.h"
#define DM_DR_NAME dm_direct_rows_v3
#define DM_DR_ATTR __attribute__((target("arch=x86-64-v3"), unused))
#define DM_DR_VEC dm_v8
#define DM_DR_VECU dm_v8u
#define DM_DR_XV 2
#define DM_DR_FH 4
#define DM_DR_MAC DM_DR_MAC_DARKNET
#include "direct_rows.h"
/* The fused ones: under fp-contract=fast the same source compiles to fused multiply-adds. */
#define DM_DR_NAME dm_direct_rows_fused_v4
#define DM_DR_ATTR __attribute__((target("arch=x86-64-v4"), optimize("fp-contract=fast"), unused))
#define DM_DR_VEC dm_v16
#define DM_DR_VECU dm_v16u
#define DM_DR_XV 2
#define DM_DR_FH 8
#define DM_DR_MAC DM_DR_MAC_DARKNET
#include "direct_rows.h"
#define DM_DR_NAME dm_direct_rows_fused_v3
#define DM_DR_ATTR __attribute__((target("arch=x86-64-v3"), optimize("fp-contract=fast"), unused))
#define DM_DR_VEC dm_v8
#define DM_DR_VECU dm_v8u
#define DM_DR_XV 2
#define DM_DR_FH 4
#define DM_DR_MAC DM_DR_MAC_DARKNET
#include "direct_rows.h"
#endif
#define DM_DR_NAME dm_direct_rows_base
#define DM_DR_ATTR __attribute__((unused))
#define DM_DR_VEC dm_v8
#define DM_DR_VECU dm_v8u
#define DM_DR_XV 1
#define DM_DR_FH 8
#define DM_DR_MAC DM_DR_MAC_DARKNET
#include "direct_rows.h"
#define DM_DR_NAME dm_direct_rows_fused_base
#define DM_DR_ATTR __attribute__((unused))
#define DM_DR_VEC dm_v8
#define DM_DR_VECU dm_v8u
#define DM_DR_XV 1
#define DM_DR_FH 8
#define DM_DR_MAC DM_DR_MAC_FUSED_BASE
#include "direct_rows.h"

/* The variant of the FMA kernels (the direct convolution's and the packed product's) that
 * runs: the widest this CPU has, 4 (x86-64-v4: AVX-512), 3 (x86-64-v3: AVX2 + FMA) or 0
 * (the portable one), capped by DARKNET_METAL_CPU_KERNELS ("avx2" or "portable"; "avx512"
 * caps nothing) to measure or test a narrower variant on a wider CPU. Every variant computes
 * the same bits. Read once per extension module; a value the Python side does not know
 * (checks.py refuses it before any layer runs) caps nothing. */
static inline int dm_fma_level(void)
{
    static int cached = -1; /* racing first calls store the same value */
    int level = __atomic_load_n(&cached, __ATOMIC_RELAXED);
    if (level >= 0)
        return level;
    level = 0;
#if defined(__x86_64__) && defined(__linux__) && defined(__GNUC__)
    __builtin_cpu_init();
    if (__builtin_cpu_supports("x86-64-v4"))
        level = 4;
    else if (__builtin_cpu_supports("x86-64-v3"))
        level = 3;
#endif
    const char *cap = getenv("DARKNET_METAL_CPU_KERNELS");
    if (cap != NULL && strcmp(cap, "portable") == 0)
        level = 0;
    else if (cap != NULL && strcmp(cap, "avx2") == 0 && level > 3)
        level = 3;
    __atomic_store_n(&cached, level, __ATOMIC_RELAXED);
    return level;
}

static inline void dm_conv3x3_direct_rows_f32(ptrdiff_t channels, ptrdiff_t height,
                                              ptrdiff_t width, ptrdiff_t stride,
                                              const float *bias, ptrdiff_t filters, int act,
                                              const float *scratch, ptrdiff_t fb0,
                                              ptrdiff_t fb1, ptrdiff_t y0, ptrdiff_t y1,
                                              int fused, float *out)
{
#define DM_DR_ARGS channels, height, width, stride, bias, filters, act, scratch, fb0, fb1, y0, y1, out
    switch (dm_fma_level()) {
#if defined(__x86_64__) && defined(__linux__) && defined(__GNUC__)
    case 4:
        if (fused)
            dm_direct_rows_fused_v4(DM_DR_ARGS);
        else
            dm_direct_rows_v4(DM_DR_ARGS);
        return;
    case 3:
        if (fused)
            dm_direct_rows_fused_v3(DM_DR_ARGS);
        else
            dm_direct_rows_v3(DM_DR_ARGS);
        return;
#endif
    default:
        if (fused)
            dm_direct_rows_fused_base(DM_DR_ARGS);
        else
            dm_direct_rows_base(DM_DR_ARGS);
    }
#undef DM_DR_ARGS
}

/* Rows of weights the packed product computes together, and the floats of its right-hand
 * operand one pass over the weights keeps in cache (128 KiB). */
#define DM_GEMM8_M 8
#define DM_GEMM8_PANEL 32768
/* Rows of b copied at a time when it has fewer columns than a block (up to 16 KiB of
 * stack). */
#define DM_GEMM8_KC 128
/* Rows of b a turn of the halves of a variant computing 4 filters at a time takes: 64 rows of
 * its 24 columns (6 KiB) stay in L1 for the second half. */
#define DM_GEMM8_KRUN 64
/* How far ahead of a block (floats) the first pass over b's rows prefetches them. */
#define DM_GEMM8_PREFETCH 64
/* How far ahead (floats) the first block of columns of each chunk prefetches the packed
 * weights: 4 KiB, a few hundred nanoseconds of the block's multiply-adds. A 13x13 Winograd
 * layer's weights (33.5 MB for yolov3-tiny's 512 -> 1024) come from memory on every pass,
 * and without this the product waited for them: 2.7-3.0 against 2.1 ms on an AMD EPYC
 * (Zen 5) with 2 threads; 512 or 2048 floats ahead were 0.1 ms slower. */
#define DM_GEMM8_WFETCH 1024
/* The most columns past b's last whole vector that the packed product computes as its tail
 * (8-lane vectors of 8 filters, DM_GEMM8_TAIL_BLOCKS filter blocks at once) rather than as
 * one more vector of columns. */
#define DM_GEMM8_TAIL_MAX 4
#define DM_GEMM8_TAIL_BLOCKS 8

/* Floats of a (m, k) matrix packed by dm_pack8_f32. */
static inline ptrdiff_t dm_pack8_size(ptrdiff_t m, ptrdiff_t k)
{
    return (m + DM_GEMM8_M - 1) / DM_GEMM8_M * DM_GEMM8_M * k;
}

/* packed[mb][kk][f] = a[mb*8 + f][kk] for the (m, k) row-major a: blocks of 8 rows, each
 * stored column by column (rows past m are zero), the order dm_gemm8_f32 reads. */
static inline void dm_pack8_f32(const float *a, ptrdiff_t m, ptrdiff_t k, float *packed)
{
    for (ptrdiff_t mb = 0; mb < (m + DM_GEMM8_M - 1) / DM_GEMM8_M; mb++)
        for (ptrdiff_t kk = 0; kk < k; kk++)
            for (ptrdiff_t f = 0; f < DM_GEMM8_M; f++) {
                const ptrdiff_t row = mb * DM_GEMM8_M + f;
                packed[(mb * k + kk) * DM_GEMM8_M + f] = row < m ? a[row * k + kk] : 0.0f;
            }
}

/* Whether the packed product copies its right-hand rows into a contiguous panel before the
 * filter blocks read them: on Intel CPUs (an Intel Xeon's AVX-512 products 1.1-1.4x faster
 * with the copy), not on others (an AMD EPYC follows the rows in place as fast; the copy's
 * extra pass made it up to 1.2x slower), and never in the portable variant.
 * DARKNET_METAL_CPU_COPY_ROWS=1 or 0 decides instead, to measure or test either way on any
 * CPU. The result is the same bits either way. Read once per extension module. */
static inline int dm_gemm8_copies(void)
{
    static int cached = -1; /* racing first calls store the same value */
    int copies = __atomic_load_n(&cached, __ATOMIC_RELAXED);
    if (copies >= 0)
        return copies;
    copies = 0;
#if defined(__x86_64__) && defined(__linux__) && defined(__GNUC__)
    __builtin_cpu_init();
    copies = __builtin_cpu_is("intel") ? 1 : 0;
#endif
    const char *set = getenv("DARKNET_METAL_CPU_COPY_ROWS");
    if (set != NULL && (strcmp(set, "0") == 0 || strcmp(set, "1") == 0))
        copies = set[0] == '1';
    __atomic_store_n(&cached, copies, __ATOMIC_RELAXED);
    return copies;
}

/* c[i][x] = act(sum_kk a[i][kk] * b[kk][x] + bias[i]) for the rows i of 8-row blocks
 * [mb0, mb1) and the columns x in [x0, x1), with a (m, k) packed by dm_pack8_f32, b (k, n)
 * and c row-major (rows n and ldc >= n floats apart). Parts running at once may share out
 * the rows and columns (each writes only its own); columns are computed in blocks of
 * dm_gemm8_columns() from x0, so parts that start at its multiples waste none. The sum is a
 * chain of fused multiply-adds in kk order from 0, the bias (none if NULL) added last; act
 * one dm_act_fusable() accepts. b is not packed in advance: its rows are read where they lie
 * (a 1x1 convolution's input planes, a block of im2col columns), or copied a chunk at a time
 * where dm_gemm8_copies() says so. */
#if defined(__x86_64__) && defined(__linux__) && defined(__GNUC__)
#define DM_PG_NAME dm_gemm8_v4
#define DM_PG_ATTR __attribute__((target("arch=x86-64-v4"), optimize("fp-contract=fast"), unused))
#define DM_PG_FMA(acc, a, b) ((acc) = (acc) + (a) * (b))
#define DM_PG_VEC dm_v16
#define DM_PG_VECU dm_v16u
#define DM_PG_XV 2
#define DM_PG_FH 8
#define DM_PG_COPY DM_GEMM8_PANEL
#include "packed_gemm.h"
#define DM_PG_NAME dm_gemm8_v3
#define DM_PG_ATTR __attribute__((target("arch=x86-64-v3"), optimize("fp-contract=fast"), unused))
#define DM_PG_FMA(acc, a, b) ((acc) = (acc) + (a) * (b))
#define DM_PG_VEC dm_v8
#define DM_PG_VECU dm_v8u
#define DM_PG_XV 3
#define DM_PG_FH 4
#define DM_PG_COPY DM_GEMM8_PANEL
#include "packed_gemm.h"
#endif
#define DM_PG_NAME dm_gemm8_base
#define DM_PG_ATTR __attribute__((unused))
#define DM_PG_FMA(acc, a, b)                             \
    for (int l_ = 0; l_ < 8; l_++)                       \
        (acc)[l_] = __builtin_fmaf((a)[l_], (b)[l_], (acc)[l_])
#define DM_PG_VEC dm_v8
#define DM_PG_VECU dm_v8u
#define DM_PG_XV 1
#define DM_PG_FH 8
#define DM_PG_COPY 1
#include "packed_gemm.h"

/* Columns of a block of the variant of dm_gemm8_f32 that runs. */
static inline ptrdiff_t dm_gemm8_columns(void)
{
    switch (dm_fma_level()) {
#if defined(__x86_64__) && defined(__linux__) && defined(__GNUC__)
    case 4:
        return dm_gemm8_v4_columns;
    case 3:
        return dm_gemm8_v3_columns;
#endif
    default:
        return dm_gemm8_base_columns;
    }
}

static inline void dm_gemm8_f32(ptrdiff_t m, ptrdiff_t k, const float *packed, const float *b,
                                ptrdiff_t n, const float *bias, int act, ptrdiff_t mb0,
                                ptrdiff_t mb1, ptrdiff_t x0, ptrdiff_t x1, float *c,
                                ptrdiff_t ldc)
{
    switch (dm_fma_level()) {
#if defined(__x86_64__) && defined(__linux__) && defined(__GNUC__)
    case 4:
        dm_gemm8_v4(m, k, packed, b, n, bias, act, mb0, mb1, x0, x1, c, ldc);
        return;
    case 3:
        dm_gemm8_v3(m, k, packed, b, n, bias, act, mb0, mb1, x0, x1, c, ldc);
        return;
#endif
    default:
        dm_gemm8_base(m, k, packed, b, n, bias, act, mb0, mb1, x0, x1, c, ldc);
    }
}

/* Tiles transformed together by the Winograd kernels (their stack buffers' length). */
#define DM_WINO_CHUNK 64
/* The F(4x4) transforms' loops run over whole 16-lane vectors of a chunk. */
_Static_assert(DM_WINO_CHUNK % 16 == 0, "DM_WINO_CHUNK: whole 16-float vectors");

/* The Winograd kernels take an image's tiles by runs: `rows` whole tile rows from ty0 when a
 * row has at most DM_WINO_CHUNK / 2 tiles (as many rows as DM_WINO_CHUNK tiles hold), else
 * pieces of DM_WINO_CHUNK tiles of one row from (ty0, tx0). A run's tiles are consecutive
 * in the transformed planes (tile ty*tiles_x + tx), so every step over them is one loop of
 * rows*n tiles (n: a row's tiles in the run): 52 at 52x52 with F(4x4), where a row's 13
 * tiles left the vector loops mostly to their scalar remainders. Only reading and writing
 * the image goes row by row. */
static inline ptrdiff_t dm_wino_rows(ptrdiff_t tiles_y, ptrdiff_t tiles_x, ptrdiff_t ty0)
{
    /* An empty image (tiles_x 0) takes one empty run a row. */
    const ptrdiff_t rows =
        tiles_x > 0 && 2 * tiles_x <= DM_WINO_CHUNK ? DM_WINO_CHUNK / tiles_x : 1;
    return rows < tiles_y - ty0 ? rows : tiles_y - ty0;
}

static inline ptrdiff_t dm_wino_run(ptrdiff_t tiles_x, ptrdiff_t tx0)
{
    return tiles_x - tx0 < DM_WINO_CHUNK ? tiles_x - tx0 : DM_WINO_CHUNK;
}

/* The runs of an image's tiles: the statement after it runs with ty0, rows, tx0 and n. */
#define DM_WINO_FOR_RUNS(tiles_y, tiles_x)                                                 \
    for (ptrdiff_t ty0 = 0, rows = dm_wino_rows((tiles_y), (tiles_x), 0); ty0 < (tiles_y);  \
         ty0 += rows, rows = dm_wino_rows((tiles_y), (tiles_x), ty0))                      \
        for (ptrdiff_t tx0 = 0, n = dm_wino_run((tiles_x), 0); tx0 < (tiles_x);             \
             tx0 += n, n = dm_wino_run((tiles_x), tx0))

/* B^T of F(2x2, 3x3) on the tile's four rows (or columns) a..d: t0..t3. */
#define DM_WINO2_BT(t0, t1, t2, t3, a, b, c, d)                                            \
    do {                                                                                   \
        (t0) = (a) - (c);                                                                  \
        (t1) = (b) + (c);                                                                  \
        (t2) = (c) - (b);                                                                  \
        (t3) = (b) - (d);                                                                  \
    } while (0)

/* Winograd F(2x2, 3x3) input transform, V = B^T d B for the 4x4 tile d of channels
 * [c0, c1) at (2*ty - 1, 2*tx - 1) (zero outside the image): v[(i*4 + j)*plane + c*tiles +
 * ty*tiles_x + tx] with tiles = tiles_y*tiles_x and plane = channels*tiles. Columns of the
 * tile are combined first, then rows, as the scalar reference does. A run of tiles
 * (DM_WINO_FOR_RUNS) is handled at once: the even and odd input columns are split apart so
 * every step is a contiguous loop; a tile's last two columns are the next tile's first two
 * (slot m + 1), except for the last tile of a row, whose are kept aside (ex, ox). */
static DM_CLONES void dm_wino2_input_f32(const float *x, ptrdiff_t channels, ptrdiff_t c0,
                                         ptrdiff_t c1, ptrdiff_t height, ptrdiff_t width,
                                         ptrdiff_t tiles_y, ptrdiff_t tiles_x, float *v)
{
    const ptrdiff_t tiles = tiles_y * tiles_x, plane = channels * tiles;
    float ev[4][DM_WINO_CHUNK + 1], od[4][DM_WINO_CHUNK + 1];
    float te[4][DM_WINO_CHUNK + 1], to[4][DM_WINO_CHUNK + 1];
    float ex[DM_WINO_CHUNK][4], ox[DM_WINO_CHUNK][4];
    for (ptrdiff_t c = c0; c < c1; c++) {
        const float *xc = x + c * height * width;
        DM_WINO_FOR_RUNS(tiles_y, tiles_x) {
            /* ev[i][r*n + m] = x[y][2(tx0+m) - 1], od[...] = x[y][2(tx0+m)], y = 2(ty0+r)-1+i;
             * slot r*n + n (the next row's first) saved to ex[r], ox[r] first. */
            for (ptrdiff_t r = 0; r < rows; r++) {
                for (int i = 0; i < 4; i++) {
                    const ptrdiff_t y = 2 * (ty0 + r) - 1 + i;
                    float *e = ev[i] + r * n, *o = od[i] + r * n;
                    if (y < 0 || y >= height) {
                        for (ptrdiff_t m = 0; m <= n; m++)
                            e[m] = o[m] = 0.0f;
                    } else {
                        const float *row = xc + y * width;
                        for (ptrdiff_t m = 0; m <= n; m++) {
                            const ptrdiff_t xe = 2 * (tx0 + m) - 1, xo = xe + 1;
                            e[m] = xe >= 0 && xe < width ? row[xe] : 0.0f;
                            o[m] = xo < width ? row[xo] : 0.0f;
                        }
                    }
                    ex[r][i] = e[n];
                    ox[r][i] = o[n];
                }
            }
            const ptrdiff_t count = rows * n;
            for (ptrdiff_t m = 0; m <= count; m++) {
                DM_WINO2_BT(te[0][m], te[1][m], te[2][m], te[3][m], ev[0][m], ev[1][m],
                            ev[2][m], ev[3][m]);
                DM_WINO2_BT(to[0][m], to[1][m], to[2][m], to[3][m], od[0][m], od[1][m],
                            od[2][m], od[3][m]);
            }
            float *dst = v + c * tiles + ty0 * tiles_x + tx0;
            for (int i = 0; i < 4; i++) {
                float *d0 = dst + (i * 4 + 0) * plane, *d1 = dst + (i * 4 + 1) * plane;
                float *d2 = dst + (i * 4 + 2) * plane, *d3 = dst + (i * 4 + 3) * plane;
                for (ptrdiff_t m = 0; m < count; m++)
                    DM_WINO2_BT(d0[m], d1[m], d2[m], d3[m], te[i][m], to[i][m], te[i][m + 1],
                                to[i][m + 1]);
            }
            /* The last tile of each row but the run's last: its next columns from ex, ox. */
            for (ptrdiff_t r = 0; r + 1 < rows; r++) {
                const ptrdiff_t m = r * n + n - 1;
                float tex[4], tox[4];
                DM_WINO2_BT(tex[0], tex[1], tex[2], tex[3], ex[r][0], ex[r][1], ex[r][2],
                            ex[r][3]);
                DM_WINO2_BT(tox[0], tox[1], tox[2], tox[3], ox[r][0], ox[r][1], ox[r][2],
                            ox[r][3]);
                for (int i = 0; i < 4; i++)
                    DM_WINO2_BT(dst[(i * 4 + 0) * plane + m], dst[(i * 4 + 1) * plane + m],
                                dst[(i * 4 + 2) * plane + m], dst[(i * 4 + 3) * plane + m],
                                te[i][m], to[i][m], tex[i], tox[i]);
            }
        }
    }
}

/* Winograd F(2x2, 3x3) output transform with the bias and the activation fused (act one
 * dm_act_fusable() accepts; any other is left undone): out[f] = act(A^T M A + bias[f]) for
 * filters [f0, f1) and every 2x2 output tile, where
 * M[i][j] = mm[(i*4 + j)*plane + f*tiles + tile] and plane = filters*tiles. Rows of M are
 * combined first, then columns, then the bias is added, as the scalar reference does. */
static DM_CLONES void dm_wino2_output_f32(const float *mm, const float *bias, ptrdiff_t filters,
                                          ptrdiff_t f0, ptrdiff_t f1, ptrdiff_t height,
                                          ptrdiff_t width, ptrdiff_t tiles_y,
                                          ptrdiff_t tiles_x, int act, float *out)
{
    const ptrdiff_t tiles = tiles_y * tiles_x, plane = filters * tiles;
    float r[2][2][DM_WINO_CHUNK];
    for (ptrdiff_t f = f0; f < f1; f++) {
        const float b = bias[f];
        float *of = out + f * height * width;
        DM_WINO_FOR_RUNS(tiles_y, tiles_x) {
            const ptrdiff_t count = rows * n;
            const float *p = mm + f * tiles + ty0 * tiles_x + tx0;
#define DM_P(i, j) p[((i) * 4 + (j)) * plane + m]
            for (ptrdiff_t m = 0; m < count; m++) {
                float s0[4], s1[4];
                for (int j = 0; j < 4; j++) {
                    s0[j] = DM_P(0, j) + DM_P(1, j) + DM_P(2, j);
                    s1[j] = DM_P(1, j) - DM_P(2, j) - DM_P(3, j);
                }
                const float v00 = s0[0] + s0[1] + s0[2] + b, v01 = s0[1] - s0[2] - s0[3] + b;
                const float v10 = s1[0] + s1[1] + s1[2] + b, v11 = s1[1] - s1[2] - s1[3] + b;
                r[0][0][m] = v00;
                r[0][1][m] = v01;
                r[1][0][m] = v10;
                r[1][1][m] = v11;
            }
#undef DM_P
            if (act != DM_ACT_LINEAR)
                for (int i = 0; i < 2; i++)
                    for (int j = 0; j < 2; j++)
                        dm_act_inplace(r[i][j], count, act);
            /* Tiles whose both columns are inside, then a possible half tile. */
            const ptrdiff_t full = (width - 2 * tx0) / 2 < n ? (width - 2 * tx0) / 2 : n;
            for (ptrdiff_t t = 0; t < rows; t++)
                for (int i = 0; i < 2; i++) {
                    const ptrdiff_t y = 2 * (ty0 + t) + i;
                    if (y >= height)
                        break;
                    float *row = of + y * width + 2 * tx0;
                    const float *q0 = r[i][0] + t * n, *q1 = r[i][1] + t * n;
                    for (ptrdiff_t m = 0; m < full; m++) {
                        row[2 * m] = q0[m];
                        row[2 * m + 1] = q1[m];
                    }
                    if (full < n)
                        row[2 * full] = q0[full];
                }
        }
    }
}

/* B^T of F(4x4, 3x3) (points 0, +-1, +-2 and infinity) on the tile's six rows (or columns)
 * d0..d5, into o[0], o[s], ..., o[5s]. */
#define DM_WINO4_BT(o, s, d0, d1, d2, d3, d4, d5)                                          \
    do {                                                                                   \
        (o)[0 * (s)] = 4.0f * (d0) - 5.0f * (d2) + (d4);                                   \
        (o)[1 * (s)] = -4.0f * (d1) - 4.0f * (d2) + (d3) + (d4);                           \
        (o)[2 * (s)] = 4.0f * (d1) - 4.0f * (d2) - (d3) + (d4);                            \
        (o)[3 * (s)] = -2.0f * (d1) - (d2) + 2.0f * (d3) + (d4);                           \
        (o)[4 * (s)] = 2.0f * (d1) - (d2) - 2.0f * (d3) + (d4);                            \
        (o)[5 * (s)] = 4.0f * (d1) - 5.0f * (d3) + (d5);                                   \
    } while (0)

/* Winograd F(4x4, 3x3). Input transform V = B^T d B for the 6x6 tile d of channels
 * [c0, c1) at (4*ty - 1, 4*tx - 1), zero outside the image:
 * v[(i*6 + j)*plane + c*tiles + ty*tiles_x + tx], tiles = tiles_y*tiles_x, plane =
 * channels*tiles. Rows of the tile are combined first (per column), then columns, in the
 * order of DM_WINO4_BT, as the scalar reference (winograd.pyx) does. By runs of tiles
 * (DM_WINO_FOR_RUNS); a tile's last two columns are the next tile's first two (slot m + 1),
 * except for the last tile of a row, whose are kept aside (phx). */
static DM_CLONES void dm_wino4_input_f32(const float *x, ptrdiff_t channels, ptrdiff_t c0,
                                         ptrdiff_t c1, ptrdiff_t height, ptrdiff_t width,
                                         ptrdiff_t tiles_y, ptrdiff_t tiles_x, float *v)
{
    const ptrdiff_t tiles = tiles_y * tiles_x, plane = channels * tiles;
    /* ph[i][q][r*n + m] = x[4(ty0+r) - 1 + i][4(tx0 + m) - 1 + q]: the run's input rows split
     * by column phase, so that column j of tile m is ph[i][j % 4][m + j / 4] and every step
     * below is a contiguous loop over tiles. t: the rows combined. */
    /* ph zeroed once: the lanes computed past a run's tiles read only finite values. */
    float ph[6][4][DM_WINO_CHUNK + 1] = {{{0}}}, t[6][6][DM_WINO_CHUNK];
    float phx[DM_WINO_CHUNK][6][2];
    for (ptrdiff_t c = c0; c < c1; c++) {
        const float *xc = x + c * height * width;
        DM_WINO_FOR_RUNS(tiles_y, tiles_x) {
            /* Tiles m in [lo, hi) read columns 4(tx0+m)-1 .. 4(tx0+m)+2 inside the row. */
            const ptrdiff_t lo = tx0 == 0 ? 1 : 0;
            ptrdiff_t hi = (width - 3) / 4 - tx0 + 1;
            hi = hi < lo ? lo : hi > n + 1 ? n + 1 : hi;
            for (ptrdiff_t r = 0; r < rows; r++) {
                for (int i = 0; i < 6; i++) {
                    const ptrdiff_t y = 4 * (ty0 + r) - 1 + i;
                    float *p0 = ph[i][0] + r * n, *p1 = ph[i][1] + r * n;
                    float *p2 = ph[i][2] + r * n, *p3 = ph[i][3] + r * n;
                    if (y < 0 || y >= height) {
                        for (ptrdiff_t m = 0; m <= n; m++)
                            p0[m] = p1[m] = p2[m] = p3[m] = 0.0f;
                    } else {
                        const float *row = xc + y * width + 4 * tx0 - 1;
                        for (ptrdiff_t m = lo; m < hi; m++) {
                            p0[m] = row[4 * m];
                            p1[m] = row[4 * m + 1];
                            p2[m] = row[4 * m + 2];
                            p3[m] = row[4 * m + 3];
                        }
                        /* The tiles outside [lo, hi), at the row's ends (a loop over
                         * every tile skipping the inside ones cost a quarter of the
                         * transform). */
                        for (int side = 0; side < 2; side++)
                            for (ptrdiff_t m = side ? hi : 0; m < (side ? n + 1 : lo); m++) {
                                float *pq[4] = {p0, p1, p2, p3};
                                for (int q = 0; q < 4; q++) {
                                    const ptrdiff_t xx = 4 * (tx0 + m) - 1 + q;
                                    pq[q][m] = xx >= 0 && xx < width ? xc[y * width + xx]
                                                                     : 0.0f;
                                }
                            }
                    }
                    phx[r][i][0] = p0[n];
                    phx[r][i][1] = p1[n];
                }
            }
            const ptrdiff_t count = rows * n;
            /* The combining loops run to a whole number of 16-lane vectors: the lanes past
             * count compute from stale (finite) slots and are never stored out, and no
             * scalar remainder is left (a remainder for each of the 72 loops of a run was a
             * sixth of the transform). */
            const ptrdiff_t lanes = (count + 15) & ~(ptrdiff_t)15;
            for (int j = 0; j < 6; j++) {
                const int q = j % 4, o = j / 4;
                const float *d0 = ph[0][q] + o, *d1 = ph[1][q] + o, *d2 = ph[2][q] + o;
                const float *d3 = ph[3][q] + o, *d4 = ph[4][q] + o, *d5 = ph[5][q] + o;
                for (ptrdiff_t m = 0; m < lanes; m++)
                    DM_WINO4_BT(&t[0][j][m], 6 * DM_WINO_CHUNK, d0[m], d1[m], d2[m], d3[m],
                                d4[m], d5[m]);
            }
            /* The last tile of each row but the run's last: columns 4 and 5 from phx. */
            for (ptrdiff_t r = 0; r + 1 < rows; r++) {
                const ptrdiff_t m = r * n + n - 1;
                for (int j = 4; j < 6; j++) {
                    const float (*e)[2] = phx[r];
                    DM_WINO4_BT(&t[0][j][m], 6 * DM_WINO_CHUNK, e[0][j - 4], e[1][j - 4],
                                e[2][j - 4], e[3][j - 4], e[4][j - 4], e[5][j - 4]);
                }
            }
            /* Into a local block first, then out by rows: stored straight to the six rows
             * plane floats apart, the loop stays scalar (the compiler cannot rule out that
             * the rows overlap) and took as long as the layer's products. */
            float *dst = v + c * tiles + ty0 * tiles_x + tx0;
            for (int i = 0; i < 6; i++) {
                const float *r0 = t[i][0], *r1 = t[i][1], *r2 = t[i][2];
                const float *r3 = t[i][3], *r4 = t[i][4], *r5 = t[i][5];
                float u[6][DM_WINO_CHUNK];
                for (ptrdiff_t m = 0; m < lanes; m++)
                    DM_WINO4_BT(&u[0][m], DM_WINO_CHUNK, r0[m], r1[m], r2[m], r3[m], r4[m],
                                r5[m]);
                for (int j = 0; j < 6; j++)
                    memcpy(dst + (i * 6 + j) * plane, u[j], (size_t)count * sizeof(float));
            }
        }
    }
}

/* A^T for F(4x4, 3x3): four outputs from six products. */
#define DM_WINO4_AT(o, p, s)                                                               \
    do {                                                                                   \
        (o)[0 * (s)] = (p)[0] + (p)[1] + (p)[2] + (p)[3] + (p)[4];                         \
        (o)[1 * (s)] = (p)[1] - (p)[2] + 2.0f * (p)[3] - 2.0f * (p)[4];                    \
        (o)[2 * (s)] = (p)[1] + (p)[2] + 4.0f * (p)[3] + 4.0f * (p)[4];                    \
        (o)[3 * (s)] = (p)[1] - (p)[2] + 8.0f * (p)[3] - 8.0f * (p)[4] + (p)[5];           \
    } while (0)

/* Winograd F(4x4, 3x3) output transform with the bias and the activation fused (act one
 * dm_act_fusable() accepts): out[f] = act(A^T M A + bias[f]) for filters [f0, f1), where
 * M[i][j] = mm[(i*6 + j)*plane + f*tiles + tile]. Rows of M first (per column), then
 * columns, then the bias, as the scalar reference does. */
static DM_CLONES void dm_wino4_output_f32(const float *mm, const float *bias, ptrdiff_t filters,
                                          ptrdiff_t f0, ptrdiff_t f1, ptrdiff_t height,
                                          ptrdiff_t width, ptrdiff_t tiles_y,
                                          ptrdiff_t tiles_x, int act, float *out)
{
    const ptrdiff_t tiles = tiles_y * tiles_x, plane = filters * tiles;
    /* s zeroed once, as ph in the input transform. */
    float s[4][6][DM_WINO_CHUNK] = {{{0}}}, r[4][4][DM_WINO_CHUNK];
    for (ptrdiff_t f = f0; f < f1; f++) {
        const float b = bias[f];
        float *of = out + f * height * width;
        DM_WINO_FOR_RUNS(tiles_y, tiles_x) {
            const ptrdiff_t count = rows * n;
            const float *p = mm + f * tiles + ty0 * tiles_x + tx0;
            for (int j = 0; j < 6; j++) {
                for (ptrdiff_t m = 0; m < count; m++) {
                    const float col[6] = {p[(0 * 6 + j) * plane + m],
                                          p[(1 * 6 + j) * plane + m],
                                          p[(2 * 6 + j) * plane + m],
                                          p[(3 * 6 + j) * plane + m],
                                          p[(4 * 6 + j) * plane + m],
                                          p[(5 * 6 + j) * plane + m]};
                    DM_WINO4_AT(&s[0][j][m], col, 6 * DM_WINO_CHUNK);
                }
            }
            /* From here on in whole 16-lane vectors, as in the input transform (the lanes
             * past count hold stale finite values and are never stored). */
            const ptrdiff_t lanes = (count + 15) & ~(ptrdiff_t)15;
            for (int i = 0; i < 4; i++) {
                for (ptrdiff_t m = 0; m < lanes; m++) {
                    const float rw[6] = {s[i][0][m], s[i][1][m], s[i][2][m],
                                         s[i][3][m], s[i][4][m], s[i][5][m]};
                    DM_WINO4_AT(&r[i][0][m], rw, DM_WINO_CHUNK);
                }
                for (int j = 0; j < 4; j++) {
                    for (ptrdiff_t m = 0; m < lanes; m++)
                        r[i][j][m] = r[i][j][m] + b;
                    if (act != DM_ACT_LINEAR)
                        dm_act_inplace(r[i][j], lanes, act);
                }
            }
            const ptrdiff_t avail = width - 4 * tx0;
            /* Tiles whose four columns are inside, then a possible partial tile. */
            const ptrdiff_t full = avail / 4 < n ? avail / 4 : n;
            for (ptrdiff_t t = 0; t < rows; t++)
                for (int i = 0; i < 4; i++) {
                    const ptrdiff_t y = 4 * (ty0 + t) + i;
                    if (y >= height)
                        break;
                    float *row = of + y * width + 4 * tx0;
                    const ptrdiff_t k = t * n;
                    for (ptrdiff_t m = 0; m < full; m++)
                        for (int j = 0; j < 4; j++)
                            row[4 * m + j] = r[i][j][k + m];
                    for (int j = 0; full < n && 4 * full + j < avail; j++)
                        row[4 * full + j] = r[i][j][k + full];
                }
        }
    }
}

#endif
