"""What training does with every cfg key that can change it: honoured, or refused.

Darknet's CPU build silently ignores some training keys (``adam=1`` is parsed and then never
used). Here every key that affects training has one of these dispositions, checked by
``check_training_keys`` when training starts:

- ``IMPLEMENTED``: training does what Darknet does with it;
- ``REFUSED``: not implemented; a value other than the default raises ``CfgError`` at the
  key's line, with the reason;
- ``DATA``: read by the data loader (augmentation, image sizes), not by a training step on
  prepared batches; the trainer that loads datasets applies it;
- ``NO_EFFECT``: a setting of Darknet's CUDA build or its console output that changes no
  number (memory limits, CUDA graphs, chart scale), accepted and ignored.

``tests/test_training_keys.py`` holds the table against the schema: every key of every
section kind that training runs is listed here or in ``INFERENCE_ONLY``.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass
from typing import Any

from darknet_metal.cfg import NetConfig, Section
from darknet_metal.cfg_schema import COMPUTED, NONE, REQUIRED, SCHEMA

IMPLEMENTED = "implemented"
REFUSED = "refused"
DATA = "data"
NO_EFFECT = "no effect"


@dataclass(frozen=True)
class TrainingKey:
    """The disposition of ``key`` in sections of kind ``section`` ("*": every layer kind)."""

    section: str
    key: str
    status: str
    why: str = ""


def _keys(section: str, status: str, names: str, why: str = "") -> list[TrainingKey]:
    return [TrainingKey(section, name, status, why) for name in names.split()]


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
    + _keys("*", IMPLEMENTED, "onlyforward dont_update burnin_update stopbackward "
            "train_only_bn learning_rate dontload dontloadscales")
    + _keys("*", REFUSED, "clip", "weight clipping after updates (Darknet's CUDA build only) "
            "is not supported")
    + _keys("convolutional", REFUSED, "batch_normalize cbn", "cross-mini-batch batch norm "
            "(batch_normalize=2) is not supported")
    + _keys("convolutional", REFUSED, "grad_centr", "gradient centralization (Darknet's CUDA "
            "build only) is not supported")
    + _keys("convolutional", REFUSED, "reverse flipped dot assisted_excitation coordconv",
            "this convolution variant is not supported in training")
    + _keys("dropout", REFUSED, "dropblock dropblock_size_rel dropblock_size_abs",
            "DropBlock is not supported")
    + _keys("softmax", REFUSED, "tree spatial", "hierarchical and spatial softmax are not "
            "supported")
    + _keys("softmax", IMPLEMENTED, "noloss groups temperature")
    + _keys("cost", IMPLEMENTED, "type scale")
    + _keys("cost", REFUSED, "ratio", "keeping only the largest deltas (ratio) is not "
            "supported")
    + _keys("maxpool", REFUSED, "maxpool_zero_nonmax", "zeroing non-maximal inputs is not "
            "supported in training")
    + _keys("yolo", DATA, "jitter resize random")
    + _keys("yolo", IMPLEMENTED, "classes num mask anchors max max_delta counters_per_class "
            "label_smooth_eps scale_x_y new_coords iou_normalizer obj_normalizer "
            "cls_normalizer iou_loss ignore_thresh truth_thresh iou_thresh")
    + _keys("yolo", REFUSED, "objectness_smooth focal_loss delta_normalizer iou_thresh_kind",
            "this [yolo] loss option is not supported")
    + _keys("yolo", REFUSED, "embedding_layer track_history_size sim_thresh dets_for_track "
            "track_ciou_norm", "tracking embeddings are not supported")
)

def _pairs(table: dict[str, str]) -> frozenset[tuple[str, str]]:
    return frozenset((section, key) for section, names in table.items() for key in names.split())


#: Keys that only change inference.
INFERENCE_ONLY: frozenset[tuple[str, str]] = _pairs({
    "yolo": "beta_nms nms_kind dets_for_show map show_details",
    "convolutional": "stream wait_stream",
    "route": "stream wait_stream",
})

#: Keys that define the network itself (shapes, sources, activations), the same in training
#: as at inference, or that are refused when the layer is built.
STRUCTURE: frozenset[tuple[str, str]] = _pairs({
    "convolutional": "filters groups size stride stride_x stride_y dilation antialiasing pad "
                     "padding activation binary xnor bin_output sway rotate stretch "
                     "stretch_sway share_index angle",
    "connected": "output activation batch_normalize",
    "maxpool": "stride stride_x stride_y size padding maxpool_depth out_channels antialiasing",
    "route": "layers groups group_id",
    "shortcut": "from activation weights_type weights_normalization",
    "upsample": "stride scale",
    "reorg": "stride reverse",
    "scale_channels": "from scale_wh activation",
    "sam": "from activation",
    "dropout": "probability",
})

_BY_KEY = {(k.section, k.key): k for k in TRAINING_KEYS}


def disposition(kind: str, key: str) -> TrainingKey | None:
    """The disposition of ``key`` in a ``[kind]`` section, or None for a key that only
    shapes the network (sizes, sources, activations)."""
    return _BY_KEY.get((kind, key)) or (_BY_KEY.get(("*", key)) if kind != "net" else None)


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
        default = _default(section.kind, key)
        if key == "batch_normalize":
            if value == 2:
                yield key, rule.why
            continue
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
