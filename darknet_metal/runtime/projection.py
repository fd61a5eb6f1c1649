"""What a profile measured on one GPU says about another: a roofline projection.

Each dispatch of a :class:`~darknet_metal.runtime.profile.Profile` has a time, its FLOPs and
the bytes its bindings move. On the measured device its roofline time is
``max(flops / peak FLOP/s, bytes / peak bandwidth)``; the fraction of that roofline the
dispatch reached (its efficiency) is assumed to carry over to the target device, whose
roofline time is computed from the target's own peaks. This is a projection, not a
measurement: it assumes the kernels reach the same fraction of the roofline on both GPUs
(occupancy, caches, the SIMD width and the launch cost all differ), and it ignores the host.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass

from darknet_metal.errors import ArgumentError
from darknet_metal.runtime.profile import DevicePeaks, Profile

__all__ = ["APPLE_GPUS", "Projection", "kernel_efficiencies", "project"]


def _apple(tflops: float, gbs: float, source: str) -> DevicePeaks:
    return DevicePeaks(tflops * 1e12, gbs * 1e9, source)


#: Published (or derived, as said) FP32 peaks and memory bandwidths of Apple GPUs.
APPLE_GPUS: dict[str, DevicePeaks] = {
    "M1 (8-core GPU)": _apple(
        2.6, 68.25, "Apple: 2.6 TFLOP/s FP32, LPDDR4X-4266 at 68.25 GB/s"),
    "M2 Pro (19-core GPU)": _apple(
        6.8, 200.0, "Apple: 200 GB/s; FP32 derived as 19 cores x 128 lanes x 2 x 1.398 GHz"),
    "M4 Pro (20-core GPU)": _apple(
        7.5, 273.0, "Apple: 273 GB/s; FP32 derived as 20 cores x 128 lanes x 2 x 1.47 GHz "
        "(clock from public GPU databases)"),
}


@dataclass(frozen=True)
class Projection:
    """A profile's dispatches projected onto ``target``: seconds in total and per kernel
    name, and the measured dispatches' mean efficiency (measured roofline time / measured
    time, weighted by time)."""

    what: str
    target: str
    target_peaks: DevicePeaks
    seconds: float
    kernel_seconds: dict[str, float]
    efficiency: float


def _roofline(flops: int, moved: int, peaks: DevicePeaks) -> float:
    """Seconds of ``flops`` and ``moved`` bytes at the device's peaks, whichever bounds."""
    return max(flops / peaks.flops_per_second, moved / peaks.bytes_per_second)


def _checked_peaks(profile: Profile) -> DevicePeaks:
    if profile.peaks is None:
        raise ArgumentError(f"profile of {profile.what!r} has no device peaks to project from")
    if not profile.dispatches:
        raise ArgumentError(f"profile of {profile.what!r} has no dispatches")
    return profile.peaks


def kernel_efficiencies(profile: Profile) -> dict[str, float]:
    """Each kernel name's fraction of its roofline over its dispatches in ``profile``: the
    summed roofline times over the summed measured times (at most 1)."""
    measured = _checked_peaks(profile)
    roofline: dict[str, float] = {}
    spent: dict[str, float] = {}
    for d in profile.dispatches:
        roofline[d.kernel] = roofline.get(d.kernel, 0.0) + _roofline(d.flops, d.bytes, measured)
        spent[d.kernel] = spent.get(d.kernel, 0.0) + d.seconds
    return {k: min(1.0, roofline[k] / spent[k]) if spent[k] > 0 else 1.0 for k in spent}


def project(profile: Profile, target: str, peaks: DevicePeaks, *,
            efficiencies: Mapping[str, float] | None = None) -> Projection:
    """Projects ``profile`` (which needs its device's peaks) onto a device of ``peaks``.

    Each dispatch keeps the fraction of its roofline it reached here, or, for a kernel named
    in ``efficiencies``, that kernel's fraction there when higher (``kernel_efficiencies`` of
    a larger pass: a pass too small to fill the measured GPU may fill a smaller one). A
    dispatch that measured faster than its roofline (the bytes its bindings declare are an
    upper bound, caches serve repeats) is taken at efficiency 1. Raises ArgumentError (a
    ValueError) when the profile has no peaks or no dispatches."""
    measured = _checked_peaks(profile)
    kernel_seconds: dict[str, float] = {}
    roofline_total = 0.0
    for d in profile.dispatches:
        here = _roofline(d.flops, d.bytes, measured)
        efficiency = min(1.0, here / d.seconds) if d.seconds > 0 else 1.0
        roofline_total += min(here, d.seconds)
        if efficiencies is not None and d.kernel in efficiencies:
            efficiency = max(efficiency, efficiencies[d.kernel])
        there = _roofline(d.flops, d.bytes, peaks)
        seconds = there / efficiency if efficiency > 0 else 0.0
        kernel_seconds[d.kernel] = kernel_seconds.get(d.kernel, 0.0) + seconds
    return Projection(
        what=profile.what, target=target, target_peaks=peaks,
        seconds=sum(kernel_seconds.values()), kernel_seconds=kernel_seconds,
        efficiency=roofline_total / profile.seconds if profile.seconds > 0 else 0.0)
