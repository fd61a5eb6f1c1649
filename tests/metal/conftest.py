"""Session fixtures of the Metal kernel tests: emulator builds of every shader (IEEE math,
and -ffast-math for the kernels that must stay finite without it)."""

from __future__ import annotations

import pytest
from metal_harness import Runner, build_library, emu_harness


@pytest.fixture(scope="session")
def emu_runner():
    emu = emu_harness.Emu(build_library(), threads=2)
    yield Runner(emu)
    emu.close()


@pytest.fixture(scope="session")
def fast_math_runner():
    """Every shader built with -ffast-math (see ``build_library``)."""
    emu = emu_harness.Emu(build_library(fast_math=True), threads=2)
    yield Runner(emu)
    emu.close()


@pytest.fixture(params=["ieee", "fast_math"])
def any_math_runner(request):
    """Each test using it runs twice: on the IEEE build and on the -ffast-math build."""
    return request.getfixturevalue("emu_runner" if request.param == "ieee"
                                   else "fast_math_runner")
