"""Kernel cases, and the one dispatcher that runs a case on a device against its reference.

A ``KernelCase`` is data: ``steps``, the dispatches of registry kernels in order (``Step``:
kernel, argument fields, grid sizes, and buffers by role, each naming one of the case's
arrays), and ``make``, which draws the case's arrays from a generator seeded by the case's
name and computes what the kernels must leave in them (``Check``: an array, its reference
and a tolerance). Arrays a kernel assigns start as NaN, so an element it forgets fails; arrays
a backward adds into start non-zero, so an assignment where an addition belongs fails.

``run_case`` uploads the arrays, packs each step through ``darknet_metal.metal.dispatch.pack``
(buffers bound by role and checked against the registry's extents), dispatches, reads back
every array a step writes or a check reads, and judges the checks. The table of cases is
``darknet_metal.diagnostics.kernel_cases.CASES``: ``darknet-metal doctor`` runs each once on
the user's device, tests/metal run each under the emulator's three thread orders.

A ``Step`` is checked against the registry when it is declared: an unknown kernel, a role
left unbound or unknown, an argument field missing or extra, or grid sizes the kernel's grid
does not have raise at once.
"""

from __future__ import annotations

import zlib
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Any, Protocol

import numpy as np

from darknet_metal.errors import ArgumentError
from darknet_metal.metal import registry
from darknet_metal.metal.dispatch import pack

__all__ = [
    "CaseData",
    "CaseResult",
    "Check",
    "Close",
    "Exact",
    "GPU_MATH_DEVICES",
    "KernelCase",
    "NCHW",
    "RelL2",
    "Step",
    "Tolerance",
    "Ulps",
    "dims",
    "judge",
    "max_abs_diff",
    "nan_filled",
    "nonzero",
    "normal",
    "rel_l2",
    "run_case",
    "ulps",
]


# ---- tolerances ----------------------------------------------------------------------------


class Tolerance(Protocol):
    """How close an output must be to its reference."""

    def holds(self, got: np.ndarray, want: np.ndarray) -> bool:
        """Whether ``got`` is close enough to ``want`` (of the same shape)."""
        ...

    def measure(self, got: np.ndarray, want: np.ndarray) -> str:
        """How far ``got`` is from ``want``, in the terms of this tolerance."""
        ...


@dataclass(frozen=True)
class Exact:
    """Bit for bit the reference, which must have the output's dtype (NaN payloads and signed
    zeros count)."""

    def holds(self, got: np.ndarray, want: np.ndarray) -> bool:
        return got.shape == want.shape and got.tobytes() == want.tobytes()

    def measure(self, got: np.ndarray, want: np.ndarray) -> str:
        return f"{int(np.count_nonzero(_bits(got) != _bits(want)))} elements differ"


@dataclass(frozen=True, eq=False)
class Close:
    """Elementwise ``|got - want| <= atol + rtol * |want|``, NaN only where the reference is
    NaN and infinities only where it has the same one (NumPy's ``assert_allclose``); ``atol``
    may be an array of per-element bounds."""

    rtol: float = 0.0
    atol: float | np.ndarray = 0.0

    def __repr__(self) -> str:
        atol = "per element" if np.ndim(self.atol) else self.atol
        return f"Close(rtol={self.rtol:g}, atol={atol:g})" if not np.ndim(self.atol) else (
            f"Close(rtol={self.rtol:g}, atol={atol})")

    def holds(self, got: np.ndarray, want: np.ndarray) -> bool:
        g, w = got.astype(np.float64), want.astype(np.float64)
        with np.errstate(invalid="ignore"):
            near = np.abs(g - w) <= self.atol + self.rtol * np.abs(w)
        return bool((near | (g == w) | (np.isnan(g) & np.isnan(w))).all())

    def measure(self, got: np.ndarray, want: np.ndarray) -> str:
        return f"max abs diff {max_abs_diff(got, want):.3g}"


@dataclass(frozen=True)
class RelL2:
    """``||got - want|| / ||want||`` below ``bound`` (the absolute L2 error where the reference
    is zero); a non-finite output fails."""

    bound: float

    def holds(self, got: np.ndarray, want: np.ndarray) -> bool:
        return bool(rel_l2(got, want) < self.bound)

    def measure(self, got: np.ndarray, want: np.ndarray) -> str:
        return f"relative L2 {rel_l2(got, want):.3g}"


@dataclass(frozen=True)
class Ulps:
    """Every float32 element at most ``most`` representable values from the reference's."""

    most: int

    def holds(self, got: np.ndarray, want: np.ndarray) -> bool:
        return bool((ulps(got, want) <= self.most).all())

    def measure(self, got: np.ndarray, want: np.ndarray) -> str:
        return f"{int(ulps(got, want).max(initial=0))} ulps apart"


def _bits(a: np.ndarray) -> np.ndarray:
    return a.reshape(-1).view(f"u{a.dtype.itemsize}")


