// [yolo]: the head's forward (Darknet's layer.output at inference) and its training loss.
//
// The loss: the layer delta (assigned, Darknet-signed) and the cost and
// statistics, as darknet_metal/cpu/yolo_loss.pyx computes them (its docstring gives the
// formulas). Four dispatches, in this order, each after the previous one has finished:
//
// 1. yolo_loss_bwd_cells_f32, a thread per (cell, anchor, image): zeroes the cell's delta,
//    then its objectness delta from the best IoU with the image's truths, and the
//    truth_thresh deltas. Every cell is independent here.
// 2. yolo_loss_bwd_truths_f32, a thread per image: walks the truths in row order, so that a
//    later truth on the same cell adds to or overwrites what an earlier one wrote exactly as
//    on the CPU; the order dependencies never leave the thread.
// 3. yolo_loss_bwd_squares_f32, a thread per cell again: shares a cell's box delta among its
//    positive classes (iou_thresh < 1), then the cell's sums of squared deltas.
// 4. yolo_loss_bwd_stats_f32, one threadgroup: reduces the per-cell sums along a fixed tree
//    and combines the per-image sums in image order into the stats (YOLO_STAT_NAMES order).
//
// Float32 follows the CPU's order of operations, so deltas agree bit for bit: CIoU's aspect
// terms, which the CPU rounds through double, are carried as float pairs. DIoU's pow of the
// iou_thresh_kind test stays float (the CPU's is double), and the statistics sum in another
// order (the CPU in double).
//
// Nothing here relies on NaN or infinity semantics: finiteness is tested on the exponent
// bits, and a predicted size whose exp would overflow is caught from exp's argument. Such a
// prediction (the CPU's infinite box) has IoU 0, GIoU -1 and no IoU-family box gradient, which
// is what the CPU's non-finite results turn into.
#include <metal_stdlib>
#include "dm_args.h"
using namespace metal;

// ---- forward -------------------------------------------------------------------------------

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

// ---- training loss -------------------------------------------------------------------------

enum { YL_MSE = 0, YL_IOU = 1, YL_GIOU = 2, YL_DIOU = 3, YL_CIOU = 4 };

// A row of the per-image sums (images) and of the per-cell sums (partials).
enum {
    YL_IMG_IOU, YL_IMG_IOU_LOSS, YL_IMG_GIOU_LOSS, YL_IMG_COUNT, YL_IMG_OBJ, YL_IMG_CLASS_PROB,
    YL_IMG_RECALL50, YL_IMG_RECALL75, YL_IMG_BBOX, YL_IMG_REWRITTEN, YL_IMG_SLOTS
};
enum { YL_CELL_OBJ, YL_CELL_BBOX, YL_CELL_BOX_SQUARES, YL_CELL_NOBOX_SQUARES, YL_CELL_SLOTS };

constant uint YL_STATS_THREADS = 256;
constant uint YL_STATS_SHARED = YL_STATS_THREADS * 4;
// expf(x) is finite exactly for x <= this (the float just below ln(FLT_MAX)).
constant float YL_EXP_LIMIT = 88.72283f;
// 4 / pi^2 of CIoU's aspect term and CIoU's 1e-6, each as a float pair hi + lo.
constant float YL_AR_HI = 0.405284733f;
constant float YL_AR_LO = 1.98916617e-09f;
constant float YL_EPS_HI = 9.99999997e-07f;
constant float YL_EPS_LO = 2.52475725e-15f;

inline bool yl_finite(float v) {
    return (as_type<uint>(v) & 0x7f800000u) != 0x7f800000u;
}

// std::max / std::min: the first argument unless the other compares larger / smaller.
inline float yl_larger(float a, float b) { return a < b ? b : a; }
inline float yl_smaller(float a, float b) { return b < a ? b : a; }

inline float yl_overlap(float x1, float w1, float x2, float w2) {
    return yl_smaller(x1 + w1 / 2.0f, x2 + w2 / 2.0f) - yl_larger(x1 - w1 / 2.0f, x2 - w2 / 2.0f);
}

// Boxes are (x, y, w, h): centre and size.
inline float yl_intersection(float4 a, float4 b) {
    const float w = yl_overlap(a.x, a.z, b.x, b.z);
    if (w <= 0.0f) return 0.0f;
    const float h = yl_overlap(a.y, a.w, b.y, b.w);
    if (h <= 0.0f) return 0.0f;
    return w * h;
}

inline float yl_iou(float4 a, float4 b) {
    const float inter = yl_intersection(a, b);
    if (inter == 0.0f) return 0.0f;
    return inter / (a.z * a.w + b.z * b.w - inter);
}

