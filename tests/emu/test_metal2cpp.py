"""The .metal -> C++ rewriter: rejects what MSL rejects, preserves lines, tables kernels."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest
from emu_harness import KERNELS, TOOL, metal2cpp

GOOD = (KERNELS / "good.metal").read_text()


def translate(src: str):
    return metal2cpp.translate(src, "/src/k.metal")


def kernel(
    body: str, params: str = "device float* out [[buffer(0)]], uint gid [[thread_position_in_grid]]"
) -> str:
    return (
        f"#include <metal_stdlib>\nusing namespace metal;\nkernel void k({params}) {{\n{body}\n}}\n"
    )


@pytest.mark.parametrize(
    ("body", "needle"),
    [
        ("    out[gid] = 0.5;", "float literal '0.5' has no 'f' suffix"),
        ("    out[gid] = 1e-3;", "float literal '1e-3' has no 'f' suffix"),
        ("    out[gid] = 2.5L;", "suffix 'L'"),
        ("    double d = 1.0f; out[gid] = d;", "'double' does not exist in Metal"),
        ("    float* p = new float[4]; out[gid] = p[0];", "'new'"),
        ("    out[gid] = std::max(1.0f, 2.0f);", "standard library"),
        ('    printf("%d", 1);', "'printf'"),
        ("    float* p = (float*)malloc(4);", "'malloc'"),
    ],
)
def test_invalid_msl_is_rejected_at_its_line(body, needle):
    with pytest.raises(metal2cpp.MetalSourceError) as err:
        translate(kernel(body))
    assert err.value.line == 4 and err.value.path == "/src/k.metal"
    assert needle in str(err.value)
    assert str(err.value).startswith("/src/k.metal:4: error:")


def test_comments_and_strings_are_not_checked():
    src = kernel(
        "    // a double 0.5 in a comment, new std::vector\n    out[gid] = 0.5f; /* 1.0 */"
    )
    assert "0.5f" in translate(src).cpp


def test_valid_literals_and_half_suffix():
    src = kernel(
        "    out[gid] = 1.0f + 2.f + .5f + 1e3f + 0x1p-2f + float(3u) + float(0x10) + 2.0h;"
    )
    cpp = translate(src).cpp
    assert "half(2.0f)" in cpp and "2.0h" not in cpp


def test_unroll_hints_take_gccs_spelling():
    src = kernel("    float s = 0.0f;\n    #pragma unroll\n"
                 "    for (uint i = 0; i < 4; ++i) s += 1.0f;\n    #pragma unroll 2\n"
                 "    for (uint i = 0; i < 4; ++i) s += 2.0f;\n"
                 "    out[gid] = s;")
    cpp = translate(src).cpp
    assert "#pragma GCC unroll 64\n" in cpp and "#pragma GCC unroll 2\n" in cpp
    assert "#pragma unroll" not in cpp


def test_lines_are_preserved():
    result = translate(GOOD)
    lines = result.cpp.splitlines()
    start = lines.index('#line 1 "/src/k.metal"') + 1
    for i, original in enumerate(GOOD.splitlines()):
        if "out[gid] = a[gid] + args.alpha * b[gid];" in original:
            assert lines[start + i] == original
            break
    else:
        raise AssertionError("line not found")


def test_kernel_table():
    table = {k.name: k for k in translate(GOOD).kernels}
    assert set(table) >= {"vadd_f32", "gemm_tiled_f32", "gemm_tiled_f16", "simd_reduce_f32"}
    assert "gemm_tiled" not in table  # templates are launched only through host_name
    vadd = table["vadd_f32"]
    assert vadd.buffers == [0, 1, 2, 3] and not vadd.uses_barrier and not vadd.uses_simd
    assert vadd.threadgroup_bytes == 0
    assert table["reduce_sum_f32"].threadgroup_bytes == 256 * 4
    assert table["reduce_sum_f32"].uses_barrier
    assert table["simd_reduce_f32"].uses_simd and table["simd_reduce_f32"].uses_barrier
    assert table["simd_shuffles"].uses_simd and not table["simd_shuffles"].uses_barrier
    assert table["histogram_u32"].threadgroup_bytes == 16 * 4
    assert table["gemm_tiled_f32"].threadgroup_bytes is None  # depends on T
    assert table["gemm_tiled_f32"].function == "gemm_tiled<float>"
    assert table["reverse_in_group"].threadgroup_args == [0]
    assert GOOD.splitlines()[table["vadd_f32"].line - 1].startswith("kernel void vadd_f32(")


def test_barrier_reached_through_helper_functions():
    src = (
        "#include <metal_stdlib>\nusing namespace metal;\n"
        "inline void sync() { threadgroup_barrier(mem_flags::mem_threadgroup); }\n"
        "inline float step2(float v) { sync(); return simd_sum(v); }\n"
        "kernel void k(device float* out [[buffer(0)]], uint i [[thread_position_in_grid]]) {\n"
        "    out[i] = step2(out[i]);\n}\n"
    )
    (info,) = translate(src).kernels
    assert info.uses_barrier and info.uses_simd


@pytest.mark.parametrize(
    ("params", "needle"),
    [
        ("device float* out", "has no [[buffer(n)]]"),
        ("device float* out [[buffer(0)]], device float* b [[buffer(0)]]", "bound to both"),
        ("device float* out [[buffer(31)]]", "beyond the limit"),
        ("texture2d<float> t [[texture(0)]]", "not supported"),
    ],
)
def test_bad_parameters(params, needle):
    with pytest.raises(metal2cpp.MetalSourceError) as err:
        translate(kernel("", params))
    assert needle in str(err.value) and err.value.line == 3


def test_command_line(tmp_path):
    bad = tmp_path / "bad.metal"
    bad.write_text(kernel("    out[gid] = 0.25;"))
    proc = subprocess.run(
        [sys.executable, str(TOOL), str(bad), "-o", str(tmp_path / "o.cpp")],
        capture_output=True,
        text=True,
    )
    assert proc.returncode == 1
    assert f"{bad}:4: error: float literal '0.25'" in proc.stderr
    assert not (tmp_path / "o.cpp").exists()
    good = tmp_path / "good.metal"
    good.write_text(kernel("    out[gid] = 0.25f;"))
    proc = subprocess.run(
        [
            sys.executable,
            str(TOOL),
            str(good),
            "-o",
            str(tmp_path / "o.cpp"),
            "--table",
            str(tmp_path / "t.json"),
        ],
        capture_output=True,
        text=True,
    )
    assert proc.returncode == 0, proc.stderr
    assert json.loads((tmp_path / "t.json").read_text())[0]["name"] == "k"


def test_threadgroup_array_sizes_may_be_expressions():
    src = (
        "#include <metal_stdlib>\nusing namespace metal;\n"
        "constant int T = 4;\n"
        "kernel void k(device float* out [[buffer(0)]], uint i [[thread_index_in_threadgroup]]) {\n"
        "    threadgroup float tile[T * (T + 1)];\n"
        "    threadgroup float* p = tile;\n"
        "    p[i] = 1.0f;\n"
        "    threadgroup_barrier(mem_flags::mem_threadgroup);\n"
        "    out[i] = tile[0];\n"
        "}\n"
    )
    result = translate(src)
    assert "tg_decl<float[T*(T+1)]>" in result.cpp  # shared by the group, not per thread
    assert "float* p = tile;" in result.cpp  # a pointer stays a thread variable
    assert result.kernels[0].threadgroup_bytes == 4 * 4 * 5
