"""What the server counts, per model version, and how it is shown: ``/metrics`` in
Prometheus' text format (through ``prometheus_client``) under Triton's metric names, and
``/v2/models/{name}/stats`` as Triton's statistics extension answers (plus ``warmup``: the
passes run at load, their count, ``ns`` and ``seconds``).

Triton's names (counters, durations in microseconds, summed over requests):
``nv_inference_request_success``, ``nv_inference_request_failure`` (label ``reason``:
``REJECTED`` for a bad request, ``BACKEND`` for a failed execution), ``nv_inference_count``
(images inferred), ``nv_inference_exec_count`` (executions: batches),
``nv_inference_request_duration_us``, ``nv_inference_queue_duration_us``,
``nv_inference_compute_input_duration_us``, ``nv_inference_compute_infer_duration_us``,
``nv_inference_compute_output_duration_us``; gauge ``nv_inference_pending_request_count``.
The package's own: ``darknet_metal_batch_size`` (histogram of images per execution),
``darknet_metal_batch_requests`` (histogram of requests per execution) and, on ``metal``,
``emu`` and ``cuda``, the device's memory and buffer-pool counters as ``darknet_metal_device_*``.
"""

from __future__ import annotations

import re
import threading
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from typing import Any

from darknet_metal.serving.batcher import BatchRecord

__all__ = ["ServingStats", "VersionStats"]

_LABELS = ["model", "version"]
_TRITON_HEADER = re.compile(rb"^# (HELP|TYPE) (nv_\w+)_total ", re.MULTILINE)
# Device counters shown as gauges (the rest of ``dm.metal.stats`` are counters).
_DEVICE_GAUGES = ("allocated_bytes", "peak_allocated_bytes", "live_buffers", "live_bytes",
                  "pooled_buffers", "pooled_bytes")
_DEVICE_COUNTERS = ("pool_hits", "pool_misses", "kernels_dispatched",
                    "command_buffers_committed", "bytes_uploaded", "bytes_downloaded",
                    "cpu_fallbacks")


@dataclass
class _Duration:
    count: int = 0
    ns: int = 0

    def add(self, ns: int, count: int = 1) -> None:
        self.count += count
        self.ns += ns

    def json(self) -> dict[str, int]:
        return {"count": self.count, "ns": self.ns}


