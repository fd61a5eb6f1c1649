"""``darknet-metal doctor``: what a user runs to check the Metal path on their machine.

It reports the device facts, builds the pipeline of every registry kernel, runs the kernel
parity suite (small one-layer-kind networks that exercise every kernel the layers use, with
both GEMM variants, then every case of ``kernel_cases.CASES``: each registry kernel against
the CPU reference at the sizes and tolerances tests/metal hold it to) and a yolov3-tiny
network parity at a small input size (real weights when they are in the model cache, random
ones otherwise), each against the CPU reference, and returns a text report to paste into a bug
report with an overall verdict.
"""

from __future__ import annotations

import os
import platform
import tempfile
import time
import traceback
from collections.abc import Callable

import numpy as np

from darknet_metal.diagnostics.kernel_cases import CASES
from darknet_metal.diagnostics.kernel_parity import run_case
from darknet_metal.diagnostics.parity import (
    format_report,
    format_training_report,
    run_parity,
    run_training_parity,
)
from darknet_metal.metal import get_device, kernel_build, registry
from darknet_metal.model.activations import ACTIVATIONS, CHANNEL_ACTIVATIONS

_NET = "[net]\nwidth={w}\nheight={h}\nchannels={c}\n"

_ELEMENTWISE = [a for a in ACTIVATIONS if a not in CHANNEL_ACTIVATIONS]


def _combine(sam_activation: str) -> str:
    """[shortcut] (plain and weighted), [scale_channels] both ways and [sam] (with
    ``sam_activation``) after two convolutions."""
    return _NET.format(w=7, h=5, c=4) + (
        "[convolutional]\nfilters=4\nsize=1\nstride=1\npad=0\nactivation=leaky\n\n"
        "[convolutional]\nfilters=6\nsize=3\nstride=1\npad=1\nactivation=linear\n\n"
        "[shortcut]\nfrom=-2\nactivation=linear\n\n"
        "[shortcut]\nfrom=-2,-3\nweights_type=per_channel\nweights_normalization=softmax\n"
        "activation=swish\n\n"
        "[avgpool]\n\n"
        "[scale_channels]\nfrom=-2\n\n"
        "[convolutional]\nfilters=1\nsize=1\nstride=1\npad=0\nactivation=logistic\n\n"
        "[scale_channels]\nfrom=-2\nscale_wh=1\n\n"
        f"[sam]\nfrom=-3\nactivation={sam_activation}\n"
    )


#: Small networks that together run every kernel a layer kind dispatches: (name, cfg text).
MINI_NETWORKS: list[tuple[str, str]] = [
    (
        "conv-activations",
        _NET.format(w=7, h=5, c=3)
        + "".join(
            f"[convolutional]\nfilters=5\nsize=3\nstride=1\npad=1\nactivation={a}\n\n"
            for a in _ELEMENTWISE
        ),
    ),
    (
        "conv-shapes",
        _NET.format(w=13, h=7, c=6)
        + (
            "[convolutional]\nbatch_normalize=1\nfilters=8\nsize=3\nstride=2\npad=1\n"
            "activation=leaky\n\n"
            "[convolutional]\nfilters=6\nsize=3\nstride=1\npad=1\ngroups=2\ndilation=2\n"
            "activation=mish\n\n"
            "[convolutional]\nfilters=7\nsize=1\nstride=1\npad=0\nactivation=logistic\n\n"
            "[convolutional]\nfilters=5\nsize=3\nstride=1\npad=1\n"
            "activation=normalize_channels\n\n"
            "[convolutional]\nfilters=5\nsize=1\nstride=1\npad=0\n"
            "activation=normalize_channels_softmax\n\n"
            "[convolutional]\nfilters=5\nsize=1\nstride=1\npad=0\n"
            "activation=normalize_channels_softmax_maxval\n"
        ),
    ),
    (
        "pool-route-resample",
        _NET.format(w=16, h=12, c=6)
        + (
            "[maxpool]\nsize=3\nstride=2\n\n"
            "[maxpool]\nmaxpool_depth=1\nout_channels=2\n\n"
            "[route]\nlayers=-2,-1\n\n"
            "[reorg]\nstride=2\n\n"
            "[route]\nlayers=-1\ngroups=4\ngroup_id=3\n\n"
            "[upsample]\nstride=2\n\n"
            "[reorg3d]\nstride=2\n\n"
            "[reorg3d]\nstride=2\nreverse=1\n\n"
            "[upsample]\nstride=-2\nscale=0.5\n\n"
            "[avgpool]\n"
        ),
    ),
    ("combine", _combine("normalize_channels")),
    (
        "heads",
        _NET.format(w=5, h=3, c=3)
        + (
            "[convolutional]\nfilters=21\nsize=1\nstride=1\npad=0\nactivation=linear\n\n"
            "[yolo]\nmask=0,1,2\nanchors=1,2,3,4,5,6\nclasses=2\nnum=3\nscale_x_y=1.05\n\n"
            "[route]\nlayers=-2\n\n"
            "[yolo]\nmask=0,1,2\nanchors=1,2,3,4,5,6\nclasses=2\nnum=3\nnew_coords=1\n"
            "scale_x_y=2.0\n\n"
            "[connected]\noutput=12\nactivation=relu\n\n"
            "[softmax]\ngroups=3\ntemperature=0.5\n"
        ),
    ),
]


