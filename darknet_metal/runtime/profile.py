"""Profiles of a pass or a training step: per dispatch its device time, floating-point
operations and bytes moved, summed per layer and per kernel, with the achieved fraction of
the device's peak compute and bandwidth.

A profile is taken by the shim (``Device.profile_begin``/``profile_end``): CUDA times each
dispatch with events around its launch, Metal with GPU timestamps sampled at the boundaries of
an encoder of its own, the emulator with the host time of running it (labelled as such: the
emulator is the CPU). The work of each dispatch comes with its tag (``metal.work``): the
registry's extents for bytes, its ``flops`` expression for arithmetic. The driver's own copies
between host copies and device memory (CUDA's host synchronisation) are reported apart: they
are not any kernel's time.

``DevicePeaks``: the device's copy bandwidth and GEMM rate, measured here with the registry's
own copy and GEMM kernels (``measure_peaks``) unless the caller gives better ones (a vendor
library's GEMM rate, published figures), with where they came from.
"""

from __future__ import annotations

import json
import statistics
import threading
import time
import weakref
from collections.abc import Callable, Mapping, Sequence
from dataclasses import asdict, dataclass, field
from typing import Any

import numpy as np

from darknet_metal.errors import DeviceError
from darknet_metal.metal.dispatch import gemm_args, gemm_kernel, pack
from darknet_metal.metal.work import NO_LAYER, dispatch_tag, work_of_tag
from darknet_metal.runtime.phases import PHASES, PhaseClock

__all__ = [
    "CLOCKS",
    "DevicePeaks",
    "DispatchTime",
    "HostSplit",
    "Profile",
    "ProfileRow",
    "cpu_profile",
    "device_peaks",
    "measure_peaks",
    "profile_passes",
    "split_host",
]

#: What the time of each device kind is.
CLOCKS = {
    "cuda": "device (CUDA events around each launch)",
    "metal": "device (GPU timestamps at each dispatch's encoder boundaries)",
    "emu": "host (the emulator runs each kernel on the CPU)",
    "cpu": "host (wall time of each layer's native steps)",
}


@dataclass(frozen=True)
class DevicePeaks:
    """A device's peak rates: ``flops_per_second`` (float32 GEMM), ``bytes_per_second``
    (copy bandwidth, bytes read plus bytes written per second) and ``source`` (how they were
    found)."""

    flops_per_second: float
    bytes_per_second: float
    source: str


@dataclass(frozen=True)
class DispatchTime:
    """One dispatch of a profile: kernel, layer (-1 for none), the layer's kind ("" for
    none), seconds (median over the profile's repeats), floating-point operations and bytes
    moved."""

    kernel: str
    layer: int
    kind: str
    seconds: float
    flops: int
    bytes: int


@dataclass(frozen=True)
class ProfileRow:
    """A sum over dispatches (one layer's or one kernel's): ``name``, ``dispatches``,
    ``seconds``, ``share`` of the profile's time, ``flops``, ``bytes``, and the achieved rates
    and fractions of the peaks (None without peaks or time)."""

    name: str
    dispatches: int
    seconds: float
    share: float
    flops: int
    bytes: int
    flops_per_second: float | None
    bytes_per_second: float | None
    compute_fraction: float | None
    bandwidth_fraction: float | None


