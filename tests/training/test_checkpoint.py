"""Training checkpoints: a resumed run continues exactly, and a kill at any moment of a save
leaves a pair that loads."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import textwrap
import time

import numpy as np
import pytest
from training_golden import TRAIN

import darknet_metal as dm
from darknet_metal.errors import CheckpointError
from darknet_metal.training.checkpoint import (
    find_checkpoint,
    restore_training_state,
    save_checkpoint,
    state_path,
)

CASE = TRAIN / "micro-v4-sgd"
CFG, INIT = CASE / "micro-v4-sgd.cfg", CASE / "init.weights"


def _net(weights=INIT, adam=0):
    net = dm.load(CFG, weights, seed=1)
    net.config.net.values.update(burn_in=0, adam=adam, learning_rate=1e-3)
    return net


def _batch(net, k):
    rng = np.random.default_rng(k)
    b = net.config.net.values["batch"]
    x = rng.random((b, *net.input_shape), dtype=np.float32)
    truths = [np.array([[k % 2, 0.3 + 0.05 * (k % 5), 0.4, 0.2, 0.3]], np.float32)
              for _ in range(b)]
    return x, truths


def _params(net):
    return {(i, n): a.copy() for i, p in net.params.items() for n, a in p.items()}


@pytest.mark.parametrize("adam", [0, 1])
def test_resuming_continues_exactly(tmp_path, adam):
    straight = _net(adam=adam)
    for k in range(4):
        straight.train_step(*_batch(straight, k))
    stopped = _net(adam=adam)
    for k in range(2):
        stopped.train_step(*_batch(stopped, k))
    path = tmp_path / "micro_last.weights"
    save_checkpoint(stopped, path, {"avg_loss": 1.5})
    found = find_checkpoint(path)
    assert found.weights == path and found.state == state_path(path)
    assert found.iteration == 2 and found.info["avg_loss"] == 1.5
    resumed = _net(found.weights, adam=adam)
    restore_training_state(resumed, found)
    assert resumed.iteration == 2
    for k in range(2, 4):
        resumed.train_step(*_batch(resumed, k))
    want = _params(straight)
    for key, a in _params(resumed).items():
        np.testing.assert_array_equal(a, want[key], err_msg=str(key))
    # Without the state (weights only, as Darknet resumes) the momentum is lost: different.
    plain = _net(found.weights, adam=adam)
    for k in range(2, 4):
        plain.train_step(*_batch(plain, k))
    assert any(not np.array_equal(a, want[key]) for key, a in _params(plain).items())


def test_a_state_for_another_network_is_refused(tmp_path):
    net = _net()
    net.train_step(*_batch(net, 0))
    path = tmp_path / "a.weights"
    save_checkpoint(net, path, {})
    other = dm.load(TRAIN / "micro-classifier" / "micro-classifier.cfg")
    with pytest.raises(CheckpointError, match="does not fit this network"):
        restore_training_state(other, find_checkpoint(path))
    state_path(path).write_bytes(b"not a state")
    assert find_checkpoint(path) is None


_CHILD = textwrap.dedent("""
    import os, signal, sys
    import numpy as np
    import darknet_metal as dm
    from darknet_metal.training import checkpoint
    cfg, init, path, kill_at, loop = sys.argv[1:6]
    net = dm.load(cfg, init, seed=1)
    net.config.net.values.update(burn_in=0)
    b = net.config.net.values["batch"]
    x = np.random.default_rng(0).random((b, *net.input_shape), dtype=np.float32)
    truths = [np.array([[1, 0.3, 0.4, 0.2, 0.3]], np.float32)] * b
    net.train_step(x, truths)
    checkpoint.save_checkpoint(net, path, {})
    kill_at = int(kill_at)
    if kill_at:
        real, calls = os.replace, [0]
        def replace(src, dst):
            calls[0] += 1
            if calls[0] == kill_at:
                os.kill(os.getpid(), signal.SIGKILL)
            real(src, dst)
        os.replace = replace
    net.train_step(x, truths)
    checkpoint.save_checkpoint(net, path, {})
    print("saved", flush=True)
    while int(loop):
        net.iteration += 1
        checkpoint.save_checkpoint(net, path, {})
""")


def _child(tmp_path, kill_at, loop=0):
    script = tmp_path / "child.py"
    script.write_text(_CHILD)
    path = tmp_path / "x_last.weights"
    # The child imports the package these tests import.
    env = {**os.environ, "PYTHONPATH": os.path.dirname(os.path.dirname(dm.__file__))}
    return path, subprocess.Popen(
        [sys.executable, str(script), str(CFG), str(INIT), str(path), str(kill_at),
         str(loop)], stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env)


def _loads(path):
    found = find_checkpoint(path)
    assert found is not None
    net = dm.load(CFG, found.weights)
    restore_training_state(net, found)
    assert net.iteration == found.iteration
    return found


# The renames of the second save: the old pair to .prev (weights, then state), the new
# weights, the new state; 0: no kill.
@pytest.mark.parametrize(("kill_at", "iteration"), [(1, 1), (2, 1), (3, 1), (4, 1), (0, 2)])
def test_a_kill_during_a_save_leaves_a_whole_pair(tmp_path, kill_at, iteration):
    path, child = _child(tmp_path, kill_at)
    out, err = child.communicate(timeout=120)
    assert child.returncode == (-signal.SIGKILL if kill_at else 0), err
    found = _loads(path)
    assert found.iteration == iteration
    # A later save cleans what the killed one left.
    net = dm.load(CFG, found.weights)
    restore_training_state(net, found)
    save_checkpoint(net, path, {})
    assert not list(tmp_path.glob(".*.tmp"))
    assert _loads(path).iteration == found.iteration


def test_kills_at_random_moments_leave_a_whole_pair(tmp_path):
    rng = np.random.default_rng(0)
    for _ in range(10):
        path, child = _child(tmp_path, 0, loop=1)
        assert child.stdout.readline().strip() == "saved"
        time.sleep(float(rng.uniform(0.0, 0.3)))
        os.kill(child.pid, signal.SIGKILL)
        child.communicate(timeout=60)
        assert _loads(path).iteration >= 2
