#!/usr/bin/env python3
"""Rewrite a Metal Shading Language (``.metal``) compute source into C++ for the CPU emulator.

The rewrite preserves lines: the output starts with ``#line 1 "<file>.metal"`` and every
source line stays on its line, so compiler errors and AddressSanitizer reports name the
``.metal`` file and line. What changes:

- parameter and function attributes (``[[buffer(0)]]``, ``[[thread_position_in_grid]]``,
  ``[[host_name("x")]]``...) are read, then removed;
- ``kernel`` disappears; a launcher per kernel (or per ``[[host_name]]`` template
  instantiation) is appended that binds buffers and built-ins by attribute, as Metal does;
- ``threadgroup T x[N];`` inside a kernel becomes storage shared by the threads of a group;
- address spaces vanish (``constant`` becomes ``const``);
- MSL-invalid C++ is rejected with ``file:line``: ``double``, ``new``/``delete``, ``std::``,
  ``printf``, ``malloc``..., and float literals without an ``f`` suffix (a double in C++,
  a float in MSL). ``1.0h`` half literals are converted.

A table of the kernels (name, buffer indices, threadgroup memory, use of barriers and simd
functions) is returned and can be written as JSON, so a kernel registry can be checked
against the shaders.

Usage: ``metal2cpp.py IN.metal -o OUT.cpp [--table OUT.json] [--prelude metal_emu.h]``
"""

from __future__ import annotations

import argparse
import json
import os
import re
import sys
import tempfile
from dataclasses import asdict, dataclass, field

__all__ = [
    "MetalSourceError",
    "KernelInfo",
    "MslRewriter",
    "Binding",
    "bound_arguments",
    "ATTR",
    "METAL_INCLUDE",
    "line_of",
    "match_close",
    "skip_ws",
    "write_atomic",
    "Translation",
    "translate",
    "translate_file",
    "main",
]


class MetalSourceError(ValueError):
    """A ``.metal`` source the emulator cannot accept; ``path`` and ``line`` locate it."""

    def __init__(self, message: str, *, path: str, line: int) -> None:
        self.path = path
        self.line = line
        self.reason = message
        super().__init__(f"{path}:{line}: error: {message}")


# Attribute name -> field of emu_thread (emu_abi.h) holding that built-in.
BUILTINS = {
    "thread_position_in_grid": "tpig",
    "thread_position_in_threadgroup": "tpitg",
    "threadgroup_position_in_grid": "tgpig",
    "threads_per_threadgroup": "tptg",
    "dispatch_threads_per_threadgroup": "dtptg",
    "threads_per_grid": "tpg",
    "threadgroups_per_grid": "tgpg",
    "thread_index_in_threadgroup": "tiitg",
    "thread_index_in_simdgroup": "tiisg",
    "simdgroup_index_in_threadgroup": "sgitg",
    "simdgroups_per_threadgroup": "sgptg",
    "dispatch_simdgroups_per_threadgroup": "sgptg",
    "threads_per_simdgroup": "tpsg",
}
CONSTANT_BUILTINS = {"thread_execution_width": "32u"}

SIMD_FUNCTIONS = {
    "simd_sum",
    "simd_product",
    "simd_max",
    "simd_min",
    "simd_and",
    "simd_or",
    "simd_xor",
    "simd_prefix_exclusive_sum",
    "simd_prefix_inclusive_sum",
    "simd_prefix_exclusive_product",
    "simd_prefix_inclusive_product",
    "simd_broadcast_first",
    "simd_shuffle",
    "simd_broadcast",
    "simd_shuffle_down",
    "simd_shuffle_up",
    "simd_shuffle_xor",
    "simd_all",
    "simd_any",
    "simdgroup_barrier",
}
BARRIER_FUNCTIONS = {"threadgroup_barrier"}

# Identifier -> why MSL rejects it. Checked as whole tokens outside comments and strings.
POISONED = {
    "double": "'double' does not exist in Metal (no 64-bit floating point on Apple GPUs)",
    "new": "'new' (dynamic allocation) is not allowed in Metal",
    "delete": "'delete' (dynamic allocation) is not allowed in Metal",
    "goto": "'goto' is not allowed in Metal",
    "virtual": "virtual functions are not allowed in Metal",
    "throw": "exceptions are not allowed in Metal",
    "try": "exceptions are not allowed in Metal",
    "catch": "exceptions are not allowed in Metal",
    "thread_local": "'thread_local' is not allowed in Metal",
    "dynamic_cast": "'dynamic_cast' is not allowed in Metal",
    "typeid": "'typeid' is not allowed in Metal",
}
POISONED_CALLS = {
    "printf": "'printf' is not available in Metal compute kernels",
    "fprintf": "'fprintf' is not available in Metal",
    "malloc": "'malloc' (dynamic allocation) is not allowed in Metal",
    "calloc": "'calloc' (dynamic allocation) is not allowed in Metal",
    "realloc": "'realloc' (dynamic allocation) is not allowed in Metal",
    "free": "'free' (dynamic allocation) is not allowed in Metal",
}
CONTROL_KEYWORDS = {"if", "for", "while", "switch", "return", "sizeof", "catch", "do"}

