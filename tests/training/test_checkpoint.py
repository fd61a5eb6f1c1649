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
    describe_earlier_checkpoint,
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
        # Counted: the renames, and the removals of files other than temporary ones.
        real_replace, real_unlink, calls = os.replace, os.unlink, [0]
        def step(path):
            calls[0] += 1
            if calls[0] == kill_at:
                os.kill(os.getpid(), signal.SIGKILL)
        def replace(src, dst):
            step(src)
            real_replace(src, dst)
        def unlink(path, *args, **kwargs):
            if not str(path).endswith(".tmp"):
                step(path)
            real_unlink(path, *args, **kwargs)
        os.replace, os.unlink = replace, unlink
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


# The steps of the second save: the old pair to .prev (weights, then state), the new
# weights, the new state, then the removal of the .prev state and weights; 0: no kill.
@pytest.mark.parametrize(("kill_at", "iteration"),
                         [(1, 1), (2, 1), (3, 1), (4, 1), (5, 2), (6, 2), (0, 2)])
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
    assert sorted(p.name for p in tmp_path.glob("x_last*")) == ["x_last.state",
                                                                "x_last.weights"]
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


def _names(folder):
    return sorted(p.name for p in folder.iterdir())


def test_a_save_keeps_one_pair_and_no_previous_one(tmp_path):
    net = _net()
    net.train_step(*_batch(net, 0))
    path = tmp_path / "x_last.weights"
    for iteration in (5, 6, 7):
        net.iteration = iteration
        save_checkpoint(net, path, {})
        assert _names(tmp_path) == ["x_last.state", "x_last.weights"]
    assert _loads(path).iteration == 7


def _earlier_run(folder, net):
    """A folder as the code before kept it after two runs: the earlier run's checkpoint
    (iteration 50) under NAME, and the one before it (iteration 40) under NAME.prev."""
    for iteration, name in ((40, "x_last.prev"), (50, "x_last")):
        net.iteration = iteration
        save_checkpoint(net, folder / "tmp.weights", {})
        for suffix in (".weights", ".state"):
            (folder / f"tmp{suffix}").rename(folder / f"{name}{suffix}")
    assert _names(folder) == ["x_last.prev.state", "x_last.prev.weights", "x_last.state",
                              "x_last.weights"]


class _Killed(BaseException):
    """A kill, simulated in process: raised before a step of a save."""


def test_saves_killed_one_after_another_always_leave_the_pair_written_last(
        tmp_path, monkeypatch):
    """Three saves in a row, each killed before any of its steps (or not killed), from a
    folder an earlier run left with higher iterations: after each, the pair written last
    loads, and an unbroken save leaves that pair alone."""
    net = _net()
    net.train_step(*_batch(net, 0))
    folder = tmp_path / "backup"
    folder.mkdir()
    path = folder / "x_last.weights"
    state = state_path(path)
    _earlier_run(folder, net)
    # The folder's durability is not what is tested here: fsync would only slow it down.
    monkeypatch.setattr(os, "fsync", lambda fd: None)
    real_replace, real_unlink = os.replace, os.unlink
    plan = {"kill_at": 0, "steps": 0, "state_in": False}

    def step(path_, dst=None):
        plan["steps"] += 1
        if plan["steps"] == plan["kill_at"]:
            raise _Killed
        if dst is not None and os.fspath(dst) == os.fspath(state):
            plan["state_in"] = True  # the new state is in place: the new pair is whole

    def replace(src, dst):
        step(src, dst)
        real_replace(src, dst)

    def unlink(path_, *args, **kwargs):
        if not os.fspath(path_).endswith(".tmp"):  # the removals of temporaries: not counted
            step(path_)
        real_unlink(path_, *args, **kwargs)

    monkeypatch.setattr(os, "replace", replace)
    monkeypatch.setattr(os, "unlink", unlink)

    def snapshot():
        return {p.name: p.read_bytes() for p in folder.iterdir()}

    def restore(files):
        for p in folder.iterdir():
            real_unlink(p)
        for name, data in files.items():
            (folder / name).write_bytes(data)

    iterations = iter(range(1, 1000))
    checked = []

    def explore(depth, expected):
        before = snapshot()
        for kill_at in range(7):  # 0: the save is not killed
            restore(before)
            net.iteration = next(iterations)
            plan.update(kill_at=kill_at, steps=0, state_in=False)
            try:
                save_checkpoint(net, path, {})
            except _Killed:
                assert kill_at
            now = net.iteration if plan["state_in"] else expected
            found = find_checkpoint(path)
            assert found is not None and found.iteration == now, (checked, kill_at, found)
            if plan["steps"] < kill_at or not kill_at:  # the save ran to its end
                assert _names(folder) == ["x_last.state", "x_last.weights"]
            checked.append(kill_at)
            if depth > 1:
                explore(depth - 1, now)

    explore(3, 50)
    assert len(checked) == 7 + 7 ** 2 + 7 ** 3
    monkeypatch.undo()
    # A pair found after such kills loads, with its training state.
    assert _loads(path).iteration == find_checkpoint(path).iteration


def test_the_line_about_an_earlier_runs_checkpoint(tmp_path):
    path = tmp_path / "x_last.weights"
    assert describe_earlier_checkpoint(path) is None  # nothing there
    net = _net()
    net.train_step(*_batch(net, 0))
    net.iteration = 40
    save_checkpoint(net, path, {})
    # What a kill left: the pair under .prev, a temporary file of the next save.
    path.rename(tmp_path / "x_last.prev.weights")
    state_path(path).rename(tmp_path / "x_last.prev.state")
    (tmp_path / ".x_last.weights.0123456789ab.tmp").write_bytes(b"\0" * 1000)
    size = sum(p.stat().st_size for p in tmp_path.iterdir())
    assert describe_earlier_checkpoint(path) == (
        f"{tmp_path}/: x_last.prev.weights, x_last.prev.state, 1 temporary file of a killed "
        f"save from an earlier run (a checkpoint at iteration 40, {size / 1e3:.1f} kB) are "
        "replaced by this run's first checkpoint: the earlier one stays until that is "
        "written (as x_last.prev.* during the save), then it is removed")
    # A run that continues from the checkpoint (by either name) replaces no earlier run's.
    assert describe_earlier_checkpoint(path, starting_from=path) is None
    assert describe_earlier_checkpoint(path, tmp_path / "x_last.prev.weights") is None
    assert describe_earlier_checkpoint(path, tmp_path / "other.weights") is not None
    state_path(path).write_bytes(b"not a state")
    (tmp_path / "x_last.prev.state").unlink()
    assert "from an earlier run (no whole checkpoint, " in describe_earlier_checkpoint(path)
