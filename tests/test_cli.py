"""The ``darknet-metal`` command line against the real Darknet's golden detections.

The printed lines are parsed and compared with ../shared/golden/.../detections.json, laid
out the way Darknet's ``detector test -ext_output`` prints them: one block per box, boxes by
increasing left edge, the box's best class first and its other classes after it in class
order, ``name: NN%`` then the box in pixels rounded half away from zero.
"""

from __future__ import annotations

import json
import math
import os
import re
import socket
import subprocess
import sys
from pathlib import Path

import pytest
from PIL import Image

from darknet_metal.cli import format_detections, main

REPO = Path(__file__).resolve().parents[1]
SHARED = Path(__file__).resolve().parents[2] / "shared"
MODEL_DIR = SHARED / "models" / "yolov3-tiny"
DOG = SHARED / "images" / "dog.jpg"
COFFEE = SHARED / "images" / "coffee.png"
GOLDEN = json.loads(
    (SHARED / "golden" / "darknet-v5-cpu-yolov3-tiny" / "detections.json").read_text()
)
COCO = (SHARED / "models" / "cfg" / "coco.names").read_text().splitlines()

LINE = re.compile(
    r"^(?P<name>[^:\t]+): (?P<pct>\d+)%\t\(left_x: +(?P<left>-?\d+) +top_y: +(?P<top>-?\d+) "
    r"+width: +(?P<width>-?\d+) +height: +(?P<height>-?\d+)\)$"
)
PREDICTED = re.compile(r"^(?P<path>.+): Predicted in \d+\.\d{6} milli-seconds\.$")


def _c_round(x: float) -> int:
    return int(math.copysign(math.floor(abs(x) + 0.5), x))


def _expected(stem: str) -> list[tuple[str, int, int, int, int, int]]:
    """The golden detections of ``stem`` in Darknet's printing order."""
    boxes: dict[tuple[float, ...], list[dict]] = {}
    for det in GOLDEN[stem]["detections"]:
        boxes.setdefault((det["left"], det["top"], det["width"], det["height"]), []).append(det)
    rows = []
    for box in sorted(boxes, key=lambda b: b[0]):
        group = sorted(boxes[box], key=lambda d: COCO.index(d["cls"]))
        best = max(group, key=lambda d: d["conf"])
        for det in [best] + [d for d in group if d is not best]:
            rows.append((det["cls"], int(f"{det['conf'] * 100:.0f}"), *(_c_round(v) for v in box)))
    return rows


def _parse(stdout: str) -> dict[str, list[tuple[str, int, int, int, int, int]]]:
    """Printed detections by image path; fails on any line that is neither form."""
    blocks: dict[str, list] = {}
    current = None
    for line in stdout.splitlines():
        if m := PREDICTED.match(line):
            current = blocks.setdefault(m["path"], [])
            continue
        m = LINE.match(line)
        assert m and current is not None, f"unexpected output line: {line!r}"
        current.append(
            (
                m["name"],
                int(m["pct"]),
                int(m["left"]),
                int(m["top"]),
                int(m["width"]),
                int(m["height"]),
            )
        )
    return blocks


def _closed_port_url() -> str:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    return f"http://127.0.0.1:{port}"


@pytest.fixture(autouse=True)
def offline_cache(monkeypatch: pytest.MonkeyPatch) -> None:
    """The shared models directory is the cache; any download attempt would fail."""
    monkeypatch.setenv("DARKNET_METAL_HOME", str(SHARED / "models"))
    monkeypatch.setenv("DARKNET_METAL_MIRROR", _closed_port_url())


def _error_lines(stderr: str) -> list[str]:
    lines = stderr.splitlines()
    assert all(line.startswith("darknet-metal: error: ") for line in lines), stderr
    assert "Traceback" not in stderr
    return lines


