"""What a training run prints and writes: Darknet's iteration line, the JSON-lines record,
the chart."""

from __future__ import annotations

import json
import math

import pytest
from PIL import Image

from darknet_metal.training.progress import (
    IterationRecord,
    LossChart,
    format_duration,
    format_map,
)


def _record(**changes):
    values = dict(iteration=5989, max_batches=6000, loss=0.4444, avg_loss=0.3291,
                  rate=0.000026, batch=64, load_seconds=0.0123, train_seconds=0.064424,
                  images=383296, remaining_seconds=7.04, width=416, height=416)
    values.update(changes)
    return IterationRecord(**values)


def test_darknet_line():
    # Darknet V5's format (detector.cpp, train_detector), as its CPU build prints it:
    # "3: loss=6.173, avg loss=93.552, last=none, best=none, mAP=DISABLED, rate=0.00100000,
    # load 16=18.7 milliseconds, train=3.1 seconds, 48 images, time remaining=12 minutes".
    assert _record().darknet_line() == (
        "5989: loss=0.444, avg loss=0.329, last=none, best=none, mAP=DISABLED, "
        "rate=0.00002600, load 64=12.3 milliseconds, train=64.4 milliseconds, 383296 images, "
        "time remaining=7 seconds")
    line = _record(last_map=0.8231, best_map=0.85, next_map=6000).darknet_line()
    assert "last=82.31%, best=85.00%, mAP=6000," in line


@pytest.mark.parametrize(("seconds", "text"), [
    (None, "unknown"), (0.0, "unknown"), (math.nan, "unknown"), (0.25, "250.0 milliseconds"),
    (1.5, "1.5 seconds"), (120.0, "120.0 seconds"), (121.0, "2.0 minutes"),
    (7200.0, "120.0 minutes"), (7201.0, "2.0 hours"), (172800.0, "48.0 hours"),
    (200000.0, "2.3 days"), (604800.0, "7.0 days"), (1209600.0, "2.0 weeks")])
def test_durations_in_darknets_words(seconds, text):
    assert format_duration(seconds) == text
    assert format_duration(720.0, trim=True) == "12 minutes"
    assert format_duration(730.0, trim=True) == "12.2 minutes"


def test_json_record_round_trips_and_has_no_nan():
    record = _record(loss=math.inf, heads={16: {"avg_iou": 0.5, "count": 3.0}})
    data = json.loads(record.to_json())
    assert data["schema"] == 1 and data["iteration"] == 5989 and data["loss"] is None
    assert data["heads"] == {"16": {"avg_iou": 0.5, "count": 3.0}}
    assert data["width"] == data["height"] == 416 and data["batch"] == 64
    assert format_map(None) == "none" and format_map(0.5) == "50.00%"


def test_json_record_time_is_to_the_microsecond(monkeypatch):
    # An iteration of a fast GPU takes tens of milliseconds: whole milliseconds would move
    # an iteration's time by a few percent.
    monkeypatch.setattr("darknet_metal.training.progress.time.time", lambda: 1796000000.1234567)
    assert json.loads(_record().to_json())["time"] == pytest.approx(1796000000.123457, abs=1e-7)


def test_chart_is_written_whole_and_not_too_often(tmp_path):
    path = tmp_path / "chart.png"
    chart = LossChart(path, max_batches=100, title="micro", every_seconds=3600)
    for i in range(1, 51):
        chart.add(i, 10.0 / i)
    assert chart.save()
    assert not chart.save()  # within the interval
    chart.add_map(50, 0.42)
    assert chart.save(force=True)
    with Image.open(path) as im:
        assert im.size == (800, 600) and im.format == "PNG"
    assert [p.name for p in tmp_path.iterdir()] == ["chart.png"]


def test_images_per_second_end_the_line_and_are_in_the_record():
    record = _record(images_per_second=412.345)
    assert record.darknet_line().endswith("time remaining=7 seconds, 412.3 img/s")
    assert json.loads(record.to_json())["images_per_second"] == 412.345
    assert json.loads(_record().to_json())["images_per_second"] is None
