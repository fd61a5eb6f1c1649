"""``darknet-metal video`` on a short generated clip: a playable annotated video with every
frame at the source's size and rate, per-frame JSON equal to detecting each decoded frame,
clear errors that leave nothing behind."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
from PIL import Image
from shared_paths import IMAGES, SHARED, YOLOV3_TINY

import darknet_metal as dm
from darknet_metal.cli import main

cv2 = pytest.importorskip("cv2")

FRAMES, FPS, SIZE = 9, 12.0, (320, 256)


@pytest.fixture(autouse=True)
def offline_cache(monkeypatch):
    monkeypatch.setenv("DARKNET_METAL_HOME", str(SHARED / "models"))


@pytest.fixture(scope="module")
def clip(tmp_path_factory) -> Path:
    """A 9-frame MPEG-4 clip panning over the dog picture."""
    img = np.asarray(Image.open(IMAGES / "dog.jpg").convert("RGB"))
    path = tmp_path_factory.mktemp("video") / "clip.mp4"
    writer = cv2.VideoWriter(str(path), cv2.VideoWriter_fourcc(*"mp4v"), FPS, SIZE)
    for i in range(FRAMES):
        frame = img[60 + 6 * i:60 + 6 * i + SIZE[1], 120 + 10 * i:120 + 10 * i + SIZE[0]]
        writer.write(cv2.cvtColor(np.ascontiguousarray(frame), cv2.COLOR_RGB2BGR))
    writer.release()
    return path


def _decoded(path: Path) -> list[np.ndarray]:
    capture = cv2.VideoCapture(str(path))
    frames = []
    while True:
        ok, frame = capture.read()
        if not ok:
            break
        frames.append(cv2.cvtColor(frame, cv2.COLOR_BGR2RGB))
    fps = capture.get(cv2.CAP_PROP_FPS)
    capture.release()
    return frames, fps


@pytest.mark.parametrize("batch", [1, 2])
def test_video_writes_every_frame_annotated_and_the_json_matches_detect(
        clip, tmp_path, capsys, batch):
    out, result = tmp_path / "annotated.mp4", tmp_path / "frames.json"
    rc = main(["video", str(clip), "--out", str(out), "--json", str(result), "-q",
               "--batch", str(batch), "--model", "yolov3-tiny"])
    stdout, err = capsys.readouterr()
    assert rc == 0, err
    assert f"{FRAMES} frames" in stdout and "FPS" in stdout

    written, fps = _decoded(out)
    source, _ = _decoded(clip)
    assert len(written) == len(source) == FRAMES
    assert fps == pytest.approx(FPS)
    assert all(f.shape == (SIZE[1], SIZE[0], 3) for f in written)
    # The annotations changed the frames (boxes, labels, the FPS counter).
    assert all(np.abs(w.astype(int) - s.astype(int)).mean() > 1 for w, s in zip(
        written, source, strict=True))

    import json

    entries = json.loads(result.read_text())
    assert [e["frame_id"] for e in entries] == list(range(1, FRAMES + 1))
    assert all("filename" not in e for e in entries)
    net = dm.load(YOLOV3_TINY / "yolov3-tiny.cfg", YOLOV3_TINY / "yolov3-tiny.weights",
                  names=YOLOV3_TINY / "coco.names")
    total = 0
    for entry, frame in zip(entries, source, strict=True):
        found = net.detect(frame)
        total += len(found)
        assert [(o["name"], round(o["confidence"], 5)) for o in entry["objects"]] == [
            (d.name, round(d.confidence, 5)) for d in found]
        for o, d in zip(entry["objects"], found, strict=True):
            box = o["relative_coordinates"]
            assert box["width"] * SIZE[0] == pytest.approx(d.width, abs=1e-3)
            assert box["center_y"] * SIZE[1] == pytest.approx(d.top + d.height / 2, abs=1e-3)
    assert total >= FRAMES  # the dog (at least) in every frame
    assert f"{total} detections" in stdout
    assert sorted(p.name for p in tmp_path.iterdir()) == ["annotated.mp4", "frames.json"]


def test_video_errors_leave_nothing_behind(clip, tmp_path, capsys):
    not_video = tmp_path / "notes.mp4"
    not_video.write_bytes(b"not a video")
    assert main(["video", str(tmp_path / "missing.mp4")]) == 1
    assert "missing.mp4: no such video file" in capsys.readouterr().err
    assert main(["video", str(not_video)]) == 1
    assert "notes.mp4: not a video" in capsys.readouterr().err
    assert main(["video", str(clip), "--out", str(tmp_path / "x.gif"), "-q"]) == 1
    assert "x.gif" in capsys.readouterr().err
    assert main(["video", str(clip), "--out", str(tmp_path / "no" / "x.mp4"), "-q"]) == 1
    assert "does not exist" in capsys.readouterr().err
    assert sorted(p.name for p in tmp_path.iterdir()) == ["notes.mp4"]


def test_detect_video_api_counts_frames_without_writing(clip):
    from darknet_metal.inference.video import detect_video

    net = dm.load(YOLOV3_TINY / "yolov3-tiny.cfg", YOLOV3_TINY / "yolov3-tiny.weights",
                  input_size=(160, 160))
    seen = []
    report = detect_video(net, clip, on_frame=lambda i, d: seen.append(i), progress=False)
    assert report.frames == FRAMES and seen == list(range(FRAMES))
    assert report.fps > 0


def test_a_run_stopped_midway_leaves_no_video(clip, tmp_path):
    from darknet_metal.inference.video import detect_video

    net = dm.load(YOLOV3_TINY / "yolov3-tiny.cfg", YOLOV3_TINY / "yolov3-tiny.weights",
                  input_size=(160, 160))

    def interrupt(index, detections):
        if index == 3:
            raise KeyboardInterrupt

    with pytest.raises(KeyboardInterrupt):
        detect_video(net, clip, out=tmp_path / "partial.mp4", on_frame=interrupt,
                     progress=False)
    assert list(tmp_path.iterdir()) == []
