"""The kernel registry against the shaders and against a C compiler, without any GPU."""

from __future__ import annotations

import re
import shutil
import subprocess

import pytest
from metal_harness import ROOT, SHADERS, emu_harness, shader_files

from darknet_metal.activations import ACTIVATIONS
from darknet_metal.layers import LAYER_KINDS
from darknet_metal.metal import registry

NAME = re.compile(
    r"^(?:[a-z][a-z0-9]*(?:_[a-z0-9]+)*_(?:fwd|bwd)(?:_[a-z0-9]+)*"
    r"|gemm_(?:nn|nt|tn)(?:_simd)?)_(?:f32|f16)$"
)


@pytest.fixture(scope="module")
def tables():
    """Kernel name -> (KernelInfo, .metal file name, source text) from the rewriter's table."""
    out = {}
    for path in shader_files():
        text = path.read_text()
        for info in emu_harness.metal2cpp.translate(text, str(path)).kernels:
            assert info.name not in out, f"{info.name} defined twice"
            out[info.name] = (info, path.name, text)
    return out


def test_registry_names_equal_shader_kernels(tables):
    assert set(registry.KERNELS) == set(tables)


def test_sources_match(tables):
    for name, k in registry.KERNELS.items():
        assert tables[name][1] == k.source, name


@pytest.mark.parametrize("name", sorted(registry.KERNELS))
def test_name_grammar_and_dtype_last(name):
    assert NAME.match(name), name
    assert registry.KERNELS[name].name == name


def test_grammar_rejects_bad_names():
    for bad in (
        "gemm_f32",
        "activation_f32",
        "maxpool_fwd",
        "fwd_f32",
        "Maxpool_fwd_f32",
        "maxpool_fwd_f32_x",
    ):
        assert not NAME.match(bad), bad


def test_every_layer_kind_has_kernels():
    for kind in sorted(LAYER_KINDS):
        if kind in registry.IDENTITY_KINDS:
            assert registry.kernels_for(kind) == ()
        else:
            assert registry.kernels_for(kind), kind
    assert registry.IDENTITY_KINDS == {"dropout", "cost"}
    with pytest.raises(KeyError, match="no Metal kernel"):
        registry.kernels_for("not_a_layer")
    with pytest.raises(KeyError, match="unknown Metal kernel"):
        registry.kernel("nope_fwd_f32")


def test_yolo_tiny_layers_map_to_expected_kernels():
    names = {kind: {k.name for k in registry.kernels_for(kind)} for kind in LAYER_KINDS}
    assert {"im2col_fwd_f32", "gemm_nn_f32", "gemm_nn_simd_f32"} <= names["convolutional"]
    assert {"gemm_nt_f32", "gemm_nt_simd_f32"} <= names["connected"]
    assert {"maxpool_fwd_f32", "maxpool_depth_fwd_f32"} <= names["maxpool"]
    assert names["route"] == {"route_fwd_f32"}
    assert names["upsample"] == {"upsample_fwd_f32"}
    assert names["yolo"] == {"yolo_fwd_f32"}
    assert "activation_fwd_f32" in names["shortcut"]


def _kernel_params(name, tables):
    """(type text, parameter name, attribute) of each parameter of the kernel's definition."""
    info, _, text = tables[name]
    function = info.function.split("<")[0]
    m = re.search(r"kernel\s+void\s+" + re.escape(function) + r"\s*\(", text)
    assert m, name
    depth, i = 1, m.end()
    while depth:
        depth += {"(": 1, ")": -1}.get(text[i], 0)
        i += 1
    params = []
    for part in text[m.end() : i - 1].split(","):
        pm = re.fullmatch(r"\s*(.*?)\s*(\w+)\s*\[\[\s*(\w+(?:\(\d+\))?)\s*\]\]\s*", part, re.S)
        assert pm, (name, part)
        params.append(pm.groups())
    return params