// Width and height of the smallest box holding a and b.
inline float2 yl_enclosing(float4 a, float4 b) {
    return float2(fmax(a.x + a.z / 2.0f, b.x + b.z / 2.0f) - fmin(a.x - a.z / 2.0f, b.x - b.z / 2.0f),
                  fmax(a.y + a.w / 2.0f, b.y + b.w / 2.0f) - fmin(a.y - a.w / 2.0f, b.y - b.w / 2.0f));
}

inline float yl_giou(float4 a, float4 b) {
    const float2 wh = yl_enclosing(a, b);
    const float c = wh.x * wh.y;
    const float iou = yl_iou(a, b);
    if (c == 0.0f) return iou;
    const float joint = a.z * a.w + b.z * b.w - yl_intersection(a, b);
    return iou - (c - joint) / c;
}

inline float yl_distance2(float4 a, float4 b) {
    return (a.x - b.x) * (a.x - b.x) + (a.y - b.y) * (a.y - b.y);
}

// The CPU computes CIoU's aspect terms in double and rounds them to float once. A float pair
// (hi + lo, about 48 bits) rounded once to float gives the same float but in rare ties. The
// error terms use fma; a compiler reassociating under fast math may drop them, leaving plain
// float arithmetic (a few ulps off), never anything worse.
inline float2 yl_two_sum(float a, float b) {
    const float s = a + b;
    const float bb = s - a;
    return float2(s, (a - (s - bb)) + (b - bb));
}

// The pair a (hi, lo) times the float b.
inline float2 yl_pair_mul(float2 a, float b) {
    const float p = a.x * b;
    const float err = fma(a.x, b, -p) + a.y * b;
    return yl_two_sum(p, err);
}

// 4/pi^2 * gap * gap: CIoU's aspect-ratio loss, rounded once.
inline float yl_ar_loss(float gap) {
    const float2 v = yl_pair_mul(yl_pair_mul(float2(YL_AR_HI, YL_AR_LO), gap), gap);
    return v.x + v.y;
}

// 2 * 4/pi^2 * gap * side, rounded once.
inline float yl_ar_slope(float gap, float side) {
    const float2 v = yl_pair_mul(yl_pair_mul(float2(2.0f * YL_AR_HI, 2.0f * YL_AR_LO), gap), side);
    return v.x + v.y;
}

// CIoU's alpha = ar_loss / ((1 - iou + ar_loss) + 1e-6), the sum in float, the rest as the
// CPU's double rounded once.
inline float yl_ciou_alpha(float iou, float ar_loss) {
    const float2 e = yl_two_sum(1.0f - iou + ar_loss, YL_EPS_HI);
    const float2 den = yl_two_sum(e.x, e.y + YL_EPS_LO);
    const float q = ar_loss / den.x;
    const float r = fma(-q, den.x, ar_loss) - q * den.y;
    return q + r / den.x;
}

// The IoU of kind (iou_thresh_kind) between two anchor shapes, both of finite size.
inline float yl_iou_of_kind(float4 a, float4 b, uint kind) {
    if (kind == YL_GIOU) return yl_giou(a, b);
    if (kind != YL_DIOU && kind != YL_CIOU) return yl_iou(a, b);
    const float2 wh = yl_enclosing(a, b);
    const float c = wh.x * wh.x + wh.y * wh.y;
    const float iou = yl_iou(a, b);
    if (c == 0.0f) return iou;
    const float d = yl_distance2(a, b) / c;
    if (kind == YL_DIOU) return iou - pow(d, 0.6f);
    const float ar_loss = yl_ar_loss(atan(b.z / b.w) - atan(a.z / a.w));
    return iou - (d + yl_ciou_alpha(iou, ar_loss) * ar_loss);
}

inline float yl_quotient(float den, float d_num, float num, float d_den) {
    return (den * d_num - num * d_den) / (den * den);
}

