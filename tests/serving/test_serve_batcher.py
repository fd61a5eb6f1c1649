"""DynamicBatcher on the CPU: concurrent requests grouped up to max_batch_size (or a
preferred size) within the queue delay, each answered with exactly what running it alone
gives; requests alone without dynamic batching; close() drains the queue; a failing
execution fails only the requests it held."""

import concurrent.futures
import threading
import time

import numpy as np
import pytest
from serve_harness import MICRO_DIR

import darknet_metal as dm
from darknet_metal.errors import ArgumentError
from darknet_metal.serving.batcher import DynamicBatcher


@pytest.fixture(scope="module")
def nets():
    return [dm.load(MICRO_DIR / "micro-v4-sgd.cfg", MICRO_DIR / "init.weights")
            for _ in range(2)]


def _inputs(net, sizes, seed=0):
    rng = np.random.default_rng(seed)
    return [rng.random((n, *net.input_shape), dtype=np.float32) for n in sizes]


def _run(batcher, xs):
    futures = [batcher.submit(x) for x in xs]
    return [f.result(timeout=120) for f in futures]


def test_queued_requests_run_as_one_batch_equal_to_each_alone(nets):
    net = nets[0]
    records = []
    batcher = DynamicBatcher([net], net.yolo_layers, max_batch_size=8,
                             queue_delay_us=2_000_000, on_batch=records.append)
    try:
        xs = _inputs(net, [1, 2, 1, 3])  # 7 images: waits for an 8th until the delay ends
        start = time.monotonic()
        got = _run(batcher, xs)
        assert time.monotonic() - start >= 1.5
    finally:
        batcher.close()
    assert [(r.rows, r.requests) for r in records] == [(7, 4)]
    assert len(records[0].queue_ns) == 4 and all(q > 0 for q in records[0].queue_ns)
    for x, outs in zip(xs, got, strict=True):
        for out, want in zip(outs, net.forward(x), strict=True):
            assert out.shape == want.shape and np.array_equal(out, want)


def test_a_full_or_preferred_batch_runs_without_waiting(nets):
    net = nets[0]
    for sizes, preferred, rows in (([2, 2, 2, 2], (), [8]), ([1, 2, 3], (3,), [3, 3])):
        records = []
        batcher = DynamicBatcher([net], net.yolo_layers, max_batch_size=8,
                                 queue_delay_us=30_000_000, preferred=preferred,
                                 on_batch=records.append)
        try:
            start = time.monotonic()
            _run(batcher, _inputs(net, sizes))
            assert time.monotonic() - start < 20, "waited out the delay"
        finally:
            batcher.close()
        assert [r.rows for r in records] == rows


def test_a_request_that_does_not_fit_runs_next(nets):
    net = nets[0]
    records = []
    batcher = DynamicBatcher([net], net.yolo_layers, max_batch_size=4,
                             queue_delay_us=30_000_000, on_batch=records.append)
    try:
        xs = _inputs(net, [3, 2, 2])
        got = _run(batcher, xs)
    finally:
        batcher.close()
    assert [r.rows for r in records] == [3, 4]
    for x, outs in zip(xs, got, strict=True):
        assert all(np.array_equal(o, w) for o, w in zip(outs, net.forward(x), strict=True))


def test_without_dynamic_batching_each_request_runs_alone(nets):
    net = nets[0]
    records = []
    batcher = DynamicBatcher([net], net.yolo_layers, max_batch_size=4, on_batch=records.append)
    try:
        _run(batcher, _inputs(net, [1, 2, 1]))
    finally:
        batcher.close()
    assert [r.rows for r in records] == [1, 2, 1]


def test_two_instances_under_concurrent_submitters(nets):
    net = nets[0]
    xs = _inputs(net, [1, 2, 1, 1, 3, 1, 2, 1] * 3, seed=3)
    want = [net.forward(x) for x in xs]
    records = []
    lock = threading.Lock()

    def record(r):
        with lock:
            records.append(r)

    batcher = DynamicBatcher(nets, nets[0].yolo_layers, max_batch_size=4,
                             queue_delay_us=5000, on_batch=record)
    try:
        with concurrent.futures.ThreadPoolExecutor(8) as pool:
            got = list(pool.map(lambda x: batcher.submit(x).result(timeout=120), xs))
    finally:
        batcher.close()
    assert sum(r.rows for r in records) == sum(x.shape[0] for x in xs)
    assert all(r.rows <= 4 for r in records)
    for outs, expected in zip(got, want, strict=True):
        assert all(np.array_equal(o, w) for o, w in zip(outs, expected, strict=True))


def test_close_runs_what_is_queued_then_refuses(nets):
    net = nets[0]
    batcher = DynamicBatcher([net], net.yolo_layers, max_batch_size=8,
                             queue_delay_us=30_000_000)
    futures = [batcher.submit(x) for x in _inputs(net, [1, 1])]
    batcher.close()  # does not wait out the 30 s delay
    assert all(f.result(timeout=1) for f in futures)
    with pytest.raises(ArgumentError, match="shutting down"):
        batcher.submit(_inputs(net, [1])[0])


def test_a_failing_execution_fails_its_requests_and_the_batcher_goes_on(nets):
    net = nets[0]
    batcher = DynamicBatcher([net], net.yolo_layers, max_batch_size=2)
    try:
        bad = np.zeros((1, 3, 7, 7), np.float32)  # the wrong size for the network
        with pytest.raises(ArgumentError, match="this network takes"):
            batcher.submit(bad).result(timeout=60)
        [good] = _inputs(net, [1])
        assert np.array_equal(batcher.submit(good).result(timeout=60)[0], net.forward(good)[0])
    finally:
        batcher.close()
