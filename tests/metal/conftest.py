"""Session fixtures of the Metal kernel tests: the shim's emulator device, and emulator builds
of every shader made here (IEEE math, and -ffast-math for the kernels that must stay finite
without it), to dispatch to by hand (runners) or through ``run_case`` (devices)."""

from __future__ import annotations

import pytest
from metal_harness import HarnessDevice, Runner, build_library, emu_harness


@pytest.fixture(scope="session")
def emu_device():
    """The shim's emulator device (what ``device="emu"`` runs on), two host threads."""
    from darknet_metal.metal import _shim

    dev = _shim.Device("emu", emu_threads=2)
    yield dev
    dev.close()


@pytest.fixture(scope="module")
def cuda_device():
    """The process-wide 'cuda' device (the kernels translated to CUDA, on an NVIDIA GPU),
    its group order reset to forward afterwards; skipped where there is none."""
    from devices import require

    require("cuda")
    from darknet_metal import metal

    dev = metal.get_device("cuda")
    yield dev
    dev.set_thread_order("forward")


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


@pytest.fixture(params=["ieee", "fast_math"])
def any_math_device(request):
    """``any_math_runner``'s build as a device for ``run_case``."""
    return HarnessDevice(request.getfixturevalue(
        "emu_runner" if request.param == "ieee" else "fast_math_runner").emu)
