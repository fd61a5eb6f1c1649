"""The cfg parser against the official cfg files and Darknet's documented defaults.

Expected values are read by eye from the cfg files in ../shared/models and from Darknet's
parser source (hank-ai/darknet src-lib/darknet_cfg.cpp, AlexeyAB/darknet src/parser.c).
"""

from __future__ import annotations

import pathlib

import pytest
from shared_paths import SHARED

from darknet_metal.errors import CfgError
from darknet_metal.model.cfg import SECTION_KINDS, NetConfig, Section, parse_cfg, parse_cfg_text
from darknet_metal.model.cfg_schema import SCHEMA

CFG_DIR = SHARED / "models" / "cfg"
REAL_TINY = SHARED / "models" / "yolov3-tiny" / "yolov3-tiny.cfg"

NET = "[net]\nwidth=64\nheight=64\nchannels=3\n"  # lines 1-4
FLT_MAX = 3.4028234663852886e38


def parse(body: str) -> NetConfig:
    return parse_cfg_text(NET + body, path="t.cfg")


def layer(body: str) -> Section:
    """The last layer of ``NET + body``."""
    return parse(body).layers[-1]


def error(text: str) -> CfgError:
    with pytest.raises(CfgError) as info:
        parse_cfg_text(text, path="t.cfg")
    assert info.value.path == "t.cfg"
    return info.value


# --- official cfgs ---------------------------------------------------------------------------


@pytest.mark.parametrize("path", [REAL_TINY, CFG_DIR / "yolov3-tiny.cfg"], ids=["real", "cfg"])
def test_yolov3_tiny(path: pathlib.Path) -> None:
    cfg = parse_cfg(path)
    assert cfg.path == str(path)
    net = cfg.net.values
    assert (cfg.net.kind, cfg.net.line, cfg.net.index) == ("net", 1, -1)
    assert (net["width"], net["height"], net["channels"]) == (416, 416, 3)
    assert (net["batch"], net["subdivisions"]) == (1, 1)
    assert net["momentum"] == 0.9 and net["decay"] == 0.0005
    assert (net["saturation"], net["exposure"], net["hue"]) == (1.5, 1.5, 0.1)
    assert (net["learning_rate"], net["burn_in"], net["max_batches"]) == (0.001, 1000, 500200)
    assert net["policy"] == "steps"
    assert net["steps"] == [400000, 450000] and net["scales"] == [0.1, 0.1]
    assert net["inputs"] == 416 * 416 * 3
    assert cfg.net.key_lines["saturation"] == 14  # "saturation = 1.5"

    kinds = ["convolutional", "maxpool"] * 6 + ["convolutional"] * 4 + ["yolo", "route"]
    kinds += ["convolutional", "upsample", "route", "convolutional", "convolutional", "yolo"]
    assert [s.kind for s in cfg.layers] == kinds
    assert [s.index for s in cfg.layers] == list(range(24))
    assert [s.line for s in cfg.layers[:3]] == [25, 33, 37]
    assert cfg.layers[-1].line == 174

    conv0 = cfg.layers[0].values
    assert (conv0["filters"], conv0["size"], conv0["stride"], conv0["pad"]) == (16, 3, 1, 1)
    assert conv0["padding"] == 1 and conv0["batch_normalize"] == 1
    assert conv0["activation"] == "leaky"
    assert cfg.layers[0].key_lines == {
        "batch_normalize": 26,
        "filters": 27,
        "size": 28,
        "stride": 29,
        "pad": 30,
        "activation": 31,
    }
    # Layer 11 is "[maxpool] size=2 stride=1": Darknet pads by size - 1.
    pool = cfg.layers[11].values
    assert (pool["size"], pool["stride"], pool["padding"]) == (2, 1, 1)
    assert (pool["stride_x"], pool["stride_y"]) == (1, 1)
    assert cfg.layers[1].values["padding"] == 1  # size=2 stride=2

    anchors = [10, 14, 23, 27, 37, 58, 81, 82, 135, 169, 344, 319]
    for idx, mask in ((16, [3, 4, 5]), (23, [0, 1, 2])):
        yolo = cfg.layers[idx].values
        assert yolo["mask"] == mask
        assert yolo["anchors"] == [float(a) for a in anchors]
        assert (yolo["classes"], yolo["num"]) == (80, 6)
        assert (yolo["jitter"], yolo["ignore_thresh"], yolo["truth_thresh"]) == (0.3, 0.7, 1.0)
        assert yolo["random"] == 1.0
    assert cfg.layers[17].values["layers"] == [13]  # layers = -4
    assert cfg.layers[20].values["layers"] == [19, 8]  # layers = -1, 8
    assert cfg.layers[19].values["stride"] == 2  # upsample


