"""The emulator's kernels compiled on first use into the kernel cache (``kernel_build``): once,
with progress, safely when two processes start together, never again in a later process,
ahead of time with ``darknet-metal build-kernels``, and without leftovers when they fail."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import time
from pathlib import Path

import pytest

from darknet_metal.errors import DeviceError
from darknet_metal.metal import kernel_build

# A process's first use of the emulator: create the device and build one kernel's pipeline
# (found only in the loaded kernel library).
FIRST_USE = (
    "import time\n"
    "from darknet_metal.metal import _shim, registry\n"
    "t = time.perf_counter()\n"
    "d = _shim.Device('emu', emu_threads=1)\n"
    "d.pipeline_info(next(iter(registry.KERNELS)))\n"
    "print(f'device {time.perf_counter() - t:.3f}')\n"
)


def _env(cache: Path, **extra: str) -> dict[str, str]:
    env = dict(os.environ)
    env["DARKNET_METAL_KERNEL_CACHE"] = str(cache)
    env.update(extra)
    return env


def _cache_entries(cache: Path) -> list[str]:
    return sorted(p.name for p in cache.iterdir()) if cache.exists() else []


def test_two_first_uses_build_once_then_never_again(tmp_path):
    cache = tmp_path / "cache"
    started = [
        subprocess.Popen([sys.executable, "-c", FIRST_USE], env=_env(cache), text=True,
                         stdout=subprocess.PIPE, stderr=subprocess.PIPE)
        for _ in range(2)
    ]
    results = [p.communicate(timeout=600) for p in started]
    for process, (out, err) in zip(started, results, strict=True):
        assert process.returncode == 0, err
        assert out.startswith("device ")
    errors = "".join(err for _, err in results)
    # One process compiled, with its progress line; the other waited or found it built.
    assert errors.count("for the emulator") >= 1
    assert errors.count("done in") == 1, errors
    assert "Metal kernels for the emulator (files)" in errors
    entries = _cache_entries(cache)
    builds = [e for e in entries if e.startswith("emu-") and not e.endswith(".lock")]
    assert len(builds) == 1, entries
    assert not [e for e in entries if e.startswith(".")], entries  # no temporary folders
    library = cache / builds[0] / kernel_build.EMU_LIBRARY
    built_at = library.stat().st_mtime_ns

    again = subprocess.run([sys.executable, "-c", FIRST_USE], env=_env(cache), text=True,
                           capture_output=True, timeout=600)
    assert again.returncode == 0, again.stderr
    assert "compiling" not in again.stderr
    assert library.stat().st_mtime_ns == built_at
    assert _cache_entries(cache) == entries


def test_build_kernels_command_builds_ahead_and_keeps_a_build(tmp_path):
    cache = tmp_path / "cache"
    command = [sys.executable, "-m", "darknet_metal", "build-kernels", "--device", "emu"]
    first = subprocess.run(command, env=_env(cache), text=True, capture_output=True,
                           timeout=600)
    assert first.returncode == 0, first.stderr
    assert "Metal kernels for the emulator" in first.stderr
    folder = Path(first.stdout.split("emu: ", 1)[1].strip())
    assert folder.parent == cache and (folder / kernel_build.EMU_LIBRARY).is_file()
    second = subprocess.run(command, env=_env(cache), text=True, capture_output=True,
                            timeout=600)
    assert second.returncode == 0 and second.stdout == first.stdout
    assert "compiling" not in second.stderr
    use = subprocess.run([sys.executable, "-c", FIRST_USE], env=_env(cache), text=True,
                         capture_output=True, timeout=600)
    assert use.returncode == 0 and "compiling" not in use.stderr


def test_a_failed_build_leaves_nothing_and_names_the_command(tmp_path, monkeypatch):
    cache = tmp_path / "cache"
    monkeypatch.setenv("DARKNET_METAL_KERNEL_CACHE", str(cache))
    monkeypatch.setenv("CXX", "false")
    with pytest.raises(DeviceError, match=r"compiling .* failed:\n\$ false "):
        kernel_build.emu_library(progress=False)
    assert [e for e in _cache_entries(cache) if not e.endswith(".lock")] == []


def test_a_cache_that_cannot_be_made_is_a_device_error(tmp_path, monkeypatch):
    blocker = tmp_path / "a-file"
    blocker.write_text("")
    monkeypatch.setenv("DARKNET_METAL_KERNEL_CACHE", str(blocker / "cache"))
    with pytest.raises(DeviceError, match="cannot create the kernel cache"):
        kernel_build.emu_library(progress=False)


def test_a_damaged_library_is_refused_with_its_path(tmp_path, monkeypatch):
    from darknet_metal.metal import _shim

    monkeypatch.setenv("DARKNET_METAL_KERNEL_CACHE", str(tmp_path / "cache"))
    library = kernel_build.emu_library_path()
    library.parent.mkdir(parents=True)
    library.write_bytes(b"not a shared library")
    with pytest.raises(DeviceError, match="cannot load the emulator's kernels from .*delete"):
        _shim.Device("emu", emu_threads=1)


def test_no_compiler_and_no_nvcc_say_what_to_install(tmp_path, monkeypatch):
    monkeypatch.setenv("DARKNET_METAL_KERNEL_CACHE", str(tmp_path / "cache"))
    monkeypatch.delenv("CXX", raising=False)
    monkeypatch.setattr(kernel_build.shutil, "which", lambda name: None)
    with pytest.raises(DeviceError, match="no C.. compiler found .*set CXX"):
        kernel_build.emu_library()
    monkeypatch.setattr(kernel_build, "nvcc_path", lambda: None)
    with pytest.raises(DeviceError, match="no nvcc found .*nvidia-cuda-nvcc"):
        kernel_build.cuda_modules()
    status = kernel_build.build_status()
    assert "no nvcc found" in status["cuda"] and "no C++ compiler" in status["emu"]


def test_the_cache_key_follows_the_sources(tmp_path, monkeypatch):
    """A changed kernel source is another build: the cached one is not used for it."""
    from darknet_metal.metal import sources

    monkeypatch.setenv("DARKNET_METAL_KERNEL_CACHE", str(tmp_path / "cache"))
    before = kernel_build.emu_library_path()
    copy = tmp_path / "toolchain"
    root = Path(sources.toolchain_root())
    for name in ("shaders", "shim"):
        shutil.copytree(root / name, copy / name)
    metal = sorted((copy / "shaders").glob("*.metal"))[0]
    metal.write_text(metal.read_text() + "\n// changed\n")
    monkeypatch.setattr(sources, "_INSTALLED", str(copy))
    after = kernel_build.emu_library_path()
    assert after != before and after.parent.parent == before.parent.parent
    assert "not compiled yet" in kernel_build.build_status()["emu"]


def test_progress_is_one_line_rewritten_on_a_terminal(capsys, monkeypatch):
    monkeypatch.setattr(sys.stderr, "isatty", lambda: True, raising=False)
    status = kernel_build._Progress("compiling things", 3, True)
    for _ in range(3):
        status.step()
        time.sleep(0)
    status.finish()
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and err.startswith("\rdarknet_metal: compiling things: 0/3")
    assert "\rdarknet_metal: compiling things: 3/3, done in" in err
