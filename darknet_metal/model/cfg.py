"""Parser for Darknet ``.cfg`` network descriptions.

The file is a list of ``[section]`` headers, each followed by ``key=value`` lines. Lexical
rules follow Darknet:

- ``#`` starts a comment anywhere on a line (Darknet V5 ends a value at ``#``); a line
  whose first non-blank character is ``;`` is a comment; blank lines are ignored.
- Spaces and tabs around section names, keys, ``=``, values and list commas are ignored.
  Whitespace inside a name, key or single value is an error rather than being squeezed out.
- Keys, section names and enum values are case-sensitive, as in Darknet.
- ``\\r\\n`` line ends and a UTF-8 byte-order mark are accepted.

Every key is checked against :data:`darknet_metal.model.cfg_schema.SCHEMA`: unknown keys, duplicate
keys, malformed numbers, out-of-range values and unknown names raise
:class:`~darknet_metal.errors.CfgError` pointing at the offending line. Each parsed section
holds a value for every key its kind takes, with Darknet's defaults and these derived values
resolved (so consumers read final values):

- ``[net]``: ``inputs`` = width*height*channels, ``max_crop`` = 2*width, ``min_crop`` = width,
  ``sgdr_cycle`` = max_batches, ``sequential_subdivisions`` = subdivisions (and lowered to it),
  ``mixup`` set from ``mosaic``/``cutmix``, ``seq_scales`` = 1.0 per step.
- ``[convolutional]``: ``stride_x``/``stride_y`` = stride; ``pad`` != 0 sets ``padding`` =
  size // 2; ``dilation`` = 1 when size == 1; ``cbn`` sets ``batch_normalize`` = 2;
  ``assisted_excitation`` keeps its integer part.
- ``[maxpool]``: ``stride_x``/``stride_y`` = stride, ``size`` = stride, ``padding`` = size - 1.
- ``[yolo]``: ``num`` = len(anchors) / 2 (Darknet's default is 1, which cannot hold the
  anchors of a real cfg), ``mask`` = 0..num-1, ``anchors`` = 0.5 for all when absent,
  ``counters_per_class`` entries below 1 become 1.
- ``[dropout]``: ``dropblock_size_abs`` keeps its integer part and is 7 when ``dropblock``
  is on without a size; ``dropblock_size_rel`` is 0 when both sizes are given.
- Enum aliases become canonical names (``weights_type=per_layer`` -> ``per_feature``,
  ``weights_normalization=avg_relu`` -> ``relu``).
- Layer references (``[route] layers``, ``[shortcut] from``, ``[sam]``/``[scale_channels]
  from``, ``share_index``, ``embedding_layer``) become absolute 0-based layer indices
  (``[net]`` is not counted) and must point at an earlier layer.

``[net]``'s ``batch`` is stored as written; Darknet's mini-batch is ``batch // subdivisions``.

Where Darknet is lax the parser is strict: Darknet truncates ``size=3.5`` with a warning,
skips lines it cannot read, and zero-fills ``scales`` shorter than ``steps``; here these are
errors. Integers may be written ``416.0`` (Darknet reads them so) but not ``1e3``. A list
may end with one trailing comma. Keys Darknet reads only under some ``policy`` (``steps``,
``gamma``...) or only with ``adam=1`` (``B1``...) are accepted and stored in any case.
Checks that need layer shapes (route sizes, filters against [yolo] classes) belong to the
network builder, which reports them through :meth:`Section.error`.
"""

from __future__ import annotations

import difflib
import math
import os
import re
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from darknet_metal.errors import ArgumentTypeError, CfgError
from darknet_metal.model.cfg_schema import (
    COMPUTED,
    DARKNET_UNSUPPORTED_SECTIONS,
    ENUM,
    FLOAT,
    FLOAT_LIST,
    INT,
    INT_LIST,
    LAYER,
    LAYER_LIST,
    NONE,
    REQUIRED,
    SCHEMA,
    SECTION_ALIASES,
    STR,
    Key,
)

