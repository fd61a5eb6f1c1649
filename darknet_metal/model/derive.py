"""A bundled model's cfg made for your classes, as Darknet's README tells a user to edit it by
hand: ``classes`` in every ``[yolo]``, ``filters=(classes + 5) x masks`` in the convolution
before each, ``max_batches``, ``steps`` at 80% and 90% of it with two ``scales``, the input size,
``batch`` and ``subdivisions``, and optionally the anchors; ``burn_in`` is the model's unless
the run is too short for it (:func:`fitting_burn_in`).

The edit is textual: every other line of the bundled cfg (comments, order, the keys not named
above) stays as it is, so the file reads like the one a user would have made, and with 80 classes
and the model's own size and anchors it equals the bundled cfg in every key but
:data:`TRAINING_KEYS`.
"""

from __future__ import annotations

import re
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from darknet_metal.errors import ArgumentError
from darknet_metal.model.bundled import get_spec
from darknet_metal.model.cfg import NetConfig, parse_cfg_text

__all__ = ["BURN_IN_SHARE", "DerivedCfg", "DerivedValue", "TRAINING_KEYS", "anchor_count",
           "darknet_max_batches", "derive_cfg", "fitting_burn_in"]

#: The [net] keys a derived cfg sets for training whatever the bundled cfg says: the
#: schedule, and the batch (bundled cfgs hold the testing batch of 1 in some cases).
TRAINING_KEYS = ("batch", "subdivisions", "max_batches", "steps", "scales")

#: The most of a run its burn-in may take: Darknet's recipe, burn_in=1000 of at least 6000
#: iterations. A shorter run warms up over this share of it, so that its learning rate is the
#: cfg's for most of the run.
BURN_IN_SHARE = 1 / 6
_HEADER = re.compile(r"^\s*\[([^\]]+)\]\s*$")
_KEY = re.compile(r"^(\s*)([A-Za-z_][\w]*)(\s*=\s*)(.*?)(\s*)$")


@dataclass(frozen=True)
class DerivedValue:
    """One value a derived cfg sets: the section (``net``, ``yolo 30``, ``convolutional
    29``), the key, the value as written, and where it came from."""

    section: str
    key: str
    value: str
    source: str


@dataclass(frozen=True)
class DerivedCfg:
    """The cfg text (``text``), what it sets (``values``, in file order) and the parsed
    network (``config``), checked by the same parser rules as every cfg; ``arguments``:
    the keyword arguments of :func:`derive_cfg` it was made with."""

    model: str
    text: str
    values: tuple[DerivedValue, ...]
    config: NetConfig
    arguments: dict[str, Any]

    def rederive(self, **changes: Any) -> DerivedCfg:
        """The same derivation with some arguments changed (``subdivisions=4``...)."""
        return derive_cfg(self.model, **{**self.arguments, **changes})


def anchor_count(config: NetConfig) -> int:
    """How many anchors the [yolo] heads of ``config`` share (0 without a head)."""
    heads = [s for s in config.layers if s.kind == "yolo"]
    return len(heads[0].values["anchors"]) // 2 if heads else 0


