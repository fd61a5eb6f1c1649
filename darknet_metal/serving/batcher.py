"""``DynamicBatcher``: one model version's network instances behind one request queue.

Each instance is a ``Network`` of its own with a thread of its own. A thread takes the oldest
request and, with dynamic batching, the requests queued behind it while their images fit in
``max_batch_size``: it waits for more until the oldest has waited ``max_queue_delay`` or the
batch reaches ``max_batch_size`` or a preferred size, stacks the images into one
``Network.forward`` and splits its outputs back by request. Without dynamic batching each
request runs alone. Rows of a batch are computed independently, so every request gets what
running it alone gives (bit for bit on the CPU).

``submit`` may be called from any thread; results arrive as ``concurrent.futures.Future``s.
"""

from __future__ import annotations

import collections
import concurrent.futures
import threading
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

import numpy as np

from darknet_metal.errors import ArgumentError

if TYPE_CHECKING:
    from darknet_metal.network import Network

__all__ = ["BatchRecord", "DynamicBatcher"]


@dataclass(frozen=True)
class BatchRecord:
    """What one execution did: ``rows`` images from ``requests`` requests, each having
    waited ``queue_ns`` (one entry per request) before its ``infer_ns`` forward began."""

    rows: int
    requests: int
    queue_ns: tuple[int, ...]
    infer_ns: int


@dataclass
class _Request:
    x: np.ndarray
    future: concurrent.futures.Future[list[np.ndarray]]
    arrival_ns: int = field(default_factory=time.monotonic_ns)


class DynamicBatcher:
    """Runs requests of ``(n, C, H, W)`` float32 images on ``networks`` (one thread each),
    returning each request's ``outputs`` (layer indices) rows.

    ``max_batch_size``: most images one forward takes (0: each request as sent).
    ``queue_delay_us``: with dynamic batching, how long the oldest request may wait for
    others, in microseconds; None runs each request alone. ``preferred``: batch sizes run
    at once without waiting (the largest the queue's head requests can make). ``on_batch``
    is called (from the instance's thread) after each execution.
    """

    def __init__(self, networks: Sequence[Network], outputs: Sequence[int], *,
                 max_batch_size: int, queue_delay_us: int | None = None,
                 preferred: Sequence[int] = (),
                 on_batch: Callable[[BatchRecord], None] | None = None,
                 name: str = "model") -> None:
        if not networks:
            raise ArgumentError("a batcher needs at least one network instance")
        self.outputs = list(outputs)
        self.max_batch_size = max_batch_size
        self.queue_delay_ns = None if queue_delay_us is None else 1000 * queue_delay_us
        self.preferred = frozenset(preferred)
        self._on_batch = on_batch
        self._queue: collections.deque[_Request] = collections.deque()
        self._ready = threading.Condition()
        self._closed = False
        self._threads = [threading.Thread(target=self._serve, args=(net,), daemon=True,
                                          name=f"{name}-instance-{i}")
                         for i, net in enumerate(networks)]
        for thread in self._threads:
            thread.start()

    @property
    def pending(self) -> int:
        """Requests queued and not yet taken by an instance."""
        return len(self._queue)

    def submit(self, x: np.ndarray) -> concurrent.futures.Future[list[np.ndarray]]:
        """Queue ``x`` (n, C, H, W) float32; the future gives one (n, ...) array per output
        layer. Raises ``ArgumentError`` once the batcher is closed."""
        request = _Request(x=x, future=concurrent.futures.Future())
        with self._ready:
            if self._closed:
                raise ArgumentError("the model is shutting down")
            self._queue.append(request)
            self._ready.notify_all()
        return request.future

    def close(self) -> None:
        """Run what is queued, then stop the instance threads and wait for them."""
        with self._ready:
            self._closed = True
            self._ready.notify_all()
        for thread in self._threads:
            thread.join()

    def _take(self) -> list[_Request] | None:
        """The next batch of requests (None when closed and drained)."""
        with self._ready:
            while True:
                while not self._queue:
                    if self._closed:
                        return None
                    self._ready.wait()
                if self.queue_delay_ns is None or self.max_batch_size == 0:
                    return [self._queue.popleft()]
                taken: list[_Request] = []
                while self._queue and not self._closed:
                    fitting = self._fitting()
                    preferred = self._preferred_prefix(fitting)
                    if preferred:
                        taken = preferred
                        break
                    if (sum(r.x.shape[0] for r in fitting) >= self.max_batch_size
                            or len(fitting) < len(self._queue)):
                        break  # full, or the next request would not fit: run what fits
                    remaining = (self._queue[0].arrival_ns + self.queue_delay_ns
                                 - time.monotonic_ns())
                    if remaining <= 0:
                        break
                    self._ready.wait(remaining / 1e9)
                if not self._queue:
                    continue  # another instance took them while this one waited
                taken = taken or self._fitting()
                for _ in taken:
                    self._queue.popleft()
                if self._queue:
                    self._ready.notify()  # what is left is another instance's to take
                return taken

    def _fitting(self) -> list[_Request]:
        """The queue's head requests whose rows fit in ``max_batch_size`` together (at
        least the first)."""
        taken: list[_Request] = []
        rows = 0
        for request in self._queue:
            n = request.x.shape[0]
            if taken and rows + n > self.max_batch_size:
                break
            taken.append(request)
            rows += n
        return taken

    def _preferred_prefix(self, fitting: list[_Request]) -> list[_Request]:
        """The longest head of ``fitting`` holding a preferred number of images (as Triton's
        batcher forms the largest preferred batch it can), or []."""
        rows, best = 0, 0
        for count, request in enumerate(fitting, 1):
            rows += request.x.shape[0]
            if rows in self.preferred:
                best = count
        return fitting[:best]

    def _serve(self, net: Network) -> None:
        while True:
            batch = self._take()
            if batch is None:
                return
            live = [r for r in batch if r.future.set_running_or_notify_cancel()]
            if not live:
                continue
            start = time.monotonic_ns()
            try:
                x = live[0].x if len(live) == 1 else np.concatenate([r.x for r in live])
                outs = net.forward(x, outputs=self.outputs)
            except BaseException as exc:  # every waiting request hears of it
                for request in live:
                    request.future.set_exception(exc)
                if not isinstance(exc, Exception):
                    raise
                continue
            infer_ns = time.monotonic_ns() - start
            row = 0
            for request in live:
                n = request.x.shape[0]
                request.future.set_result([out[row:row + n] for out in outs])
                row += n
            if self._on_batch is not None:
                self._on_batch(BatchRecord(rows=row, requests=len(live),
                                           queue_ns=tuple(start - r.arrival_ns for r in live),
                                           infer_ns=infer_ns))
