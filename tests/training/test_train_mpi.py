"""Training one network across processes: ``mpirun -n 2 darknet-metal train`` (Open MPI,
mpi4py) against one process with the combined batch and doubled subdivisions; a checksum
mismatch, a killed rank and an exception on one rank each end every rank with a message
naming the rank, within a bounded time; a two-rank run resumed from ``_last``."""

from __future__ import annotations

import json
import os
import re
import shutil
import signal
import subprocess
import sys
import textwrap
import time

import numpy as np
import pytest
from devices import require
from shared_paths import YOLOV3_TINY

from darknet_metal.datasets import make_shapes
from darknet_metal.model.weights import read_weights

pytest.importorskip("mpi4py", reason="mpi4py is not installed (the mpi extra)")
MPIRUN = shutil.which("mpirun")
pytestmark = [pytest.mark.slow,
              pytest.mark.skipif(MPIRUN is None, reason="no mpirun (Open MPI) on this machine")]

# Every mpirun here must end within this many seconds: a hang fails the test.
BOUND = 300
SIZE = 96


def _launcher() -> list[str]:
    launcher = [MPIRUN, "--oversubscribe"]
    if os.geteuid() == 0:
        launcher.append("--allow-run-as-root")
    return launcher


def _mpirun(n: int, *command: str) -> list[str]:
    return [*_launcher(), "-n", str(n), *command]


def _cuda_gpu_count() -> int:
    """The NVIDIA GPUs ``nvidia-smi`` lists (the CUDA driver's count, as the ranks see it)."""
    listed = subprocess.run(["nvidia-smi", "-L"], capture_output=True, text=True, check=True)
    return sum(line.startswith("GPU ") for line in listed.stdout.splitlines())


def _train_command(*args: str) -> list[str]:
    return [sys.executable, "-m", "darknet_metal", "train", *args]


def _run(command: list[str], timeout: float = BOUND) -> subprocess.CompletedProcess:
    return subprocess.run(command, capture_output=True, text=True, timeout=timeout)


@pytest.fixture(scope="module")
def shapes(tmp_path_factory):
    return make_shapes(tmp_path_factory.mktemp("mpi") / "shapes", train=24, valid=4,
                       size=(SIZE, SIZE), seed=2)


def tiny_cfg(folder, *, batch: int, subdivisions: int, max_batches: int,
             name: str = "tiny") -> str:
    """yolov3-tiny for the shapes set's 3 classes at SIZE x SIZE, no augmentation, burn_in=0."""
    text = (YOLOV3_TINY / "yolov3-tiny.cfg").read_text()
    for key, value in {"batch": batch, "subdivisions": subdivisions, "width": SIZE,
                       "height": SIZE, "burn_in": 0, "max_batches": max_batches,
                       "saturation": 1, "exposure": 1, "hue": 0, "classes": 3,
                       "jitter": 0, "random": 0}.items():
        text = re.sub(rf"(?m)^{key}\s*=.*$", f"{key}={value}", text)
    text = text.replace("filters=255", "filters=24")
    path = folder / f"{name}.cfg"
    path.write_text(text)
    return str(path)


def _trainable(cfg: str, weights) -> dict[tuple[int, str], np.ndarray]:
    import darknet_metal as dm

    net = dm.load(cfg)
    header, params = read_weights(weights, net.layers)
    return {(spec.index, name): params[spec.index][name] for spec in net.layers
            for name in spec.trainable_params if name in params.get(spec.index, {})}, header


def _assert_same_training(cfg, got, want):
    """The same seen, and the trainable parameters within 1e-6 relative (the whole vector's
    relative L2 difference) and 3e-5 (every value's difference against the network's largest
    trainable magnitude). The two runs add the same products in other groupings (per rank,
    then across ranks): on the CPU arrays that start at zero, batch norm's biases, differ by
    up to a few 1e-6 of their own largest value after 3 iterations; on a Metal device, whose
    weight gradients are split-K sums over images, layer 2's weights of yolov3-tiny differ by
    up to 9.5e-6 of the largest weight (measured on emu; the whole vector 3.8e-7). A missing
    or doubled rank's share moves them by whole percents."""
    got_params, got_header = _trainable(cfg, got)
    want_params, want_header = _trainable(cfg, want)
    assert got_header.seen == want_header.seen
    assert got_params.keys() == want_params.keys()
    a = np.concatenate([got_params[k].ravel() for k in want_params])
    b = np.concatenate([want_params[k].ravel() for k in want_params])
    relative_l2 = float(np.linalg.norm(a - b) / np.linalg.norm(b))
    worst = float(np.abs(a - b).max() / np.abs(b).max())
    assert relative_l2 <= 1e-6 and worst <= 3e-5, (relative_l2, worst)
    return relative_l2, worst


