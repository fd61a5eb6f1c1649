"""The arm64 fiber context switch, which Apple-silicon Macs use.

Linux AArch64: the emulator runtime, test kernels and small drivers are cross-compiled (static)
and run under qemu-aarch64; results are compared with NumPy. Apple arm64: ``fiber.cpp`` is
compiled to a Mach-O object with clang (no macOS SDK) and its symbols are checked."""

from __future__ import annotations

import hashlib
import os
import pathlib
import shutil
import struct
import subprocess

import numpy as np
import pytest
from emu_harness import EMU_DIR, KERNELS, MODES, ORDERS, RUNTIME_SOURCES, cache_dir, translate_metal

DRIVERS = pathlib.Path(__file__).resolve().parent / "drivers"
CROSS_GXX = shutil.which("aarch64-linux-gnu-g++")
QEMU = shutil.which("qemu-aarch64") or shutil.which("qemu-aarch64-static")
CLANGXX = shutil.which("clang++")
CLANG = shutil.which("clang")
LLVM_NM = shutil.which("llvm-nm") or next(
    (p for v in range(20, 13, -1) if (p := shutil.which(f"llvm-nm-{v}"))), None
)
LLVM_OBJDUMP = shutil.which("llvm-objdump") or next(
    (p for v in range(20, 13, -1) if (p := shutil.which(f"llvm-objdump-{v}"))), None
)
COMMON = ["-std=c++17", "-g", "-Wall", "-Wno-unused-function", f"-I{EMU_DIR}", "-static"]

needs_cross = pytest.mark.skipif(
    CROSS_GXX is None or QEMU is None,
    reason="needs aarch64-linux-gnu-g++ (apt g++-aarch64-linux-gnu) and qemu-aarch64 "
    "(apt qemu-user)",
)
# GCC before 13 has no _Float16 in C++ on AArch64 (metal_emu.h's half), so the kernels are
# built with clang, which uses the cross toolchain's libraries and linker.
needs_cross_clang = pytest.mark.skipif(
    CROSS_GXX is None or QEMU is None or CLANGXX is None,
    reason="needs clang++, aarch64-linux-gnu-g++ (apt g++-aarch64-linux-gnu) and "
    "qemu-aarch64 (apt qemu-user)",
)


def _build(compiler: list[str], sources: list[pathlib.Path], flags: list[str]) -> pathlib.Path:
    """Links ``sources`` into a static AArch64 executable in the emulator cache (by content)."""
    h = hashlib.sha256()
    for part in [*compiler, *flags]:
        h.update(part.encode() + b"\0")
    for src in [*sources, *sorted(EMU_DIR.glob("*.h"))]:
        h.update(src.read_bytes() + b"\0")
    out = cache_dir() / f"arm64-{h.hexdigest()[:24]}"
    if not out.exists():
        tmp = out.with_name(f"{out.name}.{os.getpid()}.tmp")
        cmd = ["nice", "-n", "10", *compiler, *COMMON, *flags, *map(str, sources)]
        proc = subprocess.run([*cmd, "-o", str(tmp), "-lpthread"], capture_output=True, text=True)
        assert proc.returncode == 0, proc.stderr
        os.replace(tmp, out)
    return out