#: Small networks for the half-storage (fp16) kernels: the layer kinds they cover.
HALF_NETWORKS: list[tuple[str, str]] = [
    (
        "half-detector",
        _NET.format(w=16, h=12, c=3)
        + (
            "[convolutional]\nbatch_normalize=1\nfilters=8\nsize=3\nstride=1\npad=1\n"
            "activation=leaky\n\n"
            "[maxpool]\nsize=2\nstride=2\n\n"
            "[convolutional]\nfilters=6\nsize=3\nstride=1\npad=1\nactivation=mish\n\n"
            "[route]\nlayers=-1\ngroups=2\ngroup_id=1\n\n"
            "[upsample]\nstride=2\n\n"
            "[route]\nlayers=-1,0\n\n"
            "[convolutional]\nfilters=21\nsize=1\nstride=1\npad=0\nactivation=linear\n\n"
            "[yolo]\nmask=0,1,2\nanchors=1,2,3,4,5,6\nclasses=2\nnum=3\nscale_x_y=1.05\n"
        ),
    ),
    (
        "half-connected",
        _NET.format(w=5, h=3, c=3)
        + "[connected]\noutput=12\nactivation=relu\n\n[connected]\noutput=4\n"
        "activation=linear\n",
    ),
    ("half-combine", _combine("normalize_channels")),
    (
        "half-channels",
        _NET.format(w=7, h=5, c=3)
        + "".join(f"[convolutional]\nfilters=5\nsize=1\nstride=1\npad=0\nactivation={a}\n\n"
                  for a in ("normalize_channels_softmax", "normalize_channels_softmax_maxval")),
    ),
    (
        "half-pool-softmax",
        _NET.format(w=16, h=12, c=8)
        + (
            "[maxpool]\nmaxpool_depth=1\nout_channels=4\n\n"
            "[reorg]\nstride=2\n\n"
            "[connected]\noutput=10\nactivation=linear\n\n"
            "[softmax]\ngroups=2\n"
        ),
    ),
]


def _section(title: str) -> str:
    return f"\n== {title} " + "=" * max(0, 66 - len(title))


def _print_line(line: str) -> None:
    # Flushed line by line, so a piped or redirected run shows each check as it finishes.
    print(line, flush=True)