# Sizes and alignments (bytes) of the types threadgroup arrays are usually made of.
_SCALARS = {"float": 4, "half": 2, "int": 4, "uint": 4, "short": 2, "ushort": 2, "char": 1}
_SCALARS |= {"uchar": 1, "bool": 1, "long": 8, "ulong": 8, "int32_t": 4, "uint32_t": 4}
_SCALARS |= {"int16_t": 2, "uint16_t": 2, "int8_t": 1, "uint8_t": 1}
_SCALARS |= {"atomic_uint": 4, "atomic_int": 4, "atomic_float": 4}
TYPE_SIZES: dict[str, tuple[int, int]] = {name: (n, n) for name, n in _SCALARS.items()}
for _name, _n in list(_SCALARS.items())[:11]:
    for _k in (2, 3, 4):
        _size = _n * (4 if _k == 3 else _k)
        TYPE_SIZES[f"{_name}{_k}"] = (_size, _size)
        TYPE_SIZES[f"packed_{_name}{_k}"] = (_n * _k, _n)

_IDENT = re.compile(r"[A-Za-z_]\w*")
_PPNUMBER = re.compile(r"(?<![\w.])\.?\d(?:[eEpP][+-]|[\w.'])*")
ATTR = re.compile(r"\[\[(.*?)\]\]", re.S)
METAL_INCLUDE = re.compile(r"^[ \t]*#[ \t]*include[ \t]*<metal_\w+>[ \t]*$", re.M)


@dataclass
class KernelInfo:
    """One launchable kernel: a plain kernel or a ``[[host_name]]`` template instantiation."""

    name: str
    function: str
    line: int
    buffers: list[int] = field(default_factory=list)
    written_buffers: list[int] = field(default_factory=list)
    threadgroup_args: list[int] = field(default_factory=list)
    threadgroup_bytes: int | None = 0
    uses_barrier: bool = False
    uses_simd: bool = False
    max_threads: int = 0


@dataclass
class Translation:
    """Result of a rewrite: the C++ text and the table of kernels it launches."""

    cpp: str
    kernels: list[KernelInfo]


@dataclass
class _Param:
    name: str
    attr: str
    arg: str
    line: int
    written: bool = False  # a buffer the kernel may write: device memory, not const


@dataclass
class _Function:
    name: str
    start: int
    body_start: int
    end: int


def _mask(src: str) -> str:
    """Blank comments and the contents of string/character literals (newlines and quotes
    kept) so that scans see only code."""
    out = list(src)
    i, n = 0, len(src)

    def blank(a: int, b: int) -> None:
        for k in range(a, b):
            if out[k] != "\n":
                out[k] = " "

    while i < n:
        c = src[i]
        if src.startswith("//", i):
            j = src.find("\n", i)
            j = n if j < 0 else j
            blank(i, j)
            i = j
        elif src.startswith("/*", i):
            j = src.find("*/", i + 2)
            j = n if j < 0 else j + 2
            blank(i, j)
            i = j
        elif c in "\"'":
            j = i + 1
            while j < n and src[j] != c and src[j] != "\n":
                j += 2 if src[j] == "\\" else 1
            blank(i + 1, min(j, n))
            i = j + 1
        else:
            i += 1
    return "".join(out)


def line_of(text: str, pos: int) -> int:
    return text.count("\n", 0, pos) + 1


def match_close(masked: str, pos: int, open_c: str, close_c: str) -> int:
    """Index just past the bracket closing the one at ``pos``."""
    depth = 0
    for i in range(pos, len(masked)):
        ch = masked[i]
        if ch == open_c:
            depth += 1
        elif ch == close_c:
            depth -= 1
            if depth == 0:
                return i + 1
    return -1


def skip_ws(masked: str, pos: int) -> int:
    while pos < len(masked) and masked[pos].isspace():
        pos += 1
    return pos


