"""The Metal kernel registry: every forward kernel in ``shaders/*.metal``, declared once as data.

For each kernel: its Metal function name (the registry key, ``<op>_<fwd|bwd>[_<part>]_<dtype>``
or a direction-free op such as ``gemm_nn_f32``), the ``.metal`` file defining it, its argument
struct (``shaders/dm_args.h``, read from the header itself so the host packs exactly what the
shaders declare; tests check that layout against what a C compiler sees), the role of each
buffer in index order (buffer 0 is always the argument struct, then inputs, then outputs), the
grid rule (what the host dispatches over) and the Darknet layer kinds it serves.

Grid rules (``Grid``): the host dispatches with ``dispatchThreads`` over ``axes``, named sizes
given in x, y, z order. Without ``tile`` there is one thread per element and the threadgroup
is ``group`` (edge groups may be partial: every kernel guards its bounds). With ``tile``, each
threadgroup of ``group`` threads covers ``tile`` elements per axis, so the grid is
``ceil(size / tile) * group`` threads per axis and every group is full (those kernels use
threadgroup barriers). ``Grid.dispatch`` computes both.
"""

from __future__ import annotations

import math
import re
import struct
from dataclasses import dataclass

from darknet_metal.metal.sources import shader_header

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

    @property
    def roles(self) -> tuple[str, ...]:
        """Buffer role names in index order (the argument struct excluded)."""
        return tuple(b.split(":", 1)[1] for b in self.buffers if ":" in b)

    def bind(self, buffers, args, sizes) -> tuple:
        """The buffers in index order from role name -> buffer; BindingError for a missing or
        unknown role."""
        from darknet_metal.errors import BindingError

        missing = [r for r in self.roles if r not in buffers]
        unknown = sorted(set(buffers) - set(self.roles))
        if missing or unknown:
            raise BindingError(f"{self.name}: missing roles {missing}, unknown roles {unknown}; "
                               f"its roles are {list(self.roles)}")
        return tuple(buffers[r] for r in self.roles)


_C_KINDS = {"uint32_t": "u32", "int32_t": "i32", "float": "f32"}
_STRUCT = re.compile(r"typedef\s+struct\s+(dm_\w+_args)\s*\{(.*?)\}\s*\1\s*;", re.S)
_MEMBER = re.compile(r"^\s*(\w+)\s+(\w+)\s*;", re.M)


def parse_args_header(text: str) -> dict[str, ArgsStruct]:
    """The ``dm_<op>_args`` structs of ``shaders/dm_args.h``, fields in declaration order.

    The header is the one declaration shared by the shaders, the C shim and this host code;
    reading it here means the fields are never written twice. Raises ValueError for a member
    type other than uint32_t, int32_t and float.
    """
    structs = {}
    for name, body in _STRUCT.findall(re.sub(r"/\*.*?\*/", "", text, flags=re.S)):
        fields = []
        for ctype, field_name in _MEMBER.findall(body):
            if ctype not in _C_KINDS:
                raise ValueError(f"{name}.{field_name}: member type {ctype} is not one of "
                                 f"{', '.join(_C_KINDS)}")
            fields.append((field_name, _C_KINDS[ctype]))
        structs[name] = ArgsStruct(name, tuple(fields))
    return structs


def _read_args() -> dict[str, ArgsStruct]:
    with open(shader_header("dm_args.h"), encoding="utf-8") as f:
        return parse_args_header(f.read())


#: Argument structs, read from shaders/dm_args.h.
ARGS: dict[str, ArgsStruct] = _read_args()

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