@dataclass(frozen=True)
class HostSplit:
    """Where the wall time of a whole call goes (a pass or a training step, run as a caller
    runs it, without the profiler's timing): the run of the median wall time among ``runs``,
    whole (its parts add up to its wall time). ``wall_seconds``: the
    call; ``phases``: host seconds per phase (``runtime.phases.PHASES``; the wait for the
    device is one); ``driver_copies`` and ``driver_copy_bytes``: the driver's own copies
    between host and device memory per call; ``waits``, ``commits``, ``dispatches``: per
    call."""

    wall_seconds: float
    phases: dict[str, float]
    driver_copies: int
    driver_copy_bytes: int
    waits: int
    commits: int
    dispatches: int
    runs: int

    @property
    def other_seconds(self) -> float:
        """Wall time no phase accounts for (Python between the marks, locks)."""
        return max(0.0, self.wall_seconds - sum(self.phases.values()))

    def lines(self, device_seconds: float) -> list[str]:
        """The split as table lines, beside the device's own time of the call."""
        wall = self.wall_seconds
        out = [f"  host side of a whole call, the median of {self.runs} unprofiled run(s): wall "
               f"{1e3 * wall:.3f} ms = {wall / device_seconds:.2f}x the device time"
               if device_seconds > 0 else
               f"  host side of a whole call, the median of {self.runs} run(s): wall "
               f"{1e3 * wall:.3f} ms",
               f"  {'part':<34} {'ms':>9} {'share':>6}  on unified memory"]
        for phase in PHASES:
            seconds = self.phases.get(phase.name, 0.0)
            out.append(f"  {phase.name:<34} {1e3 * seconds:>9.3f} "
                       f"{100 * seconds / wall if wall > 0 else 0:>5.1f}%  "
                       f"{'yes' if phase.unified_memory else 'no (cuda only)'}")
        out.append(f"  {'other (between phases)':<34} {1e3 * self.other_seconds:>9.3f} "
                   f"{100 * self.other_seconds / wall if wall > 0 else 0:>5.1f}%  yes")
        out.append(f"  driver copies: {self.driver_copies}, {self.driver_copy_bytes / 1e6:.1f} "
                   "MB (no on unified memory: the device uses host memory in place); "
                   f"{self.waits} wait(s), {self.commits} command buffer(s), "
                   f"{self.dispatches} dispatches a call")
        return out


