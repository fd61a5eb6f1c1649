"""Checkpoints that survive being killed at any moment.

A checkpoint is a pair: ``NAME.weights``, the Darknet file (parameters, rolling statistics,
``seen``) that Darknet and OpenCV load, and ``NAME.state``, what Darknet does not keep — the
gradient accumulators (SGD's momentum), Adam's moments, the random streams' counters, and
the trainer's own record (``info``: iteration, input size, average loss, ...) — with the
SHA-256 of the weights file it belongs to.

Saving writes both under temporary names, moves the pair already there to
``NAME.prev.weights``/``NAME.prev.state``, then renames the new weights and the new state into
place. A kill between any two of those steps leaves a state whose weights are still on disk
(under one name or the other): ``find_checkpoint`` pairs each state with the weights whose
checksum it records and takes the newest whole pair.
"""

from __future__ import annotations

import hashlib
import io
import json
import os
import secrets
import zipfile
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

import numpy as np

from darknet_metal.errors import CheckpointError
from darknet_metal.model.weights import weights_bytes
from darknet_metal.training.trainer import Trainer

if TYPE_CHECKING:
    from darknet_metal.network import Network

#: Layout version of the ``.state`` file.
STATE_VERSION = 1
#: Training arrays a checkpoint keeps, by ``LayerTrainState`` group; of the arrays the layers
#: keep between passes (``extra``), only the random streams' counters matter to a resume.
_GROUPS = ("grad", "adam_m", "adam_v")
_KEPT_EXTRAS = ("draws",)


@dataclass
class Checkpoint:
    """A whole pair found on disk: ``weights`` and ``state`` paths, and the state's
    ``info`` (what the trainer recorded; ``info["iteration"]`` always)."""

    weights: Path
    state: Path
    info: dict[str, Any]

    @property
    def iteration(self) -> int:
        return int(self.info["iteration"])


def state_path(weights: str | os.PathLike[str]) -> Path:
    """The ``.state`` file beside ``weights`` (``x_last.weights`` -> ``x_last.state``)."""
    p = Path(weights)
    return p.with_suffix(".state") if p.suffix == ".weights" else Path(f"{p}.state")


def _prev(path: Path) -> Path:
    return path.with_name(f"{path.stem}.prev{path.suffix}")


def save_checkpoint(net: Network, weights: str | os.PathLike[str],
                    info: dict[str, Any]) -> None:
    """Write ``net``'s parameters to ``weights`` and its training state with ``info`` (a
    JSON-able dict; ``iteration`` is added) to the ``.state`` beside it, as one pair that a
    kill at any moment cannot tear (see the module docstring)."""
    weights = Path(weights)
    state = state_path(weights)
    folder = weights.parent
    # What a save killed midway left behind.
    for stale in (*folder.glob(f".{weights.name}.*.tmp"), *folder.glob(f".{state.name}.*.tmp")):
        stale.unlink(missing_ok=True)
    tag = secrets.token_hex(6)
    tmp_weights = folder / f".{weights.name}.{tag}.tmp"
    tmp_state = folder / f".{state.name}.{tag}.tmp"
    try:
        with net.exclusive():  # the weights and the state of one moment
            data = b"".join(weights_bytes(net.layers, net.params, net.header))
            state_data = _state_bytes(net, hashlib.sha256(data).hexdigest(),
                                      {**info, "iteration": net.iteration})
        _write_new(tmp_weights, data)
        _write_new(tmp_state, state_data)
        if weights.exists() and state.exists():
            os.replace(weights, _prev(weights))
            os.replace(state, _prev(state))
        os.replace(tmp_weights, weights)
        os.replace(tmp_state, state)
        _sync_folder(folder)
    finally:
        for tmp in (tmp_weights, tmp_state):
            try:
                tmp.unlink()
            except FileNotFoundError:
                pass


