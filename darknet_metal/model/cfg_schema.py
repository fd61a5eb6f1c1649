"""Every section and key of a Darknet ``.cfg`` file this package reads, as data.

The table mirrors what Darknet's own parsers read (Darknet V5 ``darknet_cfg.cpp`` and the
AlexeyAB ``parser.c`` it grew from): for each section kind, each key with its type and
Darknet's default. ``darknet_metal.model.cfg`` turns cfg text into values with it.

A default is either a value, :data:`REQUIRED` (Darknet refuses a section without the key),
:data:`NONE` (the key is optional and stored as ``None`` when absent), or :data:`COMPUTED`
(Darknet derives it from other keys; the rule is in the key's ``doc`` and is applied by
``darknet_metal.model.cfg``). Bounds are inclusive (``lo``/``hi``) or exclusive (``gt``/``lt``)
and apply to every entry of a list.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from darknet_metal.model.activations import ACTIVATIONS

# Value types of the table. Layer references are ints in the file and absolute 0-based
# layer indices once parsed.
INT = "int"
FLOAT = "float"
STR = "str"
ENUM = "enum"
INT_LIST = "list[int]"
FLOAT_LIST = "list[float]"
LAYER = "layer"
LAYER_LIST = "list[layer]"


class _Marker:
    """A default that is not a value."""

    def __init__(self, name: str) -> None:
        self._name = name

    def __repr__(self) -> str:
        return self._name


REQUIRED = _Marker("REQUIRED")
COMPUTED = _Marker("COMPUTED")
NONE = _Marker("NONE")

#: Darknet's FLT_MAX, the default of ``max_delta``.
FLT_MAX = 3.4028234663852886e38


@dataclass(frozen=True)
class Key:
    """One key of one section kind.

    ``aliases`` maps accepted spellings of an enum value to its canonical name.
    """

    name: str
    type: str
    default: Any
    lo: float | None = None
    hi: float | None = None
    gt: float | None = None
    lt: float | None = None
    choices: tuple[str, ...] = ()
    aliases: tuple[tuple[str, str], ...] = ()
    doc: str = ""


POLICIES: tuple[str, ...] = (
    "constant",
    "step",
    "exp",
    "poly",
    "steps",
    "sigmoid",
    "random",
    "sgdr",
)
IOU_LOSSES: tuple[str, ...] = ("mse", "iou", "giou", "diou", "ciou")
NMS_KINDS: tuple[str, ...] = ("default", "greedynms", "diounms", "cornersnms")
WEIGHTS_TYPES: tuple[str, ...] = ("none", "per_feature", "per_channel")
WEIGHTS_NORMALIZATIONS: tuple[str, ...] = ("none", "relu", "softmax")
COST_TYPES: tuple[str, ...] = ("sse", "masked", "smooth")

#: Section header names Darknet accepts for the kinds supported here -> canonical kind.
SECTION_ALIASES: dict[str, str] = {
    "net": "net",
    "network": "net",
    "convolutional": "convolutional",
    "conv": "convolutional",
    "connected": "connected",
    "conn": "connected",
    "maxpool": "maxpool",
    "max": "maxpool",
    "avgpool": "avgpool",
    "avg": "avgpool",
    "route": "route",
    "shortcut": "shortcut",
    "upsample": "upsample",
    # Darknet's original reorg (AlexeyAB's REORG_OLD) and its newer one.
    "reorg": "reorg",
    "reorg3d": "reorg3d",
    "scale_channels": "scale_channels",
    "sam": "sam",
    "softmax": "softmax",
    "soft": "softmax",
    "dropout": "dropout",
    "yolo": "yolo",
    "cost": "cost",
}


#: Section names Darknet knows that this package does not implement (yet).
DARKNET_UNSUPPORTED_SECTIONS: frozenset[str] = frozenset(
    {
        "activation",
        "batchnorm",
        "contrastive",
        "conv_lstm",
        "crnn",
        "crop",
        "detection",
        "empty",
        "Gaussian_yolo",
        "gru",
        "history",
        "implicit",
        "local",
        "local_avg",
        "local_avgpool",
        "lrn",
        "lstm",
        "normalization",
        "region",
        "rnn",
        "silence",
    }
)


def _flag(name: str, doc: str = "") -> Key:
    return Key(name, INT, 0, doc=doc)


# Keys Darknet reads in every layer section (not in [net]) after the layer's own keys.
COMMON_LAYER_KEYS: tuple[Key, ...] = (
    Key("clip", FLOAT, 0.0, lo=0.0, doc="clip weights to [-clip, clip] after updates; 0 = off"),
    _flag("onlyforward", "never run backward for this layer"),
    _flag("dont_update", "no update of this layer's parameters for the first N iterations"),
    _flag("burnin_update", "no update of this layer's parameters while N*burn_in > iteration"),
    _flag("stopbackward", "layers before this one are frozen"),
    _flag("train_only_bn", "freeze this layer and all before it (only batch-norm rolling "
          "statistics change)"),
    _flag("dontload", "skip this layer's weights when loading"),
    _flag("dontloadscales", "skip batch-norm scales when loading"),
    Key("learning_rate", FLOAT, 1.0, doc="per-layer multiplier of [net] learning_rate"),
)

_NET: tuple[Key, ...] = (
    Key(
        "batch",
        INT,
        1,
        lo=1,
        doc="images per iteration; Darknet's mini-batch is batch // subdivisions",
    ),
    Key("subdivisions", INT, 1, lo=1),
    Key("time_steps", INT, 1, lo=1),
    Key("width", INT, 0, lo=0),
    Key("height", INT, 0, lo=0),
    Key("channels", INT, 0, lo=0),
    Key("inputs", INT, COMPUTED, lo=0, doc="default: width * height * channels"),
    Key("max_crop", INT, COMPUTED, lo=0, doc="default: 2 * width"),
    Key("min_crop", INT, COMPUTED, lo=0, doc="default: width"),
    Key("learning_rate", FLOAT, 0.001, lo=0.0),
    Key("learning_rate_min", FLOAT, 0.00001, lo=0.0),
    Key("momentum", FLOAT, 0.9, lo=0.0),
    Key("decay", FLOAT, 0.0001, lo=0.0),
    Key("max_batches", INT, 0, lo=0),
    Key("burn_in", INT, 0, lo=0),
    Key("power", FLOAT, 4.0),
    Key("policy", ENUM, "constant", choices=POLICIES),
    Key("step", INT, 1, lo=1, doc="policy=step and sigmoid"),
    Key("scale", FLOAT, 1.0, doc="policy=step"),
    Key("steps", INT_LIST, (), lo=0, doc="policy=steps (required there) and sgdr"),
    Key("scales", FLOAT_LIST, (), doc="one per step; required with policy=steps"),
    Key("seq_scales", FLOAT_LIST, COMPUTED, doc="one per step; default: 1.0 for each step"),
    Key("gamma", FLOAT, 1.0, doc="policy=exp and sigmoid"),
    Key("sgdr_cycle", INT, COMPUTED, lo=0, doc="default: max_batches"),
    Key("sgdr_mult", INT, 2),
    Key(
        "sequential_subdivisions",
        INT,
        COMPUTED,
        lo=1,
        doc="default: subdivisions; Darknet lowers a larger value to subdivisions",
    ),
    Key("track", INT, 0),
    Key("augment_speed", INT, 2),
    Key("try_fix_nan", INT, 0),
    Key("weights_reject_freq", INT, 0, lo=0),
    Key("equidistant_point", INT, 0, lo=0),
    Key("badlabels_rejection_percentage", FLOAT, 0.0, lo=0.0),
    Key("num_sigmas_reject_badlabels", FLOAT, 0.0, lo=0.0),
    Key("ema_alpha", FLOAT, 0.0, lo=0.0, hi=1.0),
    Key("use_cuda_graph", INT, 0),
    Key("loss_scale", FLOAT, 1.0),
    Key("dynamic_minibatch", INT, 0),
    Key("optimized_memory", INT, 0, lo=0),
    Key("workspace_size_limit_MB", FLOAT, 1024.0, lo=0.0),
    Key("adam", INT, 0),
    Key("B1", FLOAT, 0.9, lo=0.0, hi=1.0, doc="adam only"),
    Key("B2", FLOAT, 0.999, lo=0.0, hi=1.0, doc="adam only"),
    Key("eps", FLOAT, 0.000001, gt=0.0, doc="adam only"),
    Key("flip", INT, 1),
    Key("blur", INT, 0),
    Key("gaussian_noise", INT, 0),
    Key(
        "mixup",
        INT,
        0,
        doc="Darknet overrides it: 4 if mosaic and cutmix, 2 if cutmix only, 3 if mosaic only",
    ),
    Key("cutmix", INT, 0),
    Key("mosaic", INT, 0),
    Key("mosaic_bound", INT, 0),
    Key("letter_box", INT, 0),
    Key("contrastive", INT, 0, doc="needs a mini-batch (batch // subdivisions) of at least 2"),
    Key("contrastive_jit_flip", INT, 0),
    Key("contrastive_color", INT, 0),
    Key("unsupervised", INT, 0),
    Key("label_smooth_eps", FLOAT, 0.0, lo=0.0, hi=1.0),
    Key("resize_step", FLOAT, 32.0),
    Key("attention", INT, 0),
    Key("adversarial_lr", FLOAT, 0.0),
    Key("max_chart_loss", FLOAT, 20.0),
    Key("angle", FLOAT, 0.0),
    Key("aspect", FLOAT, 1.0),
    Key("saturation", FLOAT, 1.0),
    Key("exposure", FLOAT, 1.0),
    Key("hue", FLOAT, 0.0),
    Key("show_receptive_field", INT, 0),
)

_CONVOLUTIONAL: tuple[Key, ...] = (
    Key("filters", INT, 1, lo=1, doc="must be a multiple of groups"),
    Key("groups", INT, 1, lo=1),
    Key("size", INT, 1, lo=1),
    Key("stride", INT, 1, lo=1),
    Key("stride_x", INT, COMPUTED, lo=1, doc="default: stride"),
    Key("stride_y", INT, COMPUTED, lo=1, doc="default: stride"),
    Key("dilation", INT, 1, lo=1, doc="forced to 1 when size == 1"),
    Key("antialiasing", INT, 0, lo=0),
    Key("pad", INT, 0, lo=0, doc="non-zero: padding = size // 2, whatever padding says"),
    Key("padding", INT, 0, lo=0, doc="pixels of zero padding on each side (see pad)"),
    Key("activation", ENUM, "logistic", choices=ACTIVATIONS),
    Key("batch_normalize", INT, 0, lo=0, doc="2 when cbn is set"),
    Key("cbn", INT, 0),
    Key("binary", INT, 0),
    Key("xnor", INT, 0),
    Key("bin_output", INT, 0),
    Key("sway", INT, 0, doc="at most one of sway/rotate/stretch/stretch_sway; needs size > 1"),
    Key("rotate", INT, 0),
    Key("stretch", INT, 0),
    Key("stretch_sway", INT, 0),
    Key("assisted_excitation", FLOAT, 0.0, doc="Darknet reads a float and keeps its int part"),
    Key("share_index", LAYER, NONE, doc="layer whose weights this one shares"),
    Key("flipped", INT, 0),
    Key("dot", FLOAT, 0.0),
    Key("angle", FLOAT, 15.0),
    Key("grad_centr", INT, 0),
    Key("reverse", FLOAT, 0.0),
    Key("coordconv", INT, 0),
    Key("stream", INT, -1),
    Key("wait_stream", INT, -1),
)

_CONNECTED: tuple[Key, ...] = (
    Key("output", INT, 1, lo=1),
    Key("activation", ENUM, "logistic", choices=ACTIVATIONS),
    Key("batch_normalize", INT, 0, lo=0),
)

_MAXPOOL: tuple[Key, ...] = (
    Key("stride", INT, 1, lo=1),
    Key("stride_x", INT, COMPUTED, lo=1, doc="default: stride"),
    Key("stride_y", INT, COMPUTED, lo=1, doc="default: stride"),
    Key("size", INT, COMPUTED, lo=1, doc="default: stride"),
    Key("padding", INT, COMPUTED, lo=0, doc="total padding (both sides); default: size - 1"),
    Key("maxpool_depth", INT, 0, lo=0),
    Key("out_channels", INT, 1, lo=1),
    Key("antialiasing", INT, 0, lo=0),
    Key("maxpool_zero_nonmax", INT, 0),
)

_AVGPOOL: tuple[Key, ...] = ()

_ROUTE: tuple[Key, ...] = (
    Key("layers", LAYER_LIST, REQUIRED, doc="<0: relative to this layer; >=0: absolute"),
    Key("groups", INT, 1, lo=1),
    Key("group_id", INT, 0, lo=0, doc="must be below groups"),
    Key("stream", INT, -1),
    Key("wait_stream", INT, -1),
)

_SHORTCUT: tuple[Key, ...] = (
    Key("from", LAYER_LIST, REQUIRED, doc="<0: relative to this layer; >=0: absolute"),
    Key("activation", ENUM, "linear", choices=ACTIVATIONS),
    Key(
        "weights_type",
        ENUM,
        "none",
        choices=WEIGHTS_TYPES,
        aliases=(("per_layer", "per_feature"),),
    ),
    Key(
        "weights_normalization",
        ENUM,
        "none",
        choices=WEIGHTS_NORMALIZATIONS,
        aliases=(("avg_relu", "relu"),),
    ),
)

_UPSAMPLE: tuple[Key, ...] = (
    Key("stride", INT, 2, doc="non-zero; negative downsamples by -stride"),
    Key("scale", FLOAT, 1.0),
)

_REORG: tuple[Key, ...] = (
    Key("stride", INT, 1, lo=1),
    Key("reverse", INT, 0),
)

_SCALE_CHANNELS: tuple[Key, ...] = (
    Key("from", LAYER, REQUIRED, doc="<0: relative to this layer; >=0: absolute"),
    Key("scale_wh", INT, 0),
    Key("activation", ENUM, "linear", choices=ACTIVATIONS, doc="swish and mish are refused"),
)

_SAM: tuple[Key, ...] = (
    Key("from", LAYER, REQUIRED, doc="<0: relative to this layer; >=0: absolute"),
    Key("activation", ENUM, "linear", choices=ACTIVATIONS, doc="swish and mish are refused"),
)

_SOFTMAX: tuple[Key, ...] = (
    Key("groups", INT, 1, lo=1),
    Key("temperature", FLOAT, 1.0, gt=0.0),
    Key("tree", STR, NONE, doc="hierarchy file (e.g. 9k.tree)"),
    Key("spatial", FLOAT, 0.0),
    Key("noloss", INT, 0),
)

_DROPOUT: tuple[Key, ...] = (
    Key("probability", FLOAT, 0.2, lo=0.0, lt=1.0, doc="outputs scale by 1 / (1 - probability)"),
    Key("dropblock", INT, 0),
    Key(
        "dropblock_size_rel",
        FLOAT,
        0.0,
        lo=0.0,
        hi=1.0,
        doc="set to 0 when dropblock_size_abs is also set",
    ),
    Key(
        "dropblock_size_abs",
        FLOAT,
        0.0,
        lo=0.0,
        doc="Darknet keeps the int part; 7 when dropblock is on and no size is given",
    ),
)

_YOLO: tuple[Key, ...] = (
    Key("classes", INT, 20, lo=1),
    Key(
        "num",
        INT,
        COMPUTED,
        lo=1,
        hi=65536,
        doc="total anchors; default: len(anchors) / 2, or 1 without anchors",
    ),
    Key("mask", INT_LIST, COMPUTED, lo=0, doc="anchors used here; default: 0 .. num-1"),
    Key("anchors", FLOAT_LIST, COMPUTED, doc="w,h pairs in pixels; default: 0.5 for all"),
    Key("max", INT, 200, lo=1, doc="max ground-truth boxes per image"),
    Key("max_delta", FLOAT, FLT_MAX, lo=0.0),
    Key("counters_per_class", INT_LIST, NONE, doc="one per class; values below 1 count as 1"),
    Key("label_smooth_eps", FLOAT, 0.0, lo=0.0, hi=1.0),
    Key("scale_x_y", FLOAT, 1.0),
    Key("objectness_smooth", INT, 0),
    Key("new_coords", INT, 0),
    Key("iou_normalizer", FLOAT, 0.75),
    Key("obj_normalizer", FLOAT, 1.0),
    Key("cls_normalizer", FLOAT, 1.0),
    Key("delta_normalizer", FLOAT, 1.0),
    Key("iou_loss", ENUM, "mse", choices=IOU_LOSSES),
    Key("iou_thresh_kind", ENUM, "iou", choices=IOU_LOSSES),
    Key("beta_nms", FLOAT, 0.6, lo=0.0, hi=1.0),
    Key("nms_kind", ENUM, "default", choices=NMS_KINDS),
    Key("jitter", FLOAT, 0.2, lo=0.0),
    Key("resize", FLOAT, 1.0, lo=0.0),
    Key("focal_loss", INT, 0),
    Key("ignore_thresh", FLOAT, 0.5, lo=0.0, hi=1.0),
    Key("truth_thresh", FLOAT, 1.0, lo=0.0, hi=1.0),
    Key("iou_thresh", FLOAT, 1.0, lo=0.0, hi=1.0),
    Key("random", FLOAT, 0.0, lo=0.0),
    Key("track_history_size", INT, 5, lo=0),
    Key("sim_thresh", FLOAT, 0.8, lo=0.0, hi=1.0),
    Key("dets_for_track", INT, 1, lo=0),
    Key("dets_for_show", INT, 1, lo=0),
    Key("track_ciou_norm", FLOAT, 0.01),
    Key("embedding_layer", LAYER, NONE, doc="layer holding tracking embeddings"),
    Key("map", STR, NONE, doc="class-id map file"),
    Key("show_details", INT, 1),
)

_COST: tuple[Key, ...] = (
    Key("type", ENUM, "sse", choices=COST_TYPES),
    Key("scale", FLOAT, 1.0),
    Key("ratio", FLOAT, 0.0),
)

#: kind -> every key Darknet reads in that section, in Darknet's reading order.
SCHEMA: dict[str, tuple[Key, ...]] = {
    "net": _NET,
    "convolutional": _CONVOLUTIONAL + COMMON_LAYER_KEYS,
    "connected": _CONNECTED + COMMON_LAYER_KEYS,
    "maxpool": _MAXPOOL + COMMON_LAYER_KEYS,
    "avgpool": _AVGPOOL + COMMON_LAYER_KEYS,
    "route": _ROUTE + COMMON_LAYER_KEYS,
    "shortcut": _SHORTCUT + COMMON_LAYER_KEYS,
    "upsample": _UPSAMPLE + COMMON_LAYER_KEYS,
    "reorg": _REORG + COMMON_LAYER_KEYS,
    "reorg3d": _REORG + COMMON_LAYER_KEYS,
    "scale_channels": _SCALE_CHANNELS + COMMON_LAYER_KEYS,
    "sam": _SAM + COMMON_LAYER_KEYS,
    "softmax": _SOFTMAX + COMMON_LAYER_KEYS,
    "dropout": _DROPOUT + COMMON_LAYER_KEYS,
    "yolo": _YOLO + COMMON_LAYER_KEYS,
    "cost": _COST + COMMON_LAYER_KEYS,
}
