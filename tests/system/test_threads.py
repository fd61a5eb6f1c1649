"""One network used from many threads gets the results of serial calls, on every device.

A network runs one pass at a time (its memory is reused from pass to pass), and a Metal
device one network's pass at a time (one command stream); ``Network.forward`` and ``detect``
take those locks, so concurrent callers wait for each other instead of corrupting each
other's buffers (they once returned garbage: 20 of 20 results wrong from 4 threads).
"""

from __future__ import annotations

import sys
import threading
import time

import numpy as np
import pytest
from shared_paths import IMAGES, YOLOV3_TINY

import darknet_metal as dm

THREADS = 8
SIZE = (64, 64)


def _inputs():
    rng = np.random.default_rng(11)
    return [rng.random((1 + i % 2, 3, SIZE[1], SIZE[0]), dtype=np.float32)
            for i in range(THREADS)]


def _in_threads(work, n=THREADS):
    """Runs ``work(i)`` in ``n`` threads started together; returns the results by i."""
    results: list = [None] * n
    errors: list = []
    start = threading.Barrier(n)

    def run(i):
        try:
            start.wait()
            results[i] = work(i)
        except BaseException as e:  # reported by the test thread
            errors.append(e)

    threads = [threading.Thread(target=run, args=(i,)) for i in range(n)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=300)
    assert not any(t.is_alive() for t in threads), "a thread did not finish"
    assert not errors, errors
    return results


def test_one_network_from_many_threads(device):
    net = dm.load(YOLOV3_TINY / "yolov3-tiny.cfg", YOLOV3_TINY / "yolov3-tiny.weights",
                  input_size=SIZE, device=device)
    xs = _inputs()
    serial = [net.forward(x, outputs=[13, 16, 23]) for x in xs]
    found = _in_threads(lambda i: net.forward(xs[i], outputs=[13, 16, 23]))
    for i, (got, want) in enumerate(zip(found, serial, strict=True)):
        for g, w in zip(got, want, strict=True):
            np.testing.assert_array_equal(g, w, err_msg=f"thread {i}")


def test_detect_from_many_threads(device):
    net = dm.load(YOLOV3_TINY / "yolov3-tiny.cfg", YOLOV3_TINY / "yolov3-tiny.weights",
                  names=YOLOV3_TINY / "coco.names", input_size=(160, 160), device=device)
    images = [IMAGES / "dog.jpg", IMAGES / "coffee.png"]
    serial = [net.detect(image) for image in images]
    assert serial[0]
    found = _in_threads(lambda i: net.detect(images[i % 2]))
    for i, got in enumerate(found):
        assert got == serial[i % 2], f"thread {i}"


_FIFTY = """
import json, sys, threading
import psutil
import darknet_metal as dm
from darknet_metal import metal

device, cfg, weights, names, thresh, size = sys.argv[1:7]
net = dm.load(cfg, weights or None, names=names or None, device=device, seed=1,
              input_size=(int(size), int(size)) if size else None)
images = sys.argv[7:9]
thresh = float(thresh)
serial = [net.detect(image, thresh=thresh) for image in images]


def fifty(calls):
    differ, start = [], threading.Barrier(8)

    def run(i):
        start.wait()
        differ.extend((i, k) for k in range(calls)
                      if net.detect(images[(i + k) % 2], thresh=thresh) != serial[(i + k) % 2])

    threads = [threading.Thread(target=run, args=(i,)) for i in range(8)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    return differ


def device_bytes():
    return metal.stats(device)["allocated_bytes"] if device != "cpu" else 0


first = fifty(5)  # every buffer and cache made once
rss, held = psutil.Process().memory_info().rss, device_bytes()
second = fifty(50)
print(json.dumps({"boxes": [len(s) for s in serial], "differ": first + second,
                  "rss_growth": psutil.Process().memory_info().rss - rss,
                  "device_growth": device_bytes() - held}))
"""


def test_eight_threads_times_fifty_detections_equal_serial_without_growth(device, tmp_path):
    # yolov3-tiny's COCO weights on the CPU; on a Metal device the micro network (seeded,
    # untrained: its ~200 boxes per image at 0.265 are as strict a comparison) to keep 800
    # passes quick.
    # Each thread compares as it goes and keeps nothing. In a child process with glibc's
    # mmap threshold fixed: otherwise freed blocks make RSS wander (see test_train_api).
    import json
    import os
    import subprocess

    from training_golden import TRAIN

    if device == "cpu":
        model = [str(YOLOV3_TINY / "yolov3-tiny.cfg"), str(YOLOV3_TINY / "yolov3-tiny.weights"),
                 str(YOLOV3_TINY / "coco.names"), "0.1", "128"]
    else:
        model = [str(TRAIN / "micro-v4-sgd" / "micro-v4-sgd.cfg"), "", "", "0.265", ""]
    script = tmp_path / "fifty.py"
    script.write_text(_FIFTY)
    env = {**os.environ, "MALLOC_MMAP_THRESHOLD_": "131072",
           "PYTHONPATH": os.path.dirname(os.path.dirname(dm.__file__))}
    done = subprocess.run([sys.executable, str(script), device, *model,
                           str(IMAGES / "dog.jpg"), str(IMAGES / "coffee.png")],
                          capture_output=True, text=True, env=env, timeout=600)
    assert done.returncode == 0, done.stderr
    result = json.loads(done.stdout.strip().splitlines()[-1])
    assert min(result["boxes"]) > 0
    assert result["differ"] == []  # no call of 8 x (5 + 50) differs from the serial one
    assert result["rss_growth"] <= 4 * 2**20, result
    assert result["device_growth"] == 0


