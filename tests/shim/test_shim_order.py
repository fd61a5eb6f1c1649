"""Thread order of the emulator: API and DARKNET_METAL_EMU_ORDER."""

import os
import subprocess
import sys

import numpy as np
import pytest

from darknet_metal.metal import _shim


@pytest.fixture
def device():
    """A fresh emulator device with two host threads, closed after the test."""
    dev = _shim.Device("emu", emu_threads=2)
    yield dev
    dev.close()


N = 64  # one threadgroup, so the counter sees the order inside the group only


def run_probe(device) -> np.ndarray:
    counter = device.upload(np.zeros(1, np.uint32))
    out = device.buffer(4 * N)
    device.dispatch("selftest_order_probe_u32", None, [counter, out], N, N)
    return out.read(dtype=np.uint32)


def test_forward_and_reverse(device):
    assert device.thread_order == ("forward", 0)
    np.testing.assert_array_equal(run_probe(device), np.arange(N))
    device.set_thread_order("reverse")
    assert device.thread_order == ("reverse", 0)
    np.testing.assert_array_equal(run_probe(device), np.arange(N)[::-1])


def test_random_is_a_seeded_permutation(device):
    device.set_thread_order("random", seed=3)
    first = run_probe(device)
    assert sorted(first.tolist()) == list(range(N))
    assert not np.array_equal(first, np.arange(N))
    assert not np.array_equal(first, np.arange(N)[::-1])
    device.set_thread_order("random", seed=3)  # restarts the same sequence of schedules
    np.testing.assert_array_equal(run_probe(device), first)


def test_environment_variable_sets_the_initial_order():
    code = (
        "import numpy as np\n"
        "from darknet_metal.metal import _shim\n"
        "d = _shim.Device('emu', emu_threads=1)\n"
        "c = d.upload(np.zeros(1, np.uint32)); o = d.buffer(256)\n"
        "d.dispatch('selftest_order_probe_u32', None, [c, o], 64, 64)\n"
        "print(d.thread_order[0], d.thread_order[1], ' '.join(map(str, o.read(np.uint32))))\n"
    )
    env = dict(os.environ, DARKNET_METAL_EMU_ORDER="reverse")
    proc = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True)
    assert proc.returncode == 0, proc.stderr
    words = proc.stdout.split()
    assert words[:2] == ["reverse", "0"]
    assert [int(w) for w in words[2:]] == list(range(N))[::-1]
    env["DARKNET_METAL_EMU_ORDER"] = "random:42"
    proc = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True)
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.split()[:2] == ["random", "42"]
