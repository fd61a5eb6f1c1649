"""Build the Cython CPU reference extensions and the host shim.

Every ``darknet_metal/cpu/*.pyx`` becomes an extension module; adding a module needs no
change here. ``DARKNET_METAL_DEBUG=1`` turns Cython's bounds and wraparound checks on.

``darknet_metal.metal._shim`` links the shim's portable core (``shim/core``), the emulator
driver and runtime (``shim/drivers/emu_driver.cpp``, ``shim/emu``) and every kernel in
``shaders/*.metal`` and ``shim/kernels/*.metal``. Two build steps come before its link: each
``.metal`` is translated by ``shim/emu/metal2cpp.py`` into a ``.cpp`` under the build
directory (again only when the ``.metal`` or the translator changed), then the shim's C, C++
and Objective-C sources and those ``.cpp`` files are compiled with their language's flags
(again only when a source or a header changed). On macOS it also links the Objective-C Metal
driver and, when ``xcrun metal`` exists, builds ``darknet_metal.metallib`` next to the
extension. The CUDA driver (``shim/drivers/cuda_driver.cpp``) is always linked: it loads the
NVIDIA driver library at run time. Where nvcc is found (PATH, ``CUDA_HOME`` or the
``nvidia-cuda-nvcc`` wheel) and ``DARKNET_METAL_CUDA`` is not ``0``, ``shim/cuda/build.py``
translates the kernels to CUDA and writes one fatbin per ``.metal`` file under ``cuda/`` next
to the extension. The ``.metal`` sources and their headers are installed as package data
(``darknet_metal/metal/shaders``) so the Metal driver can compile them at run time.
"""

import importlib.util
import os
import shutil
import subprocess
import sys
from concurrent.futures import ThreadPoolExecutor
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
METAL2CPP = os.path.join("shim", "emu", "metal2cpp.py")
CUDA_BUILD = os.path.join("shim", "cuda", "build.py")
#: DARKNET_METAL_CUDA: "auto" (default) builds the CUDA kernels when nvcc is found, "0" never.
CUDA_SETTING = os.environ.get("DARKNET_METAL_CUDA", "auto").strip().lower()
#: Flags of the shim's own sources by suffix (the Cython module is C++ too).
LANGUAGE_FLAGS = {
    ".c": ["-std=c11", "-D_POSIX_C_SOURCE=200809L"],
    ".cpp": ["-std=c++17"],
    ".m": ["-fobjc-arc", "-fblocks"],
}


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


def _shim_native_sources() -> list[str]:
    """The shim's hand-written C, C++ and (macOS) Objective-C sources."""
    sources = sorted(glob(os.path.join("shim", "core", "*.c")))
    sources += [
        os.path.join("shim", "drivers", "emu_driver.cpp"),
        os.path.join("shim", "drivers", "bindings.c"),
        os.path.join("shim", "drivers", "cuda_driver.cpp"),
        os.path.join("shim", "emu", "emu_runtime.cpp"),
        os.path.join("shim", "emu", "fiber.cpp"),
    ]
    if MACOS:
        sources.append(os.path.join("shim", "drivers", "metal_driver.m"))
    return sources


def _shim_headers() -> list[str]:
    """Every header a shim source or a translated kernel may include."""
    return sorted(
        glob(os.path.join("shim", "*.h")) + glob(os.path.join("shim", "*", "*.h"))
    ) + _shader_headers()


def _shim_extension() -> Extension:
    # Only the Cython module is an extension source: BuildExt compiles the native sources and
    # the kernels itself, each language with its own flags, and links their objects in.
    macros = [("NPY_NO_DEPRECATED_API", "NPY_1_7_API_VERSION")]
    link_args = ["-lpthread", "-ldl"] if not MACOS else []
    if MACOS:
        macros.append(("DM_HAVE_METAL", "1"))
        link_args += ["-framework", "Metal", "-framework", "Foundation"]
    return Extension(
        SHIM_MODULE,
        [os.path.join("darknet_metal", "metal", "_shim.pyx")],
        language="c++",
        include_dirs=["shim", os.path.join("shim", "emu"), "shaders", numpy.get_include()],
        define_macros=macros,
        extra_compile_args=OPT + LANGUAGE_FLAGS[".cpp"],
        extra_link_args=link_args,
        # What the objects are built from: a change here relinks the extension.
        depends=_shim_headers() + _shim_native_sources() + _kernel_sources() + [METAL2CPP]
        + sorted(glob(os.path.join("shim", "cuda", "*.py"))),
    )


def _load_script(relative: str, name: str):
    path = os.path.join(HERE, relative)
    spec = importlib.util.spec_from_file_location(name, path)
    module = importlib.util.module_from_spec(spec)
    sys.modules.setdefault(name, module)
    spec.loader.exec_module(module)
    return module


def _load_metal2cpp():
    return _load_script(METAL2CPP, "metal2cpp")


