"""The device kernels that are compiled on first use: the emulator's kernel library and the
CUDA modules, each built once into a per-user cache.

Installing the package compiles the CPU path and the shim with its drivers only. The
emulator's kernels (every ``.metal`` file translated to C++ by ``shim/emu/metal2cpp.py``)
and the CUDA modules (the same files translated by ``shim/cuda/metal2cuda.py`` and compiled
by nvcc) are compiled the first time ``device="emu"`` or ``device="cuda"`` is used, or ahead
of time by ``darknet-metal build-kernels``. A Mac running ``device="metal"`` never needs
either.

Cache: ``$DARKNET_METAL_KERNEL_CACHE``, else ``$XDG_CACHE_HOME/darknet_metal/kernels``
(``~/.cache/darknet_metal/kernels``; ``~/Library/Caches/darknet_metal/kernels`` on macOS).
Each build is a folder named by a hash of what it is made from: the package version, every
source and translator, the compiler's identity and the flags; a change to any of them makes
a new build, and an old build is never overwritten. A build is made in a temporary folder
and renamed into place, under an exclusive lock on a file beside it, so two processes
starting together build once: the second waits, then uses the first one's build. Nothing of
a failed build is left behind.

Thread safety: every function may be called from any thread; builds are serialised.
"""

from __future__ import annotations

import contextlib
import fcntl
import functools
import hashlib
import importlib.util
import json
import os
import shlex
import shutil
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from glob import glob
from pathlib import Path

from darknet_metal.errors import DeviceError
from darknet_metal.metal import sources
from darknet_metal.metal.sources import kernel_sources
from darknet_metal.version import __version__

__all__ = [
    "EMU_LIBRARY",
    "build_status",
    "cache_root",
    "cuda_modules",
    "emu_library",
    "emu_library_path",
    "nvcc_path",
]

#: The emulator kernel library's file name inside its build folder.
EMU_LIBRARY = "libdm_emu_kernels" + (".dylib" if sys.platform == "darwin" else ".so")
_DEBUG = os.environ.get("DARKNET_METAL_DEBUG", "") not in ("", "0")
#: Flags of every translated kernel file and of emu_library.cpp. Hidden visibility binds the
#: generated code's emu_rt_* calls to emu_library.cpp's forwarders (see emu_library.h).
_EMU_FLAGS = (["-O0", "-g"] if _DEBUG else ["-O2"]) + [
    "-std=c++17", "-fPIC", "-fvisibility=hidden", "-w",
]
_MARKER = "build.json"
_builds = threading.Lock()


def cache_root() -> Path:
    """The kernel cache: ``$DARKNET_METAL_KERNEL_CACHE``, else the user's cache folder."""
    configured = os.environ.get("DARKNET_METAL_KERNEL_CACHE")
    if configured:
        return Path(configured).expanduser()
    if sys.platform == "darwin":
        base = Path.home() / "Library" / "Caches"
    else:
        base = Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache")
    return base / "darknet_metal" / "kernels"


def emu_library_path() -> Path:
    """Where the emulator's kernel library for the current sources and compiler is (or would
    be) in the cache. Compiles nothing."""
    return cache_root() / f"emu-{_emu_key(_root(), tuple(_cxx()))}" / EMU_LIBRARY


def emu_library(*, progress: bool = True) -> str:
    """Path of the emulator's kernel library, compiled first if this cache has none for the
    current sources and compiler. ``progress`` prints a one-line status to stderr while it
    compiles. Raises DeviceError when there is no C++ compiler or a kernel fails to compile.
    """
    library = emu_library_path()
    if not library.is_file():
        with _building(library.parent):
            if not library.is_file():
                _build_emu(_root(), _cxx(), library.parent, progress)
    return str(library)