def darknet_max_batches(classes: int, train_images: int = 0, batch: int = 64) -> int:
    """Darknet's rule for ``max_batches``: 2000 per class, at least 6000, and at least one
    pass over the training images (``train_images / batch``)."""
    return max(2000 * classes, 6000, -(-train_images // batch) if train_images else 0)


def fitting_burn_in(model_burn_in: int, max_batches: int) -> int:
    """The burn-in of a run of ``max_batches`` iterations: the model's ``model_burn_in``, or
    BURN_IN_SHARE of the run (at least 1) when the model's would take more of it."""
    return min(model_burn_in, max(1, int(max_batches * BURN_IN_SHARE)))


def derive_cfg(model: str, classes: int, *, size: tuple[int, int] | None = None,
               batch: int = 64, subdivisions: int | None = None,
               max_batches: int | None = None, train_images: int = 0,
               anchors: Sequence[float] | None = None,
               anchors_source: str = "given",
               subdivisions_source: str = "given",
               burn_in: int | None = None) -> DerivedCfg:
    """The bundled ``model``'s cfg for ``classes`` classes.

    ``size``: (width, height) in pixels, multiples of 32 (default: the model's);
    ``batch`` / ``subdivisions``: images per iteration and mini-batches per iteration
    (default subdivisions: the model's; given ones said to come from
    ``subdivisions_source``); ``max_batches``: iterations (default:
    :func:`darknet_max_batches` of ``classes`` and ``train_images``); ``anchors``: 2 x N
    numbers, N the model's anchor count, in pixels at ``size`` (default: the model's), said
    to come from ``anchors_source``; ``burn_in``: iterations over which the learning rate
    warms up (default: :func:`fitting_burn_in` of the model's and ``max_batches``). Raises
    ``ModelNotFoundError`` for a model not bundled and ``ArgumentError`` naming the argument
    for a value Darknet would refuse."""
    arguments = dict(classes=classes, size=size, batch=batch, subdivisions=subdivisions,
                     max_batches=max_batches, train_images=train_images, anchors=anchors,
                     anchors_source=anchors_source, subdivisions_source=subdivisions_source,
                     burn_in=burn_in)
    spec = get_spec(model)
    if not isinstance(classes, int) or isinstance(classes, bool) or classes < 1:
        raise ArgumentError(f"classes must be a positive integer, not {classes!r}")
    if not isinstance(batch, int) or isinstance(batch, bool) or batch < 1:
        raise ArgumentError(f"batch must be a positive integer, not {batch!r}")
    text = spec.cfg.read_text()
    bundled = parse_cfg_text(text, str(spec.cfg))
    net = bundled.net.values
    if size is None:
        size = (int(net["width"]), int(net["height"]))
        size_source = f"{model}'s size"
    else:
        size_source = "given"
    for name, value in zip(("width", "height"), size, strict=True):
        if not isinstance(value, int) or value < 32 or value % 32:
            raise ArgumentError(f"the {name} must be a multiple of 32 (Darknet's downsampling "
                                f"to the [yolo] grids needs it), not {value!r}")
    if subdivisions is None:
        subdivisions = min(int(net["subdivisions"]), batch)
        while batch % subdivisions:
            subdivisions -= 1
        subdivisions_source = f"{model}'s, dividing the batch"
    if not isinstance(subdivisions, int) or subdivisions < 1 or batch % subdivisions:
        raise ArgumentError(f"subdivisions must divide the batch ({batch}), not "
                            f"{subdivisions!r}")
    if max_batches is None:
        max_batches = darknet_max_batches(classes, train_images, batch)
        rule = f"max(2000 x {classes} classes, 6000"
        rule += f", {train_images} training images / batch {batch})" if train_images else ")"
        max_source = f"Darknet's rule: {rule}"
    else:
        max_source = "given"
    if not isinstance(max_batches, int) or isinstance(max_batches, bool) or max_batches < 1:
        raise ArgumentError(f"max_batches must be a positive integer, not {max_batches!r}")
    model_burn_in = int(net["burn_in"])
    if burn_in is None:
        burn_in = fitting_burn_in(model_burn_in, max_batches)
        burn_source = (f"{model}'s" if burn_in == model_burn_in else
                       f"a sixth of max_batches, as Darknet's 1000 of 6000: {model}'s "
                       f"{model_burn_in} would hold the learning rate near 0 for most of the "
                       "run")
    else:
        burn_source = "given"
    if not isinstance(burn_in, int) or isinstance(burn_in, bool) or burn_in < 0:
        raise ArgumentError(f"burn_in must be a non-negative integer, not {burn_in!r}")
    heads = [s for s in bundled.layers if s.kind == "yolo"]
    total = anchor_count(bundled)
    anchor_text = None
    if anchors is not None:
        values = [float(a) for a in anchors]
        if len(values) != 2 * total or any(not v > 0 for v in values):
            raise ArgumentError(f"{model} takes {total} anchors (2 x {total} positive numbers), "
                                f"got {len(values)} numbers")
        anchor_text = ", ".join(f"{v:g}" for v in values)
    steps = (int(max_batches * 0.8), int(max_batches * 0.9))
    net_keys = {
        "batch": (str(batch), "given" if batch != 64 else "Darknet's README (64)"),
        "subdivisions": (str(subdivisions), subdivisions_source),
        "width": (str(size[0]), size_source),
        "height": (str(size[1]), size_source),
        "max_batches": (str(max_batches), max_source),
        "steps": (f"{steps[0]},{steps[1]}", "80% and 90% of max_batches"),
        "scales": (".1,.1", "Darknet's README: one scale per step"),
        "burn_in": (str(burn_in), burn_source),
    }
    lines = text.splitlines()
    values: list[DerivedValue] = []
    sections = _sections(lines)
    edits: dict[int, dict[str, tuple[str, str]]] = {0: net_keys}
    yolo_sections = [k for k, (kind, _, _) in enumerate(sections) if kind == "yolo"]
    for k, head in zip(yolo_sections, heads, strict=True):
        masks = len(head.values["mask"]) if head.values.get("mask") else total
        head_keys = {"classes": (str(classes), "given")}
        if anchor_text is not None:
            head_keys["anchors"] = (anchor_text, anchors_source)
        edits[k] = head_keys
        before = k - 1
        if before < 0 or sections[before][0] != "convolutional":
            raise ArgumentError(f"{model}: the section before [yolo] {k} is not a convolution")
        edits[before] = {"filters": (str((classes + 5) * masks),
                                     f"(classes + 5) x {masks} masks")}
    out = list(lines)
    inserts: list[tuple[int, str]] = []
    for k, keys in edits.items():
        kind, start, end = sections[k]
        label = "net" if k == 0 else f"{kind} {k - 1}"
        seen = set()
        for i in range(start + 1, end):
            m = _KEY.match(out[i])
            if m and m.group(2) in keys:
                key = m.group(2)
                value, source = keys[key]
                out[i] = f"{m.group(1)}{key}{m.group(3)}{value}"
                seen.add(key)
        for key, (value, _source) in keys.items():
            if key not in seen:
                inserts.append((start + 1, f"{key}={value}"))
        for key, (value, source) in keys.items():
            values.append(DerivedValue(label, key, value, source))
    for at, line in sorted(inserts, key=lambda x: -x[0]):
        out.insert(at, line)
    derived_text = "\n".join(out) + "\n"
    config = parse_cfg_text(derived_text, f"<{model} for {classes} classes>")
    return DerivedCfg(model, derived_text, tuple(values), config, arguments)


def _sections(lines: list[str]) -> list[tuple[str, int, int]]:
    """(kind, header line, end line) of every section, in order."""
    found = []
    for i, line in enumerate(lines):
        m = _HEADER.match(line.split("#", 1)[0])
        if m:
            found.append([m.group(1).strip().lower(), i])
    out = []
    for k, (kind, start) in enumerate(found):
        end = found[k + 1][1] if k + 1 < len(found) else len(lines)
        kind = {"conv": "convolutional", "network": "net"}.get(kind, kind)
        out.append((kind, start, end))
    return out
