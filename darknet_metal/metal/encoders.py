"""The kernel dispatches of each layer kind, following the host contract of shaders/README.md.

``layer_kernels`` names the kernels a layer needs (for coverage and pipeline checks);
``layer_dispatches`` returns them as ready-to-replay tuples
``(kernel name, packed args, buffers, grid, threadgroup)`` for ``Device.dispatch``: arguments
are packed once when a pass is planned, so a forward pass only replays the tuples.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from darknet_metal.activations import ACTIVATION_ID, CHANNEL_ACTIVATIONS
from darknet_metal.layers import LayerSpec, Shape
from darknet_metal.metal import registry

Dispatch = tuple[str, bytes, tuple[Any, ...], tuple[int, int, int], tuple[int, int, int]]

_LINEAR = ACTIVATION_ID["linear"]
_NORMALIZE = {
    "normalize_channels": "normalize_channels_fwd_f32",
    "normalize_channels_softmax": "normalize_channels_softmax_fwd_f32",
    "normalize_channels_softmax_maxval": "normalize_channels_softmax_maxval_fwd_f32",
}
_SHORTCUT_NORMALIZATION = {"none": 0, "relu": 1, "softmax": 2}
_ACTIVATED_AFTER = ("shortcut", "scale_channels", "sam")


@dataclass
class LayerResources:
    """Device buffers a layer uses besides its inputs and output: folded ``weights``/``biases``
    (conv, connected), the shortcut weight ``table``, the shared im2col ``workspace``."""

    weights: Any = None
    biases: Any = None
    table: Any = None
    workspace: Any = None


def make_dispatch(
    name: str, buffers: Sequence[Any], sizes: dict[str, int], **args: int | float
) -> Dispatch:
    """One dispatch of kernel ``name``: its args struct packed from ``args`` and the grid its
    registry entry gives for ``sizes``."""
    k = registry.kernel(name)
    grid, group = k.grid.dispatch(**sizes)
    return (name, registry.ARGS[k.args].pack(**args), tuple(buffers), grid, group)


def is_direct_conv(spec: LayerSpec) -> bool:
    """A 1x1, stride-1, unpadded convolution: the GEMM reads the input itself (no im2col)."""
    v = spec.values
    return v["size"] == 1 and v["stride_x"] == 1 and v["stride_y"] == 1 and v["padding"] == 0


def im2col_floats(spec: LayerSpec, batch: int) -> int:
    """Floats of im2col workspace the layer needs at ``batch`` (0 if none)."""
    if spec.kind != "convolutional" or is_direct_conv(spec):
        return 0
    v = spec.values
    _, oh, ow = spec.out_shape
    return batch * spec.in_shape[0] * v["size"] * v["size"] * oh * ow


def _gemm_name(trans: str, simd: bool) -> str:
    return f"gemm_{trans}{'_simd' if simd else ''}_f32"


def gemm_dispatch(
    name: str,
    buffers: Sequence[Any],
    *,
    M: int,
    N: int,
    K: int,
    lda: int,
    ldb: int,
    ldc: int,
    bias_mode: int,
    act: int,
    groups: int = 1,
    slices: int = 1,
    beta: float = 0.0,
    **strides: int,
) -> Dispatch:
    """A GEMM dispatch (``buffers``: a, b, bias, c). Batch and group strides default to 0
    (one slice); give ``a_group_stride=...`` etc. for batched or grouped GEMMs."""
    names = (
        "a_batch_stride",
        "a_group_stride",
        "b_batch_stride",
        "b_group_stride",
        "c_batch_stride",
        "c_group_stride",
        "bias_group_stride",
    )
    unknown = set(strides) - set(names)
    if unknown:
        raise TypeError(f"gemm_dispatch: unknown strides {sorted(unknown)}")
    return make_dispatch(
        name,
        buffers,
        {"N": N, "M": M, "slices": slices},
        M=M,
        N=N,
        K=K,
        lda=lda,
        ldb=ldb,
        ldc=ldc,
        groups=groups,
        bias_mode=bias_mode,
        act=act,
        beta=beta,
        **{n: strides.get(n, 0) for n in names},
    )


def _post_activation(spec: LayerSpec) -> str | None:
    """Kernel applying the layer's activation after its main kernels, or None."""
    name = spec.values.get("activation", "linear")
    if name in CHANNEL_ACTIVATIONS:
        return _NORMALIZE[name]
    if spec.kind in _ACTIVATED_AFTER and spec.activation != _LINEAR:
        return "activation_fwd_f32"
    return None


