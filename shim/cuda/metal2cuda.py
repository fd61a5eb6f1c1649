#!/usr/bin/env python3
"""Translate a Metal Shading Language (``.metal``) compute source, or a header it includes,
into CUDA C++ for nvcc.

It reads the source with the emulator translator's parser (``shim/emu/metal2cpp.py``:
kernels, parameters and attributes, threadgroup memory, what MSL forbids), so both targets
see the same kernels with the same buffers, and changes only what differs for CUDA:

- every function becomes ``__device__`` (MSL functions all run on the GPU);
- ``kernel`` functions stay device functions; an entry point per kernel (or per
  ``[[host_name]]`` instantiation), ``extern "C" __global__ dmk_<name>``, computes the
  built-ins from the block and thread indices and the dispatch (``dmc_launch``, filled by the
  driver), binds buffers by ``[[buffer(i)]]`` and calls it;
- ``threadgroup T x[N];`` in a kernel becomes ``__shared__ T x[N];``; ``[[threadgroup(i)]]``
  parameters point into dynamic shared memory;
- address spaces vanish (``constant`` becomes ``const``; a namespace-scope ``constant``
  becomes ``__device__ constexpr``, or ``__device__ const`` for an array);
- ``using namespace metal;`` is removed so scalar math binds to CUDA's precise functions.

Lines are preserved (``#line`` names the ``.metal`` file), so nvcc's messages and the
sanitizers' reports name the ``.metal`` file and line.

Usage: ``metal2cuda.py IN.metal -o OUT.cu [--table OUT.json]``
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import os
import re
import sys
from dataclasses import asdict

_HERE = os.path.dirname(os.path.abspath(__file__))


def _load_parser():
    """The emulator translator's module (its parser is shared; loaded by path because the
    shim's tools are scripts, not a package)."""
    found = sys.modules.get("metal2cpp")
    if found is not None:
        return found
    path = os.path.join(os.path.dirname(_HERE), "emu", "metal2cpp.py")
    spec = importlib.util.spec_from_file_location("metal2cpp", path)
    module = importlib.util.module_from_spec(spec)
    sys.modules["metal2cpp"] = module
    spec.loader.exec_module(module)
    return module


_msl = _load_parser()
MetalSourceError = _msl.MetalSourceError
KernelInfo = _msl.KernelInfo
Translation = _msl.Translation

__all__ = ["MetalSourceError", "KernelInfo", "Translation", "device_memory_hazards",
           "entry_point", "main", "translate", "translate_file"]

PRELUDE = "metal_cuda.h"
_USING_METAL = re.compile(r"^[ \t]*using[ \t]+namespace[ \t]+metal[ \t]*;", re.M)
_IDENTIFIER = re.compile(r"[A-Za-z_]\w*")


def entry_point(kernel_name: str) -> str:
    """The CUDA symbol of the kernel the registry calls ``kernel_name``."""
    return f"dmk_{kernel_name}"


class CudaRewriter(_msl.MslRewriter):
    """The MSL reader with CUDA's edits."""

    def threadgroup_decl(self, type_text: str, name: str, dims: str) -> str:
        return f"__shared__ {type_text} {name}{dims};"

    def annotate_functions(self) -> None:
        """``__device__`` before every function definition (after its template header)."""
        m = self.masked
        for func in self.find_functions():
            start = max(m.rfind(";", 0, func.start), m.rfind("{", 0, func.start),
                        m.rfind("}", 0, func.start)) + 1
            pos = _msl.skip_ws(m, start)
            while m.startswith("#", pos):  # preprocessor lines between statements
                end = m.find("\n", pos)
                pos = _msl.skip_ws(m, len(m) if end < 0 else end)
            if re.match(r"template\b", m[pos:]):
                open_at = _msl.skip_ws(m, pos + len("template"))
                if m.startswith("<", open_at):
                    pos = _msl.skip_ws(m, _msl.match_close(m, open_at, "<", ">"))
            if pos > func.start:
                continue
            self.edits.append((pos, pos, "__device__ "))

    def strip_for_cuda(self) -> None:
        """Address spaces, attributes, <metal_*> includes and ``using namespace metal``."""
        m = self.masked
        for match in _USING_METAL.finditer(m):
            self.blank(match.start(), match.end())
        for im in _msl.METAL_INCLUDE.finditer(self.src):
            self.blank(im.start(), im.end())
        for am in _msl.ATTR.finditer(m):
            self.blank(am.start(), am.end())
        depth = _brace_depths(m)
        for match in re.finditer(r"\b(device|thread|threadgroup|constant)\b", m):
            start, end = match.start(), match.end()
            if start > 0 and m[start - 1] in "_.:":
                continue
            if self._in_directive(start):
                continue
            word = match.group()
            replacement = ""
            if word == "constant":
                before = m[:start].rstrip()
                after = m[_msl.skip_ws(m, end):]
                if depth[start] == 0 and (not before or before[-1] in ";{}"
                                          or before.endswith("static")):
                    stmt = m[end:m.find(";", end)]
                    eq = stmt.find("=")
                    replacement = ("__device__ const" if "[" in (stmt if eq < 0 else stmt[:eq])
                                   else "__device__ constexpr")
                elif not (before.endswith("const") or re.match(r"const\b", after)):
                    replacement = "const"
            self.edits.append((start, end, replacement))


_BARRIER = re.compile(r"\bthreadgroup_barrier\s*\(([^)]*)\)")


