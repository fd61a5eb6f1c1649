/* Argument structs of the Metal kernels: one per op. The shaders include it (compiled as MSL,
 * and as C++ in the emulator); the host reads it (darknet_metal/metal/registry.py packs the
 * structs from this text), so neither side declares the fields a second time.
 *
 * Every kernel takes `constant dm_<op>_args& args [[buffer(0)]]`. Members are only int32_t,
 * uint32_t and float (4 bytes each, so no padding anywhere), and every struct is followed by a
 * size assertion that the C, C++ and Metal compilers all check: host and shader cannot drift.
 * Sizes, counts and offsets are in elements (float32), never bytes. Tests compare the layout
 * the registry reads with what C and C++ compilers see. Keep one member per line.
 */
#ifndef DM_ARGS_H
#define DM_ARGS_H

#if defined(__METAL_VERSION__)
/* MSL names int32_t and uint32_t itself (they are int and uint); only the assertion differs. */
#include <metal_stdlib>
#define DM_STATIC_ASSERT(cond, msg) static_assert(cond, msg)
#else
#include <stdint.h>
#if defined(__cplusplus)
#define DM_STATIC_ASSERT(cond, msg) static_assert(cond, msg)
#else
#define DM_STATIC_ASSERT(cond, msg) _Static_assert(cond, msg)
#endif
#endif

/* Activation ids: the index of each name in darknet_metal.model.activations.ACTIVATIONS. */
enum dm_activation_id {
    DM_ACT_LINEAR = 0,
    DM_ACT_LEAKY = 1,
    DM_ACT_RELU = 2,
    DM_ACT_RELU6 = 3,
    DM_ACT_LOGISTIC = 4,
    DM_ACT_LOGGY = 5,
    DM_ACT_TANH = 6,
    DM_ACT_ELU = 7,
    DM_ACT_SELU = 8,
    DM_ACT_GELU = 9,
    DM_ACT_MISH = 10,
    DM_ACT_SWISH = 11,
    DM_ACT_HARD_MISH = 12,
    DM_ACT_HARDTAN = 13,
    DM_ACT_LHTAN = 14,
    DM_ACT_PLSE = 15,
    DM_ACT_STAIR = 16,
    DM_ACT_RAMP = 17,
    DM_ACT_RELIE = 18,
    DM_ACT_REVLEAKY = 19,
    DM_ACT_NORM_CHAN = 20,
    DM_ACT_NORM_CHAN_SOFTMAX = 21,
    DM_ACT_NORM_CHAN_SOFTMAX_MAXVAL = 22,
    DM_ACT_COUNT = 23
};

/* GEMM bias modes (dm_gemm_args.bias_mode). */
enum dm_bias_mode { DM_BIAS_NONE = 0, DM_BIAS_ROWS = 1, DM_BIAS_COLS = 2 };

/* activation_fwd_f32: y[i] = f(x[i]) for i < n (y may be x). act: an elementwise id. */
typedef struct dm_activation_args {
    uint32_t n;
    int32_t act;
} dm_activation_args;
DM_STATIC_ASSERT(sizeof(dm_activation_args) == 8, "dm_activation_args size");

/* normalize_channels*_fwd_f32 on (batch, channels, spatial). */
typedef struct dm_normalize_channels_args {
    uint32_t batch;
    uint32_t channels;
    uint32_t spatial;
} dm_normalize_channels_args;
DM_STATIC_ASSERT(sizeof(dm_normalize_channels_args) == 12, "dm_normalize_channels_args size");

/* im2col_fwd_f32 and its adjoint col2im_bwd_f32: z = image*groups + group; channels is per group (C/groups); pad is the
 * layer's pad (the kernel pads pad*dilation pixels, as Darknet does). The column matrix of
 * slice z starts at z*channels*ksize*ksize*out_h*out_w, its input at z*channels*height*width.
 * accumulate (col2im only): nonzero adds into the image, 0 writes it whole without reading
 * it (the first writer of a delta, which then needs no clearing); im2col ignores it. */
typedef struct dm_im2col_args {
    uint32_t channels;
    uint32_t height;
    uint32_t width;
    uint32_t ksize;
    uint32_t stride_x;
    uint32_t stride_y;
    uint32_t pad;
    uint32_t dilation;
    uint32_t out_h;
    uint32_t out_w;
    uint32_t accumulate;
} dm_im2col_args;
DM_STATIC_ASSERT(sizeof(dm_im2col_args) == 44, "dm_im2col_args size");

