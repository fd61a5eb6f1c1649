"""``darknet-metal train`` end to end on a generated shapes set: the loss falls, seeded runs
repeat bit for bit whatever the number of loader threads, Ctrl-C and a resume end where an
unbroken run does, bad datasets and mismatched networks are refused."""

from __future__ import annotations

import json
import re

import pytest
from training_golden import TRAIN

import darknet_metal as dm
from darknet_metal.cli import main
from darknet_metal.datasets import make_shapes
from darknet_metal.training.checkpoint import find_checkpoint

MICRO = TRAIN / "micro-v4-sgd" / "micro-v4-sgd.cfg"


@pytest.fixture(scope="module")
def shapes(tmp_path_factory):
    return make_shapes(tmp_path_factory.mktemp("train") / "shapes", train=48, valid=12,
                       size=(128, 128), seed=4)


def _cfg(folder, iterations, **keys):
    """micro-v4-sgd (3 classes, 128x128, batch 4 in 2 mini-batches) for ``iterations``."""
    text = MICRO.read_text().replace("max_batches=100", f"max_batches={iterations}")
    for key, value in keys.items():
        text, n = re.subn(rf"(?m)^{key}=.*$", f"{key}={value}", text)
        assert n, key
    path = folder / "micro.cfg"
    path.write_text(text)
    return path


def _records(folder):
    return [json.loads(line) for line in (folder / "micro.jsonl").read_text().splitlines()]


def test_the_loss_falls_and_darknets_files_are_written(tmp_path, shapes, device):
    cfg = _cfg(tmp_path, 30)
    backup = tmp_path / "backup"
    assert main(["train", str(shapes), str(cfg), "--backup", str(backup), "--device", device,
                 "--seed", "1", "-q", "--map-every", "15"]) == 0
    records = _records(backup)
    assert [r["iteration"] for r in records] == list(range(1, 31))
    assert records[-1]["avg_loss"] <= 0.75 * records[0]["loss"], (records[0], records[-1])
    assert records[-1]["last_map"] is not None
    names = {p.name for p in backup.iterdir()}
    assert {"micro_final.weights", "micro_last.weights", "micro_last.state",
            "micro_best.weights", "micro.log", "chart_micro.png"} <= names
    final = dm.load(cfg, backup / "micro_final.weights")
    assert final.iteration == 30


@pytest.mark.parametrize(("burn_in", "warned"), [(1000, True), (0, False)])
def test_a_learning_rate_too_low_for_most_of_the_run_is_said_first(tmp_path, shapes, capsys,
                                                                   burn_in, warned):
    # Darknet's bundled burn_in=1000 on a 3-iteration run holds the rate at 1e-12 of the
    # cfg's: said before the first iteration, even with -q.
    cfg = _cfg(tmp_path, 3, burn_in=burn_in)
    assert main(["train", str(shapes), str(cfg), "--backup", str(tmp_path / "b"), "-q",
                 "--no-chart"]) == 0
    err = capsys.readouterr().err
    said = ("warning: the learning rate stays below 0.1 x learning_rate=0.001 for 3 of the 3 "
            "iterations 1..3 (burn_in=1000 warms it up as (iteration/1000)^4): the run will "
            "learn little; lower burn_in")
    assert (said in err) == warned, err


def test_seeded_runs_are_identical_whatever_the_loader_threads(tmp_path, shapes):
    cfg = _cfg(tmp_path, 6, jitter=0.2, mosaic=1, hue=0.1, saturation=1.5, exposure=1.5)
    finals = []
    for workers in (0, 3):
        backup = tmp_path / f"w{workers}"
        assert main(["train", str(shapes), str(cfg), "--backup", str(backup), "--seed", "7",
                     "--workers", str(workers), "-q", "--no-chart"]) == 0
        finals.append((backup / "micro_final.weights").read_bytes())
    assert finals[0] == finals[1]