def _split_top(text: str, sep: str = ",") -> list[tuple[int, str]]:
    """Split at ``sep`` outside brackets; returns (offset, part) pairs."""
    parts, depth, start = [], 0, 0
    for i, ch in enumerate(text):
        if ch in "([{<":
            depth += 1
        elif ch in ")]}>":
            depth -= 1
        elif ch == sep and depth == 0:
            parts.append((start, text[start:i]))
            start = i + 1
    parts.append((start, text[start:]))
    return parts


class MslRewriter:
    """Reads one MSL source (kernels, their parameters and attributes, threadgroup memory,
    what MSL forbids) and collects edits of it; ``apply`` gives the edited text. The
    emulator's translation is this class; the CUDA translator (shim/cuda/metal2cuda.py)
    subclasses it and changes only the target-specific edits."""

    def __init__(self, src: str, path: str) -> None:
        self.src = src
        self.path = path
        self.masked = _mask(src)
        self.edits: list[tuple[int, int, str]] = []

    def error(self, pos: int, message: str) -> MetalSourceError:
        return MetalSourceError(message, path=self.path, line=line_of(self.src, pos))

    def blank(self, start: int, end: int) -> None:
        text = self.src[start:end]
        self.edits.append((start, end, "".join(c if c == "\n" else " " for c in text)))

    # ---- checks of what MSL forbids ----

    def check_and_fix_tokens(self) -> None:
        m = self.masked
        for match in _IDENT.finditer(m):
            word = match.group()
            start = match.start()
            if start > 0 and (m[start - 1].isalnum() or m[start - 1] in "_."):
                continue
            if self._in_directive(start):
                continue
            after = skip_ws(m, match.end())
            if word in POISONED:
                raise self.error(start, POISONED[word])
            if word in POISONED_CALLS and m.startswith("(", after):
                raise self.error(start, POISONED_CALLS[word])
            if word == "std" and m.startswith("::", after):
                raise self.error(
                    start,
                    "the C++ standard library ('std::') is not available "
                    "in Metal; use the metal:: functions",
                )
        for match in _PPNUMBER.finditer(m):
            if self._in_directive(match.start()):
                continue
            self._check_number(match.group(), match.start(), match.end())

    def _in_directive(self, pos: int) -> bool:
        line_start = self.masked.rfind("\n", 0, pos) + 1
        head = self.masked[line_start:pos].lstrip()
        return bool(re.match(r"#\s*(include|line|pragma|error|warning)\b", head))

    def _check_number(self, tok: str, start: int, end: int) -> None:
        if tok[:2].lower() == "0x":
            is_float = "." in tok or "p" in tok.lower()
            suffix = re.sub(r"^0[xX][0-9a-fA-F'.]*(?:[pP][+-]?\d+)?", "", tok)
        else:
            dec = re.fullmatch(r"([\d']*\.?[\d']*(?:[eE][+-]?\d+)?)([A-Za-z_]*)", tok)
            if not dec:
                return
            body, suffix = dec.groups()
            is_float = "." in body or "e" in body.lower()
        if not is_float:
            return
        if suffix in ("f", "F"):
            return
        if suffix in ("h", "H"):
            self.edits.append((start, end, f"half({tok[:-1]}f)"))
            return
        if suffix == "":
            raise self.error(
                start,
                f"float literal '{tok}' has no 'f' suffix: in C++ it is a "
                f"double, in Metal a float; write '{tok}f'",
            )
        raise self.error(
            start,
            f"float literal '{tok}' with suffix '{suffix}' is not valid "
            "Metal (use 'f' for float or 'h' for half)",
        )

    # ---- structure ----

    def find_functions(self) -> list[_Function]:
        """Every function definition (any nesting): name, extent and body."""
        m = self.masked
        funcs = []
        for match in re.finditer(r"\b([A-Za-z_]\w*)\s*(?:<[^;{}()]*>\s*)?\(", m):
            name = match.group(1)
            if name in CONTROL_KEYWORDS:
                continue
            close = match_close(m, match.end() - 1, "(", ")")
            if close < 0:
                continue
            pos = skip_ws(m, close)
            while True:
                qual = re.match(r"(const|thread|device|constant|noexcept|override)\b|\[\[", m[pos:])
                if not qual:
                    break
                if qual.group() == "[[":
                    pos = m.find("]]", pos) + 2
                else:
                    pos += qual.end()
                pos = skip_ws(m, pos)
            if pos < len(m) and m[pos] == "{":
                end = match_close(m, pos, "{", "}")
                if end > 0:
                    funcs.append(_Function(name, match.start(), pos, end))
        return funcs

    def sync_closure(self, funcs: list[_Function]) -> tuple[set[str], set[str]]:
        """Names of functions that (transitively) reach a barrier / a simd collective."""
        idents = {}
        for f in funcs:
            names = set(_IDENT.findall(self.masked[f.body_start : f.end]))
            idents[f.name] = idents.get(f.name, set()) | names
        barrier = {n for n, ids in idents.items() if ids & BARRIER_FUNCTIONS}
        simd = {n for n, ids in idents.items() if ids & SIMD_FUNCTIONS}
        changed = True
        while changed:
            changed = False
            for n, ids in idents.items():
                if n not in barrier and ids & barrier:
                    barrier.add(n)
                    changed = True
                if n not in simd and ids & simd:
                    simd.add(n)
                    changed = True
        return barrier, simd

    def constants(self) -> dict[str, int]:
        """Integer constants usable in threadgroup array sizes."""
        values: dict[str, int] = {}
        pattern = re.compile(
            r"#\s*define\s+(\w+)\s+\(?\s*(\d+)[uU]?\s*\)?\s*$"
            # Qualifiers, then the type after whitespace (a loop's "(uint i = 0;" is no
            # constant); written without nested repetition, which backtracks for seconds.
            r"|(?<![\w.])(?:(?:constexpr|constant|static|const)\s+)*(?<=\s)(?:int|uint|short|"
            r"ushort|int32_t|uint32_t|size_t)\s+(\w+)\s*=\s*([\w\s+*/()-]+?)\s*;",
            re.M,
        )
        for match in pattern.finditer(self.masked):
            name = match.group(1) or match.group(3)
            expr = match.group(2) or match.group(4)
            value = _eval_int(expr, values)
            if value is not None:
                values[name] = value
        return values

    def threadgroup_decls(self, func: _Function, consts: dict[str, int]) -> int | None:
        """Rewrite the ``threadgroup`` array declarations of one kernel body; returns their
        total size in bytes, or None if a size depends on something not evaluable here."""
        m = self.masked
        total: int | None = 0
        pattern = re.compile(r"\bthreadgroup\b(?!_)")
        for match in pattern.finditer(m, func.body_start, func.end):
            start = match.start()
            prev = m[:start].rstrip()[-1:]
            if prev not in (";", "{", "}"):
                continue
            end = m.find(";", start)
            stmt = m[match.end() : end]
            # Pointers/references into threadgroup memory are ordinary thread variables; array
            # sizes may hold any constant expression, so look only outside the brackets.
            outside = re.sub(r"\[[^\]]*\]", "[]", stmt)
            if any(c in outside for c in "*&=(") or not stmt.strip():
                continue
            parts = _split_top(stmt)
            first = re.fullmatch(
                r"\s*(.*?)\b([A-Za-z_]\w*)\s*((?:\[[^\]]*\]\s*)*)", parts[0][1], re.S
            )
            if not first:
                raise self.error(start, "cannot parse this threadgroup declaration")
            type_text = " ".join(first.group(1).split())
            if not type_text:
                raise self.error(start, "threadgroup declaration without a type")
            decls = [(first.group(2), first.group(3))]
            for _, part in parts[1:]:
                d = re.fullmatch(r"\s*([A-Za-z_]\w*)\s*((?:\[[^\]]*\]\s*)*)", part)
                if not d:
                    raise self.error(start, "cannot parse this threadgroup declaration")
                decls.append((d.group(1), d.group(2)))
            pieces = []
            for name, dims_raw in decls:
                dims = "".join(dims_raw.split())
                pieces.append(self.threadgroup_decl(type_text, name, dims))
                size = _sizeof(type_text, dims, consts)
                if size is None or total is None:
                    total = None
                else:
                    align = min(size[1], 16)
                    total = (total + align - 1) // align * align + size[0]
            newlines = self.src.count("\n", start, end + 1)
            self.edits.append((start, end + 1, " ".join(pieces) + "\n" * newlines))
        return total

    def threadgroup_decl(self, type_text: str, name: str, dims: str) -> str:
        """The target's form of ``threadgroup <type_text> <name><dims>;`` inside a kernel
        (here: storage the emulator shares between the threads of a group)."""
        return (f"{type_text} (&{name}){dims} = "
                f"*::emu::tg_decl<{type_text}{dims}>(__FILE__, __LINE__);")

    def parse_params(self, open_pos: int, close_pos: int) -> list[_Param]:
        text = self.masked[open_pos + 1 : close_pos - 1]
        params = []
        for offset, part in _split_top(text):
            if not part.strip() or part.strip() == "void":
                continue
            abs_pos = open_pos + 1 + offset
            line = line_of(self.src, abs_pos)
            attrs = ATTR.findall(self.src[abs_pos : abs_pos + len(part)])
            decl = ATTR.sub(" ", part)
            name_match = re.search(r"([A-Za-z_]\w*)\s*$", decl)
            if not name_match:
                raise MetalSourceError("kernel parameter without a name", path=self.path, line=line)
            name = name_match.group(1)
            kind = None
            for attr in attrs:
                am = re.fullmatch(r"\s*(\w+)\s*(?:\(\s*([^)]*?)\s*\))?\s*", attr)
                if not am:
                    continue
                aname, aarg = am.group(1), am.group(2) or ""
                if (
                    aname in ("buffer", "threadgroup")
                    or aname in BUILTINS
                    or (aname in CONSTANT_BUILTINS or aname == "grid_origin")
                ):
                    kind = (aname, aarg)
                elif aname in (
                    "stage_in",
                    "texture",
                    "sampler",
                    "visible_function_table",
                    "intersection_function_table",
                    "instance_acceleration_structure",
                ):
                    raise MetalSourceError(
                        f"parameter '{name}': [[{aname}]] is not supported by the compute emulator",
                        path=self.path,
                        line=line,
                    )
            if kind is None:
                raise MetalSourceError(
                    f"kernel parameter '{name}' has no [[buffer(n)]], "
                    "[[threadgroup(n)]] or built-in attribute",
                    path=self.path,
                    line=line,
                )
            if kind[0] in ("buffer", "threadgroup"):
                if not kind[1].isdigit():
                    raise MetalSourceError(
                        f"parameter '{name}': index '{kind[1]}' must be an integer literal",
                        path=self.path,
                        line=line,
                    )
                limit = 31 if kind[0] == "buffer" else 8
                if int(kind[1]) >= limit:
                    raise MetalSourceError(
                        f"parameter '{name}': {kind[0]}({kind[1]}) is beyond the limit of {limit}",
                        path=self.path,
                        line=line,
                    )
            decl_words = set(_IDENT.findall(decl))
            written = kind[0] == "buffer" and "device" in decl_words and "const" not in decl_words
            params.append(_Param(name, kind[0], kind[1], line, written))
        return params

    # ---- kernels ----

    def kernels(self) -> list[tuple[KernelInfo, list[_Param], _Function | None]]:
        m = self.masked
        funcs = self.find_functions()
        by_start = {f.start: f for f in funcs}
        definitions: dict[str, tuple[list[_Param], _Function]] = {}
        found = []
        for match in re.finditer(r"\bkernel\b|\[\[\s*kernel\s*\]\]", m):
            kpos = match.start()
            if self._in_directive(kpos):
                continue
            # What precedes: [[host_name("x")]] / template / template <...>.
            stmt_start = (
                max(m.rfind(";", 0, kpos), m.rfind("}", 0, kpos), m.rfind("{", 0, kpos)) + 1
            )
            prefix_src = self.src[stmt_start:kpos]
            prefix = m[stmt_start:kpos]
            host = re.search(r"host_name\s*\(\s*\"([^\"]*)\"\s*\)", prefix_src)
            is_instantiation = bool(re.match(r"\s*template\s*(\[\[|$)", prefix)) and "<" not in (
                ATTR.sub("", prefix)
            )
            is_template_def = bool(re.search(r"\btemplate\s*<", prefix))
            for am in ATTR.finditer(m, stmt_start, kpos):
                self.blank(am.start(), am.end())
            self.blank(kpos, match.end())
            pos = skip_ws(m, match.end())
            while m.startswith("[[", pos):
                attr_end = m.find("]]", pos) + 2
                self.blank(pos, attr_end)
                pos = skip_ws(m, attr_end)
            ret = _IDENT.match(m, pos)
            if not ret:
                raise self.error(kpos, "expected 'void' after 'kernel'")
            name_m = _IDENT.match(m, skip_ws(m, ret.end()))
            if not name_m:
                raise self.error(kpos, "expected a kernel name")
            name = name_m.group()
            pos = skip_ws(m, name_m.end())
            targs = ""
            if m.startswith("<", pos):
                close = match_close(m, pos, "<", ">")
                targs = " ".join(m[pos:close].split())
                pos = skip_ws(m, close)
            if ret.group() != "void":
                # `template [[host_name("x")]] kernel kernel_t fn<float>;`: the signature
                # (and the attributes) are those of the template definition.
                if not (is_instantiation and m.startswith(";", pos) and targs):
                    raise self.error(kpos, "a kernel must return void")
                if not host:
                    raise self.error(kpos, "template instantiation without [[host_name(...)]]")
                self.blank(stmt_start, pos + 1)
                found.append(("decl", host.group(1), name, targs, None, kpos))
                continue
            if not m.startswith("(", pos):
                raise self.error(kpos, f"expected '(' after kernel name '{name}'")
            close = match_close(m, pos, "(", ")")
            params = self.parse_params(pos, close)
            for am in ATTR.finditer(m, pos, close):
                self.blank(am.start(), am.end())
            after = skip_ws(m, close)
            if m.startswith("{", after):
                func = by_start.get(name_m.start())
                if func is None:
                    raise self.error(kpos, f"cannot find the body of kernel '{name}'")
                definitions[name] = (params, func)
                if not is_template_def:
                    kname = host.group(1) if host else name
                    found.append(("def", kname, name, "", params, kpos))
            elif m.startswith(";", after):
                if is_instantiation:
                    if not host:
                        raise self.error(kpos, "template instantiation without [[host_name(...)]]")
                    found.append(("inst", host.group(1), name, targs, params, kpos))
            else:
                raise self.error(kpos, f"expected '{{' or ';' after kernel '{name}'")

        barrier_funcs, simd_funcs = self.sync_closure(funcs)
        consts = self.constants()
        tg_bytes: dict[str, int | None] = {}
        for fname, (_, func) in definitions.items():
            tg_bytes[fname] = self.threadgroup_decls(func, consts)

        result = []
        names_seen: dict[str, int] = {}
        for _kind, kname, fname, targs, params, kpos in found:
            if fname not in definitions:
                raise self.error(
                    kpos, f"kernel template '{fname}' is not defined before this instantiation"
                )
            def_params, func = definitions[fname]
            if params is None:
                params = def_params
            line = line_of(self.src, kpos)
            if kname in names_seen:
                raise self.error(
                    kpos, f"kernel name '{kname}' already used at line {names_seen[kname]}"
                )
            names_seen[kname] = line
            self._check_params(params, kname, kpos)
            info = KernelInfo(
                name=kname,
                function=fname + targs,
                line=line,
                buffers=sorted(int(p.arg) for p in params if p.attr == "buffer"),
                written_buffers=sorted(int(p.arg) for p in params
                                       if p.attr == "buffer" and p.written),
                threadgroup_args=sorted(int(p.arg) for p in params if p.attr == "threadgroup"),
                threadgroup_bytes=tg_bytes.get(fname, 0),
                uses_barrier=fname in barrier_funcs,
                uses_simd=fname in simd_funcs,
                max_threads=self._max_threads(func),
            )
            result.append((info, params, func))
        return result

    def _check_params(self, params: list[_Param], kname: str, kpos: int) -> None:
        seen: dict[tuple[str, str], str] = {}
        for p in params:
            if p.attr in ("buffer", "threadgroup"):
                key = (p.attr, p.arg)
                if key in seen:
                    raise MetalSourceError(
                        f"kernel '{kname}': {p.attr}({p.arg}) bound to both "
                        f"'{seen[key]}' and '{p.name}'",
                        path=self.path,
                        line=p.line,
                    )
                seen[key] = p.name

    def _max_threads(self, func: _Function) -> int:
        stmt_start = (
            max(self.masked.rfind(";", 0, func.start), self.masked.rfind("}", 0, func.start)) + 1
        )
        head = self.src[stmt_start : func.body_start]
        mt = re.search(r"max_total_threads_per_threadgroup\s*\(\s*(\d+)\s*\)", head)
        return int(mt.group(1)) if mt else 0

    def strip(self) -> None:
        """Remove remaining attributes and address spaces; drop <metal_*> includes."""
        m = self.masked
        for im in METAL_INCLUDE.finditer(self.src):
            self.blank(im.start(), im.end())
        # Metal's (clang's) loop hint, in GCC's spelling: the emulator's C++ compiler warns
        # on the other and would not unroll.
        for um in re.finditer(r"#[ \t]*pragma[ \t]+unroll\b[ \t]*(\d*)", m):
            self.edits.append((um.start(), um.end(), f"#pragma GCC unroll {um.group(1) or 64}"))
        for am in ATTR.finditer(m):
            self.blank(am.start(), am.end())
        for match in re.finditer(
            r"\b(device|thread|threadgroup|constant|threadgroup_imageblock)"
            r"\b",
            m,
        ):
            start, end = match.start(), match.end()
            if start > 0 and m[start - 1] in "_.:":
                continue
            if self._in_directive(start):
                continue
            word = match.group()
            replacement = ""
            if word == "constant":
                before = m[:start].rstrip()
                after = m[skip_ws(m, end) :]
                if not (before.endswith("const") or re.match(r"const\b", after)):
                    replacement = "const"
            self.edits.append((start, end, replacement))

    def apply(self) -> str:
        # At one position an insertion (an empty range) goes before a replacement.
        edits = sorted(self.edits, key=lambda e: (e[0], e[1] > e[0], -(e[1] - e[0])))
        out, pos = [], 0
        for start, end, text in edits:
            if start < pos:
                continue  # inside a larger edit already applied (e.g. a blanked statement)
            out.append(self.src[pos:start])
            out.append(text)
            pos = end
        out.append(self.src[pos:])
        return "".join(out)


