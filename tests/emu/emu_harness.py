"""Build .metal kernels with the emulator runtime (g++, cached by content hash) and run them
from Python through ctypes."""

from __future__ import annotations

import ctypes
import hashlib
import importlib.util
import os
import pathlib
import subprocess
import sys
import tempfile

import numpy as np

ROOT = pathlib.Path(__file__).resolve().parents[2]
EMU_DIR = ROOT / "shim" / "emu"
TOOL = EMU_DIR / "metal2cpp.py"
KERNELS = pathlib.Path(__file__).resolve().parent / "kernels"
RUNTIME_SOURCES = [EMU_DIR / "emu_runtime.cpp", EMU_DIR / "fiber.cpp"]
HEADERS = [*(EMU_DIR / n for n in ("emu.h", "emu_abi.h", "fiber.h", "metal_emu.h")),
           *(ROOT / "shim" / n for n in ("msl_types.h", "msl_sync.h", "msl_glue.h"))]

CXX = os.environ.get("CXX", "g++")
BASE_FLAGS = ["-std=c++17", "-fPIC", "-g", "-Wall", "-Wno-unused-function"]
OPT_FLAGS = ["-O1"]
ASAN_FLAGS = ["-O0", "-fsanitize=address", "-fno-omit-frame-pointer"]

_spec = importlib.util.spec_from_file_location("metal2cpp", TOOL)
assert _spec is not None and _spec.loader is not None
metal2cpp = importlib.util.module_from_spec(_spec)
sys.modules.setdefault("metal2cpp", metal2cpp)
_spec.loader.exec_module(metal2cpp)

ORDERS = {"forward": 0, "reverse": 1, "random": 2}
MODES = {"threads": 0, "threadgroups": 1}


def cache_dir() -> pathlib.Path:
    """Directory of cached objects (override with DM_EMU_CACHE)."""
    path = pathlib.Path(
        os.environ.get("DM_EMU_CACHE", pathlib.Path(tempfile.gettempdir()) / "dm_emu_cache")
    )
    path.mkdir(parents=True, exist_ok=True)
    return path


def _digest(*parts: bytes | str) -> str:
    h = hashlib.sha256()
    for p in parts:
        h.update(p.encode() if isinstance(p, str) else p)
        h.update(b"\0")
    return h.hexdigest()[:24]


def _headers_digest() -> str:
    return _digest(*(p.read_bytes() for p in HEADERS))


def _run(cmd: list[str]) -> None:
    proc = subprocess.run(["nice", "-n", "10", *cmd], capture_output=True, text=True)
    if proc.returncode != 0:
        raise RuntimeError(f"command failed: {' '.join(cmd)}\n{proc.stderr}")


def _compile(source: pathlib.Path, flags: list[str], extra_key: str = "") -> pathlib.Path:
    key = _digest(source.read_bytes(), " ".join([CXX, *flags]), _headers_digest(), extra_key)
    obj = cache_dir() / f"{source.stem}-{key}.o"
    if not obj.exists():
        tmp = obj.with_suffix(f".{os.getpid()}.tmp.o")
        _run([CXX, *flags, f"-I{EMU_DIR}", "-c", str(source), "-o", str(tmp)])
        os.replace(tmp, obj)
    return obj


def translate_metal(metal: pathlib.Path) -> pathlib.Path:
    """Rewrite one .metal file into a cached .cpp (content-addressed)."""
    text = metal.read_text()
    key = _digest(text, str(metal), TOOL.read_bytes())
    out = cache_dir() / f"{metal.stem}-{key}.cpp"
    if not out.exists():
        metal2cpp.translate_file(str(metal), str(out))
    return out


def build(
    metal_files: list[pathlib.Path],
    *,
    flags: list[str] | None = None,
    driver: pathlib.Path | None = None,
) -> pathlib.Path:
    """Compile runtime + kernels (+ optional driver with main) into a shared library, or an
    executable when ``driver`` is given. Returns its path."""
    flags = [*BASE_FLAGS, *(flags or OPT_FLAGS)]
    objs = [_compile(src, flags) for src in RUNTIME_SOURCES]
    objs += [_compile(translate_metal(m), flags) for m in metal_files]
    if driver is not None:
        objs.append(_compile(driver, flags))
    # -ffast-math is for compiling only: linked with it, the library gets a constructor that
    # switches the whole loading process to flush-to-zero, changing every CPU reference.
    link_flags = [f for f in flags if f != "-ffast-math"]
    key = _digest(*(o.name for o in objs), " ".join(flags), "link:", " ".join(link_flags))
    suffix = "" if driver is not None else ".so"
    out = cache_dir() / f"emu-{key}{suffix}"
    if not out.exists():
        tmp = out.with_name(f"{out.name}.{os.getpid()}.tmp")
        link = [CXX, *link_flags, *map(str, objs), "-o", str(tmp), "-lpthread"]
        if driver is None:
            link[1:1] = ["-shared", "-Wl,-Bsymbolic"]
        _run(link)
        os.replace(tmp, out)
    return out


