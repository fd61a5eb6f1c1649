"""``DetectionStream``: detections of a sequence of frames, pipelined (``Network.stream``).

Three stages overlap. Worker threads read and resize the next frames (``Detector.prepare``).
The calling thread runs the passes: on the CPU the forward pass itself (native code that
releases the GIL); on a Metal device it fills a slot of a ``PassRing`` and commits the pass
without waiting, keeping up to ``depth`` passes in flight, and waits only when it needs the
oldest pass's outputs. One more worker decodes boxes and runs NMS on finished passes. Frames
come out in order, each with exactly the detections ``Network.detect`` gives it.
"""

from __future__ import annotations

import time
from collections import deque
from collections.abc import Iterable, Iterator
from concurrent.futures import Future, ThreadPoolExecutor
from contextlib import AbstractContextManager
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Protocol

import numpy as np

from darknet_metal import arguments
from darknet_metal.inference.boxes import Detection
from darknet_metal.inference.detector import (
    DetectingNetwork,
    Detector,
    ImageSource,
    PreparedImage,
)

if TYPE_CHECKING:
    from darknet_metal.runtime.backend import Backend
    from darknet_metal.runtime.pass_ring import PassRing

__all__ = ["DetectionStream", "PassTimings", "StreamingNetwork"]


class StreamingNetwork(DetectingNetwork, Protocol):
    """What a stream needs of a network beyond detection (``darknet_metal.Network`` has
    it): one pass at a time (``exclusive``) and its executor with current parameters (whose
    pass rings keep passes in flight)."""

    def exclusive(self) -> AbstractContextManager[None]: ...

    def inference_executor(self) -> Backend: ...


@dataclass(frozen=True)
class PassTimings:
    """Seconds one pass of a stream spent in each stage. ``frames``: the images it held.
    ``prepare``: reading and resizing them (summed over the worker threads that did it);
    ``upload``: copying the batch into the pass's input; ``encode``: encoding and committing
    the pass (0 on the CPU); ``device``: waiting for the device (on the CPU: the forward pass
    itself); ``readback``: copying the ``[yolo]`` outputs out; ``postprocess``: decoding boxes
    and NMS."""

    frames: int
    prepare: float
    upload: float
    encode: float
    device: float
    readback: float
    postprocess: float


@dataclass
class _Pass:
    images: list[PreparedImage]
    prepare: float
    upload: float = 0.0
    encode: float = 0.0
    device: float = 0.0
    readback: float = 0.0
    slot: int = -1
    outputs: list[np.ndarray] = field(default_factory=list)