def test_ctrl_c_then_resuming_from_last_ends_where_an_unbroken_run_does(
        tmp_path, shapes, monkeypatch, capsys):
    from darknet_metal.training import session

    cfg = _cfg(tmp_path, 10, jitter=0.2, flip=1)
    whole = tmp_path / "whole"
    assert main(["train", str(shapes), str(cfg), "--backup", str(whole), "--seed", "3",
                 "-q", "--no-chart"]) == 0
    broken = tmp_path / "broken"
    real = session.TrainingRun._iteration

    def interrupted(self, start, started):
        if self.net.iteration == 6:
            raise KeyboardInterrupt
        return real(self, start, started)

    monkeypatch.setattr(session.TrainingRun, "_iteration", interrupted)
    assert main(["train", str(shapes), str(cfg), "--backup", str(broken), "--seed", "3",
                 "-q", "--no-chart"]) == 130
    assert "interrupted at iteration 6" in capsys.readouterr().err
    monkeypatch.setattr(session.TrainingRun, "_iteration", real)
    assert main(["train", str(shapes), str(cfg), str(broken / "micro_last.weights"),
                 "--backup", str(broken), "--seed", "3", "--no-chart"]) == 0
    err = capsys.readouterr().err
    # Continuing the checkpoint is not replacing an earlier run's.
    assert "continues exactly" in err and "from an earlier run" not in err
    assert (broken / "micro_final.weights").read_bytes() == \
        (whole / "micro_final.weights").read_bytes()
    assert [r["iteration"] for r in _records(broken)] == list(range(1, 11))


def _checkpoint_bytes(backup):
    """The checkpoint files in ``backup`` (``.prev`` and temporaries included): name -> size."""
    return {p.name: p.stat().st_size for p in backup.iterdir()
            if p.name.startswith(("micro_last", ".micro_last"))}


def test_rerunning_into_the_same_folder_keeps_one_checkpoint_and_says_so(
        tmp_path, shapes, capsys):
    backup = tmp_path / "backup"

    def train(iterations):
        cfg = _cfg(tmp_path, iterations)
        assert main(["train", str(shapes), str(cfg), "--backup", str(backup), "-q",
                     "--no-chart"]) == 0
        return capsys.readouterr().err

    assert "from an earlier run" not in train(6)
    first = _checkpoint_bytes(backup)
    assert sorted(first) == ["micro_last.state", "micro_last.weights"]
    # Reruns from scratch, shorter: their checkpoints have lower iterations than the first.
    for earlier in (6, 3):
        size = sum(_checkpoint_bytes(backup).values())
        said = [line for line in train(3).splitlines() if "from an earlier run" in line]
        assert said == [
            f"darknet-metal: {backup}/: micro_last.weights, micro_last.state from an earlier "
            f"run (a checkpoint at iteration {earlier}, {size / 1e3:.1f} kB) are replaced by "
            "this run's first checkpoint: the earlier one stays until that is written (as "
            "micro_last.prev.* during the save), then it is removed"]
        # One checkpoint, the new one (not the earlier run's, of a higher iteration).
        after = _checkpoint_bytes(backup)
        assert sorted(after) == ["micro_last.state", "micro_last.weights"]
        assert sum(after.values()) <= sum(first.values())
        found = find_checkpoint(backup / "micro_last.weights")
        assert found.weights == backup / "micro_last.weights" and found.iteration == 3
    assert sorted(p.name for p in backup.iterdir()) == [
        "micro.jsonl", "micro.log", "micro_final.weights", "micro_last.state",
        "micro_last.weights"]


@pytest.mark.parametrize("steps", [2, 3])
def test_a_checkpoint_a_kill_left_midway_resumes(tmp_path, shapes, capsys, steps):
    backup = tmp_path / "backup"
    assert main(["train", str(shapes), str(_cfg(tmp_path, 4)), "--backup", str(backup),
                 "-q", "--no-chart"]) == 0
    capsys.readouterr()
    # What a kill during the next save leaves after its second step: the pair moved to the
    # .prev names and the new files' temporaries (half written); after its third, the new
    # weights are under NAME, without their state.
    last = backup / "micro_last.weights"
    last.rename(backup / "micro_last.prev.weights")
    (backup / "micro_last.state").rename(backup / "micro_last.prev.state")
    data = (backup / "micro_last.prev.weights").read_bytes()
    new_weights = data[:-4] + b"\x01\x02\x03\x04"
    if steps == 3:
        last.write_bytes(new_weights)
    else:
        (backup / ".micro_last.weights.0123456789ab.tmp").write_bytes(new_weights[:1000])
    (backup / ".micro_last.state.0123456789ab.tmp").write_bytes(b"PK\x03\x04")
    assert main(["train", str(shapes), str(_cfg(tmp_path, 6)), str(last),
                 "--backup", str(backup), "--no-chart"]) == 0
    err = capsys.readouterr().err
    assert (f"training state of {backup / 'micro_last.prev.state'} (iteration 4): the run "
            "continues exactly") in err
    assert "from an earlier run" not in err
    assert [r["iteration"] for r in _records(backup)] == list(range(1, 7))
    assert sorted(_checkpoint_bytes(backup)) == ["micro_last.state", "micro_last.weights"]
    assert find_checkpoint(last).iteration == 6