def _eval_int(expr: str, values: dict[str, int]) -> int | None:
    expr = re.sub(r"(\d+)[uUlL]+\b", r"\1", expr.strip())
    expr = _IDENT.sub(lambda mm: str(values[mm.group()]) if mm.group() in values else "?", expr)
    if not re.fullmatch(r"[\d\s+*/()-]+", expr):
        return None
    try:
        value = eval(expr.replace("/", "//"), {"__builtins__": {}})  # digits and + - * / only
    except (SyntaxError, ZeroDivisionError):
        return None
    return int(value)


def _sizeof(type_text: str, dims: str, consts: dict[str, int]) -> tuple[int, int] | None:
    base = TYPE_SIZES.get(type_text.replace("const ", "").strip())
    if base is None:
        return None
    count = 1
    for dim in re.findall(r"\[([^\]]*)\]", dims):
        value = _eval_int(dim, consts)
        if value is None:
            return None
        count *= value
    return base[0] * count, base[1]


def _c_ident(name: str) -> str:
    return re.sub(r"\W", "_", name)


@dataclass(frozen=True)
class Binding:
    """How a target's entry point reaches a kernel's arguments: the namespace of its
    ``bind``/``builtin`` glue (msl_glue.h), the expression of ``[[buffer(i)]]`` and of
    ``[[threadgroup(i)]]`` (``{i}`` the index), the thread's built-ins (a field name is
    appended) and the grid origin."""

    namespace: str
    buffer: str
    threadgroup: str
    thread: str
    origin: str