/* gemm_{nn,nt,tn}[_simd]_f32: C[M, N] = act(op(A)[M, K] @ op(B)[K, N] + bias + beta*C),
 * row-major with leading dimensions lda/ldb/ldc. Slice z of the grid is (zb, zg) =
 * (z / groups, z % groups) and offsets every operand by zb*<x>_batch_stride +
 * zg*<x>_group_stride; the bias index is zg*bias_group_stride + row (DM_BIAS_ROWS) or + column
 * (DM_BIAS_COLS). beta = 0 never reads C, so C may hold anything (NaN included) beforehand;
 * beta = 1 accumulates, as backward passes summing gradients need. */
typedef struct dm_gemm_args {
    uint32_t M;
    uint32_t N;
    uint32_t K;
    uint32_t lda;
    uint32_t ldb;
    uint32_t ldc;
    uint32_t groups;
    uint32_t a_batch_stride;
    uint32_t a_group_stride;
    uint32_t b_batch_stride;
    uint32_t b_group_stride;
    uint32_t c_batch_stride;
    uint32_t c_group_stride;
    uint32_t bias_group_stride;
    int32_t bias_mode;
    int32_t act;
    float beta;
} dm_gemm_args;
DM_STATIC_ASSERT(sizeof(dm_gemm_args) == 68, "dm_gemm_args size");

/* gemm_splits_fwd_f32: the epilogue of a GEMM split along K. For each of `images` outputs of
 * `per_image` elements (rows x spatial, row-major), c[z*per_image + i] = act(part[(z*splits +
 * 0)*per_image + i] + ... + part[(z*splits + splits - 1)*per_image + i] + bias[i / spatial]),
 * the splits added in order; the bias only with bias_mode DM_BIAS_ROWS. */
typedef struct dm_gemm_splits_args {
    uint32_t per_image;
    uint32_t images;
    uint32_t splits;
    uint32_t spatial;
    int32_t bias_mode;
    int32_t act;
} dm_gemm_splits_args;
DM_STATIC_ASSERT(sizeof(dm_gemm_splits_args) == 24, "dm_gemm_splits_args size");

/* maxpool_fwd_f32: planes = batch*channels; padding is Darknet's total
 * padding (cfg key, default size-1); windows start padding/2 before the image.
 * accumulate (maxpool_bwd_f32 only): nonzero adds into x_grad, 0 sets it whole. */
typedef struct dm_pool_args {
    uint32_t planes;
    uint32_t height;
    uint32_t width;
    uint32_t out_h;
    uint32_t out_w;
    uint32_t size;
    uint32_t stride_x;
    uint32_t stride_y;
    uint32_t padding;
    uint32_t accumulate;
} dm_pool_args;
DM_STATIC_ASSERT(sizeof(dm_pool_args) == 40, "dm_pool_args size");

/* maxpool_depth_fwd_f32: output channel g = max over input channels g, g+out_channels, ... */
typedef struct dm_maxpool_depth_args {
    uint32_t batch;
    uint32_t channels;
    uint32_t spatial;
    uint32_t out_channels;
} dm_maxpool_depth_args;
DM_STATIC_ASSERT(sizeof(dm_maxpool_depth_args) == 16, "dm_maxpool_depth_args size");

/* avgpool_fwd_f32 (global): planes = batch*channels, each of spatial values. */
typedef struct dm_avgpool_args {
    uint32_t planes;
    uint32_t spatial;
} dm_avgpool_args;
DM_STATIC_ASSERT(sizeof(dm_avgpool_args) == 8, "dm_avgpool_args size");

/* route_fwd_f32: y[b, dst_offset + c] = x[b, src_offset + c] for c < channels (one source).
 * accumulate (route_bwd_f32 only): nonzero adds into x_grad, 0 sets the slice. */
typedef struct dm_route_args {
    uint32_t batch;
    uint32_t spatial;
    uint32_t channels;
    uint32_t src_channels;
    uint32_t src_offset;
    uint32_t dst_channels;
    uint32_t dst_offset;
    uint32_t accumulate;
} dm_route_args;
DM_STATIC_ASSERT(sizeof(dm_route_args) == 32, "dm_route_args size");