def cuda_modules(*, progress: bool = True) -> list[str]:
    """Paths of the CUDA modules (one fatbin per ``.metal`` file), compiled first with nvcc if
    this cache has none for the current sources and nvcc. Raises DeviceError when nvcc is not
    found or a kernel fails to compile."""
    nvcc = nvcc_path()
    if nvcc is None:
        raise DeviceError(
            "no nvcc found to compile the CUDA kernels (they are compiled on first use): "
            "install a CUDA toolkit (nvcc on PATH or in $CUDA_HOME) or `pip install "
            "nvidia-cuda-nvcc`"
        )
    build = _cuda_build_script(_root())
    folder = _cuda_folder(nvcc)
    if not (folder / _MARKER).is_file():
        with _building(folder):
            if not (folder / _MARKER).is_file():
                _build_cuda(build, nvcc, folder, progress)
    return sorted(str(p) for p in folder.glob("*.fatbin"))


def nvcc_path() -> str | None:
    """The nvcc the CUDA modules are compiled with (PATH, $CUDA_HOME, the nvidia-cuda-nvcc
    wheel), or None."""
    return _cuda_build_script(_root()).find_nvcc()


def build_status() -> dict[str, str]:
    """What the cache holds for this package's sources, per device kind ("emu", "cuda"):
    the build's folder, or why there is none yet. Compiles nothing."""
    try:
        _root()
    except DeviceError as e:
        return {"emu": str(e), "cuda": str(e)}
    status = {}
    try:
        library = emu_library_path()
        status["emu"] = (str(library.parent) if library.is_file()
                         else f"not compiled yet (compiled on first use, into {library.parent})")
    except DeviceError as e:
        status["emu"] = str(e)
    nvcc = nvcc_path()
    if nvcc is None:
        status["cuda"] = "no nvcc found: the CUDA kernels cannot be compiled here"
    else:
        folder = _cuda_folder(nvcc)
        status["cuda"] = (str(folder) if (folder / _MARKER).is_file()
                          else f"not compiled yet (compiled on first use with {nvcc})")
    return status


def _cuda_folder(nvcc: str) -> Path:
    return cache_root() / f"cuda-{_cuda_key(_root(), nvcc)}"


# A process hashes the sources of a root once: the emulator's runtime could not load a second
# library of the same kernels anyway, and device creation stays cheap.
@functools.cache
def _emu_key(root: str, cxx: tuple[str, ...]) -> str:
    return _key("emu", _compiler_identity(cxx), " ".join(_EMU_FLAGS), root, _emu_inputs(root))


@functools.cache
def _cuda_key(root: str, nvcc: str) -> str:
    build = _cuda_build_script(root)
    flags = " ".join([*build.BASE_FLAGS[:-1], *build.ARCHS])  # the last is an -I of a path
    return _key("cuda", _compiler_identity((nvcc,)), flags, root, _cuda_inputs(root))


# ---- what a build is made from ----


def _root() -> str:
    try:
        return sources.toolchain_root()
    except FileNotFoundError as e:
        raise DeviceError(str(e)) from None


def _inputs(root: str, *extra: str) -> list[str]:
    """What every build reads (kernels, their headers, the shared parser), and ``extra``."""
    shim = os.path.join(root, "shim")
    return sorted(
        kernel_sources()
        + glob(os.path.join(root, "shaders", "*.h"))
        + glob(os.path.join(shim, "*.h"))
        + [os.path.join(shim, "emu", "metal2cpp.py"), *extra]
    )


def _emu_inputs(root: str) -> list[str]:
    emu = os.path.join(root, "shim", "emu")
    return _inputs(root, *glob(os.path.join(emu, "*.h")), os.path.join(emu, "emu_library.cpp"))


def _cuda_inputs(root: str) -> list[str]:
    cuda = os.path.join(root, "shim", "cuda")
    return _inputs(root, *glob(os.path.join(cuda, "*.py")), *glob(os.path.join(cuda, "*.h")))


