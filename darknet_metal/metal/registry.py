"""The Metal kernel registry: every forward kernel in ``shaders/*.metal``, declared once as data.

For each kernel: its Metal function name (the registry key, ``<op>_<fwd|bwd>[_<part>]_<dtype>``
or a direction-free op such as ``gemm_nn_f32``), the ``.metal`` file defining it, its argument
struct (``shaders/dm_args.h``; the fields are repeated here so the host can pack them, and tests
check both agree with what a C compiler sees), the role of each buffer in index order (buffer 0
is always the argument struct, then inputs, then outputs), the grid rule (what the host
dispatches over) and the Darknet layer kinds it serves.

Grid rules (``Grid``): the host dispatches with ``dispatchThreads`` over ``axes``, named sizes
given in x, y, z order. Without ``tile`` there is one thread per element and the threadgroup
is ``group`` (edge groups may be partial: every kernel guards its bounds). With ``tile``, each
threadgroup of ``group`` threads covers ``tile`` elements per axis, so the grid is
``ceil(size / tile) * group`` threads per axis and every group is full (those kernels use
threadgroup barriers). ``Grid.dispatch`` computes both.
"""

from __future__ import annotations

import math
import struct
from dataclasses import dataclass

__all__ = [
    "ARGS",
    "BIAS_COLS",
    "BIAS_NONE",
    "BIAS_ROWS",
    "IDENTITY_KINDS",
    "KERNELS",
    "ArgsStruct",
    "Grid",
    "Kernel",
    "kernel",
    "kernels_for",
]

_FORMATS = {"u32": "I", "i32": "i", "f32": "f"}


@dataclass(frozen=True)
class ArgsStruct:
    """A ``dm_<op>_args`` struct: fields in declaration order as (name, "u32"|"i32"|"f32")."""

    name: str
    fields: tuple[tuple[str, str], ...]

    @property
    def size(self) -> int:
        """Size in bytes (every member is 4 bytes, so there is no padding)."""
        return 4 * len(self.fields)

    def offset(self, field: str) -> int:
        """Byte offset of ``field``; KeyError if the struct has no such field."""
        for i, (name, _) in enumerate(self.fields):
            if name == field:
                return 4 * i
        raise KeyError(f"{self.name} has no field {field!r}")

    def pack(self, **values: int | float) -> bytes:
        """The struct's bytes (little-endian, as on every Metal device) from field values.

        Every field must be given and no other; integers must fit their type. Raises
        ValueError naming the struct and field otherwise.
        """
        missing = [n for n, _ in self.fields if n not in values]
        extra = sorted(set(values) - {n for n, _ in self.fields})
        if missing or extra:
            raise ValueError(f"{self.name}: missing fields {missing}, unknown fields {extra}")
        out = []
        for name, kind in self.fields:
            v = values[name]
            if kind == "f32":
                out.append(float(v))
                continue
            if isinstance(v, float) and not float(v).is_integer():
                raise ValueError(f"{self.name}.{name} must be an integer, got {v!r}")
            v = int(v)
            lo, hi = (0, 2**32 - 1) if kind == "u32" else (-(2**31), 2**31 - 1)
            if not lo <= v <= hi:
                raise ValueError(f"{self.name}.{name}={v} does not fit in {kind}")
            out.append(v)
        return struct.pack("<" + "".join(_FORMATS[k] for _, k in self.fields), *out)