def test_yolov4_tiny() -> None:
    cfg = parse_cfg(CFG_DIR / "yolov4-tiny.cfg")
    assert len(cfg.layers) == 38
    assert cfg.net.values["width"] == 416
    route = cfg.layers[3]
    assert route.kind == "route" and route.line == 58
    assert route.values["layers"] == [2]
    assert (route.values["groups"], route.values["group_id"]) == (2, 1)
    assert cfg.layers[6].values["layers"] == [5, 4]  # layers = -1,-2
    assert cfg.layers[8].values["layers"] == [2, 7]  # layers = -6,-1
    assert cfg.layers[34].values["layers"] == [33, 23]  # layers = -1, 23
    yolo = cfg.layers[30].values
    assert yolo["mask"] == [3, 4, 5] and cfg.layers[37].values["mask"] == [1, 2, 3]
    assert yolo["anchors"][:4] == [10.0, 14.0, 23.0, 27.0] and len(yolo["anchors"]) == 12
    assert (yolo["scale_x_y"], yolo["iou_normalizer"], yolo["iou_loss"]) == (1.05, 0.07, "ciou")
    assert (yolo["nms_kind"], yolo["beta_nms"], yolo["resize"]) == ("greedynms", 0.6, 1.5)
    assert yolo["jitter"] == 0.3


def test_yolov4() -> None:
    cfg = parse_cfg(CFG_DIR / "yolov4.cfg")
    assert len(cfg.layers) == 162
    net = cfg.net.values
    assert (net["width"], net["mosaic"]) == (608, 1)
    assert net["mixup"] == 3  # Darknet: mosaic without cutmix -> mixup = 3
    assert cfg.layers[7].kind == "shortcut" and cfg.layers[7].values["from"] == [4]
    assert cfg.layers[7].values["activation"] == "linear"
    assert cfg.layers[0].values["activation"] == "mish"
    for idx, size in ((108, 5), (110, 9), (112, 13)):  # the SPP block
        pool = cfg.layers[idx].values
        assert (pool["size"], pool["stride"], pool["padding"]) == (size, 1, size - 1)
    assert cfg.layers[113].values["layers"] == [112, 110, 108, 107]
    assert cfg.layers[119].values["layers"] == [85]
    yolo = cfg.layers[139].values
    assert cfg.layers[139].line == 965
    assert (yolo["scale_x_y"], yolo["iou_thresh"], yolo["max_delta"]) == (1.2, 0.213, 5.0)


def test_yolov3() -> None:
    cfg = parse_cfg(CFG_DIR / "yolov3.cfg")
    assert len(cfg.layers) == 107
    shortcuts = [s for s in cfg.layers if s.kind == "shortcut"]
    assert len(shortcuts) == 23
    assert all(s.values["from"] == [s.index - 3] for s in shortcuts)
    assert [s.index for s in cfg.layers if s.kind == "yolo"] == [82, 94, 106]


def test_section_kinds() -> None:
    assert SECTION_KINDS[0] == "net"
    assert set(SECTION_KINDS) == {
        "net",
        "convolutional",
        "connected",
        "maxpool",
        "avgpool",
        "route",
        "shortcut",
        "upsample",
        "reorg",
        "reorg3d",
        "scale_channels",
        "sam",
        "softmax",
        "dropout",
        "yolo",
        "cost",
    }


# --- defaults (values from Darknet's parser source) ------------------------------------------