def _key(kind: str, compiler: str, flags: str, root: str, inputs: list[str]) -> str:
    digest = hashlib.sha256()
    for part in (kind, __version__, compiler, flags):
        digest.update(part.encode() + b"\0")
    for path in inputs:
        digest.update(os.path.relpath(path, root).replace(os.sep, "/").encode() + b"\0")
        with open(path, "rb") as f:
            digest.update(f.read() + b"\0")
    return digest.hexdigest()[:16]


def _cxx() -> list[str]:
    """The C++ compiler: ``$CXX`` (which may carry flags), else c++, g++ or clang++."""
    configured = os.environ.get("CXX", "").strip()
    if configured:
        return shlex.split(configured)
    for name in ("c++", "g++", "clang++"):
        found = shutil.which(name)
        if found:
            return [found]
    raise DeviceError(
        "no C++ compiler found to compile the emulator's kernels (they are compiled on first "
        "use): install g++ or clang++, or set CXX"
    )


@functools.cache
def _compiler_identity(command: tuple[str, ...]) -> str:
    """The compiler's path and its ``--version`` text: another compiler makes another build."""
    try:
        done = subprocess.run([*command, "--version"], capture_output=True, text=True,
                              timeout=60)
    except (OSError, subprocess.TimeoutExpired) as e:
        raise DeviceError(f"cannot run the compiler {' '.join(command)}: {e}") from None
    return " ".join(command) + "\n" + done.stdout.strip()


# ---- building ----


