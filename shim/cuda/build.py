#!/usr/bin/env python3
"""Build and check the CUDA form of the Metal kernels.

``darknet_metal.metal.kernel_build`` calls ``build_modules`` on the first use of the
``cuda`` device, when nvcc is found (on PATH, or from the ``nvidia-cuda-nvcc`` wheel): every
``.metal`` file, and the headers they include, is translated by ``metal2cuda.py`` and compiled
into one fatbin per ``.metal`` file (machine code for sm_80 and sm_90, PTX for later GPUs),
which the ``cuda`` driver loads at run time.

``python shim/cuda/build.py check`` is the compile check CI runs where there is no GPU: it
translates every kernel source, compiles it for sm_80 and sm_90, and fails on a source the
translator refuses, a compile error, a register spill, or a kernel of the translated table
with no entry point in the compiled code.

Flags: ``-fmad=false`` because Metal's safe math does not contract multiplies and adds
(the library is built with fast math off), and never ``-use_fast_math``.
"""

from __future__ import annotations

import argparse
import glob
import os
import re
import shutil
import site as site_module
import subprocess
import sys
import sysconfig
import tempfile
from concurrent.futures import ThreadPoolExecutor

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(os.path.dirname(HERE))
sys.path.insert(0, HERE)
import metal2cuda  # noqa: E402  (a script beside this one)

#: Machine code for Ampere and Hopper, PTX for what comes later.
ARCHS = ("sm_80", "sm_90")
BASE_FLAGS = ["-std=c++17", "-fmad=false", "-lineinfo", "-Wno-deprecated-gpu-targets",
              f"-I{HERE}"]
#: What every translated file includes (found through -I, never copied).
PRELUDE_FILES = (os.path.join(HERE, "metal_cuda.h"), os.path.join(HERE, "dmc_launch.h"),
                 *(os.path.join(ROOT, "shim", name)
                   for name in ("msl_glue.h", "msl_types.h", "msl_sync.h")))


def find_nvcc() -> str | None:
    """nvcc on PATH (or $CUDA_HOME/bin), else the one of the ``nvidia-cuda-nvcc`` wheel."""
    found = shutil.which("nvcc")
    if found:
        return found
    home = os.environ.get("CUDA_HOME") or os.environ.get("CUDA_PATH")
    if home and os.path.isfile(os.path.join(home, "bin", "nvcc")):
        return os.path.join(home, "bin", "nvcc")
    sites = {sysconfig.get_paths()["purelib"], sysconfig.get_paths()["platlib"]}
    sites.add(site_module.getusersitepackages())
    for site in sorted(sites):
        for candidate in sorted(glob.glob(os.path.join(site, "nvidia", "cu*", "bin", "nvcc"))):
            if os.access(candidate, os.X_OK):
                return candidate
        legacy = os.path.join(site, "nvidia", "cuda_nvcc", "bin", "nvcc")
        if os.access(legacy, os.X_OK):
            return legacy
    return None


def kernel_sources(root: str = ROOT) -> list[str]:
    """Every .metal file of the shim, as setup.py builds them."""
    return (sorted(glob.glob(os.path.join(root, "shaders", "*.metal")))
            + sorted(glob.glob(os.path.join(root, "shim", "kernels", "*.metal"))))


def shader_headers(root: str = ROOT) -> list[str]:
    return sorted(glob.glob(os.path.join(root, "shaders", "*.h")))


def _stale(target: str, inputs: list[str]) -> bool:
    if not os.path.exists(target):
        return True
    built = os.path.getmtime(target)
    return any(os.path.getmtime(path) > built for path in inputs)


def translate_all(out_dir: str, root: str = ROOT, force: bool = False) -> list[str]:
    """Translates the headers and every .metal file into ``out_dir`` (again only when a
    source or the translator changed); returns the .cu paths."""
    os.makedirs(out_dir, exist_ok=True)
    tools = [os.path.join(HERE, "metal2cuda.py"), os.path.join(ROOT, "shim", "emu", "metal2cpp.py")]
    for header in shader_headers(root):
        out = os.path.join(out_dir, os.path.basename(header))
        if force or _stale(out, [header, *tools]):
            metal2cuda.translate_file(header, out)
    generated = []
    for metal in kernel_sources(root):
        stem = os.path.splitext(os.path.basename(metal))[0]
        out = os.path.join(out_dir, f"{stem}.cu")
        if force or _stale(out, [metal, *tools]):
            metal2cuda.translate_file(metal, out)
        generated.append(out)
    return generated


def _gencode(archs: tuple[str, ...], ptx: bool) -> list[str]:
    flags = []
    for arch in archs:
        number = arch.split("_")[1]
        flags += ["-gencode", f"arch=compute_{number},code=sm_{number}"]
    if ptx:
        number = archs[-1].split("_")[1]
        flags += ["-gencode", f"arch=compute_{number},code=compute_{number}"]
    return flags


