"""Builds every ``shaders/*.metal`` file into one emulator library (once per session, objects
cached by content hash) and dispatches registry kernels from NumPy arrays (``Runner``), or runs
the kernel cases there (``HarnessDevice``: a build other than the shim's, -ffast-math)."""

from __future__ import annotations

import hashlib
import os
import pathlib
import sys

import numpy as np

ROOT = pathlib.Path(__file__).resolve().parents[2]
SHADERS = ROOT / "shaders"
sys.path.insert(0, str(ROOT / "tests" / "emu"))

import emu_harness  # noqa: E402

from darknet_metal.metal import registry  # noqa: E402

ORDERS = ("forward", "reverse", "random")


def shader_files() -> list[pathlib.Path]:
    return sorted(SHADERS.glob("*.metal"))


def build_library(*, fast_math: bool = False) -> pathlib.Path:
    """The emulator library of all shaders. The shared headers are part of the cache key
    (the harness hashes only the .metal text), through a macro in the compile flags.

    ``fast_math``: compiled with ``-ffast-math`` (no NaN or infinity assumed, sums
    reassociated), the way Metal compiles by default: a kernel whose safety depends on
    IEEE semantics (a NaN test, an overflow guard written as a comparison with infinity)
    fails its tests there. The driver compiles the real library with fast math off.

    With DM_METAL_TEST_ASAN=1 the kernels are built with AddressSanitizer (run pytest with
    ``LD_PRELOAD=$(gcc -print-file-name=libasan.so) ASAN_OPTIONS=detect_leaks=0``)."""
    digest = hashlib.sha256()
    for header in sorted(SHADERS.glob("*.h")):
        digest.update(header.read_bytes())
    asan = os.environ.get("DM_METAL_TEST_ASAN", "") not in ("", "0")
    opt = emu_harness.ASAN_FLAGS if asan else emu_harness.OPT_FLAGS
    flags = [*opt, f"-I{SHADERS}", f"-DDM_HEADERS_KEY={digest.hexdigest()[:16]}"]
    if fast_math:
        flags.append("-ffast-math")
    return emu_harness.build(shader_files(), flags=flags)


class Runner:
    """Dispatches registry kernels in the emulator with their declared grid rule."""

    def __init__(self, emu: emu_harness.Emu) -> None:
        self.emu = emu

    def run(
        self,
        name: str,
        args: dict[str, int | float],
        buffers: dict[str, np.ndarray | None],
        sizes: dict[str, int],
        *,
        order: str = "forward",
        seed: int = 7,
    ) -> None:
        """Run kernel ``name``: pack ``args`` into its struct (buffer 0), bind ``buffers``
        (role -> C-contiguous array of the role's element type, float32 unless the registry
        says float16, int32 or uint32, used in place, or None where the kernel does not
        touch the role) through ``Kernel.bind``, which checks each array against the role's
        declared extent, and dispatch the grid its registry entry gives for ``sizes``."""
        k = registry.kernel(name)
        # The emulator, like Metal's validation layer, wants every index bound: a role the
        # kernel does not touch (None) gets a one-float placeholder.
        bound = [
            np.full(1, np.nan, np.float32) if b is None else b for b in k.bind(buffers, args, sizes)
        ]
        for b in bound:
            assert b.dtype.itemsize in (2, 4) and b.flags["C_CONTIGUOUS"], name
        packed = np.frombuffer(registry.ARGS[k.args].pack(**args), np.uint8).copy()
        grid, group = k.grid.dispatch(**sizes)
        self.emu.dispatch(name, [packed, *bound], grid, group, order=order, seed=seed)


class HostBuffer:
    """A device buffer of ``HarnessDevice``: bytes on the host, which the kernels use in
    place."""

    def __init__(self, data: np.ndarray) -> None:
        self.data = data

    @property
    def nbytes(self) -> int:
        return self.data.nbytes

    def read_into(self, out: np.ndarray) -> None:
        out.reshape(-1).view(np.uint8)[:] = self.data[: out.nbytes]

    def release(self) -> None:
        """Nothing to give back: the bytes go with the object."""


class HarnessDevice:
    """An emulator library built here (``build_library``: the IEEE or the -ffast-math one) as
    the device ``run_case`` dispatches to, so that the kernel cases run on either build."""

    def __init__(self, emu: emu_harness.Emu) -> None:
        self.emu = emu
        self.order, self.seed = "forward", 7

    def set_thread_order(self, order: str, seed: int = 0) -> None:
        self.order, self.seed = order, seed

    def upload(self, array: np.ndarray) -> HostBuffer:
        return HostBuffer(np.ascontiguousarray(array).reshape(-1).view(np.uint8).copy())

    def buffer(self, nbytes: int) -> HostBuffer:
        return HostBuffer(np.zeros(nbytes, np.uint8))

    def dispatch(self, name: str, args: bytes, buffers: tuple[HostBuffer, ...],
                 grid: tuple[int, int, int], group: tuple[int, int, int],
                 offsets: tuple[int, ...] | None = None) -> None:
        at = offsets or (0,) * len(buffers)
        bound = [b.data[o:] for b, o in zip(buffers, at, strict=True)]
        self.emu.dispatch(name, [np.frombuffer(args, np.uint8).copy(), *bound], grid, group,
                          order=self.order, seed=self.seed)