def run_doctor(
    device: str | None = None, *, size: int = 96, out: Callable[[str], None] = _print_line
) -> bool:
    """Run every check on ``device`` (default: "metal" when available, else "emu"), writing
    the report line by line through ``out`` (default: stdout, flushed after each line); True
    when everything passed."""
    from darknet_metal.metal import is_available
    from darknet_metal.version import __version__

    if device is None:
        device = "metal" if is_available("metal") else "emu"
    ok = True
    out(f"darknet-metal doctor {__version__}")
    out(f"python {platform.python_version()} on {platform.platform()} ({platform.machine()})")
    out(f"numpy {np.__version__}")
    out(_section("device"))
    try:
        dev = get_device(device)
    except Exception as e:  # report any failure to create the device, do not crash
        out(f"device {device!r} unavailable: {e}")
        return False
    for key, value in dev.info.items():
        out(f"{key:>28}: {value}")
    if device in ("emu", "cuda"):  # compiled on first use into the kernel cache
        kernels = kernel_build.build_status()
        out(f"{'emulator kernels':>28}: {kernels['emu']}")
        if device == "cuda":
            out(f"{'cuda modules':>28}: {kernels['cuda']}")

    out(_section("pipelines"))
    failed = []
    for name, k in registry.KERNELS.items():
        try:
            facts = dev.pipeline_info(name)
        except Exception as e:
            failed.append(name)
            out(f"  FAIL {name}: {e}")
            continue
        if k.grid.threads_per_group > facts["max_total_threads"]:
            failed.append(name)
            out(
                f"  FAIL {name}: needs {k.grid.threads_per_group} threads per group, "
                f"pipeline allows {facts['max_total_threads']}"
            )
    out(f"  {len(registry.KERNELS) - len(failed)}/{len(registry.KERNELS)} pipelines built")
    ok &= not failed

    out(_section("kernel parity (vs CPU reference)"))
    exercised: set[str] = set()
    networks = [(n, t, "fp32") for n, t in MINI_NETWORKS]
    networks += [(n, t, "fp16") for n, t in HALF_NETWORKS]
    with tempfile.TemporaryDirectory() as tmp:
        for name, text, precision in networks:
            path = os.path.join(tmp, f"{name}.cfg")
            with open(path, "w", encoding="utf-8") as f:
                f.write(text)
            kind = "GEMM" if precision == "fp32" else "fp16"
            for gemm in ("tiled", "simd"):
                try:
                    report = run_parity(path, seed=1, device=device, gemm=gemm, input_seed=2,
                                        precision=precision)
                except Exception:
                    ok = False
                    out(f"  FAIL {name} ({gemm} {kind}): error\n{traceback.format_exc()}")
                    continue
                for row in report["layers"]:
                    exercised.update(row["kernels"])  # as dispatched: _f16 names in fp16
                worst = max(r["max_abs"] for r in report["layers"])
                bad = [r["index"] for r in report["layers"] if not r["ok"]]
                out(
                    f"  {'ok  ' if not bad else 'FAIL'} {name:<22} {gemm:<5} {kind}  "
                    f"{len(report['layers']):>2} layers, max abs diff {worst:.2e}"
                    + (f", failing layers {bad}" if bad else "")
                )
                ok &= not bad
    width = max(len(case.name) for case in CASES)
    for case in CASES:
        exercised.update(case.kernels)
        try:
            result = run_case(dev, case)
        except Exception:
            ok = False
            out(f"  FAIL {case.name}: error\n{traceback.format_exc()}")
            continue
        out(f"  {'ok  ' if result.ok else 'FAIL'} {case.name:<{width}} "
            f"max abs diff {result.max_abs:.2e}")
        for failure in result.failures:
            out(f"         {failure}")
        ok &= result.ok
    missing = sorted(set(registry.KERNELS) - exercised)
    out(
        f"  kernels checked: {len(exercised & set(registry.KERNELS))}/{len(registry.KERNELS)}"
        + (f"; not checked: {missing}" if missing else "")
    )
    ok &= not missing

    cfg, weights = _yolov3_tiny()
    train_size = min(size, 64)
    for title, run, text in (
        (f"network parity: yolov3-tiny at {size}x{size}",
         lambda: run_parity(cfg, weights, seed=1, device=device, size=(size, size)),
         format_report),
        (f"training step: yolov3-tiny at {train_size}x{train_size}, batch 2",
         lambda: run_training_parity(cfg, seed=1, device=device,
                                     size=(train_size, train_size), batch=2),
         format_training_report),
    ):
        out(_section(title))
        try:
            start = time.perf_counter()
            report = run()
            out(text(report))
            out(f"({time.perf_counter() - start:.1f} s)")
            ok &= report["ok"]
        except Exception:
            ok = False
            out(f"FAIL: error\n{traceback.format_exc()}")

    out(_section("speed: yolov4-tiny 416x416, batch 1, random weights"))
    if device == "emu":
        out("  skipped: the emulator checks correctness; its speed says nothing of a GPU")
    elif device == "cuda":
        out("  skipped: cuda verifies the kernels; an NVIDIA GPU's speed says nothing of an "
            "Apple GPU's")
    else:
        try:
            measure_speed(device, size=416, out=out)
        except Exception:
            ok = False
            out(f"FAIL: error\n{traceback.format_exc()}")

    stats = dev.stats()
    out(_section("device counters"))
    for key in (
        "kernels_dispatched",
        "command_buffers_committed",
        "waits",
        "cpu_fallbacks",
        "pipelines_built",
        "peak_allocated_bytes",
    ):
        out(f"{key:>28}: {stats[key]}")
    out(_section("verdict"))
    out(
        "PASS: the Metal path agrees with the CPU reference on this device"
        if ok
        else "FAIL: see the failures above"
    )
    return bool(ok)


def measure_speed(
    device: str, *, size: int = 416, repeats: int = 20, out: Callable[[str], None] = _print_line
) -> tuple[float, float]:
    """Median ms per yolov4-tiny forward pass (random weights, batch 1, ``size`` x ``size``)
    on ``device`` and on this package's CPU path, measured in turn; returns (device, cpu)."""
    from darknet_metal.model.bundled import get_spec
    from darknet_metal.network import load

    cfg = get_spec("yolov4-tiny").cfg
    x = np.random.default_rng(0).uniform(0, 1, (1, 3, size, size)).astype(np.float32)
    medians = []
    for name in (device, "cpu"):
        net = load(cfg, seed=0, device=name, input_size=(size, size))
        net.forward(x)  # warm up: pipelines, programs, buffers
        times = []
        for _ in range(max(1, repeats)):
            start = time.perf_counter()
            net.forward(x)
            times.append(time.perf_counter() - start)
        medians.append(1e3 * float(np.median(times)))
    gpu, cpu = medians
    out(
        f"  {device}: {gpu:.2f} ms   cpu (this package, BLAS): {cpu:.2f} ms   "
        f"speed-up {cpu / gpu:.1f}x"
    )
    out("  (design target on Apple silicon: at least 14x Darknet's CPU/OpenBLAS build)")
    return gpu, cpu


def _yolov3_tiny() -> tuple[str, str | None]:
    """The bundled yolov3-tiny cfg and its cached weights (None when not downloaded)."""
    from darknet_metal.errors import ModelNotFoundError
    from darknet_metal.model.bundled import get_spec, model_files

    try:
        files = model_files("yolov3-tiny", download=False)
    except ModelNotFoundError:
        return str(get_spec("yolov3-tiny").cfg), None
    return str(files.cfg), str(files.weights)
