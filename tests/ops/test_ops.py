"""Ops own their layer kinds: nothing else branches on a kind, and a new op needs no other module.

The first test reads the package's source: outside ``darknet_metal/ops/`` and the cfg parser
and schema (which describe keys per section), no module may compare a layer kind string, key
a table by kinds, test ``isinstance`` against op classes, or branch on a ``.kind`` attribute.
The second defines a layer kind in the test alone and runs it through the loader, both
executors and the memory planner.
"""

from __future__ import annotations

import ast
import pathlib

import numpy as np
import pytest

import darknet_metal
from darknet_metal import ops
from darknet_metal.cpu import route as cpu_route
from darknet_metal.model import cfg, cfg_schema
from darknet_metal.model.cfg import parse_cfg_text
from darknet_metal.ops import LAYER_KINDS, build_layers
from darknet_metal.runtime.program import Tensor, build_program

PACKAGE = pathlib.Path(darknet_metal.__file__).parent
#: Where layer kinds may be named: the ops, the cfg parser and schema, and the cfg edit of
#: Darknet's README (classes in each [yolo], filters in the convolution before it).
ALLOWED = {PACKAGE / "ops", PACKAGE / "model" / "cfg.py", PACKAGE / "model" / "cfg_schema.py",
           PACKAGE / "model" / "derive.py"}
OP_CLASSES = {cls.__name__ for cls in ops.OPS.values()} | {"Op"}


def _is_allowed(path: pathlib.Path) -> bool:
    return any(path == a or a in path.parents for a in ALLOWED)


def _docstrings(tree: ast.AST) -> set[int]:
    ids = set()
    for node in ast.walk(tree):
        if isinstance(node, (ast.Module, ast.ClassDef, ast.FunctionDef, ast.AsyncFunctionDef)):
            body = node.body
            if body and isinstance(body[0], ast.Expr) and isinstance(body[0].value, ast.Constant):
                ids.add(id(body[0].value))
    return ids


def _kind_branches(tree: ast.AST) -> list[tuple[int, str]]:
    """(line, what) of every way ``tree`` branches on a layer kind."""
    found = []
    docs = _docstrings(tree)
    parents: dict[int, ast.AST] = {}
    for node in ast.walk(tree):
        for child in ast.iter_child_nodes(node):
            parents[id(child)] = node
    for node in ast.walk(tree):
        if isinstance(node, ast.Constant) and isinstance(node.value, str):
            if node.value in LAYER_KINDS and id(node) not in docs:
                found.append((node.lineno, f"the layer kind string {node.value!r}"))
        elif isinstance(node, ast.Attribute) and node.attr == "kind":
            parent = parents.get(id(node))
            if isinstance(parent, (ast.Compare, ast.Match, ast.match_case)) or (
                isinstance(parent, ast.Subscript) and parent.slice is node
            ) or (isinstance(parent, ast.Dict) and node in parent.keys) or (
                isinstance(parent, ast.Call) and isinstance(parent.func, ast.Attribute)
                and parent.func.attr in ("get", "index", "count", "setdefault", "pop")
            ):
                found.append((node.lineno, "a branch or lookup on '.kind'"))
        elif isinstance(node, ast.Call) and isinstance(node.func, ast.Name) and (
            node.func.id in ("isinstance", "issubclass")
        ):
            names = {n.id for n in ast.walk(node.args[1]) if isinstance(n, ast.Name)}
            names |= {n.attr for n in ast.walk(node.args[1]) if isinstance(n, ast.Attribute)}
            if names & OP_CLASSES:
                classes = sorted(names & OP_CLASSES)
                found.append((node.lineno, f"isinstance on op classes {classes}"))
        elif isinstance(node, ast.ClassDef):
            bases = {b.id for b in node.bases if isinstance(b, ast.Name)}
            bases |= {b.attr for b in node.bases if isinstance(b, ast.Attribute)}
            if bases & {"Enum", "StrEnum", "IntEnum"}:
                members = {t.id for stmt in node.body if isinstance(stmt, ast.Assign)
                           for t in stmt.targets if isinstance(t, ast.Name)}
                if {m.lower() for m in members} & LAYER_KINDS:
                    found.append((node.lineno, f"an enum of layer kinds ({node.name})"))
    return found


def test_no_module_outside_ops_branches_on_the_layer_kind():
    problems = []
    for path in sorted(PACKAGE.rglob("*.py")):
        if _is_allowed(path):
            continue
        tree = ast.parse(path.read_text(encoding="utf-8"), str(path))
        problems += [f"{path.relative_to(PACKAGE)}:{line}: {what}"
                     for line, what in _kind_branches(tree)]
    assert not problems, "layer kinds outside darknet_metal/ops:\n" + "\n".join(problems)