@dataclass
class VersionStats:
    """One model version's counters since the server started (thread-safe)."""

    model: str
    version: int
    max_batch_size: int
    pending: Callable[[], int] = lambda: 0
    success: _Duration = field(default_factory=_Duration)
    failures: dict[str, int] = field(default_factory=dict)
    fail: _Duration = field(default_factory=_Duration)
    queue: _Duration = field(default_factory=_Duration)
    compute_input: _Duration = field(default_factory=_Duration)
    compute_infer: _Duration = field(default_factory=_Duration)
    compute_output: _Duration = field(default_factory=_Duration)
    inference_count: int = 0
    execution_count: int = 0
    #: images per execution -> (executions, forward ns)
    batch_sizes: dict[int, _Duration] = field(default_factory=dict)
    #: requests per execution -> executions
    batch_requests: dict[int, int] = field(default_factory=dict)
    last_inference_ms: int = 0
    #: The warm-up at load (``record_warmup``): passes run (one per instance), and their time.
    #: Kept apart from the counts above, which are the clients' requests only.
    warmup: _Duration = field(default_factory=_Duration)
    _lock: threading.Lock = field(default_factory=threading.Lock)

    @property
    def warmed_up(self) -> bool:
        """Whether the warm-up has run: the version answers ready only after it."""
        return self.warmup.count > 0

    def record_warmup(self, passes: int, ns: int) -> None:
        """The warm-up at load: ``passes`` forward passes that took ``ns`` in all."""
        with self._lock:
            self.warmup.add(ns, passes)

    def tallies(self) -> tuple[dict[str, int], dict[int, _Duration], dict[int, int]]:
        """Copies of ``failures``, ``batch_sizes`` and ``batch_requests`` of one moment."""
        with self._lock:
            return dict(self.failures), dict(self.batch_sizes), dict(self.batch_requests)

    def record_batch(self, record: BatchRecord) -> None:
        """An execution of ``record.rows`` images (the batcher's ``on_batch``)."""
        with self._lock:
            self.execution_count += 1
            self.inference_count += record.rows
            for ns in record.queue_ns:
                self.queue.add(ns)
            self.compute_infer.add(record.infer_ns, record.requests)
            self.batch_sizes.setdefault(record.rows, _Duration()).add(record.infer_ns)
            self.batch_requests[record.requests] = self.batch_requests.get(record.requests,
                                                                           0) + 1
            self.last_inference_ms = int(time.time() * 1000)

    def record_request(self, ok: bool, total_ns: int, input_ns: int = 0, output_ns: int = 0,
                       reason: str = "REJECTED") -> None:
        """One request answered: ``total_ns`` from arrival to answer; ``input_ns`` reading
        its tensors, ``output_ns`` writing its outputs."""
        with self._lock:
            if ok:
                self.success.add(total_ns)
                self.compute_input.add(input_ns)
                self.compute_output.add(output_ns)
            else:
                self.fail.add(total_ns)
                self.failures[reason] = self.failures.get(reason, 0) + 1

    def statistics_json(self) -> dict[str, Any]:
        """This version as an entry of Triton's ``model_stats``."""
        with self._lock:
            return {
                "name": self.model,
                "version": str(self.version),
                "last_inference": self.last_inference_ms,
                "inference_count": self.inference_count,
                "execution_count": self.execution_count,
                "inference_stats": {
                    "success": self.success.json(), "fail": self.fail.json(),
                    "queue": self.queue.json(), "compute_input": self.compute_input.json(),
                    "compute_infer": self.compute_infer.json(),
                    "compute_output": self.compute_output.json(),
                },
                "batch_stats": [
                    {"batch_size": size, "compute_infer": duration.json()}
                    for size, duration in sorted(self.batch_sizes.items())
                ],
                # Not one of Triton's fields (clients read the ones they know): the forward
                # passes of zeros run at load, before the version answered ready.
                "warmup": {**self.warmup.json(), "seconds": self.warmup.ns / 1e9},
            }


