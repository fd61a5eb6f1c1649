"""What ``darknet-metal train`` puts together: the dataset (read and checked), the network
(loaded from whole weights, a backbone or a checkpoint), the loader, the evaluation and the
``TrainingRun``.
"""

from __future__ import annotations

import argparse
import os
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from darknet_metal.errors import ArgumentError, DatasetError
from darknet_metal.trainer.schedule import slow_start
from darknet_metal.trainer.trainer import Trainer
from darknet_metal.training.checkpoint import Checkpoint, find_checkpoint
from darknet_metal.training.distributed import Collective
from darknet_metal.training.session import RunResult, Schedule, TrainingRun


class LoaderSource:
    """``BatchSource`` over a ``darknet_metal.training.loading.Loader``: the batch of an iteration
    at the size asked for (the loader restarts what it prepared at another size)."""

    def __init__(self, loader: Any) -> None:
        self.loader = loader

    @property
    def wait_seconds(self) -> float:
        return float(self.loader.wait_seconds)

    def batch(self, iteration: int, width: int, height: int
              ) -> tuple[np.ndarray, list[np.ndarray]]:
        self.loader.set_size(width, height)
        if self.loader.iteration != iteration - 1:
            raise ArgumentError(f"the loader is at iteration {self.loader.iteration + 1}, "
                                f"the run at {iteration}")
        batch = self.loader.next()
        return batch.x, batch.truths