def test_net_defaults() -> None:
    cfg = parse("[avgpool]\n")
    v = cfg.net.values
    expected = {
        "batch": 1,
        "subdivisions": 1,
        "time_steps": 1,
        "max_batches": 0,
        "learning_rate": 0.001,
        "learning_rate_min": 0.00001,
        "momentum": 0.9,
        "decay": 0.0001,
        "policy": "constant",
        "burn_in": 0,
        "power": 4.0,
        "step": 1,
        "scale": 1.0,
        "gamma": 1.0,
        "steps": [],
        "scales": [],
        "seq_scales": [],
        "sgdr_cycle": 0,
        "sgdr_mult": 2,
        "sequential_subdivisions": 1,
        "augment_speed": 2,
        "loss_scale": 1.0,
        "workspace_size_limit_MB": 1024.0,
        "B1": 0.9,
        "B2": 0.999,
        "eps": 0.000001,
        "flip": 1,
        "mixup": 0,
        "mosaic": 0,
        "letter_box": 0,
        "label_smooth_eps": 0.0,
        "resize_step": 32.0,
        "max_chart_loss": 20.0,
        "angle": 0.0,
        "aspect": 1.0,
        "saturation": 1.0,
        "exposure": 1.0,
        "hue": 0.0,
        "inputs": 64 * 64 * 3,
        "max_crop": 128,
        "min_crop": 64,
    }
    assert {k: v[k] for k in expected} == expected
    assert set(v) == {k.name for k in SCHEMA["net"]}


def test_layer_defaults() -> None:
    cfg = parse(
        "[conv]\n[maxpool]\n[upsample]\n[route]\nlayers=-1\n[shortcut]\nfrom=-2\n"
        "[dropout]\n[softmax]\n[cost]\n[reorg]\n[yolo]\n[connected]\n"
    )
    conv, pool, up, route, short, drop, soft, cost, reorg, yolo, conn = (
        s.values for s in cfg.layers
    )
    assert (conv["filters"], conv["size"], conv["stride"], conv["groups"]) == (1, 1, 1, 1)
    assert (conv["padding"], conv["dilation"], conv["activation"]) == (0, 1, "logistic")
    assert (conv["batch_normalize"], conv["angle"], conv["share_index"]) == (0, 15.0, None)
    assert (conv["stream"], conv["wait_stream"]) == (-1, -1)
    assert (pool["stride"], pool["size"], pool["padding"]) == (1, 1, 0)
    assert (pool["out_channels"], pool["maxpool_depth"]) == (1, 0)
    assert (up["stride"], up["scale"]) == (2, 1.0)
    assert (route["groups"], route["group_id"]) == (1, 0)
    assert (short["activation"], short["weights_type"]) == ("linear", "none")
    assert short["weights_normalization"] == "none"
    assert (drop["probability"], drop["dropblock"], drop["dropblock_size_abs"]) == (0.2, 0, 0.0)
    assert (soft["groups"], soft["temperature"], soft["tree"]) == (1, 1.0, None)
    assert (cost["type"], cost["scale"], cost["ratio"]) == ("sse", 1.0, 0.0)
    assert (reorg["stride"], reorg["reverse"]) == (1, 0)
    assert (conn["output"], conn["activation"]) == (1, "logistic")
    assert (yolo["classes"], yolo["num"], yolo["mask"], yolo["max"]) == (20, 1, [0], 200)
    assert yolo["anchors"] == [0.5, 0.5]  # make_yolo_layer fills biases with .5
    assert (yolo["jitter"], yolo["ignore_thresh"], yolo["truth_thresh"]) == (0.2, 0.5, 1.0)
    assert (yolo["iou_thresh"], yolo["iou_normalizer"], yolo["cls_normalizer"]) == (1.0, 0.75, 1.0)
    assert (yolo["iou_loss"], yolo["iou_thresh_kind"]) == ("mse", "iou")
    assert (yolo["nms_kind"], yolo["beta_nms"]) == ("default", 0.6)
    assert (yolo["scale_x_y"], yolo["max_delta"], yolo["resize"]) == (1.0, FLT_MAX, 1.0)
    assert (yolo["random"], yolo["embedding_layer"], yolo["map"]) == (0.0, None, None)
    for section in cfg.layers:
        v = section.values
        assert (v["learning_rate"], v["clip"], v["stopbackward"], v["dontload"]) == (1.0, 0.0, 0, 0)
        assert set(v) == {k.name for k in SCHEMA[section.kind]}


def test_layer_learning_rate_is_a_scale() -> None:
    cfg = parse("[conv]\nlearning_rate=0.5\n")
    assert cfg.layers[0].values["learning_rate"] == 0.5
    assert cfg.net.values["learning_rate"] == 0.001


# --- derived values ----------------------------------------------------------------------