class ServingStats:
    """Every served version's ``VersionStats``, and a ``prometheus_client`` collector over
    them (``registry``)."""

    def __init__(self, device: str) -> None:
        from prometheus_client import CollectorRegistry

        self.device = device
        self.versions: dict[tuple[str, int], VersionStats] = {}
        self.registry = CollectorRegistry(auto_describe=False)
        self.registry.register(self)

    def add(self, model: str, version: int, max_batch_size: int,
            pending: Callable[[], int]) -> VersionStats:
        stats = VersionStats(model=model, version=version, max_batch_size=max_batch_size,
                             pending=pending)
        self.versions[(model, version)] = stats
        return stats

    def exposition(self) -> bytes:
        """``/metrics``: every metric in Prometheus' text format (version 0.0.4)."""
        from prometheus_client import generate_latest

        text = generate_latest(self.registry)
        # prometheus_client names every counter's HELP and TYPE lines "<name>_total"; Triton's
        # counters (and the dashboards reading them) go without the suffix.
        return _TRITON_HEADER.sub(rb"# \1 \2 ", text)

    def collect(self) -> Iterator[Any]:
        """The metric families (``prometheus_client``'s collector interface)."""
        from prometheus_client.core import GaugeMetricFamily, HistogramMetricFamily, Metric

        def counter(name: str, doc: str) -> Any:
            # Built by hand: prometheus_client would name the samples ``<name>_total``,
            # and clients look for Triton's names as they are.
            return Metric(name, doc, "counter")

        snapshot = []
        for (model, version), stats in sorted(self.versions.items()):
            snapshot.append((model, str(version), stats, *stats.tallies()))

        families = {
            "success": counter("nv_inference_request_success",
                               "Number of successful inference requests, all batch sizes"),
            "failure": counter("nv_inference_request_failure",
                               "Number of failed inference requests, all batch sizes"),
            "count": counter("nv_inference_count",
                             "Number of inferences performed (images, all batch sizes)"),
            "exec": counter("nv_inference_exec_count",
                            "Number of model executions performed (batches)"),
            "request_us": counter("nv_inference_request_duration_us",
                                  "Cumulative inference request duration in microseconds"),
            "queue_us": counter("nv_inference_queue_duration_us",
                                "Cumulative inference queuing duration in microseconds"),
            "input_us": counter("nv_inference_compute_input_duration_us",
                                "Cumulative compute input duration in microseconds"),
            "infer_us": counter("nv_inference_compute_infer_duration_us",
                                "Cumulative compute inference duration in microseconds"),
            "output_us": counter("nv_inference_compute_output_duration_us",
                                 "Cumulative inference compute output duration in "
                                 "microseconds"),
        }
        pending = GaugeMetricFamily("nv_inference_pending_request_count",
                                    "Instantaneous number of pending requests awaiting "
                                    "execution", labels=_LABELS)
        sizes = HistogramMetricFamily("darknet_metal_batch_size",
                                      "Images per execution", labels=_LABELS)
        requests = HistogramMetricFamily("darknet_metal_batch_requests",
                                         "Requests per execution", labels=_LABELS)
        for model, version, stats, failures, batch_sizes, batch_requests in snapshot:
            labels = {"model": model, "version": version}

            def sample(key: str, value: float, extra: dict[str, str] | None = None,
                       labels: dict[str, str] = labels) -> None:
                family = families[key]
                family.add_sample(family.name, {**labels, **(extra or {})}, value)

            sample("success", stats.success.count)
            for reason in ("REJECTED", "BACKEND"):
                sample("failure", failures.get(reason, 0), {"reason": reason})
            sample("count", stats.inference_count)
            sample("exec", stats.execution_count)
            sample("request_us", (stats.success.ns + stats.fail.ns) // 1000)
            sample("queue_us", stats.queue.ns // 1000)
            sample("input_us", stats.compute_input.ns // 1000)
            sample("infer_us", stats.compute_infer.ns // 1000)
            sample("output_us", stats.compute_output.ns // 1000)
            pending.add_metric([model, version], stats.pending())
            top = max(1, stats.max_batch_size)
            for family, counts in ((sizes, {k: v.count for k, v in batch_sizes.items()}),
                                   (requests, batch_requests)):
                buckets, running = [], 0
                for bound in range(1, top + 1):
                    running += counts.get(bound, 0)
                    buckets.append((str(bound), running))
                buckets.append(("+Inf", sum(counts.values())))
                total = sum(k * v for k, v in counts.items())
                family.add_metric([model, version], buckets, total)
        yield from families.values()
        yield pending
        yield sizes
        yield requests
        yield from self._device_families()

    def _device_families(self) -> Iterator[Any]:
        if self.device == "cpu":
            return
        from prometheus_client.core import GaugeMetricFamily, Metric

        from darknet_metal import metal

        counters = metal.stats(self.device)
        for key in _DEVICE_GAUGES:
            yield GaugeMetricFamily(f"darknet_metal_device_{key}",
                                    f"The {self.device} device's {key.replace('_', ' ')}",
                                    value=counters.get(key, 0))
        for key in _DEVICE_COUNTERS:
            family = Metric(f"darknet_metal_device_{key}",
                            f"The {self.device} device's {key.replace('_', ' ')} since it "
                            "started", "counter")
            family.add_sample(f"darknet_metal_device_{key}_total", {}, counters.get(key, 0))
            yield family
