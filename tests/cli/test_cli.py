"""The ``darknet-metal`` command line against the real Darknet's golden detections.

The printed lines are parsed and compared with ../shared/golden/.../detections.json, laid
out the way Darknet's ``detector test -ext_output`` prints them: one block per box, boxes by
increasing left edge, the box's best class first and its other classes after it in class
order, ``name: NN%`` then the box in pixels rounded half away from zero.
"""

from __future__ import annotations

import contextlib
import http.server
import json
import math
import os
import re
import socket
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import numpy as np
import pytest
from PIL import Image
from shared_paths import ROOT, SHARED

from darknet_metal.cli import format_detections, main

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


WARM_UP = re.compile(r"^darknet-metal: warm-up: (?P<ms>\d+\.\d) ms \(.*\)$")


def _error_lines(stderr: str) -> list[str]:
    """The error lines of ``stderr``; fails on any other line but the warm-up time."""
    lines = [line for line in stderr.splitlines() if not WARM_UP.match(line)]
    assert all(line.startswith("darknet-metal: error: ") for line in lines), stderr
    assert "Traceback" not in stderr
    return lines


def test_detect_without_images_uses_the_bundled_sample(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    from darknet_metal.model.bundled import SAMPLE_IMAGE

    assert SAMPLE_IMAGE.read_bytes() == DOG.read_bytes()  # Darknet's own dog.jpg
    rc = main(["detect", "--model", "yolov3-tiny", "--out", str(tmp_path)])
    out, err = capsys.readouterr()
    assert rc == 0, err
    assert f"no IMAGE given: detecting in the bundled sample {SAMPLE_IMAGE}" in err
    printed = _parse(out)
    assert printed[str(SAMPLE_IMAGE)] == _expected("dog")
    assert [p.name for p in tmp_path.iterdir()] == ["dog_predictions.jpg"]


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


def test_detect_list_writes_darknets_json_matching_detect(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    import darknet_metal as dm

    junk = tmp_path / "junk.jpg"
    junk.write_bytes(b"this is not a JPEG file")
    listing = tmp_path / "list.txt"
    listing.write_text(f"{DOG}\n\n{junk}\n{COFFEE}\n")
    result = tmp_path / "result.json"
    rc = main(["detect", "--list", str(listing), "--json", str(result), "--out",
               str(tmp_path / "out")])
    out, err = capsys.readouterr()
    assert rc == 1  # the junk image
    assert len(_error_lines(err)) == 1 and str(junk) in err
    assert _parse(out) == {str(DOG): _expected("dog"), str(COFFEE): _expected("coffee")}

    entries = json.loads(result.read_text())
    assert [(e["frame_id"], e["filename"]) for e in entries] == [(1, str(DOG)), (2, str(COFFEE))]
    net = dm.load(MODEL_DIR / "yolov3-tiny.cfg", MODEL_DIR / "yolov3-tiny.weights",
                  names=MODEL_DIR / "coco.names")
    for entry, path, stem in zip(entries, (DOG, COFFEE), ("dog", "coffee"), strict=True):
        found = net.detect(path)
        width, height = GOLDEN[stem]["width"], GOLDEN[stem]["height"]
        assert [(o["class_id"], o["name"]) for o in entry["objects"]] == [
            (d.class_id, d.name) for d in found]
        for o, d in zip(entry["objects"], found, strict=True):
            box = o["relative_coordinates"]
            assert o["confidence"] == pytest.approx(d.confidence, rel=1e-6)
            assert box["center_x"] * width == pytest.approx(d.left + d.width / 2, abs=1e-3)
            assert box["center_y"] * height == pytest.approx(d.top + d.height / 2, abs=1e-3)
            assert box["width"] * width == pytest.approx(d.width, abs=1e-3)
            assert box["height"] * height == pytest.approx(d.height, abs=1e-3)
    # The golden classes, in Darknet's -out order.
    assert sorted(o["name"] for o in entries[0]["objects"]) == sorted(
        d["cls"] for d in GOLDEN["dog"]["detections"])


def test_detect_list_errors(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    empty = tmp_path / "empty.txt"
    empty.write_text("\n\n")
    assert main(["detect", "--list", str(empty)]) == 1
    assert "names no image" in capsys.readouterr().err
    assert main(["detect", "--list", str(tmp_path / "none.txt")]) == 1
    assert "none.txt" in capsys.readouterr().err
    assert main(["detect", str(DOG), "--json", str(tmp_path)]) == 1
    assert "--json is a directory" in capsys.readouterr().err


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
    # The fix in the command line's terms, not Python's; the file and layer named once.
    assert "darknet-metal train DATA CFG BACKBONE" in line and "partial=True" not in line
    assert line.count(str(weights)) == 1 and line.count("layer 8") == 1, line
    assert out == ""
    assert not (tmp_path / "dog_predictions.jpg").exists()


def test_unknown_model(capsys: pytest.CaptureFixture[str]) -> None:
    rc = main(["detect", str(DOG), "--model", "yolov9-huge"])
    _, err = capsys.readouterr()
    assert rc == 1
    (line,) = _error_lines(err)
    assert "yolov9-huge" in line and "yolov4-tiny" in line


def test_summary_of_bundled_cfg(capsys: pytest.CaptureFixture[str]) -> None:
    from darknet_metal.model.bundled import MODELS

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
        PYTHONPATH=os.pathsep.join(filter(None, [str(ROOT), os.environ.get("PYTHONPATH")])),
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


# ---------------------------------------------------------------------------------------
# Inputs checked before any download, nothing left behind by a failed command


class _NotFoundHandler(http.server.BaseHTTPRequestHandler):
    """Answers 404 to everything and counts the requests (a mirror without the file)."""

    requests: list[str] = []

    def do_GET(self) -> None:
        type(self).requests.append(self.path)
        self.send_error(404)

    def log_message(self, format: str, *args: object) -> None:
        pass


@contextlib.contextmanager
def _mirror_404() -> Iterator[tuple[str, list[str]]]:
    handler = type("Handler", (_NotFoundHandler,), {"requests": []})
    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), handler)
    thread = threading.Thread(target=server.serve_forever, args=(0.05,), daemon=True)
    thread.start()
    try:
        yield f"http://127.0.0.1:{server.server_address[1]}", handler.requests
    finally:
        server.shutdown()
        server.server_close()
        thread.join()


def _tree(root: Path) -> list[str] | None:
    """Every path under ``root``, folders included; None when ``root`` does not exist."""
    if not root.exists():
        return None
    return sorted(str(p.relative_to(root)) for p in root.rglob("*"))


@pytest.mark.parametrize("cache_exists", [False, True])
def test_failed_download_leaves_the_cache_and_out_as_they_were(
    cache_exists: bool,
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
    capsys: pytest.CaptureFixture[str],
) -> None:
    home = tmp_path / "cache"
    if cache_exists:
        (home / "other").mkdir(parents=True)
        (home / "other" / "kept.txt").write_text("x")
    before = _tree(home)
    monkeypatch.setenv("DARKNET_METAL_HOME", str(home))
    out_dir = tmp_path / "out"
    with _mirror_404() as (url, requests):
        monkeypatch.setenv("DARKNET_METAL_MIRROR", url)
        rc = main(["detect", str(DOG), "--model", "yolov4-tiny", "--out", str(out_dir)])
    out, err = capsys.readouterr()
    assert rc == 1
    (line,) = _error_lines(err)
    assert "404" in line and "yolov4-tiny" in line
    assert requests == ["/yolov4-tiny/yolov4-tiny.weights"]
    assert out == ""
    assert _tree(home) == before
    assert not out_dir.exists()


def test_out_is_not_made_when_every_image_fails(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    junk = tmp_path / "junk.jpg"
    junk.write_bytes(b"not an image")
    out_dir = tmp_path / "a" / "b" / "out"
    rc = main(["detect", str(junk), str(tmp_path / "missing.jpg"), "--out", str(out_dir)])
    _, err = capsys.readouterr()
    assert rc == 1
    assert len(_error_lines(err)) == 2
    assert not (tmp_path / "a").exists()


def test_out_that_is_a_file_is_reported_before_loading(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    blocker = tmp_path / "out"
    blocker.write_text("a file")
    rc = main(["detect", str(DOG), "--out", str(blocker)])
    out, err = capsys.readouterr()
    assert rc == 1
    (line,) = err.splitlines()  # no warm-up line: nothing was loaded
    assert line.startswith("darknet-metal: error: ") and str(blocker) in line
    assert out == "" and blocker.read_text() == "a file"


@pytest.mark.parametrize("bad", ["image", "names"])
def test_missing_inputs_are_reported_before_any_download(
    bad: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    home = tmp_path / "cache"
    monkeypatch.setenv("DARKNET_METAL_HOME", str(home))
    missing = tmp_path / ("missing.jpg" if bad == "image" else "missing.names")
    argv = ["detect", str(missing if bad == "image" else DOG), "--model", "yolov3-tiny"]
    if bad == "names":
        argv += ["--names", str(missing)]
    with _mirror_404() as (url, requests):
        monkeypatch.setenv("DARKNET_METAL_MIRROR", url)
        rc = main([*argv, "--out", str(tmp_path / "out")])
    out, err = capsys.readouterr()
    assert rc == 1
    (line,) = _error_lines(err)
    assert str(missing) in line and "not found" in line
    assert "download" not in line
    assert requests == []
    assert out == ""
    assert not home.exists() and not (tmp_path / "out").exists()


def test_directory_as_cfg_or_weights_is_called_a_directory(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    folder = tmp_path / "folder.cfg"
    folder.mkdir()
    cfg, weights = MODEL_DIR / "yolov3-tiny.cfg", MODEL_DIR / "yolov3-tiny.weights"
    runs = [
        ["summary", str(folder)],
        ["detect", str(DOG), "--cfg", str(folder), "--weights", str(weights)],
        ["detect", str(DOG), "--cfg", str(cfg), "--weights", str(folder)],
        ["detect", str(DOG), "--names", str(folder)],
        ["detect", str(folder)],
    ]
    for argv in runs:
        assert main([*argv, "--out", str(tmp_path / "out")] if argv[0] == "detect" else argv) == 1
        (line,) = _error_lines(capsys.readouterr().err)
        assert f"{folder}: is a directory" in line, (argv, line)
        assert "not found" not in line
    assert not (tmp_path / "out").exists()


# ---------------------------------------------------------------------------------------
# Timings, warnings, argument checks and help


_TINY_CFG = """[net]
width=32
height=32
channels=3

[convolutional]
filters=18
size=1
stride=1
pad=0
activation=linear

[yolo]
mask=0,1,2
anchors=10,14,23,27,37,58
classes=1
num=3
"""


def test_first_image_time_leaves_out_the_warm_up(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    import darknet_metal
    from darknet_metal.network import Network

    # A network whose passes take microseconds, so the times depend on the sleep alone even
    # on a loaded machine.
    cfg, weights, names = tmp_path / "tiny.cfg", tmp_path / "tiny.weights", tmp_path / "one.names"
    cfg.write_text(_TINY_CFG)
    darknet_metal.load(cfg, seed=0).save_weights(weights)
    names.write_text("thing\n")

    forward = Network.forward
    shapes = []

    def slow_first_forward(self, x, outputs=None):
        shapes.append(np.shape(x))
        if len(shapes) == 1:
            time.sleep(1.0)  # stands in for planning, buffers and pipelines
        return forward(self, x, outputs)

    monkeypatch.setattr(Network, "forward", slow_first_forward)
    argv = ["detect", str(DOG), str(COFFEE), "--cfg", str(cfg), "--weights", str(weights)]
    rc = main([*argv, "--names", str(names), "--out", str(tmp_path / "out")])
    out, err = capsys.readouterr()
    assert rc == 0, err
    assert list(_parse(out)) == [str(DOG), str(COFFEE)]
    (warm,) = [m for line in err.splitlines() if (m := WARM_UP.match(line))]
    assert float(warm["ms"]) >= 1000.0
    times = [float(t) for t in re.findall(r"Predicted in (\d+\.\d+) milli-seconds", out)]
    assert len(times) == 2 and times[0] < 1000.0, times
    assert shapes == [(1, 3, 32, 32)] * 3  # the warm-up on a blank input, then one per image
    assert _error_lines(err) == []


def test_transparent_png_gets_a_warning(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    rgba = np.zeros((64, 80, 4), np.uint8)
    rgba[..., :3] = 200
    clear = tmp_path / "clear.png"
    Image.fromarray(rgba, "RGBA").save(clear)  # every pixel fully transparent
    rgba[..., 3] = 255
    opaque = tmp_path / "opaque.png"
    Image.fromarray(rgba, "RGBA").save(opaque)  # has alpha, but every pixel is opaque
    rc = main(["detect", str(clear), str(opaque), str(DOG), "--out", str(tmp_path / "out")])
    out, err = capsys.readouterr()
    assert rc == 0, err
    warnings = [line for line in err.splitlines() if line.startswith("darknet-metal: warning: ")]
    assert len(warnings) == 1, err
    assert str(clear) in warnings[0] and "alpha is ignored, as Darknet does" in warnings[0]
    assert set(_parse(out)) == {str(clear), str(opaque), str(DOG)}


def test_detect_help_mentions_alpha() -> None:
    text = " ".join(_help(["detect", "--help"]).split())
    assert "alpha is ignored, as Darknet does" in text


@pytest.mark.parametrize(
    ("value", "message"),
    [
        ("50", "must be a positive multiple of 32, got 50"),
        ("0", "must be a positive multiple of 32, got 0"),
        ("-32", "must be a positive multiple of 32, got -32"),
        ("abc", "not an integer: 'abc'"),
    ],
)
def test_doctor_size_is_checked_by_argparse(
    value: str, message: str, capsys: pytest.CaptureFixture[str]
) -> None:
    assert main(["doctor", "--size", value]) == 2
    err = capsys.readouterr().err
    assert "usage:" in err
    assert f"darknet-metal doctor: error: argument --size: {message}" in err.splitlines()


def _help(argv: list[str]) -> str:
    with contextlib.redirect_stdout(__import__("io").StringIO()) as buf:
        assert main(argv) == 0
    return buf.getvalue()


def test_help_shows_the_defaults() -> None:
    detect = " ".join(_help(["detect", "--help"]).split())
    options = re.split(r" (?=--[a-z])", detect[detect.index("options:"):])
    for option, default in [("--thresh", "0.25"), ("--nms", "0.45"), ("--out", "."),
                            ("--device", "cpu")]:
        (text,) = [o for o in options if o.startswith(f"{option} ")]
        assert f"(default: {default})" in text, text
    doctor = " ".join(_help(["doctor", "--help"]).split())
    assert "(default: 96)" in doctor


def test_every_commands_help_prints_its_percent_signs_once(capsys):
    # argparse formats "%" only in arguments' help, never in a description: a "%%" written
    # there reaches the user as two.
    def help_of(*words: str) -> str:
        assert main([*words, "--help"]) == 0
        return capsys.readouterr().out

    listing = help_of().split("COMMAND", 2)[-1]
    commands = re.findall(r"^    ([a-z][\w-]*)", listing, re.MULTILINE)
    assert {"cfg", "train", "detect", "profile"} <= set(commands)
    for name in commands:
        assert "%%" not in help_of(name), name
    assert "steps at 80% and 90% of it" in " ".join(help_of("cfg").split())


def test_a_file_that_is_not_an_image_is_reported_before_the_model_loads(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    garbage = tmp_path / "notes.jpg"
    garbage.write_bytes(b"hello, not an image")
    rc = main(["detect", str(garbage), "--cfg", str(MODEL_DIR / "yolov3-tiny.cfg"),
               "--weights", str(MODEL_DIR / "yolov3-tiny.weights"), "--out", str(tmp_path)])
    err = capsys.readouterr().err
    assert rc == 1
    (line,) = _error_lines(err)
    assert line == (f"darknet-metal: error: {garbage}: cannot decode image (not in any image "
                    "format Pillow reads)")
    assert "warm-up" not in err  # no model was loaded for it


def test_an_output_in_a_missing_folder_is_named_not_its_temporary(tmp_path, capsys):
    """Every file is written beside its name and renamed: a missing folder is reported with
    the file the user named, not the hidden temporary."""
    out = tmp_path / "missing" / "y.cfg"
    assert main(["cfg", "--model", "yolov4-tiny", "--classes", "3", str(out)]) == 1
    err = capsys.readouterr().err
    assert f"cannot write {out}: the folder {out.parent} does not exist" in err
    assert ".tmp" not in err and not out.parent.exists()
