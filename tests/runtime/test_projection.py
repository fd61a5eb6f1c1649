"""The roofline projection of a profile onto another GPU (runtime.projection), checked on
hand-made profiles whose projected times follow from the roofline by hand, and on a real
emulator profile (every dispatch projected, none dropped)."""

from __future__ import annotations

import numpy as np
import pytest

import darknet_metal as dm
from darknet_metal.model.bundled import get_spec
from darknet_metal.runtime.profile import DevicePeaks, DispatchTime, Profile
from darknet_metal.runtime.projection import APPLE_GPUS, kernel_efficiencies, project

#: A measured device of 100 FLOP/s and 1000 B/s, so that times are easy to follow.
HERE = DevicePeaks(100.0, 1000.0, "test")


def _profile(*dispatches: DispatchTime, peaks: DevicePeaks | None = HERE) -> Profile:
    return Profile("test pass", "emu", "test", "host", list(dispatches), peaks=peaks)


def test_each_dispatch_keeps_its_fraction_of_the_roofline():
    # Compute-bound: roofline 50/100 = 0.5 s, measured 1 s -> half the roofline; on a device
    # of 10 FLOP/s its roofline is 5 s, so 10 s. Memory-bound: 500 B / 1000 B/s = 0.5 s,
    # measured 0.5 s (the roofline); there 500 / 100 = 5 s.
    profile = _profile(DispatchTime("gemm", 0, "convolutional", 1.0, 50, 100),
                       DispatchTime("copy", 1, "route", 0.5, 0, 500))
    there = DevicePeaks(10.0, 100.0, "slow")
    p = project(profile, "slow", there)
    assert p.kernel_seconds == pytest.approx({"gemm": 10.0, "copy": 5.0})
    assert p.seconds == pytest.approx(15.0)
    assert p.efficiency == pytest.approx((0.5 + 0.5) / 1.5)


def test_a_dispatch_faster_than_its_roofline_counts_at_the_roofline():
    # 100 B declared, moved in 0.01 s (cache): efficiency taken as 1, not 10.
    profile = _profile(DispatchTime("copy", 0, "route", 0.01, 0, 100))
    p = project(profile, "slow", DevicePeaks(1.0, 10.0, "slow"))
    assert p.seconds == pytest.approx(100 / 10.0)
    assert p.efficiency == pytest.approx(1.0)


def test_a_larger_pass_lends_its_kernel_efficiencies():
    # gemm reached 0.5 and 0.25 of its roofline (0.5 s of 1 s, 0.5 s of 2 s): 1/3 over both.
    large = _profile(DispatchTime("gemm", 0, "convolutional", 1.0, 50, 0),
                     DispatchTime("gemm", 1, "convolutional", 2.0, 50, 0),
                     DispatchTime("copy", 2, "route", 1.0, 0, 1000))
    assert kernel_efficiencies(large) == pytest.approx({"gemm": 1 / 3, "copy": 1.0})
    # A small pass's gemm at 0.1 of its roofline runs at the larger pass's 1/3 instead; a
    # kernel at a better efficiency than the one lent keeps its own.
    small = _profile(DispatchTime("gemm", 0, "convolutional", 1.0, 10, 0),
                     DispatchTime("copy", 1, "route", 0.1, 0, 100))
    there = DevicePeaks(10.0, 100.0, "slow")
    p = project(small, "slow", there, efficiencies={"gemm": 1 / 3, "copy": 0.5})
    assert p.kernel_seconds == pytest.approx({"gemm": 1.0 * 3, "copy": 1.0})
    assert project(small, "slow", there).kernel_seconds["gemm"] == pytest.approx(10.0)


def test_projection_needs_peaks_and_dispatches():
    with pytest.raises(ValueError, match="no device peaks"):
        project(_profile(DispatchTime("copy", 0, "", 1.0, 0, 1), peaks=None), "x", HERE)
    with pytest.raises(ValueError, match="no dispatches"):
        project(_profile(), "x", HERE)


def test_apple_peaks_name_their_sources():
    assert set(APPLE_GPUS) == {"M1 (8-core GPU)", "M2 Pro (19-core GPU)",
                               "M4 Pro (20-core GPU)"}
    for peaks in APPLE_GPUS.values():
        assert "Apple" in peaks.source
        assert 1e12 < peaks.flops_per_second < 2e13
        assert 5e10 < peaks.bytes_per_second < 5e11


def test_an_emulator_profile_projects_every_dispatch():
    net = dm.load(get_spec("yolov3-tiny").cfg, device="emu", input_size=(32, 32))
    x = np.random.default_rng(0).random((1, 3, 32, 32), dtype=np.float32)
    profile = net.profile(x, repeats=1, peaks=HERE)
    p = project(profile, "M1", APPLE_GPUS["M1 (8-core GPU)"])
    assert set(p.kernel_seconds) == {d.kernel for d in profile.dispatches}
    assert all(v > 0 for v in p.kernel_seconds.values())
