"""End-to-end training throughput: ``TrainingSetup`` (the dataset checked, the loader with
Darknet's augmentation in worker threads, the run writing its logs) against ``train_step`` on
prepared batches, measured in the same run, for yolov3-tiny and yolov4-tiny (3 classes) at
224 and 416, batch 16, on a ``make-shapes`` set.

``extra_info``: images/s of both, their ratio (goal >= 0.85) and the share of the run spent
waiting for the loader (goal < 5%).
"""

from __future__ import annotations

import json
import re
import time

import numpy as np
import pytest
from shared_paths import CFG_DIR

import darknet_metal as dm
from darknet_metal.datasets import make_shapes
from darknet_metal.training.run import TrainingSetup

BATCH, ITERATIONS = 16, 8


@pytest.fixture(scope="module")
def shapes(tmp_path_factory):
    return make_shapes(tmp_path_factory.mktemp("e2e") / "shapes", train=96, valid=8,
                       size=(320, 240), seed=0)


def _cfg(folder, name, size, iterations):
    text = (CFG_DIR / f"{name}.cfg").read_text()
    for key, value in (("width", size), ("height", size), ("batch", BATCH),
                       ("subdivisions", 1), ("classes", 3), ("max_batches", iterations),
                       ("random", 0)):
        text = re.sub(rf"(?m)^{key}\s*=.*$", f"{key}={value}", text)
    text = re.sub(r"(?m)^filters=255", "filters=24", text)
    path = folder / f"{name}-{size}-e2e.cfg"
    path.write_text(text)
    return path


@pytest.mark.parametrize("size", [224, 416])
@pytest.mark.parametrize("name", ["yolov3-tiny", "yolov4-tiny"])
def test_end_to_end_training(benchmark, tmp_path, shapes, name, size):
    cfg = _cfg(tmp_path, name, size, ITERATIONS)
    # The peer: train_step on one prepared batch, as the CPU training benchmark does.
    net = dm.load(cfg, seed=0)
    rng = np.random.default_rng(0)
    x = rng.random((BATCH, 3, size, size), dtype=np.float32)
    truths = [np.array([[1, 0.4, 0.5, 0.2, 0.3]], np.float32)] * BATCH
    net.train_step(x, truths)
    steps = []
    for _ in range(3):
        start = time.perf_counter()
        net.train_step(x, truths)
        steps.append(time.perf_counter() - start)
    prepared = BATCH / float(np.median(steps))

    results = []

    def run():
        backup = tmp_path / f"run{len(results)}"
        setup = TrainingSetup.create(shapes, cfg, seed=0, backup=backup, chart=False)
        result = setup.run(progress=False)
        # Steady state: from the end of the first iteration (programs built) to the last,
        # by the JSON-lines records' times; everything between iterations included.
        records = [json.loads(line) for line in
                   (backup / f"{cfg.stem}.jsonl").read_text().splitlines()]
        seconds = records[-1]["time"] - records[0]["time"]
        waits = sum(r["load_seconds"] for r in records[1:])
        results.append((BATCH * (len(records) - 1) / seconds, waits / seconds,
                        result.wait_share))

    benchmark.group = f"train-e2e-{name}-{size}-b{BATCH}"
    benchmark.pedantic(run, rounds=2, warmup_rounds=0)
    e2e = float(np.median([r[0] for r in results]))
    benchmark.extra_info.update(
        images_per_s=e2e, prepared_images_per_s=prepared, ratio=e2e / prepared,
        wait_share=float(np.median([r[1] for r in results])))
