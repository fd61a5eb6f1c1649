"""Every cfg key that can change training is honoured or refused, never silently ignored."""

from __future__ import annotations

import pytest

from darknet_metal.errors import CfgError
from darknet_metal.model.cfg import parse_cfg_text
from darknet_metal.model.cfg_schema import SCHEMA
from darknet_metal.ops import OPS
from darknet_metal.trainer.keys import (
    REFUSED,
    TRAINING_KEYS,
    check_training_keys,
    disposition,
)

NET = """[net]
width=16
height=16
channels=3
{net}

[convolutional]
filters=6
size=3
activation=leaky
{conv}

[yolo]
mask=0
anchors=1,1
classes=1
num=1
{yolo}
"""


def _cfg(net="", conv="", yolo=""):
    return parse_cfg_text(NET.format(net=net, conv=conv, yolo=yolo))


def test_every_net_key_has_a_disposition_and_every_listed_key_exists():
    for key in SCHEMA["net"]:
        assert disposition("net", key.name) is not None, key.name
    for rule in TRAINING_KEYS:
        kinds = [k for k in SCHEMA if k != "net"] if rule.section == "*" else [rule.section]
        for kind in kinds:
            assert any(k.name == rule.key for k in SCHEMA[kind]), (kind, rule.key)
        assert rule.status != REFUSED or rule.why
    for kind, op in OPS.items():
        for key in op.training_keys:
            assert any(k.name == key for k in SCHEMA[kind]), (kind, key)
            assert disposition(kind, key) is not None
            assert disposition(kind, key).status != REFUSED or disposition(kind, key).why


def test_defaults_and_implemented_keys_pass():
    check_training_keys(_cfg())
    check_training_keys(_cfg(net="adam=1\nburn_in=10\npolicy=steps\nsteps=5\nscales=.1\n"
                                 "flip=0\nmosaic=1\nuse_cuda_graph=1",
                             conv="batch_normalize=1\nstopbackward=1\ntrain_only_bn=1\n"
                                  "dont_update=100\nburnin_update=1",
                             yolo="iou_loss=ciou\nscale_x_y=1.05\nignore_thresh=.7"))


@pytest.mark.parametrize(("where", "text", "key"), [
    ("net", "ema_alpha=0.9", "ema_alpha"),
    ("net", "loss_scale=128", "loss_scale"),
    ("net", "batch=2\ncontrastive=1", "contrastive"),
    ("net", "try_fix_nan=1", "try_fix_nan"),
    ("net", "adversarial_lr=0.05", "adversarial_lr"),
    ("conv", "batch_normalize=2", "batch_normalize"),
    ("conv", "clip=1", "clip"),
    ("conv", "grad_centr=1", "grad_centr"),
    ("yolo", "delta_normalizer=2", "delta_normalizer"),
    ("net", "batch=2\ntrack=1", "track"),
])
def test_refused_keys_name_file_line_and_key(where, text, key):
    config = _cfg(**{where: text})
    with pytest.raises(CfgError) as info:
        check_training_keys(config)
    err = info.value
    assert err.key == key and err.line is not None
    assert key in str(err) and "cannot be trained" in str(err)
    text_lines = NET.format(**{w: (text if w == where else "") for w in ("net", "conv", "yolo")})
    assert text_lines.splitlines()[err.line - 1].startswith(f"{key}=")