__all__ = ["SECTION_KINDS", "NetConfig", "Section", "Shape", "input_shape", "parse_cfg",
           "parse_cfg_text"]

#: Canonical section kinds, ``"net"`` first.
SECTION_KINDS: tuple[str, ...] = tuple(SCHEMA)

_STRING_PATH = "<string>"
# Darknet strips these; other Unicode spaces are kept so that they show up in errors.
_BLANKS = " \t\r\f\v"
_HAS_BLANK = re.compile(r"[ \t\r\f\v]")
_INT_RE = re.compile(r"[+-]?[0-9]+")
# Darknet (atoi, or V5's float-then-truncate) reads "416.0" as 416; "3.5" is refused here.
_INTEGRAL_RE = re.compile(r"([+-]?[0-9]+)\.0*")
_FLOAT_RE = re.compile(r"[+-]?(?:[0-9]+\.?[0-9]*|\.[0-9]+)(?:[eE][+-]?[0-9]+)?")
_INT32_MIN, _INT32_MAX = -(2**31), 2**31 - 1
# Darknet stores every float key as a C float.
_FLOAT32_MAX = 3.4028234663852886e38


@dataclass
class Section:
    """One ``[section]`` of a cfg file with every key of its kind resolved.

    ``values`` maps every key the kind takes (see ``darknet_metal.model.cfg_schema.SCHEMA``) to
    its typed value: ``int``, ``float``, ``str``, ``list[int]``, ``list[float]`` or ``None``
    for absent optional keys. Layer references are absolute 0-based layer indices.
    ``key_lines`` holds the 1-based line of each key written in the file.
    """

    kind: str
    line: int
    path: str
    values: dict[str, Any]
    key_lines: dict[str, int] = field(default_factory=dict)
    index: int = -1

    @property
    def name(self) -> str:
        """Human-readable name for messages, e.g. ``"[route] (layer 3)"``."""
        if self.index < 0:
            return f"[{self.kind}]"
        return f"[{self.kind}] (layer {self.index})"

    def error(self, message: str, key: str | None = None) -> CfgError:
        """A CfgError at ``key``'s line (the header line if the key is absent or None)."""
        line = self.key_lines.get(key, self.line) if key is not None else self.line
        return CfgError(f"{self.name}: {message}", path=self.path, line=line, key=key)


@dataclass
class NetConfig:
    """A parsed cfg file: the ``[net]`` section and the layer sections in file order.

    ``layers[i].index == i``.
    """

    path: str
    net: Section
    layers: list[Section]


#: (C, H, W) of one image: a network's input, a layer's input or output.
Shape = tuple[int, int, int]


def input_shape(config: NetConfig) -> Shape:
    """(C, H, W) of the network input from ``[net]``."""
    v = config.net.values
    return (v["channels"], v["height"], v["width"])


@dataclass
class _RawSection:
    kind: str
    line: int
    entries: dict[str, tuple[str, int]] = field(default_factory=dict)  # key -> (value, line)


def parse_cfg(path: str | os.PathLike[str]) -> NetConfig:
    """Read and parse the cfg file at ``path`` (UTF-8, optional byte-order mark).

    Raises CfgError for a missing or unreadable file, undecodable bytes, or any content
    error (see :func:`parse_cfg_text`).
    """
    name = os.fspath(path)
    if isinstance(name, bytes):
        name = os.fsdecode(name)
    try:
        with open(name, "rb") as fh:
            data = fh.read()
    except FileNotFoundError:
        raise CfgError("cfg file not found", path=name) from None
    except IsADirectoryError:
        raise CfgError("is a directory, not a cfg file", path=name) from None
    except (OSError, ValueError) as exc:
        raise CfgError(f"cannot read cfg file: {exc}", path=name) from None
    return parse_cfg_text(_decode(data, name), path=name)


