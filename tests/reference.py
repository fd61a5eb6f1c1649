"""NumPy reference implementations of the layers (the tests' oracles), each written once.

Each function computes what a layer computes, from Darknet's description or source, in NumPy
and independently of the code under test: in float64 unless its name or docstring says it
replays Darknet's float32 arithmetic. Tests on every device compare against these; none of
them calls the package's kernels.
"""

from __future__ import annotations

import math

import numpy as np

from darknet_metal.fp32 import fma32

FLT_MAX = float(np.finfo(np.float32).max)


# ----------------------------------------------------------------------------------------
# activations (float64 definitions)


def _softplus(x):
    return np.logaddexp(0.0, x)


NP_ACTIVATIONS = {
    "linear": lambda x: x,
    "leaky": lambda x: np.where(x > 0, x, 0.1 * x),
    "revleaky": lambda x: np.where(x > 0, x, 0.1 * x),
    "relu": lambda x: np.maximum(x, 0.0),
    "relu6": lambda x: np.clip(x, 0.0, 6.0),
    "logistic": lambda x: 1.0 / (1.0 + np.exp(-x)),
    "loggy": lambda x: 2.0 / (1.0 + np.exp(-x)) - 1.0,
    "tanh": np.tanh,
    "elu": lambda x: np.where(x >= 0, x, np.expm1(np.minimum(x, 0.0))),
    "selu": lambda x: np.where(x >= 0, 1.0507 * x, 1.0507 * 1.6732 * np.expm1(np.minimum(x, 0))),
    "gelu": lambda x: 0.5 * x * (1.0 + np.tanh(0.797885 * x + 0.035677 * x**3)),
    "mish": lambda x: x * np.tanh(_softplus(x)),
    "swish": lambda x: x / (1.0 + np.exp(-x)),
    "hard_mish": lambda x: np.where(x > 0, x, np.where(x > -2, x * x / 2 + x, 0.0)),
    "hardtan": lambda x: np.clip(x, -1.0, 1.0),
    "lhtan": lambda x: np.where(x < 0, 0.001 * x, np.where(x > 1, 0.001 * (x - 1) + 1, x)),
    "plse": lambda x: np.where(
        x < -4, 0.01 * (x + 4), np.where(x > 4, 0.01 * (x - 4) + 1, 0.125 * x + 0.5)
    ),
    "stair": lambda x: np.where(
        np.floor(x) % 2 == 0, np.floor(x / 2), (x - np.floor(x)) + np.floor(x / 2)
    ),
    "ramp": lambda x: np.maximum(x, 0.0) + 0.1 * x,
    "relie": lambda x: np.where(x > 0, x, 0.01 * x),
}


def np_normalize_channels(name, x):
    """Darknet's normalize_channels* on (N, C, ...) in float64, eps 1e-4 in the sum."""
    if name == "normalize_channels":
        pos = np.maximum(x, 0.0)
        return pos / (1e-4 + pos.sum(axis=1, keepdims=True))
    shift = x.max(axis=1, keepdims=True) if name.endswith("maxval") else 0.0
    e = np.exp(x - shift)
    return e / (1e-4 + e.sum(axis=1, keepdims=True))


# ----------------------------------------------------------------------------------------
# [convolutional] and [connected]