def split_host(device: Any, clock: PhaseClock, run: Callable[[], None], repeats: int,
               progress: Callable[[str], None] | None = None) -> HostSplit:
    """Runs ``run`` (a whole call) ``repeats`` times with ``clock`` enabled and the device's
    counters read around each run: the run of the median wall time as a ``HostSplit``.
    ``progress(line)`` is told of each run."""
    walls: list[float] = []
    phases: list[dict[str, float]] = []
    counts: list[dict[str, int]] = []
    keys = ("driver_copies", "driver_copy_bytes", "waits", "command_buffers_committed",
            "kernels_dispatched")
    for k in range(max(1, repeats)):
        if progress is not None:
            progress(f"whole call {k + 1} of {max(1, repeats)} (the host's split)")
        before = device.stats()
        with clock.measuring() as seconds:
            start = time.perf_counter()
            run()
            walls.append(time.perf_counter() - start)
        after = device.stats()
        phases.append(dict(seconds))
        counts.append({k: int(after[k]) - int(before[k]) for k in keys})

    # The run of the median wall time, whole: its parts add up to its wall time (medians
    # taken part by part would not).
    run_at = sorted(range(len(walls)), key=walls.__getitem__)[len(walls) // 2]
    chosen = counts[run_at]
    return HostSplit(
        wall_seconds=walls[run_at], phases=phases[run_at],
        driver_copies=chosen["driver_copies"], driver_copy_bytes=chosen["driver_copy_bytes"],
        waits=chosen["waits"], commits=chosen["command_buffers_committed"],
        dispatches=chosen["kernels_dispatched"], runs=len(walls))


@dataclass
class Profile:
    """The profile of one pass (``what``) on ``device`` (its kind) named ``device_name``.

    ``dispatches``: in the order they ran. ``clock``: what their times measure.
    ``host_copies``: the driver's own host copies during one pass (``bytes``, ``seconds``,
    ``count``). ``wall_seconds``: the host's wall time of one profiled pass (median; slower
    than an unprofiled one). ``peaks``: the rates fractions are of (None: none given)."""

    what: str
    device: str
    device_name: str
    clock: str
    dispatches: list[DispatchTime]
    host_copies: dict[str, float] = field(default_factory=dict)
    wall_seconds: float = 0.0
    peaks: DevicePeaks | None = None
    repeats: int = 1
    #: Where a whole call's wall time goes on the host (None: not measured).
    host: HostSplit | None = None

    @property
    def seconds(self) -> float:
        """The dispatches' time summed."""
        return float(sum(d.seconds for d in self.dispatches))

    def _row(self, name: str, items: Sequence[DispatchTime]) -> ProfileRow:
        seconds = float(sum(d.seconds for d in items))
        flops = sum(d.flops for d in items)
        moved = sum(d.bytes for d in items)
        fps = flops / seconds if seconds > 0 else None
        bps = moved / seconds if seconds > 0 else None
        peaks = self.peaks
        return ProfileRow(
            name=name, dispatches=len(items), seconds=seconds,
            share=seconds / self.seconds if self.seconds > 0 else 0.0,
            flops=flops, bytes=moved, flops_per_second=fps, bytes_per_second=bps,
            compute_fraction=None if fps is None or peaks is None or not flops
            else fps / peaks.flops_per_second,
            bandwidth_fraction=None if bps is None or peaks is None
            else bps / peaks.bytes_per_second,
        )

    def _grouped(self, key: Callable[[DispatchTime], str]) -> list[ProfileRow]:
        groups: dict[str, list[DispatchTime]] = {}
        for d in self.dispatches:
            groups.setdefault(key(d), []).append(d)
        rows = [self._row(name, items) for name, items in groups.items()]
        return sorted(rows, key=lambda r: -r.seconds)

    def by_kernel(self) -> list[ProfileRow]:
        """One row per kernel name, longest first."""
        return self._grouped(lambda d: d.kernel)

    def by_layer(self) -> list[ProfileRow]:
        """One row per layer ("12 convolutional"; "staging" for dispatches of no layer),
        longest first."""
        return self._grouped(lambda d: f"{d.layer} {d.kind}" if d.layer != NO_LAYER
                             else "staging")

    def layer_seconds(self, n_layers: int) -> list[float]:
        """Seconds per layer index 0..n_layers-1 (0 for a layer with no dispatch)."""
        out = [0.0] * n_layers
        for d in self.dispatches:
            if 0 <= d.layer < n_layers:
                out[d.layer] += d.seconds
        return out

    def to_dict(self) -> dict[str, Any]:
        """Everything, as JSON-ready data: the rows per kernel and per layer, and each
        dispatch."""
        return {
            "what": self.what, "device": self.device, "device_name": self.device_name,
            "clock": self.clock, "repeats": self.repeats, "seconds": self.seconds,
            "wall_seconds": self.wall_seconds, "host_copies": dict(self.host_copies),
            "peaks": None if self.peaks is None else asdict(self.peaks),
            "host": None if self.host is None else {
                **asdict(self.host), "other_seconds": self.host.other_seconds,
                "unified_memory": {p.name: p.unified_memory for p in PHASES}},
            "by_kernel": [asdict(r) for r in self.by_kernel()],
            "by_layer": [asdict(r) for r in self.by_layer()],
            "dispatches": [asdict(d) for d in self.dispatches],
        }

    def to_json(self) -> str:
        return json.dumps(self.to_dict(), indent=1)

    def table(self, top: int = 15) -> str:
        """The profile as text: a header, then the ``top`` kernels and layers by time."""
        lines = [
            f"{self.what} on {self.device} ({self.device_name})",
            f"  time: {self.clock}; median of {self.repeats} profiled run(s)",
            f"  {len(self.dispatches)} dispatches, {1e3 * self.seconds:.3f} ms summed; "
            f"host wall {1e3 * self.wall_seconds:.3f} ms",
        ]
        copies = self.host_copies
        if copies.get("count"):
            lines.append(
                f"  driver host copies (apart from the kernels): {int(copies['count'])}, "
                f"{copies['bytes'] / 1e6:.1f} MB, {1e3 * copies['seconds']:.3f} ms")
        if self.host is not None:
            lines.extend(self.host.lines(self.seconds))
        if self.peaks is not None:
            p = self.peaks
            lines.append(f"  peaks: {p.flops_per_second / 1e9:.1f} GFLOP/s, "
                         f"{p.bytes_per_second / 1e9:.1f} GB/s ({p.source})")
        for title, rows in (("kernel", self.by_kernel()), ("layer", self.by_layer())):
            lines.append("")
            lines.append(f"  {title:<28} {'n':>5} {'ms':>9} {'share':>6} {'GFLOP/s':>9} "
                         f"{'GB/s':>8} {'%peak':>6} {'%bw':>6}")
            for r in rows[:top]:
                lines.append(
                    f"  {r.name[:28]:<28} {r.dispatches:>5} {1e3 * r.seconds:>9.3f} "
                    f"{100 * r.share:>5.1f}% {_num(r.flops_per_second, 1e9, r.flops):>9} "
                    f"{_num(r.bytes_per_second, 1e9, r.bytes):>8} "
                    f"{_pct(r.compute_fraction):>6} {_pct(r.bandwidth_fraction):>6}")
            if len(rows) > top:
                rest = rows[top:]
                lines.append(f"  ({len(rest)} more, {1e3 * sum(r.seconds for r in rest):.3f} "
                             "ms)")
        return "\n".join(lines)


def _num(value: float | None, unit: float, amount: int) -> str:
    return "-" if value is None or not amount else f"{value / unit:.1f}"


def _pct(value: float | None) -> str:
    return "-" if value is None else f"{100 * value:.0f}"


def profile_passes(device: Any, run: Callable[[], None], repeats: int,
                   kinds: Mapping[int, str], progress: Callable[[str], None] | None = None
                   ) -> tuple[list[DispatchTime], dict[str, float], float]:
    """Runs ``run`` (one pass, or one training step) ``repeats`` times under the device's
    profiler: (the dispatches with the median time of each over the runs, the driver's host
    copies of one run (medians), the median host wall time of a run). ``kinds``: layer
    index -> kind, for the rows. ``progress(line)`` is told of each run. Raises DeviceError
    when the runs did not dispatch the same kernels (a pass whose work changes from run to run
    cannot be profiled this way)."""
    runs: list[list[tuple[str, int, int]]] = []
    copies: list[dict[str, float]] = []
    walls: list[float] = []
    for k in range(max(1, repeats)):
        if progress is not None:
            progress(f"profiled run {k + 1} of {max(1, repeats)}")
        device.profile_begin()
        start = time.perf_counter()
        try:
            run()
        finally:
            records, copied = device.profile_end()
        walls.append(time.perf_counter() - start)
        runs.append(records)
        copies.append({"bytes": copied["bytes"], "seconds": copied["ns"] / 1e9,
                       "count": copied["count"]})
    names = [r[0] for r in runs[0]]
    for other in runs[1:]:
        if [r[0] for r in other] != names:
            raise DeviceError("the profiled runs dispatched different kernels; cannot take "
                              "their medians")
    out = []
    for i, (kernel, tag, _) in enumerate(runs[0]):
        work = work_of_tag(tag)
        seconds = statistics.median(run_records[i][2] for run_records in runs) / 1e9
        layer = NO_LAYER if work is None else work.layer
        out.append(DispatchTime(
            kernel=kernel, layer=layer, kind=kinds.get(layer, ""), seconds=seconds,
            flops=0 if work is None else work.flops, bytes=0 if work is None else work.bytes))
    median_copies = {k: statistics.median(c[k] for c in copies) for k in copies[0]}
    return out, median_copies, statistics.median(walls)


_peaks_lock = threading.Lock()
_measured_peaks: weakref.WeakKeyDictionary[Any, DevicePeaks] = weakref.WeakKeyDictionary()


def device_peaks(device: Any) -> DevicePeaks:
    """``measure_peaks(device)`` with its defaults, measured on a device's first profile and
    kept with the device object (a measurement moves 512 MiB on a GPU)."""
    with _peaks_lock:
        peaks = _measured_peaks.get(device)
        if peaks is None:
            peaks = _measured_peaks[device] = measure_peaks(device)
        return peaks


def measure_peaks(device: Any, *, copy_bytes: int | None = None,
                  gemm_size: int | None = None, repeats: int = 5) -> DevicePeaks:
    """The device's copy bandwidth (``copy_buf_f32`` over ``copy_bytes``, read and written)
    and GEMM rate (the float32 tiled GEMM at ``gemm_size``^3), each the best of ``repeats``
    profiled dispatches. Defaults: 256 MiB and 2048 on a GPU, 16 MiB and 256 on the
    emulator (whose "peaks" are the CPU's running the kernels)."""
    emu = device.info["kind"] == "emu"
    copy_bytes = copy_bytes or (16 << 20 if emu else 256 << 20)
    gemm_size = gemm_size or (256 if emu else 2048)
    n = copy_bytes // 4
    src, dst = device.buffer(4 * n), device.buffer(4 * n)
    size = gemm_size
    a, b, c = (device.buffer(4 * size * size) for _ in range(3))
    try:
        zeros = np.zeros(size * size, np.float32)
        a.write(zeros)
        b.write(zeros)
        src.write(np.zeros(n, np.float32))
        copy = pack("copy_buf_f32", {"src": src, "dst": dst}, {"n": n}, {"n": n})
        args, sizes = gemm_args(M=size, N=size, K=size, lda=size, ldb=size, ldc=size,
                                bias_mode=0, act=0)
        name = gemm_kernel("nn", False)
        gemm = pack(name, {"a": a, "b": b, "bias": a, "c": c}, args, sizes)
        copy_tag = dispatch_tag("copy_buf_f32", {"n": n}, {"n": n})
        gemm_tag = dispatch_tag(name, args, sizes)
        device.synchronize()
        device.profile_begin()
        try:
            for _ in range(max(1, repeats)):
                device.dispatch(*copy, tag=copy_tag)
                device.dispatch(*gemm, tag=gemm_tag)
        finally:
            records, _ = device.profile_end()
        copy_ns = min(ns for k, _, ns in records if k == "copy_buf_f32")
        gemm_ns = min(ns for k, _, ns in records if k == name)
    finally:
        for buf in (src, dst, a, b, c):
            buf.release()
    what = "the CPU running the emulator's kernels" if emu else "the device"
    return DevicePeaks(
        flops_per_second=2.0 * size ** 3 / max(gemm_ns, 1) * 1e9,
        bytes_per_second=8.0 * n / max(copy_ns, 1) * 1e9,
        source=f"measured on {what}: copy_buf_f32 over {copy_bytes >> 20} MiB, {name} at "
               f"{size}^3",
    )


def cpu_profile(what: str, layer_ms: Sequence[float], kinds: Sequence[str],
                flops: Sequence[int], repeats: int) -> Profile:
    """A CPU pass's profile from its per-layer wall times (milliseconds, medians), the
    layers' kinds and floating-point operations (per pass): one row per layer, named
    ``cpu:<kind>`` (bytes are not counted on the CPU)."""
    dispatches = [
        DispatchTime(kernel=f"cpu:{kind}", layer=index, kind=kind, seconds=ms / 1e3,
                     flops=int(n), bytes=0)
        for index, (kind, ms, n) in enumerate(zip(kinds, layer_ms, flops, strict=True))
    ]
    return Profile(what=what, device="cpu", device_name="CPU", clock=CLOCKS["cpu"],
                   dispatches=dispatches, wall_seconds=sum(layer_ms) / 1e3, repeats=repeats)
