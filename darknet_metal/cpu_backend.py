"""The CPU reference backend: runs ``LayerSpec``s with the Cython layers of ``darknet_metal.cpu``.

It owns inference copies of the parameters (batch norm folded, in the compute dtype) and the
per-batch-size output buffers, so repeated forward passes allocate nothing.
"""

from __future__ import annotations

import time

import numpy as np

from darknet_metal.activations import ACTIVATION_ID, CHANNEL_ACTIVATIONS
from darknet_metal.cpu import activations as cpu_act
from darknet_metal.cpu import combine, conv, heads, pooling, resample, winograd
from darknet_metal.layers import LayerSpec
from darknet_metal.params import Params, fold_batchnorm

_LINEAR = ACTIVATION_ID["linear"]

#: Input channels from which Winograd beats im2col + GEMM for a 3x3 convolution: below it
#: the 16 transformed GEMMs are too thin to pay for the transforms.
WINOGRAD_MIN_CHANNELS = 32


def uses_winograd(spec: LayerSpec) -> bool:
    """Whether the CPU runs this convolution with Winograd F(2x2, 3x3)."""
    v = spec.values
    return (
        spec.kind == "convolutional"
        and v["size"] == 3
        and v["stride_x"] == 1
        and v["stride_y"] == 1
        and v["padding"] == 1
        and v["dilation"] == 1
        and v["groups"] == 1
        and spec.in_shape[0] >= WINOGRAD_MIN_CHANNELS
    )


