"""A model repository in Triton's layout, read and checked before anything is served::

    <repository>/<model>/config.pbtxt          Triton's ModelConfig (optional: completed)
    <repository>/<model>/<version>/*.cfg       one network per version folder (1, 2, ...)
    <repository>/<model>/<version>/*.weights
    <repository>/<model>/<version>/*.names     optional class names

``read_repository`` reads the configs and finds the files of each served version;
``complete_config`` fills in what a config leaves out from a version's network (inputs and
outputs, as Triton's auto-complete does) and refuses a config contradicting it. Every error
is a ``RepositoryError`` naming the file and the field.
"""

from __future__ import annotations

import os
import re
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

from darknet_metal.errors import RepositoryError
from darknet_metal.serving.model_config import enum_value, new_config, parse_config

if TYPE_CHECKING:
    from darknet_metal.network import Network

__all__ = ["INPUT_NAME", "ModelSource", "VersionFiles", "complete_config", "output_name",
           "read_repository"]

#: The one input every served model takes: (batch, 3, H, W) FP32 RGB in [0, 1].
INPUT_NAME = "images"
CONFIG_FILE = "config.pbtxt"
#: The backend names a config may give (or leave empty).
BACKENDS = ("", "darknet", "darknet_metal")
#: ``parameters`` keys a config may set: the weights' storage, and the ``/detect`` route's
#: default thresholds.
PARAMETERS = ("precision", "thresh", "nms")
MAX_BATCH_SIZE = 256
MAX_INSTANCES = 16
MAX_QUEUE_DELAY_US = 10_000_000
_VERSION = re.compile(r"[1-9][0-9]{0,8}")


def output_name(layer: int) -> str:
    """The output tensor holding ``[yolo]`` layer ``layer``'s output: ``yolo_<layer>``."""
    return f"yolo_{layer}"


@dataclass(frozen=True)
class VersionFiles:
    """One version folder's network: ``cfg``, ``weights`` and optional ``names`` paths."""

    version: int
    folder: Path
    cfg: Path
    weights: Path
    names: Path | None


@dataclass
class ModelSource:
    """One model of the repository: its ``config`` (a ``ModelConfig`` message, checked;
    completed by ``complete_config``) and the ``versions`` it serves, oldest first."""

    name: str
    folder: Path
    config_path: Path
    config: Any
    versions: list[VersionFiles]

    @property
    def max_batch_size(self) -> int:
        """Most images one execution runs; 0: no batching (a request's batch runs as sent)."""
        return int(self.config.max_batch_size)

    @property
    def queue_delay_us(self) -> int | None:
        """How long a request may wait for others to batch with, in microseconds; None
        without ``dynamic_batching``."""
        if not self.config.HasField("dynamic_batching"):
            return None
        return int(self.config.dynamic_batching.max_queue_delay_microseconds)

    @property
    def preferred_batch_sizes(self) -> tuple[int, ...]:
        """Batch sizes that run at once, without waiting out the delay."""
        return tuple(int(n) for n in self.config.dynamic_batching.preferred_batch_size)

    @property
    def instance_count(self) -> int:
        """Network instances per version (sum of ``instance_group`` counts; default 1)."""
        groups = self.config.instance_group
        return sum(max(1, int(group.count)) for group in groups) if groups else 1

    def parameter(self, key: str) -> str | None:
        """The config's ``parameters[key].string_value``, or None."""
        if key in self.config.parameters:
            return str(self.config.parameters[key].string_value)
        return None


def read_repository(path: str | os.PathLike[str]) -> list[ModelSource]:
    """Every model under ``path``, by name, with its config parsed and checked and the files
    of each version it serves found. Raises ``RepositoryError`` naming the file or folder."""
    root = Path(path)
    if not root.exists():
        raise RepositoryError("model repository not found", path=root)
    if not root.is_dir():
        raise RepositoryError("a model repository is a folder (one subfolder per model)",
                              path=root)
    models = [_read_model(entry) for entry in sorted(root.iterdir())
              if entry.is_dir() and not entry.name.startswith(".")]
    if not models:
        raise RepositoryError("no models: expected <model>/config.pbtxt and "
                              "<model>/<version>/ folders holding a .cfg and a .weights",
                              path=root)
    return models