def find_checkpoint(weights: str | os.PathLike[str]) -> Checkpoint | None:
    """The newest whole pair saved as ``weights`` (its ``.state`` and weights of the
    checksum it records, possibly under the ``.prev`` names a kill left them with), or None
    when there is none. A state that cannot be read counts as absent."""
    weights = Path(weights)
    state = state_path(weights)
    found: list[Checkpoint] = []
    sums: dict[Path, str] = {}
    for s in (state, _prev(state)):
        try:
            info, digest = _read_info(s)
        except CheckpointError:
            continue
        for w in (weights, _prev(weights)):
            if not w.is_file():
                continue
            if w not in sums:
                sums[w] = _sha256(w)
            if sums[w] == digest:
                found.append(Checkpoint(w, s, info))
                break
    return max(found, key=lambda c: c.iteration, default=None)


def restore_training_state(net: Network, checkpoint: Checkpoint) -> None:
    """Put the training state of ``checkpoint`` into ``net`` (whose parameters must have been
    loaded from ``checkpoint.weights``): accumulators, moments and counters. Raises
    ``CheckpointError`` naming the array when the state does not fit the network."""
    trainer = Trainer.of(net)
    try:
        with np.load(checkpoint.state, allow_pickle=False) as data:
            arrays = {name: data[name] for name in data.files if name != "info"}
    except (OSError, ValueError, KeyError, zipfile.BadZipFile) as e:
        raise CheckpointError(f"cannot read the training state: {e}",
                              path=checkpoint.state) from None
    expected = _state_arrays(net, write=True)
    missing = sorted(set(expected) - set(arrays))
    extra = sorted(set(arrays) - set(expected))
    if missing or extra:
        raise CheckpointError(
            "the training state does not fit this network "
            f"(missing: {', '.join(missing[:4]) or 'none'}; "
            f"unknown: {', '.join(extra[:4]) or 'none'}): was it saved with another cfg?",
            path=checkpoint.state)
    for name, target in expected.items():
        saved = arrays[name]
        if saved.shape != target.shape:
            raise CheckpointError(f"array {name} has shape {saved.shape}, the network's "
                                  f"{target.shape}", path=checkpoint.state)
        np.copyto(target, saved, casting="unsafe")
    trainer.state.write_back()


def _state_arrays(net: Network, *, write: bool = False) -> dict[str, np.ndarray]:
    """The arrays a checkpoint's state holds, current on the host (``write``: the caller
    changes them in place; the device takes them before its next step)."""
    state = Trainer.of(net).state
    state.to_host(write=write)
    arrays = {}
    for index, layer in state.layers.items():
        for group in _GROUPS:
            for name, a in layer.group(group).items():
                arrays[f"{index}/{group}/{name}"] = a
        for name in _KEPT_EXTRAS:
            if name in layer.extra:
                arrays[f"{index}/extra/{name}"] = layer.extra[name]
    return arrays


def _state_bytes(net: Network, digest: str, info: dict[str, Any]) -> bytes:
    header = {"version": STATE_VERSION, "weights_sha256": digest, "info": info}
    buffer = io.BytesIO()
    np.savez(buffer, info=np.frombuffer(json.dumps(header).encode(), np.uint8),
             **_state_arrays(net))
    return buffer.getvalue()


def _read_info(path: Path) -> tuple[dict[str, Any], str]:
    try:
        with np.load(path, allow_pickle=False) as data:
            header = json.loads(bytes(data["info"]).decode())
    except (OSError, ValueError, KeyError, UnicodeDecodeError, EOFError,
            zipfile.BadZipFile) as e:
        raise CheckpointError(f"not a readable training state: {e}", path=path) from None
    if header.get("version") != STATE_VERSION or "weights_sha256" not in header:
        raise CheckpointError(f"unknown training state version {header.get('version')!r}",
                              path=path)
    return header["info"], header["weights_sha256"]


def _write_new(path: Path, data: bytes) -> None:
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o666)
    with os.fdopen(fd, "wb") as f:
        f.write(data)
        f.flush()
        os.fsync(f.fileno())


def _sha256(path: Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for chunk in iter(lambda: f.read(1 << 20), b""):
            h.update(chunk)
    return h.hexdigest()


def _sync_folder(folder: Path) -> None:
    # The renames are durable only once the folder's entry table is on disk.
    try:
        fd = os.open(folder, os.O_RDONLY)
    except OSError:
        return
    try:
        os.fsync(fd)
    except OSError:
        pass
    finally:
        os.close(fd)