def test_two_networks_share_a_gpu_from_threads(gpu_device):
    nets = [dm.load(YOLOV3_TINY / "yolov3-tiny.cfg", seed=s, input_size=SIZE, device=gpu_device)
            for s in (1, 2)]
    xs = _inputs()
    serial = [nets[i % 2].forward(xs[i]) for i in range(THREADS)]
    found = _in_threads(lambda i: nets[i % 2].forward(xs[i]))
    for i, (got, want) in enumerate(zip(found, serial, strict=True)):
        for g, w in zip(got, want, strict=True):
            np.testing.assert_array_equal(g, w, err_msg=f"thread {i}")


def test_moving_a_network_while_threads_use_it(gpu_device):
    net = dm.load(YOLOV3_TINY / "yolov3-tiny.cfg", seed=4, input_size=SIZE)
    xs = _inputs()
    want = [net.forward(x) for x in xs]

    def work(i):
        if i == 0:
            net.to(gpu_device)
            return None
        return net.forward(xs[i])

    found = _in_threads(work)
    for i in range(1, THREADS):
        for g, w in zip(found[i], want[i], strict=True):
            np.testing.assert_allclose(g, w, rtol=0, atol=1e-4 * np.abs(w).max())


def test_a_cpu_pass_needs_no_gil_and_other_threads_keep_running():
    """Once another thread's CPU forward pass is under way, the test thread takes the GIL
    and keeps it (a switch interval of a minute stops the interpreter from handing it back)
    while it counts: the counter advances during the pass, and the pass finishes before the
    counting ends, so nothing between its layers waited for the GIL."""
    net = dm.load(YOLOV3_TINY / "yolov3-tiny.cfg", seed=3, input_size=(256, 256))
    x = np.random.default_rng(5).random((1, 3, 256, 256), dtype=np.float32)
    want = net.forward(x)  # builds and binds the program
    (steps,) = [loaded.steps for loaded in net.executor._programs.values()]
    window_ns = 2_000_000_000
    old_interval = sys.getswitchinterval()
    sys.setswitchinterval(60.0)
    try:
        for _attempt in range(5):
            found: list = []
            before = steps.last_started_ns
            worker = threading.Thread(target=lambda out=found: out.append(net.forward(x)))
            worker.start()
            while steps.last_started_ns == before and worker.is_alive():
                time.sleep(0.0001)  # lets the worker run up to its pass
            samples: list[tuple[int, int]] = []
            count = 0
            now = begin = time.monotonic_ns()
            while now - begin < window_ns:
                count += 1
                if count % 500 == 0:
                    samples.append((now, count))
                now = time.monotonic_ns()
            samples.append((now, count))
            worker.join()
            started, finished = net.executor.last_pass_ns
            if finished > begin:
                break  # else the pass was over before the counting began: try again
        else:
            pytest.fail("no pass was still running when the counting began")
    finally:
        sys.setswitchinterval(old_interval)
    assert finished < now, "the pass waited for the GIL between its layers"
    during = [c for t, c in samples if t <= finished]
    assert len(during) >= 2 and during[-1] > during[0], "the counter stalled during the pass"
    for g, w in zip(found[0], want, strict=True):
        np.testing.assert_array_equal(g, w)


def _micro(device):
    from training_golden import TRAIN

    folder = TRAIN / "micro-v4-sgd"
    net = dm.load(folder / "micro-v4-sgd.cfg", folder / "init.weights", device=device)
    net.config.net.values.update(burn_in=0)
    return net


def _training_batch(net, seed):
    rng = np.random.default_rng(seed)
    b = net.config.net.values["batch"]
    x = rng.random((b, *net.input_shape), dtype=np.float32)
    truths = [np.array([[seed % 2, 0.3 + 0.1 * (i % 3), 0.4, 0.2, 0.3]], np.float32)
              for i in range(b)]
    return x, truths


def test_networks_training_in_threads_equal_serial_training(device):
    # Each thread trains its own network (on the CPU at the same time; on a device one
    # pass at a time): the weights equal those of the same steps run serially.
    n = 3
    batches = [[_training_batch(_micro("cpu"), 10 * i + k) for k in range(3)]
               for i in range(n)]
    serial = []
    for i in range(n):
        net = _micro(device)
        for x, truths in batches[i]:
            net.train_step(x, truths)
        serial.append(net.params)
    nets = [_micro(device) for _ in range(n)]

    def train(i):
        for x, truths in batches[i]:
            nets[i].train_step(x, truths)

    _in_threads(train, n)
    for i in range(n):
        for layer, params in serial[i].items():
            for name, a in params.items():
                np.testing.assert_array_equal(nets[i].params[layer][name], a,
                                              err_msg=f"network {i} layer {layer} {name}")


def test_one_network_trained_and_run_from_threads(device):
    # Four threads step one network on the same batch while four run it forward: the steps
    # wait for each other (the weights equal four serial steps) and every forward pass sees
    # the weights between two steps, never a step half done.
    x, truths = _training_batch(_micro("cpu"), 0)
    probe = np.random.default_rng(5).random((1, *_micro("cpu").input_shape),
                                            dtype=np.float32)
    reference = _micro(device)
    between = [reference.forward(probe)[-1].copy()]
    for _ in range(4):
        reference.train_step(x, truths)
        between.append(reference.forward(probe)[-1].copy())
    net = _micro(device)

    def work(i):
        if i % 2:
            return net.train_step(x, truths).iteration
        return np.array(net.forward(probe)[-1])

    found = _in_threads(work)
    assert sorted(found[i] for i in range(1, THREADS, 2)) == [1, 2, 3, 4]
    for i in range(0, THREADS, 2):
        assert any(np.array_equal(found[i], b) for b in between), f"thread {i}"
    for layer, params in reference.params.items():
        for name, a in params.items():
            np.testing.assert_array_equal(net.params[layer][name], a, err_msg=f"{layer} {name}")