def max_abs_diff(got: np.ndarray, want: np.ndarray) -> float:
    """The largest ``|got - want|`` (0 where both are NaN or the same infinity, infinite where
    only one is NaN)."""
    g, w = np.atleast_1d(np.asarray(got, np.float64)), np.asarray(want, np.float64)
    with np.errstate(invalid="ignore"):
        d = np.abs(g - w)
    d[(g == w) | (np.isnan(g) & np.isnan(w))] = 0.0
    d[np.isnan(d)] = np.inf
    return float(d.max(initial=0.0))


def rel_l2(got: np.ndarray, want: np.ndarray) -> float:
    """``||got - want|| / ||want||`` in float64 (``||got - want||`` where ``want`` is zero)."""
    g, w = np.asarray(got, np.float64).ravel(), np.asarray(want, np.float64).ravel()
    norm = float(np.linalg.norm(w))
    err = float(np.linalg.norm(g - w))
    return err / norm if norm else err


def ulps(got: np.ndarray, want: np.ndarray) -> np.ndarray:
    """Elementwise distance in float32 representable values (0 where both are NaN, the
    largest int64 where only one is)."""

    def ordered(x: np.ndarray) -> np.ndarray:
        i = np.asarray(x, np.float32).view(np.int32).astype(np.int64)
        return np.where(i < 0, -(i & 0x7FFFFFFF), i)

    g, w = np.asarray(got, np.float32), np.asarray(want, np.float32)
    dist = np.abs(ordered(g) - ordered(w))
    nan_g, nan_w = np.isnan(g), np.isnan(w)
    dist[nan_g & nan_w] = 0
    dist[nan_g ^ nan_w] = np.iinfo(np.int64).max
    return dist


# ---- cases ---------------------------------------------------------------------------------


@dataclass(frozen=True, eq=False)
class Step:
    """One dispatch of a case: ``kernel`` with argument fields ``args`` over grid ``sizes``,
    each role bound to the case array ``buffers[role]`` (``None``: a role the kernel does not
    touch with these arguments; no ``buffers``: every role binds the array of its own name),
    starting ``offsets[role]`` elements into it."""

    kernel: str
    args: Mapping[str, int | float]
    sizes: Mapping[str, int]
    buffers: Mapping[str, str | None] = field(default_factory=dict)
    offsets: Mapping[str, int] = field(default_factory=dict)

    def __post_init__(self) -> None:
        k = registry.kernel(self.kernel)
        if not self.buffers:
            object.__setattr__(self, "buffers", {role: role for role in k.roles})
        if set(self.buffers) != set(k.roles) or not set(self.offsets) <= set(k.roles):
            raise ArgumentError(f"{self.kernel}: a step binds {sorted(self.buffers)} with "
                                f"offsets into {sorted(self.offsets)}; the kernel's roles are "
                                f"{list(k.roles)}")
        registry.ARGS[k.args].pack(**self.args)
        k.grid.dispatch(**self.sizes)


@dataclass(frozen=True, eq=False)
class Check:
    """Array ``array`` (the part ``where`` of it, all by default), once every step has run,
    against ``want`` within ``tolerance``. ``gpu_math``: the tolerance instead on a GPU
    (``metal``, ``cuda``), whose exp, log and tanh may differ from the C library's that the
    reference and the emulator use in the last bits; set only for kernels that call them."""

    array: str
    want: np.ndarray
    tolerance: Tolerance
    where: Any = ...
    gpu_math: Tolerance | None = None

    def tolerance_on(self, device_kind: str) -> Tolerance:
        """The tolerance that holds on a device of kind ``device_kind``."""
        if self.gpu_math is not None and device_kind in GPU_MATH_DEVICES:
            return self.gpu_math
        return self.tolerance


#: Device kinds whose transcendental functions are not the host C library's.
GPU_MATH_DEVICES = ("metal", "cuda")


@dataclass(frozen=True, eq=False)
class CaseData:
    """A case's arrays as uploaded (every array a step names, of its role's element type)
    and its checks."""

    arrays: Mapping[str, np.ndarray]
    checks: tuple[Check, ...]


@dataclass(frozen=True, eq=False)
class KernelCase:
    """Registry kernels checked against a reference: see the module docstring."""

    name: str
    steps: tuple[Step, ...]
    make: Callable[[np.random.Generator], CaseData]

    @property
    def kernels(self) -> tuple[str, ...]:
        """The kernels the steps dispatch, in first-dispatch order."""
        return tuple(dict.fromkeys(s.kernel for s in self.steps))

    @property
    def seed(self) -> int:
        """The seed of the case's generator: a hash of its name, so that a case's inputs do
        not change when other cases are added or reordered."""
        return zlib.crc32(self.name.encode())

    def build(self) -> CaseData:
        """The case's arrays and checks, drawn from its own seed."""
        return self.make(np.random.default_rng(self.seed))


@dataclass(frozen=True, eq=False)
class CaseResult:
    """What running a case gave: the largest absolute difference of any check, each failed
    check described, and every array a step writes or a check reads, as read back."""

    name: str
    max_abs: float
    failures: tuple[str, ...]
    outputs: Mapping[str, np.ndarray]

    @property
    def ok(self) -> bool:
        return not self.failures


