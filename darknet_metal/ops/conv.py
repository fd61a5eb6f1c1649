"""[convolutional] and [connected]: a GEMM with bias and activation, forward and backward.

Batch normalisation (``ops.batchnorm``) is folded into the weights and biases at inference and
runs unfolded in training. The weight, bias and input gradients are GEMMs too (col2im after
the input gradient of a convolution). On the CPU, 3x3 stride-1 convolutions from
``WINOGRAD_MIN_CHANNELS`` input channels use Winograd (F(4x4, 3x3) from ``WINOGRAD4_MIN_SIZE``
output rows and columns, else F(2x2, 3x3)); thin 3x3 inputs a direct loop (``cpu.conv``);
the other float32 convolutions of one group ``cpu.packed_conv``'s product with weights
packed once (after im2col, except for plain 1x1 convolutions); the rest (float64, groups)
im2col + BLAS. On a device: im2col (skipped
for 1x1 stride-1 unpadded convolutions, whose input already is the column matrix) and one
batched, grouped GEMM with the bias and elementwise activation in its epilogue (a product
with too few output tiles to fill a GPU split along K, its epilogue a pass of its own).
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import TYPE_CHECKING, Any

import numpy as np

from darknet_metal.cpu import batchnorm as cpu_batchnorm
from darknet_metal.cpu import conv as cpu_conv
from darknet_metal.cpu import packed_conv, winograd
from darknet_metal.cpu.step import NativeStep
from darknet_metal.metal.dispatch import (
    BIAS_COLS,
    BIAS_NONE,
    BIAS_ROWS,
    GEMM_TILE,
    gemm_args,
    gemm_kernel,
)
from darknet_metal.model.cfg import Section
from darknet_metal.ops.activation import (
    LINEAR,
    activation_input,
    activation_steps_after,
    emit_activation_after,
    emit_cpu_activation_gradient,
    emit_cpu_activation_train,
    emit_device_activation_gradient,
    emit_device_activation_train,
    fused_activation,
)
from darknet_metal.ops.base import Op, Params, Shape, as_rows, positive
from darknet_metal.ops.batchnorm import (
    BATCHNORM_PARAMS,
    emit_batchnorm_train,
    emit_bias_gradient,
    emit_device_batchnorm_train,
    emit_device_bias_gradient,
    fold_batchnorm,
)
from darknet_metal.ops.key_dispositions import INFERENCE_ONLY
from darknet_metal.runtime.program import LayerEmitter, Param, Tensor

if TYPE_CHECKING:
    from darknet_metal.export.graph import OnnxGraph
    from darknet_metal.runtime.train_state import LayerTrainState

#: Input channels from which Winograd beats im2col + GEMM for a 3x3 convolution on the CPU:
#: below it the 16 transformed GEMMs are too thin to pay for the transforms.
WINOGRAD_MIN_CHANNELS = 32

#: Least output height and width at which the CPU uses Winograd F(4x4, 3x3) rather than
#: F(2x2, 3x3). Measured per layer on yolov4-tiny (AMD EPYC, 2 threads): at 104x104 and 52x52
#: F(4x4) took 10-35% less time; at 26x26 (49 tiles, so 36 GEMMs 49 columns wide) it was
#: 0-8% slower, and at 13x13 its tiles would cover 16x16.
WINOGRAD4_MIN_SIZE = 48


#: A weight gradient's GEMM covers several images and is split along K when it has fewer
#: output tiles than this (enough threadgroups to fill a GPU), into runs of at least
#: WEIGHT_GRADIENT_RUN output pixels (a threadgroup's K loop long enough to be worth its
#: launch, and few slices for the sum that adds them).
WEIGHT_GRADIENT_TILES = 2048
WEIGHT_GRADIENT_RUN = 256

#: A forward GEMM with fewer output tiles than this (all its images counted) leaves a large
#: GPU's multiprocessors idle (an H200 has 132, each holding several threadgroups; a late
#: layer at batch 1 has a few dozen tiles with thousands of K each): its K is cut into runs of
#: at least FORWARD_SPLIT_RUN, each run's product goes to a slot of its own, and
#: ``gemm_splits_fwd_f32`` adds the slots before the bias and the activation.
FORWARD_SPLIT_TILES = 512
FORWARD_SPLIT_RUN = 256

#: The GEMM kernels' K step: a split's run is a multiple of it (no half-empty K tile).
GEMM_K_STEP = 16

#: The most im2col columns one GEMM's images may take (one image's always fit): a late layer's
#: images then share a dispatch.
IMAGES_WORKSPACE_BYTES = 256 << 20


def _gemm_step(
    e: LayerEmitter, name: str, buffers: Mapping[str, Tensor | Param | None],
    offsets: Mapping[str, int] | None = None, **fields: int | float,
) -> None:
    """Emits a GEMM kernel step (``buffers``: a, b, bias, c; ``offsets``: elements into
    them where the operands start) with ``gemm_args(**fields)``."""
    args, sizes = gemm_args(**fields)
    e.kernel(name, buffers, sizes, offsets=offsets, **args)


def weight_gradient_splits(filters: int, rows: int, pixels: int, copies: int) -> tuple[int, int]:
    """(splits, run) of the weight gradient ``filters`` x ``rows`` summed over ``pixels``, of
    which a dispatch computes ``copies`` (groups times images) side by side: K cut into
    ``splits`` runs of ``run`` pixels (the last may be shorter), so that the tiled GEMM's
    output tiles times the copies and splits fill a GPU; (1, pixels) when it needs no split."""
    splits = min(-(-pixels // WEIGHT_GRADIENT_RUN),
                 -(-WEIGHT_GRADIENT_TILES // (gemm_tiles(filters, rows) * copies)))
    if splits < 2:
        return 1, pixels
    run = -(-pixels // splits)
    return -(-pixels // run), run


def forward_splits(tiles: int, k: int) -> tuple[int, int]:
    """(splits, run) of a forward GEMM of ``tiles`` output tiles summing over ``k``: K cut
    into ``splits`` runs of ``run`` (a multiple of GEMM_K_STEP, at least FORWARD_SPLIT_RUN;
    the last may be shorter) so that tiles times splits reach FORWARD_SPLIT_TILES; (1, k)
    when the product needs no split."""
    splits = min(k // FORWARD_SPLIT_RUN, -(-FORWARD_SPLIT_TILES // tiles))
    if splits < 2:
        return 1, k
    steps = -(-k // GEMM_K_STEP)
    run = -(-steps // splits) * GEMM_K_STEP
    return -(-k // run), run


def gemm_tiles(rows: int, columns: int) -> int:
    """Threadgroups of the tiled GEMM for one ``rows`` x ``columns`` product."""
    tile_m, tile_n = GEMM_TILE
    return -(-rows // tile_m) * -(-columns // tile_n)


class _Gemm(Op):
    """What convolutional and connected layers share: parameters and their folding."""

    statistics = ("rolling_mean", "rolling_variance")

    def init_params(self, rng: np.random.Generator) -> Params:
        # Darknet: weights ~ U(-s, s), s = sqrt(2 / fan_in); biases 0; BN scales 1, rolling
        # mean 0, rolling variance 1. Drawn in .weights order so seeds reproduce.
        layer: Params = {}
        for name, shape in self.param_shapes.items():
            if name == "weights":
                scale = np.sqrt(2.0 / shape[1])
                layer[name] = (scale * rng.uniform(-1.0, 1.0, shape)).astype(np.float32)
            elif name in ("scales", "rolling_variance"):
                layer[name] = np.ones(shape, np.float32)
            else:
                layer[name] = np.zeros(shape, np.float32)
        return layer

    def device_params(self, params: Params | None) -> dict[str, np.ndarray | int]:
        w, b = fold_batchnorm(params)
        return {"weights": w.astype(np.float32), "biases": b.astype(np.float32)}

    #: Darknet's rolling-average momentum of this kind's batch norm.
    batchnorm_momentum: float

    def _emit_gemm(self, e: LayerEmitter, weights: Param, bias: Param | None, out: Tensor,
                   act: int) -> None:
        """out = act(the layer's product of ``weights`` and its input (+ ``bias``))."""
        raise NotImplementedError

    def _emit_gemm_backward(self, e: LayerEmitter, ts: LayerTrainState) -> None:
        """The weight gradient and the input's delta from ``e.delta``."""
        raise NotImplementedError

    def emit_device_forward(self, e: LayerEmitter) -> None:
        self._emit_gemm(e, Param(self.index, "weights"), Param(self.index, "biases"),
                        e.output, fused_activation(self.activation))
        emit_activation_after(e, self.activation, fused=True)

    def emit_device_train(self, e: LayerEmitter, ts: LayerTrainState) -> None:
        # As emit_cpu_train: the product (no bias with batch norm), batch norm on the
        # mini-batch statistics, then the activation, each result kept for the backward.
        act = self.activation
        pre = activation_input(e, act)
        if "scales" not in ts.values:
            self._emit_gemm(e, ts.ref("weights"), ts.ref("biases"), pre, LINEAR)
        else:
            raw = e.tensor("raw", e.shape(e.output))
            self._emit_gemm(e, ts.ref("weights"), None, raw, LINEAR)
            # An element-wise activation differentiated from its output rides on the
            # normalisation: one pass over the output less.
            fused = fused_activation(act) if pre == e.output else LINEAR
            emit_device_batchnorm_train(e, ts, raw, pre, self.batchnorm_momentum, act=fused)
            if fused != LINEAR:
                return
        emit_device_activation_train(e, act, pre)

    def emit_device_backward(self, e: LayerEmitter, ts: LayerTrainState) -> None:
        emit_device_activation_gradient(e, self.activation,
                                        Tensor(self.index, "activation_input"))
        emit_device_bias_gradient(e, ts)
        self._emit_gemm_backward(e, ts)


class ConvolutionalOp(_Gemm):
    kind = "convolutional"
    short_name = "conv"
    batchnorm_momentum = cpu_batchnorm.MOMENTUM_CONV
    training_keys = {
        "batch_normalize": "cross-mini-batch batch norm (batch_normalize=2) is not supported",
        "cbn": "cross-mini-batch batch norm (batch_normalize=2) is not supported",
        "grad_centr": "gradient centralization (Darknet's CUDA build only) is not supported",
        **dict.fromkeys(("reverse", "flipped", "dot", "assisted_excitation", "coordconv"),
                        "this convolution variant is not supported in training"),
        "stream": INFERENCE_ONLY, "wait_stream": INFERENCE_ONLY,
    }

    @classmethod
    def build(cls, s: Section, shape: Shape, shapes: list[Shape]) -> Op:
        v = s.values
        c, h, w = shape
        n, size, groups = v["filters"], v["size"], v["groups"]
        pad, dilation = v["padding"], v["dilation"]
        sx, sy = v["stride_x"], v["stride_y"]
        for key in ("binary", "xnor", "antialiasing", "sway", "rotate", "stretch",
                    "stretch_sway", "assisted_excitation"):
            if v.get(key):
                raise s.error(f"'{key}' convolutions are not supported", key)
        if v.get("share_index") is not None:
            raise s.error("'share_index' (weights shared between layers) is not supported",
                          "share_index")
        if c % groups or n % groups:
            raise s.error(f"groups={groups} must divide the input channels ({c}) and filters "
                          f"({n})", "groups")
        out_h = (h + 2 * pad - size) // sy + 1
        out_w = (w + 2 * pad - size) // sx + 1
        if dilation > 1:
            # Darknet sizes the output without the dilation but samples with it; only the
            # combinations where both agree are well defined.
            true_h = (h + 2 * pad * dilation - dilation * (size - 1) - 1) // sy + 1
            true_w = (w + 2 * pad * dilation - dilation * (size - 1) - 1) // sx + 1
            if (true_h, true_w) != (out_h, out_w):
                raise s.error(
                    f"dilation={dilation} with size={size} pad={pad} gives {true_h}x{true_w} "
                    f"samples but Darknet allocates {out_h}x{out_w}; use pad=1 with an odd size",
                    "dilation",
                )
        out = positive(s, (n, out_h, out_w), f"size={size} stride=({sx},{sy}) padding={pad}")
        params = {"biases": (n,)}
        if v["batch_normalize"]:
            params.update({name: (n,) for name in BATCHNORM_PARAMS})
        params["weights"] = (n, c // groups * size * size)
        flops = 2 * n * (c // groups) * size * size * out_h * out_w
        return cls(s, [s.index - 1], shape, out, params, flops)

    def stored_params(self, *, reading: bool = True) -> list[tuple[str, tuple[int, ...]]]:
        # dontloadscales=1: Darknet reads no batch-norm arrays (but always writes them).
        skip = BATCHNORM_PARAMS if reading and self.values.get("dontloadscales") else ()
        return [(n, s) for n, s in self.param_shapes.items() if n not in skip]

    # -- CPU -------------------------------------------------------------------------------

    @property
    def uses_winograd(self) -> bool:
        """Whether the CPU runs this convolution with Winograd F(2x2, 3x3)."""
        v = self.values
        return (
            v["size"] == 3
            and v["stride_x"] == 1
            and v["stride_y"] == 1
            and v["padding"] == 1
            and v["dilation"] == 1
            and v["groups"] == 1
            and self.in_shape[0] >= WINOGRAD_MIN_CHANNELS
        )

    @property
    def winograd_tile(self) -> int:
        """The output tile m of the CPU's Winograd F(m x m, 3x3) for this convolution."""
        return 4 if min(self.out_shape[1:]) >= WINOGRAD4_MIN_SIZE else 2

    def uses_packed(self, dtype: np.dtype) -> bool:
        """Whether the CPU runs this convolution in ``dtype`` as ``cpu.packed_conv``'s product
        with packed weights: float32, one group, neither Winograd nor the direct 3x3 loop."""
        v = self.values
        return (
            np.dtype(dtype) == np.float32
            and v["groups"] == 1
            and not self.uses_winograd
            and not self._direct_workspace()
        )

    def _direct_workspace(self) -> int:
        v = self.values
        return cpu_conv.direct_workspace_size(
            self.in_shape[0], self.out_shape[0], self.in_shape[1], self.in_shape[2], v["size"],
            v["stride_x"], v["stride_y"], v["padding"], v["dilation"], v["groups"])

    def prepare_cpu(self, params: Params | None, dtype: np.dtype) -> Any:
        w, b = fold_batchnorm(params)
        w = np.ascontiguousarray(w, dtype)
        if self.uses_winograd:
            w = winograd.transform_filters(w, self.in_shape[0], self.winograd_tile)
        elif self.uses_packed(dtype):
            w = packed_conv.pack_weights(w)
        return w, np.ascontiguousarray(b, dtype)

    def cpu_workspace(self, batch: int) -> int:
        if self.uses_winograd:
            return winograd.workspace_size(self.in_shape[0], self.out_shape[0],
                                           *self.out_shape[1:], self.winograd_tile)
        return max(self._im2col_workspace(), self._direct_workspace())

    def _im2col_workspace(self) -> int:
        """Elements of im2col columns the convolution unfolds (0 for a plain 1x1, which
        multiplies its input planes as they are)."""
        v = self.values
        if (v["size"], v["stride_x"], v["stride_y"], v["padding"]) == (1, 1, 1, 0):
            return 0
        return cpu_conv.workspace_size(self.in_shape[0], v["size"], v["groups"],
                                       self.out_shape[1], self.out_shape[2])

    def cpu_steps(self, state: Any, sources: list[np.ndarray], out: np.ndarray,
                  workspace: np.ndarray | None) -> list[NativeStep]:
        w, b = state
        v = self.values
        act = fused_activation(self.activation)
        if self.uses_winograd:
            step = winograd.winograd_step(sources[0], w, b, out, workspace, act)
        elif self.uses_packed(out.dtype):
            step = packed_conv.conv_step(sources[0], w, b, out, workspace, v["size"],
                                         v["stride_x"], v["stride_y"], v["padding"],
                                         v["dilation"], act)
        else:
            # Inference: the direct kernel's fused multiply-adds (training keeps Darknet's
            # arithmetic).
            step = cpu_conv.conv2d_step(sources[0], w, b, out, workspace, v["size"],
                                        v["stride_x"], v["stride_y"], v["padding"],
                                        v["dilation"], v["groups"], act, fused=True)
        return [step, *activation_steps_after(out, self.activation, fused=True)]

    # -- export ----------------------------------------------------------------------------

    def emit_onnx(self, g: OnnxGraph, params: Params | None) -> str:
        v = self.values
        c = self.in_shape[0]
        n, size, groups, dilation = v["filters"], v["size"], v["groups"], v["dilation"]
        w, b = fold_batchnorm(params)
        # Darknet pads by padding*dilation (its im2col's offset) on every side.
        pad = v["padding"] * dilation
        y = g.node("Conv", [g.source(self.inputs[0]),
                            g.const(w.reshape(n, c // groups, size, size), "weights"),
                            g.const(b, "biases")],
                   kernel_shape=[size, size], strides=[v["stride_y"], v["stride_x"]],
                   pads=[pad, pad, pad, pad], dilations=[dilation, dilation], group=groups)
        return g.activation(y, self.activation)

    # -- CPU training ------------------------------------------------------------------

    def _geometry(self) -> tuple[int, ...]:
        v = self.values
        return (v["size"], v["stride_x"], v["stride_y"], v["padding"], v["dilation"],
                v["groups"])

    def emit_cpu_train(self, e: LayerEmitter, ts: LayerTrainState) -> None:
        # Darknet's training forward: the convolution (no bias with batch norm), batch norm
        # on the mini-batch statistics (rolling averages updated), then the activation with
        # Darknet's scalar functions, each result kept for the backward.
        act = self.activation
        geo = self._geometry()
        weights, biases = ts.values["weights"], ts.values["biases"]
        pre = activation_input(e, act)
        # im2col + GEMM as Darknet trains (not Winograd, whose rounding differs).
        workspace = e.tensor("workspace", (max(1, self._im2col_workspace()),))
        if "scales" not in ts.values:
            e.host([e.inputs[0]], [pre, workspace], lambda r, w: [cpu_conv.conv2d_step(
                r[0], weights, biases, w[0], w[1], *geo, LINEAR)])
        else:
            raw = e.tensor("raw", e.shape(e.output))
            no_bias = np.zeros_like(biases)
            e.host([e.inputs[0]], [raw, workspace], lambda r, w: [cpu_conv.conv2d_step(
                r[0], weights, no_bias, w[0], w[1], *geo, LINEAR)])
            emit_batchnorm_train(e, ts, raw, pre, self.batchnorm_momentum)
        emit_cpu_activation_train(e, act, pre)

    def emit_cpu_backward(self, e: LayerEmitter, ts: LayerTrainState) -> None:
        act = self.activation
        geo = self._geometry()
        emit_cpu_activation_gradient(e, act, Tensor(self.index, "activation_input"))
        emit_bias_gradient(e, ts)
        c, _, _ = self.in_shape
        _, oh, ow = self.out_shape
        workspace = e.tensor("backward_workspace", (max(1, cpu_conv.backward_workspace_size(
            c, geo[0], geo[5], oh, ow)),))
        weight_grad = ts.grads["weights"]
        e.host([e.inputs[0], e.delta], [workspace], lambda r, w: [
            cpu_conv.conv2d_backward_weights_step(r[0], r[1], weight_grad, w[0], *geo)])
        into = e.input_delta(0)
        if into is not None:
            weights = ts.values["weights"]
            e.host([e.delta, into, workspace], [into, workspace], lambda r, w: [
                cpu_conv.conv2d_backward_input_step(weights, r[0], w[0], w[1], *geo)])

    # -- GPU -------------------------------------------------------------------------------

    @property
    def reads_input_as_columns(self) -> bool:
        """A 1x1, stride-1, unpadded convolution: the GEMM reads the input itself."""
        v = self.values
        return v["size"] == 1 and v["stride_x"] == 1 and v["stride_y"] == 1 and v["padding"] == 0

    def _im2col_args(self, accumulate: bool = False) -> dict[str, int]:
        v = self.values
        c, h, w = self.in_shape
        _, oh, ow = self.out_shape
        return dict(channels=c // v["groups"], height=h, width=w, ksize=v["size"],
                    stride_x=v["stride_x"], stride_y=v["stride_y"], pad=v["padding"],
                    dilation=v["dilation"], out_h=oh, out_w=ow, accumulate=int(accumulate))

    def _sizes(self) -> tuple[int, int, int, int, int]:
        """(groups, filters per group, channels per group, rows K = channels per group x
        size^2, columns N = output pixels) of this convolution's GEMMs."""
        v = self.values
        groups = v["groups"]
        cg = self.in_shape[0] // groups
        return (groups, self.out_shape[0] // groups, cg, cg * v["size"] ** 2,
                self.out_shape[1] * self.out_shape[2])

    def _images_per_gemm(self, e: LayerEmitter) -> int:
        """How many images one GEMM dispatch covers (as slices): the whole batch when the
        input is the columns, else as many as fit IMAGES_WORKSPACE_BYTES of im2col columns
        (at least one; Darknet keeps one image's), so that a small late layer is one dispatch
        wide enough for a GPU, not batch dispatches of a few tiles each."""
        groups, _, _, k, n = self._sizes()
        if self.reads_input_as_columns:
            return e.batch
        return max(1, min(e.batch, IMAGES_WORKSPACE_BYTES // (4 * groups * k * n)))

    def _chunk_columns(self, e: LayerEmitter, workspace: Tensor | None, first: int,
                       count: int) -> tuple[Tensor, int, int, int]:
        """(the GEMM's column operand for images first..first+count-1, its offset, its group
        and its image stride): the input itself for a 1x1 stride-1 unpadded convolution, else
        the images' im2col (one dispatch) into their slots of ``workspace``."""
        c, h, w = self.in_shape
        groups, _, cg, k, n = self._sizes()
        if workspace is None:
            return e.inputs[0], first * c * h * w, cg * h * w, c * h * w
        # Slice z of im2col is image z // groups, group z % groups: one dispatch.
        e.kernel("im2col_fwd_f32", {"image": e.inputs[0], "col": workspace},
                 {"spatial": n, "channels": cg, "slices": count * groups},
                 offsets={"image": first * c * h * w}, **self._im2col_args())
        return workspace, 0, k * n, groups * k * n

    def _workspace(self, e: LayerEmitter, role: str, images: int = 1) -> Tensor | None:
        groups, _, _, k, n = self._sizes()
        return (None if self.reads_input_as_columns
                else e.tensor(role, (images * groups * k * n,)))

    def _emit_gemm(self, e: LayerEmitter, weights: Param, bias: Param | None, out: Tensor,
                   act: int) -> None:
        """out = act(W * columns (+ bias)) per group, several images per GEMM; split along K
        (``forward_splits``) when too few output tiles would fill a GPU."""
        f = self.out_shape[0]
        groups, fg, _, k, n = self._sizes()
        chunk = self._images_per_gemm(e)
        cols = self._workspace(e, "workspace", chunk)
        splits, run = forward_splits(gemm_tiles(fg, n) * chunk, k)
        if groups == 1 and splits > 1 and e.storage == "f32":
            self._emit_split_gemm(e, weights, bias, out, act, cols, chunk, splits, run)
            return
        for first in range(0, e.batch, chunk):
            count = min(chunk, e.batch - first)
            operand, offset, b_group, b_image = self._chunk_columns(e, cols, first, count)
            _gemm_step(
                e, gemm_kernel("nn", e.simd),
                {"a": weights, "b": operand, "bias": bias, "c": out},
                offsets={"b": offset, "c": first * f * n},
                M=fg, N=n, K=k, lda=k, ldb=n, ldc=n, groups=groups, slices=count * groups,
                a_group_stride=fg * k, b_batch_stride=b_image, b_group_stride=b_group,
                c_batch_stride=f * n, c_group_stride=fg * n, bias_group_stride=fg,
                bias_mode=BIAS_NONE if bias is None else BIAS_ROWS, act=act,
            )

    def _emit_split_gemm(self, e: LayerEmitter, weights: Param, bias: Param | None,
                         out: Tensor, act: int, cols: Tensor | None, chunk: int, splits: int,
                         run: int) -> None:
        """``_emit_gemm`` of an ungrouped convolution with K cut into ``splits`` runs of
        ``run``: per chunk of images, slice z of a GEMM is image z // runs, run z % runs,
        its product in slot z of the partial sums (the last, shorter run a GEMM of its own),
        then one pass adds each image's slots in order, with the bias and activation."""
        f = self.out_shape[0]
        _, _, _, k, n = self._sizes()
        partials = e.tensor("forward_partials", (chunk * splits * f * n,))
        whole, rest = divmod(k, run)
        for first in range(0, e.batch, chunk):
            count = min(chunk, e.batch - first)
            operand, offset, _, b_image = self._chunk_columns(e, cols, first, count)
            for at, runs, length in ((0, whole, run), (whole, int(rest > 0), rest)):
                if runs == 0:
                    continue
                _gemm_step(e, gemm_kernel("nn", e.simd),
                          {"a": weights, "b": operand, "bias": None, "c": partials},
                          offsets={"a": at * run, "b": offset + at * run * n,
                                   "c": at * f * n},
                          M=f, N=n, K=length, lda=k, ldb=n, ldc=n, groups=runs,
                          slices=count * runs, a_group_stride=run, b_batch_stride=b_image,
                          b_group_stride=run * n, c_batch_stride=splits * f * n,
                          c_group_stride=f * n, bias_mode=BIAS_NONE, act=LINEAR)
            e.kernel("gemm_splits_fwd_f32", {"part": partials, "bias": bias, "c": out},
                     {"n": count * f * n}, offsets={"c": first * f * n}, per_image=f * n,
                     images=count, splits=splits, spatial=n,
                     bias_mode=BIAS_NONE if bias is None else BIAS_ROWS, act=act)

    def _emit_gemm_backward(self, e: LayerEmitter, ts: LayerTrainState) -> None:
        c, h, w = self.in_shape
        f = self.out_shape[0]
        groups, fg, cg, k, n = self._sizes()
        self._emit_weight_gradient(e, ts)
        target = e.input_delta_target(0)
        if target is None:
            return
        # Both paths write every element of the input's delta, so the first of its writers
        # sets it rather than adding to a cleared one.
        into, accumulate = target
        # Input gradient: W^T * delta per image and group, straight into the input's delta
        # when the input was the columns, else into one image's columns folded back by col2im.
        if self.reads_input_as_columns:
            _gemm_step(e, gemm_kernel("tn", e.simd),
                      {"a": ts.ref("weights"), "b": e.delta, "bias": None, "c": into},
                      M=k, N=n, K=fg, lda=k, ldb=n, ldc=n, groups=groups,
                      slices=e.batch * groups, beta=float(accumulate), a_group_stride=fg * k,
                      b_batch_stride=f * n, b_group_stride=fg * n, c_batch_stride=c * h * w,
                      c_group_stride=cg * h * w, bias_mode=BIAS_NONE, act=LINEAR)
            return
        # Several images' columns per GEMM (as the forward), each folded back by col2im.
        chunk = self._images_per_gemm(e)
        cols = self._workspace(e, "input_grad_workspace", chunk)
        for first in range(0, e.batch, chunk):
            count = min(chunk, e.batch - first)
            _gemm_step(e, gemm_kernel("tn", e.simd),
                      {"a": ts.ref("weights"), "b": e.delta, "bias": None, "c": cols},
                      offsets={"b": first * f * n},
                      M=k, N=n, K=fg, lda=k, ldb=n, ldc=n, groups=groups,
                      slices=count * groups, a_group_stride=fg * k, b_batch_stride=f * n,
                      b_group_stride=fg * n, c_batch_stride=groups * k * n,
                      c_group_stride=k * n, bias_mode=BIAS_NONE, act=LINEAR)
            e.kernel("col2im_bwd_f32", {"col": cols, "image": into},
                     {"spatial": h * w, "channels": cg, "slices": count * groups},
                     offsets={"image": first * c * h * w}, **self._im2col_args(accumulate))

    def _emit_weight_gradient(self, e: LayerEmitter, ts: LayerTrainState) -> None:
        """W_grad += the batch's delta * columns^T, per group. Ungrouped, several images a
        dispatch (as many as fill a GPU, within IMAGES_WORKSPACE_BYTES of columns), each
        image's K (its output pixels) cut into runs: slice z of a dispatch is image
        z // runs, run z % runs, and its product goes to its own slot of the partial sums;
        later images add into the slots of earlier ones in batch order, and one pass adds the
        slots into the gradient. Grouped, image by image: slice z is run z // groups, group
        z % groups."""
        f = self.out_shape[0]
        groups, fg, _, k, n = self._sizes()
        size = groups * fg * k
        chunk = 1
        if groups == 1:
            chunk = min(self._images_per_gemm(e),
                        -(-WEIGHT_GRADIENT_TILES // gemm_tiles(fg, k)))
        cols = self._workspace(e, "backward_workspace", chunk)
        splits, run = weight_gradient_splits(fg, k, n, groups * chunk)
        slots = chunk * splits
        grad = ts.ref("weights", "grad")
        partials = e.tensor("weight_grad_partials", (slots * size,)) if slots > 1 else None
        whole, rest = divmod(n, run)
        for first in range(0, e.batch, chunk):
            count = min(chunk, e.batch - first)
            operand, offset, b_group, b_image = self._chunk_columns(e, cols, first, count)
            target, beta = (grad, 1.0) if partials is None else (partials, float(first > 0))
            for at, runs, length in ((0, whole, run), (whole, int(rest > 0), rest)):
                if runs == 0:
                    continue
                if groups == 1:
                    slicing = dict(groups=runs, slices=count * runs, a_batch_stride=f * n,
                                   a_group_stride=run, b_batch_stride=b_image,
                                   b_group_stride=run, c_batch_stride=splits * size,
                                   c_group_stride=size)
                else:
                    slicing = dict(groups=groups, slices=runs * groups, a_batch_stride=run,
                                   a_group_stride=fg * n, b_batch_stride=run,
                                   b_group_stride=b_group, c_batch_stride=size,
                                   c_group_stride=fg * k)
                _gemm_step(e, gemm_kernel("nt", e.simd),
                          {"a": e.delta, "b": operand, "bias": None, "c": target},
                          offsets={"a": first * f * n + at * run, "b": offset + at * run,
                                   "c": at * size},
                          M=fg, N=k, K=length, lda=n, ldb=n, ldc=k, beta=beta,
                          bias_mode=BIAS_NONE, act=LINEAR, **slicing)
        if partials is not None:
            e.kernel("sum_slices_buf_f32", {"src": partials, "dst": grad},
                     {"n": size}, n=size, slices=slots, stride=size)

    def describe(self) -> str:
        v = self.values
        stride = (f"{v['stride_x']}" if v["stride_x"] == v["stride_y"]
                  else f"{v['stride_x']}x{v['stride_y']}")
        dil = f"({v['dilation']})" if v["dilation"] > 1 else ""
        groups = f" {v['groups']}g" if v["groups"] > 1 else ""
        return f"{v['filters']:5d}{groups:>4s} {v['size']:2d} x{v['size']:2d}/{stride:>3s}{dil}"


class ConnectedOp(_Gemm):
    kind = "connected"
    short_name = "connected"
    learning_rate_scaled = False
    # Batch norm over the images alone (one value per output and image).
    batchnorm_momentum = cpu_batchnorm.MOMENTUM_CONNECTED

    @classmethod
    def build(cls, s: Section, shape: Shape, shapes: list[Shape]) -> Op:
        inputs = shape[0] * shape[1] * shape[2]
        outputs = s.values["output"]
        params = {"biases": (outputs,), "weights": (outputs, inputs)}
        if s.values["batch_normalize"]:
            params.update({name: (outputs,) for name in BATCHNORM_PARAMS})
        return cls(s, [s.index - 1], shape, (outputs, 1, 1), params, 2 * inputs * outputs)

    def stored_transposed(self, name: str) -> bool:
        return name == "weights"

    def emit_onnx(self, g: OnnxGraph, params: Params | None) -> str:
        w, b = fold_batchnorm(params)  # (outputs, inputs): y = x W^T + b
        rows = g.node("Flatten", [g.source(self.inputs[0])], axis=1)
        y = g.node("Gemm", [rows, g.const(w, "weights"), g.const(b, "biases")], transB=1)
        y = g.activation(y, self.activation)
        return g.node("Reshape", [y, g.shape([0, -1, 1, 1])])

    def prepare_cpu(self, params: Params | None, dtype: np.dtype) -> Any:
        w, b = fold_batchnorm(params)
        return np.ascontiguousarray(w, dtype), np.ascontiguousarray(b, dtype)

    def cpu_steps(self, state: Any, sources: list[np.ndarray], out: np.ndarray,
                  workspace: np.ndarray | None) -> list[NativeStep]:
        w, b = state
        src = sources[0]
        step = cpu_conv.connected_step(src.reshape(src.shape[0], -1), w, b,
                                       out.reshape(out.shape[0], -1),
                                       fused_activation(self.activation))
        return [step, *activation_steps_after(out, self.activation, fused=True)]

    def emit_cpu_train(self, e: LayerEmitter, ts: LayerTrainState) -> None:
        act = self.activation
        weights, biases = ts.values["weights"], ts.values["biases"]
        pre = activation_input(e, act)
        if "scales" not in ts.values:
            e.host([e.inputs[0]], [pre], lambda r, w: [cpu_conv.connected_step(
                as_rows(r[0]), weights, biases, as_rows(w[0]), LINEAR)])
        else:
            raw = e.tensor("raw", e.shape(e.output))
            no_bias = np.zeros_like(biases)
            e.host([e.inputs[0]], [raw], lambda r, w: [cpu_conv.connected_step(
                as_rows(r[0]), weights, no_bias, as_rows(w[0]), LINEAR)])
            emit_batchnorm_train(e, ts, raw, pre, self.batchnorm_momentum, flat=True)
        emit_cpu_activation_train(e, act, pre)

    def emit_cpu_backward(self, e: LayerEmitter, ts: LayerTrainState) -> None:
        emit_cpu_activation_gradient(e, self.activation,
                                     Tensor(self.index, "activation_input"))
        emit_bias_gradient(e, ts, flat=True)
        weights, weight_grad = ts.values["weights"], ts.grads["weights"]
        into = e.input_delta(0)
        reads = [e.inputs[0], e.delta] + ([into] if into is not None else [])
        e.host(reads, [into] if into is not None else [], lambda r, w: [
            cpu_conv.connected_backward_step(as_rows(r[0]), weights, as_rows(r[1]), weight_grad,
                                             as_rows(w[0]) if w else None)])

    def _emit_gemm(self, e: LayerEmitter, weights: Param, bias: Param | None, out: Tensor,
                   act: int) -> None:
        """out = act(x * W^T (+ bias)): one row per image."""
        c, h, w = self.in_shape
        k, oc = c * h * w, self.out_shape[0]
        _gemm_step(e, gemm_kernel("nt", e.simd),
                  {"a": e.inputs[0], "b": weights, "bias": bias, "c": out},
                  M=e.batch, N=oc, K=k, lda=k, ldb=k, ldc=oc,
                  bias_mode=BIAS_NONE if bias is None else BIAS_COLS, act=act)

    def _emit_gemm_backward(self, e: LayerEmitter, ts: LayerTrainState) -> None:
        c, h, w = self.in_shape
        k, oc = c * h * w, self.out_shape[0]
        # W_grad += delta^T * x; the input's delta += delta * W.
        _gemm_step(e, gemm_kernel("tn", e.simd),
                  {"a": e.delta, "b": e.inputs[0], "bias": None,
                   "c": ts.ref("weights", "grad")},
                  M=oc, N=k, K=e.batch, lda=oc, ldb=k, ldc=k, beta=1.0,
                  bias_mode=BIAS_NONE, act=LINEAR)
        into = e.input_delta(0)
        if into is not None:
            _gemm_step(e, gemm_kernel("nn", e.simd),
                      {"a": e.delta, "b": ts.ref("weights"), "bias": None, "c": into},
                      M=e.batch, N=k, K=oc, lda=oc, ldb=k, ldc=k, beta=1.0,
                      bias_mode=BIAS_NONE, act=LINEAR)

    def describe(self) -> str:
        return f"{self.values['output']:5d}"