@pytest.mark.parametrize(
    "source, what",
    [
        ("if spec.kind == 'convolutional':\n    pass\n", "kind string"),
        ("x = spec.kind in KINDS\n", "'.kind'"),
        ("x = TABLE[spec.kind]\n", "'.kind'"),
        ("x = TABLE.get(layer.kind)\n", "'.kind'"),
        ("x = {'maxpool': 1}\n", "kind string"),
        ("x = isinstance(spec, ConvolutionalOp)\n", "isinstance"),
        ("x = isinstance(spec, ops.YoloOp)\n", "isinstance"),
        ("class K(Enum):\n    ROUTE = 1\n", "enum"),
        ("match spec.kind:\n    case _:\n        pass\n", "'.kind'"),
    ],
)
def test_the_kind_check_catches_each_form(source, what):
    found = _kind_branches(ast.parse(source))
    assert any(what in w for _, w in found), (source, found)


def test_the_kind_check_allows_reports_and_docstrings():
    source = (
        '"""Mentions convolutional layers."""\nrow = {"type": spec.kind}\nmsg = f"{spec.kind}"\n'
    )
    assert _kind_branches(ast.parse(source)) == []


def test_every_parsed_section_kind_has_an_op():
    assert set(cfg.SECTION_KINDS) - {"net"} == set(ops.OPS)
    for kind, cls in ops.OPS.items():
        assert cls.kind == kind and cls.short_name
    with pytest.raises(KeyError, match="no op for layer kind"):
        ops.op_class("not_a_layer")


# -- a layer kind defined here alone ---------------------------------------------------------


class CopyOp(ops.Op):
    """y = x, computed: a host copy on the CPU, a linear activation kernel on a device."""

    kind = "test_copy"
    short_name = "copy"

    def cpu_steps(self, state, sources, out, workspace):
        return [cpu_route.route_step(sources[0], out, 0, out.shape[1], 0)]

    def emit_device_forward(self, e):
        n = e.batch * self.out_size
        e.kernel("activation_fwd_f32", {"x": e.inputs[0], "y": e.output}, {"n": n}, n=n, act=0)


COPY_CFG = """[net]
width=12
height=10
channels=3

[convolutional]
filters=4
size=3
stride=1
pad=1
activation=leaky

[test_copy]

[maxpool]
size=2
stride=2

[test_copy]
"""


@pytest.fixture
def copy_op(monkeypatch, tmp_path):
    monkeypatch.setitem(ops.OPS, CopyOp.kind, CopyOp)
    monkeypatch.setitem(cfg_schema.SCHEMA, CopyOp.kind, ())
    monkeypatch.setitem(cfg_schema.SECTION_ALIASES, CopyOp.kind, CopyOp.kind)
    path = tmp_path / "copy.cfg"
    path.write_text(COPY_CFG)
    return path


def test_a_new_op_is_planned(copy_op):
    specs = build_layers(parse_cfg_text(COPY_CFG))
    assert [type(s).__name__ for s in specs] == ["ConvolutionalOp", "CopyOp", "MaxpoolOp",
                                                 "CopyOp"]
    program = build_program(specs, lambda s, e: s.emit_device_forward(e), batch=2, keep=[3])
    copies = [step for step in program.steps if step.layer in (1, 3)]
    assert [s.kernel for s in copies] == ["activation_fwd_f32"] * 2
    assert copies[0].reads == (Tensor(0, "output"),) and copies[0].writes == (Tensor(1, "output"),)
    assert program.tensors[Tensor(3, "output")].shape == (2, 4, 5, 6)


def test_a_new_op_loads_and_runs(copy_op, device):
    net = darknet_metal.load(copy_op, seed=3, device=device)
    x = np.random.default_rng(0).random((2, 3, 10, 12), dtype=np.float32)
    conv, copy, pool, copy2 = net.forward(x, outputs=[0, 1, 2, 3])
    np.testing.assert_array_equal(copy, conv)
    np.testing.assert_array_equal(copy2, pool)
    assert "copy" in net.summary()
    reference = darknet_metal.load(copy_op, seed=3).forward(x, outputs=[3])[0]
    np.testing.assert_allclose(copy2, reference, rtol=0, atol=1e-5)
    if device != "cpu":
        placements = net.executor.coverage()
        assert placements[1].where == "kernels"
        assert placements[1].kernels == ("activation_fwd_f32",)
