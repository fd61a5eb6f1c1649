"""Build the real Darknet's CPU trainer (hank-ai V5, OpenBLAS) as the golden training data was made.

    python tools/darknet_cpu_build.py --source DARKNET_GIT --work DIR

``--source`` is a clone of https://github.com/hank-ai/darknet (any clone that holds the
commit below; a bare one will do). Nothing in it is changed: the commit is cloned into
``DIR/src``, the golden data's six CPU fixes are applied there (each must match exactly once,
or the build stops naming it), and CMake builds ``DIR/build/src-cli/darknet`` without CUDA or
ROCm. It also compiles ``DIR/libkeep_blas_threads.so``: Darknet calls
``openblas_set_num_threads(1)`` at start, and with this library preloaded that call does
nothing, so ``OPENBLAS_NUM_THREADS`` decides (the only way to give its products more than one
thread). Needs git, cmake, a C++ compiler, OpenCV's development files and the 64-bit-index
OpenBLAS that Darknet's README names (Debian and Ubuntu: ``apt-get install cmake
libopencv-dev libopenblas64-openmp-dev``); a build that did not find OpenBLAS is refused, as it
would time Darknet's own slow product instead.
"""

from __future__ import annotations

import argparse
import os
import shutil
import subprocess
import sys
from pathlib import Path

COMMIT = "f684e1d75d4594298c8e73acc727ba6cf2e81c60"

# (file, text, replacement): the six fixes of ../shared/golden/darknet-v5-train/README.md.
FIXES = [
    # 1. logistic and the NaN guards survive -Ofast.
    ("src-lib/CMakeLists.txt", "COMPILE_FLAGS -Ofast)",
     'COMPILE_FLAGS "-Ofast -fno-finite-math-only")'),
    # 2. batch-norm betas get their gradient.
    ("src-lib/batchnorm_layer.cpp",
     "\tbackward_scale_cpu(l.x_norm, l.delta,",
     "\tbackward_bias(l.bias_updates, l.delta, l.batch, l.out_c, l.out_w*l.out_h);\n"
     "\tbackward_scale_cpu(l.x_norm, l.delta,"),
    # 3. every layer's delta is zeroed before the pass.
    ("src-lib/darknet_network.cpp", "if (l.delta && state.train && l.train)",
     "if (l.delta && state.train)"),
    # 4. a convolution's backward adds into its input's delta.
    ("src-lib/col2im.cpp",
     "\tcaffe_set(height * width * channels, 0.0F, data_im);\n", ""),
    # 5. [sam] backward adds into its "from" layer's delta.
    ("src-lib/sam_layer.cpp", "from_delta[i] = state.input[i] * l.delta[i];",
     "from_delta[i] += state.input[i] * l.delta[i];"),
    # 6. [connected] layers train.
    ("src-lib/darknet_cfg.cpp",
     "make_connected_layer(parms.batch, 1, parms.inputs, output, activation, "
     "batch_normalize);\n",
     "make_connected_layer(parms.batch, 1, parms.inputs, output, activation, "
     "batch_normalize);\n\tl.train = 1;\n"),
]

KEEP_BLAS_THREADS = """\
/* Preloaded before OpenBLAS: Darknet's call that pins OpenBLAS to one thread does nothing,
   so OPENBLAS_NUM_THREADS decides. */
void openblas_set_num_threads(int threads) { (void)threads; }
"""


class BuildError(RuntimeError):
    """The Darknet build could not be made; the message says which step and why."""


def _run(command: list[str], log: Path, cwd: Path | None = None) -> None:
    print("  $", " ".join(command), flush=True)
    with open(log, "a") as out:
        done = subprocess.run(command, stdout=out, stderr=subprocess.STDOUT, cwd=cwd)
    if done.returncode != 0:
        tail = "\n".join(log.read_text(errors="replace").splitlines()[-15:])
        raise BuildError(f"{command[0]} failed with status {done.returncode} (log {log}):\n{tail}")


def apply_fixes(tree: Path) -> None:
    """Apply ``FIXES`` to the Darknet sources in ``tree``; each text must occur exactly once."""
    for name, text, replacement in FIXES:
        path = tree / name
        source = path.read_text()
        found = source.count(text)
        if found != 1:
            raise BuildError(f"{path}: expected the text {text!r} once, found it {found} times "
                             f"(is this commit {COMMIT[:8]}?)")
        path.write_text(source.replace(text, replacement))


def build(source: Path, work: Path, jobs: int | None = None) -> tuple[Path, Path]:
    """Clone, fix and build Darknet's CPU trainer in ``work``; returns (darknet executable,
    the preload library). A build already made in ``work`` is reused."""
    work = work.resolve()
    work.mkdir(parents=True, exist_ok=True)
    darknet = work / "build" / "src-cli" / "darknet"
    preload = work / "libkeep_blas_threads.so"
    log = work / "build.log"
    if not preload.is_file():
        c_file = work / "keep_blas_threads.c"
        c_file.write_text(KEEP_BLAS_THREADS)
        _run([os.environ.get("CC", "cc"), "-shared", "-fPIC", "-O2", "-o", str(preload),
              str(c_file)], log)
    if darknet.is_file():
        return darknet, preload
    tree = work / "src"
    fixed = work / "src.fixed"  # made once the clone holds the fixes
    if not fixed.is_file():
        if tree.exists():
            shutil.rmtree(tree)
        _run(["git", "clone", "-q", "--no-checkout", str(source.resolve()), str(tree)], log)
        _run(["git", "-c", "advice.detachedHead=false", "checkout", "-q", COMMIT], log, cwd=tree)
        apply_fixes(tree)
        fixed.write_text(COMMIT + "\n")
    _run(["cmake", "-S", str(tree), "-B", str(work / "build"), "-DCMAKE_BUILD_TYPE=Release",
          "-DDARKNET_TRY_CUDA=OFF", "-DDARKNET_TRY_ROCM=OFF"], log,
         cwd=tree)  # its version comes from `git describe` in the working directory
    configured = log.read_text(errors="replace")
    if "Found OpenBLAS" not in configured or "OpenBLAS not found" in configured:
        shutil.rmtree(work / "build")
        raise BuildError(f"CMake did not find OpenBLAS (log {log}); install the package "
                         "Darknet's README names (Debian: libopenblas64-openmp-dev)")
    _run(["cmake", "--build", str(work / "build"), "--target", "darknetcli", "-j",
          str(jobs or os.cpu_count() or 1)], log)
    if not darknet.is_file():
        raise BuildError(f"the build ended without {darknet} (log {log})")
    return darknet, preload


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--source", type=Path, required=True,
                        help="a git clone of hank-ai/darknet holding commit " + COMMIT[:8])
    parser.add_argument("--work", type=Path, required=True, help="the build folder")
    parser.add_argument("--jobs", type=int)
    args = parser.parse_args()
    try:
        darknet, preload = build(args.source, args.work, args.jobs)
    except BuildError as error:
        print(f"darknet_cpu_build: {error}", file=sys.stderr)
        return 1
    print(f"darknet: {darknet}\npreload: {preload}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
