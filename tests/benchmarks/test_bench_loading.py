"""Loader throughput with full augmentation: mosaic on, jitter, zoom, HSV, flip, on 640x480
JPEGs made here; batch 16 at 416x416, with 1 and 2 worker threads.

``extra_info`` holds images/s and images/s per worker (per core used). There is no peer in
the same run.
"""

from __future__ import annotations

import time

import cv2
import numpy as np
import pytest

from darknet_metal.training.loading import Loader, LoaderSettings

BATCH = 16
BATCHES = 4


@pytest.fixture(scope="module")
def jpegs(tmp_path_factory):
    folder = tmp_path_factory.mktemp("jpegs")
    rng = np.random.default_rng(0)
    samples = []
    for i in range(24):
        image = cv2.GaussianBlur(rng.integers(0, 256, (480, 640, 3), dtype=np.uint8), (9, 9), 3)
        boxes = []
        for k in range(4):
            x0, y0 = int(rng.integers(0, 540)), int(rng.integers(0, 400))
            w, h = int(rng.integers(30, 100)), int(rng.integers(30, 80))
            image[y0 : y0 + h, x0 : x0 + w] = rng.integers(0, 256, 3)
            boxes.append([k, (x0 + w / 2) / 640, (y0 + h / 2) / 480, w / 640, h / 480])
        path = folder / f"{i}.jpg"
        cv2.imwrite(str(path), image, [cv2.IMWRITE_JPEG_QUALITY, 90])
        samples.append((str(path), np.clip(np.array(boxes, np.float32), 0, 1)))
    return samples


@pytest.mark.parametrize("workers", [1, 2])
def test_loader_throughput(benchmark, jpegs, workers):
    settings = LoaderSettings(width=416, height=416, batch=BATCH, jitter=0.3, resize=1.5,
                              hue=0.1, saturation=1.5, exposure=1.5, mixup=3)

    cpu = []

    def run():
        start = time.process_time()
        with Loader(jpegs, settings, seed=0, workers=workers, prefetch=2) as loader:
            for _ in range(BATCHES):
                loader.next()
        cpu.append(time.process_time() - start)

    benchmark.group = "loading-mosaic-416-b16"
    benchmark.pedantic(run, rounds=3, warmup_rounds=1)
    images_per_s = BATCH * BATCHES / benchmark.stats.stats.median
    benchmark.extra_info["images_per_s"] = images_per_s
    benchmark.extra_info["images_per_cpu_s"] = BATCH * BATCHES / float(np.median(cpu))
