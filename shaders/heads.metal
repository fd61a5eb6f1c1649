// Output heads [softmax] and [cost]: softmax at inference (Darknet's layer.output), and the
// training forward of the loss heads, which also assigns the delta. [yolo] is yolo.metal.
#include <metal_stdlib>
#include "dm_args.h"
using namespace metal;

// One thread per run of n values: exp(x/T - max/T) / sum, max over the run, summed in order
// as Darknet's softmax. y may alias x. Grid: rows (= batch*groups).
template <typename T>
kernel void softmax_fwd(constant dm_softmax_args& args [[buffer(0)]],
                        device const T* x [[buffer(1)]],
                        device T* y [[buffer(2)]],
                        uint gid [[thread_position_in_grid]]) {
    if (gid >= args.rows) return;
    device const T* src = x + gid * args.n;
    device T* dst = y + gid * args.n;
    const float t = args.temperature;
    float largest = -FLT_MAX;
    for (uint i = 0; i < args.n; ++i) largest = src[i] > largest ? src[i] : largest;
    float total = 0.0f;
    for (uint i = 0; i < args.n; ++i) {
        float e = exp(src[i] / t - largest / t);
        total += e;
        dst[i] = e;
    }
    for (uint i = 0; i < args.n; ++i) dst[i] = dst[i] / total;
}

typedef decltype(softmax_fwd<float>) softmax_fwd_f32_t;
typedef decltype(softmax_fwd<half>) softmax_fwd_f16_t;
template [[host_name("softmax_fwd_f32")]] kernel softmax_fwd_f32_t softmax_fwd<float>;
template [[host_name("softmax_fwd_f16")]] kernel softmax_fwd_f16_t softmax_fwd<half>;

// ---- loss heads ----------------------------------------------------------------------------

// [softmax] given a truth: delta = t - p and loss = -log(p) where t != 0, else 0 (both
// assigned). Grid: n.
kernel void softmax_fwd_xent_f32(constant dm_loss_args& args [[buffer(0)]],
                                 device const float* pred [[buffer(1)]],
                                 device const float* truth [[buffer(2)]],
                                 device float* delta [[buffer(3)]],
                                 device float* loss [[buffer(4)]],
                                 uint gid [[thread_position_in_grid]]) {
    if (gid >= args.n) return;
    const float t = truth[gid], p = pred[gid];
    loss[gid] = t != 0.0f ? -log(p) : 0.0f;
    delta[gid] = t - p;
}

// [cost] type=sse: delta = t - p and loss = (t - p)^2 (both assigned). Grid: n.
kernel void cost_fwd_sse_f32(constant dm_loss_args& args [[buffer(0)]],
                             device const float* pred [[buffer(1)]],
                             device const float* truth [[buffer(2)]],
                             device float* delta [[buffer(3)]],
                             device float* loss [[buffer(4)]],
                             uint gid [[thread_position_in_grid]]) {
    if (gid >= args.n) return;
    const float diff = truth[gid] - pred[gid];
    loss[gid] = diff * diff;
    delta[gid] = diff;
}
