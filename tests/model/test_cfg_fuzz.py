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
from cfg_mutations import CFG_FILES, NASTY_VALUES, SECTION_NAMES, mutated_cfg
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from darknet_metal.errors import CfgError
from darknet_metal.model.cfg import NetConfig, parse_cfg, parse_cfg_text
from darknet_metal.model.cfg_schema import LAYER, LAYER_LIST, SCHEMA

pytestmark = pytest.mark.slow

FUZZ = settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.too_slow])


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
