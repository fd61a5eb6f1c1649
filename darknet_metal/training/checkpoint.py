"""Checkpoints that survive being killed at any moment.

A checkpoint is a pair: ``NAME.weights``, the Darknet file (parameters, rolling statistics,
``seen``) that Darknet and OpenCV load, and ``NAME.state``, what Darknet does not keep — the
gradient accumulators (SGD's momentum), Adam's moments, the random streams' counters, and
the trainer's own record (``info``: iteration, input size, average loss, ...) — with the
SHA-256 of the weights file it belongs to.

Saving writes both under temporary names, moves the pair already there to
``NAME.prev.weights``/``NAME.prev.state``, renames the new weights and the new state into
place, and once they are on disk removes the ``.prev`` files: between two saves a name has
one pair, during a save at most one previous pair as well. A kill between any two of those
steps leaves a state whose weights are still on disk (under one name or the other):
``find_checkpoint`` pairs each state with the weights whose checksum it records and takes
the pair written last (the state under ``NAME`` before the one under ``NAME.prev``, whatever
their iterations: a rerun from scratch writes lower ones than the run it replaces).

A save never moves or overwrites a file of the pair it would fall back on: after a kill the
files under ``NAME`` need not be a pair (the weights of one save, the state of the one
before, whose weights are the ``.prev`` ones), and moving them aside would overwrite those
``.prev`` weights; so when ``.prev`` files are there, the save first finds which whole pair is
on disk and moves aside only the files of it that sit under ``NAME``. ``test_checkpoint.py``
kills saves at each step, also several in a row.
"""

from __future__ import annotations

import contextlib
import glob
import hashlib
import json
import os
import secrets
import zipfile
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any, BinaryIO

import numpy as np

from darknet_metal.errors import CheckpointError
from darknet_metal.model.weights import weights_bytes
from darknet_metal.trainer.trainer import Trainer

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
    for stale in _temporaries(weights, state):
        _unlink(stale)
    tag = secrets.token_hex(6)
    tmp_weights = folder / f".{weights.name}.{tag}.tmp"
    tmp_state = folder / f".{state.name}.{tag}.tmp"
    try:
        # The weights and the state of one moment, written as they are read: a save holds
        # one array's bytes at a time, not copies of every parameter and momentum.
        with net.exclusive():
            digest = hashlib.sha256()
            with _new_file(tmp_weights) as f:
                for piece in weights_bytes(net.layers, net.params, net.header):
                    digest.update(piece)
                    f.write(piece)
            header = {"version": STATE_VERSION, "weights_sha256": digest.hexdigest(),
                      "info": {**info, "iteration": net.iteration}}
            with _new_file(tmp_state) as f:
                np.savez(f, info=np.frombuffer(json.dumps(header).encode(), np.uint8),
                         **_state_arrays(net))
        # Until the new state is renamed in, the pair on disk is what a kill falls back on:
        # the files of it under NAME go to the .prev names, those already there stay.
        kept = _pair_on_disk(weights, state)
        if kept is not None and kept.weights == weights:
            os.replace(weights, _prev(weights))
            if kept.state == state:
                os.replace(state, _prev(state))
        os.replace(tmp_weights, weights)
        os.replace(tmp_state, state)
        # The new pair must be on disk before the previous one goes.
        _sync_folder(folder)
        # Only one pair is kept: the previous one (possibly an earlier run's, or what a
        # killed save left) is no longer needed. A kill between the two removals leaves a
        # lone .prev file, which pairs with nothing and goes at the next save.
        for previous in (_prev(state), _prev(weights)):
            _unlink(previous)
    finally:
        for tmp in (tmp_weights, tmp_state):
            _unlink(tmp)


def find_checkpoint(weights: str | os.PathLike[str]) -> Checkpoint | None:
    """The whole pair saved last as ``weights`` (its ``.state`` and weights of the checksum
    it records, possibly under the ``.prev`` names a kill left them with), or None when there
    is none. A state that cannot be read counts as absent."""
    weights = Path(weights)
    return next(_whole_pairs(weights, state_path(weights)), None)


