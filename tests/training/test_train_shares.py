"""What training across processes is built on, in one process: a loader that loads only
some rows of each batch (the same images as the whole batch's rows), accumulating and
stepping on a share of the batch with the sum supplied by ``reduce``, the statistics
buffers, and refusing to run as one of several MPI processes without mpi4py."""

from __future__ import annotations

import sys

import numpy as np
import pytest
from loading_scenes import scene, write_png
from training_golden import TRAIN

import darknet_metal as dm
from darknet_metal.errors import ArgumentError, DependencyError
from darknet_metal.training import distributed
from darknet_metal.training.loading import Loader, LoaderSettings

MICRO = TRAIN / "micro-v4-sgd" / "micro-v4-sgd.cfg"  # batch 4 in 2 mini-batches


def _samples(tmp_path, count=5):
    out = []
    for i in range(count):
        rgb, boxes = scene(160, 120, [(10 + 8 * i, 12, 60 + 8 * i, 70)], first_id=i % 3)
        out.append((write_png(tmp_path / f"img{i}.png", rgb), boxes))
    return out


@pytest.mark.parametrize("sampling", ["random", "epoch"])
def test_a_loader_of_some_slots_gives_those_rows_of_the_whole_batch(tmp_path, sampling):
    samples = _samples(tmp_path)
    settings = LoaderSettings(width=64, height=64, batch=6, jitter=0.3, hue=0.1, mixup=3,
                              max_boxes=6)
    with Loader(samples, settings, seed=3, workers=2, sampling=sampling) as whole, \
            Loader(samples, settings, seed=3, workers=0, sampling=sampling,
                   slots=range(2, 4)) as part:
        for _ in range(3):
            a, b = whole.next(), part.next()
            assert b.x.shape == (2, 3, 64, 64)
            assert b.x.tobytes() == a.x[2:4].tobytes()
            assert [t.tobytes() for t in b.truths] == [t.tobytes() for t in a.truths[2:4]]
            assert b.images == a.images[2:4]


@pytest.mark.parametrize("slots", [range(0), range(5, 7), range(0, 4, 2), [0, 1]])
def test_bad_slots_are_refused(tmp_path, slots):
    with pytest.raises(ArgumentError, match="slots must be a non-empty range"):
        Loader(_samples(tmp_path, 1), LoaderSettings(width=32, height=32, batch=6),
               slots=slots)


def _batch(seed=0):
    rng = np.random.default_rng(seed)
    x = rng.random((4, 3, 128, 128), dtype=np.float32)
    truths = [np.array([[i % 3, 0.3 + 0.1 * i, 0.5, 0.2, 0.3]], np.float32) for i in range(4)]
    return x, truths


def test_a_step_on_shares_with_the_sum_equals_the_whole_step():
    """Two networks each take half of the batch; ``reduce`` adds the other's accumulators
    (as an all-reduce would), and both end where one network stepping on the whole batch
    ends, up to the order of the sums."""
    x, truths = _batch()
    whole = dm.load(MICRO, seed=1)
    halves = [dm.load(MICRO, seed=1) for _ in range(2)]
    for step in range(3):
        whole.train_step(x, truths)
        # The second half's gradients, with the momentum term carried in the first only.
        second = halves[1]
        for layer in second.gradient_buffers().values():
            for array in layer.values():
                array.fill(0)
        loss_b = second.accumulate(x[2:], truths[2:])
        added = {(i, k): v.copy() for i, layer in second.gradient_buffers().items()
                 for k, v in layer.items()}

        def reduce(loss, added=added, loss_b=loss_b):
            for (i, k), v in added.items():
                halves[0].gradient_buffers()[i][k] += v
            return 4, (loss + loss_b) / 2

        report = halves[0].train_step(x[:2], truths[:2], reduce=reduce)
        assert report.iteration == step + 1
        assert halves[0].header.seen == whole.header.seen == 4 * (step + 1)
        trained = [(i, name) for i, layer in whole.params.items() for name in layer
                   if name not in whole.layers[i].statistics]
        want = np.concatenate([whole.params[i][n].ravel() for i, n in trained])
        got = np.concatenate([halves[0].params[i][n].ravel() for i, n in trained])
        assert np.abs(got - want).max() <= 1e-6 * np.abs(want).max()
        # The second network follows the first, as a rank applying the same update would.
        for i, layer in halves[0].params.items():
            for name, value in layer.items():
                np.copyto(second.params[i][name], value)
        second.header.seen = halves[0].header.seen


def test_accumulate_takes_whole_mini_batches_of_the_batch():
    net = dm.load(MICRO, seed=1)
    x, truths = _batch()
    net.accumulate(x[:2], truths[:2])
    assert net.header.seen == 2
    with pytest.raises(ArgumentError, match="whole mini-batches of 2"):
        net.accumulate(x[:3], truths[:3])
    with pytest.raises(ArgumentError, match=r"shape \(4, 3, 128, 128\)"):
        net.train_step(x[:2], truths[:2])  # without reduce, the whole batch


def test_statistic_buffers_are_the_trained_running_statistics():
    net = dm.load(MICRO, seed=1)
    buffers = net.statistic_buffers()
    assert buffers and all(set(layer) == {"rolling_mean", "rolling_variance"}
                           for layer in buffers.values())
    before = {i: layer["rolling_mean"].copy() for i, layer in buffers.items()}
    net.train_step(*_batch())
    assert any(not np.array_equal(before[i], layer["rolling_mean"])
               for i, layer in net.statistic_buffers().items())


def test_launched_by_mpirun_without_mpi4py_is_refused(monkeypatch):
    monkeypatch.setenv("OMPI_COMM_WORLD_SIZE", "2")
    monkeypatch.setitem(sys.modules, "mpi4py", None)
    assert distributed.launched_size() == 2
    with pytest.raises(DependencyError, match="one of 2 processes.*darknet-metal\\[mpi\\]"):
        distributed.Collective.from_environment()


def test_one_process_is_the_ordinary_trainer(monkeypatch):
    for name in ("OMPI_COMM_WORLD_SIZE", "PMI_SIZE", "PMIX_SIZE", "MPI_LOCALNRANKS"):
        monkeypatch.delenv(name, raising=False)
    monkeypatch.setitem(sys.modules, "mpi4py", None)
    assert distributed.launched_size() == 1
    assert distributed.Collective.from_environment() is None


def test_a_process_no_launcher_started_does_not_start_mpi():
    """Initialising MPI outside a launcher makes the process a singleton job: Open MPI
    starts a daemon and leaves variables that break an mpirun started from it later."""
    import os
    import subprocess

    env = {k: v for k, v in os.environ.items()
           if not k.startswith(("OMPI_", "PMI", "PMIX_", "MPI_"))}
    code = ("import sys; from darknet_metal.training.distributed import Collective; "
            "assert Collective.from_environment() is None; "
            "assert 'mpi4py.MPI' not in sys.modules, 'MPI was initialised'")
    done = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True,
                          text=True, timeout=120)
    assert done.returncode == 0, done.stderr
