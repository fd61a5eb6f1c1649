"""cpu/kernels.h and cpu/gemm_threads.h build on every platform branch, not only this one.

kernels.h compiles its loops with ``target_clones`` on x86-64 Linux and plainly elsewhere
(macOS arm64); gemm_threads.h has a per-architecture pause instruction in its polling loop.
Only the x86-64 Linux branch is exercised by the extension built here, so compile the headers
down the other branches too: with the host compiler told it is not on Linux, and with the
AArch64 cross compiler when installed.
"""

import shutil
import subprocess

import pytest
from shared_paths import ROOT

HEADER_DIR = ROOT / "darknet_metal" / "cpu"


_GEMM_THREADS_USE = """#include "gemm_threads.h"
static void part(void *ctx, int i) { ((int *)ctx)[i] = i; }
int main(void) {
    int out[4];
    dm_gemm_threads((void *)main);
    dm_blas_single_enter();
    dm_gemm_run(part, out, 4);
    dm_blas_single_exit();
    return out[3] != 3;
}
"""


def compile_header(compiler, extra, tmp_path, header="kernels.h"):
    source = tmp_path / "use_header.c"
    if header == "kernels.h":
        source.write_text('#include "kernels.h"\nint main(void) { return 0; }\n')
        std = "-std=c11"
    else:
        source.write_text(_GEMM_THREADS_USE)
        std = "-std=gnu11"  # POSIX clocks and threads
    cmd = [compiler, std, "-O1", "-Wall", "-Werror", *extra, f"-I{HEADER_DIR}", "-c",
           str(source), "-o", str(tmp_path / "use_header.o")]
    return subprocess.run(cmd, capture_output=True, text=True)


HEADERS = ["kernels.h", "gemm_threads.h"]


@pytest.mark.parametrize("header", HEADERS)
@pytest.mark.parametrize("extra", [[], ["-U__linux__"]], ids=["clones", "plain"])
def test_header_compiles_with_the_host_compiler(extra, header, tmp_path):
    compiler = shutil.which("gcc") or shutil.which("cc")
    if compiler is None:
        pytest.skip("no C compiler (gcc or cc) on PATH")
    proc = compile_header(compiler, extra, tmp_path, header)
    assert proc.returncode == 0, proc.stderr


@pytest.mark.parametrize("header", HEADERS)
def test_header_compiles_for_aarch64(header, tmp_path):
    compiler = shutil.which("aarch64-linux-gnu-gcc")
    if compiler is None:
        pytest.skip("aarch64-linux-gnu-gcc not installed (apt g++-aarch64-linux-gnu)")
    proc = compile_header(compiler, [], tmp_path, header)
    assert proc.returncode == 0, proc.stderr


def test_gemm_pool_runs_every_part(tmp_path):
    """The pool, built and run as a program: every part runs once, helpers included."""
    compiler = shutil.which("gcc") or shutil.which("cc")
    if compiler is None:
        pytest.skip("no C compiler (gcc or cc) on PATH")
    source = tmp_path / "pool.c"
    source.write_text("""#include "gemm_threads.h"
#include <stdio.h>
static int hits[1000];
static void part(void *ctx, int i) {
    (void)ctx;
    __atomic_add_fetch(&hits[i], 1, __ATOMIC_RELAXED);
}
int main(void) {
    int i, round;
    dm_gemm_threads((void *)main);
    dm_blas_single_enter();
    for (round = 0; round < 200; round++) dm_gemm_run(part, NULL, 1000);
    dm_blas_single_exit();
    for (i = 0; i < 1000; i++)
        if (hits[i] != 200) { printf("part %d ran %d times\\n", i, hits[i]); return 1; }
    return 0;
}
""")
    exe = tmp_path / "pool"
    build = subprocess.run([compiler, "-std=gnu11", "-O1", "-Wall", "-Werror", "-pthread",
                            f"-I{HEADER_DIR}", str(source), "-o", str(exe), "-ldl"],
                           capture_output=True, text=True)
    assert build.returncode == 0, build.stderr
    for threads in ("1", "2", "4"):
        run = subprocess.run([str(exe)], capture_output=True, text=True, timeout=60,
                             env={"DARKNET_METAL_CPU_THREADS": threads})
        assert run.returncode == 0, (threads, run.stdout, run.stderr)


_LEAVE_CPU = """#include "gemm_threads.h"
#include <stdio.h>
#include <string.h>
static int same_mask(const cpu_set_t *a) {
    cpu_set_t now;
    return sched_getaffinity(0, sizeof now, &now) == 0 && CPU_EQUAL(&now, a);
}
int main(void) {
    cpu_set_t allowed, only;
    int cpu;
    if (sched_getaffinity(0, sizeof allowed, &allowed) != 0) return 2;
    if (CPU_COUNT(&allowed) < 2) return 77;
    cpu = dm_current_cpu();
    dm_leave_cpu(cpu);
    if (dm_current_cpu() == cpu) { printf("still on %d\\n", cpu); return 1; }
    if (!same_mask(&allowed)) { printf("mask not restored\\n"); return 1; }
    /* A thread that may run on one CPU only stays there, its mask untouched. */
    cpu = dm_current_cpu();
    CPU_ZERO(&only);
    CPU_SET(cpu, &only);
    if (sched_setaffinity(0, sizeof only, &only) != 0) return 2;
    dm_leave_cpu(cpu);
    if (dm_current_cpu() != cpu || !same_mask(&only)) {
        printf("moved off its one CPU\\n");
        return 1;
    }
    dm_leave_cpu(-1);
    dm_leave_cpu(CPU_SETSIZE);
    return same_mask(&only) ? 0 : 1;
}
"""


def test_leave_cpu_moves_the_thread_and_keeps_its_mask(tmp_path):
    """dm_leave_cpu (a helper woken onto its caller's CPU moves itself off it) moves the
    calling thread to another CPU it may use and leaves its affinity as it found it."""
    import sys

    if not sys.platform.startswith("linux"):
        pytest.skip("CPU affinity is read and set on Linux only")
    compiler = shutil.which("gcc") or shutil.which("cc")
    if compiler is None:
        pytest.skip("no C compiler (gcc or cc) on PATH")
    source = tmp_path / "leave.c"
    source.write_text(_LEAVE_CPU)
    exe = tmp_path / "leave"
    build = subprocess.run([compiler, "-std=gnu11", "-O1", "-Wall", "-Werror",
                            "-Wno-unused-function", "-pthread", f"-I{HEADER_DIR}", str(source),
                            "-o", str(exe), "-ldl"], capture_output=True, text=True)
    assert build.returncode == 0, build.stderr
    run = subprocess.run([str(exe)], capture_output=True, text=True, timeout=60)
    if run.returncode == 77:
        pytest.skip("this process may run on one CPU only")
    assert run.returncode == 0, (run.stdout, run.stderr)
