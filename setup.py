"""Build the Cython CPU reference extensions.

Every ``darknet_metal/cpu/*.pyx`` becomes an extension module; adding a module needs no
change here. ``DARKNET_METAL_DEBUG=1`` turns Cython's bounds and wraparound checks on.
"""

import os
import sys
from glob import glob

import numpy
from Cython.Build import cythonize
from setuptools import Extension, setup

DEBUG = os.environ.get("DARKNET_METAL_DEBUG", "") not in ("", "0")


def _openmp_flags() -> tuple[list[str], list[str]]:
    # Apple clang has no -fopenmp; Cython's prange then runs serially, which is correct.
    if sys.platform == "darwin" or os.environ.get("DARKNET_METAL_NO_OPENMP"):
        return [], []
    return ["-fopenmp"], ["-fopenmp"]


def _extensions() -> list[Extension]:
    omp_compile, omp_link = _openmp_flags()
    opt = ["-O0", "-g"] if DEBUG else ["-O3"]
    extensions = []
    for pyx in sorted(glob(os.path.join("darknet_metal", "cpu", "*.pyx"))):
        module = pyx[: -len(".pyx")].replace(os.sep, ".")
        extensions.append(
            Extension(
                module,
                [pyx],
                include_dirs=[numpy.get_include()],
                define_macros=[("NPY_NO_DEPRECATED_API", "NPY_1_7_API_VERSION")],
                extra_compile_args=opt + omp_compile,
                extra_link_args=omp_link,
            )
        )
    return cythonize(
        extensions,
        language_level=3,
        compiler_directives={
            "boundscheck": DEBUG,
            "wraparound": DEBUG,
            "initializedcheck": DEBUG,
            "cdivision": not DEBUG,
            "embedsignature": True,
        },
    )


setup(ext_modules=_extensions())