@pytest.mark.parametrize("name", sorted(registry.KERNELS))
def test_buffers_match_signature(name, tables):
    k = registry.KERNELS[name]
    info = tables[name][0]
    assert info.buffers == list(range(len(k.buffers))), name
    roles = k.buffers
    assert roles[0] == "args"
    kinds = [r.split(":")[0] for r in roles[1:]]
    assert kinds == sorted(kinds, key=lambda r: r != "in"), f"{name}: inputs before outputs"
    assert set(kinds) <= {"in", "out"} and "out" in kinds
    buffers = {
        int(a[7:-1]): (t, n) for t, n, a in _kernel_params(name, tables) if a.startswith("buffer(")
    }
    assert re.fullmatch(rf"constant\s+{k.args}\s*&", buffers[0][0]), (name, buffers[0])
    assert buffers[0][1] == "args"
    for i, role in enumerate(roles[1:], start=1):
        kind, pname = role.split(":")
        ptype, actual = buffers[i]
        assert actual == pname, f"{name}: buffer {i} is '{actual}', registry says '{pname}'"
        if kind == "in":
            assert re.fullmatch(r"device\s+const\s+float\s*\*", ptype), (name, ptype)
        else:
            assert re.fullmatch(r"device\s+float\s*\*", ptype), (name, ptype)


@pytest.mark.parametrize("name", sorted(registry.KERNELS))
def test_grid_rules(name, tables):
    k = registry.KERNELS[name]
    g = k.grid
    assert len(g.axes) == len(g.group) <= 3
    assert g.threads_per_group <= 1024 and g.threads_per_group % 32 == 0
    info = tables[name][0]
    if info.uses_barrier:
        # Barrier kernels need full threadgroups: only tiled grids guarantee them.
        assert g.tile is not None, name
    assert info.threadgroup_bytes is not None and info.threadgroup_bytes <= 32768
    if "simd" in name:
        assert k.requires == "simdgroup_matrix"
        assert g.group[0] % 32 == 0


def test_grid_dispatch_arithmetic():
    g = registry.KERNELS["gemm_nn_f32"].grid
    assert g.dispatch(N=33, M=17, slices=3) == ((32, 16, 3), (16, 16, 1))
    g = registry.KERNELS["gemm_nt_simd_f32"].grid
    assert g.dispatch(N=64, M=65, slices=1) == ((256, 3, 1), (128, 1, 1))
    g = registry.KERNELS["activation_fwd_f32"].grid
    assert g.dispatch(n=1000) == ((1000, 1, 1), (256, 1, 1))
    with pytest.raises(ValueError):
        g.dispatch(n=0)
    with pytest.raises(ValueError):
        g.dispatch(m=3)


def test_args_pack():
    a = registry.ARGS["dm_upsample_args"]
    raw = a.pack(planes=3, height=4, width=5, out_h=8, out_w=10, stride=-2, scale=0.5)
    assert raw == bytes.fromhex("03000000 04000000 05000000 08000000 0a000000 feffffff 0000003f")
    with pytest.raises(ValueError, match="missing"):
        a.pack(planes=3)
    with pytest.raises(ValueError, match="does not fit"):
        registry.ARGS["dm_sam_args"].pack(n=-1)


def test_every_registry_struct_is_used():
    assert {k.args for k in registry.KERNELS.values()} == set(registry.ARGS)


def _c_program():
    lines = [
        "#include <stddef.h>",
        "#include <stdio.h>",
        '#include "dm_args.h"',
        "int main(void) {",
    ]
    for s in registry.ARGS.values():
        lines.append(f'    printf("{s.name} %zu\\n", sizeof({s.name}));')
        for field, _ in s.fields:
            lines.append(f'    printf("{s.name}.{field} %zu\\n", offsetof({s.name}, {field}));')
    for i, act in enumerate(ACTIVATIONS):
        enum = {
            "normalize_channels": "NORM_CHAN",
            "normalize_channels_softmax": "NORM_CHAN_SOFTMAX",
            "normalize_channels_softmax_maxval": "NORM_CHAN_SOFTMAX_MAXVAL",
        }.get(act, act.upper())
        lines.append(f'    printf("act{i} %d\\n", (int)DM_ACT_{enum});')
    lines.append('    printf("count %d\\n", (int)DM_ACT_COUNT);')
    lines.append("    return 0;\n}")
    return "\n".join(lines) + "\n"


