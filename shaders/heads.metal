// Output heads: [softmax] and the [yolo] activation (Darknet's layer.output at inference).
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

// Per anchor the channels are x, y, w, h, objectness, classes. Unless new_coords the
// logistic goes on every channel but w and h; then x and y become
// v*scale_x_y - 0.5*(scale_x_y - 1). y may alias x. Grid (spatial, anchors*(5+classes),
// batch).
template <typename T>
kernel void yolo_fwd(constant dm_yolo_args& args [[buffer(0)]],
                     device const T* x [[buffer(1)]],
                     device T* y [[buffer(2)]],
                     uint3 gid [[thread_position_in_grid]]) {
    const uint entries = 5u + args.classes;
    const uint channels = args.anchors * entries;
    if (gid.x >= args.spatial || gid.y >= channels || gid.z >= args.batch) return;
    const uint idx = (gid.z * channels + gid.y) * args.spatial + gid.x;
    const uint entry = gid.y % entries;
    float v = x[idx];
    if (args.new_coords == 0u && entry != 2u && entry != 3u) v = 1.0f / (1.0f + exp(-v));
    if (entry < 2u) {
        const float alpha = args.scale_x_y;
        const float beta = -0.5f * (alpha - 1.0f);
        v = v * alpha + beta;
    }
    y[idx] = v;
}

typedef decltype(yolo_fwd<float>) yolo_fwd_f32_t;
typedef decltype(yolo_fwd<half>) yolo_fwd_f16_t;
template [[host_name("yolo_fwd_f32")]] kernel yolo_fwd_f32_t yolo_fwd<float>;
template [[host_name("yolo_fwd_f16")]] kernel yolo_fwd_f16_t yolo_fwd<half>;

typedef decltype(softmax_fwd<float>) softmax_fwd_f32_t;
typedef decltype(softmax_fwd<half>) softmax_fwd_f16_t;
template [[host_name("softmax_fwd_f32")]] kernel softmax_fwd_f32_t softmax_fwd<float>;
template [[host_name("softmax_fwd_f16")]] kernel softmax_fwd_f16_t softmax_fwd<half>;