def test_conv_padding_and_strides() -> None:
    assert layer("[conv]\nsize=3\npad=1\n").values["padding"] == 1
    assert layer("[conv]\nsize=5\npad=1\n").values["padding"] == 2
    assert layer("[conv]\nsize=3\npad=1\npadding=4\n").values["padding"] == 1  # pad wins
    assert layer("[conv]\nsize=3\npadding=4\n").values["padding"] == 4
    assert layer("[conv]\nsize=1\ndilation=2\n").values["dilation"] == 1
    assert layer("[conv]\nsize=3\ndilation=2\n").values["dilation"] == 2
    v = layer("[conv]\nstride=2\nstride_y=1\n").values
    assert (v["stride"], v["stride_x"], v["stride_y"]) == (2, 2, 1)
    assert layer("[conv]\ncbn=1\n").values["batch_normalize"] == 2
    assert layer("[conv]\nassisted_excitation=0.9\n").values["assisted_excitation"] == 0.0
    assert layer("[conv]\nfilters=8\ngroups=4\n").values["groups"] == 4


def test_maxpool_derived() -> None:
    v = layer("[max]\nstride=2\n").values
    assert (v["size"], v["padding"], v["stride_x"], v["stride_y"]) == (2, 1, 2, 2)
    v = layer("[maxpool]\nsize=3\nstride=2\npadding=0\nstride_x=1\n").values
    assert (v["size"], v["padding"], v["stride_x"], v["stride_y"]) == (3, 0, 1, 2)


def test_yolo_derived() -> None:
    v = layer("[yolo]\nanchors=1,2, 3,4 ,5,6\n").values
    assert (v["num"], v["mask"], v["anchors"]) == (3, [0, 1, 2], [1.0, 2.0, 3.0, 4.0, 5.0, 6.0])
    v = layer("[yolo]\nnum=2\nmask=1\n").values
    assert (v["num"], v["mask"], v["anchors"]) == (2, [1], [0.5] * 4)
    v = layer("[yolo]\nclasses=3\ncounters_per_class=0, 5, -2\n").values
    assert v["counters_per_class"] == [1, 5, 1]


def test_net_derived() -> None:
    v = parse_cfg_text(
        "[network]\ninputs=10\nbatch=8\nsubdivisions=2\nsequential_subdivisions=5\n"
        "max_batches=100\nmosaic=1\ncutmix=1\npolicy=sgdr\nsteps=10,20\n[conn]\n"
    ).net.values
    assert (v["inputs"], v["width"], v["sequential_subdivisions"]) == (10, 0, 2)
    assert (v["sgdr_cycle"], v["mixup"], v["seq_scales"]) == (100, 4, [1.0, 1.0])
    assert parse_cfg_text(NET + "cutmix=1\n[conn]\n").net.values["mixup"] == 2
    v = parse_cfg_text(NET + "sgdr_cycle=7\nmax_crop=5\n[conn]\n").net.values
    assert (v["sgdr_cycle"], v["max_crop"]) == (7, 5)


def test_dropout_and_enum_aliases() -> None:
    v = layer("[dropout]\ndropblock=1\n").values
    assert (v["dropblock_size_abs"], v["dropblock_size_rel"]) == (7.0, 0.0)
    v = layer("[dropout]\ndropblock=1\ndropblock_size_rel=0.5\ndropblock_size_abs=3.7\n").values
    assert (v["dropblock_size_abs"], v["dropblock_size_rel"]) == (3.0, 0.0)
    v = layer(
        "[conv]\n[shortcut]\nfrom=0\nweights_type=per_layer\nweights_normalization=avg_relu\n"
    )
    assert (v.values["weights_type"], v.values["weights_normalization"]) == ("per_feature", "relu")


def test_layer_references() -> None:
    cfg = parse(
        "[conv]\n[conv]\n[conv]\n[route]\nlayers=-1,0, -3\n[shortcut]\nfrom=-4, 2\n"
        "[sam]\nfrom=1\n[scale_channels]\nfrom=-2\n[conv]\nshare_index=-7\n[yolo]\n"
        "embedding_layer=-1\n"
    )
    route, short, sam, scale, conv, yolo = cfg.layers[3:]
    assert route.values["layers"] == [2, 0, 0]
    assert short.values["from"] == [0, 2]
    assert sam.values["from"] == 1 and scale.values["from"] == 4
    assert conv.values["share_index"] == 0
    assert yolo.values["embedding_layer"] == 7