// box.cpp's dx_box_iou: (dx, dy, dw, dh) of the IoU of `kind` at pred, from the gradients by
// the prediction's edges top, bottom, left, right, combined as Darknet does (dw, dh not
// halved).
inline float4 yl_dx_box_iou(float4 pred, float4 truth, uint kind) {
    const float ptop = pred.y - pred.w / 2.0f, pbot = pred.y + pred.w / 2.0f;
    const float pleft = pred.x - pred.z / 2.0f, pright = pred.x + pred.z / 2.0f;
    const float pt = fmin(ptop, pbot), pb = fmax(ptop, pbot);
    const float pl = fmin(pleft, pright), pr = fmax(pleft, pright);
    const float tt = truth.y - truth.w / 2.0f, tb = truth.y + truth.w / 2.0f;
    const float tl = truth.x - truth.z / 2.0f, tr = truth.x + truth.z / 2.0f;

    const float area = (pb - pt) * (pr - pl);
    const float truth_area = (tb - tt) * (tr - tl);
    const float ih = fmin(pb, tb) - fmax(pt, tt);
    const float iw = fmin(pr, tr) - fmax(pl, tl);
    const float inter = iw * ih;
    const float joint = area + truth_area - inter;
    const float s = yl_distance2(pred, truth);
    const float gcw = fmax(pr, tr) - fmin(pl, tl);
    const float gch = fmax(pb, tb) - fmin(pt, tt);
    const float gc = gcw * gch;

    // By edge: of the prediction's area (dx), the intersection (di), the union (du) and the
    // enclosing box (dc).
    const float dx_t = -(pr - pl), dx_b = pr - pl;
    const float dx_l = -(pb - pt), dx_r = pb - pt;
    const float di_t = pt > tt ? -iw : 0.0f;
    const float di_b = pb < tb ? iw : 0.0f;
    const float di_l = pl > tl ? -ih : 0.0f;
    const float di_r = pr < tr ? ih : 0.0f;
    const float du_t = dx_t - di_t, du_b = dx_b - di_b;
    const float du_l = dx_l - di_l, du_r = dx_r - di_r;
    const float dc_t = pt < tt ? -gcw : 0.0f;
    const float dc_b = pb > tb ? gcw : 0.0f;
    const float dc_l = pl < tl ? -gch : 0.0f;
    const float dc_r = pr > tr ? gch : 0.0f;

    float g_t = 0.0f, g_b = 0.0f, g_l = 0.0f, g_r = 0.0f;
    if (joint > 0.0f) {
        g_t = yl_quotient(joint, di_t, inter, du_t);
        g_b = yl_quotient(joint, di_b, inter, du_b);
        g_l = yl_quotient(joint, di_l, inter, du_l);
        g_r = yl_quotient(joint, di_r, inter, du_r);
    }
    // A flipped box takes the gradient of the edge really on that side.
    if (!(ptop < pbot)) g_t = g_b;
    if (!(pleft < pright)) g_l = g_r;

    if (kind == YL_GIOU) {
        if (gc > 0.0f) {
            g_t = g_t + yl_quotient(gc, du_t, joint, dc_t);
            g_b = g_b + yl_quotient(gc, du_b, joint, dc_b);
            g_l = g_l + yl_quotient(gc, du_l, joint, dc_l);
            g_r = g_r + yl_quotient(gc, du_r, joint, dc_r);
        }
        if (iw <= 0.0f || ih <= 0.0f) {
            g_t = yl_quotient(gc, du_t, joint, dc_t);
            g_b = yl_quotient(gc, du_b, joint, dc_b);
            g_l = yl_quotient(gc, du_l, joint, dc_l);
            g_r = yl_quotient(gc, du_r, joint, dc_r);
        }
    }
    float4 grad = float4(g_l + g_r, g_t + g_b, g_r - g_l, g_b - g_t);
    if (kind != YL_DIOU && kind != YL_CIOU) return grad;

    // The centre distance over the enclosing box's squared diagonal, from the unordered
    // edges as Darknet takes them.
    const float ct = fmin(pred.y - pred.w / 2.0f, truth.y - truth.w / 2.0f);
    const float cb = fmax(pred.y + pred.w / 2.0f, truth.y + truth.w / 2.0f);
    const float cl = fmin(pred.x - pred.z / 2.0f, truth.x - truth.z / 2.0f);
    const float cr = fmax(pred.x + pred.z / 2.0f, truth.x + truth.z / 2.0f);
    const float cw = cr - cl, ch = cb - ct;
    const float c = cw * cw + ch * ch;
    const float dcw_dx = (pr > tr ? 1.0f : 0.0f) - (pl < tl ? 1.0f : 0.0f);
    const float dcw_dw = (pr > tr ? 0.5f : 0.0f) - (pl < tl ? -0.5f : 0.0f);
    const float dch_dy = (pb > tb ? 1.0f : 0.0f) - (pt < tt ? 1.0f : 0.0f);
    const float dch_dh = (pb > tb ? 0.5f : 0.0f) - (pt < tt ? -0.5f : 0.0f);
    // The products with a zero are Darknet's: they only matter for a non-finite side, where
    // the CPU's NaN is zeroed by the caller (here such a prediction never gets this far).
    const float dc_x = 2.0f * cw * dcw_dx + 2.0f * ch * 0.0f;
    const float dc_y = 2.0f * cw * 0.0f + 2.0f * ch * dch_dy;
    const float dc_w = 2.0f * cw * dcw_dw + 2.0f * ch * 0.0f;
    const float dc_h = 2.0f * cw * 0.0f + 2.0f * ch * dch_dh;
    // Darknet's signs: x and y take -S*dC where the derivative of -S/C has +S*dC.
    const float ex = (2.0f * (truth.x - pred.x) * c - dc_x * s) / (c * c);
    const float ey = (2.0f * (truth.y - pred.y) * c - dc_y * s) / (c * c);
    float ew = dc_w * s / (c * c);
    float eh = dc_h * s / (c * c);
    if (kind == YL_CIOU) {
        const float gap = atan(truth.z / truth.w) - atan(pred.z / pred.w);
        const float alpha = yl_ciou_alpha(inter / joint, yl_ar_loss(gap));
        ew = ew + alpha * yl_ar_slope(gap, pred.w);
        eh = eh + alpha * -yl_ar_slope(gap, pred.z);
    }
    if (c > 0.0f) grad = float4(grad.x + ex, grad.y + ey, grad.z + ew, grad.w + eh);
    if (iw <= 0.0f || ih <= 0.0f) grad = float4(ex, ey, ew, eh);
    return grad;
}