def test_random_sizes_through_the_loader(tmp_path, shapes):
    cfg = _cfg(tmp_path, 12, random=1)
    backup = tmp_path / "b"
    assert main(["train", str(shapes), str(cfg), "--backup", str(backup), "-q",
                 "--no-chart"]) == 0
    sizes = [(r["iteration"], r["width"]) for r in _records(backup)]
    # Darknet's rule: a new size every 10 iterations, and the largest at the start and in
    # the last 100 iterations (all 12 here): round(1.4 * 128 / 32 + 1) * 32 = 224.
    assert {w for _, w in sizes} == {224}, sizes
    assert dm.load(cfg, backup / "micro_final.weights").iteration == 12


def test_a_dataset_with_errors_or_another_class_count_is_refused(tmp_path, shapes, capsys):
    cfg = _cfg(tmp_path, 5)
    broken = tmp_path / "broken"
    make_shapes(broken, train=6, valid=2, size=(64, 64), seed=1)
    label = sorted((broken / "images").glob("train_*.txt"))[2]
    label.write_text("7 0.5 0.5 0.2 0.2\n")
    assert main(["train", str(broken / "shapes.data"), str(cfg), "-q",
                 "--backup", str(tmp_path / "x")]) == 1
    err = capsys.readouterr().err
    assert f"{label}:1" in err and "check-data" in err
    two = tmp_path / "two.cfg"
    two.write_text(cfg.read_text().replace("classes=3", "classes=2").replace("filters=24",
                                                                             "filters=21"))
    assert main(["train", str(shapes), str(two), "-q", "--backup", str(tmp_path / "y")]) == 1
    assert "detect 2 classes" in capsys.readouterr().err
    assert not (tmp_path / "x").exists() and not (tmp_path / "y").exists()


def test_random_sizes_grow_memory_only_at_a_size_not_seen_before(tmp_path, shapes, device):
    # random=1 through the loader and the run (a new size every 10 iterations; max_batches
    # 1000 keeps the last-100-iterations rule away, and the run is stopped as by Ctrl-C): the
    # process's resident memory, and on a Metal device its allocated bytes and pool misses, may
    # grow when a size appears for the first time, never at a size seen before. In a child
    # process with glibc's mmap threshold fixed (see test_train_api's RSS test: otherwise
    # freed blocks make RSS wander). Fewer iterations on a Metal device (the emulator's are
    # slow).
    import os
    import subprocess
    import sys

    iterations = 120 if device == "cpu" else 60
    cfg = _cfg(tmp_path, 1000, random=1)
    script = tmp_path / "rss.py"
    script.write_text(f"""
import psutil
from darknet_metal import metal
from darknet_metal.training import session
from darknet_metal.training.run import TrainingSetup
real = session.TrainingRun._iteration
def watched(self, start, started):
    record = real(self, start, started)
    device = (0, 0) if {device!r} == "cpu" else (
        metal.stats({device!r})["allocated_bytes"], metal.stats({device!r})["pool_misses"])
    print(record.iteration, record.width, psutil.Process().memory_info().rss, *device,
          flush=True)
    if record.iteration == {iterations}:
        raise KeyboardInterrupt
    return record
session.TrainingRun._iteration = watched
setup = TrainingSetup.create({str(shapes)!r}, {str(cfg)!r}, seed=5, device={device!r},
                             backup={str(tmp_path / "b")!r}, chart=False)
try:
    setup.run(progress=False)
except KeyboardInterrupt:
    pass
""")
    env = {**os.environ, "MALLOC_MMAP_THRESHOLD_": "131072",
           "PYTHONPATH": os.path.dirname(os.path.dirname(dm.__file__))}
    out = subprocess.run([sys.executable, str(script)], capture_output=True, text=True,
                         env=env, timeout=600, check=True).stdout.split("\n")
    rows = [tuple(int(v) for v in line.split()) for line in out if line.strip()]
    assert [r[0] for r in rows] == list(range(1, iterations + 1))
    # Host slack: the loader keeps up to two batches in flight, whose arrays (4 images at up
    # to 224x224) come and go between the moments RSS is read.
    slack = max(2**20, 2 * 4 * 3 * 224 * 224 * 4)
    seen, peak, device_peak = set(), 0, (0, 0)
    returns = 0  # iterations at a size seen before another size came between
    for iteration, width, rss, allocated, misses in rows:
        if width in seen and iteration > 2:
            returns += width != rows[iteration - 2][1] or returns > 0
            assert rss <= peak + slack, (iteration, width, rss / 2**20, peak / 2**20)
            assert (allocated, misses) <= device_peak, (iteration, width, allocated, misses,
                                                        device_peak)
        seen.add(width)
        peak = max(peak, rss)
        device_peak = max(device_peak[0], allocated), max(device_peak[1], misses)
    assert len(seen) >= 3, seen  # sizes did change
    assert returns >= 10, [r[1] for r in rows]  # and came back