def parse_cfg_text(text: str, path: str = _STRING_PATH) -> NetConfig:
    """Parse cfg ``text``; ``path`` names it in error messages.

    Returns the ``[net]``/``[network]`` section and the layers. Whatever the text, the only
    exception is CfgError, raised when it does not describe a network of supported kinds.
    ``bytes`` are decoded as UTF-8; any other type is a TypeError.
    """
    if isinstance(text, bytes):
        text = _decode(text, path)
    if not isinstance(text, str):
        raise ArgumentTypeError(f"cfg text must be str, not {type(text).__name__}")
    text = text.removeprefix("\ufeff")
    raws = _lex(text, path)
    if not raws:
        raise CfgError("no sections: a cfg file starts with [net]", path=path)
    if len(raws) == 1:
        raise CfgError("no layers after [net]", path=path, line=raws[0].line)
    net = _build_section(raws[0], -1, path)
    layers = [_build_section(raw, i, path) for i, raw in enumerate(raws[1:])]
    return NetConfig(path=path, net=net, layers=layers)


def _decode(data: bytes, path: str) -> str:
    try:
        return data.decode("utf-8-sig")
    except UnicodeDecodeError as exc:
        line = data.count(b"\n", 0, exc.start) + 1
        bad = data[exc.start : exc.end]
        raise CfgError(
            f"not UTF-8 text: undecodable byte(s) {bad!r}", path=path, line=line
        ) from None


def _lex(text: str, path: str) -> list[_RawSection]:
    """Split ``text`` into sections of raw ``key -> (value, line)`` entries."""
    sections: list[_RawSection] = []
    for lineno, raw_line in enumerate(text.split("\n"), start=1):
        line = raw_line.split("#", 1)[0].strip(_BLANKS)
        if not line or line.startswith(";"):
            continue
        if line.startswith("["):
            sections.append(_header(line, lineno, path, first=not sections))
            continue
        key, sep, value = line.partition("=")
        key = key.strip(_BLANKS)
        value = value.strip(_BLANKS)
        if not sep:
            raise CfgError(
                f"expected [section], key=value or a comment, got {line!r}", path=path, line=lineno
            )
        if not key:
            raise CfgError(f"missing key before '=' in {line!r}", path=path, line=lineno)
        if _HAS_BLANK.search(key):
            raise CfgError(f"whitespace inside key {key!r}", path=path, line=lineno, key=key)
        if not sections:
            raise CfgError("key=value before the first [section]", path=path, line=lineno, key=key)
        section = sections[-1]
        if not value:
            raise CfgError(f"empty value in [{section.kind}]", path=path, line=lineno, key=key)
        if key in section.entries:
            first = section.entries[key][1]
            raise CfgError(
                f"duplicate key in [{section.kind}] (first given on line {first})",
                path=path,
                line=lineno,
                key=key,
            )
        section.entries[key] = (value, lineno)
    return sections


def _header(line: str, lineno: int, path: str, *, first: bool) -> _RawSection:
    if not line.endswith("]"):
        raise CfgError(f"malformed section header {line!r}", path=path, line=lineno)
    name = line[1:-1].strip(_BLANKS)
    if not name or _HAS_BLANK.search(name) or "[" in name or "]" in name:
        raise CfgError(f"malformed section header {line!r}", path=path, line=lineno)
    kind = SECTION_ALIASES.get(name)
    if kind is None:
        if name in DARKNET_UNSUPPORTED_SECTIONS:
            why = "a Darknet layer type that darknet_metal does not implement"
        else:
            why = "not a Darknet section" + _suggest(name, SECTION_ALIASES)
        raise CfgError(
            f"unsupported section [{name}]: {why}; supported: "
            + ", ".join(f"[{n}]" for n in SECTION_ALIASES),
            path=path,
            line=lineno,
        )
    if first and kind != "net":
        raise CfgError(
            f"the first section must be [net] or [network], not [{name}]", path=path, line=lineno
        )
    if not first and kind == "net":
        raise CfgError(f"[{name}] may only be the first section", path=path, line=lineno)
    return _RawSection(kind=kind, line=lineno)


