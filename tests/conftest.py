"""Shared fixtures: the devices, paths into ../shared and the real yolov3-tiny."""

import json
import shutil
import statistics

import pytest
from devices import DEVICES, GPU_DEVICES, require
from shared_paths import GOLDEN, YOLOV3_TINY


@pytest.fixture(params=DEVICES)
def device(request):
    """Each device of devices.DEVICES in turn (test ids ``[cpu]``, ``[emu]``, ``[cuda]``);
    skipped where that device is not available."""
    require(request.param)
    return request.param


@pytest.fixture
def model_cache(tmp_path, monkeypatch):
    """A model cache (``DARKNET_METAL_HOME``) holding only yolov3-tiny's COCO weights, as a
    first ``--model yolov3-tiny`` command leaves it (no download)."""
    home = tmp_path / "home"
    (home / "yolov3-tiny").mkdir(parents=True)
    shutil.copy(YOLOV3_TINY / "yolov3-tiny.weights", home / "yolov3-tiny")
    monkeypatch.setenv("DARKNET_METAL_HOME", str(home))
    return home


@pytest.fixture(params=GPU_DEVICES)
def gpu_device(request):
    """Each Metal device of devices.GPU_DEVICES in turn (test ids ``[emu]``, ``[cuda]``);
    skipped where that device is not available."""
    require(request.param)
    return request.param


@pytest.fixture(scope="session")
def golden_detections():
    with open(GOLDEN / "detections.json") as f:
        return json.load(f)


@pytest.fixture(scope="session")
def yolov3_tiny():
    import darknet_metal as dm

    return dm.load(YOLOV3_TINY / "yolov3-tiny.cfg", YOLOV3_TINY / "yolov3-tiny.weights",
                   names=YOLOV3_TINY / "coco.names")


# Benchmarks: print our/peer median ratios at the end of a benchmark run; and the training
# arrays judged against float64 (tests/float64_judge.py).
def pytest_terminal_summary(terminalreporter, config):
    from float64_judge import REPORT

    if REPORT:
        terminalreporter.write_sep("-", "device arrays within 2x Darknet's distance from float64")
        for label, to_darknet, darknet_error, to_exact in REPORT:
            terminalreporter.write_line(
                f"{label}: device {to_darknet:.3g} from Darknet's array; Darknet "
                f"{darknet_error:.3g} from float64, device {to_exact:.3g}")
    session = getattr(config, "_benchmarksession", None)
    if session is None or not getattr(session, "benchmarks", None):
        return
    groups: dict[str, dict[str, float]] = {}
    alternating: set[str] = set()
    for bench in session.benchmarks:
        if bench.stats is None or not bench.group:
            continue
        peer_seconds = bench.extra_info.get("peer_seconds")
        if peer_seconds:
            # Ours with the peer timed between its rounds (tests/alternating.py).
            groups.setdefault(bench.group, {})["peer"] = statistics.median(peer_seconds)
            alternating.add(bench.group)
        role = "peer" if "peer" in bench.name else "ours"
        groups.setdefault(bench.group, {})[role] = bench.stats.median
    lines = []
    for group, roles in sorted(groups.items()):
        if "ours" in roles and "peer" in roles:
            how = " (alternating rounds)" if group in alternating else ""
            lines.append(f"{group}: ours {roles['ours'] * 1e3:.1f} ms, peer "
                         f"{roles['peer'] * 1e3:.1f} ms{how}, median ratio ours/peer "
                         f"{roles['ours'] / roles['peer']:.2f}")
    if lines:
        terminalreporter.write_sep("-", "median ratios (lower is better for us)")
        for line in lines:
            terminalreporter.write_line(line)