class CpuBackend:
    """Executes a network's layers on the CPU in ``dtype`` (float32 or float64)."""

    name = "cpu"

    def __init__(
        self, specs: list[LayerSpec], params: dict[int, Params], dtype: np.dtype | type = np.float32
    ) -> None:
        self.specs = specs
        self.dtype = np.dtype(dtype)
        if self.dtype not in (np.float32, np.float64):
            raise ValueError(f"dtype must be float32 or float64, not {self.dtype}")
        self._buffers: dict[int, list[np.ndarray]] = {}
        self._workspace = np.empty(0, self.dtype)
        self.load_params(params)

    def load_params(self, params: dict[int, Params]) -> None:
        """(Re)build the inference parameters from the master copies in ``params``."""
        self._weights: dict[int, tuple[np.ndarray, np.ndarray]] = {}
        self._shortcut: dict[int, np.ndarray] = {}
        need = 0
        for spec in self.specs:
            if spec.kind in ("convolutional", "connected"):
                w, b = fold_batchnorm(params[spec.index])
                w = np.ascontiguousarray(w, self.dtype)
                if uses_winograd(spec):
                    w = winograd.transform_filters(w, spec.in_shape[0])
                    need = max(
                        need,
                        winograd.workspace_size(
                            spec.in_shape[0], spec.out_shape[0], *spec.out_shape[1:]
                        ),
                    )
                self._weights[spec.index] = (w, np.ascontiguousarray(b, self.dtype))
            elif spec.kind == "shortcut" and "weights" in spec.param_shapes:
                self._shortcut[spec.index] = np.ascontiguousarray(
                    params[spec.index]["weights"], self.dtype
                )
            if spec.kind == "convolutional":
                v = spec.values
                c = spec.in_shape[0]
                need = max(
                    need,
                    conv.workspace_size(
                        c, v["size"], v["groups"], spec.out_shape[1], spec.out_shape[2]
                    ),
                )
        if self._workspace.size < need:
            self._workspace = np.empty(need, self.dtype)

    def _outputs(self, batch: int) -> list[np.ndarray]:
        buffers = self._buffers.get(batch)
        if buffers is None:
            buffers = [np.empty((batch, *spec.out_shape), self.dtype) for spec in self.specs]
            self._buffers = {batch: buffers}  # keep one batch size: bounded memory
        return buffers

    def forward(
        self, x: np.ndarray, timings: list[float] | None = None, outputs: list[int] | None = None
    ) -> list[np.ndarray]:
        """Run every layer on ``x`` (N, C, H, W) and return each layer's output buffer.

        The returned arrays are reused by the next call: copy what must outlive it. With
        ``timings``, the wall time of each layer in seconds is appended to it. ``outputs``
        (the layers the caller will read) changes nothing here: every buffer is in memory.
        """
        x = np.ascontiguousarray(x, self.dtype)
        outs = self._outputs(x.shape[0])
        for spec in self.specs:
            sources = [x if i < 0 else outs[i] for i in spec.inputs]
            if timings is None:
                self.run_layer(spec, sources, outs[spec.index])
            else:
                start = time.perf_counter()
                self.run_layer(spec, sources, outs[spec.index])
                timings.append(time.perf_counter() - start)
        return outs

    def run_layer(self, spec: LayerSpec, sources: list[np.ndarray], out: np.ndarray) -> None:
        """Run one layer: ``sources`` are its input arrays (``spec.inputs`` order), ``out``
        its preallocated output (N, *spec.out_shape)."""
        v = spec.values
        kind = spec.kind
        src = sources[0]
        act = spec.activation
        channel_act = v.get("activation") in CHANNEL_ACTIVATIONS
        if kind == "convolutional" and uses_winograd(spec):
            w, b = self._weights[spec.index]
            winograd.winograd_forward(
                src, w, b, out, self._workspace, _LINEAR if channel_act else act
            )
        elif kind == "convolutional":
            w, b = self._weights[spec.index]
            conv.conv2d_forward(
                src,
                w,
                b,
                out,
                self._workspace,
                v["size"],
                v["stride_x"],
                v["stride_y"],
                v["padding"],
                v["dilation"],
                v["groups"],
                _LINEAR if channel_act else act,
            )
        elif kind == "connected":
            w, b = self._weights[spec.index]
            conv.connected_forward(
                src.reshape(src.shape[0], -1),
                w,
                b,
                out.reshape(out.shape[0], -1),
                _LINEAR if channel_act else act,
            )
        elif kind == "maxpool":
            if v["maxpool_depth"]:
                pooling.maxpool_depth_forward(src, out)
            else:
                pooling.maxpool_forward(
                    src, out, v["size"], v["stride_x"], v["stride_y"], v["padding"]
                )
        elif kind == "avgpool":
            pooling.avgpool_forward(src, out)
        elif kind == "route":
            groups, group_id = v["groups"], v["group_id"]
            offset = 0
            for part in sources:
                width = part.shape[1] // groups
                out[:, offset : offset + width] = part[:, group_id * width : (group_id + 1) * width]
                offset += width
        elif kind == "shortcut":
            combine.shortcut_forward(
                src,
                sources[1:],
                self._shortcut.get(spec.index),
                v["weights_type"],
                v["weights_normalization"],
                out,
            )
        elif kind == "upsample":
            resample.upsample_forward(src, out, v["stride"], v["scale"])
        elif kind == "reorg":
            resample.reorg_forward(src, out, v["stride"], v["reverse"])
        elif kind == "scale_channels":
            combine.scale_channels_forward(sources[1], src, out, v["scale_wh"])
        elif kind == "sam":
            combine.sam_forward(sources[1], src, out)
        elif kind == "softmax":
            heads.softmax_forward(
                src.reshape(src.shape[0], -1),
                out.reshape(out.shape[0], -1),
                v["groups"],
                v["temperature"],
            )
        elif kind == "yolo":
            heads.yolo_forward(
                src, out, len(v["mask"]), v["classes"], v["scale_x_y"], v["new_coords"]
            )
        elif kind in ("dropout", "cost"):
            np.copyto(out, src)
        else:  # build_layers admits only the kinds above
            raise AssertionError(kind)
        needs_activation = kind in ("shortcut", "scale_channels", "sam") and act != _LINEAR
        if channel_act or needs_activation:
            cpu_act.activate(out, act)
