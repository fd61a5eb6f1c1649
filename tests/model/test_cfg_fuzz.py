"""Property tests: whatever the input, the cfg parser either succeeds or raises CfgError.

Inputs are real cfg files mutated line by line and byte by byte, and random text. A parse
that succeeds must still honour the parser's promises (every key present, references point
at earlier layers), so these tests can fail on wrong output as well as on stray exceptions.
"""

from __future__ import annotations

import os
import pathlib
import tempfile

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from shared_paths import SHARED

from darknet_metal.errors import CfgError
from darknet_metal.model.cfg import NetConfig, parse_cfg, parse_cfg_text
from darknet_metal.model.cfg_schema import LAYER, LAYER_LIST, SCHEMA

CFG_FILES = [
    SHARED / "models" / "yolov3-tiny" / "yolov3-tiny.cfg",
    SHARED / "models" / "cfg" / "yolov4-tiny.cfg",
    SHARED / "models" / "cfg" / "yolov3.cfg",
]
CFG_LINES = [path.read_text(encoding="utf-8").split("\n") for path in CFG_FILES]

pytestmark = pytest.mark.slow

FUZZ = settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.too_slow])

# Values that have tripped cfg parsers: bad numbers, huge numbers, separators, comments.
NASTY_VALUES = [
    "",
    " ",
    "0",
    "-1",
    "-0",
    "+",
    "-",
    "1.5",
    ".",
    "1e3",
    "1e99",
    "1e-99",
    "nan",
    "inf",
    "-inf",
    "2147483647",
    "2147483648",
    "-2147483649",
    "9" * 5000,
    "0x10",
    "1_000",
    "١٢",  # non-ASCII digits
    ",",
    "1,",
    ",1",
    "1,,2",
    "-1,-2,-3",
    "-9999",
    "99999",
    "0,0,0,0,0,0,0",
    "1,2,3",
    "leaky",
    "mish",
    "steps",
    "per_layer",
    "#",
    "[net]",
    "=",
    "a=b",
    "\x00",
    "\u00a0",
    "\ufeff",
]
SECTION_NAMES = [*SCHEMA, "network", "conv", "max", "avg", "soft", "crnn", "Gaussian_yolo", "x"]


def check(text: str) -> None:
    try:
        cfg = parse_cfg_text(text, path="fuzz.cfg")
    except CfgError as err:
        assert err.path == "fuzz.cfg"
        assert err.line is None or err.line >= 1
        return
    check_promises(cfg)


def check_promises(cfg: NetConfig) -> None:
    """What every successful parse guarantees, whatever the text."""
    assert cfg.net.kind == "net" and cfg.net.index == -1 and cfg.layers
    for section in [cfg.net, *cfg.layers]:
        assert set(section.values) == {k.name for k in SCHEMA[section.kind]}
    for index, section in enumerate(cfg.layers):
        assert section.index == index
        for spec in SCHEMA[section.kind]:
            value = section.values[spec.name]
            if spec.type in (LAYER, LAYER_LIST) and value is not None:
                refs = value if isinstance(value, list) else [value]
                assert all(0 <= ref < index for ref in refs), (section.kind, spec.name, refs)
        if section.kind == "yolo":
            v = section.values
            assert len(v["anchors"]) == 2 * v["num"]
            assert all(0 <= m < v["num"] for m in v["mask"])


@st.composite
def mutated_cfg(draw: st.DrawFn) -> str:
    lines = list(draw(st.sampled_from(CFG_LINES)))
    for _ in range(draw(st.integers(1, 6))):
        op = draw(st.sampled_from(["delete", "duplicate", "swap", "value", "header", "insert"]))
        i = draw(st.integers(0, len(lines) - 1))
        if op == "delete" and len(lines) > 1:
            del lines[i]
        elif op == "duplicate":
            lines.insert(i, lines[i])
        elif op == "swap":
            j = draw(st.integers(0, len(lines) - 1))
            lines[i], lines[j] = lines[j], lines[i]
        elif op == "value" and "=" in lines[i]:
            key = lines[i].split("=", 1)[0]
            value = draw(st.sampled_from(NASTY_VALUES) | st.text(max_size=12))
            lines[i] = f"{key}={value}"
        elif op == "header":
            lines[i] = f"[{draw(st.sampled_from(SECTION_NAMES))}]"
        else:
            lines.insert(i, draw(st.text(max_size=30)))
    return "\n".join(lines)


@FUZZ
@given(mutated_cfg())
def test_mutated_real_cfgs(text: str) -> None:
    check(text)


CFG_ALPHABET = st.sampled_from(list("[]=#;,.-+0123456789 \t\r\nabcdefilmnorstuvwxyz_"))


@FUZZ
@given(st.text(CFG_ALPHABET, max_size=300) | st.text(max_size=300))
def test_random_text(text: str) -> None:
    check(text)


@FUZZ
@given(
    st.lists(
        st.sampled_from(SECTION_NAMES).map(lambda s: f"[{s}]")
        | st.builds(
            lambda k, v: f"{k}={v}",
            st.sampled_from(sorted({k.name for keys in SCHEMA.values() for k in keys})),
            st.sampled_from(NASTY_VALUES) | st.integers(-40, 40).map(str),
        ),
        max_size=40,
    )
)
def test_random_sections_and_keys(lines: list[str]) -> None:
    check("[net]\nwidth=32\nheight=32\nchannels=3\n" + "\n".join(lines))


_TMP = tempfile.TemporaryDirectory()


@settings(max_examples=60, deadline=None)
@given(st.sampled_from(CFG_FILES), st.data())
def test_byte_edits(path: pathlib.Path, data: st.DataObject) -> None:
    raw = bytearray(path.read_bytes())
    for _ in range(data.draw(st.integers(1, 4))):
        i = data.draw(st.integers(0, len(raw) - 1))
        op = data.draw(st.sampled_from(["set", "insert", "delete"]))
        byte = data.draw(st.integers(0, 255))
        if op == "set":
            raw[i] = byte
        elif op == "insert":
            raw.insert(i, byte)
        else:
            del raw[i]
    target = os.path.join(_TMP.name, "edited.cfg")
    with open(target, "wb") as fh:
        fh.write(bytes(raw))
    try:
        cfg = parse_cfg(target)
    except CfgError as err:
        assert err.path == target
        return
    check_promises(cfg)
