"""Profiling a whole network (what ``Network.profile`` runs): a forward pass, or a training step
on a trained copy, timed dispatch by dispatch (``runtime.profile``), with the input and the
targets made up when the caller gives none.

The network is seen through ``ProfiledNetwork``: what a profile reads of it and calls on it.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence
from contextlib import AbstractContextManager
from typing import Any, Protocol, cast

import numpy as np

from darknet_metal import arguments
from darknet_metal.model.cfg import NetConfig
from darknet_metal.runtime.backend import Backend
from darknet_metal.runtime.profile import (
    CLOCKS,
    DevicePeaks,
    DispatchTime,
    Profile,
    cpu_profile,
    device_peaks,
    profile_passes,
    split_host,
)

__all__ = ["ProfiledNetwork", "profile_network"]


class ProfiledLayer(Protocol):
    index: int
    kind: str
    flops: int
    out_shape: tuple[int, ...]


class ProfiledNetwork(Protocol):
    """What a profile needs of a network (``darknet_metal.Network``)."""

    device: str
    batch: int
    config: NetConfig

    @property
    def layers(self) -> Sequence[ProfiledLayer]: ...
    @property
    def input_shape(self) -> tuple[int, int, int]: ...
    @property
    def yolo_layers(self) -> list[int]: ...
    @property
    def executor(self) -> Backend: ...
    def inference_executor(self) -> Backend: ...
    def exclusive(self) -> AbstractContextManager[None]: ...
    def yolo_heads(self) -> list[Any]: ...
    def forward(self, x: np.ndarray, outputs: Sequence[int] | None = None) -> list[np.ndarray]:
        ...
    def train_step(self, x: np.ndarray, truths: Sequence[Any]) -> Any: ...
    def to(self, device: str) -> Any: ...


class TimedTraining(Protocol):
    """A backend that times its training steps (``CpuBackend``)."""

    def training_step_seconds(self) -> dict[tuple[int, str], float]: ...


def profile_network(net: ProfiledNetwork, twin: Callable[[], ProfiledNetwork],
                    x: np.ndarray | None = None, *, train: bool = False,
                    truths: Sequence[Any] | None = None, repeats: int = 3,
                    peaks: DevicePeaks | bool = True,
                    progress: Callable[[str], None] | None = None) -> Profile:
    """The profile ``Network.profile`` documents; ``twin()`` makes the copy of ``net`` (its
    cfg, layers and a copy of its parameters, on its device) that a training profile trains,
    so that ``net``'s own weights are left as they were."""
    repeats = arguments.positive_int("repeats", repeats)
    say = progress or (lambda line: None)
    c, h, w = net.input_shape
    rng = np.random.default_rng(0)
    if train:
        batch = int(net.config.net.values["batch"])
    else:
        batch = net.batch
    if x is None:
        x = rng.random((batch, c, h, w), dtype=np.float32)
    x = np.ascontiguousarray(x, np.float32)
    kinds = {op.index: op.kind for op in net.layers}
    size = f"{w}x{h} batch {x.shape[0]}"
    if net.device == "cpu" and train:
        if truths is None:
            truths = _synthetic_truths(net, x.shape[0], rng)
        return _cpu_training_profile(net, twin, x, truths, repeats, say)
    if net.device == "cpu":
        ms = _layer_milliseconds(net, x, repeats)
        return cpu_profile(f"inference {size}", ms, list(kinds.values()),
                           [x.shape[0] * op.flops for op in net.layers], repeats)
    if not train:
        say("a warm-up pass (programs, buffers, pipelines)")
        net.forward(x)
        with net.exclusive():
            executor = net.inference_executor()
            device = executor.device
            dispatches, copies, wall = profile_passes(
                device, lambda: executor.forward(x, outputs=[]), repeats, kinds,
                progress=say)
            host = split_host(device, executor.phases, lambda: net.forward(x),
                              max(repeats, 5), progress=say)
        what = f"inference {size}"
    else:
        if truths is None:
            truths = _synthetic_truths(net, x.shape[0], rng)
        trained = twin()
        try:
            say("a warm-up step (programs, buffers, pipelines)")
            trained.train_step(x, truths)
            with trained.exclusive():
                device = trained.executor.device
                dispatches, copies, wall = profile_passes(
                    device, lambda: trained.train_step(x, truths), repeats, kinds,
                    progress=say)
                host = split_host(device, trained.executor.phases,
                                  lambda: trained.train_step(x, truths), max(repeats, 5),
                                  progress=say)
        finally:
            trained.to("cpu")
        subdivisions = int(net.config.net.values["subdivisions"])
        what = f"training step {size} (subdivisions {subdivisions})"
    with net.exclusive():
        if peaks is True:
            say("the device's copy bandwidth and GEMM rate (once per device)")
            peaks = device_peaks(device)
    return Profile(what=what, device=net.device, device_name=str(device.name),
                   clock=CLOCKS[net.device], dispatches=dispatches, host_copies=copies,
                   wall_seconds=wall, peaks=peaks or None, repeats=repeats, host=host)


