"""The repository's models loaded: for each served version, its network instances, warmed up
(one forward pass of zeros each), behind a ``DynamicBatcher``, and its ``VersionStats``."""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import numpy as np

from darknet_metal.errors import ArgumentError, DarknetMetalError, RepositoryError
from darknet_metal.network import Network
from darknet_metal.serving.batcher import DynamicBatcher
from darknet_metal.serving.metrics import ServingStats, VersionStats
from darknet_metal.serving.repository import (
    ModelSource,
    VersionFiles,
    complete_config,
    output_name,
)

__all__ = ["ServedModel", "ServedVersion", "load_models", "warm_up"]

#: Most images one request may carry to a model without batching (max_batch_size 0).
UNBATCHED_MAX_ROWS = 64


@dataclass
class ServedVersion:
    """One version being served: ``network`` is its first instance (the one whose shapes
    and heads requests are checked and decoded against), ``outputs`` every ``[yolo]``
    layer's tensor name -> layer index, in the order the batcher returns them."""

    version: int
    files: VersionFiles
    network: Network
    batcher: DynamicBatcher
    stats: VersionStats
    outputs: dict[str, int]


@dataclass
class ServedModel:
    """A model of the repository: its completed ``source`` and loaded ``versions``."""

    source: ModelSource
    versions: dict[int, ServedVersion]

    @property
    def name(self) -> str:
        return self.source.name

    @property
    def latest(self) -> ServedVersion:
        """The version requests without one go to: the highest."""
        return self.versions[max(self.versions)]

    @property
    def output_names(self) -> list[str]:
        """The outputs the config lists (all ``[yolo]`` layers unless it chose some)."""
        return [out.name for out in self.source.config.output]

    def close(self) -> None:
        """Finish what is queued, then stop the instances."""
        for version in self.versions.values():
            version.batcher.close()


def load_models(sources: list[ModelSource], device: str, stats: ServingStats,
                progress: Callable[[str], None] = lambda _: None) -> dict[str, ServedModel]:
    """Load every served version of ``sources`` on ``device`` (``instance_count`` networks
    each), completing each config from its latest version, and warm each network up with one
    forward pass before its version is returned (the time is in its ``VersionStats``).
    Raises ``RepositoryError``, ``CfgError`` or ``WeightsError`` naming the file (a failed
    warm-up is a ``RepositoryError`` naming the version folder); nothing stays loaded after
    an error."""
    models: dict[str, ServedModel] = {}
    try:
        for source in sources:
            versions: dict[int, ServedVersion] = {}
            models[source.name] = ServedModel(source, versions)
            for files in reversed(source.versions):  # the latest completes the config
                served = _load_version(source, files, device, stats)
                versions[files.version] = served
                progress(f"loaded {source.name} version {files.version} "
                         f"({files.cfg.name}, {source.instance_count} instance(s) on {device})")
                shape = "x".join(map(str, (1, *served.network.input_shape)))
                progress(f"model {source.name} version {files.version} warmed up in "
                         f"{served.stats.warmup.ns / 1e9:.3g} s (a {shape} pass of zeros "
                         f"per instance)")
    except BaseException:
        for model in models.values():
            model.close()
        raise
    return models


def _load_version(source: ModelSource, files: VersionFiles, device: str,
                  stats: ServingStats) -> ServedVersion:
    import darknet_metal

    precision = source.parameter("precision") or "fp32"
    networks = []
    for _ in range(source.instance_count):
        try:
            net = darknet_metal.load(files.cfg, files.weights, names=files.names, device=device,
                                     batch=max(1, source.max_batch_size), precision=precision)
        except ArgumentError as exc:
            raise RepositoryError(f"{exc} ({files.folder})", path=source.config_path,
                                  field="parameters[precision]") from exc
        except DarknetMetalError:
            raise
        networks.append(net)
        if len(networks) == 1:
            complete_config(source, net, files)
    first = networks[0]
    outputs = {output_name(i): i for i in first.yolo_layers}
    try:
        warmup_ns = warm_up(networks, list(outputs.values()))
    except Exception as exc:
        # A network that cannot run one pass would fail every request: refuse to serve it,
        # naming the version, rather than answer ready and then 500s.
        raise RepositoryError(f"the warm-up forward pass on {device} failed "
                              f"({type(exc).__name__}: {exc})", path=files.folder) from exc
    version_stats = stats.add(source.name, files.version, source.max_batch_size,
                              pending=lambda: batcher.pending)
    version_stats.record_warmup(len(networks), warmup_ns)
    batcher = DynamicBatcher(networks, list(outputs.values()),
                             max_batch_size=source.max_batch_size,
                             queue_delay_us=source.queue_delay_us,
                             preferred=source.preferred_batch_sizes,
                             on_batch=version_stats.record_batch,
                             name=f"{source.name}-{files.version}")
    return ServedVersion(version=files.version, files=files, network=first, batcher=batcher,
                         stats=version_stats, outputs=outputs)


def warm_up(networks: Sequence[Network], outputs: Sequence[int]) -> int:
    """Run one forward pass of zeros, one image at the input shape, on each of ``networks``
    (asking for ``outputs``, as the batcher does); the nanoseconds they took in all.

    A network's first pass builds its executor (folded weights, workspaces, and on a GPU its
    programs and buffers), several times the cost of the passes after it: run here, before
    the version is served, that cost is paid at load instead of by the first request."""
    started = time.monotonic_ns()
    for net in networks:
        net.forward(np.zeros((1, *net.input_shape), np.float32), outputs=list(outputs))
    return time.monotonic_ns() - started
