"""The .metal -> CUDA translation (shim/cuda/metal2cuda.py) and its build check
(shim/cuda/build.py), without a GPU: every kernel source translates with the emulator's
kernel table, the CUDA-specific edits are made, what cannot be translated is refused with its
file and line, and the check fails on a refused source, on a device-memory hazard that only
Apple GPUs expose and, where nvcc is found, on a kernel that spills."""

from __future__ import annotations

import importlib.util
import re
import sys

import pytest
from shared_paths import ROOT

CUDA_DIR = ROOT / "shim" / "cuda"


def _load(name: str):
    if name in sys.modules:
        return sys.modules[name]
    spec = importlib.util.spec_from_file_location(name, CUDA_DIR / f"{name}.py")
    module = importlib.util.module_from_spec(spec)
    sys.modules[name] = module
    spec.loader.exec_module(module)
    return module


metal2cuda = _load("metal2cuda")
build = _load("build")
metal2cpp = sys.modules["metal2cpp"]
SOURCES = build.kernel_sources()


@pytest.mark.parametrize("path", SOURCES, ids=lambda p: p.rsplit("/", 1)[-1])
def test_each_source_translates_with_the_emulators_kernel_table(path):
    text = open(path, encoding="utf-8").read()
    cuda = metal2cuda.translate(text, path)
    emu = metal2cpp.translate(text, path)
    assert cuda.kernels == emu.kernels
    for k in cuda.kernels:
        assert 'extern "C" __global__ void ' in cuda.cpp
        assert re.search(rf"\b{metal2cuda.entry_point(k.name)}\(const dmc_launch L\)", cuda.cpp)
    assert not re.search(r"^\s*using\s+namespace\s+metal\s*;", cuda.cpp, re.M)
    assert f"#line 1 \"{path}\"" in cuda.cpp


def test_the_cuda_edits():
    src = """#include <metal_stdlib>
using namespace metal;
constant uint TILE = 16;
constant float TABLE[2] = {1.0f, 2.0f};
template <typename T>
inline T twice(T x) { return x + x; }
kernel void k(constant uint& n [[buffer(0)]],
              device const float* x [[buffer(1)]],
              device float* y [[buffer(2)]],
              threadgroup float* dyn [[threadgroup(0)]],
              uint gid [[thread_position_in_grid]],
              uint lid [[thread_index_in_threadgroup]]) {
    threadgroup float tile[TILE];
    tile[lid] = x[gid];
    threadgroup_barrier(mem_flags::mem_threadgroup);
    y[gid] = twice(tile[lid]) + TABLE[0] + dyn[0];
}
"""
    out = metal2cuda.translate(src, "/src/k.metal")
    body = out.cpp
    assert "__device__ constexpr uint TILE = 16;" in body
    assert "__device__ const float TABLE[2]" in body
    assert re.search(r"__device__ inline T twice", body)
    assert re.search(r"__device__\s+void k\(", body)
    assert "__shared__ float tile[TILE];" in body
    assert "dmc_tg_dynamic + L.tg_offset[0]" in body
    assert "::msl::builtin<__A::arg<4>>(T.tpig)" in body
    assert "::msl::builtin<__A::arg<5>>(T.tiitg)" in body
    source_part = body.split('#line 1 "/src/k.metal"\n')[1].split("// ---- entry points")[0]
    assert not re.search(r"\b(device|threadgroup|constant)\b", source_part)
    [info] = out.kernels
    assert (info.buffers, info.written_buffers, info.threadgroup_args) == ([0, 1, 2], [2], [0])
    assert info.uses_barrier and not info.uses_simd


@pytest.mark.parametrize(("line", "why"), [
    ("kernel void k(texture2d<float> t [[texture(0)]]) {}", r"\[\[texture\]\] is not supported"),
    ("kernel void k(device double* x [[buffer(0)]]) {}", "'double' does not exist"),
    ("kernel void k(device float* x [[buffer(0)]]) { x[0] = 0.5; }", "no 'f' suffix"),
])
def test_what_cannot_be_translated_is_refused_with_its_line(line, why):
    with pytest.raises(metal2cuda.MetalSourceError, match=why) as err:
        metal2cuda.translate("// first\n" + line + "\n", "/src/bad.metal")
    assert err.value.path == "/src/bad.metal" and err.value.line == 2


HAZARD = """kernel void h(device float* y [[buffer(1)]],
              uint gid [[thread_position_in_grid]],
              uint lid [[thread_index_in_threadgroup]]) {
    y[gid] = 1.0f;
    threadgroup_barrier(mem_flags::mem_threadgroup);
    y[gid ^ 1u] += 1.0f;
}
"""


def test_a_device_write_read_across_a_threadgroup_barrier_is_flagged():
    assert metal2cuda.device_memory_hazards(HAZARD, "/src/h.metal") == [("h", 5, "y")]
    ordered = HAZARD.replace("mem_flags::mem_threadgroup", "mem_flags::mem_device")
    assert metal2cuda.device_memory_hazards(ordered, "/src/h.metal") == []


def test_no_shader_has_that_hazard():
    for path in SOURCES:
        assert metal2cuda.device_memory_hazards(open(path).read(), path) == [], path


def _root(tmp_path, name: str, text: str):
    (tmp_path / "shaders").mkdir()
    (tmp_path / "shaders" / name).write_text(text)
    return str(tmp_path)


def test_the_check_fails_on_a_source_it_cannot_translate(tmp_path):
    root = _root(tmp_path, "bad.metal",
                 "kernel void k(device float* x [[buffer(0)]]) { x[0] = 0.5; }\n")
    problems = build.check("nvcc-is-not-reached", str(tmp_path / "work"), root=root)
    assert len(problems) == 1 and "bad.metal:1: error" in problems[0]


def test_the_check_fails_on_the_apple_barrier_hazard(tmp_path):
    nvcc = build.find_nvcc()
    if nvcc is None:
        pytest.skip("no nvcc here (PATH, CUDA_HOME or the nvidia-cuda-nvcc wheel)")
    root = _root(tmp_path, "h.metal", HAZARD)
    problems = build.check(nvcc, str(tmp_path / "work"), jobs=1, root=root)
    assert len(problems) == 1 and "h.metal:5: kernel h writes device buffer 'y'" in problems[0]


SPILLS = """[[max_total_threads_per_threadgroup(1024)]]
kernel void spills(device const float* x [[buffer(0)]], device float* y [[buffer(1)]],
                   uint gid [[thread_position_in_grid]]) {
    float v[160];
#pragma unroll
    for (uint i = 0; i < 160u; ++i) v[i] = x[gid * 160u + i] * x[i];
    float s = 0.0f;
#pragma unroll
    for (uint i = 0; i < 160u; ++i) {
#pragma unroll
        for (uint j = 0; j < 160u; j += 7u) s += v[i] * v[(i + j) % 160u];
    }
    y[gid] = s;
}
"""


def test_the_check_fails_on_a_spill(tmp_path):
    nvcc = build.find_nvcc()
    if nvcc is None:
        pytest.skip("no nvcc here (PATH, CUDA_HOME or the nvidia-cuda-nvcc wheel)")
    root = _root(tmp_path, "spills.metal", SPILLS)
    problems = build.check(nvcc, str(tmp_path / "work"), jobs=1, root=root)
    assert problems and all("kernel dmk_spills spills registers" in p for p in problems), problems
