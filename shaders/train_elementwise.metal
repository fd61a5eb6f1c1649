// Training kernels that work element by element: activation derivatives, buffer utilities,
// dropout with its counter-based draws, optimizer updates and a finiteness check. Each
// reproduces a CPU reference step (darknet_metal/cpu/): activations.activation_gradient_step,
// fill.{fill,copy,add}_step, dropout.{uniform_fill,dropout_forward_train,dropout_backward}_step,
// update.{sgd_update,adam_update,all_finite}_step. No thread reads what another writes, and
// every per-pixel sum runs in channel order, so results never depend on scheduling.
#include <metal_stdlib>
#include "dm_args.h"
#include "dm_activation.h"
using namespace metal;

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

// ---- buffer utilities ----------------------------------------------------------------------

// x[i] = value. Grid: n.
kernel void fill_buf_f32(constant dm_fill_args& args [[buffer(0)]],
                         device float* x [[buffer(1)]],
                         uint gid [[thread_position_in_grid]]) {
    if (gid >= args.n) return;
    x[gid] = args.value;
}

// dst[i] = src[i] (the buffers must not overlap). Grid: n.
template <typename T>
kernel void copy_buf(constant dm_copy_args& args [[buffer(0)]],
                     device const T* src [[buffer(1)]],
                     device T* dst [[buffer(2)]],
                     uint gid [[thread_position_in_grid]]) {
    if (gid >= args.n) return;
    dst[gid] = src[gid];
}

// dst[i] = dst[i] + scale*src[i]; scale = 1 adds exactly (1*src is src). Grid: n.
kernel void add_buf_f32(constant dm_add_args& args [[buffer(0)]],
                        device const float* src [[buffer(1)]],
                        device float* dst [[buffer(2)]],
                        uint gid [[thread_position_in_grid]]) {
    if (gid >= args.n) return;
    dst[gid] = dst[gid] + args.scale * src[gid];
}

// ---- dropout -------------------------------------------------------------------------------

// splitmix64's increment (2^64 / golden ratio) and output function.
constant ulong DM_GAMMA = 0x9E3779B97F4A7C15UL;

static inline ulong dm_mix64(ulong z) {
    z = (z ^ (z >> 30)) * 0xBF58476D1CE4E5B9UL;
    z = (z ^ (z >> 27)) * 0x94D049BB133111EBUL;
    return z ^ (z >> 31);
}

// rand[i] = draw i of (seed, counter): the reference's float32 draws bit for bit, the top 24
// bits of a hash times 2^-24. The counter (a 64-bit value as two words, low first) is only
// read here: uniform_buf_advance_f32 advances it afterwards, since a thread advancing it
// here would race with threads still reading it. Grid: n.
kernel void uniform_buf_f32(constant dm_uniform_args& args [[buffer(0)]],
                            device const uint* counter [[buffer(1)]],
                            device float* rand [[buffer(2)]],
                            uint gid [[thread_position_in_grid]]) {
    if (gid >= args.n) return;
    const ulong seed = (ulong(args.seed_hi) << 32) | ulong(args.seed_lo);
    const ulong count = (ulong(counter[1]) << 32) | ulong(counter[0]);
    const ulong key = dm_mix64(seed ^ dm_mix64(count + DM_GAMMA));
    const ulong bits = dm_mix64(key + (ulong(gid) + 1UL) * DM_GAMMA);
    rand[gid] = float(uint(bits >> 40)) * 5.9604644775390625e-08f;
}

// counter c += 1 (wrapping at 2^64) for each of `count` counters stored two words apiece.
// Grid: count.
kernel void uniform_buf_advance_f32(constant dm_counter_args& args [[buffer(0)]],
                                    device uint* counter [[buffer(1)]],
                                    uint gid [[thread_position_in_grid]]) {
    if (gid >= args.count) return;
    const uint lo = counter[2 * gid] + 1u;
    counter[2 * gid] = lo;
    if (lo == 0u) counter[2 * gid + 1] = counter[2 * gid + 1] + 1u;
}

