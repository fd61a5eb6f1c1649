"""Build the Cython CPU extensions and the host shim.

Every ``darknet_metal/cpu/*.pyx`` becomes an extension module; adding a module needs no
change here. The Cython modules share one module of Cython's utility code
(``darknet_metal._cyutility``) instead of compiling a copy each. ``DARKNET_METAL_DEBUG=1``
turns Cython's bounds and wraparound checks on.

``darknet_metal.metal._shim`` links the shim's portable core (``shim/core``), the emulator
driver and runtime (``shim/drivers/emu_driver.cpp``, ``shim/emu``) and the CUDA driver
(``shim/drivers/cuda_driver.cpp``, which loads the NVIDIA driver library at run time); its C,
C++ and Objective-C sources are compiled with their language's flags, again only when a
source or a header changed. On macOS it also links the Objective-C Metal driver and, when
``xcrun metal`` exists, builds ``darknet_metal.metallib`` next to the extension.

No kernel is compiled here for the emulator or for CUDA: ``darknet_metal.metal.kernel_build``
compiles them on the first use of their device (or ``darknet-metal build-kernels``), from the
``.metal`` sources and translators installed as package data under
``darknet_metal/metal/toolchain`` (laid out as in the source tree).

Extensions compile in parallel, one job per core. An editable install whose extensions in
the source tree are newer than their sources reuses them: adding an extra with
``pip install -e ".[extra]"`` compiles nothing.
"""

import os
import shutil
import subprocess
import sys
import sysconfig
from concurrent.futures import ThreadPoolExecutor
from glob import glob

import Cython
from Cython.Build import cythonize
from setuptools import Extension, setup
from setuptools.command.build_ext import build_ext
from setuptools.command.build_py import build_py

HERE = os.path.dirname(os.path.abspath(__file__))
DEBUG = os.environ.get("DARKNET_METAL_DEBUG", "") not in ("", "0")
MACOS = sys.platform == "darwin"
SHIM_MODULE = "darknet_metal.metal._shim"
# No debug information outside debug builds: less compile time, smaller modules.
OPT = ["-O0", "-g"] if DEBUG else ["-O2", "-g0"]
SHARED_UTILITY = "darknet_metal._cyutility"
#: Cython 3.1 added the shared utility module; an older one (a build without isolation) gives
#: every module its own copy, as before.
SHARES_UTILITY = tuple(int(p) for p in Cython.__version__.split(".")[:2]) >= (3, 1)
#: Flags of the shim's own sources by suffix (the Cython module is C++ too).
LANGUAGE_FLAGS = {
    ".c": ["-std=c11", "-D_POSIX_C_SOURCE=200809L"],
    ".cpp": ["-std=c++17"],
    ".m": ["-fobjc-arc", "-fblocks"],
}


def _kernel_sources() -> list[str]:
    """Every .metal file (relative paths, sorted)."""
    return sorted(glob(os.path.join("shaders", "*.metal"))) + sorted(
        glob(os.path.join("shim", "kernels", "*.metal"))
    )


def _shader_headers() -> list[str]:
    return sorted(glob(os.path.join("shaders", "*.h")))


def _toolchain_files() -> list[str]:
    """What run-time kernel builds read, relative to the source tree (kernel_build)."""
    return sorted(
        _kernel_sources() + _shader_headers()
        + glob(os.path.join("shim", "*.h"))
        + glob(os.path.join("shim", "emu", "*.h"))
        + [os.path.join("shim", "emu", "metal2cpp.py"),
           os.path.join("shim", "emu", "emu_library.cpp")]
        + glob(os.path.join("shim", "cuda", "*.py"))
        + glob(os.path.join("shim", "cuda", "*.h"))
    )