def test_detect_prints_the_golden_detections_and_writes_images(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    rc = main(["detect", str(DOG), str(COFFEE), "--model", "yolov3-tiny", "--out", str(tmp_path)])
    out, err = capsys.readouterr()
    assert rc == 0, err
    assert _error_lines(err) == []
    printed = _parse(out)
    assert list(printed) == [str(DOG), str(COFFEE)]
    assert printed[str(DOG)] == _expected("dog")
    assert printed[str(COFFEE)] == _expected("coffee")

    assert sorted(p.name for p in tmp_path.iterdir()) == [
        "coffee_predictions.jpg",
        "dog_predictions.jpg",
    ]
    for stem in ("dog", "coffee"):
        with Image.open(tmp_path / f"{stem}_predictions.jpg") as img:
            assert img.format == "JPEG"
            assert img.size == (GOLDEN[stem]["width"], GOLDEN[stem]["height"])
            img.load()


def test_bad_images_are_reported_and_the_others_still_run(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    missing = tmp_path / "missing.jpg"
    junk = tmp_path / "junk.jpg"
    junk.write_bytes(b"this is not a JPEG file")
    out_dir = tmp_path / "out"
    # No --model: the default model is yolov3-tiny.
    rc = main(["detect", str(missing), str(junk), str(DOG), "--out", str(out_dir)])
    out, err = capsys.readouterr()
    assert rc == 1
    errors = _error_lines(err)
    assert len(errors) == 2
    assert str(missing) in errors[0] and str(junk) in errors[1]
    assert _parse(out) == {str(DOG): _expected("dog")}
    assert [p.name for p in out_dir.iterdir()] == ["dog_predictions.jpg"]


def test_detect_with_cfg_weights_and_names(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    rc = main(
        [
            "detect",
            str(COFFEE),
            "--cfg",
            str(MODEL_DIR / "yolov3-tiny.cfg"),
            "--weights",
            str(MODEL_DIR / "yolov3-tiny.weights"),
            "--names",
            str(MODEL_DIR / "coco.names"),
            "--out",
            str(tmp_path),
        ]
    )
    out, err = capsys.readouterr()
    assert rc == 0, err
    assert _parse(out) == {str(COFFEE): _expected("coffee")}


def test_missing_cfg(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    cfg = tmp_path / "nope.cfg"
    rc = main(
        ["detect", str(DOG), "--cfg", str(cfg), "--weights", str(MODEL_DIR / "yolov3-tiny.weights")]
    )
    _, err = capsys.readouterr()
    assert rc == 1
    (line,) = _error_lines(err)
    assert str(cfg) in line


def test_truncated_weights(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    weights = tmp_path / "short.weights"
    with open(MODEL_DIR / "yolov3-tiny.weights", "rb") as f:
        weights.write_bytes(f.read(1_000_000))
    rc = main(
        [
            "detect",
            str(DOG),
            "--cfg",
            str(MODEL_DIR / "yolov3-tiny.cfg"),
            "--weights",
            str(weights),
            "--out",
            str(tmp_path),
        ]
    )
    out, err = capsys.readouterr()
    assert rc == 1
    (line,) = _error_lines(err)
    assert str(weights) in line
    assert out == ""
    assert not (tmp_path / "dog_predictions.jpg").exists()


def test_unknown_model(capsys: pytest.CaptureFixture[str]) -> None:
    rc = main(["detect", str(DOG), "--model", "yolov9-huge"])
    _, err = capsys.readouterr()
    assert rc == 1
    (line,) = _error_lines(err)
    assert "yolov9-huge" in line and "yolov4-tiny" in line


def test_summary_of_bundled_cfg(capsys: pytest.CaptureFixture[str]) -> None:
    from darknet_metal.models import MODELS

    rc = main(["summary", str(MODELS["yolov3-tiny"].cfg)])
    out, err = capsys.readouterr()
    assert rc == 0, err
    # yolov3-tiny at 416x416: 5.565 BFLOPs in its 13 convolutions (2 x MACs, summed by hand
    # from the layer shapes) plus ~0.006 in its 6 maxpools, as Darknet counts them.
    numbers = [float(x) for x in re.findall(r"\d+\.\d+", out)]
    assert any(5.56 <= x <= 5.575 for x in numbers), out


def test_summary_errors(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    missing = tmp_path / "absent.cfg"
    assert main(["summary", str(missing)]) == 1
    (line,) = _error_lines(capsys.readouterr().err)
    assert str(missing) in line

    bad = tmp_path / "bad.cfg"
    bad.write_text("[net]\nwidth=416\nheight=416\nchannels=3\n\n[convolutional]\nfilters=abc\n")
    assert main(["summary", str(bad)]) == 1
    (line,) = _error_lines(capsys.readouterr().err)
    assert str(bad) in line


@pytest.mark.parametrize(
    "argv",
    [
        [],
        ["detect"],
        ["detect", "x.jpg", "--cfg", "a.cfg"],
        ["detect", "x.jpg", "--weights", "a.weights"],
        ["detect", "x.jpg", "--model", "yolov3-tiny", "--cfg", "a.cfg", "--weights", "a.weights"],
        ["detect", "x.jpg", "--thresh", "1.5"],
        ["detect", "x.jpg", "--nms", "abc"],
        ["frobnicate"],
    ],
)
def test_usage_errors_exit_2(argv: list[str], capsys: pytest.CaptureFixture[str]) -> None:
    assert main(argv) == 2
    assert "usage:" in capsys.readouterr().err


def _det(class_id: int, name: str, conf: float, box: tuple[float, float, float, float]):
    from darknet_metal import Detection

    left, top, width, height = box
    return Detection(
        class_id=class_id,
        name=name,
        confidence=conf,
        objectness=0.9,
        left=left,
        top=top,
        width=width,
        height=height,
    )


def test_format_follows_darknet_printf() -> None:
    a = (10.5, -0.3, 2.5, 99.49)
    b = (-3.5, 7.0, 1000.0, 0.5)
    lines = format_detections(
        [
            _det(7, "truck", 0.40, a),
            _det(2, "car", 0.70, a),
            _det(5, "bus", 0.70, a),
            _det(0, "person", 0.994, b),
        ]
    )
    assert lines == [
        # The box with the smaller left edge comes first.
        "person: 99%\t(left_x:   -4   top_y:    7   width: 1000   height:    1)",
        # Best class first (car and bus tie at 70%: the lower class id wins), then the rest
        # by class id; C's round() sends halves away from zero and keeps the sign of -0.
        "car: 70%\t(left_x:   11   top_y:   -0   width:    3   height:   99)",
        "bus: 70%\t(left_x:   11   top_y:   -0   width:    3   height:   99)",
        "truck: 40%\t(left_x:   11   top_y:   -0   width:    3   height:   99)",
    ]


def test_python_dash_m_reports_errors_in_one_line(tmp_path: Path) -> None:
    env = dict(
        os.environ,
        PYTHONPATH=os.pathsep.join(filter(None, [str(REPO), os.environ.get("PYTHONPATH")])),
    )
    cfg = tmp_path / "missing.cfg"
    proc = subprocess.run(
        [
            sys.executable,
            "-m",
            "darknet_metal",
            "detect",
            str(DOG),
            "--cfg",
            str(cfg),
            "--weights",
            str(cfg),
        ],
        capture_output=True,
        text=True,
        env=env,
        cwd=tmp_path,
        timeout=120,
    )
    assert proc.returncode == 1, proc.stderr
    assert proc.stdout == ""
    (line,) = _error_lines(proc.stderr)
    assert str(cfg) in line
