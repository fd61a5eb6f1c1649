"""A training run as ``darknet detector train`` runs one: iterations up to ``max_batches``,
the average loss, evaluations, checkpoints, logs and the chart.

``TrainingRun`` owns the loop and Darknet's schedule (``Schedule``): when to evaluate mAP,
when to write ``_last`` (a checkpoint pair that resumes exactly), ``_<N>``, ``_best`` and
``_final``; what feeds it is a ``BatchSource`` (the data loader) and, with ``--map``, an
evaluation callable. Ctrl-C (KeyboardInterrupt) writes ``_last`` before the run ends.
"""

from __future__ import annotations

import math
import os
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any, Protocol, TextIO

import numpy as np

from darknet_metal.errors import ArgumentError
from darknet_metal.training.checkpoint import (
    Checkpoint,
    find_checkpoint,
    restore_training_state,
    save_checkpoint,
)
from darknet_metal.training.progress import IterationRecord, LossChart

if TYPE_CHECKING:
    from darknet_metal.network import Network
    from darknet_metal.training.distributed import Collective


class BatchSource(Protocol):
    """What feeds a run: ``batch(iteration, width, height)`` returns the images (batch, C,
    height, width) float32 and the truths of ``iteration`` (1-based) at that input size;
    ``wait_seconds`` accumulates the time callers spent waiting for data."""

    wait_seconds: float

    def batch(self, iteration: int, width: int, height: int
              ) -> tuple[np.ndarray, list[np.ndarray]]: ...