def _suggest(word: str, candidates: Any) -> str:
    """`` (did you mean 'x'?)`` for the candidate closest to ``word``, or ``""``."""
    names = list(candidates)
    close = [n for n in names if n.lower() == word.lower()]
    close = close or difflib.get_close_matches(word, names, n=1)
    return f" (did you mean {close[0]!r}?)" if close else ""


def _build_section(raw: _RawSection, index: int, path: str) -> Section:
    schema = {k.name: k for k in SCHEMA[raw.kind]}
    section = Section(kind=raw.kind, line=raw.line, path=path, values={}, index=index)
    values = section.values
    for key, (text, lineno) in raw.entries.items():
        section.key_lines[key] = lineno
        spec = schema.get(key)
        if spec is None:
            raise section.error(f"unknown key {key!r}{_suggest(key, schema)}", key)
        values[key] = _convert(spec, text, section)
    for spec in SCHEMA[raw.kind]:
        if spec.name in values or spec.default is COMPUTED:
            continue
        if spec.default is REQUIRED:
            raise section.error(f"missing required key {spec.name!r}")
        if spec.default is NONE:
            values[spec.name] = None
        elif isinstance(spec.default, tuple):
            values[spec.name] = list(spec.default)
        else:
            values[spec.name] = spec.default
    for spec in SCHEMA[raw.kind]:
        if spec.type in (LAYER, LAYER_LIST) and values.get(spec.name) is not None:
            values[spec.name] = _resolve_refs(spec, values[spec.name], section)
    resolver = _RESOLVERS.get(raw.kind)
    if resolver is not None:
        resolver(section)
    # Keep the schema's key order so that every section of a kind reads the same way.
    section.values = {spec.name: values[spec.name] for spec in SCHEMA[raw.kind]}
    return section


# --- values -------------------------------------------------------------------------------


def _convert(spec: Key, text: str, section: Section) -> Any:
    """Turn the text of one value into the type ``spec`` asks for, checking its range."""
    if spec.type in (INT_LIST, FLOAT_LIST, LAYER_LIST):
        items = [item.strip(_BLANKS) for item in text.split(",")]
        if len(items) > 1 and items[-1] == "":
            items.pop()  # Darknet V5 ignores a trailing comma
        if any(item == "" for item in items):
            raise section.error(f"empty entry in list {text!r}", spec.name)
        if spec.type == FLOAT_LIST:
            out: list[Any] = [_to_float(spec, item, section) for item in items]
        else:
            out = [_to_int(spec, item, section, integral_float=False) for item in items]
        return out
    if spec.type in (INT, LAYER):
        return _to_int(spec, text, section, integral_float=spec.type == INT)
    if spec.type == FLOAT:
        return _to_float(spec, text, section)
    if _HAS_BLANK.search(text):
        raise section.error(f"whitespace inside value {text!r}", spec.name)
    if spec.type == ENUM:
        name = dict(spec.aliases).get(text, text)
        if name not in spec.choices:
            raise section.error(
                f"unknown {spec.name} {text!r}{_suggest(text, spec.choices)}; "
                f"expected one of: {', '.join(spec.choices)}",
                spec.name,
            )
        return name
    if spec.type == STR:
        return text
    raise AssertionError(f"schema type {spec.type!r} has no converter")


def _to_int(spec: Key, text: str, section: Section, *, integral_float: bool) -> int:
    match = _INT_RE.fullmatch(text)
    if match is None and integral_float:
        match = _INTEGRAL_RE.fullmatch(text)
    if match is None:
        raise section.error(f"{spec.name}={text!r} is not an integer", spec.name)
    digits = match.group(1) if match.re is _INTEGRAL_RE else text
    if len(digits.lstrip("+-").lstrip("0")) > 10:
        raise section.error(f"{spec.name}={text!r} does not fit a 32-bit int", spec.name)
    value = int(digits)
    if not _INT32_MIN <= value <= _INT32_MAX:
        raise section.error(f"{spec.name}={text!r} does not fit a 32-bit int", spec.name)
    if spec.type not in (LAYER, LAYER_LIST):
        _check_range(spec, value, text, section)
    return value


