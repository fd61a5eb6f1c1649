// Optimizer updates, as update.{sgd_update,adam_update}_step of darknet_metal/cpu/: one
// thread per parameter, reading only its own elements.
#include <metal_stdlib>
#include "dm_args.h"
using namespace metal;

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