@pytest.mark.parametrize("compiler", ["cc", "c++"])
def test_struct_layout_as_seen_by_c(tmp_path, compiler):
    if shutil.which(compiler) is None:
        pytest.skip(f"no {compiler}")
    suffix = ".c" if compiler == "cc" else ".cpp"
    std = "-std=c11" if compiler == "cc" else "-std=c++17"
    src = tmp_path / f"layout{suffix}"
    src.write_text(_c_program())
    exe = tmp_path / "layout"
    subprocess.run(
        [compiler, std, "-Wall", "-Werror", "-pedantic", f"-I{SHADERS}", str(src), "-o", str(exe)],
        check=True,
        capture_output=True,
    )
    seen = dict(
        line.rsplit(" ", 1)
        for line in subprocess.run(
            [str(exe)], check=True, capture_output=True, text=True
        ).stdout.splitlines()
    )
    for s in registry.ARGS.values():
        assert int(seen[s.name]) == s.size, s.name
        for field, _ in s.fields:
            assert int(seen[f"{s.name}.{field}"]) == s.offset(field), (s.name, field)
    for i in range(len(ACTIVATIONS)):
        assert int(seen[f"act{i}"]) == i
    assert int(seen["count"]) == len(ACTIVATIONS)


def test_static_assertions_fire(tmp_path):
    """A struct that drifts from its asserted size does not compile."""
    if shutil.which("cc") is None:
        pytest.skip("no cc")
    text = (SHADERS / "dm_args.h").read_text()
    broken = text.replace(
        "    int32_t act;\n} dm_activation_args;",
        "    int32_t act;\n    float extra;\n} dm_activation_args;",
    )
    assert broken != text
    (tmp_path / "dm_args.h").write_text(broken)
    (tmp_path / "t.c").write_text('#include "dm_args.h"\nint main(void) { return 0; }\n')
    proc = subprocess.run(
        ["cc", "-std=c11", f"-I{tmp_path}", str(tmp_path / "t.c"), "-o", str(tmp_path / "t")],
        capture_output=True,
        text=True,
    )
    assert proc.returncode != 0 and "dm_activation_args size" in proc.stderr


def test_every_header_struct_is_read():
    """The registry reads dm_args.h: no struct may be skipped by the parser."""
    text = (SHADERS / "dm_args.h").read_text()
    assert len(registry.ARGS) == len(re.findall(r"typedef\s+struct\s+dm_\w+_args\b", text))
    assert all(s.fields for s in registry.ARGS.values())


def test_args_header_parser():
    text = (
        "/* a comment with typedef struct dm_fake_args { float no; } dm_fake_args; */\n"
        "typedef struct dm_x_args {\n    uint32_t a; /* count */\n    int32_t b;\n"
        "    float c;\n} dm_x_args;\n"
    )
    parsed = registry.parse_args_header(text)
    assert list(parsed) == ["dm_x_args"]
    assert parsed["dm_x_args"].fields == (("a", "u32"), ("b", "i32"), ("c", "f32"))
    with pytest.raises(ValueError, match="double"):
        registry.parse_args_header("typedef struct dm_y_args {\n double d;\n} dm_y_args;\n")


def test_headers_are_valid_msl_tokens():
    """The headers are compiled as-is (not rewritten): check them with the rewriter's rules
    (float literals with an f suffix, no double, no std::)."""
    for header in sorted(SHADERS.glob("*.h")):
        emu_harness.metal2cpp.translate(header.read_text(), str(header))
    with pytest.raises(emu_harness.metal2cpp.MetalSourceError):
        emu_harness.metal2cpp.translate("float f(float x) { return 0.5 * x; }\n", "x.h")


def test_no_unregistered_shader_headers():
    assert {p.name for p in SHADERS.glob("*.h")} == {"dm_args.h", "dm_activation.h"}
    assert (ROOT / "shaders").is_dir()
