"""A training run: Darknet's schedule of evaluations and weights files, logs, Ctrl-C and an
exact resume."""

from __future__ import annotations

import json

import numpy as np
import pytest
from training_golden import TRAIN

import darknet_metal as dm
from darknet_metal.training.checkpoint import find_checkpoint
from darknet_metal.training.run import default_workers, loader_processes
from darknet_metal.training.session import Schedule, TrainingRun

CASE = TRAIN / "micro-v4-sgd"


class FixedBatches:
    """A few fixed batches in turn (what a loader gives, without images): enough for a
    network to learn them."""

    def __init__(self, net, count=2, interrupt_at=None):
        b = net.config.net.values["batch"]
        rng = np.random.default_rng(0)
        self.batches = []
        for k in range(count):
            x = rng.random((b, *net.input_shape), dtype=np.float32)
            truths = [np.array([[k % 2, 0.25 + 0.5 * (i % 2), 0.5, 0.3, 0.4]], np.float32)
                      for i in range(b)]
            self.batches.append((x, truths))
        self.wait_seconds = 0.0
        self.interrupt_at = interrupt_at
        self.seen = []

    def batch(self, iteration, width, height):
        if iteration == self.interrupt_at:
            raise KeyboardInterrupt
        self.seen.append((iteration, width, height))
        return self.batches[iteration % len(self.batches)]


def _net(device="cpu", **values):
    net = dm.load(CASE / "micro-v4-sgd.cfg", CASE / "init.weights", device=device, seed=2)
    net.config.net.values.update(burn_in=0, learning_rate=2e-3, policy="constant", **values)
    return net


def test_darknets_schedule():
    s = Schedule.darknet(max_batches=6000, burn_in=1000, train_images=12800, batch=64)
    assert (s.map_every, s.save_every) == (200, 1000)
    assert s.next_map(0) == 1000 and s.next_map(1000) == 1200
    s = Schedule.darknet(max_batches=20000, burn_in=0, train_images=100, batch=64)
    assert (s.map_every, s.save_every) == (100, 10000)


def test_a_run_learns_and_writes_darknets_files(tmp_path, device):
    net = _net(device)
    source = FixedBatches(net)
    maps = iter([0.2, 0.5, 0.4])
    run = TrainingRun(net, source, Schedule(30, 0, 10, 10), backup=tmp_path, base="micro",
                      evaluate=lambda n: next(maps), progress=False)
    result = run.run()
    assert result.iteration == 30 and not result.interrupted
    lines = (tmp_path / "micro.jsonl").read_text().splitlines()
    records = [json.loads(line) for line in lines]
    assert [r["iteration"] for r in records] == list(range(1, 31))
    first, last = records[0]["avg_loss"], records[-1]["avg_loss"]
    assert last <= 0.75 * first, (first, last)  # the loss falls by at least 25%
    log = (tmp_path / "micro.log").read_text().splitlines()
    assert len(log) == 30 and log[11].startswith("12: loss=") and "last=20.00%" in log[11]
    # Images per second over each iteration's wall time: at most the batch over the step.
    for r in records:
        assert 0 < r["images_per_second"] <= r["batch"] / r["train_seconds"]
    assert all(line.endswith(" img/s") for line in log)
    names = sorted(p.name for p in tmp_path.iterdir())
    assert names == ["chart_micro.png", "micro.jsonl", "micro.log", "micro_10.weights",
                     "micro_20.weights", "micro_30.weights", "micro_best.weights",
                     "micro_final.weights", "micro_last.state", "micro_last.weights"]
    # mAP at 10, 20, 30: the best (0.5) was at 20.
    assert (result.last_map, result.best_map) == (0.4, 0.5)
    best = dm.load(CASE / "micro-v4-sgd.cfg", tmp_path / "micro_best.weights")
    assert best.iteration == 20
    assert find_checkpoint(tmp_path / "micro_last.weights").iteration == 30