@dataclass
class TrainingSetup:
    """A run ready to start: ``dataset``, ``net``, ``loader``, ``run_`` (the
    ``TrainingRun``), where the parameters came from (``started_from``), and why the
    loader uses threads where processes would be faster (``loader_note``)."""

    dataset: Any
    net: Any
    loader: Any
    run_: TrainingRun
    started_from: list[str]
    loader_note: str | None = None

    @classmethod
    def from_args(cls, args: argparse.Namespace) -> TrainingSetup:
        return cls.create(args.data, args.cfg, args.weights, device=args.device,
                          seed=args.seed, evaluate=bool(args.map or args.map_every),
                          map_every=args.map_every, clear=args.clear, backup=args.backup,
                          workers=args.workers, chart=not args.no_chart,
                          collective=getattr(args, "collective", None))

    @classmethod
    def create(cls, data: str | os.PathLike[str], cfg: str | os.PathLike[str],
               weights: str | os.PathLike[str] | None = None, *, device: str = "cpu",
               seed: int = 0, evaluate: bool = False, map_every: int | None = None,
               clear: bool = False, backup: str | os.PathLike[str] | None = None,
               workers: int | None = None, chart: bool = True,
               collective: Collective | None = None) -> TrainingSetup:
        """Read and check the dataset (``DatasetError`` with ``check-data``'s first message
        when it has errors), load the network, make the loader and the run.

        ``workers``: the loader's workers (None: ``default_workers(device)``): processes
        on a GPU device (``cuda``, ``metal``), threads on ``cpu`` and ``emu``, whose steps
        use the host's cores.
        ``collective``: this process's rank among the processes training together
        (``training.distributed``): the network is loaded with ``K x`` the cfg's batch and
        subdivisions, the loader loads this rank's rows of each batch, every rank starts
        from rank 0's parameters, and only rank 0 evaluates and writes."""
        import darknet_metal as dm
        from darknet_metal.datasets import check_dataset, load_dataset
        from darknet_metal.training.loading import Loader, random_size, settings_from_cfg
        from darknet_metal.training.loading.processes import spawn_blocker

        dataset = load_dataset(data)
        report = check_dataset(dataset, progress=False)
        if not report.ok:
            errors = report.errors
            raise DatasetError(
                f"{len(errors)} error(s) in the dataset (`darknet-metal check-data {data}` "
                f"lists every problem); the first: {errors[0]}", path=data)
        if not dataset.train:
            raise DatasetError(f"{dataset.path}: the training set is empty")
        checkpoint: Checkpoint | None = None
        started_from: list[str] = []
        if weights is not None:
            found = find_checkpoint(weights)
            if found is not None and not clear:
                checkpoint = found
                weights = found.weights
        rows, sizes_override = None, {}
        if collective is not None:
            from darknet_metal.model.cfg import parse_cfg

            values = parse_cfg(cfg).net.values
            rows, batch, subdivisions = collective.share(int(values["batch"]),
                                                         int(values["subdivisions"]))
            sizes_override = {"batch": batch, "subdivisions": subdivisions}
        net = dm.load(cfg, weights, names=dataset.names, device=device, seed=seed,
                      partial=weights is not None, **sizes_override)
        heads = [net.layers[i].values["classes"] for i in net.yolo_layers]
        if not heads:
            raise ArgumentError(f"{cfg}: the network has no [yolo] layer to train a detector")
        if any(c != dataset.classes for c in heads):
            raise ArgumentError(f"{cfg}: the [yolo] layers detect {heads[0]} classes, the "
                                f"dataset {dataset.path} has {dataset.classes}")
        if weights is None:
            started_from.append(f"parameters initialised as Darknet does (seed {seed})")
        elif net.weights_coverage is not None:
            started_from.append(net.weights_coverage.describe())
        else:
            started_from.append(f"{weights}: every layer's parameters, iteration "
                                f"{net.iteration}")
        if clear:
            net.header.seen = 0
        values = net.config.net.values
        base = Path(cfg).stem
        folder = Path(backup) if backup is not None else (dataset.backup or Path("backup"))
        batch = int(values["batch"])
        schedule = Schedule.darknet(int(values["max_batches"]), int(values["burn_in"]),
                                    len(dataset.train), batch, map_every=map_every)
        settings = settings_from_cfg(net.config, classes=dataset.classes)
        start = net.iteration
        writes = collective is None or collective.writes
        evaluation = _evaluation(dataset) if evaluate and writes else None
        sizes = None
        if settings.random:
            def sizes(iteration: int, started: bool) -> tuple[int, int] | None:
                # ``start`` is read when called: a resumed run counts from its iteration.
                return random_size(iteration - 1, settings, schedule.max_batches, seed,
                                   start_iteration=start)

        run_ = TrainingRun(net, LoaderSource(None), schedule, backup=folder, base=base,
                           evaluate=evaluation, sizes=sizes, chart=chart and writes,
                           collective=collective)
        if checkpoint is not None:
            run_.resume_from(checkpoint)
            started_from.append(f"training state of {checkpoint.state} (iteration "
                                f"{checkpoint.iteration}): the run continues exactly")
            start = net.iteration
        if collective is not None:
            # Compared before rank 0's are sent: a rank that read other weights or another
            # checkpoint than rank 0 is an error, not something to paper over.
            collective.check_same_parameters(net, net.iteration)
            collective.broadcast_parameters(net)
            start = net.iteration
            started_from.append(
                f"{collective.size} ranks, each on {len(rows)} of the "
                f"{net.config.net.values['batch']} images of an iteration "
                f"(batch {net.config.net.values['batch']}, subdivisions "
                f"{net.config.net.values['subdivisions']} in all)")
        # The workers write each batch where the trainer's device reads it.
        processes = loader_processes(net.device)
        loader_note = None
        if processes and (blocker := spawn_blocker()) is not None:
            processes = False
            loader_note = (f"the loader uses threads: {blocker}; put the training under "
                           "that guard for loader processes (faster on a GPU)")
        workers = default_workers(collective, processes) if workers is None else workers
        loader = Loader(dataset.train, settings, boxes=dataset.read_boxes, seed=seed,
                        workers=workers, processes=processes, start_iteration=start,
                        slots=rows, allocate=Trainer.of(net).batch_array)
        run_.source = LoaderSource(loader)
        return cls(dataset, net, loader, run_, started_from, loader_note)

    def device_description(self) -> str:
        """The device this process trains on, in words: the CPU, or the GPU's name (on
        ``cuda`` with its number: under mpirun each rank of a machine takes the GPU of its
        rank on that machine, unless DARKNET_METAL_CUDA_DEVICE says otherwise)."""
        if self.net.device == "cpu":
            return "device cpu"
        from darknet_metal import metal

        return f"device {self.net.device}, {metal.device_name(self.net.device)}"

    def describe(self) -> list[str]:
        """Lines saying what will run (for the command's stderr)."""
        s = self.run_.schedule
        return [*self.started_from,
                f"training {self.run_.base} on {len(self.dataset.train)} images of "
                f"{self.dataset.path}, iterations {self.net.iteration + 1}..{s.max_batches}, "
                f"device {self.net.device}; writing into {self.run_.backup}",
                f"mAP every {s.map_every} iterations from {s.burn_in}"
                if self.run_.evaluate else "no mAP evaluation (--map to evaluate)"]

    def projection(self) -> str:
        """How long the run will take, said before its first iteration: a training step of
        PROJECTION_IMAGES images timed on a throwaway copy of the network (random weights,
        the same cfg and device), scaled to the batch and to the iterations left. A model,
        not a measurement: a GPU does a large batch in less than that scaling says."""
        import time

        import darknet_metal as dm

        values = self.net.config.net.values
        batch = int(values["batch"])
        images = min(PROJECTION_IMAGES, batch)
        width, height = int(values["width"]), int(values["height"])
        probe = dm.load(self.net.config.path, device=self.net.device, batch=images,
                        subdivisions=1, seed=0, input_size=(width, height))
        x = np.full((images, 3, height, width), 0.5, np.float32)
        truths = [np.array([[0, 0.5, 0.5, 0.25, 0.25]], np.float32)] * images
        probe.train_step(x, truths)  # the first step builds and allocates: not timed
        start = time.perf_counter()
        probe.train_step(x, truths)
        per_image = (time.perf_counter() - start) / images
        probe.to("cpu")
        s = self.run_.schedule
        left = max(0, s.max_batches - self.net.iteration)
        iteration = per_image * batch
        said = (f"projected: about {_duration(iteration)} an iteration, "
                f"{_duration(iteration * left)} for the {left} iterations left on "
                f"{self.net.device} (a step of {images} "
                f"image(s) at {width}x{height} timed, times {batch}/{images}; the log's time "
                "remaining then follows the run)")
        if self.net.device == "cpu" and iteration * left > 3600:
            said += ("; on a Mac, --device metal runs the same training on its GPU, "
                     "and a smaller --size, --batch or --max-batches shortens it")
        return said

    def warnings(self) -> list[str]:
        """What the command should say before it starts: a learning rate that stays too low
        for most of the run (``schedule.slow_start``), a loader that had to use threads."""
        slow = slow_start(self.net.config.net.values, self.net.iteration + 1,
                          self.run_.schedule.max_batches)
        return [note for note in (slow, self.loader_note) if note is not None]

    def run(self, progress: bool = True) -> RunResult:
        """Train to max_batches (or Ctrl-C); the loader is closed in every case."""
        self.run_.progress = progress
        with self.loader:
            return self.run_.run()