def _cpu_training_profile(net: ProfiledNetwork, twin: Callable[[], ProfiledNetwork],
                          x: np.ndarray, truths: Sequence[Any], repeats: int,
                          say: Callable[[str], None]) -> Profile:
    """A CPU training step's profile: per layer the wall time of its forward, backward and
    update steps (medians over ``repeats`` steps of a copy of ``net``), with the forward's
    floating-point operations, and the backward of a layer with parameters counted as its
    products twice (the parameters' gradient, and the input's where a layer below takes it)."""
    trained = twin()
    backend = cast(TimedTraining, trained.executor)
    say("a warm-up step")
    trained.train_step(x, truths)
    runs: list[dict[tuple[int, str], float]] = []
    walls: list[float] = []
    backend.training_step_seconds()
    for run in range(repeats):
        say(f"step {run + 1} of {repeats}")
        started = time.perf_counter()
        trained.train_step(x, truths)
        walls.append(time.perf_counter() - started)
        runs.append(backend.training_step_seconds())
    layers = {op.index: op for op in net.layers}
    first_delta = min((i for (i, phase) in runs[0] if phase == "backward"), default=0)
    dispatches = []
    for label in sorted(runs[0]):
        index, phase = label
        op = layers.get(index)
        kind = op.kind if op is not None else ""
        flops = 0
        if op is not None and phase == "forward":
            flops = x.shape[0] * op.flops
        elif op is not None and phase == "backward" and (index, "update") in runs[0]:
            # A layer with parameters: its products again for the parameters' gradient,
            # and again for its input's where a layer below takes one.
            flops = x.shape[0] * op.flops * (1 if index == first_delta else 2)
        dispatches.append(DispatchTime(
            kernel=f"cpu:{kind} {phase}", layer=index, kind=kind,
            seconds=float(np.median([r.get(label, 0.0) for r in runs])), flops=int(flops),
            bytes=0))
    subdivisions = int(net.config.net.values["subdivisions"])
    c, h, w = net.input_shape
    return Profile(what=f"training step {w}x{h} batch {x.shape[0]} (subdivisions "
                   f"{subdivisions})", device="cpu", device_name="CPU", clock=CLOCKS["cpu"],
                   dispatches=dispatches, wall_seconds=float(np.median(walls)),
                   repeats=repeats)


def _layer_milliseconds(net: ProfiledNetwork, x: np.ndarray, repeats: int) -> list[float]:
    """Median wall time in milliseconds of each layer over ``repeats`` forward passes."""
    net.forward(x)  # warm up buffers and caches
    runs: list[list[float]] = []
    with net.exclusive():
        for _ in range(max(1, repeats)):
            times: list[float] = []
            net.inference_executor().forward(np.asarray(x), timings=times)
            runs.append(times)
    return [1e3 * float(t) for t in np.median(np.array(runs), axis=0)]


def _synthetic_truths(net: ProfiledNetwork, batch: int, rng: np.random.Generator) -> list[Any]:
    """Three boxes per image for a detector, a class id per image for a classifier."""
    if not net.yolo_layers:
        classes = int(np.prod(net.layers[-1].out_shape))
        return [int(rng.integers(classes)) for _ in range(batch)]
    classes = net.yolo_heads()[0].classes
    out = []
    for _ in range(batch):
        boxes = np.empty((3, 5), np.float32)
        boxes[:, 0] = rng.integers(classes, size=3)
        boxes[:, 1:3] = rng.uniform(0.2, 0.8, (3, 2))
        boxes[:, 3:5] = rng.uniform(0.05, 0.4, (3, 2))
        out.append(boxes)
    return out