def test_aliases() -> None:
    cfg = parse_cfg_text(
        "[network]\nwidth=8\nheight=8\nchannels=1\n[conv]\n[max]\n[avg]\n[conn]\n[soft]\n"
    )
    assert cfg.net.kind == "net"
    assert [s.kind for s in cfg.layers] == [
        "convolutional",
        "maxpool",
        "avgpool",
        "connected",
        "softmax",
    ]
    assert cfg.path == "<string>"


# --- lexical rules -------------------------------------------------------------------------


def test_comments_whitespace_and_line_ends() -> None:
    text = (
        "\ufeff# leading comment\r\n"  # 1 (byte-order mark)
        "[ net ]\r\n"  # 2
        "  width = 32   # trailing comment\r\n"  # 3
        "\theight\t=\t32\r\n"  # 4
        "channels=3#no space\r\n"  # 5
        "; semicolon comment\r\n"  # 6
        "   ;indented\r\n"  # 7
        "\r\n"  # 8
        "[convolutional]  # trailing\r\n"  # 9
        "activation = leaky\r\n"  # 10
        "#size=5\r\n"  # 11
        "   # indented comment\n"  # 12
        "[yolo]\n"  # 13
        "anchors = 10,14,  23,27,\n"  # 14: one trailing comma is ignored, as in Darknet
    )
    cfg = parse_cfg_text(text)
    assert (cfg.net.line, cfg.net.key_lines) == (2, {"width": 3, "height": 4, "channels": 5})
    assert (cfg.net.values["width"], cfg.net.values["height"]) == (32, 32)
    conv = cfg.layers[0]
    assert (conv.line, conv.values["activation"], conv.values["size"]) == (9, "leaky", 1)
    assert cfg.layers[1].values["anchors"] == [10.0, 14.0, 23.0, 27.0]
    assert cfg.layers[1].line == 13


def test_number_syntax() -> None:
    v = layer("[conv]\nfilters=+8\nsize=3.0\nangle=-1e1\ndot=.5\nreverse=2.\n").values
    assert (v["filters"], v["size"], v["angle"], v["dot"], v["reverse"]) == (8, 3, -10.0, 0.5, 2.0)
    assert type(v["size"]) is int and type(v["dot"]) is float


def test_parse_cfg_file(tmp_path: pathlib.Path) -> None:
    path = tmp_path / "tiny.cfg"
    path.write_bytes((NET + "[conv]\n").encode("utf-8"))
    cfg = parse_cfg(path)
    assert cfg.path == str(path) and cfg.layers[0].path == str(path)


def test_section_error_points_at_key_or_header() -> None:
    conv = layer("[conv]\nsize=3\n")
    err = conv.error("bad size", "size")
    assert (err.path, err.line, err.key) == ("t.cfg", 6, "size")
    assert "bad size" in str(err) and "t.cfg:6" in str(err)
    err = conv.error("no filters given", "filters")
    assert (err.line, err.key) == (5, "filters")
    assert conv.error("whole layer").line == 5