def layer_kernels(spec: LayerSpec, simd: bool) -> list[str]:
    """Names of the kernels ``spec`` dispatches (empty for identity kinds). Raises KeyError
    for a kind the registry does not serve."""
    kind, v = spec.kind, spec.values
    registry.kernels_for(kind)
    if kind in registry.IDENTITY_KINDS:
        return []
    if kind == "convolutional":
        names = [] if is_direct_conv(spec) else ["im2col_fwd_f32"]
        names.append(_gemm_name("nn", simd))
    elif kind == "connected":
        names = [_gemm_name("nt", simd)]
    elif kind == "maxpool":
        names = ["maxpool_depth_fwd_f32" if v["maxpool_depth"] else "maxpool_fwd_f32"]
    elif kind == "shortcut":
        names = ["shortcut_fwd_f32"]
        if v["weights_type"] != "none":
            names.insert(0, "shortcut_weights_fwd_f32")
    else:
        names = [f"{kind}_fwd_f32"]
    post = _post_activation(spec)
    if post is not None:
        names.append(post)
    return names


def shortcut_table_dispatch(spec: LayerSpec, weights: Any, table: Any) -> Dispatch:
    """The normalised weight table of a weighted shortcut (run once when weights load)."""
    v = spec.values
    return make_dispatch(
        "shortcut_weights_fwd_f32",
        (weights, table),
        {"channels": spec.out_shape[0]},
        n_inputs=len(spec.inputs),
        channels=spec.out_shape[0],
        per_channel=int(v["weights_type"] == "per_channel"),
        normalization=_SHORTCUT_NORMALIZATION[v["weights_normalization"]],
    )


def layer_dispatches(
    spec: LayerSpec,
    batch: int,
    ins: Sequence[Any],
    in_shapes: Sequence[Shape],
    out: Any,
    res: LayerResources,
    simd: bool,
) -> list[Dispatch]:
    """The dispatches of one forward pass of ``spec`` at ``batch`` reading buffers ``ins``
    (one per ``spec.inputs``, of (C, H, W) ``in_shapes``) and writing ``out``."""
    kind, v = spec.kind, spec.values
    c, h, w = spec.in_shape
    oc, oh, ow = spec.out_shape
    spatial = oh * ow
    act = spec.activation
    post = _post_activation(spec)
    fused_act = _LINEAR if post is not None else act
    x = ins[0]
    d: list[Dispatch] = []
    if kind == "convolutional":
        d += _conv(spec, batch, x, out, res, simd, fused_act)
    elif kind == "connected":
        k = c * h * w
        d.append(
            gemm_dispatch(
                _gemm_name("nt", simd),
                (x, res.weights, res.biases, out),
                M=batch,
                N=oc,
                K=k,
                lda=k,
                ldb=k,
                ldc=oc,
                bias_mode=registry.BIAS_COLS,
                act=fused_act,
            )
        )
    elif kind == "maxpool" and v["maxpool_depth"]:
        d.append(
            make_dispatch(
                "maxpool_depth_fwd_f32",
                (x, out),
                {"spatial": h * w, "out_channels": oc, "batch": batch},
                batch=batch,
                channels=c,
                spatial=h * w,
                out_channels=oc,
            )
        )
    elif kind == "maxpool":
        d.append(
            make_dispatch(
                "maxpool_fwd_f32",
                (x, out),
                {"out_w": ow, "out_h": oh, "planes": batch * c},
                planes=batch * c,
                height=h,
                width=w,
                out_h=oh,
                out_w=ow,
                size=v["size"],
                stride_x=v["stride_x"],
                stride_y=v["stride_y"],
                padding=v["padding"],
            )
        )
    elif kind == "avgpool":
        d.append(
            make_dispatch(
                "avgpool_fwd_f32", (x, out), {"planes": batch * c}, planes=batch * c, spatial=h * w
            )
        )
    elif kind == "route":
        d += _route(spec, batch, ins, in_shapes, out)
    elif kind == "shortcut":
        table = res.table if res.table is not None else x  # bound but unread when unweighted
        for i, source in enumerate(ins[1:]):
            src_c = in_shapes[i + 1][0]
            d.append(
                make_dispatch(
                    "shortcut_fwd_f32",
                    (x if i == 0 else out, source, table, out),
                    {"spatial": spatial, "channels": oc, "batch": batch},
                    batch=batch,
                    channels=oc,
                    spatial=spatial,
                    src_channels=src_c,
                    source=i + 1,
                    first=int(i == 0),
                    weighted=int(res.table is not None),
                )
            )
    elif kind == "upsample":
        d.append(
            make_dispatch(
                "upsample_fwd_f32",
                (x, out),
                {"out_w": ow, "out_h": oh, "planes": batch * c},
                planes=batch * c,
                height=h,
                width=w,
                out_h=oh,
                out_w=ow,
                stride=v["stride"],
                scale=v["scale"],
            )
        )
    elif kind == "reorg":
        d.append(
            make_dispatch(
                "reorg_fwd_f32",
                (x, out),
                {"width": w, "height": h, "slices": batch * c},
                batch=batch,
                width=w,
                height=h,
                channels=c,
                stride=v["stride"],
                reverse=int(bool(v["reverse"])),
            )
        )
    elif kind == "scale_channels":
        d.append(
            make_dispatch(
                "scale_channels_fwd_f32",
                (ins[1], x, out),
                {"spatial": spatial, "channels": oc, "batch": batch},
                batch=batch,
                channels=oc,
                spatial=spatial,
                scale_wh=int(bool(v["scale_wh"])),
            )
        )
    elif kind == "sam":
        n = batch * oc * spatial
        d.append(make_dispatch("sam_fwd_f32", (ins[1], x, out), {"n": n}, n=n))
    elif kind == "softmax":
        groups = v["groups"]
        rows = batch * groups
        d.append(
            make_dispatch(
                "softmax_fwd_f32",
                (x, out),
                {"rows": rows},
                rows=rows,
                n=(c * h * w) // groups,
                temperature=v["temperature"],
            )
        )
    elif kind == "yolo":
        d.append(
            make_dispatch(
                "yolo_fwd_f32",
                (x, out),
                {"spatial": spatial, "channels": oc, "batch": batch},
                batch=batch,
                anchors=len(v["mask"]),
                classes=v["classes"],
                spatial=spatial,
                new_coords=int(bool(v["new_coords"])),
                scale_x_y=v["scale_x_y"],
            )
        )
    else:  # identity kinds have no dispatches; build_layers admits nothing else
        raise KeyError(f"no dispatches for layer kind {kind!r}")
    if post == "activation_fwd_f32":
        n = batch * oc * spatial
        d.append(make_dispatch(post, (out, out), {"n": n}, n=n, act=act))
    elif post is not None:
        d.append(
            make_dispatch(
                post,
                (out, out),
                {"spatial": spatial, "batch": batch},
                batch=batch,
                channels=oc,
                spatial=spatial,
            )
        )
    return d


