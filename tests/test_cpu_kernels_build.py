"""cpu/kernels.h builds on every platform branch, not only the one this machine takes.

The header compiles its loops with ``target_clones`` on x86-64 Linux and plainly elsewhere
(macOS arm64). Only the first is exercised by the extension built here, so compile the header
down the other branch too: with the host compiler told it is not on Linux, and with the
AArch64 cross compiler when installed.
"""

import pathlib
import shutil
import subprocess

import pytest

HEADER_DIR = pathlib.Path(__file__).resolve().parents[1] / "darknet_metal" / "cpu"


def compile_header(compiler, extra, tmp_path):
    source = tmp_path / "use_kernels.c"
    source.write_text('#include "kernels.h"\nint main(void) { return 0; }\n')
    cmd = [compiler, "-std=c11", "-O1", "-Wall", "-Werror", *extra, f"-I{HEADER_DIR}", "-c",
           str(source), "-o", str(tmp_path / "use_kernels.o")]
    return subprocess.run(cmd, capture_output=True, text=True)


@pytest.mark.parametrize("extra", [[], ["-U__linux__"]], ids=["clones", "plain"])
def test_header_compiles_with_the_host_compiler(extra, tmp_path):
    compiler = shutil.which("gcc") or shutil.which("cc")
    if compiler is None:
        pytest.skip("no C compiler (gcc or cc) on PATH")
    proc = compile_header(compiler, extra, tmp_path)
    assert proc.returncode == 0, proc.stderr


def test_header_compiles_for_aarch64(tmp_path):
    compiler = shutil.which("aarch64-linux-gnu-gcc")
    if compiler is None:
        pytest.skip("aarch64-linux-gnu-gcc not installed (apt g++-aarch64-linux-gnu)")
    proc = compile_header(compiler, [], tmp_path)
    assert proc.returncode == 0, proc.stderr
