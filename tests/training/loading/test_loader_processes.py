"""The loader with worker processes: the same batches as threads, written into shared arrays a
trainer reads in place, and nothing left behind (processes, shared files) in any ending."""

from __future__ import annotations

import multiprocessing
import os
import signal

import numpy as np
import pytest
from loading_scenes import scene_samples

import darknet_metal as dm
from darknet_metal.errors import ArgumentError, DarknetMetalError, ImageError
from darknet_metal.training.loading import Loader, LoaderSettings, load_batch
from darknet_metal.training.loading.batch import SampleSource
from darknet_metal.training.loading.processes import row_tasks
from darknet_metal.training.loading.shared_batches import FOLDER_PREFIX, SharedBatches, sweep_stale

FULL = dict(width=96, height=64, batch=6, jitter=0.3, resize=1.2, hue=0.1, saturation=1.5,
            exposure=1.5, blur=3, gaussian_noise=8, mixup=3, max_boxes=6)


def _samples(tmp_path, count=5):
    return scene_samples(tmp_path, count)


def _children():
    return multiprocessing.active_children()


def _loader_folders(loader):
    return os.path.isdir(loader._shared.folder)


def test_tasks_cover_every_row_once_in_order():
    for rows, workers in ((64, 15), (6, 2), (1, 8), (5, 1)):
        tasks = row_tasks(range(3, 3 + rows), workers)
        flat = [pair for task in tasks for pair in task]
        assert flat == list(enumerate(range(3, 3 + rows)))
        assert len(tasks) == min(rows, 2 * workers)


def test_processes_make_the_batches_threads_make(tmp_path):
    samples = _samples(tmp_path)
    settings = LoaderSettings(**FULL)
    sizes = [(96, 64), (128, 96), (128, 96), (96, 64), (96, 64), (96, 64), (96, 64), (96, 64)]
    with Loader(samples, settings, seed=5, workers=2, processes=True, start_iteration=3,
                slots=range(1, 5)) as loader:
        assert loader.processes
        for width, height in sizes:
            loader.set_size(width, height)
            got = loader.next()
            want = load_batch(SampleSource(samples), settings, 5, got.iteration, width=width,
                              height=height, slots=range(1, 5))
            assert got.x.shape == (4, 3, height, width)
            assert got.x.tobytes() == want.x.tobytes()
            assert [t.tobytes() for t in got.truths] == [t.tobytes() for t in want.truths]
            assert got.images == want.images
        folder = loader._shared.folder
        assert os.listdir(folder)  # the shared arrays' files
    assert not os.path.exists(folder)
    assert not _children()
    assert got.x.sum() > 0  # the arrays handed out stay valid after the loader closed


def test_a_trainer_reads_the_shared_arrays_in_place(tmp_path):
    from darknet_metal.model.derive import derive_cfg
    from darknet_metal.trainer.trainer import Trainer

    cfg = tmp_path / "tiny.cfg"
    cfg.write_text(derive_cfg("yolov3-tiny", 12, max_batches=10).text)
    net = dm.load(cfg, device="cpu", batch=2, subdivisions=1, seed=1, input_size=(64, 64))
    trainer = Trainer.of(net)
    made = []

    def allocate(shape, memory=None):
        made.append(trainer.batch_array(shape, memory))
        return made[-1]

    samples = _samples(tmp_path, 3)
    settings = LoaderSettings(width=64, height=64, batch=2, classes=12)
    with Loader(samples, settings, seed=1, workers=2, processes=True,
                allocate=allocate) as loader:
        batch = loader.next()
    assert any(batch.x is m for m in made)
    assert trainer._stage(batch.x, batch.truths).x is batch.x  # no copy
    wrong = np.zeros((2, 3, 64, 64), np.float64)
    with pytest.raises(ArgumentError, match="float32 array of shape"):
        trainer.batch_array((2, 3, 64, 64), wrong)
    unaligned = np.zeros(2 * 3 * 64 * 64 + 1, np.float32)[1:].reshape(2, 3, 64, 64)
    with pytest.raises(ArgumentError, match="multiple of 64 bytes"):
        trainer.batch_array((2, 3, 64, 64), unaligned)


def test_a_bad_image_in_a_process_raises_naming_the_file(tmp_path):
    samples = _samples(tmp_path, count=2)
    bad = tmp_path / "broken.jpg"
    bad.write_bytes(b"\xff\xd8\xff\xe0 not really a jpeg")
    samples = [*samples, (str(bad), np.zeros((0, 5), np.float32))]
    settings = LoaderSettings(**{**FULL, "mixup": 0, "batch": 8})
    loader = Loader(samples, settings, workers=2, processes=True, sampling="epoch")
    folder = loader._shared.folder
    with pytest.raises(ImageError, match="broken.jpg: cannot decode image"):
        for _ in range(3):
            loader.next()
    assert loader.closed and not _children() and not os.path.exists(folder)


def test_samples_that_cannot_go_to_a_process_are_refused(tmp_path):
    samples = [p for p, _ in _samples(tmp_path, count=1)]
    with pytest.raises(ArgumentError, match="pickled .* lambda"):
        Loader(samples, LoaderSettings(**FULL), boxes=lambda s: np.zeros((0, 5)), workers=2,
               processes=True)
    assert not _children()