def bound_arguments(params: list[_Param], binding: Binding) -> str:
    """The argument list of a kernel's call, each bound by its attribute (``__A`` is the
    kernel's ``fn_args``)."""
    ns, args = binding.namespace, []
    for i, p in enumerate(params):
        arg_t = f"__A::arg<{i}>"
        if p.attr == "buffer":
            args.append(f"{ns}::bind<{arg_t}>({binding.buffer.format(i=p.arg)})")
        elif p.attr == "threadgroup":
            args.append(f"{ns}::bind<{arg_t}>({binding.threadgroup.format(i=p.arg)})")
        elif p.attr in BUILTINS:
            args.append(f"{ns}::builtin<{arg_t}>({binding.thread}{BUILTINS[p.attr]})")
        elif p.attr == "grid_origin":
            args.append(f"{ns}::builtin<{arg_t}>({binding.origin})")
        else:
            args.append(f"{ns}::builtin<{arg_t}>({CONSTANT_BUILTINS[p.attr]})")
    return ",\n        ".join(args)


_EMU_BINDING = Binding("::emu", "L->buffers[{i}]", "L->tg_args[{i}]", "T->",
                       "emu_uint3{0u, 0u, 0u}")


def _launcher(info: KernelInfo, params: list[_Param], index: int) -> str:
    fn = f"__emu_call_{index}_{_c_ident(info.name)}"
    joined = bound_arguments(params, _EMU_BINDING)
    return (
        f"static void {fn}(const emu_launch *L, const emu_thread *T) {{\n"
        f"    (void)L;\n    (void)T;\n"
        f"    using __A = ::emu::fn_args<decltype(&{info.function})>;\n"
        f"    {info.function}(\n        {joined});\n}}\n"
    )


