"""``darknet-metal train DATA --model NAME``: what Darknet's README has a user do by hand before
training, done once and said on stderr: the model's cfg for DATA's classes
(``model.derive``) written into the backup folder as ``<model>-<data>.cfg``, subdivisions that
fit this machine's memory when none are given, and the backbone the README names for the model
(``yolov4-tiny.conv.29``...) made from its COCO weights (the model cache, downloaded as
``detect --model`` does, or ``--weights FILE``). Training then runs as
``train DATA CFG BACKBONE``.
"""

from __future__ import annotations

import argparse
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from darknet_metal.errors import ArgumentError, MemoryLimitError, WeightsError
from darknet_metal.files import atomic_write
from darknet_metal.model.bundled import get_spec, model_files
from darknet_metal.training.cfg_command import derive_from_args

__all__ = ["Prepared", "prepare"]


@dataclass(frozen=True)
class Prepared:
    """The files a run from a bundled model starts from, and what was derived (lines);
    ``created``: the files and folder that did not exist before (``remove_created``)."""

    cfg: Path
    backbone: Path
    lines: tuple[str, ...]
    created: tuple[Path, ...] = ()

    def remove_created(self) -> None:
        """Removes what ``prepare`` created (a run that then fails to start leaves nothing
        behind); a folder only when it is empty."""
        for path in self.created:
            if path.is_dir():
                try:
                    path.rmdir()
                except OSError:
                    pass  # something else is in it now
            else:
                path.unlink(missing_ok=True)


def prepare(args: argparse.Namespace, say: Any) -> Prepared:
    """Derive the cfg, choose subdivisions, make the backbone; ``say(line)`` reports each
    step. Writes nothing when a value is refused (a class count that disagrees with DATA, a
    size not a multiple of 32, weights of another network)."""
    import darknet_metal as dm
    from darknet_metal.datasets import load_dataset
    from darknet_metal.model.weights import WeightsHeader, write_weights

    spec = get_spec(args.model)
    dataset = load_dataset(args.data)
    derived = derive_from_args(args, dataset)
    if args.subdivisions is None:
        derived = _fitting(args, derived, say)
    if args.coco_weights is not None:
        coco, where = Path(args.coco_weights), "given"
    else:
        coco, where = model_files(args.model, download=True).weights, "the model cache"
    try:  # the whole file, as the model's: a cut or another network's file is refused
        full = dm.load(spec.cfg, coco)
    except WeightsError as e:
        fix = (f"--model {args.model} makes its backbone from the model's whole COCO weights "
               "file: give that file to --weights, or leave --weights out to use the model "
               "cache")
        raise WeightsError(e.reason, path=e.path, layer=e.layer, hint=fix) from None
    folder = Path(args.backup) if args.backup is not None else (dataset.backup
                                                                 or Path("backup"))
    cfg = folder / f"{args.model}-{Path(args.data).stem}.cfg"
    backbone = folder / f"{args.model}.conv.{spec.backbone_layers}"
    # Files first, the folder last: removed in this order, the folder is empty by then.
    created = tuple(p for p in (cfg, backbone, folder) if not p.exists())
    folder.mkdir(parents=True, exist_ok=True)
    for v in derived.values:
        say(f"[{v.section}] {v.key}={v.value} ({v.source})")
    atomic_write(cfg, lambda f: f.write(derived.text.encode()))
    write_weights(backbone, full.layers, full.params, WeightsHeader(seen=0),
                  upto=spec.backbone_layers)
    lines = (f"wrote {cfg}", f"wrote {backbone}: the first {spec.backbone_layers} layers of "
             f"{coco} ({where}), as Darknet's README makes {args.model}'s backbone")
    for line in lines:
        say(line)
    return Prepared(cfg, backbone, lines, created)


def _fitting(args: argparse.Namespace, derived: Any, say: Any) -> Any:
    """The derived cfg with the fewest subdivisions whose training pass fits this machine's
    memory (the trainer's own check, on the device the run uses)."""
    from darknet_metal.trainer.trainer import Trainer

    batch = args.batch
    tried = []
    for subdivisions in (s for s in range(1, batch + 1) if batch % s == 0):
        candidate = derived.rederive(
            subdivisions=subdivisions,
            subdivisions_source=f"the fewest that fit this machine's memory on {args.device}")
        try:
            Trainer.of(_load_text(candidate.text, args.device))
        except MemoryLimitError:
            tried.append(subdivisions)
            continue
        if tried:
            say(f"subdivisions {', '.join(map(str, tried))} would not fit this machine's "
                "memory")
        return candidate
    raise ArgumentError(f"even one image per pass of {args.model} does not fit this machine's "
                        "memory: give a smaller --size")


def _load_text(text: str, device: str) -> Any:
    """A network from cfg text, through a temporary file removed at once."""
    import tempfile

    import darknet_metal as dm

    with tempfile.TemporaryDirectory(prefix="darknet-metal-cfg-") as tmp:
        path = Path(tmp) / "candidate.cfg"
        path.write_text(text)
        return dm.load(path, seed=0, device=device)