@contextlib.contextmanager
def _building(folder: Path) -> Iterator[None]:
    """Holds this process's build lock and the exclusive file lock of ``folder``'s build."""
    try:
        folder.parent.mkdir(parents=True, exist_ok=True)
    except OSError as e:
        raise DeviceError(f"cannot create the kernel cache {folder.parent}: {e}") from None
    try:
        lock = open(folder.with_name(folder.name + ".lock"), "a")  # closed by the with below
    except OSError as e:
        raise DeviceError(f"cannot write to the kernel cache {folder.parent}: {e}") from None
    with _builds, lock:
        try:
            fcntl.flock(lock, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            print(f"darknet_metal: waiting for another process compiling {folder.name}",
                  file=sys.stderr, flush=True)
            fcntl.flock(lock, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(lock, fcntl.LOCK_UN)


class _Progress:
    """A one-line status on stderr: rewritten in place on a terminal, else a line when the
    work starts and one when it ends."""

    def __init__(self, label: str, total: int, enabled: bool) -> None:
        self.label, self.total, self.enabled = label, total, enabled
        self.done = 0
        self.started = time.perf_counter()
        self.tty = sys.stderr.isatty()
        self._lock = threading.Lock()
        self._show(final=False)

    def step(self) -> None:
        with self._lock:
            self.done += 1
            if self.tty:
                self._show(final=False)

    def finish(self) -> None:
        self._show(final=True)

    def _show(self, final: bool) -> None:
        if not self.enabled:
            return
        line = f"darknet_metal: {self.label}: {self.done}/{self.total}"
        if final:
            line += f", done in {time.perf_counter() - self.started:.1f} s"
        if self.tty:
            print("\r" + line, end="\n" if final else "", file=sys.stderr, flush=True)
        elif final or self.done == 0:
            print(line, file=sys.stderr, flush=True)


def _new_build_dir(folder: Path) -> Path:
    try:
        return Path(tempfile.mkdtemp(prefix=f".{folder.name}.", dir=folder.parent))
    except OSError as e:
        raise DeviceError(f"cannot write to the kernel cache {folder.parent}: {e}") from None


def _publish(tmp: Path, folder: Path, facts: dict) -> None:
    """Writes the build's facts and renames ``tmp`` to ``folder`` (atomic)."""
    (tmp / _MARKER).write_text(json.dumps(facts, indent=1) + "\n", encoding="utf-8")
    if folder.exists():  # a folder without its marker: a build that did not finish
        shutil.rmtree(folder)
    os.rename(tmp, folder)


def _load_script(path: str, name: str):
    spec = importlib.util.spec_from_file_location(name, path)
    if spec is None or spec.loader is None:
        raise DeviceError(f"cannot load {path}")
    module = importlib.util.module_from_spec(spec)
    sys.modules[name] = module
    spec.loader.exec_module(module)
    return module


@functools.cache
def _metal2cpp(root: str):
    return _load_script(os.path.join(root, "shim", "emu", "metal2cpp.py"),
                        "darknet_metal._toolchain_metal2cpp")


@functools.cache
def _cuda_build_script(root: str):
    return _load_script(os.path.join(root, "shim", "cuda", "build.py"),
                        "darknet_metal._toolchain_cuda_build")


def _run(command: list[str], what: str) -> None:
    done = subprocess.run(command, capture_output=True, text=True)
    if done.returncode != 0:
        message = (done.stderr + done.stdout).strip()
        if len(message) > 4000:
            message = message[:4000] + "\n..."
        raise DeviceError(f"compiling {what} failed:\n$ {shlex.join(command)}\n{message}")


def _build_emu(root: str, cxx: list[str], folder: Path, progress: bool) -> None:
    metal2cpp = _metal2cpp(root)
    tmp = _new_build_dir(folder)
    try:
        work = tmp / "work"
        work.mkdir()
        units, n_kernels = [], 0
        for metal in kernel_sources():
            stem = os.path.splitext(os.path.basename(metal))[0]
            out = work / f"{stem}.cpp"
            with open(metal, encoding="utf-8") as f:
                try:
                    result = metal2cpp.translate(f.read(), metal, output_name=str(out))
                except metal2cpp.MetalSourceError as e:
                    raise DeviceError(f"translating {metal} for the emulator: {e}") from None
            out.write_text(result.cpp, encoding="utf-8")
            units.append(str(out))
            n_kernels += len(result.kernels)
        n_files = len(units)
        units.append(os.path.join(root, "shim", "emu", "emu_library.cpp"))
        includes = [f"-I{os.path.join(root, d)}" for d in ("shim", os.path.join("shim", "emu"),
                                                           "shaders")]
        status = _Progress(f"compiling {n_kernels} Metal kernels for the emulator (files)",
                           n_files, progress)

        def compile_one(source: str) -> str:
            obj = str(work / (Path(source).stem + ".o"))
            _run([*cxx, *_EMU_FLAGS, *includes, "-c", source, "-o", obj],
                 f"{source} for the emulator")
            if source.endswith(".cpp") and Path(source).parent == work:
                status.step()
            return obj

        with ThreadPoolExecutor(max_workers=os.cpu_count() or 1) as pool:
            objects = list(pool.map(compile_one, units))
        link = [*cxx, "-shared", "-o", str(tmp / EMU_LIBRARY), *objects]
        if sys.platform != "darwin":
            link.append("-Wl,--no-undefined")
        _run(link, "the emulator's kernel library")
        shutil.rmtree(work)
        status.finish()
        _publish(tmp, folder, {"device": "emu", "kernels": n_kernels, "compiler": cxx,
                               "flags": _EMU_FLAGS, "sources": root})
    finally:
        shutil.rmtree(tmp, ignore_errors=True)


def _build_cuda(build, nvcc: str, folder: Path, progress: bool) -> None:
    tmp = _new_build_dir(folder)
    try:
        n_files = len(kernel_sources())
        status = _Progress(f"compiling the CUDA kernels ({n_files} files) with nvcc", n_files,
                           progress)
        try:
            build.build_modules(str(tmp / "modules"), str(tmp / "work"), nvcc,
                                progress=lambda _path: status.step())
        except RuntimeError as e:
            raise DeviceError(f"compiling the CUDA kernels failed: {e}") from None
        for fatbin in (tmp / "modules").glob("*.fatbin"):
            os.replace(fatbin, tmp / fatbin.name)
        shutil.rmtree(tmp / "modules")
        shutil.rmtree(tmp / "work")
        status.finish()
        _publish(tmp, folder, {"device": "cuda", "nvcc": nvcc, "archs": list(build.ARCHS)})
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