#: Images of the training step ``TrainingSetup.projection`` times.
PROJECTION_IMAGES = 2


def _duration(seconds: float) -> str:
    """``seconds`` as a person reads it: 850 ms, 37 s, 12 minutes, 3.4 hours, 2.6 days."""
    if seconds < 1:
        return f"{1e3 * seconds:.0f} ms"
    if seconds < 120:
        return f"{seconds:.0f} s"
    if seconds < 7200:
        return f"{seconds / 60:.0f} minutes"
    if seconds < 2 * 86400:
        return f"{seconds / 3600:.1f} hours"
    return f"{seconds / 86400:.1f} days"


#: The most loader threads by default: they share one interpreter, and past 8 they deliver
#: less, not more (a 16-core H200 machine: 623 images/s with 8 threads, 512 with 16).
MAX_DEFAULT_THREADS = 8


def loader_processes(device: str) -> bool:
    """Whether the loader's workers are processes on ``device``: on a GPU, whose step leaves
    the host's cores to the loader; not on ``cpu`` and ``emu``, whose steps use them (and
    run without the GIL while threads wait)."""
    return device in ("cuda", "metal")


def default_workers(collective: Collective | None = None, processes: bool = False) -> int:
    """The loader's workers by default, from the CPUs this process may use (shared among the
    ranks of one machine when training across processes): processes, one per CPU but one
    (the trainer's own); threads, one per CPU up to MAX_DEFAULT_THREADS. At least 2."""
    try:
        cpus = len(os.sched_getaffinity(0))
    except (AttributeError, OSError):
        cpus = os.cpu_count() or 2
    ranks = 1 if collective is None else max(1, collective.local_size)
    share = cpus // ranks
    return max(2, share - 1 if processes else min(MAX_DEFAULT_THREADS, share))


def _evaluation(dataset: Any) -> Callable[[Any], float]:
    """mAP@0.50 of a network on ``dataset``'s valid set, as Darknet's training evaluates it
    (its ``points`` key; no COCO figures)."""
    from darknet_metal.evaluation import evaluate_dataset

    if not dataset.valid:
        raise DatasetError(f"{dataset.path}: --map needs a valid set")
    points = int(dataset.options.get("points", 0) or 0)

    def evaluation(net: Any) -> float:
        return evaluate_dataset(net, dataset, points=points, progress=False, coco=False).map

    return evaluation
