"""Fuzz: a mutated real cfg (the cfg fuzzer's mutations of the tiny networks) either fails to
load, or exports and agrees with ONNX Runtime, or is refused with an ExportError naming a
layer; never another exception."""

from __future__ import annotations

import numpy as np
import pytest
from cfg_mutations import CFG_LINES, mutated_cfg
from hypothesis import HealthCheck, given, settings

import darknet_metal as dm
from darknet_metal.errors import DarknetMetalError, ExportError

onnx = pytest.importorskip("onnx")
ort = pytest.importorskip("onnxruntime")

pytestmark = pytest.mark.slow

#: yolov3-tiny and yolov4-tiny (the large networks take seconds a load).
TINY = CFG_LINES[:2]


@settings(max_examples=120, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(mutated_cfg(TINY))
def test_a_mutated_cfg_exports_and_agrees_or_is_refused(tmp_path_factory, text):
    folder = tmp_path_factory.mktemp("fuzz")
    cfg = folder / "fuzz.cfg"
    cfg.write_text(text, encoding="utf-8")
    try:
        net = dm.load(cfg, seed=1, input_size=(96, 96))
    except DarknetMetalError:
        return  # the loader's refusals are its own fuzzers' business
    out = folder / "fuzz.onnx"
    try:
        net.export_onnx(out, batch="dynamic")
    except ExportError as err:
        assert err.layer is not None and f"layer {err.layer} ({err.kind})" in str(err)
        assert not out.exists()
        return
    x = np.random.default_rng(0).random((2, *net.input_shape), dtype=np.float32)
    session = ort.InferenceSession(str(out), providers=["CPUExecutionProvider"])
    got = session.run(None, {"input": x})
    for g, want in zip(got, net.forward(x), strict=True):
        bound = 1e-4 * float(np.abs(want).max()) + 1e-5
        assert float(np.abs(g - want).max()) <= bound