def _stale(target: str, inputs: list[str]) -> bool:
    """Whether ``target`` is missing or older than any of ``inputs``."""
    if not os.path.exists(target):
        return True
    built = os.path.getmtime(target)
    return any(os.path.getmtime(path) > built for path in inputs)


class BuildExt(build_ext):
    """The shim's build steps before its link (kernels translated from .metal, native sources
    compiled per language) and the .metallib on macOS."""

    def build_extension(self, ext: Extension) -> None:
        if ext.name == SHIM_MODULE:
            sources = _shim_native_sources() + self._translate_kernels()
            ext.extra_objects = self._compile_native(ext, sources)
        super().build_extension(ext)
        if ext.name == SHIM_MODULE and MACOS:
            self._build_metallib(ext)
        if ext.name == SHIM_MODULE:
            self._build_cuda_modules(ext)

    def _build_cuda_modules(self, ext: Extension) -> None:
        """The kernels as CUDA fatbins under ``cuda/`` next to the extension, when nvcc is
        found; without nvcc the 'cuda' device reports that its kernels are missing."""
        if CUDA_SETTING in ("0", "no", "off", "false"):
            return
        cuda_build = _load_script(CUDA_BUILD, "dm_cuda_build")
        nvcc = cuda_build.find_nvcc()
        if nvcc is None:
            if CUDA_SETTING not in ("", "auto"):
                raise RuntimeError("DARKNET_METAL_CUDA is set but no nvcc was found")
            print("darknet_metal: nvcc not found; the 'cuda' device will have no kernels")
            return
        target = os.path.join(os.path.dirname(self.get_ext_fullpath(ext.name)), "cuda")
        work = os.path.join(self.build_temp, "dm_cuda")
        print(f"darknet_metal: building the CUDA kernels with {nvcc}")
        cuda_build.build_modules(target, work, nvcc, force=self.force)

    def copy_extensions_to_source(self) -> None:
        """In-place builds: the CUDA modules go beside the extension too."""
        super().copy_extensions_to_source()
        built = os.path.join(self.build_lib, *SHIM_MODULE.split(".")[:-1], "cuda")
        if not os.path.isdir(built):
            return
        source = os.path.join(HERE, *SHIM_MODULE.split(".")[:-1], "cuda")
        os.makedirs(source, exist_ok=True)
        for name in sorted(os.listdir(built)):
            shutil.copy2(os.path.join(built, name), os.path.join(source, name))

    def _translate_kernels(self) -> list[str]:
        """Every kernel source as C++ for the emulator, under the build directory; a .metal
        is translated again only when it or the translator is newer than its .cpp."""
        out_dir = os.path.join(self.build_temp, "dm_kernels")
        os.makedirs(out_dir, exist_ok=True)
        metal2cpp = None
        generated = []
        for metal in _kernel_sources():
            stem = os.path.splitext(os.path.basename(metal))[0]
            out = os.path.join(out_dir, f"{stem}.cpp")
            if self.force or _stale(out, [metal, METAL2CPP]):
                metal2cpp = metal2cpp or _load_metal2cpp()
                with open(metal, encoding="utf-8") as f:
                    result = metal2cpp.translate(
                        f.read(), os.path.abspath(metal), output_name=os.path.abspath(out)
                    )
                tmp = f"{out}.tmp{os.getpid()}"
                with open(tmp, "w", encoding="utf-8") as f:
                    f.write(result.cpp)
                os.replace(tmp, out)
            generated.append(out)
        return generated

    def _compile_native(self, ext: Extension, sources: list[str]) -> list[str]:
        """Objects of ``sources``, each compiled with ``OPT`` and its language's flags when
        it, or any header it may include, is newer than its object."""
        headers = _shim_headers()
        objects = []
        for suffix, flags in LANGUAGE_FLAGS.items():
            group = [s for s in sources if s.endswith(suffix)]
            if not group:
                continue
            if suffix not in self.compiler.src_extensions:  # .m: unknown to distutils
                self.compiler.src_extensions.append(suffix)
            targets = self.compiler.object_filenames(group, output_dir=self.build_temp)
            stale = [src for src, obj in zip(group, targets, strict=True)
                     if self.force or _stale(obj, [src, *headers])]
            def compile_some(some: list[str], flags: list[str] = flags) -> None:
                self.compiler.compile(
                    some,
                    output_dir=self.build_temp,
                    macros=ext.define_macros,
                    include_dirs=ext.include_dirs,
                    debug=self.debug,
                    extra_postargs=OPT + flags,
                )

            jobs = self.parallel if isinstance(self.parallel, int) and self.parallel > 1 else 1
            if len(stale) > 1 and jobs > 1:  # build_ext -j N: one compiler process per source
                with ThreadPoolExecutor(max_workers=jobs) as pool:
                    list(pool.map(lambda src: compile_some([src]), stale))
            elif stale:
                compile_some(stale)
            objects += targets
        return objects

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