def _to_float(spec: Key, text: str, section: Section) -> float:
    if _FLOAT_RE.fullmatch(text) is None:
        raise section.error(f"{spec.name}={text!r} is not a number", spec.name)
    value = float(text)
    if not math.isfinite(value) or abs(value) > _FLOAT32_MAX:
        raise section.error(f"{spec.name}={text!r} is out of float range", spec.name)
    _check_range(spec, value, text, section)
    return value


def _check_range(spec: Key, value: float, text: str, section: Section) -> None:
    ok = (
        (spec.lo is None or value >= spec.lo)
        and (spec.hi is None or value <= spec.hi)
        and (spec.gt is None or value > spec.gt)
        and (spec.lt is None or value < spec.lt)
    )
    if not ok:
        raise section.error(f"{spec.name}={text} is out of range: {_describe(spec)}", spec.name)


def _describe(spec: Key) -> str:
    """The allowed range as text, e.g. ``expected 0 <= probability < 1``."""
    low = high = ""
    if spec.lo is not None:
        low = f"{spec.lo:g} <= "
    elif spec.gt is not None:
        low = f"{spec.gt:g} < "
    if spec.hi is not None:
        high = f" <= {spec.hi:g}"
    elif spec.lt is not None:
        high = f" < {spec.lt:g}"
    return f"expected {low}{spec.name}{high}"


def _resolve_refs(spec: Key, value: Any, section: Section) -> Any:
    """Absolute 0-based indices of earlier layers for relative (<0) or absolute refs."""
    refs = value if isinstance(value, list) else [value]
    out = []
    for ref in refs:
        target = section.index + ref if ref < 0 else ref
        if not 0 <= target < section.index:
            earlier = (
                f"layers 0..{section.index - 1}" if section.index > 0 else "no layer (it is first)"
            )
            raise section.error(
                f"{spec.name}={ref} refers to layer {target}, but only earlier layers can be "
                f"referenced: {earlier}",
                spec.name,
            )
        out.append(target)
    return out if isinstance(value, list) else out[0]


# --- derived values and cross-key checks, per kind -----------------------------------------


def _resolve_net(s: Section) -> None:
    v = s.values
    given = s.key_lines
    if "inputs" not in given:
        v["inputs"] = v["width"] * v["height"] * v["channels"]
    if v["inputs"] == 0 and not (v["width"] and v["height"] and v["channels"]):
        raise s.error("no input size: give width, height and channels (or inputs)")
    if "max_crop" not in given:
        v["max_crop"] = 2 * v["width"]
    if "min_crop" not in given:
        v["min_crop"] = v["width"]
    if "sgdr_cycle" not in given:
        v["sgdr_cycle"] = v["max_batches"]
    subdivisions = v["subdivisions"]
    v["sequential_subdivisions"] = min(v.get("sequential_subdivisions", subdivisions), subdivisions)
    if v["mosaic"] and v["cutmix"]:
        v["mixup"] = 4
    elif v["cutmix"]:
        v["mixup"] = 2
    elif v["mosaic"]:
        v["mixup"] = 3
    if v["contrastive"] and v["batch"] // subdivisions < 2:
        raise s.error(
            "contrastive=1 needs a mini-batch (batch // subdivisions) of at least 2", "contrastive"
        )
    steps = v["steps"]
    if v["policy"] == "steps" and not ("steps" in given and "scales" in given):
        missing = "steps" if "steps" not in given else "scales"
        raise s.error(f"policy=steps needs both steps and scales; {missing} is missing", "policy")
    if "scales" in given and len(v["scales"]) != len(steps):
        raise s.error(f"scales has {len(v['scales'])} entries but steps has {len(steps)}", "scales")
    if "seq_scales" not in given:
        v["seq_scales"] = [1.0] * len(steps)
    elif len(v["seq_scales"]) != len(steps):
        raise s.error(
            f"seq_scales has {len(v['seq_scales'])} entries but steps has {len(steps)}",
            "seq_scales",
        )