# --- errors ----------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("body", "line", "key", "words"),
    [
        ("[conv]\nsize=abc\n", 6, "size", ["'abc'", "integer"]),
        ("[conv]\nsize=3.5\n", 6, "size", ["'3.5'", "integer"]),
        ("[conv]\nsize=1e1\n", 6, "size", ["integer"]),
        ("[conv]\nsize=0\n", 6, "size", ["size=0", "range"]),
        ("[conv]\nstride=0\n", 6, "stride", ["stride=0"]),
        ("[conv]\nfilters=0\n", 6, "filters", ["filters=0"]),
        ("[conv]\ngroups=0\n", 6, "groups", ["groups=0"]),
        ("[conv]\nfilters=6\ngroups=4\n", 6, "filters", ["groups=4"]),
        ("[conv]\nsize=99999999999\n", 6, "size", ["32-bit"]),
        ("[conv]\nangle=nan\n", 6, "angle", ["number"]),
        ("[conv]\nangle=1e39\n", 6, "angle", ["range"]),
        ("[conv]\nactivation=leakyy\n", 6, "activation", ["'leakyy'", "leaky"]),
        ("[conv]\nactivation=LEAKY\n", 6, "activation", ["'LEAKY'"]),
        ("[conv]\nactivation=lea ky\n", 6, "activation", ["whitespace"]),
        ("[conv]\nsway=1\nrotate=1\nsize=3\n", 7, "rotate", ["only one"]),
        ("[conv]\nstretch=1\n", 6, "stretch", ["size"]),
        ("[conv]\nsize=3\nsizee=3\n", 7, "sizee", ["unknown key", "'size'"]),
        ("[conv]\nsize=3\n\nsize=3\n", 8, "size", ["duplicate", "line 6"]),
        ("[conv]\nsize=\n", 6, "size", ["empty"]),
        ("[conv]\nsi ze=3\n", 6, "si ze", ["whitespace"]),
        ("[conv]\nshare_index=0\n", 6, "share_index", ["earlier"]),
        ("[maxpool]\nstride=-1\n", 6, "stride", ["stride=-1"]),
        ("[maxpool]\npadding=-1\n", 6, "padding", ["padding=-1"]),
        ("[upsample]\nstride=0\n", 6, "stride", ["non-zero"]),
        ("[reorg]\nstride=0\n", 6, "stride", ["stride=0"]),
        ("[softmax]\ntemperature=0\n", 6, "temperature", ["temperature=0"]),
        ("[dropout]\nprobability=1.5\n", 6, "probability", ["probability=1.5"]),
        ("[dropout]\nprobability=-0.1\n", 6, "probability", ["probability=-0.1"]),
        ("[yolo]\nclasses=0\n", 6, "classes", ["classes=0"]),
        ("[yolo]\nnum=-1\n", 6, "num", ["num=-1"]),
        ("[yolo]\nnum=0\n", 6, "num", ["num=0"]),
        ("[yolo]\nignore_thresh=1.1\n", 6, "ignore_thresh", ["1.1"]),
        ("[yolo]\nbeta_nms=-0.5\n", 6, "beta_nms", ["-0.5"]),
        ("[yolo]\nanchors=1,2,3\n", 6, "anchors", ["even"]),
        ("[yolo]\nanchors=1,,2\n", 6, "anchors", ["empty entry"]),
        ("[yolo]\nanchors=1,2\nnum=2\n", 7, "num", ["num=2"]),
        ("[yolo]\nnum=3\nmask=0,3\n", 7, "mask", ["mask entry 3"]),
        ("[yolo]\nmask=-1\n", 6, "mask", ["mask=-1"]),
        ("[yolo]\nnms_kind=fast\n", 6, "nms_kind", ["'fast'"]),
        ("[yolo]\niou_loss=l1\n", 6, "iou_loss", ["'l1'"]),
        ("[yolo]\nclasses=2\ncounters_per_class=1,2,3\n", 7, "counters_per_class", ["classes=2"]),
        ("[cost]\ntype=l2\n", 6, "type", ["'l2'"]),
        ("[conv]\n[shortcut]\nfrom=-1\nweights_type=per_pixel\n", 8, "weights_type", ["per_pixel"]),
        ("[conv]\n[shortcut]\nfrom=-1\nweights_normalization=x\n", 8, "weights_normalization", []),
        ("[conv]\n[sam]\nfrom=-1\nactivation=swish\n", 8, "activation", ["swish"]),
        ("[conv]\n[scale_channels]\nfrom=-1\nactivation=mish\n", 8, "activation", ["mish"]),
        ("[conv]\n[scale_channels]\nfrom=-1,-2\n", 7, "from", ["integer"]),
        ("[route]\nlayers=0\n", 6, "layers", ["layers=0"]),
        ("[conv]\n[conv]\n[route]\nlayers=2\n", 8, "layers", ["layer 2", "0..1"]),
        ("[conv]\n[conv]\n[route]\nlayers=-1,-5\n", 8, "layers", ["-5", "layer -3"]),
        ("[conv]\n[route]\nlayers=-1\ngroups=2\ngroup_id=2\n", 9, "group_id", ["group_id=2"]),
        ("[conv]\n[shortcut]\nfrom=1\n", 7, "from", ["from=1"]),
        ("[conv]\n[route]\n", 6, None, ["missing", "'layers'"]),
        ("[conv]\n[shortcut]\nactivation=linear\n", 6, None, ["'from'"]),
        ("[conv]\n[sam]\n", 6, None, ["'from'"]),
        ("[yolo]\nmap\n", 6, None, ["'map'"]),
        ("[conv]\n[local_avgpool]\n", 6, None, ["[local_avgpool]", "unsupported"]),
        ("[crnn]\n", 5, None, ["[crnn]", "unsupported"]),
        ("[Gaussian_yolo]\n", 5, None, ["[Gaussian_yolo]"]),
        ("[region]\n", 5, None, ["[region]"]),
        ("[Convolutional]\n", 5, None, ["[Convolutional]"]),
        ("[conv\n", 5, None, ["malformed"]),
        ("[]\n", 5, None, ["malformed"]),
        ("[conv]\n[net]\n", 6, None, ["first section"]),
    ],
)
def test_errors(body: str, line: int, key: str | None, words: list[str]) -> None:
    err = error(NET + body)
    assert (err.line, err.key) == (line, key), str(err)
    message = str(err)
    assert message.startswith(f"t.cfg:{line}")
    for word in words:
        assert word in message


