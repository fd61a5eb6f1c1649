"""The cfg values that decide how training images are loaded and augmented.

Darknet's ``train_detector`` reads most of them from ``[net]`` and four from the last
``[yolo]`` layer (``jitter``, ``resize``, ``random`` and ``max``), then hands them to
``load_data_detection``. :func:`settings_from_cfg` gathers them from a parsed cfg the same
way; :class:`LoaderSettings` can also be built directly (tests, other front ends).
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import dataclass, fields, replace
from typing import Any

from darknet_metal.errors import ArgumentError, CfgError
from darknet_metal.model.cfg import NetConfig, Section

__all__ = ["LoaderSettings", "settings_from_cfg"]

#: Darknet's ``use_mixup`` codes after its cfg parser combines ``mixup``/``cutmix``/``mosaic``.
MIXUP_BLEND = 1
MIXUP_CUTMIX = 2
MIXUP_MOSAIC = 3
MIXUP_CUTMIX_MOSAIC = 4


@dataclass(frozen=True)
class LoaderSettings:
    """Everything the loader needs from a cfg; sizes in network pixels.

    ``width``/``height``/``channels``: the network input (the size batches are made at until
    :meth:`darknet_metal.training.loading.Loader.set_size` changes it). ``batch``: images per
    iteration (``[net] batch``, all mini-batches together). ``max_boxes``: truths kept per image
    (``[yolo] max``). ``classes``: class ids must be below it (None: not checked).
    ``mixup``: Darknet's combined code (0 none, 1 blend two images, 3 mosaic; 2 and 4,
    cutmix, are refused as Darknet refuses them for detection). The others are the cfg keys
    of the same name.
    """

    width: int
    height: int
    channels: int = 3
    batch: int = 1
    max_boxes: int = 200
    classes: int | None = None
    jitter: float = 0.2
    resize: float = 1.0
    random: float = 0.0
    resize_step: float = 32.0
    flip: int = 1
    hue: float = 0.0
    saturation: float = 1.0
    exposure: float = 1.0
    blur: int = 0
    gaussian_noise: int = 0
    mixup: int = 0
    mosaic_bound: int = 0
    letter_box: int = 0

    def __post_init__(self) -> None:
        for name in ("width", "height", "batch", "max_boxes"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ArgumentError(
                    f"loader setting {name}={value!r}: must be a positive integer"
                )
        if self.channels not in (1, 3):
            raise ArgumentError(
                f"loader setting channels={self.channels!r}: images are loaded with 1 or 3 "
                "channels, as Darknet's detector training loads them"
            )
        for name in ("jitter", "resize", "random", "resize_step", "hue", "saturation",
                     "exposure"):
            value = getattr(self, name)
            if not isinstance(value, int | float) or not math.isfinite(value):
                raise ArgumentError(f"loader setting {name}={value!r}: must be a finite number")
        if self.jitter < 0 or self.jitter >= 0.5:
            raise ArgumentError(
                f"loader setting jitter={self.jitter!r}: must be in [0, 0.5) (a crop can lose "
                "up to jitter of the image on each side, so 0.5 or more can leave nothing)"
            )
        if self.resize <= 0:
            raise ArgumentError(f"loader setting resize={self.resize!r}: must be positive")
        if self.saturation <= 0 or self.exposure <= 0:
            raise ArgumentError(
                f"loader settings saturation={self.saturation!r}, exposure={self.exposure!r}: "
                "must be positive (the factor is drawn between 1/value and value)"
            )
        if self.resize_step <= 0:
            raise ArgumentError(
                f"loader setting resize_step={self.resize_step!r}: must be positive"
            )
        if self.mixup in (MIXUP_CUTMIX, MIXUP_CUTMIX_MOSAIC):
            raise ArgumentError(
                "cutmix=1: not supported for detection (Darknet refuses it there too)"
            )
        if self.mixup not in (0, MIXUP_BLEND, MIXUP_MOSAIC):
            raise ArgumentError(f"loader setting mixup={self.mixup!r}: expected 0, 1 or 3")
        if self.mixup == MIXUP_MOSAIC and self.letter_box:
            raise ArgumentError(
                "letter_box=1 with mosaic=1: they cannot be combined (as in Darknet)"
            )
        if self.blur < 0 or self.gaussian_noise < 0:
            raise ArgumentError(
                f"loader settings blur={self.blur!r}, gaussian_noise={self.gaussian_noise!r}: "
                "must not be negative"
            )
        if self.classes is not None and self.classes < 1:
            raise ArgumentError(f"loader setting classes={self.classes!r}: must be positive")

    @property
    def mosaic(self) -> bool:
        """``mosaic=1`` in the cfg."""
        return self.mixup == MIXUP_MOSAIC

    def with_size(self, width: int, height: int) -> LoaderSettings:
        """The same settings at another network size."""
        return replace(self, width=width, height=height)

    @classmethod
    def from_values(
        cls, net: Mapping[str, Any], yolo: Mapping[str, Any] | None = None, **overrides: Any
    ) -> LoaderSettings:
        """Settings from ``[net]`` values and the last ``[yolo]`` layer's values (its
        ``jitter``, ``resize``, ``random``, ``max``, ``classes``; Darknet's defaults when
        ``yolo`` is None). ``overrides`` replace any field."""
        yolo = yolo or {}
        values: dict[str, Any] = {
            "width": net["width"],
            "height": net["height"],
            "channels": net.get("channels") or 3,
            "batch": net.get("batch", 1),
            "max_boxes": yolo.get("max", 200),
            "classes": yolo.get("classes"),
            "jitter": yolo.get("jitter", 0.2),
            "resize": yolo.get("resize", 1.0),
            "random": yolo.get("random", 0.0),
        }
        for name in ("resize_step", "flip", "hue", "saturation", "exposure", "blur",
                     "gaussian_noise", "mixup", "mosaic_bound", "letter_box"):
            if name in net:
                values[name] = net[name]
        # Darknet's parser turns mosaic/cutmix into mixup codes; values given without the
        # parser (a plain dict) may carry only the flags.
        if "mixup" not in net or net.get("mosaic") or net.get("cutmix"):
            mosaic, cutmix = bool(net.get("mosaic")), bool(net.get("cutmix"))
            if mosaic or cutmix:
                values["mixup"] = {(True, True): 4, (False, True): 2, (True, False): 3}[
                    (mosaic, cutmix)
                ]
        values.update(overrides)
        known = {f.name for f in fields(cls)}
        unknown = set(values) - known
        if unknown:
            raise ArgumentError(f"unknown loader settings: {', '.join(sorted(unknown))}")
        return cls(**values)


def settings_from_cfg(config: NetConfig, **overrides: Any) -> LoaderSettings:
    """:class:`LoaderSettings` of a parsed cfg (``darknet_metal.model.cfg.parse_cfg``), taken as
    Darknet's ``train_detector`` takes them: ``[net]`` keys, and ``jitter``, ``resize``,
    ``random``, ``max``, ``classes`` from the last ``[yolo]`` layer.

    Raises ``CfgError`` at the offending key's line for a combination Darknet refuses
    (``cutmix``, ``mosaic`` with ``letter_box``) or a value the loader cannot use.
    """
    # The detection head whose keys Darknet reads: the last layer whose op leaves its
    # jitter to the data loader (the [yolo] layers).
    from darknet_metal.ops import op_class
    from darknet_metal.trainer.keys import DATA

    heads = [s for s in config.layers if op_class(s.kind).training_keys.get("jitter") == DATA]
    last: Section | None = heads[-1] if heads else None
    try:
        return LoaderSettings.from_values(
            config.net.values, last.values if last is not None else None, **overrides
        )
    except ArgumentError as exc:
        raise _at_key(config, last, str(exc)) from None


# Where each setting comes from: (section kind, cfg key).
_SOURCES = {
    "cutmix": ("net", "cutmix"), "letter_box": ("net", "letter_box"),
    "mosaic": ("net", "mosaic"), "mixup": ("net", "mixup"), "width": ("net", "width"),
    "height": ("net", "height"), "channels": ("net", "channels"), "batch": ("net", "batch"),
    "resize_step": ("net", "resize_step"), "hue": ("net", "hue"),
    "saturation": ("net", "saturation"), "exposure": ("net", "exposure"),
    "blur": ("net", "blur"), "gaussian_noise": ("net", "gaussian_noise"),
    "max_boxes": ("head", "max"), "classes": ("head", "classes"), "jitter": ("head", "jitter"),
    "resize": ("head", "resize"), "random": ("head", "random"),
}


def _at_key(config: NetConfig, yolo: Section | None, message: str) -> CfgError:
    """The error located at the line of the first setting its message names."""
    message = message.replace("loader settings ", "").replace("loader setting ", "")
    named = [(message.find(f"{name}="), name) for name in _SOURCES]
    named += [(message.find(f"{name} "), name) for name in _SOURCES]
    for _, name in sorted(n for n in named if n[0] >= 0):
        kind, key = _SOURCES[name]
        section = config.net if kind == "net" else yolo
        if section is not None and key in section.key_lines:
            return section.error(message, key)
    return config.net.error(message)
