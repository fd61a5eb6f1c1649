"""The kernel registry against the shaders and against a C compiler, without any GPU."""

from __future__ import annotations

import os
import re
import shutil
import subprocess

import numpy as np
import pytest
from metal_harness import ROOT, SHADERS, emu_harness, shader_files

from darknet_metal import ops
from darknet_metal.errors import BindingError, DeviceError
from darknet_metal.metal import registry
from darknet_metal.model.activations import ACTIVATIONS
from darknet_metal.network import load
from darknet_metal.ops import LAYER_KINDS
from darknet_metal.runtime.program import Param, build_program

NAME = re.compile(
    r"^(?:[a-z][a-z0-9]*(?:_[a-z0-9]+)*_(?:fwd|bwd|upd|buf)(?:_[a-z0-9]+)*"
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


def test_each_shader_is_declared_by_its_family_module():
    """``kernels/<family>.py`` declares the kernels of ``shaders/<family>.metal``, and only
    those; every shader has its module."""
    for family in registry.FAMILIES:
        assert family.SOURCE == family.__name__.rsplit(".", 1)[1] + ".metal"
        assert {k.source for k in family.KERNELS} == {family.SOURCE}
        assert set(family.HALF_TWINS) <= {k.name for k in family.KERNELS}
    assert sorted(f.SOURCE for f in registry.FAMILIES) == [p.name for p in shader_files()]


@pytest.mark.parametrize("name", sorted(registry.KERNELS))
def test_name_grammar_and_dtype_last(name):
    assert NAME.match(name), name
    assert registry.KERNELS[name].name == name


def test_every_half_twin_is_declared_from_its_float_kernel():
    for name in registry.HALF_TWINS:
        f32, f16 = registry.KERNELS[name], registry.KERNELS[registry.half_name(name)]
        assert (f16.source, f16.args, f16.grid, f16.roles) == (f32.source, f32.args, f32.grid,
                                                               f32.roles)
        for a, b in zip(f32.bindings, f16.bindings, strict=True):
            assert b.dtype == ("f16" if a.dtype == "f32" else a.dtype)
            assert b.itemsize == (2 if a.dtype == "f32" else 4)


def test_grammar_rejects_bad_names():
    for bad in (
        "gemm_f32",
        "activation_f32",
        "maxpool_fwd",
        "fwd_f32",
        "Maxpool_fwd_f32",
        "maxpool_fwd_f32_x",
        "sgd_upd",
        "buf_f32",
        "fill_update_f32",
    ):
        assert not NAME.match(bad), bad


def _kernels_by_kind(specs, simd, param_nbytes=None, batch=1):
    """Kernel names each layer kind's op dispatches (setup and forward) in these layers."""
    names = {}

    def emit(spec, e):
        spec.emit_device_setup(e)
        spec.emit_device_forward(e)

    program = build_program(specs, emit, batch=batch, keep=None, simd=simd,
                            param_nbytes=param_nbytes)
    kinds = {spec.index: spec.kind for spec in specs}
    for step in program.steps:
        names.setdefault(kinds[step.layer], set()).add(step.kernel)
    return names


def _all_networks(tmp_path):
    return [load(path, seed=0, input_size=size).layers
            for _, path, size in _host_networks(tmp_path)]


def test_every_layer_kind_has_kernels(tmp_path):
    names = {}
    for specs in _all_networks(tmp_path):
        for simd in (False, True):
            for kind, found in _kernels_by_kind(specs, simd).items():
                names.setdefault(kind, set()).update(found)
    identity = {kind for kind, op in ops.OPS.items() if op.output_is_input}
    for kind in sorted(LAYER_KINDS):
        if kind in identity:
            assert kind not in names
        else:
            assert names.get(kind), kind
            assert all(n in registry.KERNELS for n in names[kind])
    assert identity == {"dropout", "cost"}
    with pytest.raises(KeyError, match="unknown Metal kernel"):
        registry.kernel("nope_fwd_f32")


def test_yolo_tiny_layers_map_to_expected_kernels(tmp_path):
    names = {}
    for specs in _all_networks(tmp_path):
        for simd in (False, True):
            for kind, found in _kernels_by_kind(specs, simd).items():
                names.setdefault(kind, set()).update(found)
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


#: The MSL element type of each role dtype.
_MSL_ELEMENT = {"f32": "float", "f16": "half", "i32": "int", "u32": "uint"}


@pytest.mark.parametrize("name", sorted(registry.KERNELS))
def test_buffers_match_signature(name, tables):
    k = registry.KERNELS[name]
    info = tables[name][0]
    assert info.buffers == list(range(len(k.buffers))), name
    roles = k.buffers
    assert roles[0] == "args"
    kinds = [r.split(":")[0] for r in roles[1:]]
    assert kinds == sorted(kinds, key=lambda r: r != "in"), f"{name}: inputs before outputs"
    assert set(kinds) <= {"in", "out", "inout"} and kinds[-1] != "in"
    buffers = {
        int(a[7:-1]): (t, n) for t, n, a in _kernel_params(name, tables) if a.startswith("buffer(")
    }
    assert re.fullmatch(rf"constant\s+{k.args}\s*&", buffers[0][0]), (name, buffers[0])
    assert buffers[0][1] == "args"
    for i, role in enumerate(roles[1:], start=1):
        kind, pname = role.split(":")
        ptype, actual = buffers[i]
        assert actual == pname, f"{name}: buffer {i} is '{actual}', registry says '{pname}'"
        element = _MSL_ELEMENT[k.binding(pname).dtype]
        # In a template over the storage type, T is the instantiation's float or half.
        if element in re.findall(r"\w+", info.function.partition("<")[2]):
            element = f"(?:{element}|T)"
        if kind == "in":
            assert re.fullmatch(rf"device\s+const\s+{element}\s*\*", ptype), (name, ptype)
        else:
            assert re.fullmatch(rf"device\s+{element}\s*\*", ptype), (name, ptype)


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
    assert g.dispatch(N=65, M=129, slices=3) == ((32, 24, 3), (16, 8, 1))
    g = registry.KERNELS["gemm_nt_simd_f32"].grid
    assert g.dispatch(N=65, M=129, slices=1) == ((256, 3, 1), (128, 1, 1))
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


# ---- binding by role ----------------------------------------------------------------------


@pytest.mark.parametrize("name", sorted(registry.KERNELS))
def test_every_role_declares_a_parsable_extent_over_known_names(name):
    k = registry.KERNELS[name]
    fields = dict(registry.ARGS[k.args].fields)
    integers = {f for f, kind in fields.items() if kind != "f32"}
    assert k.roles == tuple(b.role for b in k.bindings) and k.roles
    assert set(k.inputs) | set(k.outputs) == set(k.roles)
    for b in k.bindings:
        extent = registry.Expr(b.extent)
        assert extent.names, (name, b.role)
        assert set(extent.names) <= integers | set(k.grid.axes), (name, b.role, extent.names)
        if b.used_if:
            assert b.direction == "in", (name, b.role)
            assert set(registry.Expr(b.used_if).names) <= integers, (name, b.role)
    for role in k.inputs:
        assert k.binding(role).reads
    for role in k.outputs:
        assert k.binding(role).writes


def test_directions_and_role_lists():
    b = registry.Binding("inout", "c", "n")
    assert b.reads and b.writes
    assert registry.Binding("in", "x", "n").reads and not registry.Binding("in", "x", "n").writes
    k = registry.Kernel(
        "axpy_fwd_f32",
        "x.metal",
        "dm_sam_args",
        (registry.Binding("in", "x", "n"), b, registry.Binding("out", "y", "n")),
        registry.Grid(("n",), (64,)),
        (),
    )
    assert k.roles == ("x", "c", "y")
    assert k.inputs == ("x", "c") and k.outputs == ("c", "y")
    assert k.buffers == ("args", "in:x", "inout:c", "out:y")
    with pytest.raises(ValueError, match="direction"):
        registry.Binding("both", "x", "n")
    with pytest.raises(ValueError, match="duplicate"):
        registry.Kernel("k_fwd_f32", "x.metal", "dm_sam_args", (b, b), k.grid, ())


@pytest.mark.parametrize(
    "text",
    [
        "x ** 2",
        "x / 2",
        "x % 2",
        "x == 1",
        "x if y else z",
        "1.5 * x",
        "True",
        "abs(x)",
        "max(x, key=y)",
        "max(*x)",
        "x.real",
        "x[0]",
        "__import__('os')",
        "(lambda: 1)()",
        "max",
        "x +",
        "x << 1",
    ],
)
def test_expr_rejects_anything_beyond_the_grammar(text):
    with pytest.raises(ValueError, match="expression"):
        registry.Expr(text)


def test_expr_evaluates_integers():
    e = registry.Expr("max(a - 1, 0)*b + min(c, 7, 3)//2 - -d")
    assert e.names == ("a", "b", "c", "d")
    assert e({"a": 3, "b": 5, "c": 9, "d": 1}) == 2 * 5 + 1 + 1
    with pytest.raises(KeyError):
        e({"a": 1})
    with pytest.raises(ZeroDivisionError):
        registry.Expr("a // b")({"a": 1, "b": 0})


def _gemm_values(m, n, k, *, lda=None, ldb=None, ldc=None, bias_mode=registry.BIAS_ROWS, **more):
    args = {
        "M": m,
        "N": n,
        "K": k,
        "lda": k if lda is None else lda,
        "ldb": n if ldb is None else ldb,
        "ldc": n if ldc is None else ldc,
        "groups": 1,
        "a_batch_stride": 0,
        "a_group_stride": 0,
        "b_batch_stride": 0,
        "b_group_stride": 0,
        "c_batch_stride": 0,
        "c_group_stride": 0,
        "bias_group_stride": 0,
        "bias_mode": bias_mode,
        "act": 0,
    }
    args.update(more)
    return args, {"N": n, "M": m, "slices": 1}


def _f32(n):
    return np.zeros(n, np.float32)


def test_bind_exact_sizes_returns_buffers_in_index_order():
    k = registry.kernel("gemm_nn_f32")
    args, sizes = _gemm_values(32, 5, 27)
    a, b, bias, c = _f32(32 * 27), _f32(27 * 5), _f32(32), _f32(32 * 5)
    bound = k.bind({"c": c, "bias": bias, "b": b, "a": a}, args, sizes)
    assert len(bound) == 4
    assert all(x is y for x, y in zip(bound, (a, b, bias, c), strict=True))
    assert k.extents(args, sizes) == {"a": 32 * 27, "b": 27 * 5, "bias": 32, "c": 32 * 5}


def test_bind_names_a_missing_role():
    k = registry.kernel("gemm_nn_f32")
    args, sizes = _gemm_values(4, 4, 4)
    with pytest.raises(
        BindingError, match=r"^gemm_nn_f32: no buffer for role 'c'; .*a, b, bias, c"
    ):
        k.bind({"a": _f32(16), "b": _f32(16), "bias": _f32(4)}, args, sizes)


def test_bind_names_an_unknown_role_and_the_close_one():
    k = registry.kernel("gemm_nn_f32")
    args, sizes = _gemm_values(4, 4, 4)
    bufs = {"a": _f32(16), "b": _f32(16), "bais": _f32(4), "c": _f32(16)}
    with pytest.raises(BindingError) as e:
        k.bind(bufs, args, sizes)
    msg = str(e.value)
    assert msg.startswith("gemm_nn_f32: unknown role 'bais'")
    assert "a, b, bias, c" in msg and "did you mean 'bias'" in msg
    with pytest.raises(BindingError, match="unknown role 'zzz'; its roles are x, y$"):
        registry.kernel("maxpool_fwd_f32").bind({"zzz": None}, {}, {})


def test_bind_refuses_a_too_small_buffer_with_bytes_held_and_needed():
    k = registry.kernel("gemm_nn_f32")
    args, sizes = _gemm_values(32, 5, 27)
    bufs = {"a": _f32(256), "b": _f32(27 * 5), "bias": _f32(32), "c": _f32(32 * 5)}
    with pytest.raises(BindingError) as e:
        k.bind(bufs, args, sizes)
    msg = str(e.value)
    assert re.fullmatch(
        r"gemm_nn_f32: buffer for role 'a' holds 1024 bytes; M=32 K=27 .*lda=27.* needs 3456",
        msg,
    ), msg
    assert isinstance(e.value, DeviceError)
    bufs["a"] = _f32(32 * 27 - 1)
    with pytest.raises(BindingError, match="holds 3452 bytes; .* needs 3456$"):
        k.bind(bufs, args, sizes)


def test_bind_refuses_swapped_operands():
    k = registry.kernel("gemm_nn_f32")
    args, sizes = _gemm_values(32, 5, 27)
    a, b = _f32(32 * 27), _f32(27 * 5)
    with pytest.raises(BindingError, match="role 'a' holds 540 bytes"):
        k.bind({"a": b, "b": a, "bias": _f32(32), "c": _f32(160)}, args, sizes)
    pool = registry.kernel("maxpool_fwd_f32")
    pool_args = {
        "planes": 3,
        "height": 8,
        "width": 8,
        "out_h": 4,
        "out_w": 4,
        "size": 2,
        "stride_x": 2,
        "stride_y": 2,
        "padding": 0,
    }
    x, y = _f32(3 * 64), _f32(3 * 16)
    pool.bind({"x": x, "y": y}, pool_args, {})
    with pytest.raises(
        BindingError,
        match=r"^maxpool_fwd_f32: buffer for role 'x' holds 192 bytes; "
        r"planes=3 height=8 width=8 needs 768$",
    ):
        pool.bind({"x": y, "y": x}, pool_args, {})


def test_none_only_where_the_kernel_does_not_touch_the_role():
    k = registry.kernel("gemm_nt_f32")
    args, sizes = _gemm_values(3, 4, 5, ldb=5, bias_mode=registry.BIAS_NONE)
    bufs = {"a": _f32(15), "b": _f32(20), "bias": None, "c": _f32(12)}
    assert k.bind(bufs, args, sizes)[2] is None
    assert k.extents(args, sizes)["bias"] == 0
    args["bias_mode"] = registry.BIAS_COLS
    with pytest.raises(BindingError, match="role 'bias' is None but the kernel reads it"):
        k.bind(bufs, args, sizes)
    bufs["bias"] = _f32(3)
    with pytest.raises(BindingError, match="role 'bias' holds 12 bytes; .* needs 16$"):
        k.bind(bufs, args, sizes)
    bufs["bias"], bufs["c"] = _f32(4), None
    with pytest.raises(BindingError, match="role 'c' is None but the kernel reads and writes it"):
        k.bind(bufs, args, sizes)

    s = registry.kernel("shortcut_fwd_f32")
    sargs = {
        "batch": 1,
        "channels": 3,
        "spatial": 4,
        "src_channels": 3,
        "source": 1,
        "first": 1,
        "weighted": 0,
    }
    sizes = {"spatial": 4, "channels": 3, "batch": 1}
    sbufs = {"x": _f32(12), "source": _f32(12), "table": None, "y": _f32(12)}
    assert s.bind(sbufs, sargs, sizes)[2] is None
    sargs["weighted"] = 1
    with pytest.raises(
        BindingError, match="'table' is None but the kernel reads it with weighted=1"
    ):
        s.bind(sbufs, sargs, sizes)
    sbufs["table"] = _f32(6)  # rows 0 (x) and 1 (the source)
    s.bind(sbufs, sargs, sizes)


def test_bind_passes_objects_without_nbytes_and_checks_device_buffers():
    k = registry.kernel("activation_fwd_f32")
    token = object()
    assert k.bind({"x": token, "y": token}, {"n": 10, "act": 0}, {"n": 10}) == (token, token)
    from darknet_metal.metal import get_device

    dev = get_device("emu")
    with dev.buffer(40) as small, dev.buffer(44) as enough:
        assert k.bind({"x": enough, "y": enough}, {"n": 11, "act": 0}, {"n": 11})[0] is enough
        with pytest.raises(BindingError, match="role 'x' holds 40 bytes; n=11 needs 44"):
            k.bind({"x": small, "y": enough}, {"n": 11, "act": 0}, {"n": 11})


def test_bind_reports_missing_values_and_division_by_zero():
    k = registry.kernel("gemm_nn_f32")
    args, _ = _gemm_values(4, 4, 4)
    bufs = {"a": _f32(16), "b": _f32(16), "bias": _f32(4), "c": _f32(16)}
    with pytest.raises(BindingError, match="needs 'slices'"):
        k.bind(bufs, args, {"N": 4, "M": 4})
    args["groups"] = 0
    with pytest.raises(BindingError, match="divides by zero"):
        k.bind(bufs, args, {"N": 4, "M": 4, "slices": 1})


# Generic argument values for binding every kernel: small, distinct, with the flags and modes
# that make every role touched.
_SAMPLE = {
    "bias_mode": registry.BIAS_ROWS,
    "act": 0,
    "groups": 2,
    "stride": 2,
    "channels": 8,
    "first": 1,
    "weighted": 1,
    "source": 1,
    "n_inputs": 2,
    "normalization": 1,
    "src_offset": 1,
    "dst_offset": 2,
    "dst_channels": 9,
    "src_channels": 6,
}


@pytest.mark.parametrize("name", sorted(registry.KERNELS))
def test_bind_every_kernel_at_exact_extents_and_one_float_short(name):
    k = registry.KERNELS[name]
    fields = registry.ARGS[k.args].fields
    args = {
        f: 1.0 if kind == "f32" else _SAMPLE.get(f, 3 + i % 4) for i, (f, kind) in enumerate(fields)
    }
    sizes = {axis: 5 for axis in k.grid.axes}
    extents = k.extents(args, sizes)
    assert set(extents) == set(k.roles)
    assert all(v > 0 for v in extents.values()), extents
    bufs = {role: np.zeros(n, k.binding(role).numpy_dtype) for role, n in extents.items()}
    assert k.bind(bufs, args, sizes) == tuple(bufs[r] for r in k.roles)
    for role, n in extents.items():
        short = dict(bufs, **{role: np.zeros(n - 1, k.binding(role).numpy_dtype)})
        with pytest.raises(BindingError, match=rf"^{name}: buffer for role '{role}' holds "):
            k.bind(short, args, sizes)


def _sample_dispatch(k):
    """Argument values and grid sizes for running kernel ``k`` with every role touched (a grid
    axis named like a field gets the field's value)."""
    fields = registry.ARGS[k.args].fields
    args = {
        f: 1.0 if kind == "f32" else _SAMPLE.get(f, 3 + i % 4) for i, (f, kind) in enumerate(fields)
    }
    return args, {axis: int(args.get(axis, 7)) for axis in k.grid.axes}


@pytest.mark.parametrize("name", sorted(registry.KERNELS))
def test_kernels_stay_within_their_declared_extents(emu_runner, name):
    """Each role gets exactly its extent (a view of a larger array whose tail must stay
    untouched): no kernel writes past an extent. With DM_METAL_TEST_ASAN=1 every role is its
    own allocation instead, so reads past an extent are caught too."""
    k = registry.KERNELS[name]
    args, sizes = _sample_dispatch(k)
    extents = k.extents(args, sizes)
    asan = os.environ.get("DM_METAL_TEST_ASAN", "") not in ("", "0")
    tail = 0 if asan else 67
    rng = np.random.default_rng(1)

    def filled(role: str, n: int) -> np.ndarray:
        # Integer roles (indices, counts) get small values of both signs: kernels guard what
        # they index with them.
        dtype = k.binding(role).numpy_dtype
        body = (rng.standard_normal(n) if dtype.startswith("float")
                else rng.integers(-3, 40, n))
        return np.concatenate([body.astype(dtype), np.full(tail, 1234.5).astype(dtype)])

    backing = {role: filled(role, n) for role, n in extents.items()}
    emu_runner.run(name, args, {r: b[: extents[r]] for r, b in backing.items()}, sizes)
    for role, b in backing.items():
        assert (b[extents[role] :] == np.array(1234.5).astype(b.dtype)).all(), (name, role)


def _gemm_touched(trans, args, slices):
    """Largest offset + 1 of each operand, enumerating gemm.metal's indexing."""
    m, n, kk, g = args["M"], args["N"], args["K"], args["groups"]
    top = dict.fromkeys("a b bias c".split(), 0)
    for z in range(slices):
        zb, zg = divmod(z, g)
        off = {p: zb * args[f"{p}_batch_stride"] + zg * args[f"{p}_group_stride"] for p in "abc"}
        for r in range(m):
            for k in range(kk):
                i = k * args["lda"] + r if trans[0] == "t" else r * args["lda"] + k
                top["a"] = max(top["a"], off["a"] + i + 1)
        for k in range(kk):
            for c in range(n):
                i = c * args["ldb"] + k if trans[1] == "t" else k * args["ldb"] + c
                top["b"] = max(top["b"], off["b"] + i + 1)
        for r in range(m):
            for c in range(n):
                top["c"] = max(top["c"], off["c"] + r * args["ldc"] + c + 1)
                if args["bias_mode"] in (registry.BIAS_ROWS, registry.BIAS_COLS):
                    i = r if args["bias_mode"] == registry.BIAS_ROWS else c
                    top["bias"] = max(top["bias"], zg * args["bias_group_stride"] + i + 1)
    return top


@pytest.mark.parametrize("trans", ["nn", "nt", "tn"])
def test_gemm_extents_equal_the_largest_offset_touched(trans):
    rng = np.random.default_rng(0)
    k = registry.kernel(f"gemm_{trans}_f32")
    for _ in range(60):
        m, n, kk = (int(v) for v in rng.integers(0, 5, 3))
        groups, slices = int(rng.integers(1, 4)), int(rng.integers(1, 8))
        lda = (m if trans[0] == "t" else kk) + int(rng.integers(0, 3))
        ldb = (kk if trans[1] == "t" else n) + int(rng.integers(0, 3))
        strides = {
            f"{p}_{s}_stride": int(rng.integers(0, 40))
            for p in ("a", "b", "c")
            for s in ("batch", "group")
        }
        args, _ = _gemm_values(
            m,
            n,
            kk,
            lda=lda,
            ldb=ldb,
            ldc=n + int(rng.integers(0, 3)),
            bias_mode=int(rng.integers(0, 3)),
            groups=groups,
            bias_group_stride=int(rng.integers(0, 9)),
            **strides,
        )
        sizes = {"N": max(n, 1), "M": max(m, 1), "slices": slices}
        assert k.extents(args, sizes) == _gemm_touched(trans, args, slices), (args, slices)


@pytest.mark.parametrize("reverse", [0, 1])
@pytest.mark.parametrize("shape,stride", [((1, 4, 6, 6), 2), ((2, 9, 3, 6), 3), ((2, 8, 1, 5), 2)])
def test_reorg_extents_equal_the_largest_offset_touched(shape, stride, reverse):
    n, c, h, w = shape
    k = registry.kernel("reorg_fwd_f32")
    args = {"batch": n, "width": w, "height": h, "channels": c, "stride": stride}
    args["reverse"] = reverse
    s, in_c = stride, c // (stride * stride)
    small = large = 0
    for z in range(n * c):
        b, kk = divmod(z, c)
        c2, offset = kk % in_c, kk // in_c
        for y in range(h):
            for x in range(w):
                small = max(small, x + w * (y + h * z) + 1)
                large_y = y * s + offset // s
                i = (x * s + offset % s) + w * s * (large_y + h * s * (c2 + in_c * b))
                large = max(large, i + 1)
    ext = k.extents(args, {"width": w, "height": h, "slices": n * c})
    assert ext == ({"x": small, "y": large} if reverse else {"x": large, "y": small})


def _host_networks(tmp_path):
    from darknet_metal.diagnostics.doctor import MINI_NETWORKS
    from darknet_metal.model.bundled import get_spec

    for name, text in MINI_NETWORKS:
        path = tmp_path / f"{name}.cfg"
        path.write_text(text)
        yield name, path, None
    for model in ("yolov3-tiny", "yolov4-tiny"):
        yield model, get_spec(model).cfg, (64, 64)


@pytest.mark.parametrize("simd", [False, True])
def test_every_host_dispatch_fits_the_declared_extents(tmp_path, simd):
    """The programs the GPU executor binds, with every tensor and parameter at its exact size,
    bind by role: building them checks every step, and no declared extent exceeds what the
    host gives the kernels."""
    batch = 2
    checked = set()
    for _, cfg, size in _host_networks(tmp_path):
        net = load(cfg, seed=0, input_size=size)
        sizes = {
            Param(spec.index, name): value.nbytes if isinstance(value, np.ndarray) else value
            for spec in net.layers
            for name, value in spec.device_params(net.params.get(spec.index)).items()
        }
        for found in _kernels_by_kind(net.layers, simd, sizes, batch).values():
            checked |= found
    assert len(checked) >= 15, checked


def test_bind_refuses_an_array_of_another_element_type():
    k = registry.Kernel("probe_fwd_f32", "x.metal", "dm_activation_args",
                        (registry.Binding("in", "index", "n", dtype="i32"),
                         registry.Binding("out", "y", "n")),
                        registry.Grid(("n",), (64,)))
    k.bind({"index": np.zeros(4, np.int32), "y": _f32(4)}, {"n": 4}, {"n": 4})
    with pytest.raises(BindingError, match="role 'index' holds int32 elements, not float32"):
        k.bind({"index": _f32(4), "y": _f32(4)}, {"n": 4}, {"n": 4})
    with pytest.raises(BindingError, match="role 'y' holds float32 elements, not int32"):
        k.bind({"index": np.zeros(4, np.int32), "y": np.zeros(4, np.int32)}, {"n": 4}, {"n": 4})
    with pytest.raises(ValueError, match="dtype 'f64'"):
        registry.Binding("in", "x", "n", dtype="f64")