def _resolve_convolutional(s: Section) -> None:
    v = s.values
    v.setdefault("stride_x", v["stride"])
    v.setdefault("stride_y", v["stride"])
    if v["size"] == 1:
        v["dilation"] = 1
    if v["pad"]:
        v["padding"] = v["size"] // 2
    if v["cbn"]:
        v["batch_normalize"] = 2
    v["assisted_excitation"] = float(math.trunc(v["assisted_excitation"]))
    if v["filters"] % v["groups"]:
        raise s.error(
            f"filters={v['filters']} is not a multiple of groups={v['groups']}", "filters"
        )
    deform = [k for k in ("sway", "rotate", "stretch", "stretch_sway") if v[k]]
    if len(deform) > 1:
        raise s.error(
            f"only one of sway, rotate, stretch, stretch_sway may be set: {deform}", deform[1]
        )
    if deform and v["size"] == 1:
        raise s.error(f"{deform[0]}=1 needs size >= 3", deform[0])


def _resolve_maxpool(s: Section) -> None:
    v = s.values
    v.setdefault("stride_x", v["stride"])
    v.setdefault("stride_y", v["stride"])
    v.setdefault("size", v["stride"])
    v.setdefault("padding", v["size"] - 1)


def _resolve_route(s: Section) -> None:
    v = s.values
    if v["group_id"] >= v["groups"]:
        raise s.error(f"group_id={v['group_id']} must be below groups={v['groups']}", "group_id")


def _resolve_upsample(s: Section) -> None:
    if s.values["stride"] == 0:
        raise s.error("stride=0: expected a non-zero stride (negative downsamples)", "stride")


def _refuse_swish_mish(s: Section) -> None:
    if s.values["activation"] in ("swish", "mish"):
        raise s.error(f"activation={s.values['activation']} is not supported here", "activation")


def _resolve_dropout(s: Section) -> None:
    v = s.values
    size_abs = float(math.trunc(v["dropblock_size_abs"]))
    if v["dropblock"] and not v["dropblock_size_rel"] and not size_abs:
        size_abs = 7.0
    if v["dropblock_size_rel"] and size_abs:
        v["dropblock_size_rel"] = 0.0
    v["dropblock_size_abs"] = size_abs


def _resolve_yolo(s: Section) -> None:
    v = s.values
    given = s.key_lines
    if "anchors" in given:
        anchors = v["anchors"]
        if len(anchors) % 2:
            raise s.error(
                f"anchors has {len(anchors)} numbers; expected w,h pairs (an even count)",
                "anchors",
            )
        if "num" in given and v["num"] * 2 != len(anchors):
            raise s.error(
                f"num={v['num']} but anchors holds {len(anchors) // 2} w,h pair(s)", "num"
            )
        v["num"] = len(anchors) // 2
        if v["num"] > 65536:
            raise s.error(f"anchors holds {v['num']} pairs; at most 65536 are supported", "anchors")
    else:
        v.setdefault("num", 1)
        v["anchors"] = [0.5] * (2 * v["num"])
    num = v["num"]
    if "mask" not in given:
        v["mask"] = list(range(num))
    for entry in v["mask"]:
        if entry >= num:
            raise s.error(f"mask entry {entry} is not an anchor index (0..{num - 1})", "mask")
    counters = v["counters_per_class"]
    if counters is not None:
        if len(counters) != v["classes"]:
            raise s.error(
                f"counters_per_class has {len(counters)} entries but classes={v['classes']}",
                "counters_per_class",
            )
        v["counters_per_class"] = [max(c, 1) for c in counters]


_RESOLVERS: dict[str, Callable[[Section], None]] = {
    "net": _resolve_net,
    "convolutional": _resolve_convolutional,
    "maxpool": _resolve_maxpool,
    "route": _resolve_route,
    "upsample": _resolve_upsample,
    "scale_channels": _refuse_swish_mish,
    "sam": _refuse_swish_mish,
    "dropout": _resolve_dropout,
    "yolo": _resolve_yolo,
}