def test_ctrl_c_saves_last_and_a_resumed_run_ends_where_an_unbroken_one_does(tmp_path):
    straight = _net()
    TrainingRun(straight, FixedBatches(straight), Schedule(12, 0, 100, 100),
                backup=tmp_path / "a", base="m", progress=False, chart=False).run()
    broken = _net()
    result = TrainingRun(broken, FixedBatches(broken, interrupt_at=8), Schedule(12, 0, 100, 100),
                         backup=tmp_path / "b", base="m", progress=False, chart=False).run()
    assert result.interrupted and result.iteration == 7 and result.final_weights is None
    resumed = _net()
    run = TrainingRun(resumed, FixedBatches(resumed), Schedule(12, 0, 100, 100),
                      backup=tmp_path / "b", base="m", progress=False, chart=False)
    assert run.resume() and resumed.iteration == 7
    run.run()
    a = dm.load(CASE / "micro-v4-sgd.cfg", tmp_path / "a" / "m_final.weights")
    b = dm.load(CASE / "micro-v4-sgd.cfg", tmp_path / "b" / "m_final.weights")
    assert a.iteration == b.iteration == 12
    for i, params in a.params.items():
        for name, v in params.items():
            np.testing.assert_array_equal(b.params[i][name], v, err_msg=f"{i} {name}")
    # The log continues: 7 lines, then 5 more.
    assert len((tmp_path / "b" / "m.jsonl").read_text().splitlines()) == 12


def test_random_sizes_resize_the_network(tmp_path):
    net = _net()
    source = FixedBatches(net)
    sizes = {1: (96, 96), 3: (64, 64)}
    TrainingRun(net, _Resized(source), Schedule(4, 0, 100, 100), backup=tmp_path,
                base="m", sizes=lambda i, started: sizes.get(i), progress=False,
                chart=False).run()
    assert [s[1:] for s in source.seen] == [(96, 96), (96, 96), (64, 64), (64, 64)]


class _Resized:
    """Fixed batches resampled to the size asked for (nearest pixels)."""

    def __init__(self, source):
        self.source = source
        self.wait_seconds = 0.0

    def batch(self, iteration, width, height):
        x, truths = self.source.batch(iteration, width, height)
        rows = np.arange(height) * x.shape[2] // height
        cols = np.arange(width) * x.shape[3] // width
        return np.ascontiguousarray(x[:, :, rows][:, :, :, cols]), truths


def test_a_finished_run_says_how_to_continue(tmp_path):
    net = _net()
    net.iteration = 5
    with pytest.raises(dm.ArgumentError, match="--clear"):
        TrainingRun(net, FixedBatches(net), Schedule(5, 0, 100, 100), backup=tmp_path,
                    base="m", progress=False, chart=False).run()


def test_the_loader_has_a_worker_per_cpu_by_default_shared_among_local_ranks(monkeypatch):
    import os

    monkeypatch.setattr(os, "sched_getaffinity", lambda pid: set(range(12)), raising=False)

    class Ranks:
        local_size = 3

    assert default_workers() == 8  # at most 8: more threads deliver less
    assert default_workers(Ranks()) == 4
    monkeypatch.setattr(os, "sched_getaffinity", lambda pid: set(range(32)), raising=False)
    Ranks.local_size = 2
    assert default_workers(Ranks()) == 8
    assert default_workers(Ranks(), processes=True) == 15  # the trainer keeps one CPU
    monkeypatch.setattr(os, "sched_getaffinity", lambda pid: set(range(12)), raising=False)
    assert default_workers(processes=True) == 11  # processes: no cap, they do not share a GIL
    monkeypatch.setattr(os, "sched_getaffinity", lambda pid: {0}, raising=False)
    assert default_workers() == 2  # at least 2: one loads while the other augments
    assert default_workers(processes=True) == 2
    assert loader_processes("cuda") and loader_processes("metal")
    assert not loader_processes("cpu") and not loader_processes("emu")



def test_a_run_removes_what_a_killed_write_left(tmp_path):
    """A process killed while writing a checkpoint leaves the hidden temporary of its
    atomic write (never a half-written file under a checkpoint's name); the next run into
    the folder removes it, and nothing of another run."""
    left = tmp_path / ".m_last.weights.0123456789ab.tmp"
    left.write_bytes(b"part of a checkpoint")
    other = tmp_path / ".other_last.weights.0123456789ab.tmp"
    other.write_bytes(b"another run's")
    net = _net()
    TrainingRun(net, FixedBatches(net), Schedule(1, 0, 100, 100), backup=tmp_path, base="m",
                progress=False, chart=False).run()
    assert not left.exists() and other.exists()