def test_the_runs_time_is_projected_before_the_first_iteration(tmp_path, shapes, capsys):
    cfg = _cfg(tmp_path, 3)
    assert main(["train", str(shapes), str(cfg), "--backup", str(tmp_path / "b"),
                 "--no-chart"]) == 0
    err = capsys.readouterr().err
    (line,) = [x for x in err.splitlines() if "projected:" in x]
    assert re.search(r"projected: about \d+ (ms|s) an iteration, .* for the 3 iterations left "
                     r"on cpu \(a step of 2 image\(s\) at 128x128 timed, times 4/2", line), line


def test_darknets_recipe_on_a_cpu_is_projected_in_days_with_the_way_out(tmp_path, shapes):
    # The one-command demo's defaults Darknet's README gives (yolov4-tiny at 416, batch 64,
    # 6000 iterations) on this CPU: the projection says hours or days, and what shortens it.
    from darknet_metal.model.derive import derive_cfg
    from darknet_metal.training.run import TrainingSetup

    derived = derive_cfg("yolov4-tiny", 3, max_batches=6000)
    cfg = tmp_path / "recipe.cfg"
    cfg.write_text(derived.text)
    setup = TrainingSetup.create(shapes, cfg, backup=tmp_path / "b", chart=False, workers=0)
    said = setup.projection()
    setup.loader.close()
    assert re.search(r"for the 6000 iterations left on cpu .*times 64/2", said), said
    assert re.search(r"\d+(\.\d)? (hours|days) for", said), said
    assert "--device metal" in said


def test_the_loader_falls_back_to_threads_where_processes_cannot_start(tmp_path, shapes,
                                                                      monkeypatch):
    # A GPU run's loader is processes; from a script without a main guard they would run
    # the script again, so the run uses threads and says why.
    from darknet_metal.training import run as run_module

    monkeypatch.setattr(run_module, "loader_processes", lambda device: True)
    cfg = _cfg(tmp_path, 3)
    for blocker, processes in (("x.py runs its training outside the guard", False),
                               (None, True)):
        monkeypatch.setattr("darknet_metal.training.loading.processes.spawn_blocker",
                            lambda b=blocker: b)
        setup = run_module.TrainingSetup.create(shapes, cfg, backup=tmp_path / "b",
                                                chart=False, workers=2)
        try:
            assert setup.loader.processes is processes
            notes = [w for w in setup.warnings() if "the loader uses threads" in w]
            assert len(notes) == (0 if processes else 1)
            if not processes:
                assert "x.py runs its training outside the guard" in notes[0]
            setup.loader.next()
        finally:
            setup.loader.close()