/* shortcut_weights_fwd_f32: table[i, c] = normalised weight of input i (0 = x) at channel c.
 * per_channel: weights hold n_inputs*channels values (input-major), else n_inputs.
 * normalization: 0 none, 1 relu, 2 softmax. */
typedef struct dm_shortcut_weights_args {
    uint32_t n_inputs;
    uint32_t channels;
    uint32_t per_channel;
    uint32_t normalization;
} dm_shortcut_weights_args;
DM_STATIC_ASSERT(sizeof(dm_shortcut_weights_args) == 16, "dm_shortcut_weights_args size");

/* shortcut_fwd_f32: adds source number `source` (1-based, its table row) with src_channels
 * channels into y. first=1: y = x*table[0,c] + s*table[source,c] (weighted) or x + s;
 * first=0: y = x + s*table[source,c] (x is the previous pass's y). Channels
 * c >= min(channels, src_channels) take only the x term. */
typedef struct dm_shortcut_args {
    uint32_t batch;
    uint32_t channels;
    uint32_t spatial;
    uint32_t src_channels;
    uint32_t source;
    uint32_t first;
    uint32_t weighted;
} dm_shortcut_args;
DM_STATIC_ASSERT(sizeof(dm_shortcut_args) == 28, "dm_shortcut_args size");

/* upsample_fwd_f32: stride > 0 nearest-neighbour (out = scale*x), stride < 0 Darknet's reverse
 * mode (sum of scale*x over -stride x -stride blocks). planes = batch*channels. */
typedef struct dm_upsample_args {
    uint32_t planes;
    uint32_t height;
    uint32_t width;
    uint32_t out_h;
    uint32_t out_w;
    int32_t stride;
    float scale;
} dm_upsample_args;
DM_STATIC_ASSERT(sizeof(dm_upsample_args) == 28, "dm_upsample_args size");

/* reorg_fwd_f32: Darknet's reorg_cpu(x, width, height, channels, batch, stride, forward) as
 * [reorg] (reorg_old) calls it: the input's dims, and the layer's reverse flag in reorg_cpu's
 * `forward` argument (reverse=0 copies the large side to the small one, reverse=1 back). */
typedef struct dm_reorg_args {
    uint32_t batch;
    uint32_t width;
    uint32_t height;
    uint32_t channels;
    uint32_t stride;
    uint32_t reverse;
} dm_reorg_args;
DM_STATIC_ASSERT(sizeof(dm_reorg_args) == 24, "dm_reorg_args size");

/* scale_channels_fwd_f32: y = scale * x_from, scale (N, C, 1, 1) or, scale_wh, (N, 1, H, W). */
typedef struct dm_scale_channels_args {
    uint32_t batch;
    uint32_t channels;
    uint32_t spatial;
    uint32_t scale_wh;
} dm_scale_channels_args;
DM_STATIC_ASSERT(sizeof(dm_scale_channels_args) == 16, "dm_scale_channels_args size");

/* sam_fwd_f32: y[i] = x[i] * x_from[i] for i < n. */
typedef struct dm_sam_args {
    uint32_t n;
} dm_sam_args;
DM_STATIC_ASSERT(sizeof(dm_sam_args) == 4, "dm_sam_args size");

/* softmax_fwd_f32: rows = batch*groups consecutive runs of n values each. */
typedef struct dm_softmax_args {
    uint32_t rows;
    uint32_t n;
    float temperature;
} dm_softmax_args;
DM_STATIC_ASSERT(sizeof(dm_softmax_args) == 12, "dm_softmax_args size");

/* yolo_fwd_f32 on (batch, anchors*(5+classes), spatial). */
typedef struct dm_yolo_args {
    uint32_t batch;
    uint32_t anchors;
    uint32_t classes;
    uint32_t spatial;
    uint32_t new_coords;
    float scale_x_y;
} dm_yolo_args;
DM_STATIC_ASSERT(sizeof(dm_yolo_args) == 24, "dm_yolo_args size");

/* Per-channel sums over a (batch, channels, spatial) array (a connected layer's (batch,
 * channels) has spatial = 1), in two dispatches of a fixed tree order: the channel's
 * batch*spatial values, flattened image by image, are cut into `chunks` runs of `chunk` values
 * (a multiple of DM_SUM_THREADS; host: darknet_metal.ops.batchnorm.sum_chunks), one
 * threadgroup each writing partials[(k*channels + c)*chunks + g]; then one threadgroup per
 * channel sums its partials. bias_bwd_f32: bias_grad[c] += the sum of delta. */