def device_memory_hazards(source: str, path: str) -> list[tuple[str, int, str]]:
    """Kernels that write a device buffer before a barrier that orders threadgroup memory
    only, and read that buffer after it: ``(kernel, line of the barrier, buffer)``. CUDA's
    ``__syncthreads`` also orders device memory, so such a kernel passes here; Apple's
    ``threadgroup_barrier(mem_flags::mem_threadgroup)`` does not, so another thread's write may
    not be seen on a Mac. (A thread reading back its own write is flagged too: look.)"""
    rw = CudaRewriter(source, path)
    m = rw.masked
    found = []
    for info, params, func in rw.kernels():
        if func is None:
            continue
        body_start, end = func.body_start, func.end
        written = [p.name for p in params if p.attr == "buffer" and p.written]
        for barrier in _BARRIER.finditer(m, body_start, end):
            if "mem_device" in barrier.group(1):
                continue
            before, after = m[body_start:barrier.start()], m[barrier.end():end]
            for name in written:
                store = re.search(rf"\b{name}\s*\[[^\]]*\]\s*[-+*/|&^]?=(?!=)", before)
                load = re.search(rf"\b{name}\s*\[", after)
                if store and load:
                    found.append((info.name, _msl.line_of(source, barrier.start()), name))
    return found


def _brace_depths(masked: str) -> list[int]:
    """Depth of ``{}`` nesting at every position."""
    depths, depth = [], 0
    for ch in masked:
        if ch == "}":
            depth -= 1
        depths.append(depth)
        if ch == "{":
            depth += 1
    return depths


_BINDING = _msl.Binding("::msl", "L.buffers[{i}]", "dmc_tg_dynamic + L.tg_offset[{i}]", "T.",
                        "uint3(0u, 0u, 0u)")


def _entry(info, params, index: int) -> str:
    if not _IDENTIFIER.fullmatch(info.name):
        raise MetalSourceError(
            f"kernel name '{info.name}' is not an identifier (CUDA entry points need one)",
            path="<kernel table>", line=info.line)
    joined = _msl.bound_arguments(params, _BINDING)
    # Without [[max_total_threads_per_threadgroup]], registers decide the most threads a
    # group may have, as on Apple GPUs (the driver reports it as the pipeline's limit).
    bound = f"__launch_bounds__({info.max_threads}) " if info.max_threads > 0 else ""
    return (
        f'extern "C" __global__ void {bound}'
        f"{entry_point(info.name)}(const dmc_launch L) {{\n"
        f"    dmc_thread T;\n"
        f"    if (!dmc_enter(L, T)) return;\n"
        f"    (void)T;\n"
        f"    using __A = ::msl::fn_args<decltype(&{info.function})>;\n"
        f"    {info.function}(\n        {joined});\n}}\n"
    )


def translate(source: str, path: str, *, prelude: str = PRELUDE,
              output_name: str = "<generated>") -> Translation:
    """Translate MSL ``source`` (read from ``path``) into CUDA C++. A header (no kernels)
    gets the same edits and no entry points. Raises MetalSourceError naming ``path`` and
    the line at fault."""
    rw = CudaRewriter(source, path)
    rw.check_and_fix_tokens()
    kernels = rw.kernels()
    rw.annotate_functions()
    rw.strip_for_cuda()
    body = rw.apply()
    if not body.endswith("\n"):
        body += "\n"
    quoted = json.dumps(path)
    head = (f"// Generated by shim/cuda/metal2cuda.py from {os.path.basename(path)}; "
            f'do not edit.\n#include "{prelude}"\n#line 1 {quoted}\n')
    tail_lines = ["", "// ---- entry points: built-ins from the launch, buffers by index ----"]
    for i, (info, params, _) in enumerate(kernels):
        tail_lines.append(_entry(info, params, i))
    first_tail_line = head.count("\n") + body.count("\n") + 2
    tail = f"#line {first_tail_line} {json.dumps(output_name)}\n" + "\n".join(tail_lines) + "\n"
    return Translation(cpp=head + body + tail, kernels=[k for k, _, _ in kernels])


def translate_file(path: str, out_cu: str | None = None, out_table: str | None = None,
                   ) -> Translation:
    """Translate the file at ``path``; write the CUDA source to ``out_cu`` and the kernel
    table (JSON list) to ``out_table`` when given, each atomically."""
    with open(path, encoding="utf-8") as f:
        source = f.read()
    result = translate(source, path,
                       output_name=os.path.abspath(out_cu) if out_cu else "<generated>")
    if out_cu:
        _msl.write_atomic(out_cu, result.cpp)
    if out_table:
        table = [asdict(k) for k in result.kernels]
        _msl.write_atomic(out_table, json.dumps(table, indent=2) + "\n")
    return result


def main(argv: list[str] | None = None) -> int:
    """Command line: translate one file; exit status 1 with ``file:line: error`` on bad
    input."""
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("source", help=".metal file or a header it includes")
    parser.add_argument("-o", "--output", required=True, help="CUDA file to write")
    parser.add_argument("--table", help="JSON kernel table to write")
    args = parser.parse_args(argv)
    try:
        translate_file(os.path.abspath(args.source), args.output, args.table)
    except MetalSourceError as exc:
        print(exc, file=sys.stderr)
        return 1
    except OSError as exc:
        print(f"{args.source}: error: {exc}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
