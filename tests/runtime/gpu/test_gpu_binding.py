"""Kernel buffers are bound by registry role and checked before anything is encoded (emu).

Each case is an op whose device forward binds a kernel wrongly; loading a network with it on
the emulator must raise ``BindingError`` naming the kernel and the role, and the device must
not have dispatched or committed anything.
"""

from __future__ import annotations

import numpy as np
import pytest

import darknet_metal
from darknet_metal import metal, ops
from darknet_metal.cpu import route as cpu_route
from darknet_metal.errors import BindingError
from darknet_metal.metal import get_device
from darknet_metal.metal.dispatch import gemm_args, pack
from darknet_metal.model import cfg_schema
from darknet_metal.runtime.program import Param

CFG = """[net]
width=8
height=6
channels=3

[convolutional]
filters=4
size=3
stride=1
pad=1
activation=leaky

[{kind}]
"""


def _copy_op(kind: str, bind):
    class BadOp(ops.Op):
        short_name = "bad"

        def cpu_steps(self, state, sources, out, workspace):
            return [cpu_route.route_step(sources[0], out, 0, out.shape[1], 0)]

        def emit_device_forward(self, e):
            n = e.batch * self.out_size
            e.kernel("activation_fwd_f32", bind(e), {"n": n}, n=n, act=0)

    BadOp.kind = kind
    return BadOp


CASES = {
    "swapped": (lambda e: {"x": e.output, "y": e.inputs[0]}, ["before any step writes it"]),
    "missing": (lambda e: {"x": e.inputs[0]}, ["activation_fwd_f32", "'y'"]),
    "unknown": (lambda e: {"x": e.inputs[0], "y": e.output, "z": e.output},
                ["activation_fwd_f32", "'z'"]),
}


@pytest.mark.parametrize("case", sorted(CASES))
def test_wrong_binding_raises_before_encoding(case, monkeypatch, tmp_path):
    bind, words = CASES[case]
    kind = f"test_bad_{case}"
    monkeypatch.setitem(ops.OPS, kind, _copy_op(kind, bind))
    monkeypatch.setitem(cfg_schema.SCHEMA, kind, ())
    monkeypatch.setitem(cfg_schema.SECTION_ALIASES, kind, kind)
    path = tmp_path / "bad.cfg"
    path.write_text(CFG.format(kind=kind))
    # On the CPU the op runs (its host step is bound by the executor).
    x = np.random.default_rng(1).random((1, 3, 6, 8), dtype=np.float32)
    conv, out = darknet_metal.load(path, seed=0).forward(x, outputs=[0, 1])
    np.testing.assert_array_equal(out, conv)
    before = metal.stats("emu")
    with pytest.raises(BindingError) as info:
        darknet_metal.load(path, seed=0, device="emu").forward(x)
    after = metal.stats("emu")
    for word in words:
        assert word in str(info.value), (word, str(info.value))
    assert after["kernels_dispatched"] == before["kernels_dispatched"]
    assert after["command_buffers_committed"] == before["command_buffers_committed"]


def test_pack_checks_roles_against_real_buffers():
    dev = get_device("emu")
    a, b = dev.buffer(4 * 6 * 5), dev.buffer(4 * 5 * 7)
    bias, c = dev.buffer(4 * 6), dev.buffer(4 * 6 * 7)
    args, sizes = gemm_args(M=6, N=7, K=5, lda=5, ldb=7, ldc=7, bias_mode=1, act=0)
    try:
        pack("gemm_nn_f32", {"a": a, "b": b, "bias": bias, "c": c}, args, sizes)
        with pytest.raises(BindingError, match="'bias'"):
            pack("gemm_nn_f32", {"a": a, "b": b, "c": c}, args, sizes)
        with pytest.raises(BindingError, match="'C'"):
            pack("gemm_nn_f32", {"a": a, "b": b, "bias": bias, "C": c}, args, sizes)
        # a is 6x5 and b 5x7: swapped, b's role gets 120 bytes where it needs 140.
        with pytest.raises(BindingError, match="role 'b' holds 120 bytes"):
            pack("gemm_nn_f32", {"a": b, "b": a, "bias": bias, "c": c}, args, sizes)
    finally:
        for buf in (a, b, bias, c):
            buf.release()


def test_param_refs_must_exist():
    from darknet_metal.ops import build_layers
    from darknet_metal.runtime.program import build_program

    specs = build_layers(darknet_metal.model.cfg.parse_cfg_text(CFG.format(kind="dropout")))
    with pytest.raises(BindingError, match="unknown Param"):
        build_program(specs, lambda s, e: s.emit_device_forward(e), batch=1, keep=None,
                      param_nbytes={Param(9, "weights"): 16})