// ---- the layer -------------------------------------------------------------------------

// A truth row the loss takes: finite, a box (w, h > 0), a class in [0, classes) and a
// centre in [0, 1]. Rows failing it are padding.
inline bool yl_usable(device const float* row, uint classes) {
    for (uint k = 0; k < 5u; ++k) {
        if (!yl_finite(row[k])) return false;
    }
    return row[3] > 0.0f && row[4] > 0.0f && row[0] >= 0.0f && row[0] < float(classes) &&
           row[1] >= 0.0f && row[1] <= 1.0f && row[2] >= 0.0f && row[2] <= 1.0f;
}

inline bool yl_has_truths(constant dm_yolo_loss_args& args, device const float* rows) {
    for (uint t = 0; t < args.boxes; ++t) {
        if (yl_usable(rows + t * 5u, args.classes)) return true;
    }
    return false;
}

// Anchor k's (w, h) in pixels; a mask entry out of range reads anchor 0 (the host checks the
// mask: this only keeps the read inside the table).
inline float2 yl_anchor(constant dm_yolo_loss_args& args, device const float* table, int k) {
    const uint at = (k >= 0 && uint(k) < args.total) ? uint(k) : 0u;
    return float2(table[2u * at], table[2u * at + 1u]);
}

// Anchor k's shape centred on 0, normalised to the network size.
inline float4 yl_anchor_box(constant dm_yolo_loss_args& args, device const float* table, uint k) {
    return float4(0.0f, 0.0f, table[2u * k] / float(args.net_w), table[2u * k + 1u] / float(args.net_h));
}

// int_index: the first position of anchor k in the mask, or -1.
inline int yl_mask_position(constant dm_yolo_loss_args& args, device const int* mask, uint k) {
    for (uint a = 0; a < args.anchors; ++a) {
        if (mask[a] == int(k)) return int(a);
    }
    return -1;
}

struct yl_pred {
    float4 box;
    bool finite;  // false: a size the CPU computes as infinite (or NaN)
};

// get_yolo_box of the cell (i, j) whose x channel `out` points at, normalised to the network.
inline yl_pred yl_pred_box(constant dm_yolo_loss_args& args, device const float* out, uint stride,
                           float2 anchor, uint i, uint j) {
    const float tw = out[2u * stride], th = out[3u * stride];
    yl_pred p;
    p.box.x = (float(i) + out[0]) / float(args.width);
    p.box.y = (float(j) + out[stride]) / float(args.height);
    bool ok = true;
    if (args.new_coords != 0u) {
        p.box.z = tw * tw * 4.0f * anchor.x / float(args.net_w);
        p.box.w = th * th * 4.0f * anchor.y / float(args.net_h);
    } else {
        ok = tw <= YL_EXP_LIMIT && th <= YL_EXP_LIMIT;
        p.box.z = exp(ok ? tw : 0.0f) * anchor.x / float(args.net_w);
        p.box.w = exp(ok ? th : 0.0f) * anchor.y / float(args.net_h);
    }
    p.finite = ok && yl_finite(p.box.z) && yl_finite(p.box.w);
    return p;
}