def build_modules(out_dir: str, work_dir: str, nvcc: str, *, jobs: int = 0,
                  force: bool = False, progress=None) -> list[str]:
    """Fatbins of every kernel source in ``out_dir`` (translations in ``work_dir``); a module
    is rebuilt only when its translation or the prelude is newer. ``progress``, if given, is
    called with each fatbin's path when it is ready. Raises RuntimeError with nvcc's message
    when one does not compile."""
    out_dir, work_dir = os.path.abspath(out_dir), os.path.abspath(work_dir)
    sources = translate_all(work_dir, force=force)
    os.makedirs(out_dir, exist_ok=True)
    prelude = [*PRELUDE_FILES]
    prelude += [os.path.join(work_dir, os.path.basename(h)) for h in shader_headers()]

    def one(cu: str) -> str:
        stem = os.path.splitext(os.path.basename(cu))[0]
        target = os.path.join(out_dir, f"{stem}.fatbin")
        if force or _stale(target, [cu, *prelude]):
            tmp = f"{target}.tmp{os.getpid()}"
            cmd = [nvcc, *BASE_FLAGS, *_gencode(ARCHS, ptx=True), "-fatbin", cu, "-o", tmp]
            done = subprocess.run(cmd, capture_output=True, text=True, cwd=work_dir)
            if done.returncode != 0:
                if os.path.exists(tmp):
                    os.unlink(tmp)
                raise RuntimeError(f"nvcc failed on {cu}:\n{done.stderr}{done.stdout}")
            os.replace(tmp, target)
        if progress is not None:
            progress(target)
        return target

    with ThreadPoolExecutor(max_workers=jobs or os.cpu_count() or 1) as pool:
        return list(pool.map(one, sources))


_ENTRY = re.compile(r"Compiling entry function '(\w+)' for '(sm_\d+)'")
_SPILL = re.compile(r"(\d+) bytes spill stores, (\d+) bytes spill loads")


def check(nvcc: str, work_dir: str, jobs: int = 0, root: str = ROOT) -> list[str]:
    """Problems of the CUDA build of the kernel sources under ``root`` for every arch of
    ARCHS (empty: all good): a source the translator refuses, a kernel that writes device
    memory before a threadgroup-only barrier and reads it after (legal here, wrong on Apple
    GPUs), a compile error, a spill, a kernel without its entry point."""
    work_dir = os.path.abspath(work_dir)
    problems = []
    try:
        sources = translate_all(work_dir, root=root, force=True)
    except metal2cuda.MetalSourceError as e:
        return [str(e)]
    expected: dict[str, set[str]] = {}
    for metal in kernel_sources(root):
        stem = os.path.splitext(os.path.basename(metal))[0]
        with open(metal, encoding="utf-8") as f:
            text = f.read()
        expected[stem] = {metal2cuda.entry_point(k.name)
                          for k in metal2cuda.translate(text, metal).kernels}
        for kernel, line, name in metal2cuda.device_memory_hazards(text, metal):
            problems.append(f"{metal}:{line}: kernel {kernel} writes device buffer '{name}' "
                            "before this barrier, which orders threadgroup memory only, and "
                            "reads it after: other threads' writes need mem_flags::mem_device "
                            "on Apple GPUs")

    def one(cu: str) -> list[str]:
        stem = os.path.splitext(os.path.basename(cu))[0]
        problems = []
        for arch in ARCHS:
            cmd = [nvcc, *BASE_FLAGS, *_gencode((arch,), ptx=False), "-Xptxas", "-v",
                   "-cubin", cu, "-o", os.path.join(work_dir, f"{stem}.{arch}.cubin")]
            done = subprocess.run(cmd, capture_output=True, text=True, cwd=work_dir)
            log = done.stderr + done.stdout
            if done.returncode != 0:
                problems.append(f"{stem}.metal does not compile for {arch}:\n{log}")
                continue
            entry, seen = None, set()
            for line in log.splitlines():
                m = _ENTRY.search(line)
                if m:
                    entry = m.group(1)
                    seen.add(entry)
                    continue
                s = _SPILL.search(line)
                if s and entry and (int(s.group(1)) or int(s.group(2))):
                    problems.append(f"{stem}.metal: kernel {entry} spills registers on {arch} "
                                    f"({s.group(0)})")
            for missing in sorted(expected[stem] - seen):
                problems.append(f"{stem}.metal: kernel {missing} has no entry point in the "
                                f"{arch} code")
        return problems

    with ThreadPoolExecutor(max_workers=jobs or os.cpu_count() or 1) as pool:
        for found in pool.map(one, sources):
            problems += found
    return problems


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("command", choices=("check", "build"))
    parser.add_argument("--out", help="build: folder for the fatbins")
    parser.add_argument("--jobs", type=int, default=0)
    args = parser.parse_args(argv)
    nvcc = find_nvcc()
    if nvcc is None:
        print("build.py: no nvcc found (PATH, CUDA_HOME or the nvidia-cuda-nvcc wheel)",
              file=sys.stderr)
        return 2
    with tempfile.TemporaryDirectory(prefix="dm-cuda-") as work:
        if args.command == "build":
            modules = build_modules(args.out or work, work, nvcc, jobs=args.jobs)
            print(f"built {len(modules)} modules with {nvcc}")
            return 0
        problems = check(nvcc, work, args.jobs)
        count = sum(len(metal2cuda.translate(open(m, encoding="utf-8").read(), m).kernels)
                    for m in kernel_sources())
        if problems:
            print("\n".join(problems), file=sys.stderr)
            print(f"CUDA check: {len(problems)} problem(s)", file=sys.stderr)
            return 1
        print(f"CUDA check: {count} kernels from {len(kernel_sources())} .metal files compile "
              f"for {', '.join(ARCHS)} without spills ({nvcc})")
        return 0


if __name__ == "__main__":
    sys.exit(main())