typedef struct dm_bias_args {
    uint32_t batch;
    uint32_t channels;
    uint32_t spatial;
    uint32_t chunk;
    uint32_t chunks;
} dm_bias_args;
DM_STATIC_ASSERT(sizeof(dm_bias_args) == 20, "dm_bias_args size");

/* batchnorm_{fwd_mean,fwd_var,fwd_norm,fwd_xnorm,bwd_sums,bwd_delta}_f32 on (batch, channels,
 * spatial) (spatial = 1 for a connected layer). The running averages take
 * r = r*momentum + one_minus_momentum*stat, both factors rounded to float from the double
 * momentum on the host, as the CPU rounds them. exact: the backward's exact gradient instead
 * of Darknet's formulas (batchnorm_bwd_delta_f32). */
typedef struct dm_batchnorm_args {
    uint32_t batch;
    uint32_t channels;
    uint32_t spatial;
    float eps;
    float momentum;
    float one_minus_momentum;
    uint32_t exact;
    uint32_t chunk;  /* the sums' runs (see dm_bias_args); unused by the element kernels */
    uint32_t chunks;
    uint32_t act;    /* batchnorm_fwd_norm_f32's activation of its output (dm_activate) */
} dm_batchnorm_args;
DM_STATIC_ASSERT(sizeof(dm_batchnorm_args) == 40, "dm_batchnorm_args size");

/* yolo_loss_bwd_*_f32: Darknet's [yolo] training loss (darknet_metal/cpu/yolo_loss.pyx) in
 * four dispatches: cells, truths, squares, stats. output and delta are (batch,
 * anchors*(5+classes), height, width); truths (batch, boxes, 5) rows (class, cx, cy, w, h);
 * anchor_table the layer's `total` (w, h) pairs in pixels; mask the `anchors` int32 indices
 * of this layer's anchors. iou_loss and iou_thresh_kind: 0 mse, 1 iou, 2 giou, 3 diou,
 * 4 ciou. counters != 0: multipliers holds counters_per_class's per-class weights.
 * max_delta = FLT_MAX does not clip. */
typedef struct dm_yolo_loss_args {
    uint32_t batch;
    uint32_t anchors;
    uint32_t classes;
    uint32_t height;
    uint32_t width;
    uint32_t boxes;
    uint32_t total;
    uint32_t net_w;
    uint32_t net_h;
    uint32_t iou_loss;
    uint32_t iou_thresh_kind;
    uint32_t new_coords;
    uint32_t focal_loss;
    uint32_t objectness_smooth;
    uint32_t counters;
    float ignore_thresh;
    float truth_thresh;
    float iou_thresh;
    float iou_normalizer;
    float obj_normalizer;
    float cls_normalizer;
    float max_delta;
    float label_smooth_eps;
} dm_yolo_loss_args;
DM_STATIC_ASSERT(sizeof(dm_yolo_loss_args) == 92, "dm_yolo_loss_args size");

/* shortcut_bwd_f32, shortcut_bwd_dot_f32: one input of a shortcut, table row `row` (0 = x,
 * then the sources) with src_channels channels; channels is the layer's. Only the first
 * min(channels, src_channels) channels take part. */
typedef struct dm_shortcut_bwd_args {
    uint32_t batch;
    uint32_t channels;
    uint32_t spatial;
    uint32_t src_channels;
    uint32_t row;
    uint32_t weighted;
} dm_shortcut_bwd_args;
DM_STATIC_ASSERT(sizeof(dm_shortcut_bwd_args) == 24, "dm_shortcut_bwd_args size");

/* shortcut_bwd_weights_f32: partial sums (batch rows of `channels`) into the gradient of
 * input row's weight(s); accumulate=0 starts from zero instead of acc's old value. */
typedef struct dm_shortcut_wgrad_args {
    uint32_t batch;
    uint32_t channels;
    uint32_t src_channels;
    uint32_t row;
    uint32_t per_channel;
    uint32_t accumulate;
} dm_shortcut_wgrad_args;
DM_STATIC_ASSERT(sizeof(dm_shortcut_wgrad_args) == 24, "dm_shortcut_wgrad_args size");