def _read_model(folder: Path) -> ModelSource:
    config_path = folder / CONFIG_FILE
    if config_path.is_file():
        config = parse_config(config_path)
    else:
        config = new_config()
    version_folders = {int(entry.name): entry for entry in folder.iterdir()
                       if entry.is_dir() and _VERSION.fullmatch(entry.name)}
    if not config_path.is_file() and not version_folders:
        raise RepositoryError(f"not a model: no {CONFIG_FILE} and no version folder (1, 2, "
                              "...)", path=folder)
    _check_config(config, folder.name, config_path)
    versions = [_version_files(version_folders[v]) for v in
                _served_versions(config, sorted(version_folders), folder, config_path)]
    return ModelSource(name=folder.name, folder=folder, config_path=config_path,
                       config=config, versions=versions)


def _check_config(config: Any, name: str, path: Path) -> None:
    """What a config says on its own, before its network is known."""
    def fail(field: str, message: str) -> None:
        raise RepositoryError(message, path=path, field=field)

    if config.name and config.name != name:
        fail("name", f"'{config.name}' differs from the model's folder name '{name}'")
    config.name = name
    for field in ("backend", "platform"):
        if getattr(config, field) not in BACKENDS:
            fail(field, f"'{getattr(config, field)}': this server runs Darknet networks "
                 f"(leave it out, or give 'darknet')")
    for field in ("sequence_batching", "ensemble_scheduling"):
        if config.HasField(field):
            fail(field, "not supported: detection requests are independent")
    if not 0 <= config.max_batch_size <= MAX_BATCH_SIZE:
        fail("max_batch_size", f"{config.max_batch_size} is outside 0..{MAX_BATCH_SIZE}")
    if config.HasField("dynamic_batching"):
        batching = config.dynamic_batching
        if config.max_batch_size == 0:
            fail("dynamic_batching", "needs max_batch_size above 0 (the most images one "
                 "batch may hold)")
        if not 0 <= batching.max_queue_delay_microseconds <= MAX_QUEUE_DELAY_US:
            fail("dynamic_batching.max_queue_delay_microseconds",
                 f"{batching.max_queue_delay_microseconds} is outside 0..{MAX_QUEUE_DELAY_US}")
        for i, size in enumerate(batching.preferred_batch_size):
            if not 1 <= size <= config.max_batch_size:
                fail(f"dynamic_batching.preferred_batch_size[{i}]",
                     f"{size} is outside 1..max_batch_size ({config.max_batch_size})")
    for i, group in enumerate(config.instance_group):
        if group.count < 0:
            fail(f"instance_group[{i}].count", f"{group.count} is negative")
    count = sum(max(1, group.count) for group in config.instance_group)
    if count > MAX_INSTANCES:
        fail("instance_group", f"{count} instances; at most {MAX_INSTANCES}")
    for key in config.parameters:
        if key not in PARAMETERS:
            fail(f"parameters[{key}]", f"unknown parameter; known: {', '.join(PARAMETERS)}")
        value = config.parameters[key].string_value
        if key == "precision" and value not in ("fp32", "fp16"):
            fail(f"parameters[{key}]", f"'{value}': expected 'fp32' or 'fp16'")
        if key in ("thresh", "nms"):
            try:
                number = float(value)
            except ValueError:
                number = -1.0
            if not 0.0 <= number <= 1.0:
                fail(f"parameters[{key}]", f"'{value}': expected a number in [0, 1]")


def _served_versions(config: Any, present: list[int], folder: Path,
                     path: Path) -> list[int]:
    """The versions ``version_policy`` serves among the folders present (Triton's default:
    the latest one)."""
    policy = config.version_policy
    kind = policy.WhichOneof("policy_choice") if config.HasField("version_policy") else None
    if not present:
        raise RepositoryError("no version folder (1, 2, ...) holding the .cfg and .weights",
                              path=folder)
    if kind == "all":
        return present
    if kind == "specific":
        wanted = sorted(set(int(v) for v in policy.specific.versions))
        missing = [v for v in wanted if v not in present]
        if not wanted or missing:
            raise RepositoryError(
                f"version(s) {missing or wanted} have no folder in {folder} (present: "
                f"{present})" if wanted else "lists no version",
                path=path, field="version_policy.specific.versions")
        return wanted
    count = int(policy.latest.num_versions) if kind == "latest" else 1
    if count < 1:
        raise RepositoryError(f"{count}: at least 1", path=path,
                              field="version_policy.latest.num_versions")
    return present[-count:]