def _flags(info: KernelInfo) -> str:
    flags = []
    if info.uses_barrier:
        flags.append("EMU_KERNEL_BARRIER")
    if info.uses_simd:
        flags.append("EMU_KERNEL_SIMD")
    if info.threadgroup_bytes != 0 or info.threadgroup_args:
        flags.append("EMU_KERNEL_TGMEM")
    return " | ".join(flags) or "0u"


def _c_string(text: str) -> str:
    return json.dumps(text)


def translate(
    source: str, path: str, *, prelude: str = "metal_emu.h", output_name: str = "<generated>"
) -> Translation:
    """Rewrite MSL ``source`` (read from ``path``) into C++ for the emulator.

    Raises MetalSourceError naming ``path`` and the line at fault.
    """
    rw = MslRewriter(source, path)
    rw.check_and_fix_tokens()
    kernels = rw.kernels()
    rw.strip()
    body = rw.apply()
    if not body.endswith("\n"):
        body += "\n"

    head = (
        f"// Generated by shim/emu/metal2cpp.py from {os.path.basename(path)}; do not edit.\n"
        f'#include "{prelude}"\n#line 1 {_c_string(path)}\n'
    )
    stem = _c_ident(os.path.splitext(os.path.basename(path))[0])
    tail_lines = [
        "",
        "// ---- launchers: bind buffers and built-ins by attribute ----",
    ]
    for i, (info, params, _) in enumerate(kernels):
        tail_lines.append(_launcher(info, params, i))
    entries = []
    for i, (info, _, _) in enumerate(kernels):
        fn = f"__emu_call_{i}_{_c_ident(info.name)}"
        bmask = sum(1 << b for b in info.buffers)
        wmask = sum(1 << b for b in info.written_buffers)
        tmask = sum(1 << t for t in info.threadgroup_args)
        tg_bytes = -1 if info.threadgroup_bytes is None else info.threadgroup_bytes
        entries.append(
            f"    {{{_c_string(info.name)}, &{fn}, &::emu::run_group<&{fn}>, {_flags(info)}, "
            f"0x{bmask:x}u, 0x{wmask:x}u, 0x{tmask:x}u, {tg_bytes}, {info.max_threads}, "
            f"{_c_string(path)}, {info.line}}},"
        )
    count = len(kernels)
    if count:
        tail_lines.append("static const emu_kernel_info __emu_kernels[] = {")
        tail_lines.extend(entries)
        tail_lines.append("};")
        tail_lines.append(
            f"static const int __emu_registered = emu_register_kernels(__emu_kernels, {count});"
        )
        table = "__emu_kernels"
    else:
        table = "nullptr"
    tail_lines.append(
        f'extern "C" const emu_kernel_info *emu_kernels_{stem}(int *count) {{\n'
        f"    *count = {count};\n    return {table};\n}}"
    )
    first_tail_line = head.count("\n") + body.count("\n") + 2
    tail = f"#line {first_tail_line} {_c_string(output_name)}\n" + "\n".join(tail_lines) + "\n"
    return Translation(cpp=head + body + tail, kernels=[k for k, _, _ in kernels])


