"""Loader worker processes: each makes whole rows of a batch into a shared batch array.

Processes rather than threads when the device trains without the host's CPUs (a GPU): the
augmentation's NumPy and Python work then runs on every core at once instead of taking
turns under one interpreter lock (16 cores of an H200 host: 8 threads delivered 623 images
a second, 16 processes 1,662). The processes are started with ``spawn`` (no copy of the
trainer's threads or device state), ignore Ctrl-C (the trainer's process stops them), and
hold the samples from their start: a task names only the rows to make.
"""

from __future__ import annotations

import ast
import functools
import multiprocessing
import os
import pickle
import signal
import sys
from collections.abc import Sequence
from concurrent.futures import Future, ProcessPoolExecutor

import numpy as np

from darknet_metal.errors import ArgumentError

from .batch import SampleSource, load_slot
from .settings import LoaderSettings
from .shared_batches import map_batch

__all__ = ["RowTask", "check_picklable", "row_tasks", "spawn_blocker", "start_processes"]

#: Rows of a batch per task, in tasks per worker: a few, so that a slow image (a mosaic of
#: four large files) does not hold the batch back behind one worker.
TASKS_PER_WORKER = 2

_source: SampleSource | None = None
_settings: LoaderSettings | None = None


def _start_worker(source: SampleSource, settings: LoaderSettings) -> None:
    global _source, _settings
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    try:
        import cv2

        cv2.setNumThreads(1)  # one process per core already
    except ImportError:
        pass
    _source, _settings = source, settings


def _guarded(path: str) -> bool:
    """Whether the script at ``path`` tests ``__name__ == "__main__"`` at its top level."""
    try:
        with open(path, "rb") as f:
            tree = ast.parse(f.read(), path)
    except (OSError, SyntaxError, ValueError):
        return False
    for node in tree.body:
        if isinstance(node, ast.If) and isinstance(node.test, ast.Compare):
            names = {n.id for n in ast.walk(node.test) if isinstance(n, ast.Name)}
            texts = {n.value for n in ast.walk(node.test) if isinstance(n, ast.Constant)}
            if "__name__" in names and "__main__" in texts:
                return True
    return False


@functools.cache
def spawn_blocker() -> str | None:
    """Why loader processes cannot start from this program, or None when they can.

    A spawned process imports the program's main module again (Python's rule): a script
    whose training code is not under ``if __name__ == "__main__":`` would run again in each
    process. ``python -m package`` (a ``__main__`` module), console scripts and interactive
    sessions are fine; a script is read (not run) to find the guard, once a process."""
    main = sys.modules.get("__main__")
    spec_name = getattr(getattr(main, "__spec__", None), "name", None)
    if spec_name is not None and (spec_name == "__main__" or spec_name.endswith(".__main__")):
        return None
    path = getattr(main, "__file__", None)
    if path is None:
        return None  # interactive: nothing is imported again
    if _guarded(os.path.abspath(path)):
        return None
    return (f"{path} runs its training outside `if __name__ == \"__main__\":`, and loader "
            "processes import the program's main module again (Python's spawned processes "
            "do)")


def check_picklable(source: SampleSource, settings: LoaderSettings) -> None:
    """Raises ArgumentError when the samples or the boxes callable cannot go to another
    process (a lambda, a local function)."""
    try:
        pickle.dumps((source, settings))
    except Exception as exc:  # pickling raises several kinds
        raise ArgumentError(
            f"loader processes need samples and a boxes callable that can be pickled "
            f"(a module-level function or a bound method, not a lambda): {exc}; use "
            "threads instead (processes=False)") from None


def start_processes(workers: int, source: SampleSource,
                    settings: LoaderSettings) -> ProcessPoolExecutor:
    """``workers`` spawned processes holding ``source`` and ``settings``; ArgumentError when
    this program cannot spawn them (``spawn_blocker``)."""
    blocker = spawn_blocker()
    if blocker is not None:
        raise ArgumentError(f"loader processes cannot start: {blocker}; put the training "
                            "under that guard, or use threads (processes=False)")
    return ProcessPoolExecutor(max_workers=workers,
                               mp_context=multiprocessing.get_context("spawn"),
                               initializer=_start_worker, initargs=(source, settings))


RowTask = tuple[int, int]  # (row of the batch array, slot of the batch)


def row_tasks(slots: range, workers: int) -> list[list[RowTask]]:
    """The rows of a batch split into contiguous tasks, TASKS_PER_WORKER per worker."""
    rows = list(enumerate(slots))
    count = max(1, min(len(rows), workers * TASKS_PER_WORKER))
    return [chunk for chunk in (rows[i * len(rows) // count:(i + 1) * len(rows) // count]
                                for i in range(count)) if chunk]


def load_rows(path: str, shape: tuple[int, ...], rows: Sequence[RowTask], seed: int,
              iteration: int, sampling: str) -> list[tuple[np.ndarray, int]]:
    """Makes ``rows`` of batch ``iteration`` into the shared array at ``path``; returns each
    row's truths and sample index (runs in a worker process)."""
    assert _source is not None and _settings is not None, "not a loader process"
    x = map_batch(path, shape)
    made = []
    for row, slot in rows:
        _, truths, index = load_slot(_source, _settings, seed, iteration, slot,
                                     width=shape[3], height=shape[2], sampling=sampling,
                                     out=x[row])
        made.append((truths, index))
    return made


def submit_rows(pool: ProcessPoolExecutor, path: str, shape: tuple[int, ...],
                tasks: Sequence[Sequence[RowTask]], seed: int, iteration: int,
                sampling: str) -> list[Future[list[tuple[np.ndarray, int]]]]:
    """One future per task of ``tasks`` (``row_tasks``)."""
    return [pool.submit(load_rows, path, shape, list(task), seed, iteration, sampling)
            for task in tasks]
