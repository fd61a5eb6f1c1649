"""Mutations of real cfg files for the fuzzers: lines deleted, duplicated, swapped, given
nasty values or other section headers, and random lines inserted."""

from __future__ import annotations

from hypothesis import strategies as st
from shared_paths import SHARED

from darknet_metal.model.cfg_schema import SCHEMA

CFG_FILES = [
    SHARED / "models" / "yolov3-tiny" / "yolov3-tiny.cfg",
    SHARED / "models" / "cfg" / "yolov4-tiny.cfg",
    SHARED / "models" / "cfg" / "yolov3.cfg",
]
CFG_LINES = [path.read_text(encoding="utf-8").split("\n") for path in CFG_FILES]

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


@st.composite
def mutated_cfg(draw: st.DrawFn, sources: list[list[str]] | None = None) -> str:
    """A real cfg (one of ``sources``' line lists, default ``CFG_LINES``) with 1 to 6
    mutations."""
    lines = list(draw(st.sampled_from(sources or CFG_LINES)))
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