// delta_yolo_box: adds the box delta of `truth` into the cell whose x channel `out` and `d`
// point at. Returns the prediction's (IoU, GIoU) with the CPU's replacements of non-finite
// values (0 and -1).
inline float2 yl_delta_box(constant dm_yolo_loss_args& args, device const float* out,
                           device float* d, uint stride, float4 truth, float2 anchor, uint i,
                           uint j, float scale, float iou_normalizer) {
    const yl_pred p = yl_pred_box(args, out, stride, anchor, i, j);
    float iou = p.finite ? yl_iou(p.box, truth) : 0.0f;
    float giou = p.finite ? yl_giou(p.box, truth) : -1.0f;
    if (!yl_finite(iou)) iou = 0.0f;
    if (!yl_finite(giou)) giou = -1.0f;
    float4 pred = p.box;
    // Darknet's guard against 0/0 in the derivatives of a collapsed prediction.
    if (pred.z == 0.0f) pred.z = 1.0f;
    if (pred.w == 0.0f) pred.w = 1.0f;
    float target[4];
    if (args.iou_loss == YL_MSE) {
        target[0] = truth.x * float(args.width) - float(i);
        target[1] = truth.y * float(args.height) - float(j);
        if (args.new_coords != 0u) {
            target[2] = sqrt(truth.z * float(args.net_w) / (4.0f * anchor.x));
            target[3] = sqrt(truth.w * float(args.net_h) / (4.0f * anchor.y));
        } else {
            target[2] = log(truth.z * float(args.net_w) / anchor.x);
            target[3] = log(truth.w * float(args.net_h) / anchor.y);
        }
        // scale * iou_normalizer first, as Darknet's build rounds it.
        const float weight = scale * iou_normalizer;
        for (uint k = 0; k < 4u; ++k) d[k * stride] += weight * (target[k] - out[k * stride]);
        return float2(iou, giou);
    }
    const float4 g = p.finite ? yl_dx_box_iou(pred, truth, args.iou_loss) : float4(0.0f);
    float grad[4] = {g.x, g.y, g.z, g.w};
    if (args.new_coords == 0u) {
        // The size is exp(raw): its chain-rule factor. An overflowing factor leaves a
        // non-finite gradient on the CPU, which zeroes it.
        for (uint k = 2; k < 4u; ++k) {
            const float raw = out[k * stride];
            grad[k] = raw > YL_EXP_LIMIT ? 0.0f : grad[k] * exp(raw);
        }
    }
    const float limit = args.max_delta;
    for (uint k = 0; k < 4u; ++k) {
        float v = grad[k] * iou_normalizer;
        if (!yl_finite(v)) v = 0.0f;
        if (v > limit) {
            v = limit;
        } else if (v < -limit) {
            v = -limit;
        }
        d[k * stride] += v;
    }
    return float2(iou, giou);
}

// delta_yolo_class for a truth of class `cls` on the cell whose first class channel `out` and
// `d` point at. A class already holding a delta (a second truth of that class) is the only
// one redone.
inline void yl_delta_class(constant dm_yolo_loss_args& args, device const float* out,
                           device float* d, uint stride, uint cls,
                           device const float* multipliers) {
    const uint at = cls * stride;
    const float eps = args.label_smooth_eps;
    if (d[at] != 0.0f) {
        float y = 1.0f;
        if (eps != 0.0f) y = y * (1.0f - eps) + 0.5f * eps;
        const float r = y - out[at];
        if (yl_finite(r)) d[at] = r;
        if (args.counters != 0u) d[at] = d[at] * multipliers[cls];
        return;
    }
    if (args.focal_loss != 0u) {
        const float pt = out[at] + 1e-15f;
        const float scale = 0.5f * (-(1.0f - pt) * (2.0f * pt * log(pt) + pt - 1.0f));
        for (uint c = 0; c < args.classes; ++c) {
            d[c * stride] = ((c == cls ? 1.0f : 0.0f) - out[c * stride]) * scale;
        }
        return;
    }
    for (uint c = 0; c < args.classes; ++c) {
        float y = c == cls ? 1.0f : 0.0f;
        if (eps != 0.0f) y = y * (1.0f - eps) + 0.5f * eps;
        const float r = y - out[c * stride];
        if (yl_finite(r)) d[c * stride] = r;
    }
    if (args.counters != 0u) d[at] = d[at] * (multipliers[cls] * args.cls_normalizer);
}