@dataclass(frozen=True)
class Schedule:
    """Darknet's timetable of a run (``train_detector``): mAP every ``map_every`` iterations
    but not before ``burn_in``; ``_last`` every 100 iterations; ``_<N>`` every
    ``save_every`` (1,000 when ``max_batches`` <= 10,000, else 10,000)."""

    max_batches: int
    burn_in: int
    map_every: int
    save_every: int

    @classmethod
    def darknet(cls, max_batches: int, burn_in: int, train_images: int, batch: int,
                map_every: int | None = None, save_every: int | None = None) -> Schedule:
        """The schedule Darknet derives: an evaluation per epoch (at least every 100
        iterations) unless ``map_every`` is given."""
        return cls(max_batches, burn_in,
                   map_every or max(100, train_images // max(batch, 1)),
                   save_every or (1000 if max_batches <= 10000 else 10000))

    def next_map(self, last_map_iteration: int) -> int:
        return max(self.burn_in, last_map_iteration + self.map_every)


@dataclass
class RunState:
    """What a run carries from iteration to iteration (and across a resume, in the
    checkpoint's ``info``)."""

    avg_loss: float | None = None
    last_map: float | None = None
    best_map: float | None = None
    best_iteration: int | None = None
    map_iteration: int = 0
    save_iteration: int = 0
    last_iteration: int = 0
    losses: list[tuple[int, float]] = field(default_factory=list)
    maps: list[tuple[int, float]] = field(default_factory=list)

    def to_info(self) -> dict[str, Any]:
        return {k: v for k, v in self.__dict__.items()}

    @classmethod
    def from_info(cls, info: dict[str, Any]) -> RunState:
        known = {k: v for k, v in info.items() if k in cls.__dataclass_fields__}
        state = cls(**known)
        state.losses = [tuple(p) for p in state.losses]  # type: ignore[misc]
        state.maps = [tuple(p) for p in state.maps]  # type: ignore[misc]
        return state


@dataclass
class RunResult:
    """How a run ended: ``iteration`` reached, ``interrupted`` (Ctrl-C), the files written,
    the last and best mAP, and the share of time spent waiting for data."""

    iteration: int
    interrupted: bool
    final_weights: Path | None
    last_map: float | None
    best_map: float | None
    wait_share: float


class TrainingRun:
    """Trains ``net`` from ``source`` until ``schedule.max_batches``, writing into ``backup``
    the files Darknet writes (``<base>_last.weights`` with its ``.state``, ``<base>_<N>``,
    ``<base>_best`` with ``evaluate``, ``<base>_final``), ``<base>.log`` (Darknet's line per
    iteration), ``<base>.jsonl`` (``IterationRecord.to_json``) and ``chart_<base>.png``.

    ``evaluate(net) -> float``: mAP@0.50 in [0, 1] on the validation set (None: no
    evaluations). ``sizes(iteration, started) -> (width, height) | None``: ``random=1``'s new
    input size for the iteration about to run, or None to keep the current one.
    ``progress``: a tqdm bar on ``stream``; ``chart``: draw the chart (matplotlib).
    ``collective``: this process's rank when several train together
    (``training.distributed``): each iteration's gradients are summed over the ranks and
    only rank 0 writes files and shows progress.
    """

    def __init__(self, net: Network, source: BatchSource, schedule: Schedule, *,
                 backup: str | os.PathLike[str], base: str,
                 evaluate: Callable[[Network], float] | None = None,
                 sizes: Callable[[int, bool], tuple[int, int] | None] | None = None,
                 progress: bool = True, chart: bool = True, stream: TextIO | None = None,
                 collective: Collective | None = None) -> None:
        if schedule.max_batches < 1:
            raise ArgumentError(f"max_batches must be at least 1, not {schedule.max_batches}")
        self.net = net
        self.source = source
        self.schedule = schedule
        self.backup = Path(backup)
        self.base = base
        self.evaluate = evaluate
        self.sizes = sizes
        self.progress = progress
        self.stream = stream
        self.collective = collective
        #: Whether this process writes the run's files (every process but ranks 1..K-1).
        self.writes = collective is None or collective.writes
        self.state = RunState()
        self.init_size = (int(net.config.net.values["width"]),
                          int(net.config.net.values["height"]))
        self.chart = LossChart(self.backup / f"chart_{base}.png", schedule.max_batches,
                               base) if chart else None

    # -- files ------------------------------------------------------------------------------

    def path(self, suffix: str) -> Path:
        """``backup/<base>_<suffix>.weights``."""
        return self.backup / f"{self.base}_{suffix}.weights"

    def resume(self) -> bool:
        """Continue from ``<base>_last`` when a whole checkpoint pair is there (training
        state and run record included); returns whether it did."""
        found = find_checkpoint(self.path("last"))
        if found is None:
            return False
        self.resume_from(found)
        return True

    def resume_from(self, found: Checkpoint) -> None:
        """Continue from the checkpoint ``found``: its weights, training state, run record
        (average loss, evaluations, counters, chart) and input size."""
        from darknet_metal.model.weights import read_weights

        header, params = read_weights(found.weights, self.net.layers)
        for index, layer in params.items():
            for name, array in layer.items():
                np.copyto(self.net.params[index][name], array)
        self.net.header.seen = header.seen
        self.net.params_changed()
        restore_training_state(self.net, found)
        self.state = RunState.from_info(found.info.get("run", {}))
        size = found.info.get("size")
        if size and tuple(size) != self.current_size:
            self.net.resize(*size)
        if self.chart is not None:
            for i, loss in self.state.losses:
                self.chart.add(i, loss)
            for i, value in self.state.maps:
                self.chart.add_map(i, value)

    @property
    def current_size(self) -> tuple[int, int]:
        values = self.net.config.net.values
        return int(values["width"]), int(values["height"])

    def _save_last(self) -> None:
        if not self.writes:
            return
        save_checkpoint(self.net, self.path("last"),
                        {"run": self.state.to_info(), "size": list(self.current_size)})

    # -- the loop ---------------------------------------------------------------------------

    def run(self) -> RunResult:
        """Iterations until ``max_batches`` (or Ctrl-C, which writes ``_last`` first)."""
        if self.writes:
            self.backup.mkdir(parents=True, exist_ok=True)
            # What a write killed midway (a rank ended by mpirun, a killed process) left
            # beside its file: never a file of the run, so it goes.
            for stale in self.backup.glob(f".{self.base}_*.tmp"):
                stale.unlink(missing_ok=True)
        schedule, state = self.schedule, self.state
        start_iteration = self.net.iteration
        if start_iteration >= schedule.max_batches:
            raise ArgumentError(
                f"the weights have already trained {start_iteration} iterations, max_batches "
                f"is {schedule.max_batches}: raise max_batches, or clear the counters "
                "(--clear) to train again from iteration 0")
        if not self.state.losses:  # not resumed: Darknet's counters start here
            state.map_iteration = state.save_iteration = state.last_iteration = start_iteration
        bar = self._bar(start_iteration)
        started = time.monotonic()
        #: When the iteration before the next one ended (its evaluation and files included).
        self._last_end = started
        wait_before = self.source.wait_seconds
        interrupted = False
        logs = [open(self.backup / f"{self.base}.{kind}", "a", encoding="utf-8")
                for kind in ("log", "jsonl")] if self.writes else []
        try:
            while self.net.iteration < schedule.max_batches:
                record = self._iteration(start_iteration, started)
                for file, line in zip(logs, (record.darknet_line(), record.to_json()),
                                      strict=False):
                    file.write(line + "\n")
                    file.flush()
                if bar is not None:
                    bar.set_postfix_str(
                        f"loss={record.loss:.3f} avg={record.avg_loss:.3f} "
                        f"rate={record.rate:.2g} {record.images_per_second or 0:.1f} img/s",
                        refresh=False)
                    bar.update(1)
                self._after(record.iteration)
                self._last_end = time.monotonic()
        except KeyboardInterrupt:
            interrupted = True
        finally:
            for file in logs:
                file.close()
            if bar is not None:
                bar.close()
        final = None
        if interrupted:
            self._save_last()
        elif self.writes:
            final = self.path("final")
            self.net.save_weights(final)
            self._save_last()
        if self.chart is not None:
            self.chart.save(force=True)
        elapsed = time.monotonic() - started
        waited = self.source.wait_seconds - wait_before
        return RunResult(self.net.iteration, interrupted, final, state.last_map,
                         state.best_map, waited / elapsed if elapsed > 0 else 0.0)

    def _bar(self, start: int) -> Any:
        if not self.progress or not self.writes:
            return None
        from tqdm import tqdm

        return tqdm(total=self.schedule.max_batches, initial=start, unit="it",
                    desc=self.base, file=self.stream, dynamic_ncols=True)

    def _iteration(self, start_iteration: int, started: float) -> IterationRecord:
        net, state, schedule = self.net, self.state, self.schedule
        iteration = net.iteration + 1
        if self.sizes is not None:
            size = self.sizes(iteration, state.avg_loss is not None)
            if size is not None and size != self.current_size:
                net.resize(*size)
        width, height = self.current_size
        t0 = time.monotonic()
        x, truths = self.source.batch(iteration, width, height)
        t1 = time.monotonic()
        collective = self.collective
        report = (net.train_step(x, truths) if collective is None
                  else collective.step(net, x, truths, average_statistics=False))
        t2 = time.monotonic()
        batch = int(x.shape[0]) * (1 if collective is None else collective.size)
        reduced = None if collective is None else collective.last_reduce
        loss = float(report.loss)
        if state.avg_loss is None or not math.isfinite(state.avg_loss):
            state.avg_loss = loss
        state.avg_loss = 0.9 * state.avg_loss + 0.1 * loss
        state.losses.append((report.iteration, state.avg_loss))
        if self.chart is not None:
            self.chart.add(report.iteration, state.avg_loss)
            self.chart.save()
        done = report.iteration - start_iteration
        rate = done / max(t2 - started, 1e-9)
        remaining = (schedule.max_batches - report.iteration) / rate if rate > 0 else None
        return IterationRecord(
            iteration=report.iteration, max_batches=schedule.max_batches, loss=loss,
            avg_loss=state.avg_loss, rate=report.learning_rate,
            batch=batch, load_seconds=t1 - t0,
            train_seconds=t2 - t1, images=net.header.seen, remaining_seconds=remaining,
            width=width, height=height, last_map=state.last_map, best_map=state.best_map,
            next_map=schedule.next_map(state.map_iteration) if self.evaluate else None,
            heads={h.layer: dict(h.values) for h in report.heads},
            images_per_second=batch / max(t2 - self._last_end, 1e-9),
            allreduce_bytes=None if reduced is None else reduced.nbytes,
            allreduce_seconds=None if reduced is None else reduced.seconds)

    def _evaluation_due(self, iteration: int) -> bool:
        return self.evaluate is not None and (
            iteration >= self.schedule.next_map(self.state.map_iteration)
            or iteration == self.schedule.max_batches)

    def _weights_due(self, iteration: int) -> bool:
        return (iteration >= self.state.save_iteration + self.schedule.save_every
                or iteration % self.schedule.save_every == 0)

    def _last_due(self, iteration: int) -> bool:
        return (iteration >= self.state.last_iteration + 100
                or (iteration % 100 == 0 and iteration > 1))

    def _after(self, iteration: int) -> None:
        """Darknet's end of an iteration: the evaluation, then the weights files. Across
        processes the rolling statistics are averaged over the ranks first when rank 0 is
        about to read them (an evaluation, a file): averaging the ranks' moving averages only
        then gives what averaging them every iteration gives, without taking the parameters
        off the device every iteration."""
        schedule, state = self.schedule, self.state
        if self.collective is not None and self.collective.from_rank_0(
                self._evaluation_due(iteration) or self._weights_due(iteration)
                or self._last_due(iteration) or iteration >= schedule.max_batches):
            self.collective.average_statistics(self.net)
        if self._evaluation_due(iteration):
            size = self.current_size
            if size != self.init_size:
                self.net.resize(*self.init_size)
            value = float(self.evaluate(self.net))
            state.map_iteration = iteration
            state.last_map = value
            state.maps.append((iteration, value))
            if self.chart is not None:
                self.chart.add_map(iteration, value)
                self.chart.save(force=True)
            if state.best_map is None or value >= state.best_map:
                state.best_map, state.best_iteration = value, iteration
                self.net.save_weights(self.path("best"))
        if self._weights_due(iteration):
            state.save_iteration = iteration
            if self.writes:
                self.net.save_weights(self.path(str(iteration)))
        if self._last_due(iteration):
            state.last_iteration = iteration
            self._save_last()
