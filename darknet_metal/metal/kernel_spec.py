"""The language Metal kernels are described in: argument structs, buffer roles with their
extents, grid rules, and the checks a dispatch goes through before anything is encoded.

``darknet_metal.metal.registry`` declares every kernel of ``shaders/*.metal`` with these types
(``Kernel``: Metal function name, ``.metal`` file, argument struct, buffers in index order,
grid rule); this module knows nothing of any particular kernel.

Argument structs (``ArgsStruct``): ``parse_args_header`` reads the ``dm_<op>_args`` structs of
``shaders/dm_args.h`` from the header itself, so the host packs exactly what the shaders
declare (tests check that layout against what a C compiler sees).

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

Grid rules (``Grid``): the host dispatches with ``dispatchThreads`` over ``axes``, named sizes
given in x, y, z order. Without ``tile`` there is one thread per element and the threadgroup
is ``group`` (edge groups may be partial: every kernel guards its bounds). With ``tile``, each
threadgroup of ``group`` threads covers ``tile`` elements per axis, so the grid is
``ceil(size / tile) * group`` threads per axis and every group is full (those kernels use
threadgroup barriers). ``Grid.dispatch`` computes both.
"""

from __future__ import annotations

import ast
import difflib
import functools
import math
import re
import struct
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any

from darknet_metal.errors import ArgumentError, BindingError

__all__ = [
    "ArgsStruct",
    "Binding",
    "BindingError",
    "Expr",
    "Grid",
    "Kernel",
    "parse_args_header",
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
    kernel needs beyond Metal 2.4 ("simdgroup_matrix": Apple7 family and later).
    ``flops``: an expression (the extents' grammar) of the floating-point operations of a
    dispatch, for profiles; empty for kernels that only move data or whose arithmetic is
    negligible beside their memory traffic (profiles judge those by bandwidth)."""

    name: str
    source: str
    args: str
    bindings: tuple[Binding, ...]
    grid: Grid
    requires: str = ""
    flops: str = ""

    def __post_init__(self) -> None:
        roles = self.roles
        if len(set(roles)) != len(roles):
            raise ValueError(f"{self.name}: duplicate roles in {roles}")
        if self.flops:
            _expr(self.flops)

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

    def work(self, args: Mapping[str, int | float], sizes: Mapping[str, int]) -> tuple[int, int]:
        """(floating-point operations, bytes moved) of a dispatch with these argument values
        and grid sizes: ``flops`` evaluated, and every role's extent in bytes, counted once
        for a role read and once more for a role written (the least traffic the dispatch
        can have: each element it may touch, moved once each way)."""
        values = {**sizes, **args}
        extents = self.extents(args, sizes)
        read, written = self.accesses(args, sizes)
        moved = sum(self.binding(r).itemsize * extents[r] for r in read)
        moved += sum(self.binding(r).itemsize * extents[r] for r in written)
        flops = max(0, _expr(self.flops)(values)) if self.flops else 0
        return flops, moved

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