def write_atomic(path: str, text: str) -> None:
    directory = os.path.dirname(os.path.abspath(path))
    fd, tmp = tempfile.mkstemp(dir=directory, prefix=".tmp-", suffix=os.path.basename(path))
    try:
        with os.fdopen(fd, "w", encoding="utf-8") as f:
            f.write(text)
        os.replace(tmp, path)
    except BaseException:
        if os.path.exists(tmp):
            os.unlink(tmp)
        raise


def translate_file(
    path: str,
    out_cpp: str | None = None,
    out_table: str | None = None,
    *,
    prelude: str = "metal_emu.h",
) -> Translation:
    """Rewrite the ``.metal`` file at ``path``; write the C++ to ``out_cpp`` and the kernel
    table (JSON list) to ``out_table`` when given, each atomically."""
    with open(path, encoding="utf-8") as f:
        source = f.read()
    result = translate(
        source,
        path,
        prelude=prelude,
        output_name=os.path.abspath(out_cpp) if out_cpp else "<generated>",
    )
    if out_cpp:
        write_atomic(out_cpp, result.cpp)
    if out_table:
        table = [asdict(k) for k in result.kernels]
        write_atomic(out_table, json.dumps(table, indent=2) + "\n")
    return result


def main(argv: list[str] | None = None) -> int:
    """Command line: rewrite one .metal file; exit status 1 with ``file:line: error`` on bad
    input."""
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("source", help=".metal file")
    parser.add_argument("-o", "--output", required=True, help="C++ file to write")
    parser.add_argument("--table", help="JSON kernel table to write")
    parser.add_argument("--prelude", default="metal_emu.h", help="prelude header to include")
    args = parser.parse_args(argv)
    try:
        translate_file(os.path.abspath(args.source), args.output, args.table, prelude=args.prelude)
    except MetalSourceError as exc:
        print(exc, file=sys.stderr)
        return 1
    except OSError as exc:
        print(f"{args.source}: error: {exc}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