def run_case(device: Any, case: KernelCase, data: CaseData | None = None) -> CaseResult:
    """Run ``case`` on ``device`` (a shim ``Device``, or anything with its ``upload``,
    ``buffer`` and ``dispatch``) from ``data`` (default: ``case.build()``) and judge its
    checks. Raises BindingError where an array does not fit its role (type or extent)."""
    data = case.build() if data is None else data
    _check_bindings(case, data)
    written = {s.buffers[role] for s in case.steps
               for role in registry.kernel(s.kernel).outputs} - {None}
    read_back = written | {c.array for c in data.checks}
    buffers = {name: device.upload(np.ascontiguousarray(a)) for name, a in data.arrays.items()}
    # The dispatch binds some buffer at every index (Metal's validation and the emulator
    # refuse an unbound one), even where the kernel leaves the role alone.
    placeholder = device.buffer(4)
    try:
        for s in case.steps:
            k = registry.kernel(s.kernel)
            by_role = {role: None if name is None else buffers[name]
                       for role, name in s.buffers.items()}
            kernel, args, bound, grid, group = pack(s.kernel, by_role, s.args, s.sizes)
            bound = tuple(placeholder if b is None else b for b in bound)
            offsets = (tuple(b.itemsize * s.offsets.get(b.role, 0) for b in k.bindings)
                       if s.offsets else None)
            device.dispatch(kernel, args, bound, grid, group, offsets=offsets)
        outputs = {}
        for name in sorted(read_back):
            outputs[name] = np.empty_like(data.arrays[name])
            buffers[name].read_into(outputs[name])
    finally:
        for b in (*buffers.values(), placeholder):
            b.release()
    return judge(case.name, data.checks, outputs, getattr(device, "kind", "emu"))


def judge(name: str, checks: tuple[Check, ...], outputs: Mapping[str, np.ndarray],
          device_kind: str = "emu") -> CaseResult:
    """The result of case ``name`` whose steps left ``outputs`` on a device of kind
    ``device_kind``: every check judged."""
    failures, worst = [], 0.0
    for c in checks:
        tolerance = c.tolerance_on(device_kind)
        got = np.asarray(outputs[c.array][c.where])
        want = np.asarray(c.want)
        if isinstance(tolerance, Exact) and want.dtype != got.dtype:
            raise ArgumentError(f"{name}: the reference of {c.array} is {want.dtype}, the "
                                f"array {got.dtype}: bit equality needs one type")
        if got.shape != want.shape:
            raise ArgumentError(f"{name}: {c.array} checks {got.shape} against a reference "
                                f"of {want.shape}")
        worst = max(worst, max_abs_diff(got, want))
        if not tolerance.holds(got, want):
            part = "" if c.where is ... else f"[{c.where}]"
            failures.append(f"{c.array}{part}: {tolerance} does not hold "
                            f"({tolerance.measure(got, want)})")
    return CaseResult(name, worst, tuple(failures), dict(outputs))


def _check_bindings(case: KernelCase, data: CaseData) -> None:
    """Each step's arrays against its kernel's roles on the host, offsets included: the
    element type, and the extent from where the step starts."""
    for s in case.steps:
        views = {}
        for role, name in s.buffers.items():
            if name is not None and name not in data.arrays:
                raise ArgumentError(f"{case.name}: {s.kernel} binds {role} to {name!r}, which "
                                    f"is not one of the case's arrays {sorted(data.arrays)}")
            views[role] = (None if name is None
                           else data.arrays[name].reshape(-1)[s.offsets.get(role, 0):])
        registry.kernel(s.kernel).bind(views, s.args, s.sizes)


# ---- inputs --------------------------------------------------------------------------------


def normal(rng: np.random.Generator, shape: int | tuple[int, ...], scale: float = 1.0,
           offset: float = 0.0) -> np.ndarray:
    """float32 draws of ``scale * N(0, 1) + offset``."""
    return (rng.standard_normal(shape) * scale + offset).astype(np.float32)


def nonzero(rng: np.random.Generator, shape: int | tuple[int, ...]) -> np.ndarray:
    """float32 values of magnitude 0.5 to 2, either sign: what an array a kernel adds into
    starts as."""
    magnitude = rng.uniform(0.5, 2.0, shape)
    return (magnitude * rng.choice([-1.0, 1.0], shape)).astype(np.float32)


def nan_filled(shape: int | tuple[int, ...], dtype: Any = np.float32) -> np.ndarray:
    """An array a kernel assigns: NaN (or, of an integer type, a value no kernel writes)."""
    if np.issubdtype(np.dtype(dtype), np.integer):
        return np.full(shape, 12345, dtype)
    return np.full(shape, np.nan, dtype)


#: An (N, C, H, W) shape.
NCHW = tuple[int, int, int, int]


def dims(shape: tuple[int, ...]) -> str:
    """A shape as case names write it: ``2x7x5x3``."""
    return "x".join(map(str, shape))