// Writes delta and partials[cell] (its objectness as averaged, and 1 for a truth_thresh box).
// Grid (spatial, anchors, batch).
kernel void yolo_loss_bwd_cells_f32(constant dm_yolo_loss_args& args [[buffer(0)]],
                                    device const float* output [[buffer(1)]],
                                    device const float* truths [[buffer(2)]],
                                    device const float* anchor_table [[buffer(3)]],
                                    device const int* mask [[buffer(4)]],
                                    device const float* multipliers [[buffer(5)]],
                                    device float* delta [[buffer(6)]],
                                    device float* partials [[buffer(7)]],
                                    uint3 gid [[thread_position_in_grid]]) {
    const uint stride = args.height * args.width;
    if (gid.x >= stride || gid.y >= args.anchors || gid.z >= args.batch || args.total == 0u) {
        return;
    }
    const uint entries = 5u + args.classes;
    const uint base = (gid.z * args.anchors + gid.y) * entries * stride + gid.x;
    device const float* out = output + base;
    device float* d = delta + base;
    for (uint c = 0; c < entries; ++c) d[c * stride] = 0.0f;
    const uint i = gid.x % args.width, j = gid.x / args.width;
    const float2 anchor = yl_anchor(args, anchor_table, mask[gid.y]);
    device const float* rows = truths + gid.z * args.boxes * 5u;

    const yl_pred pred = yl_pred_box(args, out, stride, anchor, i, j);
    // compare_yolo_class: any class, not the truth's.
    bool class_match = false;
    for (uint c = 0; c < args.classes; ++c) {
        if (out[(5u + c) * stride] > 0.25f) class_match = true;
    }
    bool has_truths = false;
    float best_match = 0.0f, best_iou = 0.0f;
    uint best_t = 0;
    for (uint t = 0; t < args.boxes; ++t) {
        device const float* row = rows + t * 5u;
        if (!yl_usable(row, args.classes)) continue;
        has_truths = true;
        const float iou = pred.finite ? yl_iou(pred.box, float4(row[1], row[2], row[3], row[4])) : 0.0f;
        if (iou > best_match && class_match) best_match = iou;
        if (iou > best_iou) {
            best_iou = iou;
            best_t = t;
        }
    }
    // Darknet zeroes a non-finite objectness, but only in an image with truths.
    float obj = out[4u * stride];
    if (has_truths && !yl_finite(obj)) obj = 0.0f;
    const float obj_norm = args.obj_normalizer;
    d[4u * stride] = obj_norm * (0.0f - obj);
    if (best_match > args.ignore_thresh) {
        d[4u * stride] = args.objectness_smooth != 0u
                             ? yl_larger(d[4u * stride], obj_norm * (best_match - obj))
                             : 0.0f;
    }
    float bbox = 0.0f;
    if (best_iou > args.truth_thresh) {
        device const float* row = rows + best_t * 5u;
        const uint cls = uint(row[0]);
        const float multiplier = args.counters != 0u ? multipliers[cls] : 1.0f;
        const bool smooth = args.objectness_smooth != 0u;
        d[4u * stride] = obj_norm * ((smooth ? best_iou * best_iou : 1.0f) - obj);
        yl_delta_class(args, out + 5u * stride, d + 5u * stride, stride, cls, multipliers);
        if (smooth) {
            const uint at = (5u + cls) * stride;
            d[at] = multiplier * (best_iou * best_iou - out[at]);
        }
        yl_delta_box(args, out, d, stride, float4(row[1], row[2], row[3], row[4]), anchor, i, j,
                     2.0f - row[3] * row[4], args.iou_normalizer * multiplier);
        bbox = 1.0f;
    }
    device float* sums = partials + ((gid.z * args.anchors + gid.y) * stride + gid.x) * YL_CELL_SLOTS;
    sums[YL_CELL_OBJ] = obj;
    sums[YL_CELL_BBOX] = bbox;
}

struct yl_tally {
    float v[YL_IMG_SLOTS];
};

// The deltas of truth `row` on the cell (i, j) of the mask's position-th anchor, whose size is
// `anchor`.
inline void yl_responsible(constant dm_yolo_loss_args& args, device const float* out,
                           device float* d, device const float* row, float2 anchor, uint position,
                           uint i, uint j, device const float* multipliers, bool fix_obj,
                           thread yl_tally& tally) {
    const uint stride = args.height * args.width;
    const uint cell = position * (5u + args.classes) * stride + j * args.width + i;
    const uint cls = uint(row[0]);
    const float multiplier = args.counters != 0u ? multipliers[cls] : 1.0f;
    for (uint k = 0; k < 4u; ++k) {
        if (d[cell + k * stride] != 0.0f) {
            tally.v[YL_IMG_REWRITTEN] += 1.0f;
            break;
        }
    }
    const float2 ious = yl_delta_box(args, out + cell, d + cell, stride,
                                     float4(row[1], row[2], row[3], row[4]), anchor, i, j,
                                     2.0f - row[3] * row[4], args.iou_normalizer * multiplier);
    tally.v[YL_IMG_BBOX] += 1.0f;
    tally.v[YL_IMG_IOU] = tally.v[YL_IMG_IOU] + ious.x;
    tally.v[YL_IMG_IOU_LOSS] = tally.v[YL_IMG_IOU_LOSS] + (1.0f - ious.x);
    tally.v[YL_IMG_GIOU_LOSS] = tally.v[YL_IMG_GIOU_LOSS] + (1.0f - ious.y);
    const uint obj_index = cell + 4u * stride;
    float obj = out[obj_index];
    if (fix_obj && !yl_finite(obj)) obj = 0.0f;
    const float weight = multiplier * args.obj_normalizer * (1.0f - obj);
    if (args.objectness_smooth == 0u || d[obj_index] == 0.0f) d[obj_index] = weight;
    tally.v[YL_IMG_OBJ] += obj;
    tally.v[YL_IMG_RECALL50] += ious.x > 0.5f ? 1.0f : 0.0f;
    tally.v[YL_IMG_RECALL75] += ious.x > 0.75f ? 1.0f : 0.0f;
    const uint classes = cell + 5u * stride;
    yl_delta_class(args, out + classes, d + classes, stride, cls, multipliers);
    tally.v[YL_IMG_CLASS_PROB] += out[classes + cls * stride];
    tally.v[YL_IMG_COUNT] += 1.0f;
}

