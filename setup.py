"""Build the Cython CPU reference extensions and the host shim.

Every ``darknet_metal/cpu/*.pyx`` becomes an extension module; adding a module needs no
change here. ``DARKNET_METAL_DEBUG=1`` turns Cython's bounds and wraparound checks on.

``darknet_metal.metal._shim`` links the shim's portable core (``shim/core``), the emulator
driver and runtime (``shim/drivers/emu_driver.cpp``, ``shim/emu``) and every kernel in
``shaders/*.metal`` and ``shim/kernels/*.metal``, rewritten to C++ by ``tools/metal2cpp.py``
into the build directory. On macOS it also links the Objective-C Metal driver and, when
``xcrun metal`` exists, builds ``darknet_metal.metallib`` next to the extension. The
``.metal`` sources and their headers are installed as package data
(``darknet_metal/metal/shaders``) so the Metal driver can compile them at run time.
"""

import importlib.util
import os
import shutil
import subprocess
import sys
from glob import glob

import numpy
from Cython.Build import cythonize
from setuptools import Extension, setup
from setuptools.command.build_ext import build_ext
from setuptools.command.build_py import build_py

HERE = os.path.dirname(os.path.abspath(__file__))
DEBUG = os.environ.get("DARKNET_METAL_DEBUG", "") not in ("", "0")
MACOS = sys.platform == "darwin"
SHIM_MODULE = "darknet_metal.metal._shim"
OPT = ["-O0", "-g"] if DEBUG else ["-O2"]


def _kernel_sources() -> list[str]:
    """Every .metal file the shim is built with (relative paths, sorted)."""
    return sorted(glob(os.path.join("shaders", "*.metal"))) + sorted(
        glob(os.path.join("shim", "kernels", "*.metal"))
    )


def _shader_headers() -> list[str]:
    return sorted(glob(os.path.join("shaders", "*.h")))


def _cpu_extensions() -> list[Extension]:
    # No OpenMP: the GEMMs run on BLAS's own threads, and OpenMP threads between them were
    # measured to fight those for the cores. No contraction into FMAs, so x86-64 and arm64
    # builds round alike. No trapping math: without it GCC keeps a select such as
    # "x > 0 ? x : 0.1f * x" a branch (the multiply might trap) and leaves the activation
    # loops of kernels.h scalar; results are unchanged (only floating-point exception flags
    # may be raised by work whose result is discarded).
    opt = (["-O0", "-g"] if DEBUG else ["-O3"]) + ["-ffp-contract=off", "-fno-trapping-math"]
    extensions = []
    for pyx in sorted(glob(os.path.join("darknet_metal", "cpu", "*.pyx"))):
        module = pyx[: -len(".pyx")].replace(os.sep, ".")
        extensions.append(
            Extension(
                module,
                [pyx],
                include_dirs=[numpy.get_include()],
                define_macros=[("NPY_NO_DEPRECATED_API", "NPY_1_7_API_VERSION")],
                extra_compile_args=opt,
                depends=sorted(glob(os.path.join("darknet_metal", "cpu", "*.h"))),
                extra_link_args=[] if MACOS else ["-pthread", "-ldl"],
            )
        )
    return extensions


def _shim_extension() -> Extension:
    sources = [os.path.join("darknet_metal", "metal", "_shim.pyx")]
    sources += sorted(glob(os.path.join("shim", "core", "*.c")))
    sources += [
        os.path.join("shim", "drivers", "emu_driver.cpp"),
        os.path.join("shim", "emu", "emu_runtime.cpp"),
        os.path.join("shim", "emu", "fiber.cpp"),
    ]
    macros = [("NPY_NO_DEPRECATED_API", "NPY_1_7_API_VERSION")]
    link_args = ["-lpthread"] if not MACOS else []
    if MACOS:
        sources.append(os.path.join("shim", "drivers", "metal_driver.m"))
        macros.append(("DM_HAVE_METAL", "1"))
        link_args += ["-framework", "Metal", "-framework", "Foundation"]
    depends = sorted(
        glob(os.path.join("shim", "*.h"))
        + glob(os.path.join("shim", "*", "*.h"))
        + _shader_headers()
        + _kernel_sources()
        + [os.path.join("tools", "metal2cpp.py")]
    )
    return Extension(
        SHIM_MODULE,
        sources,
        language="c++",
        include_dirs=["shim", os.path.join("shim", "emu"), "shaders", numpy.get_include()],
        define_macros=macros,
        extra_compile_args=list(OPT),
        extra_link_args=link_args,
        depends=depends,
    )


def _load_metal2cpp():
    path = os.path.join(HERE, "tools", "metal2cpp.py")
    spec = importlib.util.spec_from_file_location("metal2cpp", path)
    module = importlib.util.module_from_spec(spec)
    sys.modules.setdefault("metal2cpp", module)
    spec.loader.exec_module(module)
    return module