def test_two_ranks_train_as_one_process_with_the_combined_batch(tmp_path, shapes, device):
    ranks_cfg = tiny_cfg(tmp_path, batch=2, subdivisions=1, max_batches=3)
    one_dir = tmp_path / "one"
    one_dir.mkdir()
    one_cfg = tiny_cfg(one_dir, batch=4, subdivisions=2, max_batches=3)
    common = ["--seed", "5", "--device", device, "-q", "--no-chart", "--workers", "1"]
    two = _run(_mpirun(2, *_train_command(str(shapes), ranks_cfg, "--backup",
                                          str(tmp_path / "two"), *common)))
    assert two.returncode == 0, two.stderr[-3000:]
    one = _run(_train_command(str(shapes), one_cfg, "--backup", str(tmp_path / "single"),
                              *common))
    assert one.returncode == 0, one.stderr[-3000:]
    relative_l2, worst = _assert_same_training(
        one_cfg, tmp_path / "two" / "tiny_final.weights",
        tmp_path / "single" / "tiny_final.weights")
    records = [json.loads(line) for line in
               (tmp_path / "two" / "tiny.jsonl").read_text().splitlines()]
    # One log, by rank 0; each iteration counted once, with the 4 images of both ranks.
    assert [r["iteration"] for r in records] == [1, 2, 3]
    assert [r["images"] for r in records] == [4, 8, 12]
    # Each iteration says what its gradient sum moved and took: at least every trainable
    # value (a GPU's one block holds them with gaps for alignment, the CPU's exactly them).
    trainable_bytes = 4 * sum(a.size for a in _trainable(one_cfg, tmp_path / "single" /
                                                          "tiny_final.weights")[0].values())
    for r in records:
        assert trainable_bytes <= r["allreduce_bytes"] <= trainable_bytes + (1 << 20)
        assert 0 < r["allreduce_seconds"] < 60
    darknet_lines = (tmp_path / "two" / "tiny.log").read_text()
    assert "all-reduce " in darknet_lines and " MB in " in darknet_lines
    # Every rank names where it trains: on cuda, the GPU of its local rank (one each where
    # the machine has two).
    gpus = _cuda_gpu_count() if device == "cuda" else 0
    for rank in (0, 1):
        where = rf", [^\n]*\(CUDA device {rank % gpus}\b" if gpus else ""
        assert re.search(rf"rank {rank} of 2 on \S+: device {device}{where}", two.stderr), \
            two.stderr[-3000:]
    singles = [json.loads(line) for line in
               (tmp_path / "single" / "tiny.jsonl").read_text().splitlines()]
    for r, s in zip(records, singles, strict=True):
        assert r["loss"] == pytest.approx(s["loss"], rel=1e-5)
        assert r["rate"] == s["rate"]
    print(f"\n{device}: two ranks vs one process: relative L2 {relative_l2:.2e}, largest "
          f"difference {worst:.2e} of the largest parameter")


SCRIPT = textwrap.dedent('''
    """Train through the Python API, with a fault on rank 1 chosen by argv[1]."""
    import sys

    import numpy as np

    from darknet_metal.training import session
    from darknet_metal.training.distributed import Collective
    from darknet_metal.training.run import TrainingSetup

    fault, data, cfg, backup = sys.argv[1:5]
    collective = Collective.from_environment(check_every=1)
    real = session.TrainingRun._iteration

    def faulty(self, start, started):
        record = real(self, start, started)
        if collective.rank == 1 and record.iteration == 2:
            if fault == "raise":
                raise RuntimeError("a fault injected on rank 1")
            if fault == "diverge":
                self.net.params[0]["weights"].flat[0] += 1e-3
        return record

    session.TrainingRun._iteration = faulty
    with collective.guard():
        setup = TrainingSetup.create(data, cfg, seed=3, backup=backup, workers=0,
                                     chart=False, collective=collective)
        setup.run(progress=False)
''')


@pytest.mark.parametrize("fault, words", [
    ("raise", "rank 1 of 2 failed: Traceback"),
    ("diverge", "the trainable parameters of rank(s) 1 differ from rank 0's"),
])
def test_a_fault_on_one_rank_ends_every_rank_naming_it(tmp_path, shapes, fault, words):
    cfg = tiny_cfg(tmp_path, batch=2, subdivisions=1, max_batches=50)
    script = tmp_path / "train.py"
    script.write_text(SCRIPT)
    start = time.monotonic()
    done = _run(_mpirun(2, sys.executable, str(script), fault, str(shapes), cfg,
                        str(tmp_path / "backup")))
    assert done.returncode != 0
    output = done.stdout + done.stderr
    assert words in output, output[-3000:]
    if fault == "raise":
        assert "a fault injected on rank 1" in output
    # Ended long before the 50 iterations: every rank stopped, none waited in a collective.
    assert time.monotonic() - start < BOUND
    records = (tmp_path / "backup" / "tiny.jsonl").read_text().splitlines()
    assert len(records) <= 3