// Darknet's dropout on x in place with the kept draws: 0 where rand < probability, else
// x*scale. Forward (training) on the layer's input, backward on its delta. Grid: n.
kernel void dropout_fwd_train_f32(constant dm_dropout_args& args [[buffer(0)]],
                                  device const float* rand [[buffer(1)]],
                                  device float* x [[buffer(2)]],
                                  uint gid [[thread_position_in_grid]]) {
    if (gid >= args.n) return;
    x[gid] = rand[gid] < args.probability ? 0.0f : x[gid] * args.scale;
}

kernel void dropout_bwd_f32(constant dm_dropout_args& args [[buffer(0)]],
                            device const float* rand [[buffer(1)]],
                            device float* delta [[buffer(2)]],
                            uint gid [[thread_position_in_grid]]) {
    if (gid >= args.n) return;
    delta[gid] = rand[gid] < args.probability ? 0.0f : delta[gid] * args.scale;
}

// ---- optimizer updates ---------------------------------------------------------------------

// Darknet's SGD with momentum and decay (update.sgd_update_step); the learning rate is
// lr[0], read at run time. Each axpy is one fma, as the reference's cblas_saxpy (its
// double-then-float evaluation differs from a single rounding only when the double sum is
// exactly halfway between two floats). The coefficients are float expressions as in Darknet.
// Grid: n.
kernel void sgd_upd_f32(constant dm_sgd_args& args [[buffer(0)]],
                        device const float* lr [[buffer(1)]],
                        device float* param [[buffer(2)]],
                        device float* grad_acc [[buffer(3)]],
                        uint gid [[thread_position_in_grid]]) {
    if (gid >= args.n) return;
    const float batch = float(args.batch);
    const float rate = lr[0] * args.lr_scale / batch;
    float g = grad_acc[gid];
    if (args.apply_decay != 0u) g = fma(-args.decay * batch, param[gid], g);
    param[gid] = fma(rate, g, param[gid]);
    grad_acc[gid] = args.momentum * g;
}

// Adam as Darknet's adam_update_gpu (update.adam_update_step): lr[0] and t[0] (the batch
// number, >= 1) read at run time; grad_acc is left 0. Grid: n.
kernel void adam_upd_f32(constant dm_adam_args& args [[buffer(0)]],
                         device const float* lr [[buffer(1)]],
                         device const float* t [[buffer(2)]],
                         device float* param [[buffer(3)]],
                         device float* grad_acc [[buffer(4)]],
                         device float* m [[buffer(5)]],
                         device float* v [[buffer(6)]],
                         uint gid [[thread_position_in_grid]]) {
    if (gid >= args.n) return;
    const float rate = lr[0] * args.lr_scale;
    const float shrink = -args.decay * float(args.batch);
    const float debias1 = 1.0f - pow(args.b1, t[0]);
    const float debias2 = 1.0f - pow(args.b2, t[0]);
    const float w = param[gid];
    const float d = fma(shrink, w, grad_acc[gid]);
    const float mi = fma(1.0f - args.b1, d, args.b1 * m[gid]);
    const float vi = fma(1.0f - args.b2, d * d, args.b2 * v[gid]);
    m[gid] = mi;
    v[gid] = vi;
    param[gid] = w + rate * (mi / debias1) / (sqrt(vi / debias2) + args.eps);
    grad_acc[gid] = 0.0f;
}

// flag[0] = 0 when x holds a NaN or an infinity (all exponent bits set), tested on the bits
// so that fast math cannot fold the test away. The flag is only ever cleared, so one flag
// set to 1 by the host collects the checks of several arrays; every thread that finds a bad
// element stores the same 0, so the result does not depend on which one stores last.
// Grid: n.
kernel void finite_buf_f32(constant dm_finite_args& args [[buffer(0)]],
                           device const float* x [[buffer(1)]],
                           device float* flag [[buffer(2)]],
                           uint gid [[thread_position_in_grid]]) {
    if (gid >= args.n) return;
    if ((as_type<uint>(x[gid]) & 0x7F800000u) == 0x7F800000u) flag[0] = 0.0f;
}

typedef decltype(copy_buf<float>) copy_buf_f32_t;
typedef decltype(copy_buf<half>) copy_buf_f16_t;
template [[host_name("copy_buf_f32")]] kernel copy_buf_f32_t copy_buf<float>;
template [[host_name("copy_buf_f16")]] kernel copy_buf_f16_t copy_buf<half>;