class EmuError(RuntimeError):
    """A dispatch the emulator refused or a kernel fault it caught."""

    def __init__(self, code: int, message: str) -> None:
        self.code = code
        self.message = message
        super().__init__(f"[{code}] {message}")


class _Desc(ctypes.Structure):
    _fields_ = [
        ("kernel", ctypes.c_void_p),
        ("buffers", ctypes.POINTER(ctypes.c_void_p)),
        ("n_buffers", ctypes.c_int),
        ("tg_arg_bytes", ctypes.c_uint32 * 8),
        ("size", ctypes.c_uint32 * 3),
        ("group", ctypes.c_uint32 * 3),
        ("mode", ctypes.c_int),
        ("order", ctypes.c_int),
        ("seed", ctypes.c_uint64),
    ]


class _KernelInfo(ctypes.Structure):
    _fields_ = [
        ("name", ctypes.c_char_p),
        ("thread", ctypes.c_void_p),
        ("group", ctypes.c_void_p),
        ("flags", ctypes.c_uint32),
        ("buffer_mask", ctypes.c_uint32),
        ("tg_arg_mask", ctypes.c_uint32),
        ("tg_static_bytes", ctypes.c_int32),
        ("max_threads", ctypes.c_int32),
        ("file", ctypes.c_char_p),
        ("line", ctypes.c_int),
    ]


def _dim3(v: int | tuple[int, ...]) -> tuple[int, int, int]:
    t = (v,) if isinstance(v, int) else tuple(v)
    return (t + (1, 1, 1))[:3]  # type: ignore[return-value]


class Emu:
    """A loaded emulator library with its device (a pool of ``threads`` host threads)."""

    def __init__(self, library: pathlib.Path, threads: int = 2) -> None:
        self.lib = ctypes.CDLL(str(library))
        lib = self.lib
        lib.emu_device_create.restype = ctypes.c_void_p
        lib.emu_device_create.argtypes = [ctypes.c_int]
        lib.emu_device_destroy.argtypes = [ctypes.c_void_p]
        lib.emu_dispatch.argtypes = [ctypes.c_void_p, ctypes.POINTER(_Desc)]
        lib.emu_find_kernel.restype = ctypes.POINTER(_KernelInfo)
        lib.emu_find_kernel.argtypes = [ctypes.c_char_p]
        lib.emu_last_error.restype = ctypes.c_char_p
        self.device = lib.emu_device_create(threads)
        if not self.device:
            raise EmuError(-4, lib.emu_last_error().decode())

    def close(self) -> None:
        if self.device:
            self.lib.emu_device_destroy(self.device)
            self.device = None

    def kernel(self, name: str) -> _KernelInfo:
        ptr = self.lib.emu_find_kernel(name.encode())
        if not ptr:
            raise EmuError(-3, self.lib.emu_last_error().decode())
        return ptr.contents

    def dispatch(
        self,
        name: str,
        buffers: list[np.ndarray | None],
        size: int | tuple[int, ...],
        group: int | tuple[int, ...],
        *,
        mode: str = "threads",
        order: str = "forward",
        seed: int = 0,
        tg_args: tuple[int, ...] = (),
    ) -> None:
        """Run kernel ``name``; ``buffers[i]`` binds [[buffer(i)]] (arrays are used in place
        and must be C-contiguous). Raises EmuError with the runtime's message."""
        ptr = self.lib.emu_find_kernel(name.encode())
        if not ptr:
            raise EmuError(-3, self.lib.emu_last_error().decode())
        arr = (ctypes.c_void_p * max(1, len(buffers)))()
        for i, b in enumerate(buffers):
            if b is not None:
                assert b.flags["C_CONTIGUOUS"]
                arr[i] = b.ctypes.data
        desc = _Desc()
        desc.kernel = ctypes.cast(ptr, ctypes.c_void_p)
        desc.buffers = arr
        desc.n_buffers = len(buffers)
        for i, n in enumerate(tg_args):
            desc.tg_arg_bytes[i] = n
        desc.size[:] = _dim3(size)
        desc.group[:] = _dim3(group)
        desc.mode = MODES[mode]
        desc.order = ORDERS[order]
        desc.seed = seed
        rc = self.lib.emu_dispatch(self.device, ctypes.byref(desc))
        if rc != 0:
            raise EmuError(rc, self.lib.emu_last_error().decode())


def struct_bytes(fmt: str, *values: float | int) -> np.ndarray:
    """Little-endian packed argument struct as a uint8 array (for constant& args)."""
    import struct

    return np.frombuffer(struct.pack("<" + fmt, *values), dtype=np.uint8).copy()