def _rank_pids(launcher_pid: int) -> dict[int, int]:
    """rank -> pid of the processes an mpirun started (from their environment)."""
    import psutil

    found = {}
    for child in psutil.Process(launcher_pid).children(recursive=True):
        try:
            rank = child.environ().get("OMPI_COMM_WORLD_RANK")
        except (psutil.AccessDenied, psutil.NoSuchProcess):
            continue
        if rank is not None and "python" in " ".join(child.cmdline()):
            found[int(rank)] = child.pid
    return found


@pytest.mark.parametrize("device", ["cpu", "cuda"])
def test_a_killed_rank_ends_the_others(tmp_path, shapes, device):
    require(device)
    cfg = tiny_cfg(tmp_path, batch=2, subdivisions=1, max_batches=100000)
    backup = tmp_path / "backup"
    process = subprocess.Popen(
        _mpirun(2, *_train_command(str(shapes), cfg, "--backup", str(backup), "-q",
                                   "--no-chart", "--workers", "0", "--device", device)),
        stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    try:
        log = backup / "tiny.jsonl"
        deadline = time.monotonic() + BOUND
        while time.monotonic() < deadline and not (log.exists() and log.read_text().strip()):
            time.sleep(0.2)
        assert log.exists(), "the run never trained an iteration"
        ranks = _rank_pids(process.pid)
        assert sorted(ranks) == [0, 1], ranks
        os.kill(ranks[1], signal.SIGKILL)
        output, _ = process.communicate(timeout=120)
    finally:
        if process.poll() is None:
            process.kill()
            process.communicate()
    assert process.returncode != 0
    assert re.search(r"rank 1\b", output), output[-3000:]
    import psutil

    assert not psutil.pid_exists(ranks[0]) or \
        psutil.Process(ranks[0]).status() == psutil.STATUS_ZOMBIE
    # Nothing half written: no temporary file left, and every weights file whole.
    assert not [p.name for p in backup.iterdir() if p.name.endswith(".tmp")]
    import darknet_metal as dm

    layers = dm.load(cfg).layers
    for weights in backup.glob("*.weights"):
        read_weights(weights, layers)


def test_a_two_rank_run_resumes_from_last(tmp_path, shapes):
    common = ["--seed", "9", "-q", "--no-chart", "--workers", "0"]
    whole_cfg = tiny_cfg(tmp_path, batch=2, subdivisions=1, max_batches=4)
    whole = _run(_mpirun(2, *_train_command(str(shapes), whole_cfg, "--backup",
                                            str(tmp_path / "whole"), *common)))
    assert whole.returncode == 0, whole.stderr[-3000:]
    part_dir = tmp_path / "part"
    part_dir.mkdir()
    first_cfg = tiny_cfg(part_dir, batch=2, subdivisions=1, max_batches=2)
    first = _run(_mpirun(2, *_train_command(str(shapes), first_cfg, "--backup",
                                            str(part_dir), *common)))
    assert first.returncode == 0, first.stderr[-3000:]
    rest_cfg = tiny_cfg(part_dir, batch=2, subdivisions=1, max_batches=4)
    rest = _run(_mpirun(2, *_train_command(str(shapes), rest_cfg,
                                           str(part_dir / "tiny_last.weights"), "--backup",
                                           str(part_dir), "--seed", "9", "--no-chart",
                                           "--workers", "0")))
    assert rest.returncode == 0, rest.stderr[-3000:]
    assert "continues exactly" in rest.stderr
    records = [json.loads(line) for line in (part_dir / "tiny.jsonl").read_text().splitlines()]
    assert [r["iteration"] for r in records] == [1, 2, 3, 4]
    assert [r["images"] for r in records] == [4, 8, 12, 16]
    _assert_same_training(whole_cfg, part_dir / "tiny_final.weights",
                          tmp_path / "whole" / "tiny_final.weights")


def test_ranks_started_from_different_weights_are_refused(tmp_path, shapes):
    import darknet_metal as dm

    cfg = tiny_cfg(tmp_path, batch=2, subdivisions=1, max_batches=3)
    for seed in (1, 2):
        dm.load(cfg, seed=seed).save_weights(tmp_path / f"start{seed}.weights")
    launcher = _launcher()  # then one command per rank
    rank = ["-n", "1"]
    common = ["--backup", str(tmp_path / "b"), "-q", "--no-chart", "--workers", "0"]
    done = _run([*launcher, *rank, *_train_command(str(shapes), cfg,
                                                   str(tmp_path / "start1.weights"), *common),
                 ":", *rank, *_train_command(str(shapes), cfg,
                                             str(tmp_path / "start2.weights"), *common)])
    assert done.returncode != 0
    assert "at iteration 0 the trainable parameters of rank(s) 1 differ from rank 0's" in \
        done.stdout + done.stderr, done.stderr[-3000:]


STATISTICS_SCRIPT = textwrap.dedent('''
    """Two networks trained side by side through the Python API on the same shares: one
    averaging the statistics after every step, one only at the end; prints the largest
    difference of their rolling statistics relative to their largest value."""
    import sys

    import numpy as np

    import darknet_metal as dm
    from darknet_metal.training.distributed import Collective

    cfg, device = sys.argv[1:3]
    collective = Collective.from_environment(check_every=0)
    rows, batch, subdivisions = collective.share(2, 1)
    nets = [dm.load(cfg, seed=4, batch=batch, subdivisions=subdivisions, device=device)
            for _ in range(2)]
    rng = np.random.default_rng(11)
    with collective.guard():
        for net in nets:
            collective.broadcast_parameters(net)
        for _ in range(3):
            x = rng.random((batch, 3, 96, 96), dtype=np.float32)
            truths = [np.array([[i % 3, 0.5, 0.5, 0.3, 0.4]], np.float32) for i in range(batch)]
            collective.step(nets[0], x[rows], [truths[i] for i in rows])
            collective.step(nets[1], x[rows], [truths[i] for i in rows],
                            average_statistics=False)
        collective.average_statistics(nets[1])
        worst = 0.0
        for layer, arrays in nets[0].statistic_buffers().items():
            for name, a in arrays.items():
                b = nets[1].statistic_buffers()[layer][name]
                worst = max(worst, float(np.abs(a - b).max() / max(np.abs(a).max(), 1e-30)))
        if collective.rank == 0:
            print(f"worst {worst:.3e}")
''')


@pytest.mark.parametrize("device", ["cpu", "cuda"])
def test_statistics_averaged_before_a_read_equal_averaged_every_step(tmp_path, device):
    """The trainer averages the ranks' rolling statistics only before rank 0 reads them: the
    moving average is linear, so that is the per-step average up to rounding."""
    require(device)
    cfg = tiny_cfg(tmp_path, batch=2, subdivisions=1, max_batches=3)
    script = tmp_path / "averaging.py"  # not statistics.py: that would hide the stdlib's
    script.write_text(STATISTICS_SCRIPT)
    done = _run(_mpirun(2, sys.executable, str(script), cfg, device))
    assert done.returncode == 0, done.stderr[-3000:]
    worst = float(re.search(r"worst (\S+)", done.stdout).group(1))
    # Float32 rounding of three moving-average updates in another order.
    assert worst <= 1e-5, worst
    print(f"\n{device}: statistics averaged at the end vs every step: {worst:.2e}")


def test_under_mpirun_rank_0_alone_derives_the_model_files(tmp_path, model_cache):
    """``train --model`` across processes: rank 0 derives the cfg and cuts the backbone (one
    set of derivation lines), every rank trains from those files, and the run's one log
    counts both ranks' images."""
    data = make_shapes(tmp_path / "shapes", train=12, valid=4, size=(SIZE, SIZE), seed=5)
    done = _run(_mpirun(2, *_train_command(
        str(data), "--model", "yolov3-tiny", "--size", f"{SIZE}x{SIZE}", "--batch", "2",
        "--max-batches", "2", "--seed", "1", "--no-chart", "--workers", "0")))
    assert done.returncode == 0, done.stderr[-3000:]
    assert done.stderr.count("[yolo 16] classes=3 (given)") == 1, done.stderr[-3000:]
    assert done.stderr.count("the first 15 layers of") == 1
    for rank in (0, 1):
        assert f"rank {rank} of 2 on " in done.stderr
    backup = data.parent / "backup"
    assert sorted(p.name for p in backup.iterdir() if p.suffix in (".cfg", ".15")) == \
        ["yolov3-tiny-shapes.cfg", "yolov3-tiny.conv.15"]
    records = [json.loads(line) for line in
               (backup / "yolov3-tiny-shapes.jsonl").read_text().splitlines()]
    assert [r["images"] for r in records] == [4, 8]