@dataclass(frozen=True)
class Grid:
    """What the host dispatches over (see the module docstring)."""

    axes: tuple[str, ...]
    group: tuple[int, ...]
    tile: tuple[int, ...] | None = None

    @property
    def threads_per_group(self) -> int:
        return math.prod(self.group)

    def dispatch(self, **sizes: int) -> tuple[tuple[int, int, int], tuple[int, int, int]]:
        """(threads per grid, threads per threadgroup), both 3-D, for the named axis sizes.

        Raises ValueError for a missing or extra axis or a size below 1.
        """
        if set(sizes) != set(self.axes):
            raise ValueError(f"grid axes are {self.axes}, got {tuple(sizes)}")
        for axis, n in sizes.items():
            if n < 1:
                raise ValueError(f"grid axis {axis}={n} must be >= 1")
        grid = []
        for i, axis in enumerate(self.axes):
            n = sizes[axis]
            grid.append(n if self.tile is None else -(-n // self.tile[i]) * self.group[i])
        pad = (1, 1, 1)
        return (tuple((*grid, *pad)[:3]), tuple((*self.group, *pad)[:3]))  # type: ignore[return-value]


@dataclass(frozen=True)
class Kernel:
    """One kernel function: see the module docstring. ``requires`` names a GPU feature the
    kernel needs beyond Metal 2.4 ("simdgroup_matrix": Apple7 family and later)."""

    name: str
    source: str
    args: str
    buffers: tuple[str, ...]
    grid: Grid
    layers: tuple[str, ...]
    requires: str = ""

    @property
    def inputs(self) -> tuple[str, ...]:
        return tuple(b[3:] for b in self.buffers if b.startswith("in:"))

    @property
    def outputs(self) -> tuple[str, ...]:
        return tuple(b[4:] for b in self.buffers if b.startswith("out:"))


def _args(name: str, spec: str) -> ArgsStruct:
    """``spec``: "u32 a, b; i32 c; f32 d" in declaration order."""
    fields = []
    for group in spec.split(";"):
        kind, names = group.strip().split(" ", 1)
        fields.extend((n.strip(), kind) for n in names.split(","))
    return ArgsStruct(name, tuple(fields))


#: Argument structs, field for field as declared in shaders/dm_args.h.
ARGS: dict[str, ArgsStruct] = {
    a.name: a
    for a in (
        _args("dm_activation_args", "u32 n; i32 act"),
        _args("dm_normalize_channels_args", "u32 batch, channels, spatial"),
        _args(
            "dm_im2col_args",
            "u32 channels, height, width, ksize, stride_x, stride_y, pad, dilation, out_h, out_w",
        ),
        _args(
            "dm_gemm_args",
            "u32 M, N, K, lda, ldb, ldc, groups, a_batch_stride, a_group_stride, "
            "b_batch_stride, b_group_stride, c_batch_stride, c_group_stride, bias_group_stride; "
            "i32 bias_mode, act",
        ),
        _args(
            "dm_pool_args",
            "u32 planes, height, width, out_h, out_w, size, stride_x, stride_y, padding",
        ),
        _args("dm_maxpool_depth_args", "u32 batch, channels, spatial, out_channels"),
        _args("dm_avgpool_args", "u32 planes, spatial"),
        _args(
            "dm_route_args",
            "u32 batch, spatial, channels, src_channels, src_offset, dst_channels, dst_offset",
        ),
        _args("dm_shortcut_weights_args", "u32 n_inputs, channels, per_channel, normalization"),
        _args(
            "dm_shortcut_args",
            "u32 batch, channels, spatial, src_channels, source, first, weighted",
        ),
        _args("dm_upsample_args", "u32 planes, height, width, out_h, out_w; i32 stride; f32 scale"),
        _args("dm_reorg_args", "u32 batch, width, height, channels, stride, forward"),
        _args("dm_scale_channels_args", "u32 batch, channels, spatial, scale_wh"),
        _args("dm_sam_args", "u32 n"),
        _args("dm_softmax_args", "u32 rows, n; f32 temperature"),
        _args("dm_yolo_args", "u32 batch, anchors, classes, spatial, new_coords; f32 scale_x_y"),
    )
}

#: dm_gemm_args.bias_mode values.
BIAS_NONE, BIAS_ROWS, BIAS_COLS = 0, 1, 2

#: Layer kinds that copy their input at inference and need no kernel.
IDENTITY_KINDS: frozenset[str] = frozenset({"dropout", "cost"})

# Layers whose activation key is applied by a separate activation kernel after the layer
# (convolutional and connected fuse elementwise activations into the GEMM epilogue).
_ACTIVATED = ("shortcut", "scale_channels", "sam")
_ANY_ACTIVATION = ("convolutional", "connected", *_ACTIVATED)

_ELEMENTS = Grid(("n",), (256,))
_SPATIAL_3D = Grid(("spatial", "channels", "batch"), (64, 4, 1))
_PLANE_3D = Grid(("out_w", "out_h", "planes"), (16, 16, 1))
_GEMM_TILED = Grid(("N", "M", "slices"), (16, 16, 1), (32, 32, 1))
_GEMM_SIMD = Grid(("N", "M", "slices"), (128, 1, 1), (32, 32, 1))
_IO = ("args", "in:x", "out:y")
_GEMM_IO = ("args", "in:a", "in:b", "in:bias", "out:c")


def _gemm(trans: str, simd: bool) -> Kernel:
    layers = {"nn": ("convolutional",), "nt": ("connected",), "tn": ()}[trans]
    return Kernel(
        name=f"gemm_{trans}{'_simd' if simd else ''}_f32",
        source="gemm.metal",
        args="dm_gemm_args",
        buffers=_GEMM_IO,
        grid=_GEMM_SIMD if simd else _GEMM_TILED,
        layers=layers,
        requires="simdgroup_matrix" if simd else "",
    )


#: Every kernel, keyed by its Metal function name.
KERNELS: dict[str, Kernel] = {
    k.name: k
    for k in (
        Kernel(
            "activation_fwd_f32",
            "activation.metal",
            "dm_activation_args",
            _IO,
            _ELEMENTS,
            _ACTIVATED,
        ),
        *(
            Kernel(
                f"{variant}_fwd_f32",
                "activation.metal",
                "dm_normalize_channels_args",
                _IO,
                Grid(("spatial", "batch"), (64, 1)),
                _ANY_ACTIVATION,
            )
            for variant in (
                "normalize_channels",
                "normalize_channels_softmax",
                "normalize_channels_softmax_maxval",
            )
        ),
        Kernel(
            "im2col_fwd_f32",
            "im2col.metal",
            "dm_im2col_args",
            ("args", "in:image", "out:col"),
            Grid(("spatial", "rows", "slices"), (64, 4, 1)),
            ("convolutional",),
        ),
        *(_gemm(t, s) for s in (False, True) for t in ("nn", "nt", "tn")),
        Kernel("maxpool_fwd_f32", "pooling.metal", "dm_pool_args", _IO, _PLANE_3D, ("maxpool",)),
        Kernel(
            "local_avgpool_fwd_f32",
            "pooling.metal",
            "dm_pool_args",
            _IO,
            _PLANE_3D,
            ("local_avgpool",),
        ),
        Kernel(
            "maxpool_depth_fwd_f32",
            "pooling.metal",
            "dm_maxpool_depth_args",
            _IO,
            Grid(("spatial", "out_channels", "batch"), (64, 4, 1)),
            ("maxpool",),
        ),
        Kernel(
            "avgpool_fwd_f32",
            "pooling.metal",
            "dm_avgpool_args",
            _IO,
            Grid(("planes",), (64,)),
            ("avgpool",),
        ),
        Kernel("route_fwd_f32", "route.metal", "dm_route_args", _IO, _SPATIAL_3D, ("route",)),
        Kernel(
            "shortcut_weights_fwd_f32",
            "combine.metal",
            "dm_shortcut_weights_args",
            ("args", "in:weights", "out:table"),
            Grid(("channels",), (64,)),
            ("shortcut",),
        ),
        Kernel(
            "shortcut_fwd_f32",
            "combine.metal",
            "dm_shortcut_args",
            ("args", "in:x", "in:source", "in:table", "out:y"),
            _SPATIAL_3D,
            ("shortcut",),
        ),
        Kernel(
            "scale_channels_fwd_f32",
            "combine.metal",
            "dm_scale_channels_args",
            ("args", "in:x_from", "in:scale", "out:y"),
            _SPATIAL_3D,
            ("scale_channels",),
        ),
        Kernel(
            "sam_fwd_f32",
            "combine.metal",
            "dm_sam_args",
            ("args", "in:x_from", "in:x", "out:y"),
            _ELEMENTS,
            ("sam",),
        ),
        Kernel(
            "upsample_fwd_f32",
            "resample.metal",
            "dm_upsample_args",
            _IO,
            _PLANE_3D,
            ("upsample",),
        ),
        Kernel(
            "reorg_fwd_f32",
            "resample.metal",
            "dm_reorg_args",
            _IO,
            Grid(("width", "height", "slices"), (16, 16, 1)),
            ("reorg",),
        ),
        Kernel(
            "softmax_fwd_f32",
            "heads.metal",
            "dm_softmax_args",
            _IO,
            Grid(("rows",), (64,)),
            ("softmax",),
        ),
        Kernel(
            "yolo_fwd_f32",
            "heads.metal",
            "dm_yolo_args",
            _IO,
            Grid(("spatial", "channels", "batch"), (64, 4, 1)),
            ("yolo",),
        ),
    )
}


def kernel(name: str) -> Kernel:
    """The registry entry of kernel ``name``; KeyError naming the known kernels otherwise."""
    try:
        return KERNELS[name]
    except KeyError:
        raise KeyError(f"unknown Metal kernel {name!r}; known: {sorted(KERNELS)}") from None


def kernels_for(kind: str) -> tuple[Kernel, ...]:
    """The kernels that implement the forward pass of Darknet layer kind ``kind`` (e.g.
    ``"convolutional"``), in registry order; empty for identity kinds (dropout, cost).

    The host picks among them by the layer's options (maxpool_depth, a channel activation,
    simdgroup_matrix support). Raises KeyError for a kind no kernel serves.
    """
    if kind in IDENTITY_KINDS:
        return ()
    found = tuple(k for k in KERNELS.values() if kind in k.layers)
    if not found:
        raise KeyError(f"no Metal kernel serves layer kind {kind!r}")
    return found
