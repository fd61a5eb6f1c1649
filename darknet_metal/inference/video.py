"""Detection in video files (``darknet-metal video``): frames decoded with OpenCV in a
reader thread, detected in a pipelined ``Network.stream``, drawn (boxes, labels and an FPS
counter, as Darknet's video example shows them) and encoded in a writer thread.

Needs OpenCV (``pip install "darknet-metal[video]"``). The annotated video is written under a
temporary name in its folder and renamed when complete; a run that fails leaves nothing.
"""

from __future__ import annotations

import os
import queue
import sys
import threading
import time
from collections import deque
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

import numpy as np
from PIL import ImageDraw, ImageFont

from darknet_metal.errors import ArgumentError, DependencyError, ImageError
from darknet_metal.inference.boxes import shown
from darknet_metal.inference.draw import draw_detections, label_font_size
from darknet_metal.inference.stream import DetectionStream, StreamingNetwork

if TYPE_CHECKING:
    from darknet_metal.inference.boxes import Detection

__all__ = ["VideoInfo", "VideoReport", "detect_video", "open_video"]

#: Codec by output extension (OpenCV's FFmpeg backend in its pip wheels writes these).
_FOURCC = {".mp4": "mp4v", ".m4v": "mp4v", ".mov": "mp4v", ".avi": "MJPG", ".mkv": "mp4v"}


def _cv2() -> Any:
    try:
        import cv2
    except ImportError as exc:
        raise DependencyError('video needs OpenCV: pip install "darknet-metal[video]"') from exc
    return cv2


@dataclass(frozen=True)
class VideoInfo:
    """A video file's ``width`` and ``height`` in pixels, ``fps`` (frames per second, 25
    when the file does not say) and ``frames`` (the count the file declares; 0 if none)."""

    path: str
    width: int
    height: int
    fps: float
    frames: int


@dataclass(frozen=True)
class VideoReport:
    """What ``detect_video`` did: ``frames`` read, ``boxes`` reported (per (box, class)),
    ``seconds`` of wall time and ``fps`` (frames per second end to end)."""

    frames: int
    boxes: int
    seconds: float
    fps: float


def open_video(path: str | os.PathLike[str]) -> tuple[VideoInfo, Iterator[np.ndarray]]:
    """Open ``path``; returns its ``VideoInfo`` and an iterator of its frames as (H, W, 3)
    uint8 RGB arrays. Raises ``ImageError`` naming the file when it is missing or is not a
    video OpenCV can decode."""
    cv2 = _cv2()
    name = os.fspath(path)
    if not os.path.isfile(name):
        raise ImageError(f"{name}: no such video file")
    capture = cv2.VideoCapture(name)
    ok, first = capture.read() if capture.isOpened() else (False, None)
    if not ok or first is None:
        capture.release()
        raise ImageError(f"{name}: not a video OpenCV can decode (or it has no frames)")
    fps = float(capture.get(cv2.CAP_PROP_FPS) or 0.0)
    info = VideoInfo(path=name, width=int(first.shape[1]), height=int(first.shape[0]),
                     fps=fps if 0 < fps < 1000 else 25.0,
                     frames=max(0, int(capture.get(cv2.CAP_PROP_FRAME_COUNT) or 0)))

    def frames() -> Iterator[np.ndarray]:
        try:
            frame = first
            while frame is not None:
                yield cv2.cvtColor(frame, cv2.COLOR_BGR2RGB)
                ok, frame = capture.read()
                if not ok:
                    frame = None
        finally:
            capture.release()

    return info, frames()


class _Prefetch:
    """Runs ``source`` in a thread, ``depth`` items ahead; re-raises its error in order."""

    _END = object()

    def __init__(self, source: Iterator[Any], depth: int) -> None:
        self._queue: queue.Queue[Any] = queue.Queue(depth)
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, args=(source,), daemon=True,
                                        name="dm-video-reader")
        self._thread.start()

    def _run(self, source: Iterator[Any]) -> None:
        try:
            for item in source:
                while not self._stop.is_set():
                    try:
                        self._queue.put((True, item), timeout=0.1)
                        break
                    except queue.Full:
                        continue
                if self._stop.is_set():
                    return
            self._queue.put((True, self._END))
        except BaseException as exc:  # handed to the consumer
            self._queue.put((False, exc))

    def __iter__(self) -> Iterator[Any]:
        while True:
            ok, item = self._queue.get()
            if not ok:
                raise item
            if item is self._END:
                return
            yield item

    def close(self) -> None:
        self._stop.set()
        while self._thread.is_alive():
            try:
                self._queue.get(timeout=0.05)
            except queue.Empty:
                pass