/* softmax_fwd_xent_f32, cost_fwd_sse_f32: n elements of prediction and truth. */
typedef struct dm_loss_args {
    uint32_t n;
} dm_loss_args;
DM_STATIC_ASSERT(sizeof(dm_loss_args) == 4, "dm_loss_args size");

/* ---- training: elementwise kernels (activation, buffers, dropout and update .metal) ---- */

/* activation_bwd_f32 takes dm_activation_args (delta[i] *= f'(y_or_x[i]), i < n), and
 * normalize_channels*_bwd_f32 take dm_normalize_channels_args. */

/* fill_buf_f32: x[i] = value for i < n. */
typedef struct dm_fill_args {
    uint32_t n;
    float value;
} dm_fill_args;
DM_STATIC_ASSERT(sizeof(dm_fill_args) == 8, "dm_fill_args size");

/* copy_buf_f32: dst[i] = src[i] for i < n. */
typedef struct dm_copy_args {
    uint32_t n;
} dm_copy_args;
DM_STATIC_ASSERT(sizeof(dm_copy_args) == 4, "dm_copy_args size");

/* sum_slices_buf_f32: dst[i] = dst[i] + (src[i] + src[stride + i] + ... + src[(slices - 1)*stride
 * + i]) for i < n, the slices added in order: the split-K partial products of a GEMM. */
typedef struct dm_sum_slices_args {
    uint32_t n;
    uint32_t slices;
    uint32_t stride;
} dm_sum_slices_args;
DM_STATIC_ASSERT(sizeof(dm_sum_slices_args) == 12, "dm_sum_slices_args size");

/* add_buf_f32: dst[i] = dst[i] + scale*src[i] for i < n. */
typedef struct dm_add_args {
    uint32_t n;
    float scale;
} dm_add_args;
DM_STATIC_ASSERT(sizeof(dm_add_args) == 8, "dm_add_args size");

/* uniform_buf_f32: rand[i] = U[0, 1) draw i of (seed, counter) for i < n; the 64-bit seed
 * as two words (seed = seed_hi << 32 | seed_lo). */
typedef struct dm_uniform_args {
    uint32_t n;
    uint32_t seed_lo;
    uint32_t seed_hi;
} dm_uniform_args;
DM_STATIC_ASSERT(sizeof(dm_uniform_args) == 12, "dm_uniform_args size");

/* uniform_buf_advance_f32: counters 0 .. count-1 (two words each, low first) += 1. */
typedef struct dm_counter_args {
    uint32_t count;
} dm_counter_args;
DM_STATIC_ASSERT(sizeof(dm_counter_args) == 4, "dm_counter_args size");

/* dropout_fwd_train_f32 / dropout_bwd_f32: v[i] = rand[i] < probability ? 0 : v[i]*scale,
 * scale = 1/(1 - probability) rounded to float by the host (as Darknet stores it). */
typedef struct dm_dropout_args {
    uint32_t n;
    float probability;
    float scale;
} dm_dropout_args;
DM_STATIC_ASSERT(sizeof(dm_dropout_args) == 12, "dm_dropout_args size");

/* sgd_upd_f32: Darknet's SGD step of n parameters; batch = images per iteration,
 * apply_decay: nonzero where Darknet decays (weights), lr_scale: the layer's multiplier. */
typedef struct dm_sgd_args {
    uint32_t n;
    uint32_t batch;
    uint32_t apply_decay;
    float decay;
    float momentum;
    float lr_scale;
} dm_sgd_args;
DM_STATIC_ASSERT(sizeof(dm_sgd_args) == 24, "dm_sgd_args size");

/* adam_upd_f32: Darknet's (GPU) Adam step of n parameters. */
typedef struct dm_adam_args {
    uint32_t n;
    uint32_t batch;
    float decay;
    float b1;
    float b2;
    float eps;
    float lr_scale;
} dm_adam_args;
DM_STATIC_ASSERT(sizeof(dm_adam_args) == 28, "dm_adam_args size");

/* finite_buf_f32: flag[0] = 0 if any of x[0 .. n-1] is a NaN or an infinity (else kept). */
typedef struct dm_finite_args {
    uint32_t n;
} dm_finite_args;
DM_STATIC_ASSERT(sizeof(dm_finite_args) == 4, "dm_finite_args size");

#endif /* DM_ARGS_H */
