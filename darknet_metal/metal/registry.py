"""The Metal kernel registry: every kernel in ``shaders/*.metal``, declared once as data.

For each kernel: its Metal function name (the registry key,
``<op>_<direction>[_<part>]_<dtype>`` or a direction-free op such as ``gemm_nn_f32``; the
direction is ``fwd`` or ``bwd`` for a layer's forward or backward pass, ``upd`` for an optimizer
update such as ``sgd_upd_f32``, ``buf`` for a buffer utility such as ``fill_buf_f32``; the dtype
is that of the data the kernel computes on), the ``.metal`` file defining it, its argument
struct (``shaders/dm_args.h``, read from the header itself so the host packs exactly what the
shaders declare; tests check that layout against what a C compiler sees), its buffers in index
order and the grid rule (what the host dispatches over). Which kernels a layer uses is its
op's business (``darknet_metal.ops``), not the registry's.

Buffers (``Binding``): buffer 0 is always the argument struct; every other index has a role
name (the kernel's parameter name) and a direction: ``in`` (read), ``out`` (written) or
``inout`` (read and written, e.g. a GEMM accumulating into ``c``; ``read_if`` names the field,
``beta``, without which its old contents are ignored), inputs before outputs. Hosts
bind buffers by role with ``Kernel.bind`` rather than by position: a positional list silently
accepts two operands in the wrong order, and a kernel given too short a buffer reads or writes
past its end without any error on the GPU.

Each role declares its extent: an integer expression over the argument-struct fields and the
grid axis names (a field wins where both have the name) giving how many elements (of the
role's type: float, half, int or uint) the role must hold, that is the largest element
offset the kernel can touch, plus one, for those arguments. Expressions use only
``+ - * //``, parentheses, integer literals, names and ``max``/``min`` calls, and are evaluated by
walking their syntax tree, not by ``eval``, so a declaration is data that can never run
code. A role the kernel touches only under a condition declares it as ``used_if``, an
expression that is zero when the kernel leaves the role alone (a GEMM's bias with
``bias_mode = DM_BIAS_NONE``, the weight table of an unweighted shortcut): there, and only
there, the role may be given as ``None`` (the dispatch must still bind some buffer at that
index: Metal's validation wants every index bound). ``Kernel.bind`` raises ``BindingError``
for a missing or unknown role, ``None`` where the kernel touches the role, or a buffer
(anything with ``nbytes``) holding fewer bytes than the element size times the extent.
Forward kernels listed in ``HALF_TWINS`` also exist for half storage (``_f16``), declared
from their float twins.

Grid rules (``Grid``): the host dispatches with ``dispatchThreads`` over ``axes``, named sizes
given in x, y, z order. Without ``tile`` there is one thread per element and the threadgroup
is ``group`` (edge groups may be partial: every kernel guards its bounds). With ``tile``, each
threadgroup of ``group`` threads covers ``tile`` elements per axis, so the grid is
``ceil(size / tile) * group`` threads per axis and every group is full (those kernels use
threadgroup barriers). ``Grid.dispatch`` computes both.
"""

from __future__ import annotations

import ast
import dataclasses
import difflib
import functools
import math
import re
import struct
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any

from darknet_metal.errors import ArgumentError, BindingError
from darknet_metal.metal.sources import shader_header