def np_conv(x, w, b, size, sx, sy, pad, dilation, groups):
    """Direct convolution: zero padding of pad*dilation, taps every `dilation` pixels."""
    n, c, h, wd = x.shape
    f = w.shape[0]
    w4 = w.reshape(f, c // groups, size, size).astype(np.float64)
    p = pad * dilation
    xp = np.zeros((n, c, h + 2 * p, wd + 2 * p))
    xp[:, :, p : p + h, p : p + wd] = x
    oh = (h + 2 * p - dilation * (size - 1) - 1) // sy + 1
    ow = (wd + 2 * p - dilation * (size - 1) - 1) // sx + 1
    out = np.zeros((n, f, oh, ow))
    cg, fg = c // groups, f // groups
    for g in range(groups):
        xs = xp[:, g * cg : (g + 1) * cg]
        for ky in range(size):
            for kx in range(size):
                patch = xs[
                    :,
                    :,
                    ky * dilation : ky * dilation + sy * (oh - 1) + 1 : sy,
                    kx * dilation : kx * dilation + sx * (ow - 1) + 1 : sx,
                ]
                out[:, g * fg : (g + 1) * fg] += np.einsum(
                    "fc,nchw->nfhw", w4[g * fg : (g + 1) * fg, :, ky, kx], patch
                )
    return out + b.reshape(1, f, 1, 1)


def np_conv_grads(x, wt, delta, size, sx, sy, pad, dilation, groups):
    """The weight and input gradients of sum(conv(x, wt) * delta), by shifted slices."""
    n, c, h, w = x.shape
    f = wt.shape[0]
    cg, fg = c // groups, f // groups
    oh, ow = delta.shape[2:]
    p = pad * dilation
    xp = np.zeros((n, c, h + 2 * p + size * dilation, w + 2 * p + size * dilation))
    xp[:, :, p:p + h, p:p + w] = x
    gp = np.zeros_like(xp)
    w4 = wt.astype(np.float64).reshape(f, cg, size, size)
    wgrad = np.zeros_like(w4)
    for g in range(groups):
        dg = delta[:, g * fg:(g + 1) * fg].astype(np.float64)
        chans = slice(g * cg, (g + 1) * cg)
        for ky in range(size):
            for kx in range(size):
                rows = slice(ky * dilation, ky * dilation + sy * (oh - 1) + 1, sy)
                cols = slice(kx * dilation, kx * dilation + sx * (ow - 1) + 1, sx)
                wgrad[g * fg:(g + 1) * fg, :, ky, kx] = np.einsum(
                    "nfhw,nchw->fc", dg, xp[:, chans, rows, cols])
                gp[:, chans, rows, cols] += np.einsum(
                    "nfhw,fc->nchw", dg, w4[g * fg:(g + 1) * fg, :, ky, kx])
    return wgrad.reshape(f, -1), gp[:, :, p:p + h, p:p + w]


# ----------------------------------------------------------------------------------------
# [batchnorm] in training mode


def axes_of(x):
    return (0, 2, 3) if x.ndim == 4 else (0,)


def per_channel(v, x):
    return v.reshape((1, -1, 1, 1) if x.ndim == 4 else (1, -1))


def np_batchnorm_forward(x, scale, bias, eps):
    """Darknet's forward_batchnorm_layer in training mode, in float64."""
    x = x.astype(np.float64)
    axes = axes_of(x)
    n = x.size // x.shape[1]
    mean = x.mean(axis=axes)
    var = ((x - per_channel(mean, x)) ** 2).sum(axis=axes) / (n - 1)
    x_norm = (x - per_channel(mean, x)) / np.sqrt(per_channel(var, x) + eps)
    return mean, var, x_norm, x_norm * per_channel(scale, x) + per_channel(bias, x)


def np_batchnorm_backward(delta, x, mean, var, x_norm, scale, eps):
    """Darknet's CPU backward_batchnorm_layer (and the golden build's bias gradient), in
    float64: returns (delta with respect to x, scale gradient, bias gradient). The first
    term's eps sits outside the root and the variance term divides by N, not N - 1, so
    this is not quite the derivative of np_batchnorm_forward (test_cpu_batchnorm's
    test_darknet_formulas_*)."""
    delta, x = delta.astype(np.float64), x.astype(np.float64)
    axes = axes_of(x)
    n = x.size // x.shape[1]
    bias_grad = delta.sum(axis=axes)
    scale_grad = (delta * x_norm).sum(axis=axes)
    d = delta * per_channel(scale, x)
    centred = x - per_channel(mean, x)
    mean_delta = d.sum(axis=axes) * (-1 / np.sqrt(var + eps))
    var_delta = (d * centred).sum(axis=axes) * -0.5 * (var + eps) ** -1.5
    d = (d / (np.sqrt(per_channel(var, x)) + eps) + per_channel(var_delta, x) * 2 * centred / n
         + per_channel(mean_delta, x) / n)
    return d, scale_grad, bias_grad


# ----------------------------------------------------------------------------------------
# [maxpool]


def _c_trunc_div(a, b):
    return int(a / b)


def _windows(x, size, sx, sy, padding, fill):
    """All pooling windows (N, C, out_h, out_w, size, size), outside positions = fill."""
    n, c, h, w = x.shape
    oh = _c_trunc_div(h + padding - size, sy) + 1
    ow = _c_trunc_div(w + padding - size, sx) + 1
    off = padding // 2
    pad_b = max(0, (oh - 1) * sy + size - off - h)
    pad_r = max(0, (ow - 1) * sx + size - off - w)
    xp = np.pad(
        x.astype(np.float64),
        ((0, 0), (0, 0), (off, pad_b), (off, pad_r)),
        constant_values=fill,
    )
    win = np.lib.stride_tricks.sliding_window_view(xp, (size, size), axis=(2, 3))
    return win[:, :, ::sy, ::sx][:, :, :oh, :ow]


def np_maxpool(x, size, sx, sy, padding):
    out = _windows(x, size, sx, sy, padding, -np.inf).max(axis=(-2, -1))
    return np.where(np.isneginf(out), -FLT_MAX, out)  # Darknet starts from -FLT_MAX


# ----------------------------------------------------------------------------------------
# [reorg], [reorg3d], [upsample]


def np_reorg_old(x, s):
    """[reorg] as OpenCV's Reorg layer computes it: a permute of a reshaped view."""
    n, c, h, w = x.shape
    v = x.reshape(n, c * h // (s * s), s, w, s).transpose(0, 2, 4, 1, 3)
    return v.reshape(n, c * s * s, h // s, w // s)


def np_space_to_depth(x, s):
    n, c, h, w = x.shape
    v = x.reshape(n, c, h // s, s, w // s, s).transpose(0, 3, 5, 1, 2, 4)
    return v.reshape(n, s * s * c, h // s, w // s)


def np_depth_to_space(x, s):
    n, c, h, w = x.shape
    v = x.reshape(n, s, s, c // (s * s), h, w).transpose(0, 3, 4, 1, 5, 2)
    return v.reshape(n, c // (s * s), h * s, w * s)


def np_reorg_cpu(x, w, h, c, s, forward):
    """Darknet's reorg_cpu (blas.cpp) on flat buffers, written out with NumPy indices."""
    n = x.size // (w * h * c)
    b, k, j, i = np.indices((n, c, h, w))
    in_c = c // (s * s)
    c2, offset = k % in_c, k // in_c
    small = i + w * (j + h * (k + c * b))
    large = (i * s + offset % s) + w * s * ((j * s + offset // s) + h * s * (c2 + in_c * b))
    flat, out = x.ravel(), np.empty(x.size, x.dtype)
    if forward:
        out[large] = flat[small]
    else:
        out[small] = flat[large]
    return out


def np_upsample_reverse(x, s, scale):
    """[upsample] with a negative stride -s: each s x s block summed, times scale."""
    n, c, h, w = x.shape
    return (x.astype(np.float64) * scale).reshape(n, c, h // s, s, w // s, s).sum(axis=(3, 5))


# ----------------------------------------------------------------------------------------
# [shortcut]


def np_shortcut(x, sources, weights, wtype, norm):
    c = x.shape[1]
    k = len(sources) + 1
    if wtype == "none":
        wt = np.ones((k, c))
    elif wtype == "per_feature":
        wt = np.repeat(np.asarray(weights, np.float64).reshape(k, 1), c, axis=1)
    else:
        wt = np.asarray(weights, np.float64).reshape(k, c)
    if norm == "relu":
        r = np.maximum(wt, 0.0)
        wt = r / (1e-4 + r.sum(axis=0))
    elif norm == "softmax":
        e = np.exp(wt - wt.max(axis=0))
        wt = e / (1e-4 + e.sum(axis=0))
    out = x.astype(np.float64) * wt[0][None, :, None, None]
    for i, s in enumerate(sources):
        m = min(c, s.shape[1])
        out[:, :m] += s[:, :m].astype(np.float64) * wt[i + 1][None, :m, None, None]
    return out


def np_shortcut_darknet_f32(x, sources, weights, wtype, norm):
    """shortcut_multilayer_cpu's float32 operations one by one (relu or no normalisation)."""
    f = np.float32
    c = x.shape[1]
    k = len(sources) + 1
    w = np.asarray(weights, f).reshape(k, -1) if wtype != "none" else None
    table = np.empty((k, c), f)
    for ch in range(c):
        col = w[:, ch if wtype == "per_channel" else 0] if w is not None else np.ones(k, f)
        if norm == "relu":
            total = f(0.0001)
            for v in col:
                total = f(total + max(v, f(0)))
            table[:, ch] = [f(max(v, f(0)) / total) for v in col]
        else:
            table[:, ch] = col
    out = (x * table[0][None, :, None, None]).astype(f) if w is not None else x.copy()
    for i, s in enumerate(sources):
        m = min(c, s.shape[1])
        add = s[:, :m] * table[i + 1][None, :m, None, None] if w is not None else s[:, :m]
        out[:, :m] = out[:, :m] + add.astype(f)
    return out


# ----------------------------------------------------------------------------------------
# [softmax], [yolo]


def np_softmax(x, groups, temperature):
    n = x.shape[0]
    v = x.astype(np.float64).reshape(n, groups, -1) / temperature
    e = np.exp(v - v.max(axis=2, keepdims=True))
    return (e / e.sum(axis=2, keepdims=True)).reshape(x.shape)


def np_yolo(x, n, classes, scale_x_y, new_coords):
    v = x.astype(np.float64).reshape(x.shape[0], n, 5 + classes, *x.shape[2:]).copy()
    if not new_coords:
        for ch in [0, 1, *range(4, 5 + classes)]:
            v[:, :, ch] = 1.0 / (1.0 + np.exp(-v[:, :, ch]))
    v[:, :, :2] = v[:, :, :2] * scale_x_y - 0.5 * (scale_x_y - 1)
    return v.reshape(x.shape)


# ----------------------------------------------------------------------------------------
# the [yolo] training loss
#
# The loss's description (Darknet V5) for one mini-batch, in float64. The IoU-family box
# gradients are central differences of the function Darknet differentiates (the IoU with the
# overlap's width and height not clamped at 0; for GIoU the IoU plus U/C, or U/C alone when
# the boxes do not overlap), so the oracle shares no derivative formula with the kernel.


def _edges(box):
    """(top, bottom, left, right) of (x, y, w, h)."""
    x, y, w, h = box
    return np.array([y - h / 2, y + h / 2, x - w / 2, x + w / 2])


def _iou(a, b):
    """IoU of boxes (x, y, w, h), broadcasting over leading axes of stacked (4, ...) arrays."""
    at, ab, al, ar = _edges(a)
    bt, bb, bl, br = _edges(b)
    iw = np.minimum(ar, br) - np.maximum(al, bl)
    ih = np.minimum(ab, bb) - np.maximum(at, bt)
    inter = np.where((iw > 0) & (ih > 0), iw * ih, 0.0)
    union = a[2] * a[3] + b[2] * b[3] - inter
    with np.errstate(invalid="ignore", divide="ignore"):
        return np.where(inter > 0, inter / union, 0.0)


def _enclosure(a, b):
    at, ab, al, ar = _edges(a)
    bt, bb, bl, br = _edges(b)
    return np.maximum(ar, br) - np.minimum(al, bl), np.maximum(ab, bb) - np.minimum(at, bt)


def _giou(a, b):
    cw, ch = _enclosure(a, b)
    c = cw * ch
    iou = _iou(a, b)
    if c == 0:
        return iou
    return iou - (c - (a[2] * a[3] + b[2] * b[3] - _intersection(a, b))) / c


def _intersection(a, b):
    at, ab, al, ar = _edges(a)
    bt, bb, bl, br = _edges(b)
    iw = min(ar, br) - max(al, bl)
    ih = min(ab, bb) - max(at, bt)
    return iw * ih if iw > 0 and ih > 0 else 0.0


def _iou_of_kind(a, b, kind):
    """Darknet's box_iou_kind; DIoU's distance term has its exponent 0.6."""
    iou = float(_iou(a, b))
    if kind in ("iou", "mse"):
        return iou
    if kind == "giou":
        return float(_giou(a, b))
    cw, ch = _enclosure(a, b)
    c = cw * cw + ch * ch
    if c == 0:
        return iou
    d = ((a[0] - b[0]) ** 2 + (a[1] - b[1]) ** 2) / c
    if kind == "diou":
        return iou - d ** 0.6
    v = 4 / math.pi ** 2 * (math.atan(b[2] / b[3]) - math.atan(a[2] / a[3])) ** 2
    return iou - (d + v / (1 - iou + v + 1e-6) * v)


def _objective(edges, truth, kind):
    """The function of the prediction's edges (t, b, l, r) whose gradient Darknet uses."""
    top, bottom, left, right = edges
    tt, tb, tl, tr = _edges(truth)
    iw = min(right, tr) - max(left, tl)
    ih = min(bottom, tb) - max(top, tt)
    inter = iw * ih
    union = (bottom - top) * (right - left) + truth[2] * truth[3] - inter
    iou = inter / union if union > 0 else 0.0
    if kind != "giou":
        return iou
    c = (max(right, tr) - min(left, tl)) * (max(bottom, tb) - min(top, tt))
    return union / c if iw <= 0 or ih <= 0 else iou + union / c


def _iou_gradient(pred, truth, kind, step=1e-6):
    """(dx, dy, dw, dh) as Darknet combines the edge gradients: dw = d/dr - d/dl (not
    halved), by central differences."""
    edges = _edges(pred)
    grad = np.zeros(4)
    for k in range(4):
        up, down = edges.copy(), edges.copy()
        up[k] += step
        down[k] -= step
        grad[k] = (_objective(up, truth, kind) - _objective(down, truth, kind)) / (2 * step)
    g_t, g_b, g_l, g_r = grad
    return np.array([g_l + g_r, g_t + g_b, g_r - g_l, g_b - g_t])


class NpYoloLoss:
    """Darknet's [yolo] loss for one mini-batch, in float64, from the loss's description."""

    def __init__(self, output, truths, *, anchors, mask, classes, net_w, net_h,
                 ignore_thresh=0.5, truth_thresh=1.0, iou_thresh=1.0, iou_thresh_kind="iou",
                 iou_loss="mse", iou_normalizer=0.75, obj_normalizer=1.0, cls_normalizer=1.0,
                 max_delta=FLT_MAX, label_smooth_eps=0.0, counters_per_class=None,
                 new_coords=False, focal_loss=False, objectness_smooth=False, max_boxes=200):
        self.__dict__.update(locals())
        del self.__dict__["self"]
        n, e = len(mask), 5 + classes
        self.N, _, self.H, self.W = output.shape
        self.out = output.astype(np.float64).reshape(self.N, n, e, self.H, self.W)
        self.anchors = np.asarray(anchors, np.float64).reshape(-1, 2)
        self.delta = np.zeros_like(self.out)
        if counters_per_class is None:
            self.mult = None
        else:
            counts = np.maximum(np.asarray(counters_per_class, np.float64), 1)
            self.mult = np.minimum(counts.max() / counts, max_delta)
        self.sums = dict(iou=0.0, iou_loss=0.0, giou_loss=0.0, count=0, obj=0.0, prob=0.0,
                         r50=0, r75=0, bbox=0, rewritten=0)
        for b in range(self.N):
            self._image(b, [row for row in truths[b] if row[3] > 0 and row[4] > 0])

    def _weight(self, cls):
        return 1.0 if self.mult is None else self.mult[cls]

    def _pred(self, b, a, anchor, j, i):
        o = self.out[b, a, :4, j, i]
        aw, ah = self.anchors[anchor]
        if self.new_coords:
            w, h = o[2] ** 2 * 4 * aw / self.net_w, o[3] ** 2 * 4 * ah / self.net_h
        else:
            w, h = np.exp(o[2]) * aw / self.net_w, np.exp(o[3]) * ah / self.net_h
        return np.array([(i + o[0]) / self.W, (j + o[1]) / self.H, w, h])

    def _box(self, b, a, anchor, j, i, truth, weight):
        """Adds the box delta; returns (IoU, GIoU) of the prediction."""
        d = self.delta[b, a, :4, j, i]
        self.sums["rewritten"] += bool(np.any(d != 0))
        self.sums["bbox"] += 1
        pred = self._pred(b, a, anchor, j, i)
        ious = float(_iou(pred, truth)), float(_giou(pred, truth))
        o = self.out[b, a, :4, j, i]
        aw, ah = self.anchors[anchor]
        if self.iou_loss == "mse":
            if self.new_coords:
                tw = math.sqrt(truth[2] * self.net_w / (4 * aw))
                th = math.sqrt(truth[3] * self.net_h / (4 * ah))
            else:
                tw, th = math.log(truth[2] * self.net_w / aw), math.log(truth[3] * self.net_h / ah)
            target = np.array([truth[0] * self.W - i, truth[1] * self.H - j, tw, th])
            d += (2 - truth[2] * truth[3]) * self.iou_normalizer * weight * (target - o)
            return ious
        grad = _iou_gradient(pred, truth, self.iou_loss)
        if not self.new_coords:
            grad[2:] *= np.exp(o[2:4])
        grad *= self.iou_normalizer * weight
        grad[~np.isfinite(grad)] = 0
        if self.max_delta < FLT_MAX:
            grad = np.clip(grad, -self.max_delta, self.max_delta)
        d += grad
        return ious

    def _classes(self, b, a, j, i, cls):
        p = self.out[b, a, 5:, j, i]
        d = self.delta[b, a, 5:, j, i]
        eps = self.label_smooth_eps
        if d[cls] != 0:
            d[cls] = (1 - eps) + 0.5 * eps - p[cls]
            d[cls] *= self._weight(cls)
            return
        target = np.where(np.arange(self.classes) == cls, 1.0, 0.0) * (1 - eps) + 0.5 * eps
        if self.focal_loss:
            pt = p[cls]
            target = np.arange(self.classes) == cls
            d[:] = (target - p) * 0.5 * (-(1 - pt) * (2 * pt * math.log(pt) + pt - 1))
            return
        d[:] = target - p
        if self.mult is not None:
            d[cls] *= self.mult[cls] * self.cls_normalizer

    def _responsible(self, b, a, anchor, j, i, row):
        cls, truth = int(row[0]), row[1:]
        weight = self._weight(cls)
        iou, giou = self._box(b, a, anchor, j, i, truth, weight)
        obj = self.out[b, a, 4, j, i]
        if not self.objectness_smooth or self.delta[b, a, 4, j, i] == 0:
            self.delta[b, a, 4, j, i] = weight * self.obj_normalizer * (1 - obj)
        s = self.sums
        s["iou"] += iou
        s["iou_loss"] += 1 - iou
        s["giou_loss"] += 1 - giou
        s["count"] += 1
        s["obj"] += obj
        s["prob"] += self.out[b, a, 5 + cls, j, i]
        s["r50"] += iou > 0.5
        s["r75"] += iou > 0.75
        self._classes(b, a, j, i, cls)

    def _image(self, b, rows):
        n = len(self.mask)
        for j in range(self.H):
            for i in range(self.W):
                for a in range(n):
                    pred = self._pred(b, a, self.mask[a], j, i)
                    ious = [float(_iou(pred, row[1:])) for row in rows] or [0.0]
                    best_t = int(np.argmax(ious))
                    best = ious[best_t]
                    obj = self.out[b, a, 4, j, i]
                    self.delta[b, a, 4, j, i] = self.obj_normalizer * -obj
                    if best > self.ignore_thresh and (self.out[b, a, 5:, j, i] > 0.25).any():
                        self.delta[b, a, 4, j, i] = (
                            max(-obj * self.obj_normalizer, (best - obj) * self.obj_normalizer)
                            if self.objectness_smooth else 0.0)
                    if best > self.truth_thresh:
                        self._truth_thresh(b, a, j, i, rows[best_t], best)
        for row in rows:
            i, j = min(int(row[1] * self.W), self.W - 1), min(int(row[2] * self.H), self.H - 1)
            shape = np.array([0, 0, row[3], row[4]])
            shapes = [np.array([0, 0, w / self.net_w, h / self.net_h]) for w, h in self.anchors]
            best_n = int(np.argmax([float(_iou(s, shape)) for s in shapes]))
            if best_n in self.mask:
                self._responsible(b, self.mask.index(best_n), best_n, j, i, row)
            if self.iou_thresh < 1:
                for k, s in enumerate(shapes):
                    if k != best_n and k in self.mask and _iou_of_kind(
                            s, shape, self.iou_thresh_kind) > self.iou_thresh:
                        self._responsible(b, self.mask.index(k), k, j, i, row)
        if self.iou_thresh < 1:
            d = self.delta[b]
            positives = (d[:, 5:] > 0).sum(axis=1)
            share = (d[:, 4] != 0) & (positives > 0)
            d[:, :4] = np.where(share[:, None], d[:, :4] / np.maximum(positives, 1)[:, None],
                                d[:, :4])

    def _truth_thresh(self, b, a, j, i, row, best):
        cls = int(row[0])
        obj = self.out[b, a, 4, j, i]
        target = best * best if self.objectness_smooth else 1.0
        self.delta[b, a, 4, j, i] = self.obj_normalizer * (target - obj)
        self._classes(b, a, j, i, cls)
        weight = self._weight(cls)
        if self.objectness_smooth:
            self.delta[b, a, 5 + cls, j, i] = weight * (target - self.out[b, a, 5 + cls, j, i])
        self._box(b, a, self.mask[a], j, i, row[1:], weight)

    def stats(self):
        s = self.sums
        count = max(s["count"], 1)
        total = float((self.delta ** 2).sum())
        nobox = self.obj_normalizer * float((self.delta[:, :, 4:] ** 2).sum())
        iou_term = s["giou_loss"] if self.iou_loss == "giou" else s["iou_loss"]
        cost = total if self.iou_loss == "mse" else self.iou_normalizer * iou_term / count + nobox
        return {
            "cost": cost, "avg_iou": s["iou"] / count, "count": count,
            "class_loss_per_image": nobox / self.N,
            "iou_loss_per_image": (total - nobox) / self.N,
            "total_loss_per_image": total / self.N, "avg_obj": s["obj"] / count,
            "avg_noobj": float(self.out[:, :, 4].mean()), "avg_class_prob": s["prob"] / count,
            "recall50": s["r50"] / count, "recall75": s["r75"] / count,
            "responsible": s["count"], "total_bbox": s["bbox"],
            "rewritten_bbox": s["rewritten"], "iou_sum": s["iou"],
            "iou_loss_sum": s["iou_loss"], "giou_loss_sum": s["giou_loss"],
        }

    def delta_array(self):
        return self.delta.reshape(self.N, -1, self.H, self.W)


# ----------------------------------------------------------------------------------------
# parameter updates (SGD, Adam)


def np_sgd_update(w, wu, lr, decay, momentum, batch, apply_decay, lr_scale=1.0):
    """The kernel's arithmetic in NumPy: coefficients in the dtype, one rounding per axpy."""
    t = w.dtype.type
    rate = t(t(lr) * t(lr_scale)) / t(batch)
    if w.dtype == np.float32:
        axpy = fma32
    else:
        def axpy(a, x, y):
            return a * x + y
    g = axpy(-t(decay) * t(batch), w, wu) if apply_decay else wu
    return axpy(rate, g, w).astype(w.dtype), (t(momentum) * g).astype(w.dtype)


def np_adam_update(w, wu, m, v, lr, t, decay, b1, b2, eps, batch):
    d = wu - decay * batch * w
    m = b1 * m + (1 - b1) * d
    v = b2 * v + (1 - b2) * d * d
    w = w + lr * (m / (1 - b1**t)) / (np.sqrt(v / (1 - b2**t)) + eps)
    return w, m, v
