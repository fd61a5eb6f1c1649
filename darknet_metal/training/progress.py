"""What a training run tells its user: Darknet's line per iteration, a JSON-lines record of
every iteration, and the loss (and mAP) chart.

``IterationRecord`` is the one record; ``darknet_line`` formats it as Darknet V5 prints it
(``5989: loss=0.444, avg loss=0.329, last=none, best=none, mAP=DISABLED, rate=0.00002600, ...``)
and ``to_json`` gives the JSON-lines schema documented in the README ("Training from the
command line").
"""

from __future__ import annotations

import io
import json
import math
import os
import time
from dataclasses import asdict, dataclass, field
from typing import Any

from darknet_metal.files import atomic_write

#: Version of the JSON-lines schema (``schema`` in every record).
JSONL_SCHEMA = 1


@dataclass
class IterationRecord:
    """One iteration of a run. ``loss``: what ``train_step`` returned; ``avg_loss``: Darknet's
    ``0.9 * avg + 0.1 * loss`` (the first iteration's loss to start); ``last_map``,
    ``best_map``: mAP@0.50 in [0, 1] of the last evaluation and the best one (None before
    the first); ``next_map``: the iteration of the next evaluation (None without ``--map``);
    ``rate``: the learning rate the update used; ``batch``: images per iteration;
    ``load_seconds``: the wait for the batch; ``train_seconds``: the step; ``images``: images
    trained on so far (``seen``); ``remaining_seconds``:
    the estimate to ``max_batches``; ``width``, ``height``: the input size of the step;
    ``heads``: per ``[yolo]`` layer its statistics (``StepReport.heads``);
    ``images_per_second``: the batch over the iteration's wall time (from the end of the one
    before: loading, the step, the logs, checkpoints and evaluations included);
    ``allreduce_bytes``, ``allreduce_seconds``: across processes, the gradient bytes each
    rank sent into the sum and the time the sum took (None in one process)."""

    iteration: int
    max_batches: int
    loss: float
    avg_loss: float
    rate: float
    batch: int
    load_seconds: float
    train_seconds: float
    images: int
    remaining_seconds: float | None
    width: int
    height: int
    last_map: float | None = None
    best_map: float | None = None
    next_map: int | None = None
    heads: dict[int, dict[str, float]] = field(default_factory=dict)
    images_per_second: float | None = None
    allreduce_bytes: int | None = None
    allreduce_seconds: float | None = None

    def to_json(self) -> str:
        """One line of the JSON-lines log: every field, ``schema`` and ``time`` (Unix
        seconds, to the microsecond: the gap between two lines times an iteration) added;
        non-finite losses as null."""
        record: dict[str, Any] = {"schema": JSONL_SCHEMA, "time": round(time.time(), 6),
                                  **asdict(self)}
        record["heads"] = {str(k): v for k, v in self.heads.items()}
        return json.dumps(_finite(record), allow_nan=False)

    def darknet_line(self) -> str:
        """The line Darknet V5 prints after each iteration (without its colours), and the
        images per second when known."""
        return (f"{self.iteration}: loss={self.loss:.3f}, avg loss={self.avg_loss:.3f}, "
                f"last={format_map(self.last_map)}, best={format_map(self.best_map)}, "
                f"mAP={'DISABLED' if self.next_map is None else self.next_map}, "
                f"rate={self.rate:.8f}, load {self.batch}="
                f"{format_duration(self.load_seconds)}, train="
                f"{format_duration(self.train_seconds)}, {self.images} images, "
                f"time remaining={format_duration(self.remaining_seconds, trim=True)}"
                + ("" if self.images_per_second is None
                   else f", {self.images_per_second:.1f} img/s")
                + ("" if self.allreduce_bytes is None or self.allreduce_seconds is None
                   else f", all-reduce {self.allreduce_bytes / 1e6:.1f} MB in "
                        f"{format_duration(self.allreduce_seconds)}"))