def _write_if_changed(path: str, text: str) -> None:
    # An unchanged file keeps its mtime, so an unchanged kernel is not a reason to relink.
    if os.path.exists(path):
        with open(path, encoding="utf-8") as f:
            if f.read() == text:
                return
    tmp = f"{path}.tmp{os.getpid()}"
    with open(tmp, "w", encoding="utf-8") as f:
        f.write(text)
    os.replace(tmp, path)


class BuildExt(build_ext):
    """Per-language flags for the mixed C / C++ / Objective-C shim, kernels rewritten from
    .metal at build time, and the .metallib on macOS."""

    def build_extensions(self) -> None:
        compiler = self.compiler
        if ".m" not in compiler.src_extensions:
            compiler.src_extensions.append(".m")
        if hasattr(compiler, "language_map"):
            compiler.language_map[".m"] = "objc"
        original = compiler._compile

        def compile_one(obj, src, ext, cc_args, extra_postargs, pp_opts):
            extra = list(extra_postargs)
            if src.endswith((".cpp", ".cc", ".cxx")):
                extra += ["-std=c++17"]
            elif src.endswith(".c") and "darknet_metal" + os.sep + "cpu" not in src:
                extra += ["-std=c11", "-D_POSIX_C_SOURCE=200809L"]
            elif src.endswith(".m"):
                extra += ["-fobjc-arc", "-fblocks"]
            return original(obj, src, ext, cc_args, extra, pp_opts)

        compiler._compile = compile_one
        super().build_extensions()

    def build_extension(self, ext: Extension) -> None:
        if ext.name == SHIM_MODULE:
            ext.sources = [s for s in ext.sources if "dm_kernels" not in s]
            ext.sources += self._translate_kernels()
        super().build_extension(ext)
        if ext.name == SHIM_MODULE and MACOS:
            self._build_metallib(ext)

    def _translate_kernels(self) -> list[str]:
        metal2cpp = _load_metal2cpp()
        out_dir = os.path.join(self.build_temp, "dm_kernels")
        os.makedirs(out_dir, exist_ok=True)
        generated = []
        for metal in _kernel_sources():
            stem = os.path.splitext(os.path.basename(metal))[0]
            out = os.path.join(out_dir, f"{stem}.cpp")
            result = metal2cpp.translate(
                open(metal, encoding="utf-8").read(),
                os.path.abspath(metal),
                output_name=os.path.abspath(out),
            )
            _write_if_changed(out, result.cpp)
            generated.append(out)
        return generated

    def _build_metallib(self, ext: Extension) -> None:
        sources = _kernel_sources()
        if not sources or shutil.which("xcrun") is None:
            return
        probe = subprocess.run(
            ["xcrun", "-sdk", "macosx", "--find", "metal"], capture_output=True, text=True
        )
        if probe.returncode != 0:
            print("darknet_metal: xcrun metal not found; kernels compile at run time")
            return
        air_dir = os.path.join(self.build_temp, "metal_air")
        os.makedirs(air_dir, exist_ok=True)
        airs = []
        for metal in sources:
            air = os.path.join(air_dir, os.path.basename(metal)[: -len(".metal")] + ".air")
            cmd = ["xcrun", "-sdk", "macosx", "metal", "-c", "-std=metal3.0", "-Ishaders"]
            cmd += ["-fno-fast-math", metal, "-o", air]
            if subprocess.run(cmd).returncode != 0:
                print(f"darknet_metal: {metal} failed to compile; kernels compile at run time")
                return
            airs.append(air)
        target = os.path.join(
            os.path.dirname(self.get_ext_fullpath(ext.name)), "darknet_metal.metallib"
        )
        cmd = ["xcrun", "-sdk", "macosx", "metallib", *airs, "-o", target]
        if subprocess.run(cmd).returncode != 0:
            print("darknet_metal: metallib failed; kernels compile at run time")


class BuildPy(build_py):
    """Installs the .metal sources and shader headers under darknet_metal/metal/shaders."""

    def run(self) -> None:
        super().run()
        target = os.path.join(self.build_lib, "darknet_metal", "metal", "shaders")
        os.makedirs(target, exist_ok=True)
        for path in _kernel_sources() + _shader_headers():
            shutil.copy2(path, os.path.join(target, os.path.basename(path)))


def _extensions() -> list[Extension]:
    return cythonize(
        _cpu_extensions() + [_shim_extension()],
        language_level=3,
        quiet=True,
        compiler_directives={
            "boundscheck": DEBUG,
            "wraparound": DEBUG,
            "initializedcheck": DEBUG,
            "cdivision": not DEBUG,
            "embedsignature": True,
        },
    )


setup(ext_modules=_extensions(), cmdclass={"build_ext": BuildExt, "build_py": BuildPy})
