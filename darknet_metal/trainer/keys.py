"""What training does with every cfg key that can change it: honoured, or refused.

Darknet's CPU build silently ignores some training keys (``adam=1`` is parsed and then never
used). Here every key that affects training has one of these dispositions, checked by
``check_training_keys`` when training starts:

- ``IMPLEMENTED``: training does what Darknet does with it;
- ``REFUSED``: not implemented; a value other than the default raises ``CfgError`` at the
  key's line, with the reason;
- ``DATA``: read by the data loader (augmentation, image sizes), not by a training step on
  prepared batches; ``darknet_metal.training.loading`` applies it (``darknet-metal train``);
- ``NO_EFFECT``: a setting of Darknet's CUDA build or its console output that changes no
  number (memory limits, CUDA graphs, chart scale), accepted and ignored.

The ``[net]`` keys and the keys every layer takes are tabled here; each op lists its kind's
own in ``training_keys`` (key -> one of these, or the reason it is refused); the keys it does
not list shape the network and train as they infer. ``tests/training/test_training_keys.py``
holds the tables against the schema.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass
from typing import Any

from darknet_metal.model.cfg import NetConfig, Section
from darknet_metal.model.cfg_schema import COMPUTED, NONE, REQUIRED, SCHEMA
from darknet_metal.ops import op_class
from darknet_metal.ops.key_dispositions import (
    DATA,
    IMPLEMENTED,
    INFERENCE_ONLY,
    NO_EFFECT,
    REFUSED,
)


@dataclass(frozen=True)
class TrainingKey:
    """The disposition of ``key`` in sections of kind ``section`` ("*": every layer kind)."""

    section: str
    key: str
    status: str
    why: str = ""


def _keys(section: str, status: str, names: str, why: str = "") -> list[TrainingKey]:
    return [TrainingKey(section, name, status, why) for name in names.split()]


#: ``[net]`` keys, and the keys every layer section takes (``"*"``).
TRAINING_KEYS: tuple[TrainingKey, ...] = tuple(
    _keys("net", IMPLEMENTED, "batch subdivisions learning_rate momentum decay policy step "
          "scale steps scales gamma power burn_in max_batches sgdr_cycle sgdr_mult "
          "learning_rate_min adam B1 B2 eps width height channels inputs")
    + _keys("net", DATA, "flip blur gaussian_noise mixup cutmix mosaic mosaic_bound letter_box "
            "angle aspect saturation exposure hue label_smooth_eps resize_step max_crop "
            "min_crop")
    + _keys("net", NO_EFFECT, "use_cuda_graph optimized_memory workspace_size_limit_MB "
            "max_chart_loss show_receptive_field")
    + _keys("net", REFUSED, "time_steps track augment_speed seq_scales sequential_subdivisions",
            "sequence (tracking) training is not supported")
    + _keys("net", REFUSED, "try_fix_nan", "Darknet's CUDA-only delta clamping is not "
            "reproduced; a step producing NaN or inf raises NonFiniteError instead")
    + _keys("net", REFUSED, "weights_reject_freq equidistant_point "
            "badlabels_rejection_percentage num_sigmas_reject_badlabels",
            "weight and bad-label rejection are not supported")
    + _keys("net", REFUSED, "ema_alpha", "exponential moving averages of the weights are not "
            "supported")
    + _keys("net", REFUSED, "loss_scale", "loss scaling (Darknet's mixed-precision CUDA "
            "training) is not supported")
    + _keys("net", REFUSED, "dynamic_minibatch", "dynamic mini-batch sizes are not supported")
    + _keys("net", REFUSED, "contrastive contrastive_jit_flip contrastive_color unsupervised",
            "contrastive and unsupervised training are not supported")
    + _keys("net", REFUSED, "attention adversarial_lr", "attention and adversarial training "
            "are not supported")
    + _keys("*", IMPLEMENTED, "stopbackward onlyforward learning_rate dontload "
            "dontloadscales dont_update burnin_update train_only_bn")
    + _keys("*", REFUSED, "clip", "weight clipping after updates (Darknet's CUDA build only) "
            "is not supported")
)

_BY_KEY = {(k.section, k.key): k for k in TRAINING_KEYS}


def disposition(kind: str, key: str) -> TrainingKey | None:
    """The disposition of ``key`` in a ``[kind]`` section: the ``[net]`` table, the common
    layer keys, then the op's ``training_keys`` (None for a key that shapes the network and
    trains as it infers)."""
    if kind == "net":
        return _BY_KEY.get(("net", key))
    rule = _BY_KEY.get(("*", key))
    if rule is not None:
        return rule

    value = op_class(kind).training_keys.get(key)
    if value is None:
        return None
    if value in (IMPLEMENTED, DATA, NO_EFFECT, INFERENCE_ONLY):
        return TrainingKey(kind, key, value)
    return TrainingKey(kind, key, REFUSED, value)


def _default(kind: str, key: str) -> Any:
    for k in SCHEMA[kind]:
        if k.name == key:
            return k.default
    return None


def _refusals(section: Section) -> Iterable[tuple[str, str]]:
    for key, value in section.values.items():
        rule = disposition(section.kind, key)
        if rule is None or rule.status != REFUSED:
            continue
        if key == "batch_normalize" and value != 2:
            continue  # plain batch norm trains; 2 (cbn) is what is refused
        default = _default(section.kind, key)
        if default in (COMPUTED, REQUIRED) or key not in section.key_lines:
            continue  # derived or absent: the default behaviour
        if default is NONE:
            default = None
        if value != default and not (isinstance(default, tuple) and list(value) == list(default)):
            yield key, rule.why


def check_training_keys(config: NetConfig) -> None:
    """Raises ``CfgError`` at the first key (``[net]`` first, then layers in order) whose
    value asks for something training does not do."""
    for section in (config.net, *config.layers):
        for key, why in _refusals(section):
            raise section.error(f"{key}={section.values[key]!r} cannot be trained: {why}", key)