def _finite(value: Any) -> Any:
    if isinstance(value, float):
        return value if math.isfinite(value) else None
    if isinstance(value, dict):
        return {k: _finite(v) for k, v in value.items()}
    if isinstance(value, list):
        return [_finite(v) for v in value]
    return value


def format_map(value: float | None) -> str:
    """mAP as Darknet prints it: ``none`` before the first evaluation, else a percentage with
    two decimals."""
    return "none" if value is None else f"{100.0 * value:.2f}%"


def format_duration(seconds: float | None, decimals: int = 1, trim: bool = False) -> str:
    """A duration in Darknet's words: milliseconds below a second, seconds up to two minutes,
    then minutes, hours (to two days), days (to a week), weeks; ``unknown`` when not known.
    ``trim``: a whole number loses its zero decimals ("12 minutes", as Darknet's remaining
    time)."""
    if seconds is None or not math.isfinite(seconds) or seconds <= 0:
        return "unknown"
    value, unit = seconds / 604800.0, "weeks"
    for limit, name, scale in ((1.0, "milliseconds", 1e-3), (120.0, "seconds", 1.0),
                               (7200.0, "minutes", 60.0), (172800.0, "hours", 3600.0),
                               (604800.0, "days", 86400.0)):
        if seconds < limit or (name != "milliseconds" and seconds <= limit):
            value, unit = seconds / scale, name
            break
    text = f"{value:.{decimals}f}"
    if trim and decimals and text.endswith("." + "0" * decimals):
        text = text[:-decimals - 1]
    return f"{text} {unit}"


class LossChart:
    """The chart Darknet draws while training: average loss per iteration (and mAP@0.50 at
    each evaluation, on a second axis), saved as a PNG at most every ``every_seconds`` and
    whenever ``save(force=True)`` is called (evaluations, the end). Needs matplotlib (the
    ``train`` extra); drawn off-screen."""

    def __init__(self, path: str | os.PathLike[str], max_batches: int, title: str,
                 every_seconds: float = 10.0) -> None:
        import matplotlib

        matplotlib.use("Agg", force=False)
        self.path = os.fspath(path)
        self.max_batches = max_batches
        self.title = title
        self.every_seconds = every_seconds
        self.iterations: list[int] = []
        self.losses: list[float] = []
        self.maps: list[tuple[int, float]] = []
        self._saved_at = -math.inf

    def add(self, iteration: int, avg_loss: float) -> None:
        self.iterations.append(iteration)
        self.losses.append(avg_loss)

    def add_map(self, iteration: int, value: float) -> None:
        self.maps.append((iteration, value))

    def save(self, force: bool = False) -> bool:
        """Draw and write the PNG (atomically) if ``force`` or the interval has passed;
        returns whether it did."""
        now = time.monotonic()
        if not force and now - self._saved_at < self.every_seconds:
            return False
        from matplotlib.figure import Figure

        fig = Figure(figsize=(8, 6), dpi=100)
        ax = fig.add_subplot()
        ax.plot(self.iterations, self.losses, color="tab:blue", linewidth=1, label="avg loss")
        ax.set_xlim(0, self.max_batches)
        finite = [v for v in self.losses if math.isfinite(v)]
        if finite:
            ax.set_ylim(0, max(1e-6, 1.1 * max(finite[len(finite) // 10:] or finite)))
        ax.set_xlabel("iteration")
        ax.set_ylabel("average loss")
        ax.grid(True, alpha=0.3)
        ax.set_title(self.title)
        if self.maps:
            right = ax.twinx()
            xs, ys = zip(*self.maps, strict=True)
            right.plot(xs, [100 * y for y in ys], "o-", color="tab:red", label="mAP@0.50")
            right.set_ylim(0, 100)
            right.set_ylabel("mAP@0.50 (%)")
            right.annotate(f"{100 * ys[-1]:.1f}%", (xs[-1], 100 * ys[-1]),
                           textcoords="offset points", xytext=(4, 4), color="tab:red")
        buffer = io.BytesIO()
        fig.savefig(buffer, format="png")
        atomic_write(self.path, lambda f: f.write(buffer.getvalue()))
        self._saved_at = now
        return True