class DetectionStream:
    """Iterator over per-frame detection lists; see ``Network.stream``. ``timings`` holds a
    ``PassTimings`` per finished pass. ``close()`` (or leaving a ``with`` block) stops the
    workers and waits for passes in flight; it is called when the frames run out."""

    def __init__(self, net: StreamingNetwork, frames: Iterable[ImageSource], *,
                 thresh: float = 0.25,
                 nms: float = 0.45, batch: int | None = None, depth: int = 2,
                 workers: int = 2) -> None:
        self.net = net
        self.detector = Detector(net, thresh, nms)
        self.batch = arguments.positive_int("batch", net.batch if batch is None else batch)
        self.depth = arguments.positive_int("depth", depth)
        self.workers = arguments.positive_int("workers", workers)
        self.timings: list[PassTimings] = []
        self._frames = iter(frames)
        self._results = self._run()

    def __iter__(self) -> Iterator[list[Detection]]:
        return self

    def __next__(self) -> list[Detection]:
        return next(self._results)

    def close(self) -> None:
        self._results.close()

    def __enter__(self) -> DetectionStream:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    # -- the pipeline ----------------------------------------------------------------------

    def _run(self) -> Iterator[list[Detection]]:
        prepare_pool = ThreadPoolExecutor(self.workers, thread_name_prefix="dm-stream-prepare")
        finish_pool = ThreadPoolExecutor(1, thread_name_prefix="dm-stream-finish")
        ring = self._hold_ring()
        ahead: deque[Future[tuple[PreparedImage, float]]] = deque()
        in_flight: deque[_Pass] = deque()
        finishing: deque[Future[list[list[Detection]]]] = deque()
        # Passes kept on the device at once; the CPU runs each pass to the end.
        keep = ring.depth if ring is not None else 1
        try:
            while True:
                self._read_ahead(prepare_pool, ahead)
                images, prepare = [], 0.0
                while ahead and len(images) < self.batch:
                    image, seconds = ahead.popleft().result()
                    images.append(image)
                    prepare += seconds
                if not images:
                    break
                in_flight.append(self._start(_Pass(images, prepare), ring))
                while len(in_flight) >= keep:
                    finishing.append(finish_pool.submit(self._finish, self._collect(
                        in_flight.popleft(), ring)))
                # Hand over what is done; block only when `depth` passes wait behind it.
                while finishing and (finishing[0].done() or len(finishing) > self.depth):
                    yield from finishing.popleft().result()
            while in_flight:
                finishing.append(finish_pool.submit(self._finish, self._collect(
                    in_flight.popleft(), ring)))
            while finishing:
                yield from finishing.popleft().result()
        finally:
            for future in ahead:
                future.cancel()
            prepare_pool.shutdown(wait=True, cancel_futures=True)
            finish_pool.shutdown(wait=True, cancel_futures=True)
            if ring is not None:
                with self.net.exclusive():
                    self.net.inference_executor().let_go_pass_ring(ring)

    def _read_ahead(self, pool: ThreadPoolExecutor,
                    ahead: deque[Future[tuple[PreparedImage, float]]]) -> None:
        # Frames are taken from the caller's iterable in this thread, in order.
        wanted = self.batch * (self.depth + 1) + self.workers
        while len(ahead) < wanted:
            frame = next(self._frames, None)
            if frame is None:
                return
            ahead.append(pool.submit(self._prepare, frame))

    def _prepare(self, frame: ImageSource) -> tuple[PreparedImage, float]:
        began = time.perf_counter()
        image = self.detector.prepare(frame)
        return image, time.perf_counter() - began

    def _hold_ring(self) -> PassRing | None:
        with self.net.exclusive():
            return self.net.inference_executor().hold_pass_ring(
                self.batch, self.detector.outputs, self.depth)

    def _batch_input(self, images: list[PreparedImage], out: np.ndarray) -> None:
        for n, image in enumerate(images):
            out[n] = image.x
        out[len(images):] = 0  # a last, shorter pass: padding rows, never read back

    def _start(self, job: _Pass, ring: PassRing | None) -> _Pass:
        net = self.net
        if ring is None:
            began = time.perf_counter()
            c, h, w = net.input_shape
            x = np.empty((self.batch, c, h, w), np.float32)
            self._batch_input(job.images, x)
            staged = time.perf_counter()
            job.outputs = net.forward(x, outputs=self.detector.outputs)
            job.upload, job.device = staged - began, time.perf_counter() - staged
            return job
        with net.exclusive():
            net.inference_executor()  # the parameters of the last training step, if any
            job.slot = next(s for s in range(ring.depth) if not ring.started[s])
            began = time.perf_counter()
            self._batch_input(job.images, ring.inputs[job.slot])
            job.upload = time.perf_counter() - began
            job.encode = ring.start(job.slot)
        return job

    def _collect(self, job: _Pass, ring: PassRing | None) -> _Pass:
        if ring is not None:
            with self.net.exclusive():
                job.outputs, job.device, job.readback = ring.finish(job.slot)
        return job

    def _finish(self, job: _Pass) -> list[list[Detection]]:
        began = time.perf_counter()
        found = self.detector.batch_detections(job.outputs, job.images)
        self.timings.append(PassTimings(
            frames=len(job.images), prepare=job.prepare, upload=job.upload,
            encode=job.encode, device=job.device, readback=job.readback,
            postprocess=time.perf_counter() - began))
        return found

    def summary(self) -> dict[str, Any]:
        """Totals of ``timings``: frames, passes, and seconds per stage."""
        fields = ("prepare", "upload", "encode", "device", "readback", "postprocess")
        return {"frames": sum(t.frames for t in self.timings), "passes": len(self.timings),
                **{f: sum(getattr(t, f) for t in self.timings) for f in fields}}