def _cpu_extensions() -> list[Extension]:
    # No OpenMP: the GEMMs run on BLAS's own threads, and OpenMP threads between them were
    # measured to fight those for the cores. No contraction into FMAs, so x86-64 and arm64
    # builds round alike. No trapping math: without it GCC keeps a select such as
    # "x > 0 ? x : 0.1f * x" a branch (the multiply might trap) and leaves the activation
    # loops of kernels.h scalar; results are unchanged (only floating-point exception flags
    # may be raised by work whose result is discarded).
    opt = (["-O0", "-g"] if DEBUG else ["-O3", "-g0"]) + ["-ffp-contract=off", "-fno-trapping-math"]
    extensions = []
    if SHARES_UTILITY:
        path = os.path.join(*SHARED_UTILITY.split(".")) + ".c"
        extensions.append(Extension(SHARED_UTILITY, [path], extra_compile_args=opt))
    for pyx in sorted(glob(os.path.join("darknet_metal", "cpu", "*.pyx"))):
        module = pyx[: -len(".pyx")].replace(os.sep, ".")
        extensions.append(
            Extension(
                module,
                [pyx],
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
    """Every header a shim source may include."""
    return sorted(
        glob(os.path.join("shim", "*.h")) + glob(os.path.join("shim", "*", "*.h"))
    ) + _shader_headers()


def _shim_extension() -> Extension:
    # Only the Cython module is an extension source: BuildExt compiles the native sources
    # itself, each language with its own flags, and links their objects in.
    macros = [("NPY_NO_DEPRECATED_API", "NPY_1_7_API_VERSION")]
    link_args = ["-lpthread", "-ldl"] if not MACOS else []
    if MACOS:
        macros.append(("DM_HAVE_METAL", "1"))
        link_args += ["-framework", "Metal", "-framework", "Foundation"]
    return Extension(
        SHIM_MODULE,
        [os.path.join("darknet_metal", "metal", "_shim.pyx")],
        language="c++",
        include_dirs=["shim", os.path.join("shim", "emu"), "shaders"],
        define_macros=macros,
        extra_compile_args=OPT + LANGUAGE_FLAGS[".cpp"],
        extra_link_args=link_args,
        # What the objects are built from: a change here relinks the extension.
        depends=_shim_headers() + _shim_native_sources(),
    )


def _stale(target: str, inputs: list[str]) -> bool:
    """Whether ``target`` is missing or older than any of ``inputs``."""
    if not os.path.exists(target):
        return True
    built = os.path.getmtime(target)
    return any(os.path.getmtime(path) > built for path in inputs)


def _generated(ext: Extension) -> str:
    """The C or C++ file Cython writes for ``ext`` (its source, for the utility module)."""
    source = ext.sources[0]
    if not source.endswith(".pyx"):
        return source
    return source[: -len(".pyx")] + (".cpp" if ext.language == "c++" else ".c")


def _current_in_place(ext: Extension) -> bool:
    """Whether the copy of ``ext`` built in the source tree is newer than the project's files
    it is made from (its .pyx, every .pxd, its headers and native sources, the C Cython wrote).
    Cython's own check would also weigh NumPy's and SciPy's .pxd files, which each isolated
    build environment installs anew, and so would translate and compile everything again."""
    built = os.path.join(HERE, *ext.name.split(".")) + sysconfig.get_config_var("EXT_SUFFIX")
    pxds = glob(os.path.join("darknet_metal", "**", "*.pxd"), recursive=True)
    if ext.name == SHARED_UTILITY:  # made from every module
        inputs = glob(os.path.join("darknet_metal", "**", "*.pyx"), recursive=True) + pxds
    else:
        inputs = [s for s in ext.sources if s.endswith(".pyx")] + pxds + list(ext.depends)
    generated = _generated(ext)
    return os.path.exists(generated) and not _stale(built, [*inputs, generated])


class BuildExt(build_ext):
    """The shim's native sources compiled per language before its link, extensions in
    parallel, editable installs reusing up-to-date extensions, and the .metallib on macOS."""

    def finalize_options(self) -> None:
        super().finalize_options()
        if not self.parallel:  # pip passes no -j: one job per core
            self.parallel = os.cpu_count() or 1

    def build_extension(self, ext: Extension) -> None:
        if self.editable_mode and self._reuse_in_place(ext):
            return
        if ext.name == SHIM_MODULE:
            ext.extra_objects = self._compile_native(ext, _shim_native_sources())
        super().build_extension(ext)
        if ext.name == SHIM_MODULE and MACOS:
            self._build_metallib(ext)

    def _reuse_in_place(self, ext: Extension) -> bool:
        """Copies the extension already built in the source tree to where this build puts
        it, when it is current (``_current_in_place``); False when it must be built."""
        in_place = os.path.join(HERE, self.get_ext_filename(ext.name))
        if self.force or not _current_in_place(ext):
            return False
        target = self.get_ext_fullpath(ext.name)
        os.makedirs(os.path.dirname(target), exist_ok=True)
        shutil.copy2(in_place, target)
        print(f"darknet_metal: {ext.name} is up to date in the source tree; not rebuilt")
        return True

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
    """Installs what run-time kernel builds read under darknet_metal/metal/toolchain, laid
    out as in the source tree."""

    def run(self) -> None:
        super().run()
        target = os.path.join(self.build_lib, "darknet_metal", "metal", "toolchain")
        for path in _toolchain_files():
            os.makedirs(os.path.join(target, os.path.dirname(path)), exist_ok=True)
            shutil.copy2(path, os.path.join(target, path))


def _extensions() -> list[Extension]:
    """Every extension, with Cython run on those not current in the source tree."""
    extensions = _cpu_extensions() + [_shim_extension()]
    current = [ext for ext in extensions if _current_in_place(ext)]
    for ext in current:
        ext.sources = [_generated(ext)]
    stale = [ext for ext in extensions if ext not in current]
    extensions = (_cythonize(stale) if stale else []) + current
    # Largest C first: the parallel build then ends with short compiles, not one long one.
    return sorted(extensions, key=lambda ext: -os.path.getsize(ext.sources[0]))


def _cythonize(extensions: list[Extension]) -> list[Extension]:
    return cythonize(
        extensions,
        language_level=3,
        quiet=True,
        **({"shared_utility_qualified_name": SHARED_UTILITY} if SHARES_UTILITY else {}),
        # Cython's own translation in parallel too (worker processes, forked only on Linux).
        nthreads=(os.cpu_count() or 1) if sys.platform.startswith("linux") else 0,
        compiler_directives={
            "boundscheck": DEBUG,
            "wraparound": DEBUG,
            "initializedcheck": DEBUG,
            "cdivision": not DEBUG,
            "embedsignature": True,
        },
    )


setup(ext_modules=_extensions(), cmdclass={"build_ext": BuildExt, "build_py": BuildPy})