__all__ = [
    "ARGS",
    "BIAS_COLS",
    "BIAS_NONE",
    "BIAS_ROWS",
    "KERNELS",
    "ArgsStruct",
    "Binding",
    "BindingError",
    "Expr",
    "Grid",
    "Kernel",
    "kernel",
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
            raise ArgumentError(f"{self.name}: missing fields {missing}, unknown fields {extra}")
        out = []
        for name, kind in self.fields:
            v = values[name]
            if kind == "f32":
                out.append(float(v))
                continue
            if isinstance(v, float) and not float(v).is_integer():
                raise ArgumentError(f"{self.name}.{name} must be an integer, got {v!r}")
            v = int(v)
            lo, hi = (0, 2**32 - 1) if kind == "u32" else (-(2**31), 2**31 - 1)
            if not lo <= v <= hi:
                raise ArgumentError(f"{self.name}.{name}={v} does not fit in {kind}")
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
            raise ArgumentError(f"grid axes are {self.axes}, got {tuple(sizes)}")
        for axis, n in sizes.items():
            if n < 1:
                raise ArgumentError(f"grid axis {axis}={n} must be >= 1")
        grid = []
        for i, axis in enumerate(self.axes):
            n = sizes[axis]
            grid.append(n if self.tile is None else -(-n // self.tile[i]) * self.group[i])
        pad = (1, 1, 1)
        return (tuple((*grid, *pad)[:3]), tuple((*self.group, *pad)[:3]))  # type: ignore[return-value]


_BINARY: dict[type, Callable[[int, int], int]] = {
    ast.Add: lambda a, b: a + b,
    ast.Sub: lambda a, b: a - b,
    ast.Mult: lambda a, b: a * b,
    ast.FloorDiv: lambda a, b: a // b,
}
_CALLS: dict[str, Callable[..., int]] = {"max": max, "min": min}


class Expr:
    """An integer expression of the registry (an extent or a ``used_if`` condition).

    ``Expr(text)`` raises ValueError unless ``text`` uses only ``+ - * //``, parentheses,
    integer literals, names and ``max``/``min`` calls. Calling it with a mapping of names to
    integers evaluates it; a missing name raises KeyError, a division by zero
    ZeroDivisionError.
    """

    __slots__ = ("names", "text", "_tree")

    def __init__(self, text: str) -> None:
        try:
            tree = ast.parse(text.strip(), mode="eval").body
        except SyntaxError as e:
            raise ValueError(f"expression {text!r}: {e.msg}") from None
        found: list[ast.Name] = []
        self._check(tree, text, found)
        self.text = text
        self._tree = tree
        #: Names the expression reads, in order of first appearance.
        self.names: tuple[str, ...] = tuple(
            dict.fromkeys(n.id for n in sorted(found, key=lambda n: (n.lineno, n.col_offset)))
        )

    @classmethod
    def _check(cls, node: ast.AST, text: str, names: list[ast.Name]) -> None:
        if isinstance(node, ast.BinOp) and type(node.op) in _BINARY:
            cls._check(node.left, text, names)
            cls._check(node.right, text, names)
        elif isinstance(node, ast.UnaryOp) and isinstance(node.op, ast.USub):
            cls._check(node.operand, text, names)
        elif isinstance(node, ast.Constant) and type(node.value) is int:
            pass
        elif isinstance(node, ast.Name) and node.id not in _CALLS:
            names.append(node)
        elif (
            isinstance(node, ast.Call)
            and isinstance(node.func, ast.Name)
            and node.func.id in _CALLS
            and node.args
            and not node.keywords
            and not any(isinstance(a, ast.Starred) for a in node.args)
        ):
            for a in node.args:
                cls._check(a, text, names)
        else:
            raise ValueError(
                f"expression {text!r}: {ast.unparse(node)!r} is not allowed (only + - * //, "
                "parentheses, integer literals, names and max/min calls)"
            )

    def __call__(self, values: Mapping[str, int | float]) -> int:
        return self._eval(self._tree, values)

    @classmethod
    def _eval(cls, node: ast.AST, values: Mapping[str, int | float]) -> int:
        if isinstance(node, ast.BinOp):
            op = _BINARY[type(node.op)]
            return op(cls._eval(node.left, values), cls._eval(node.right, values))
        if isinstance(node, ast.UnaryOp):
            return -cls._eval(node.operand, values)
        if isinstance(node, ast.Constant):
            return int(node.value)
        if isinstance(node, ast.Name):
            return int(values[node.id])
        assert isinstance(node, ast.Call) and isinstance(node.func, ast.Name)
        return _CALLS[node.func.id](*(cls._eval(a, values) for a in node.args))

    def __repr__(self) -> str:
        return f"Expr({self.text!r})"


@functools.cache
def _expr(text: str) -> Expr:
    return Expr(text)


_DIRECTIONS = ("in", "out", "inout")
#: Role element types -> the NumPy dtype a host array bound there must have.
_ELEMENT_TYPES = {"f32": "float32", "f16": "float16", "i32": "int32", "u32": "uint32"}
_ITEMSIZE = {"f32": 4, "f16": 2, "i32": 4, "u32": 4}
_VERBS = {"in": "reads", "out": "writes", "inout": "reads and writes"}


@dataclass(frozen=True)
class Binding:
    """One buffer of a kernel: ``direction`` ("in", "out" or "inout"), ``role`` (the kernel's
    parameter name), ``extent`` (floats it must hold) and ``used_if`` (empty: always touched);
    see the module docstring."""

    direction: str
    role: str
    extent: str
    used_if: str = ""
    #: For an inout role: the argument field whose non-zero value makes the kernel read the
    #: role's old contents (empty: always read). A role not read need not be initialised.
    read_if: str = ""
    #: The element type: "f32" (float), "f16" (half), "i32" (int) or "u32" (uint); extents
    #: count elements, of ``itemsize`` bytes. ``bind`` refuses a NumPy array of another type.
    dtype: str = "f32"

    def __post_init__(self) -> None:
        if self.direction not in _DIRECTIONS:
            raise ValueError(
                f"role {self.role!r}: direction {self.direction!r} is not one of {_DIRECTIONS}"
            )
        if not self.role.isidentifier() or self.role == "args":
            raise ValueError(f"bad role name {self.role!r}")
        if self.dtype not in _ELEMENT_TYPES:
            raise ValueError(f"role {self.role!r}: dtype {self.dtype!r} is not one of "
                             f"{sorted(_ELEMENT_TYPES)}")
        _expr(self.extent)
        if self.used_if:
            _expr(self.used_if)

    @property
    def numpy_dtype(self) -> str:
        """The NumPy dtype of the role's elements ("float32", "float16", "int32", "uint32")."""
        return _ELEMENT_TYPES[self.dtype]

    @property
    def itemsize(self) -> int:
        """Bytes per element."""
        return _ITEMSIZE[self.dtype]

    @property
    def reads(self) -> bool:
        return self.direction != "out"

    @property
    def writes(self) -> bool:
        return self.direction != "in"


@dataclass(frozen=True)
class Kernel:
    """One kernel function: see the module docstring. ``requires`` names a GPU feature the
    kernel needs beyond Metal 2.4 ("simdgroup_matrix": Apple7 family and later)."""

    name: str
    source: str
    args: str
    bindings: tuple[Binding, ...]
    grid: Grid
    requires: str = ""

    def __post_init__(self) -> None:
        roles = self.roles
        if len(set(roles)) != len(roles):
            raise ValueError(f"{self.name}: duplicate roles in {roles}")

    @property
    def buffers(self) -> tuple[str, ...]:
        """``"args"`` then ``"<direction>:<role>"`` for each buffer index."""
        return ("args", *(f"{b.direction}:{b.role}" for b in self.bindings))

    @property
    def roles(self) -> tuple[str, ...]:
        """Role names in buffer index order (index 1 on; buffer 0 is the argument struct)."""
        return tuple(b.role for b in self.bindings)

    @property
    def inputs(self) -> tuple[str, ...]:
        """Roles the kernel reads ("in" and "inout")."""
        return tuple(b.role for b in self.bindings if b.reads)

    @property
    def outputs(self) -> tuple[str, ...]:
        """Roles the kernel writes ("out" and "inout")."""
        return tuple(b.role for b in self.bindings if b.writes)

    def accesses(
        self, args: Mapping[str, int | float], sizes: Mapping[str, int]
    ) -> tuple[tuple[str, ...], tuple[str, ...]]:
        """(roles read, roles written) by a dispatch with these argument values and grid
        sizes: roles the kernel does not touch (``used_if``) and inout roles whose old
        contents it ignores (``read_if``) are not read."""
        values = {**sizes, **args}
        used = [b for b in self.bindings if self._used(b, values)]
        read = tuple(b.role for b in used
                     if b.reads and (not b.read_if or float(args[b.read_if]) != 0.0))
        return read, tuple(b.role for b in used if b.writes)

    def binding(self, role: str) -> Binding:
        """The declaration of ``role``; BindingError naming the kernel's roles otherwise."""
        for b in self.bindings:
            if b.role == role:
                return b
        raise BindingError(self._unknown(role))

    def _unknown(self, role: str) -> str:
        msg = f"{self.name}: unknown role {role!r}; its roles are {', '.join(self.roles)}"
        close = difflib.get_close_matches(role, self.roles, n=1)
        return msg + (f" (did you mean {close[0]!r}?)" if close else "")

    def _value(self, b: Binding, text: str, values: Mapping[str, int | float]) -> int:
        try:
            return _expr(text)(values)
        except KeyError as e:
            raise BindingError(
                f"{self.name}: role {b.role!r} needs {e.args[0]!r} ({text}), which is neither "
                "in the arguments nor in the grid sizes"
            ) from None
        except ZeroDivisionError:
            raise BindingError(
                f"{self.name}: the extent of role {b.role!r} divides by zero with "
                f"{_show(_expr(text), values)}"
            ) from None

    def _used(self, b: Binding, values: Mapping[str, int | float]) -> bool:
        return not b.used_if or self._value(b, b.used_if, values) != 0

    def extents(self, args: Mapping[str, int | float], sizes: Mapping[str, int]) -> dict[str, int]:
        """Floats each role must hold for these argument values and grid sizes (0 for a role
        the kernel does not touch with them). Raises BindingError for a value the
        declarations need but neither mapping gives, or a division by zero."""
        values = {**sizes, **args}
        return {
            b.role: max(0, self._value(b, b.extent, values)) if self._used(b, values) else 0
            for b in self.bindings
        }

    def bind(
        self,
        buffers: Mapping[str, Any],
        args: Mapping[str, int | float],
        sizes: Mapping[str, int],
    ) -> tuple[Any, ...]:
        """The buffers of roles ``buffers`` in index order (buffer 1 on), for a dispatch with
        argument values ``args`` and grid sizes ``sizes``.

        Raises BindingError for a missing or unknown role, a ``None`` where the kernel
        touches the role (see ``Binding.used_if``), or a buffer with ``nbytes`` (shim
        ``Buffer``, NumPy array) smaller than the role's element size times its extent, or an array
        whose ``dtype`` is not the role's element type. Objects without ``nbytes`` are passed
        through unchecked.
        """
        for role in buffers:
            if role not in self.roles:
                raise BindingError(self._unknown(role))
        values = {**sizes, **args}
        bound = []
        for b in self.bindings:
            if b.role not in buffers:
                raise BindingError(
                    f"{self.name}: no buffer for role {b.role!r}; its roles are "
                    f"{', '.join(self.roles)}"
                )
            buf = buffers[b.role]
            if not self._used(b, values):
                bound.append(buf)
                continue
            if buf is None:
                when = f" with {_show(_expr(b.used_if), values)}" if b.used_if else ""
                raise BindingError(
                    f"{self.name}: role {b.role!r} is None but the kernel "
                    f"{_VERBS[b.direction]} it{when}"
                )
            dtype = getattr(buf, "dtype", None)
            if dtype is not None and str(dtype) != b.numpy_dtype:
                raise BindingError(
                    f"{self.name}: role {b.role!r} holds {b.numpy_dtype} elements, not {dtype}"
                )
            held = getattr(buf, "nbytes", None)
            if held is not None:
                expr = _expr(b.extent)
                need = b.itemsize * max(0, self._value(b, b.extent, values))
                if held < need:
                    raise BindingError(
                        f"{self.name}: buffer for role {b.role!r} holds {held} bytes; "
                        f"{_show(expr, values)} needs {need}"
                    )
            bound.append(buf)
        return tuple(bound)


def _show(expr: Expr, values: Mapping[str, int | float]) -> str:
    return " ".join(f"{n}={values[n]}" for n in expr.names if n in values)


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

_ELEMENTS = Grid(("n",), (256,))
_SPATIAL_3D = Grid(("spatial", "channels", "batch"), (64, 4, 1))
_PLANE_3D = Grid(("out_w", "out_h", "planes"), (16, 16, 1))
_GEMM_TILED = Grid(("N", "M", "slices"), (16, 16, 1), (32, 32, 1))
_GEMM_SIMD = Grid(("N", "M", "slices"), (128, 1, 1), (32, 32, 1))


def _in(role: str, extent: str, used_if: str = "") -> Binding:
    return Binding("in", role, extent, used_if)


def _out(role: str, extent: str) -> Binding:
    return Binding("out", role, extent)


def _inout(role: str, extent: str) -> Binding:
    return Binding("inout", role, extent)


def _io(x: str, y: str) -> tuple[Binding, ...]:
    return (_in("x", x), _out("y", y))


def _flag(name: str) -> str:
    """1 when the u32 field ``name`` is nonzero (the kernels test ``!= 0u``), else 0."""
    return f"min({name}, 1)"


def _equals(name: str, value: int) -> str:
    """1 when ``name == value``, else 0: the grammar has no comparisons."""
    return f"(1 - min(1, max({name} - {value}, {value} - {name})))"


def _slice_offset(operand: str) -> str:
    """Largest offset zb*<operand>_batch_stride + zg*<operand>_group_stride over the GEMM's
    slices z < slices, (zb, zg) = (z // groups, z % groups). With all strides unsigned it is
    the last slice, or the last group of the previous image when the last image is partial."""
    last = "(slices - 1) // groups"
    batch, group = f"{operand}_batch_stride", f"{operand}_group_stride"
    return (
        f"max(({last})*{batch} + (slices - 1 - ({last})*groups)*{group}, "
        f"min({last}, 1)*(({last} - 1)*{batch} + (groups - 1)*{group}))"
    )


def _gemm(trans: str, simd: bool) -> Kernel:
    # op(A)[r, k] is a[r*lda + k], or a[k*lda + r] stored transposed; likewise op(B)[k, n].
    a_span = "(K - 1)*lda + M" if trans[0] == "t" else "(M - 1)*lda + K"
    b_span = "(N - 1)*ldb + K" if trans[1] == "t" else "(K - 1)*ldb + N"
    # The epilogue adds bias[zg*bias_group_stride + r] (rows) or [... + n] (columns).
    bias = (
        f"min(M, N, 1)*((min(groups, slices) - 1)*bias_group_stride "
        f"+ {_equals('bias_mode', BIAS_ROWS)}*M + {_equals('bias_mode', BIAS_COLS)}*N)"
    )
    return Kernel(
        name=f"gemm_{trans}{'_simd' if simd else ''}_f32",
        source="gemm.metal",
        args="dm_gemm_args",
        bindings=(
            # Loads are guarded by r < M, k < K and n < N: an empty operand is not read.
            _in("a", f"min(M, K, 1)*({_slice_offset('a')} + {a_span})"),
            _in("b", f"min(K, N, 1)*({_slice_offset('b')} + {b_span})"),
            _in("bias", bias, used_if="bias_mode"),
            # Read (beta != 0) and written in place: one thread per element does both.
            Binding("inout", "c", f"min(M, N, 1)*({_slice_offset('c')} + (M - 1)*ldc + N)",
                    read_if="beta"),
        ),
        grid=_GEMM_SIMD if simd else _GEMM_TILED,
        requires="simdgroup_matrix" if simd else "",
    )


# reorg_fwd_f32's "large" side, read as (channels/s^2, height*s, width*s) per image: the sum
# of each index term's largest value (exactly batch*channels*height*width when s^2 divides
# channels, which the layer requires; larger otherwise, where the kernel overruns it).
_REORG_SMALL = "batch*channels*height*width"
_REORG_LARGE = (
    "width*stride + width*stride*((height - 1)*stride "
    "+ ((channels - 1)//(channels//(stride*stride)))//stride) "
    "+ width*height*stride*stride*((channels//(stride*stride))*batch - 1)"
)

#: The inference kernels.
_FORWARD: tuple[Kernel, ...] = (
    Kernel(
        "activation_fwd_f32",
        "activation.metal",
        "dm_activation_args",
        _io("n", "n"),
        _ELEMENTS,
    ),
    *(
        Kernel(
            f"{variant}_fwd_f32",
            "activation.metal",
            "dm_normalize_channels_args",
            _io("batch*channels*spatial", "batch*channels*spatial"),
            Grid(("spatial", "batch"), (64, 1)),
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
        # Slice z reads input slice z whole at most and writes its column matrix whole.
        (
            _in("image", "slices*channels*height*width"),
            _out("col", "slices*channels*ksize*ksize*out_h*out_w"),
        ),
        Grid(("spatial", "rows", "slices"), (64, 4, 1)),
    ),
    *(_gemm(t, s) for s in (False, True) for t in ("nn", "nt", "tn")),
    Kernel(
        "maxpool_fwd_f32",
        "pooling.metal",
        "dm_pool_args",
        _io("planes*height*width", "planes*out_h*out_w"),
        _PLANE_3D,
    ),
    Kernel(
        "maxpool_depth_fwd_f32",
        "pooling.metal",
        "dm_maxpool_depth_args",
        _io("batch*channels*spatial", "batch*out_channels*spatial"),
        Grid(("spatial", "out_channels", "batch"), (64, 4, 1)),
    ),
    Kernel(
        "avgpool_fwd_f32",
        "pooling.metal",
        "dm_avgpool_args",
        _io("planes*spatial", "planes"),
        Grid(("planes",), (64,)),
    ),
    Kernel(
        "route_fwd_f32",
        "route.metal",
        "dm_route_args",
        # One source's channel slice into its place in the output: the last image's
        # slice ends the touched range on both sides.
        _io(
            "((batch - 1)*src_channels + src_offset + channels)*spatial",
            "((batch - 1)*dst_channels + dst_offset + channels)*spatial",
        ),
        _SPATIAL_3D,
    ),
    Kernel(
        "shortcut_weights_fwd_f32",
        "combine.metal",
        "dm_shortcut_weights_args",
        (
            _in("weights", f"n_inputs*max(1, {_flag('per_channel')}*channels)"),
            _out("table", "n_inputs*channels"),
        ),
        Grid(("channels",), (64,)),
    ),
    Kernel(
        "shortcut_fwd_f32",
        "combine.metal",
        "dm_shortcut_args",
        (
            _in("x", "batch*channels*spatial"),
            # Only the first min(channels, src_channels) channels of a source are added.
            _in(
                "source",
                "((batch - 1)*src_channels + min(channels, src_channels))*spatial",
            ),
            # Row 0 (x's weights) when first, row `source` for the source's channels.
            _in(
                "table",
                f"max({_flag('first')}*channels, min(channels, src_channels, 1)"
                "*(source*channels + min(channels, src_channels)))",
                used_if="weighted",
            ),
            _out("y", "batch*channels*spatial"),
        ),
        _SPATIAL_3D,
    ),
    Kernel(
        "scale_channels_fwd_f32",
        "combine.metal",
        "dm_scale_channels_args",
        (
            _in("x_from", "batch*channels*spatial"),
            _in(
                "scale",
                f"batch*max({_flag('scale_wh')}*spatial, (1 - {_flag('scale_wh')})*channels)",
            ),
            _out("y", "batch*channels*spatial"),
        ),
        _SPATIAL_3D,
    ),
    Kernel(
        "sam_fwd_f32",
        "combine.metal",
        "dm_sam_args",
        (_in("x_from", "n"), _in("x", "n"), _out("y", "n")),
        _ELEMENTS,
    ),
    Kernel(
        "upsample_fwd_f32",
        "resample.metal",
        "dm_upsample_args",
        # stride > 0 reads pixel (j/s, i/s) of each plane; stride < 0 sums s x s blocks of
        # planes out_h*out_w*s*s long (stride 0 reads nothing).
        _io(
            "min(1, max(stride, 0))*(((planes - 1)*height + (out_h - 1)//max(stride, 1))"
            "*width + (out_w - 1)//max(stride, 1) + 1) "
            "+ min(1, max(0 - stride, 0))*planes*out_h*out_w*stride*stride",
            "planes*out_h*out_w",
        ),
        _PLANE_3D,
    ),
    Kernel(
        "reorg_fwd_f32",
        "resample.metal",
        "dm_reorg_args",
        # reverse=0 copies the large side (x) to the small side (y), reverse=1 the other way.
        _io(
            f"{_flag('reverse')}*{_REORG_SMALL} + (1 - {_flag('reverse')})*({_REORG_LARGE})",
            f"{_flag('reverse')}*({_REORG_LARGE}) + (1 - {_flag('reverse')})*{_REORG_SMALL}",
        ),
        Grid(("width", "height", "slices"), (16, 16, 1)),
    ),
    Kernel(
        "softmax_fwd_f32",
        "heads.metal",
        "dm_softmax_args",
        _io("rows*n", "rows*n"),
        Grid(("rows",), (64,)),
    ),
    Kernel(
        "yolo_fwd_f32",
        "heads.metal",
        "dm_yolo_args",
        _io("batch*anchors*(5 + classes)*spatial", "batch*anchors*(5 + classes)*spatial"),
        Grid(("spatial", "channels", "batch"), (64, 4, 1)),
    ),
)

# Training kernels of convolutional and connected layers (train_conv.metal); the weight and
# input gradients are GEMMs of gemm.metal.
_PER_CHANNEL = Grid(("channels",), (32,))  # one thread sums each channel, serially
_BN_VALUES = "batch*channels*spatial"

_CONV_TRAIN: tuple[Kernel, ...] = (
    Kernel(
        "col2im_bwd_f32",
        "train_conv.metal",
        "dm_im2col_args",
        # Slice z reads (at most) the whole column matrix of slice z and adds into its input.
        (
            _in("col", "slices*channels*ksize*ksize*out_h*out_w"),
            Binding("inout", "image", "slices*channels*height*width"),
        ),
        Grid(("spatial", "channels", "slices"), (64, 4, 1)),
    ),
    Kernel(
        "bias_bwd_f32",
        "train_conv.metal",
        "dm_bias_args",
        (_in("delta", "batch*channels*spatial"), Binding("inout", "bias_grad", "channels")),
        _PER_CHANNEL,
    ),
    Kernel(
        "batchnorm_fwd_stats_f32",
        "train_conv.metal",
        "dm_batchnorm_args",
        (
            _in("x", _BN_VALUES),
            _out("mean", "channels"),
            _out("variance", "channels"),
            Binding("inout", "rolling_mean", "channels"),
            Binding("inout", "rolling_variance", "channels"),
        ),
        _PER_CHANNEL,
    ),
    Kernel(
        "batchnorm_fwd_norm_f32",
        "train_conv.metal",
        "dm_batchnorm_args",
        (
            _in("x", _BN_VALUES),
            _in("mean", "channels"),
            _in("variance", "channels"),
            _in("scale", "channels"),
            _in("bias", "channels"),
            _out("x_norm", _BN_VALUES),
            _out("out", _BN_VALUES),
        ),
        _SPATIAL_3D,
    ),
    Kernel(
        "batchnorm_fwd_xnorm_f32",
        "train_conv.metal",
        "dm_batchnorm_args",
        (
            _in("x", _BN_VALUES),
            _in("mean", "channels"),
            _in("variance", "channels"),
            _out("x_norm", _BN_VALUES),
        ),
        _SPATIAL_3D,
    ),
    Kernel(
        "batchnorm_bwd_sums_f32",
        "train_conv.metal",
        "dm_batchnorm_args",
        (
            _in("delta", _BN_VALUES),
            _in("x", _BN_VALUES),
            _in("mean", "channels"),
            _in("variance", "channels"),
            _in("x_norm", _BN_VALUES),
            _in("scale", "channels"),
            Binding("inout", "scale_grad", "channels"),
            Binding("inout", "bias_grad", "channels"),
            _out("mean_delta", "channels"),
            _out("var_delta", "channels"),
        ),
        _PER_CHANNEL,
    ),
    Kernel(
        "batchnorm_bwd_delta_f32",
        "train_conv.metal",
        "dm_batchnorm_args",
        (
            _in("x", _BN_VALUES),
            _in("mean", "channels"),
            _in("variance", "channels"),
            _in("scale", "channels"),
            _in("mean_delta", "channels"),
            _in("var_delta", "channels"),
            Binding("inout", "delta", _BN_VALUES),
        ),
        _SPATIAL_3D,
    ),
)

# [yolo] training loss (yolo_loss.metal): four dispatches in order, see the file's comment.
_YOLO_DELTA = "batch*anchors*(5 + classes)*height*width"
_YOLO_PARTIALS = "batch*anchors*height*width*4"  # 4 sums per (image, anchor, cell)
_YOLO_IMAGES = "batch*10"  # 10 sums per image
_YOLO_CELLS = Grid(("spatial", "anchors", "batch"), (64, 1, 1))
_YOLO_INPUTS = (
    _in("output", _YOLO_DELTA),
    _in("truths", "batch*boxes*5"),
    _in("anchor_table", "2*total"),
    Binding("in", "mask", "anchors", dtype="i32"),
    _in("multipliers", "classes", used_if="counters"),
)

#: The [yolo] loss kernels.
_YOLO_TRAIN: tuple[Kernel, ...] = (
    Kernel(
        "yolo_loss_bwd_cells_f32",
        "yolo_loss.metal",
        "dm_yolo_loss_args",
        (*_YOLO_INPUTS, _out("delta", _YOLO_DELTA), _out("partials", _YOLO_PARTIALS)),
        _YOLO_CELLS,
    ),
    Kernel(
        "yolo_loss_bwd_truths_f32",
        "yolo_loss.metal",
        "dm_yolo_loss_args",
        (*_YOLO_INPUTS, Binding("inout", "delta", _YOLO_DELTA), _out("images", _YOLO_IMAGES)),
        Grid(("batch",), (32,)),
    ),
    Kernel(
        "yolo_loss_bwd_squares_f32",
        "yolo_loss.metal",
        "dm_yolo_loss_args",
        (Binding("inout", "delta", _YOLO_DELTA), _out("partials", _YOLO_PARTIALS)),
        _YOLO_CELLS,
    ),
    Kernel(
        "yolo_loss_bwd_stats_f32",
        "yolo_loss.metal",
        "dm_yolo_loss_args",
        # The 17 stats in YOLO_STAT_NAMES order (nothing is written for an empty batch).
        (_in("partials", _YOLO_PARTIALS), _in("images", _YOLO_IMAGES),
         _out("stats", "17*min(batch, 1)")),
        # One threadgroup: the host dispatches one = 1.
        Grid(("one",), (256,), (1,)),
    ),
)


#: The training kernels of the pooling, resampling, route, shortcut, scale_channels and sam
#: layers, and the loss heads' forward (shaders/train_layers.metal). Backward kernels add
#: into their gradient roles (inout).
_LAYERS_TRAIN: tuple[Kernel, ...] = (
    Kernel(
        "maxpool_fwd_train_f32",
        "train_layers.metal",
        "dm_pool_args",
        (
            _in("x", "planes*height*width"),
            _out("y", "planes*out_h*out_w"),
            Binding("out", "indexes", "planes*out_h*out_w", dtype="i32"),
        ),
        _PLANE_3D,
    ),
    Kernel(
        "maxpool_depth_fwd_train_f32",
        "train_layers.metal",
        "dm_maxpool_depth_args",
        (
            _in("x", "batch*channels*spatial"),
            _out("y", "batch*out_channels*spatial"),
            Binding("out", "indexes", "batch*out_channels*spatial", dtype="i32"),
        ),
        Grid(("spatial", "out_channels", "batch"), (64, 4, 1)),
    ),
    Kernel(
        "maxpool_bwd_f32",
        "train_layers.metal",
        "dm_pool_args",
        (
            _in("delta", "planes*out_h*out_w"),
            Binding("in", "indexes", "planes*out_h*out_w", dtype="i32"),
            Binding("inout", "x_grad", "planes*height*width"),
        ),
        Grid(("width", "height", "planes"), (16, 16, 1)),
    ),
    Kernel(
        "maxpool_depth_bwd_f32",
        "train_layers.metal",
        "dm_maxpool_depth_args",
        (
            _in("delta", "batch*out_channels*spatial"),
            Binding("in", "indexes", "batch*out_channels*spatial", dtype="i32"),
            Binding("inout", "x_grad", "batch*channels*spatial"),
        ),
        _SPATIAL_3D,
    ),
    Kernel(
        "avgpool_bwd_f32",
        "train_layers.metal",
        "dm_avgpool_args",
        (_in("delta", "planes"), Binding("inout", "x_grad", "planes*spatial")),
        Grid(("spatial", "planes"), (64, 4)),
    ),
    Kernel(
        "upsample_bwd_f32",
        "train_layers.metal",
        "dm_upsample_args",
        # stride > 0: input pixel (y, x) reads delta rows y*s.., columns x*s.. of its plane;
        # stride < 0: x_grad planes are out_h*out_w*s*s long, as the forward reads them.
        (
            _in(
                "delta",
                "min(1, max(stride, 0))*((planes - 1)*out_h*out_w "
                "+ (height*stride - 1)*out_w + width*stride) "
                "+ min(1, max(0 - stride, 0))*planes*out_h*out_w",
            ),
            Binding(
                "inout",
                "x_grad",
                "min(1, max(stride, 0))*planes*height*width "
                "+ min(1, max(0 - stride, 0))*planes*out_h*out_w*stride*stride",
            ),
        ),
        # cols, rows: the input's width and height (stride > 0) or the output's (< 0).
        Grid(("cols", "rows", "planes"), (16, 16, 1)),
    ),
    Kernel(
        "reorg_bwd_f32",
        "train_layers.metal",
        "dm_reorg_args",
        # The forward's extents with the sides swapped: delta is the forward's y.
        (
            _in(
                "delta",
                f"{_flag('reverse')}*({_REORG_LARGE}) + (1 - {_flag('reverse')})*{_REORG_SMALL}",
            ),
            Binding(
                "inout",
                "x_grad",
                f"{_flag('reverse')}*{_REORG_SMALL} + (1 - {_flag('reverse')})*({_REORG_LARGE})",
            ),
        ),
        Grid(("width", "height", "slices"), (16, 16, 1)),
    ),
    Kernel(
        "route_bwd_f32",
        "train_layers.metal",
        "dm_route_args",
        (
            _in("delta", "((batch - 1)*dst_channels + dst_offset + channels)*spatial"),
            Binding(
                "inout", "x_grad", "((batch - 1)*src_channels + src_offset + channels)*spatial"
            ),
        ),
        _SPATIAL_3D,
    ),
    Kernel(
        "shortcut_bwd_f32",
        "train_layers.metal",
        "dm_shortcut_bwd_args",
        (
            _in("delta", "((batch - 1)*channels + min(channels, src_channels))*spatial"),
            _in("table", "row*channels + min(channels, src_channels)", used_if="weighted"),
            Binding(
                "inout", "grad", "((batch - 1)*src_channels + min(channels, src_channels))*spatial"
            ),
        ),
        _SPATIAL_3D,
    ),
    Kernel(
        "shortcut_bwd_dot_f32",
        "train_layers.metal",
        "dm_shortcut_bwd_args",
        (
            _in("delta", "((batch - 1)*channels + min(channels, src_channels))*spatial"),
            _in("input", "((batch - 1)*src_channels + min(channels, src_channels))*spatial"),
            _out("partial", "(batch - 1)*channels + min(channels, src_channels)"),
        ),
        Grid(("channels", "batch"), (64, 4)),
    ),
    Kernel(
        "shortcut_bwd_weights_f32",
        "train_layers.metal",
        "dm_shortcut_wgrad_args",
        (
            _in("partial", "(batch - 1)*channels + min(channels, src_channels)"),
            Binding(
                "inout",
                "acc",
                f"{_flag('per_channel')}*(row + 1)*channels "
                f"+ (1 - {_flag('per_channel')})*(row + 1)",
                read_if="accumulate",
            ),
        ),
        Grid(("columns",), (64,)),
    ),
    Kernel(
        "shortcut_bwd_norm_f32",
        "train_layers.metal",
        "dm_shortcut_weights_args",
        (
            _in("weights", f"n_inputs*max(1, {_flag('per_channel')}*channels)"),
            _in("g", f"n_inputs*max(1, {_flag('per_channel')}*channels)"),
            Binding("inout", "weight_grad", f"n_inputs*max(1, {_flag('per_channel')}*channels)"),
        ),
        Grid(("columns",), (64,)),
    ),
    Kernel(
        "scale_channels_bwd_f32",
        "train_layers.metal",
        "dm_scale_channels_args",
        (
            _in("delta", "batch*channels*spatial"),
            _in(
                "scale",
                f"batch*max({_flag('scale_wh')}*spatial, (1 - {_flag('scale_wh')})*channels)",
            ),
            Binding("inout", "x_from_grad", "batch*channels*spatial"),
        ),
        _SPATIAL_3D,
    ),
    Kernel(
        "scale_channels_bwd_scale_f32",
        "train_layers.metal",
        "dm_scale_channels_args",
        (
            _in("delta", "batch*channels*spatial"),
            _in("x_from", "batch*channels*spatial"),
            Binding(
                "inout",
                "scale_grad",
                f"batch*max({_flag('scale_wh')}*spatial, (1 - {_flag('scale_wh')})*channels)",
            ),
        ),
        Grid(("factors",), (64,)),
    ),
    Kernel(
        "sam_bwd_f32",
        "train_layers.metal",
        "dm_sam_args",
        (
            _in("delta", "n"),
            _in("x_from", "n"),
            _in("x", "n"),
            Binding("inout", "x_from_grad", "n"),
            Binding("inout", "x_grad", "n"),
        ),
        _ELEMENTS,
    ),
    *(
        Kernel(
            name,
            "train_layers.metal",
            "dm_loss_args",
            (_in("pred", "n"), _in("truth", "n"), _out("delta", "n"), _out("loss", "n")),
            _ELEMENTS,
        )
        for name in ("softmax_fwd_xent_f32", "cost_fwd_sse_f32")
    ),
)


#: Training kernels that work element by element (train_elementwise.metal): activation
#: derivatives, buffer utilities, dropout and its draws, optimizer updates.
_ELEMENTWISE: tuple[Kernel, ...] = (
    Kernel(
        "activation_bwd_f32",
        "train_elementwise.metal",
        "dm_activation_args",
        (_in("y_or_x", "n"), _inout("delta", "n")),
        _ELEMENTS,
    ),
    *(
        Kernel(
            f"{variant}_bwd_f32",
            "train_elementwise.metal",
            "dm_normalize_channels_args",
            (_in("y", "batch*channels*spatial"), _inout("delta", "batch*channels*spatial")),
            Grid(("spatial", "batch"), (64, 1)),
        )
        for variant in (
            "normalize_channels",
            "normalize_channels_softmax",
            "normalize_channels_softmax_maxval",
        )
    ),
    Kernel("fill_buf_f32", "train_elementwise.metal", "dm_fill_args", (_out("x", "n"),), _ELEMENTS),
    Kernel(
        "copy_buf_f32",
        "train_elementwise.metal",
        "dm_copy_args",
        (_in("src", "n"), _out("dst", "n")),
        _ELEMENTS,
    ),
    Kernel(
        "add_buf_f32",
        "train_elementwise.metal",
        "dm_add_args",
        (_in("src", "n"), _inout("dst", "n")),
        _ELEMENTS,
    ),
    Kernel(
        "uniform_buf_f32",
        "train_elementwise.metal",
        "dm_uniform_args",
        # The 64-bit counter as two uint32 words, low first (a uint64 array's bytes).
        (Binding("in", "counter", "2*min(n, 1)", dtype="u32"), _out("rand", "n")),
        _ELEMENTS,
    ),
    Kernel(
        "uniform_buf_advance_f32",
        "train_elementwise.metal",
        "dm_counter_args",
        (Binding("inout", "counter", "2*count", dtype="u32"),),
        Grid(("count",), (32,)),
    ),
    *(
        Kernel(
            name,
            "train_elementwise.metal",
            "dm_dropout_args",
            (_in("rand", "n"), _inout(role, "n")),
            _ELEMENTS,
        )
        for name, role in (("dropout_fwd_train_f32", "x"), ("dropout_bwd_f32", "delta"))
    ),
    Kernel(
        "sgd_upd_f32",
        "train_elementwise.metal",
        "dm_sgd_args",
        (
            _in("lr", "min(n, 1)"),
            _inout("param", "n"),
            _inout("grad_acc", "n"),
        ),
        _ELEMENTS,
    ),
    Kernel(
        "adam_upd_f32",
        "train_elementwise.metal",
        "dm_adam_args",
        (
            _in("lr", "min(n, 1)"),
            _in("t", "min(n, 1)"),
            *(_inout(role, "n") for role in ("param", "grad_acc", "m", "v")),
        ),
        _ELEMENTS,
    ),
    Kernel(
        "finite_buf_f32",
        "train_elementwise.metal",
        "dm_finite_args",
        # The flag keeps its value unless the kernel finds a non-finite element.
        (_in("x", "n"), _inout("flag", "min(n, 1)")),
        _ELEMENTS,
    ),
)


#: Forward kernels that also exist for half storage (fp16 networks): the same template
#: instantiated for ``half`` in its shader, named with ``_f16`` for ``_f32``, every float
#: role holding half instead (sums stay float inside the kernels).
HALF_TWINS = (
    "activation_fwd_f32",
    "im2col_fwd_f32",
    "gemm_nn_f32",
    "gemm_nt_f32",
    "gemm_nn_simd_f32",
    "gemm_nt_simd_f32",
    "maxpool_fwd_f32",
    "route_fwd_f32",
    "upsample_fwd_f32",
    "yolo_fwd_f32",
    "copy_buf_f32",
    "shortcut_weights_fwd_f32",
    "shortcut_fwd_f32",
    "scale_channels_fwd_f32",
    "sam_fwd_f32",
    "maxpool_depth_fwd_f32",
    "avgpool_fwd_f32",
    "softmax_fwd_f32",
    "reorg_fwd_f32",
    "normalize_channels_fwd_f32",
    "normalize_channels_softmax_fwd_f32",
    "normalize_channels_softmax_maxval_fwd_f32",
)


def half_name(name: str) -> str:
    """The ``_f16`` twin's name of ``_f32`` kernel ``name``."""
    if not name.endswith("_f32"):
        raise ArgumentError(f"{name} is not a float32 kernel name")
    return name[: -len("_f32")] + "_f16"


def _half_twins(table: Mapping[str, Kernel]) -> tuple[Kernel, ...]:
    twins = []
    for name in HALF_TWINS:
        k = table[name]
        bindings = tuple(dataclasses.replace(b, dtype="f16") if b.dtype == "f32" else b
                         for b in k.bindings)
        twins.append(dataclasses.replace(k, name=half_name(name), bindings=bindings))
    return tuple(twins)


def _table(*groups: tuple[Kernel, ...]) -> dict[str, Kernel]:
    table: dict[str, Kernel] = {}
    for group in groups:
        for k in group:
            if k.name in table:
                raise ValueError(f"kernel {k.name} is declared twice")
            table[k.name] = k
    return table


#: Every kernel, keyed by its Metal function name.
_SINGLE = _table(_FORWARD, _CONV_TRAIN, _YOLO_TRAIN, _LAYERS_TRAIN, _ELEMENTWISE)
KERNELS: dict[str, Kernel] = _table(tuple(_SINGLE.values()), _half_twins(_SINGLE))


def kernel(name: str) -> Kernel:
    """The registry entry of kernel ``name``; KeyError naming the known kernels otherwise."""
    try:
        return KERNELS[name]
    except KeyError:
        raise KeyError(f"unknown Metal kernel {name!r}; known: {sorted(KERNELS)}") from None