def test_a_killed_process_ends_the_loader_with_a_clear_error(tmp_path):
    samples = _samples(tmp_path)
    loader = Loader(samples, LoaderSettings(**FULL), workers=2, processes=True)
    loader.next()
    folder = loader._shared.folder
    for child in _children():
        os.kill(child.pid, signal.SIGKILL)
    with pytest.raises(DarknetMetalError, match="loader process ended unexpectedly"):
        for _ in range(4):
            loader.next()
    assert loader.closed and not os.path.exists(folder)


def test_errors_cross_processes_whole(tmp_path):
    import pickle

    from darknet_metal.errors import DatasetError

    error = pickle.loads(pickle.dumps(DatasetError("no label", path="a/b.txt", line=4)))
    assert (type(error), str(error), error.path, error.line, error.reason) == (
        DatasetError, "a/b.txt:4: no label", "a/b.txt", 4, "no label")


def test_a_killed_runs_shared_files_are_swept_by_the_next(tmp_path):
    dead = subprocess_pid_that_ended()
    stale = tmp_path / f"{FOLDER_PREFIX}{dead}-abc"
    stale.mkdir()
    (stale / "batch-0").write_bytes(b"\0" * 4096)
    live = tmp_path / f"{FOLDER_PREFIX}{os.getpid()}-def"
    live.mkdir()
    other = tmp_path / "something-else"
    other.mkdir()
    assert sweep_stale(str(tmp_path)) == [str(stale)]
    assert not stale.exists() and live.exists() and other.exists()
    shared = SharedBatches([str(tmp_path)])
    path, array = shared.create((2, 3, 5, 7))
    assert array.shape == (2, 3, 5, 7) and not array.any()
    assert array.ctypes.data % 4096 == 0 and os.stat(path).st_mode & 0o777 == 0o600
    shared.close()
    assert not os.path.exists(shared.folder)
    array[:] = 1  # still mapped


def test_a_full_ram_folder_sends_the_arrays_to_the_next(tmp_path, monkeypatch):
    # A container's /dev/shm is often 64 MB: the arrays then go to the temporary folder, and
    # when no folder has room the error names them all (and leaves no file behind).
    import errno

    from darknet_metal.training.loading import shared_batches

    ram, disk = tmp_path / "ram", tmp_path / "disk"
    ram.mkdir()
    disk.mkdir()
    real = shared_batches._mapped_file
    full = {str(ram)}

    def mapped(path, size):
        if os.path.dirname(os.path.dirname(path)) in full:
            raise OSError(errno.ENOSPC, "No space left on device")
        return real(path, size)

    monkeypatch.setattr(shared_batches, "_mapped_file", mapped)
    shared = SharedBatches([str(ram), str(disk)])
    path, array = shared.create((2, 3, 8, 8))
    assert path.startswith(str(disk)) and array.shape == (2, 3, 8, 8)
    full.add(str(disk))
    with pytest.raises(OSError, match=r"no room for a shared batch of .* in .*ram, .*disk"):
        shared.create((2, 3, 8, 8))
    (folder,) = os.listdir(disk)
    assert os.listdir(disk / folder) == ["batch-0"]  # the refused array left no file
    shared.close()
    assert os.listdir(ram) == [] and os.listdir(disk) == []


def subprocess_pid_that_ended():
    import subprocess
    import sys

    p = subprocess.Popen([sys.executable, "-c", "pass"])
    p.wait()
    return p.pid


def _spawn_blocker_of(tmp_path, text, *args):
    import subprocess
    import sys

    script = tmp_path / "program.py"
    script.write_text(text)
    done = subprocess.run([sys.executable, *args], capture_output=True, text=True,
                          timeout=120, cwd=tmp_path)
    assert done.returncode == 0, done.stderr[-2000:]
    return done.stdout.strip().splitlines()[-1]


ASK = "from darknet_metal.training.loading.processes import spawn_blocker\n"


def test_which_programs_can_start_loader_processes(tmp_path):
    guarded = (ASK + "def main():\n    print(spawn_blocker())\n"
               "if __name__ == '__main__':\n    main()\n")
    unguarded = ASK + "print(spawn_blocker())\n"
    assert _spawn_blocker_of(tmp_path, guarded, "program.py") == "None"
    said = _spawn_blocker_of(tmp_path, unguarded, "program.py")
    assert "program.py runs its training outside `if __name__ == \"__main__\":`" in said
    assert _spawn_blocker_of(tmp_path, unguarded, "-m", "program").endswith(
        "import the program's main module again (Python's spawned processes do)")
    assert _spawn_blocker_of(tmp_path, "", "-c", unguarded) == "None"  # nothing to import


def test_a_script_without_a_main_guard_is_told_why_before_anything_starts(tmp_path):
    import subprocess
    import sys

    (path, boxes), = _samples(tmp_path, count=1)
    script = tmp_path / "unguarded.py"
    script.write_text(f"""
import numpy as np
from darknet_metal.training.loading import Loader, LoaderSettings
loader = Loader([({path!r}, np.array({boxes.tolist()!r}, np.float32))],
                LoaderSettings(width=32, height=32, batch=2), workers=2, processes=True)
""")
    done = subprocess.run([sys.executable, str(script)], capture_output=True, text=True,
                          timeout=120, cwd=tmp_path)
    assert done.returncode != 0
    last = done.stderr.strip().splitlines()[-1]
    assert "ArgumentError: loader processes cannot start:" in last, done.stderr[-2000:]
    assert '__name__ == "__main__"' in last and "processes=False" in last