@pytest.mark.parametrize(
    ("net_lines", "line", "key", "words"),
    [
        ("policy=steps\nsteps=10\n", 5, "policy", ["scales"]),
        ("policy=steps\nscales=.1\n", 5, "policy", ["steps"]),
        ("policy=steps\nsteps=10,20\nscales=.1\n", 7, "scales", ["1 entries", "2"]),
        ("policy=sgdr\nsteps=10,20\nseq_scales=1\n", 7, "seq_scales", ["seq_scales"]),
        ("policy=fast\n", 5, "policy", ["'fast'", "steps"]),
        ("batch=0\n", 5, "batch", ["batch=0"]),
        ("subdivisions=0\n", 5, "subdivisions", ["subdivisions=0"]),
        ("inputs=-1\n", 5, "inputs", ["inputs=-1"]),
        ("steps=-5\n", 5, "steps", ["-5"]),
        ("contrastive=1\nbatch=2\nsubdivisions=2\n", 5, "contrastive", ["mini-batch"]),
        ("ema_alpha=2\n", 5, "ema_alpha", ["ema_alpha=2"]),
        ("filters=3\n", 5, "filters", ["unknown key"]),
        ("B1=0.9\nb1=0.9\n", 6, "b1", ["unknown key", "'B1'"]),
    ],
)
def test_net_errors(net_lines: str, line: int, key: str | None, words: list[str]) -> None:
    err = error(NET + net_lines + "[conv]\n")
    assert (err.line, err.key) == (line, key), str(err)
    for word in words:
        assert word in str(err)


@pytest.mark.parametrize(
    ("text", "line", "key", "words"),
    [
        ("width=3\n[net]\n[conv]\n", 1, "width", ["before the first [section]"]),
        ("# c\n\n[conv]\n[net]\n", 3, None, ["first section", "[conv]"]),
        ("", None, None, ["no sections"]),
        ("# only comments\n\n", None, None, ["no sections"]),
        (NET, 1, None, ["no layers"]),
        ("[net]\nbatch=1\n[conv]\n", 1, None, ["width"]),
        (NET + "[conv]\nsize=3\nhello\n", 7, None, ["'hello'"]),
        (NET + "[conv]\n=3\n", 6, None, ["missing key"]),
    ],
)
def test_file_level_errors(text: str, line: int | None, key: str | None, words: list[str]) -> None:
    err = error(text)
    assert (err.line, err.key) == (line, key), str(err)
    for word in words:
        assert word in str(err)


def test_missing_and_unreadable_files(tmp_path: pathlib.Path) -> None:
    missing = tmp_path / "nope.cfg"
    with pytest.raises(CfgError) as info:
        parse_cfg(missing)
    assert info.value.path == str(missing) and "not found" in str(info.value)
    with pytest.raises(CfgError) as info:
        parse_cfg(tmp_path)
    assert info.value.path == str(tmp_path)


def test_undecodable_bytes(tmp_path: pathlib.Path) -> None:
    path = tmp_path / "latin1.cfg"
    path.write_bytes(NET.encode() + b"[conv]\n# caf\xe9\n")
    with pytest.raises(CfgError) as info:
        parse_cfg(path)
    assert (info.value.path, info.value.line) == (str(path), 6)
    assert "UTF-8" in str(info.value)


def test_cfg_error_is_a_value_error() -> None:
    # Callers that catch ValueError for bad input keep working.
    with pytest.raises(ValueError):
        parse_cfg_text("")