class _Writer:
    """Encodes frames in a thread into a temporary file beside ``path``; ``finish`` renames
    it into place, ``abort`` removes it."""

    def __init__(self, path: Path, info: VideoInfo) -> None:
        cv2 = _cv2()
        ext = path.suffix.lower()
        if ext not in _FOURCC:
            raise ArgumentError(f"{path}: cannot tell the video format from {ext!r} (use "
                                f"{', '.join(sorted(_FOURCC))})")
        if not path.parent.is_dir():
            raise ArgumentError(f"{path}: folder {path.parent} does not exist")
        self.path = path
        self.temporary = path.with_name(f".{path.stem}.{os.getpid()}.partial{ext}")
        self._video = cv2.VideoWriter(str(self.temporary), cv2.VideoWriter_fourcc(*_FOURCC[ext]),
                                      info.fps, (info.width, info.height))
        if not self._video.isOpened():
            self._video.release()
            self.temporary.unlink(missing_ok=True)
            raise ArgumentError(f"{path}: OpenCV cannot write this video format here")
        self._cv2 = cv2
        self._queue: queue.Queue[np.ndarray | None] = queue.Queue(8)
        self._error: BaseException | None = None
        self._thread = threading.Thread(target=self._run, daemon=True, name="dm-video-writer")
        self._thread.start()

    def _run(self) -> None:
        while (frame := self._queue.get()) is not None:
            if self._error is None:
                try:
                    self._video.write(self._cv2.cvtColor(frame, self._cv2.COLOR_RGB2BGR))
                except BaseException as exc:  # reported by write() or finish()
                    self._error = exc

    def write(self, rgb: np.ndarray) -> None:
        if self._error is not None:
            raise ImageError(f"{self.path}: writing the video failed: {self._error}")
        self._queue.put(rgb)

    def _close(self) -> None:
        self._queue.put(None)
        self._thread.join()
        self._video.release()

    def finish(self) -> None:
        self._close()
        if self._error is not None:
            self.temporary.unlink(missing_ok=True)
            raise ImageError(f"{self.path}: writing the video failed: {self._error}")
        os.replace(self.temporary, self.path)

    def abort(self) -> None:
        self._close()
        self.temporary.unlink(missing_ok=True)


def draw_frame(rgb: np.ndarray, detections: list[Detection], fps: float | None,
               num_classes: int) -> np.ndarray:
    """``rgb`` with the boxes and labels of ``detections`` and, unless ``fps`` is None, an
    "FPS: x.x" counter in the top left corner; a new (H, W, 3) uint8 array."""
    canvas = draw_detections(rgb, shown(detections), num_classes=num_classes)
    if fps is not None:
        draw = ImageDraw.Draw(canvas)
        size = label_font_size(rgb.shape[0])
        font = ImageFont.load_default(size=size)
        text = f"FPS: {fps:.1f}"
        x0, y0, x1, y1 = draw.textbbox((0, 0), text, font=font)
        pad = max(2, size // 8)
        draw.rectangle((0, 0, x1 - x0 + 2 * pad, y1 - y0 + 2 * pad), fill=(0, 0, 0))
        draw.text((pad - x0, pad - y0), text, fill=(255, 255, 0), font=font)
    return np.asarray(canvas)


def detect_video(
    net: StreamingNetwork,
    source: str | os.PathLike[str],
    *,
    out: str | os.PathLike[str] | None = None,
    thresh: float = 0.25,
    nms: float = 0.45,
    batch: int = 1,
    fps_overlay: bool = True,
    on_frame: Callable[[int, list[Detection]], None] | None = None,
    progress: bool = True,
) -> VideoReport:
    """Detect in every frame of video ``source`` with ``net`` (a pipelined ``stream`` of
    ``batch`` frames per pass). With ``out``, write the frames with their boxes, labels and
    (``fps_overlay``) the running FPS there, at the source's size and frame rate (``.mp4``,
    ``.mov``, ``.m4v``, ``.mkv``: MPEG-4; ``.avi``: Motion JPEG). ``on_frame(index,
    detections)`` is called for each frame in order (index from 0). ``progress``: a tqdm bar
    with the FPS on stderr. Raises ``ImageError`` naming an unreadable video or a failed
    write (the partial output removed), ``ArgumentError`` for an unusable ``out``.
    """
    info, frames = open_video(source)
    writer = _Writer(Path(out), info) if out is not None else None
    reader = _Prefetch(frames, depth=4 + 2 * batch)
    bar = None
    if progress:
        from tqdm import tqdm

        bar = tqdm(total=info.frames or None, desc=os.path.basename(info.path), unit="frame",
                   file=sys.stderr)
    classes = net.yolo_heads()[0].classes if net.yolo_layers else 0
    kept: deque[np.ndarray] = deque()

    def remembered() -> Iterator[np.ndarray]:
        for frame in reader:
            kept.append(frame)
            yield frame

    count = boxes = 0
    recent: deque[float] = deque(maxlen=30)
    began = time.perf_counter()
    stream = DetectionStream(net, remembered(), thresh=thresh, nms=nms, batch=batch)
    try:
        for detections in stream:
            frame = kept.popleft()
            now = time.perf_counter()
            recent.append(now)
            fps = (len(recent) - 1) / (recent[-1] - recent[0]) if len(recent) > 1 else 0.0
            if on_frame is not None:
                on_frame(count, detections)
            if writer is not None:
                writer.write(draw_frame(frame, detections, fps if fps_overlay else None,
                                        classes))
            count += 1
            boxes += len(detections)
            if bar is not None:
                bar.update(1)
                bar.set_postfix(fps=f"{fps:.1f}", refresh=False)
    except BaseException:
        stream.close()
        reader.close()
        if writer is not None:
            writer.abort()
        raise
    finally:
        if bar is not None:
            bar.close()
    reader.close()
    if writer is not None:
        writer.finish()
    seconds = time.perf_counter() - began
    return VideoReport(frames=count, boxes=boxes, seconds=seconds,
                       fps=count / seconds if seconds > 0 else 0.0)
