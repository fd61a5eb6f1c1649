"""Session fixtures of the Metal kernel tests: one emulator build of every shader."""

from __future__ import annotations

import pytest
from metal_harness import Runner, build_library, emu_harness


@pytest.fixture(scope="session")
def emu_runner():
    emu = emu_harness.Emu(build_library(), threads=2)
    yield Runner(emu)
    emu.close()
