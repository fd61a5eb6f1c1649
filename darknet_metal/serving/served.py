"""The repository's models loaded: for each served version, its network instances behind a
``DynamicBatcher`` and its ``VersionStats``."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

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

__all__ = ["ServedModel", "ServedVersion", "load_models"]

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
    each), completing each config from its latest version. Raises ``RepositoryError``,
    ``CfgError`` or ``WeightsError`` naming the file; nothing stays loaded after an error."""
    models: dict[str, ServedModel] = {}
    try:
        for source in sources:
            versions: dict[int, ServedVersion] = {}
            models[source.name] = ServedModel(source, versions)
            for files in reversed(source.versions):  # the latest completes the config
                versions[files.version] = _load_version(source, files, device, stats)
                progress(f"loaded {source.name} version {files.version} "
                         f"({files.cfg.name}, {source.instance_count} instance(s) on {device})")
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
    version_stats = stats.add(source.name, files.version, source.max_batch_size,
                              pending=lambda: batcher.pending)
    batcher = DynamicBatcher(networks, list(outputs.values()),
                             max_batch_size=source.max_batch_size,
                             queue_delay_us=source.queue_delay_us,
                             preferred=source.preferred_batch_sizes,
                             on_batch=version_stats.record_batch,
                             name=f"{source.name}-{files.version}")
    return ServedVersion(version=files.version, files=files, network=first, batcher=batcher,
                         stats=version_stats, outputs=outputs)