def _version_files(folder: Path) -> VersionFiles:
    found: dict[str, list[Path]] = {".cfg": [], ".weights": [], ".names": []}
    for entry in sorted(folder.iterdir()):
        if entry.is_file() and entry.suffix in found:
            found[entry.suffix].append(entry)
    for suffix in (".cfg", ".weights"):
        if len(found[suffix]) != 1:
            what = ("no" if not found[suffix]
                    else f"{len(found[suffix])} ({', '.join(p.name for p in found[suffix])})")
            raise RepositoryError(f"{what} {suffix} files; a version folder holds exactly one",
                                  path=folder)
    if len(found[".names"]) > 1:
        raise RepositoryError(f"{len(found['.names'])} .names files; at most one", path=folder)
    return VersionFiles(version=int(folder.name), folder=folder, cfg=found[".cfg"][0],
                        weights=found[".weights"][0],
                        names=found[".names"][0] if found[".names"] else None)


def complete_config(source: ModelSource, net: Network, files: VersionFiles) -> None:
    """Fill in ``source.config``'s inputs and outputs from ``net`` (version ``files``) where
    the config leaves them out; raise ``RepositoryError`` naming the field where the config
    (or a version completed before) contradicts ``net``."""
    config = source.config
    fp32 = enum_value("DataType", "TYPE_FP32")
    nchw, no_format = (enum_value("ModelInput.Format", f"FORMAT_{name}")
                       for name in ("NCHW", "NONE"))
    c, h, w = net.input_shape
    batch_dims = [-1] if config.max_batch_size == 0 else []
    want_input = batch_dims + [c, h, w]

    def fail(field: str, message: str) -> None:
        raise RepositoryError(f"{message} ({files.cfg})", path=source.config_path, field=field)

    if not config.input:
        config.input.add(name=INPUT_NAME, data_type=fp32, format=nchw, dims=want_input)
    if len(config.input) != 1:
        fail("input", f"{len(config.input)} inputs; a detector takes one, '{INPUT_NAME}'")
    tensor = config.input[0]
    if tensor.name != INPUT_NAME:
        fail("input[0].name", f"'{tensor.name}': the input is named '{INPUT_NAME}'")
    if tensor.data_type != fp32:
        fail("input[0].data_type", "the input is TYPE_FP32")
    if tensor.format not in (nchw, no_format):
        fail("input[0].format", "the input is FORMAT_NCHW (planes of R, G and B)")
    if list(tensor.dims) != want_input:
        hint = ("; without max_batch_size the dims include the batch (-1: any)"
                if batch_dims and list(tensor.dims) == want_input[1:] else "")
        fail("input[0].dims", f"{list(tensor.dims)} contradicts the network, which takes "
             f"{want_input}{hint}")
    heads = {output_name(i): list(net.layers[i].out_shape) for i in net.yolo_layers}
    if not heads:
        fail("output", "the network has no [yolo] layer")
    if not config.output:
        for name, dims in heads.items():
            config.output.add(name=name, data_type=fp32, dims=batch_dims + dims)
    seen: set[str] = set()
    for i, out in enumerate(config.output):
        if out.name not in heads:
            fail(f"output[{i}].name", f"'{out.name}' is not one of the network's outputs "
                 f"({', '.join(heads)})")
        if out.name in seen:
            fail(f"output[{i}].name", f"'{out.name}' is listed twice")
        seen.add(out.name)
        if out.data_type != fp32:
            fail(f"output[{i}].data_type", "the outputs are TYPE_FP32")
        if list(out.dims) != batch_dims + heads[out.name]:
            fail(f"output[{i}].dims", f"{list(out.dims)} contradicts the network's "
                 f"{batch_dims + heads[out.name]}")

