"""The training loader: batches prepared ahead by workers while the caller trains.

Threads by default: decoding, resizing and colour conversion run in OpenCV, and a training
step on the CPU runs without the GIL, so threads overlap with both and share the batch
arrays without copies. Processes (``processes=True``) when the step leaves the CPUs free (a
GPU): the augmentation's Python and NumPy work then runs on every core at once, and the
processes write into shared batch arrays the device reads in place
(:mod:`.processes`, :mod:`.shared_batches`). At most ``prefetch`` batches are in flight
(bounded memory). A batch depends only on (seed, iteration, size), so the number or kind of
workers changes how fast batches come, never what they hold.
"""

from __future__ import annotations

import threading
import time
from collections import deque
from collections.abc import Callable, Iterator, Sequence
from concurrent.futures import Executor, Future, ThreadPoolExecutor
from concurrent.futures.process import BrokenProcessPool
from dataclasses import dataclass
from typing import Any

import numpy as np

from darknet_metal.errors import ArgumentError, DarknetMetalError

from .batch import SAMPLINGS, Batch, SampleSource, load_batch, load_slot
from .draws import check_seed
from .processes import check_picklable, row_tasks, start_processes, submit_rows
from .settings import LoaderSettings
from .shared_batches import SharedBatches

__all__ = ["Loader"]

THREAD_NAME_PREFIX = "darknet-metal-loader"


@dataclass
class _Pending:
    iteration: int
    width: int
    height: int
    x: np.ndarray
    #: Per task, the (truths, sample index) of each of its rows, in row order.
    futures: list[Future[list[tuple[np.ndarray, int]]]]


def _load_row(source: SampleSource, settings: LoaderSettings, seed: int, iteration: int,
              slot: int, width: int, height: int, sampling: str,
              out: np.ndarray) -> list[tuple[np.ndarray, int]]:
    _, truths, index = load_slot(source, settings, seed, iteration, slot, width=width,
                                 height=height, sampling=sampling, out=out)
    return [(truths, index)]


def _check_size(width: object, height: object) -> tuple[int, int]:
    for value in (width, height):
        if isinstance(value, bool) or not isinstance(value, int | np.integer) or value < 1:
            raise ArgumentError(f"size must be positive integers, got {width!r}x{height!r}")
    return int(width), int(height)  # type: ignore[arg-type]


