"""tools/parity.py and darknet-metal doctor on the emulator device."""

import importlib.util
import json
import re
import subprocess
import sys

import numpy as np
import pytest
from shared_paths import CFG_DIR, ROOT, YOLOV3_TINY

from darknet_metal.cli import main
from darknet_metal.diagnostics import parity
from darknet_metal.metal import registry


def _tool():
    spec = importlib.util.spec_from_file_location("parity_tool", ROOT / "tools" / "parity.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_parity_yolov3_tiny_real_weights():
    report = _tool().run_parity(
        YOLOV3_TINY / "yolov3-tiny.cfg", YOLOV3_TINY / "yolov3-tiny.weights", size=(96, 96)
    )
    assert report["ok"], parity.format_report(report)
    assert report["input_shape"] == [1, 3, 96, 96]
    assert len(report["layers"]) == 24
    assert all(r["where"] == "kernels" for r in report["layers"])


def test_parity_yolov4_tiny_random_weights_cli(capsys):
    rc = parity.main(
        [str(CFG_DIR / "yolov4-tiny.cfg"), "--random-seed", "4", "--size", "96x64", "--json"]
    )
    report = json.loads(capsys.readouterr().out)
    assert rc == 0, parity.format_report(report)
    assert report["ok"] and report["input_shape"] == [1, 3, 64, 96]
    assert [r["type"] for r in report["layers"]].count("yolo") == 2


def test_parity_fails_when_outside_tolerance(monkeypatch, capsys):
    monkeypatch.setattr(parity, "DEFAULT_TOLERANCE", (-1.0, -1.0))
    rc = parity.main([str(YOLOV3_TINY / "yolov3-tiny.cfg"), "--size", "64x64"])
    assert rc == 1
    assert "FAIL" in capsys.readouterr().out


def test_compare_catches_wrong_values():
    rng = np.random.default_rng(0)
    ref = rng.standard_normal(1000).astype(np.float32)
    assert parity.compare(ref + np.float32(1e-7), ref)["ok"]
    bad = ref.copy()
    bad[17] += 0.05 * np.abs(ref).max()
    assert not parity.compare(bad, ref)["ok"]
    assert not parity.compare(np.full_like(ref, np.nan), ref)["ok"]


def test_parity_tool_command_line():
    proc = subprocess.run(
        [
            sys.executable,
            str(ROOT / "tools" / "parity.py"),
            str(YOLOV3_TINY / "yolov3-tiny.cfg"),
            "--size",
            "64",
        ],
        capture_output=True,
        text=True,
        cwd=ROOT,
        timeout=120,
        env={"PYTHONPATH": str(ROOT), "PATH": "/usr/bin:/bin"},
    )
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert "PASS" in proc.stdout


def test_parity_size_argument_errors(capsys):
    assert parity.main([str(YOLOV3_TINY / "yolov3-tiny.cfg"), "--size", "0x5"]) == 2
    assert "size" in capsys.readouterr().err


def test_doctor_passes_on_emu(capsys, monkeypatch):
    monkeypatch.setenv("DARKNET_METAL_HOME", str(YOLOV3_TINY.parent))
    assert main(["doctor", "--device", "emu", "--size", "64"]) == 0
    out = capsys.readouterr().out
    n = len(registry.KERNELS)
    assert f"{n}/{n} pipelines built" in out
    assert f"kernels checked: {n}/{n}" in out
    assert "PASS: the Metal path agrees" in out
    assert "yolov3-tiny.weights" in out  # the cached real weights were used


@pytest.mark.skipif(sys.platform == "darwin", reason="a Mac may have Metal")
def test_doctor_reports_missing_metal(capsys):
    assert main(["doctor", "--device", "metal"]) == 1
    assert "unavailable" in capsys.readouterr().out


def test_doctor_speed_measurement_runs():
    from darknet_metal.diagnostics.doctor import measure_speed

    lines = []
    gpu_ms, cpu_ms = measure_speed("emu", size=32, repeats=1, out=lines.append)
    assert gpu_ms > 0 and cpu_ms > 0
    assert "speed-up" in lines[0]


@pytest.mark.parametrize("as_json", [True, False])
def test_parity_reports_each_stage_on_stderr(as_json, capsys):
    argv = [str(YOLOV3_TINY / "yolov3-tiny.cfg"), "--size", "64x64"]
    assert parity.main(argv + ["--json"] * as_json) == 0
    out, err = capsys.readouterr()
    if as_json:
        assert json.loads(out)["ok"]  # stdout holds the JSON report alone
    else:
        assert out.rstrip().endswith("PASS: every layer within tolerance")
    lines = err.splitlines()
    assert all(line.startswith("parity.py: ") for line in lines), err
    stages = [
        "loading yolov3-tiny.cfg (random weights)",
        "CPU pass, 24 layers at 64x64",
        "emu pass, 24 layers at 64x64",
    ]
    assert len(lines) == 2 * len(stages), err
    for stage, begin, end in zip(stages, lines[::2], lines[1::2], strict=True):
        assert begin == f"parity.py: {stage} ..."
        assert re.fullmatch(rf"parity\.py: {re.escape(stage)}: done in \d+\.\d s", end), end


def test_run_parity_is_quiet_without_progress(capsys):
    parity.run_parity(YOLOV3_TINY / "yolov3-tiny.cfg", size=(32, 32))
    assert capsys.readouterr() == ("", "")


class _FlushRecorder:
    """A stdout that records writes and flushes in order."""

    def __init__(self):
        self.events = []

    def write(self, text):
        self.events.append(("write", text))
        return len(text)

    def flush(self):
        self.events.append(("flush", None))


@pytest.mark.skipif(sys.platform == "darwin", reason="a Mac may have Metal")
def test_doctor_flushes_each_line(monkeypatch):
    # Without Metal the doctor stops after its first lines: enough to see how it writes.
    recorder = _FlushRecorder()
    monkeypatch.setattr(sys, "stdout", recorder)
    assert main(["doctor", "--device", "metal"]) == 1
    monkeypatch.undo()
    events = recorder.events
    ends = [i for i, (kind, text) in enumerate(events) if kind == "write" and text.endswith("\n")]
    assert len(ends) >= 4, events
    for i in ends:  # every finished line is flushed before anything else is written
        assert i + 1 < len(events) and events[i + 1][0] == "flush", events[i : i + 2]


def test_training_parity_command_line_json():
    proc = subprocess.run(
        [sys.executable, str(ROOT / "tools" / "parity.py"), str(YOLOV3_TINY / "yolov3-tiny.cfg"),
         "--train", "--size", "64", "--batch", "2", "--json"],
        capture_output=True, text=True, cwd=ROOT, timeout=300,
        env={"PYTHONPATH": str(ROOT), "PATH": "/usr/bin:/bin"},
    )
    assert proc.returncode == 0, proc.stdout + proc.stderr
    report = json.loads(proc.stdout)
    assert report["ok"] and report["input_shape"] == [2, 3, 64, 64]
    assert [row["where"] for row in report["layers"]] == ["kernels"] * 24
    convs = [row for row in report["layers"] if row["type"] == "convolutional"]
    assert all(row["gradients"]["nmse"] < 1e-8 and row["parameters"]["ok"] for row in convs)
    assert "emu training step: done" in proc.stderr


def test_training_parity_catches_a_wrong_backward(monkeypatch):
    from darknet_metal.ops import yolo

    # A [yolo] backward sending twice its delta: every layer below must fail.
    monkeypatch.setattr(yolo.YoloOp, "emit_device_backward",
                        lambda self, e, ts: yolo.emit_device_add_into_input(e, 2.0))
    report = parity.run_training_parity(YOLOV3_TINY / "yolov3-tiny.cfg", size=(64, 64))
    assert not report["ok"]
    failed = {row["index"] for row in report["layers"]
              if row["gradients"] is not None and not row["gradients"]["ok"]}
    assert {0, 13, 15} <= failed
    assert "FAIL: layers" in parity.format_training_report(report)


@pytest.mark.parametrize("argv", [["--train", "--image", "x.jpg"], ["--train", "--batch", "0"]])
def test_training_parity_usage_errors(capsys, argv):
    assert parity.main([str(YOLOV3_TINY / "yolov3-tiny.cfg"), *argv]) == 2
    assert "error" in capsys.readouterr().err