def _qemu(exe: pathlib.Path, *args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run([QEMU, str(exe), *args], capture_output=True, text=True, timeout=60)


@pytest.mark.parametrize("compiler", ["gcc", "clang"])
@needs_cross
def test_callee_saved_registers_survive_the_switch(compiler):
    if compiler == "clang" and CLANGXX is None:
        pytest.skip("needs clang++")
    cxx = [CROSS_GXX] if compiler == "gcc" else [CLANGXX, "--target=aarch64-linux-gnu"]
    exe = _build(cxx, [EMU_DIR / "fiber.cpp", DRIVERS / "fiber_regs_arm64.cpp"], ["-O2"])
    proc = _qemu(exe)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert proc.stdout.split() == ["backend=arm64-asm", "ok"]


@pytest.fixture(scope="module")
def runner():
    """Runs one dispatch of the AArch64 build of good.metal + broken.metal under qemu."""
    sources = [*RUNTIME_SOURCES, DRIVERS / "run_dispatch.cpp"]
    sources += [translate_metal(KERNELS / m) for m in ("good.metal", "broken.metal")]
    exe = _build([CLANGXX, "--target=aarch64-linux-gnu"], sources, ["-O1"])

    def run(tmp_path, name, buffers, size, group, *, mode="threads", order="forward", seed=0):
        files = []
        for i, b in enumerate(buffers):
            files.append(tmp_path / f"buf{i}.bin")
            b.tofile(files[-1])
        args = [name, str(MODES[mode]), str(ORDERS[order]), str(seed)]
        args += [str(v) for v in (*(tuple(size) + (1, 1))[:3], *(tuple(group) + (1, 1))[:3])]
        proc = _qemu(exe, *args, *map(str, files))
        assert proc.returncode == 0, proc.stdout + proc.stderr
        lines = proc.stdout.splitlines()
        assert lines[0] == "backend=arm64-asm"
        rc = int(lines[1].removeprefix("rc="))
        outs = [
            np.fromfile(f, b.dtype).reshape(b.shape) for f, b in zip(files, buffers, strict=True)
        ]
        return rc, "\n".join(lines[2:]), outs

    return run


@needs_cross_clang
@pytest.mark.parametrize("order", ["forward", "reverse", "random"])
def test_reduction_with_barriers(runner, tmp_path, order):
    groups = 6
    x = np.random.default_rng(1).standard_normal(groups * 256).astype(np.float32)
    out = np.zeros(groups, np.float32)
    rc, msg, (_, got) = runner(
        tmp_path,
        "reduce_sum_f32",
        [x, out],
        (groups,),
        (256,),
        mode="threadgroups",
        order=order,
        seed=11,
    )
    assert rc == 0, msg
    np.testing.assert_allclose(got, x.reshape(groups, 256).sum(1, dtype=np.float64), atol=1e-4)


@needs_cross_clang
def test_simd_sum_reduction(runner, tmp_path):
    groups, per = 3, 256
    x = np.random.default_rng(2).standard_normal(groups * per).astype(np.float32)
    out = np.zeros(groups, np.float32)
    rc, msg, (_, got) = runner(
        tmp_path, "simd_reduce_f32", [x, out], (groups * per,), (per,), order="random", seed=5
    )
    assert rc == 0, msg
    np.testing.assert_allclose(got, x.reshape(groups, per).sum(1, dtype=np.float64), atol=1e-4)


@needs_cross_clang
@pytest.mark.parametrize("order", ["reverse", "random"])
def test_tiled_gemm(runner, tmp_path, order):
    m, n, k = 37, 29, 45
    rng = np.random.default_rng(3)
    a = rng.standard_normal((m, k)).astype(np.float32)
    b = rng.standard_normal((k, n)).astype(np.float32)
    c = np.zeros((m, n), np.float32)
    args = np.frombuffer(struct.pack("<3I", m, n, k), np.uint8).copy()
    # The kernel stages whole 16x16 tiles, so every group must be full: ragged edges are
    # handled inside it.
    groups = ((n + 15) // 16, (m + 15) // 16)
    rc, msg, outs = runner(
        tmp_path,
        "gemm_tiled_f32",
        [args, a, b, c],
        groups,
        (16, 16),
        mode="threadgroups",
        order=order,
        seed=7,
    )
    assert rc == 0, msg
    expected = a.astype(np.float64) @ b.astype(np.float64)
    np.testing.assert_allclose(outs[3], expected, rtol=1e-4, atol=1e-4)


@needs_cross_clang
def test_return_before_barrier_is_reported(runner, tmp_path):
    x = np.ones(64, np.float32)
    out = np.zeros(64, np.float32)
    limit = np.array([40], np.uint32)
    rc, msg, _ = runner(tmp_path, "return_before_barrier", [x, out, limit], (64,), (64,))
    assert rc == -2
    assert "return_before_barrier" in msg and "returned while other threads wait" in msg
    assert "broken.metal:" in msg


# Only what fiber.cpp includes beyond clang's own freestanding headers.
_STRING_H = """#include <stddef.h>
#ifdef __cplusplus
extern "C" {
#endif
void *memcpy(void *, const void *, size_t);
void *memset(void *, int, size_t);
#ifdef __cplusplus
}
#endif
"""


@pytest.mark.skipif(CLANG is None, reason="needs clang (apt clang)")
@pytest.mark.parametrize("sanitize", [False, True], ids=["plain", "asan"])
def test_apple_arm64_object(tmp_path, sanitize):
    (tmp_path / "inc").mkdir()
    (tmp_path / "inc" / "string.h").write_text(_STRING_H)
    obj = tmp_path / "fiber.o"
    cmd = [CLANG, "-target", "arm64-apple-macos13", "-x", "c++", "-std=c++17", "-O1"]
    cmd += ["-ffreestanding", "-nostdlibinc", "-isystem", str(tmp_path / "inc"), "-Wall"]
    cmd += ["-Werror", *(["-fsanitize=address"] if sanitize else [])]
    proc = subprocess.run(
        [*cmd, "-c", str(EMU_DIR / "fiber.cpp"), "-o", str(obj)], capture_output=True, text=True
    )
    assert proc.returncode == 0, proc.stderr
    # Mach-O 64-bit magic (0xfeedfacf) and CPU type arm64 (0x0100000c).
    assert struct.unpack("<II", obj.read_bytes()[:8]) == (0xFEEDFACF, 0x0100000C)
    if LLVM_NM is None or LLVM_OBJDUMP is None:
        pytest.skip("needs llvm-nm and llvm-objdump to check symbols")
    nm = subprocess.run([LLVM_NM, str(obj)], capture_output=True, text=True, check=True).stdout
    defined = {line.split()[-1] for line in nm.splitlines() if " T " in line}
    assert {"_emu_fiber_swap", "_emu_fiber_start", "_emu_fiber_make"} <= defined
    assert {"_emu_fiber_switch", "_emu_fiber_entered", "_emu_fiber_backend"} <= defined
    dis = subprocess.run(
        [LLVM_OBJDUMP, "-d", str(obj)], capture_output=True, text=True, check=True
    ).stdout
    # The switch itself (it may be labelled by a section-local symbol in the listing).
    for insn in ("stp\td14, d15, [sp, #144]", "ldp\tx29, x30, [sp, #80]", "mov\tsp, x1"):
        assert insn in dis
    assert "bti\tc" in dis or "hint\t#34" in dis
    assert "blr\tx20" in dis.split("<_emu_fiber_start>:")[1].split("\n\n")[0]