def checkpoint_files(weights: str | os.PathLike[str]) -> list[Path]:
    """The files on disk of the checkpoint saved as ``weights``: its weights and state, the
    ``.prev`` ones, and the temporary files of a save that was killed."""
    weights = Path(weights)
    state = state_path(weights)
    named = [p for p in (weights, state, _prev(weights), _prev(state)) if p.is_file()]
    return named + sorted(_temporaries(weights, state))


def describe_earlier_checkpoint(weights: str | os.PathLike[str],
                                starting_from: str | os.PathLike[str] | None = None
                                ) -> str | None:
    """The line ``train`` prints when the checkpoint it will save as ``weights`` is already
    there, from an earlier run: the folder, the files and their size, the iteration of the
    pair, and that the first new checkpoint replaces them. None when there is nothing, or
    when the run continues from that checkpoint (``starting_from``, the weights it was
    loaded from, is one of its weights files)."""
    weights = Path(weights)
    files = checkpoint_files(weights)
    if not files:
        return None
    if starting_from is not None and any(
            _same_file(starting_from, w) for w in (weights, _prev(weights))):
        return None
    temporaries = _temporaries(weights, state_path(weights))
    names = [p.name for p in files if p not in temporaries]
    if temporaries:
        names.append(f"{len(temporaries)} temporary file{'s' * (len(temporaries) > 1)} of a "
                     "killed save")
    found = find_checkpoint(weights)
    pair = (f"a checkpoint at iteration {found.iteration}" if found is not None
            else "no whole checkpoint")
    size = sum(p.stat().st_size for p in files)
    return (f"{weights.parent}/: {', '.join(names)} from an earlier run ({pair}, "
            f"{_megabytes(size)}) are replaced by this run's first checkpoint: the earlier "
            f"one stays until that is written (as {_prev(weights).stem}.* during the save), "
            "then it is removed")


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


def _whole_pairs(weights: Path, state: Path) -> Iterator[Checkpoint]:
    """The whole pairs of the checkpoint ``weights``/``state``, the one written last first.

    States only ever move from NAME to NAME.prev, so the state under NAME is the later one
    whatever the iterations say."""
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
                yield Checkpoint(w, s, info)
                break


def _pair_on_disk(weights: Path, state: Path) -> Checkpoint | None:
    """The whole pair a save must keep until its new one is in place (None: none)."""
    if not _prev(weights).exists() and not _prev(state).exists():
        # Without .prev files the only pair there can be is the one under NAME; moving it
        # aside is harmless even when it is not whole, so there is no need to hash it.
        if weights.exists() and state.exists():
            return Checkpoint(weights, state, {})
        return None
    return next(_whole_pairs(weights, state), None)


def _temporaries(weights: Path, state: Path) -> list[Path]:
    """The temporary files that saves killed midway left for ``weights``/``state``."""
    folder = weights.parent
    return [*folder.glob(f".{glob.escape(weights.name)}.*.tmp"),
            *folder.glob(f".{glob.escape(state.name)}.*.tmp")]


def _same_file(a: str | os.PathLike[str], b: Path) -> bool:
    """Whether ``a`` and ``b`` name one file; also when it is absent (a kill can leave a
    checkpoint under its ``.prev`` names only, and ``train`` resumes from it by ``NAME``)."""
    try:
        return os.path.samefile(a, b)
    except OSError:
        return Path(a).resolve() == b.resolve()


def _unlink(path: Path) -> None:
    try:
        os.unlink(path)
    except FileNotFoundError:
        pass


def _megabytes(size: int) -> str:
    return f"{size / 1e6:.1f} MB" if size >= 100_000 else f"{size / 1e3:.1f} kB"


@contextlib.contextmanager
def _new_file(path: Path) -> Iterator[BinaryIO]:
    """A file created for writing (never an existing one), on disk when the block ends."""
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o666)
    with os.fdopen(fd, "wb") as f:
        yield f
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