// Every truth of an image in row order: its cell and best-shaped anchor of the whole table
// (first best wins), plus with iou_thresh < 1 the mask's other anchors of a close enough
// shape. Writes the image's row of sums. Grid (batch).
kernel void yolo_loss_bwd_truths_f32(constant dm_yolo_loss_args& args [[buffer(0)]],
                                     device const float* output [[buffer(1)]],
                                     device const float* truths [[buffer(2)]],
                                     device const float* anchor_table [[buffer(3)]],
                                     device const int* mask [[buffer(4)]],
                                     device const float* multipliers [[buffer(5)]],
                                     device float* delta [[buffer(6)]],
                                     device float* images [[buffer(7)]],
                                     uint gid [[thread_position_in_grid]]) {
    const uint stride = args.height * args.width;
    if (gid >= args.batch || args.total == 0u || stride == 0u) return;
    const uint outputs = args.anchors * (5u + args.classes) * stride;
    device const float* out = output + gid * outputs;
    device float* d = delta + gid * outputs;
    device const float* rows = truths + gid * args.boxes * 5u;
    const bool fix_obj = yl_has_truths(args, rows);
    yl_tally tally;
    for (uint k = 0; k < uint(YL_IMG_SLOTS); ++k) tally.v[k] = 0.0f;
    for (uint t = 0; t < args.boxes; ++t) {
        device const float* row = rows + t * 5u;
        if (!yl_usable(row, args.classes)) continue;
        // (int)(cx*W), clamped: a centre of exactly 1 is in the last cell.
        const uint i = min(uint(row[1] * float(args.width)), args.width - 1u);
        const uint j = min(uint(row[2] * float(args.height)), args.height - 1u);
        const float4 shape = float4(0.0f, 0.0f, row[3], row[4]);
        float best_iou = 0.0f;
        uint best_n = 0;
        for (uint k = 0; k < args.total; ++k) {
            const float iou = yl_iou(yl_anchor_box(args, anchor_table, k), shape);
            if (iou > best_iou) {
                best_iou = iou;
                best_n = k;
            }
        }
        const int position = yl_mask_position(args, mask, best_n);
        if (position >= 0) {
            yl_responsible(args, out, d, row, yl_anchor(args, anchor_table, int(best_n)),
                           uint(position), i, j, multipliers, fix_obj, tally);
        }
        if (args.iou_thresh < 1.0f) {
            for (uint k = 0; k < args.total; ++k) {
                const int other = yl_mask_position(args, mask, k);
                if (other < 0 || k == best_n) continue;
                const float4 box = yl_anchor_box(args, anchor_table, k);
                if (yl_iou_of_kind(box, shape, args.iou_thresh_kind) > args.iou_thresh) {
                    yl_responsible(args, out, d, row, yl_anchor(args, anchor_table, int(k)),
                                   uint(other), i, j, multipliers, fix_obj, tally);
                }
            }
        }
    }
    for (uint k = 0; k < uint(YL_IMG_SLOTS); ++k) images[gid * YL_IMG_SLOTS + k] = tally.v[k];
}

// averages_yolo_deltas (iou_thresh < 1 only): a cell's box delta shared among its classes
// with a positive delta. Then the cell's squared deltas, box channels and the others apart,
// into partials[cell]. Grid (spatial, anchors, batch).
kernel void yolo_loss_bwd_squares_f32(constant dm_yolo_loss_args& args [[buffer(0)]],
                                      device float* delta [[buffer(1)]],
                                      device float* partials [[buffer(2)]],
                                      uint3 gid [[thread_position_in_grid]]) {
    const uint stride = args.height * args.width;
    if (gid.x >= stride || gid.y >= args.anchors || gid.z >= args.batch) return;
    const uint entries = 5u + args.classes;
    device float* d = delta + (gid.z * args.anchors + gid.y) * entries * stride + gid.x;
    if (args.iou_thresh < 1.0f && d[4u * stride] != 0.0f) {
        uint positives = 0;
        for (uint c = 0; c < args.classes; ++c) {
            if (d[(5u + c) * stride] > 0.0f) ++positives;
        }
        if (positives > 0u) {
            for (uint k = 0; k < 4u; ++k) d[k * stride] = d[k * stride] / float(positives);
        }
    }
    float box = 0.0f, nobox = 0.0f;
    for (uint c = 0; c < 4u; ++c) box += d[c * stride] * d[c * stride];
    for (uint c = 4; c < entries; ++c) nobox += d[c * stride] * d[c * stride];
    device float* sums = partials + ((gid.z * args.anchors + gid.y) * stride + gid.x) * YL_CELL_SLOTS;
    sums[YL_CELL_BOX_SQUARES] = box;
    sums[YL_CELL_NOBOX_SQUARES] = nobox;
}