class Loader:
    """Batches of augmented training images, in iteration order, made ahead by workers.

    ``samples``/``boxes``: see :class:`~darknet_metal.training.loading.batch.SampleSource`;
    ``settings``: :class:`LoaderSettings` (e.g. ``settings_from_cfg(parse_cfg(path))``);
    ``seed``: the run's seed; ``workers``: threads preparing images (0: each batch is made
    in the caller's thread when asked for); ``processes``: the workers are processes
    (spawned at the start; the samples and ``boxes`` must pickle) writing into shared
    batch arrays; ``prefetch``: batches in flight at most (>= 1);
    ``start_iteration``: the first batch's iteration (a resumed run continues its sequence);
    ``sampling``: "random" (Darknet's: each image drawn with replacement) or "epoch" (a
    seeded permutation per epoch); ``slots``: the rows of each batch to load (default all:
    a process training on a share of each batch loads its rows only). ``allocate(shape)``:
    makes the arrays the workers write batches into (a trainer's ``batch_array``: memory its
    device reads in place); with processes it is called ``allocate(shape, memory=shared)``
    and builds its array on that shared memory. The arrays are then reused, ``prefetch + 2``
    per size, so a batch's ``x`` is valid until ``prefetch + 1`` more batches were taken
    (None: a new NumPy array each batch with threads).

    Use as a context manager (or call :meth:`close`): closing cancels the work queued, waits
    for the images being made, and leaves no thread, process or shared file behind. An
    image or label that cannot be read raises its error (naming the file) from :meth:`next`
    in the caller's thread, and closes the loader.
    """

    def __init__(
        self,
        samples: Sequence[Any],
        settings: LoaderSettings,
        *,
        boxes: Callable[[Any], np.ndarray] | None = None,
        seed: int = 0,
        workers: int = 2,
        processes: bool = False,
        prefetch: int = 2,
        start_iteration: int = 0,
        sampling: str = "random",
        slots: range | None = None,
        allocate: Callable[[tuple[int, ...]], np.ndarray] | None = None,
    ) -> None:
        if not isinstance(settings, LoaderSettings):
            raise ArgumentError(f"settings must be LoaderSettings, not {type(settings).__name__}")
        for name, value, low in (("workers", workers, 0), ("prefetch", prefetch, 1),
                                 ("start_iteration", start_iteration, 0)):
            if isinstance(value, bool) or not isinstance(value, int) or value < low:
                raise ArgumentError(f"{name} must be an integer >= {low}, not {value!r}")
        if sampling not in SAMPLINGS:
            raise ArgumentError(f"sampling must be one of {', '.join(SAMPLINGS)}, not {sampling!r}")
        slots = range(settings.batch) if slots is None else slots
        if (not isinstance(slots, range) or len(slots) == 0 or slots.step != 1
                or slots.start < 0 or slots.stop > settings.batch):
            raise ArgumentError(f"slots must be a non-empty range within the batch's "
                                f"{settings.batch} rows, not {slots!r}")
        self.slots = slots
        self.source = SampleSource(samples, boxes, settings.classes)
        self.settings = settings
        self.seed = check_seed(seed)
        self.workers = workers
        self.processes = bool(processes and workers)
        self.prefetch = prefetch
        self.sampling = sampling
        #: The iteration of the batch :meth:`next` returns next.
        self.iteration = start_iteration
        #: Seconds the caller spent in :meth:`next` waiting for data.
        self.wait_seconds = 0.0
        self._size = (settings.width, settings.height)
        self._allocate = allocate
        # Per (width, height): the batch arrays made so far and the next one to reuse.
        # (with processes, each array's shared file).
        self._arrays: dict[tuple[int, int], list[tuple[str | None, np.ndarray]]] = {}
        self._turn: dict[tuple[int, int], int] = {}
        self._pending: deque[_Pending] = deque()
        self._lock = threading.Lock()
        self._closed = False
        self._shared: SharedBatches | None = None
        self._pool: Executor | None = None
        # With processes, the rows of every batch split into tasks (the same each batch).
        self._tasks = row_tasks(slots, workers) if self.processes else []
        if self.processes:
            check_picklable(self.source, settings)
            self._pool = start_processes(workers, self.source, settings)
            self._shared = SharedBatches()
        elif workers:
            self._pool = ThreadPoolExecutor(max_workers=workers,
                                            thread_name_prefix=THREAD_NAME_PREFIX)

    # --- public API ----------------------------------------------------------------------

    @property
    def size(self) -> tuple[int, int]:
        """(width, height) of the batches to come."""
        return self._size

    def set_size(self, width: int, height: int) -> None:
        """Make the next batches at ``width`` x ``height`` (``random=1``). Batches already
        being prepared at another size are dropped and made again, as Darknet restarts its
        loading after a resize; their content depends only on (seed, iteration, size)."""
        size = _check_size(width, height)
        self._check_open()
        if size == self._size:
            return
        self._size = size
        self._drop_pending()

    def next(self) -> Batch:
        """The batch of :attr:`iteration` at :attr:`size`; advances :attr:`iteration`."""
        self._check_open()
        start = time.perf_counter()
        try:
            if self._pool is None:
                batch = load_batch(
                    self.source, self.settings, self.seed, self.iteration,
                    width=self._size[0], height=self._size[1], sampling=self.sampling,
                    slots=self.slots,
                )
            else:
                self._fill()
                batch = self._collect(self._pending.popleft())
        except BaseException:
            self.close()
            raise
        finally:
            self.wait_seconds += time.perf_counter() - start
        self.iteration += 1
        if self._pool is not None:
            self._fill()  # start the following batches while the caller trains
        return batch

    def __next__(self) -> Batch:
        return self.next()

    def __iter__(self) -> Iterator[Batch]:
        return self

    def close(self) -> None:
        """Cancel queued work, wait for running tasks, stop the workers. Idempotent."""
        with self._lock:
            if self._closed:
                return
            self._closed = True
        self._drop_pending()
        if self._pool is not None:
            self._pool.shutdown(wait=True, cancel_futures=True)
        if self._shared is not None:
            self._shared.close()

    @property
    def closed(self) -> bool:
        return self._closed

    def __enter__(self) -> Loader:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    # --- internals -----------------------------------------------------------------------

    def _check_open(self) -> None:
        if self._closed:
            raise ArgumentError("the loader is closed")

    def _drop_pending(self) -> None:
        while self._pending:
            pending = self._pending.popleft()
            for future in pending.futures:
                future.cancel()
            # Tasks already running finish into arrays nobody keeps: never handed out again.
            arrays = self._arrays.get((pending.width, pending.height), [])
            self._arrays[(pending.width, pending.height)] = [a for a in arrays
                                                            if a[1] is not pending.x]

    def _new_array(self, shape: tuple[int, ...]) -> tuple[str | None, np.ndarray]:
        if self._shared is None:
            assert self._allocate is not None
            return None, self._allocate(shape)
        path, shared = self._shared.create(shape)
        return path, shared if self._allocate is None else self._allocate(shape, memory=shared)

    def _batch_array(self, width: int, height: int) -> tuple[str | None, np.ndarray]:
        shape = (len(self.slots), self.settings.channels, height, width)
        if self._allocate is None and self._shared is None:
            return None, np.empty(shape, np.float32)
        arrays = self._arrays.setdefault((width, height), [])
        if len(arrays) < self.prefetch + 2:
            arrays.append(self._new_array(shape))
            return arrays[-1]
        turn = self._turn.get((width, height), 0)
        self._turn[(width, height)] = turn + 1
        return arrays[turn % len(arrays)]

    def _fill(self) -> None:
        assert self._pool is not None
        next_iteration = self.iteration + len(self._pending)
        while len(self._pending) < self.prefetch:
            width, height = self._size
            s = self.settings
            path, x = self._batch_array(width, height)
            if path is not None:
                futures = submit_rows(self._pool, path, x.shape, self._tasks, self.seed,
                                      next_iteration, self.sampling)
            else:
                futures = [self._pool.submit(_load_row, self.source, s, self.seed,
                                             next_iteration, slot, width, height,
                                             self.sampling, x[row])
                           for row, slot in enumerate(self.slots)]
            self._pending.append(_Pending(next_iteration, width, height, x, futures))
            next_iteration += 1

    def _collect(self, pending: _Pending) -> Batch:
        truths: list[np.ndarray] = []
        images: list[int] = []
        for future in pending.futures:
            try:
                rows = future.result()
            except BrokenProcessPool:
                raise DarknetMetalError(
                    "a loader process ended unexpectedly: killed, out of memory, or it could "
                    "not start (Python's spawned processes import the script that started "
                    "them again: a script that trains on a GPU runs its training under "
                    "`if __name__ == \"__main__\":`); the loader stops") from None
            for slot_truths, index in rows:
                truths.append(slot_truths)
                images.append(index)
        return Batch(pending.x, truths, pending.iteration, pending.width, pending.height, images)