def _conv(
    spec: LayerSpec, batch: int, x: Any, out: Any, res: LayerResources, simd: bool, act: int
) -> list[Dispatch]:
    v = spec.values
    c, h, w = spec.in_shape
    f, oh, ow = spec.out_shape
    size, groups = v["size"], v["groups"]
    cg, fg = c // groups, f // groups
    k, n = cg * size * size, oh * ow
    d: list[Dispatch] = []
    if is_direct_conv(spec):
        operand, b_batch, b_group = x, c * h * w, cg * h * w
    else:
        operand, b_batch, b_group = res.workspace, groups * k * n, k * n
        d.append(
            make_dispatch(
                "im2col_fwd_f32",
                (x, res.workspace),
                {"spatial": n, "rows": k, "slices": batch * groups},
                channels=cg,
                height=h,
                width=w,
                ksize=size,
                stride_x=v["stride_x"],
                stride_y=v["stride_y"],
                pad=v["padding"],
                dilation=v["dilation"],
                out_h=oh,
                out_w=ow,
            )
        )
    d.append(
        gemm_dispatch(
            _gemm_name("nn", simd),
            (res.weights, operand, res.biases, out),
            M=fg,
            N=n,
            K=k,
            lda=k,
            ldb=n,
            ldc=n,
            groups=groups,
            slices=batch * groups,
            a_group_stride=fg * k,
            b_batch_stride=b_batch,
            b_group_stride=b_group,
            c_batch_stride=f * n,
            c_group_stride=fg * n,
            bias_group_stride=fg,
            bias_mode=registry.BIAS_ROWS,
            act=act,
        )
    )
    return d


def _route(
    spec: LayerSpec, batch: int, ins: Sequence[Any], in_shapes: Sequence[Shape], out: Any
) -> list[Dispatch]:
    v = spec.values
    groups, group_id = v["groups"], v["group_id"]
    oc, oh, ow = spec.out_shape
    d: list[Dispatch] = []
    offset = 0
    for i, source in enumerate(ins):
        src_c = in_shapes[i][0]
        width = src_c // groups
        d.append(
            make_dispatch(
                "route_fwd_f32",
                (source, out),
                {"spatial": oh * ow, "channels": width, "batch": batch},
                batch=batch,
                spatial=oh * ow,
                channels=width,
                src_channels=src_c,
                src_offset=group_id * width,
                dst_channels=oc,
                dst_offset=offset,
            )
        )
        offset += width
    return d