// The cost and statistics, in YOLO_STAT_NAMES order. One threadgroup of YL_STATS_THREADS
// (dispatch one = 1; any further group returns at once): each thread sums a fixed stride of
// cells, a tree halves the partial sums, then thread 0 adds the images' rows in image order
// (the CPU's order for the IoU sums) and derives the statistics as the CPU's _finish does.
kernel void yolo_loss_bwd_stats_f32(constant dm_yolo_loss_args& args [[buffer(0)]],
                                    device const float* partials [[buffer(1)]],
                                    device const float* images [[buffer(2)]],
                                    device float* stats [[buffer(3)]],
                                    uint tid [[thread_index_in_threadgroup]],
                                    uint group [[threadgroup_position_in_grid]]) {
    threadgroup float shared[YL_STATS_SHARED];
    if (group != 0u || args.batch == 0u) return;
    const uint cells = args.batch * args.anchors * args.height * args.width;
    float acc[YL_CELL_SLOTS] = {0.0f, 0.0f, 0.0f, 0.0f};
    for (uint c = tid; c < cells; c += YL_STATS_THREADS) {
        for (uint k = 0; k < uint(YL_CELL_SLOTS); ++k) acc[k] += partials[c * YL_CELL_SLOTS + k];
    }
    for (uint k = 0; k < uint(YL_CELL_SLOTS); ++k) shared[k * YL_STATS_THREADS + tid] = acc[k];
    for (uint half_width = YL_STATS_THREADS / 2u; half_width > 0u; half_width /= 2u) {
        threadgroup_barrier(mem_flags::mem_threadgroup);
        if (tid < half_width) {
            for (uint k = 0; k < uint(YL_CELL_SLOTS); ++k) {
                shared[k * YL_STATS_THREADS + tid] += shared[k * YL_STATS_THREADS + tid + half_width];
            }
        }
    }
    threadgroup_barrier(mem_flags::mem_threadgroup);
    if (tid != 0u) return;

    float sums[YL_IMG_SLOTS];
    for (uint k = 0; k < uint(YL_IMG_SLOTS); ++k) sums[k] = 0.0f;
    for (uint b = 0; b < args.batch; ++b) {
        for (uint k = 0; k < uint(YL_IMG_SLOTS); ++k) sums[k] = sums[k] + images[b * YL_IMG_SLOTS + k];
    }
    const float anyobj = shared[YL_CELL_OBJ * YL_STATS_THREADS];
    const float bbox = sums[YL_IMG_BBOX] + shared[YL_CELL_BBOX * YL_STATS_THREADS];
    const float box_squares = shared[YL_CELL_BOX_SQUARES * YL_STATS_THREADS];
    const float nobox_squares = shared[YL_CELL_NOBOX_SQUARES * YL_STATS_THREADS];
    const float count = max(sums[YL_IMG_COUNT], 1.0f);
    // mag_array's sqrt of the sum of squares, squared again (the cost's pow).
    float v = sqrt(box_squares + nobox_squares);
    const float total = v * v;
    v = sqrt(nobox_squares);
    const float nobox = args.obj_normalizer * (v * v);
    const float loss_sum = args.iou_loss == YL_GIOU ? sums[YL_IMG_GIOU_LOSS] : sums[YL_IMG_IOU_LOSS];
    const float batch = float(args.batch);
    stats[0] = args.iou_loss == YL_MSE ? total : args.iou_normalizer * (loss_sum / count) + nobox;
    stats[1] = sums[YL_IMG_IOU] / count;
    stats[2] = count;
    stats[3] = nobox / batch;
    stats[4] = (total - nobox) / batch;
    stats[5] = total / batch;
    stats[6] = sums[YL_IMG_OBJ] / count;
    stats[7] = anyobj / float(cells);
    stats[8] = sums[YL_IMG_CLASS_PROB] / count;
    stats[9] = sums[YL_IMG_RECALL50] / count;
    stats[10] = sums[YL_IMG_RECALL75] / count;
    stats[11] = sums[YL_IMG_COUNT];
    stats[12] = bbox;
    stats[13] = sums[YL_IMG_REWRITTEN];
    stats[14] = sums[YL_IMG_IOU];
    stats[15] = sums[YL_IMG_IOU_LOSS];
    stats[16] = sums[YL_IMG_GIOU_LOSS];
}
