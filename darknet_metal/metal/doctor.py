"""``darknet-metal doctor``: what a user runs to check the Metal path on their machine.

It reports the device facts, builds the pipeline of every registry kernel, runs the kernel
parity suite (small one-layer-kind networks that exercise every kernel the layers use, with
both GEMM variants, plus direct checks of the kernels no layer kind uses) and a yolov3-tiny
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
from typing import Any

import numpy as np

from darknet_metal.activations import ACTIVATIONS, CHANNEL_ACTIVATIONS
from darknet_metal.metal import get_device, registry
from darknet_metal.metal.dispatch import gemm_args, gemm_kernel, pack
from darknet_metal.metal.parity import compare, format_report, run_parity

_NET = "[net]\nwidth={w}\nheight={h}\nchannels={c}\n"

_ELEMENTWISE = [a for a in ACTIVATIONS if a not in CHANNEL_ACTIVATIONS]

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
    (
        "combine",
        _NET.format(w=7, h=5, c=4)
        + (
            "[convolutional]\nfilters=4\nsize=1\nstride=1\npad=0\nactivation=leaky\n\n"
            "[convolutional]\nfilters=6\nsize=3\nstride=1\npad=1\nactivation=linear\n\n"
            "[shortcut]\nfrom=-2\nactivation=linear\n\n"
            "[shortcut]\nfrom=-2,-3\nweights_type=per_channel\nweights_normalization=softmax\n"
            "activation=swish\n\n"
            "[avgpool]\n\n"
            "[scale_channels]\nfrom=-2\n\n"
            "[convolutional]\nfilters=1\nsize=1\nstride=1\npad=0\nactivation=logistic\n\n"
            "[scale_channels]\nfrom=-2\nscale_wh=1\n\n"
            "[sam]\nfrom=-3\nactivation=normalize_channels\n"
        ),
    ),
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


def _direct_checks(device: Any) -> list[tuple[str, float, bool]]:
    """Kernels no layer dispatches at inference: the transposed-A GEMMs against a float64
    NumPy product, and the training kernels against the CPU reference."""
    rng = np.random.default_rng(5)
    results = []
    m, n, k = 17, 33, 29
    a = rng.standard_normal((k, m)).astype(np.float32)  # stored transposed
    b = rng.standard_normal((k, n)).astype(np.float32)
    bias = rng.standard_normal(m).astype(np.float32)
    ref = (a.T.astype(np.float64) @ b.astype(np.float64) + bias[:, None]).astype(np.float32)
    args, sizes = gemm_args(M=m, N=n, K=k, lda=m, ldb=n, ldc=n, bias_mode=registry.BIAS_ROWS,
                            act=0)
    for name in (gemm_kernel("tn", False), gemm_kernel("tn", True)):
        got = _run(device, name, {"a": a, "b": b, "bias": bias}, "c", (m, n), args, sizes)
        results.append((name, *_verdict(got, ref)))
    return results + _training_checks(device, rng) + _elementwise_training_checks(device)


def _training_checks(device: Any, rng: np.random.Generator) -> list[tuple[str, float, bool]]:
    """The convolution's training kernels (train_conv.metal) against the CPU reference, each
    adding into non-zero gradients where it accumulates."""
    from darknet_metal.cpu import batchnorm, conv, im2col

    def rand(*shape: int) -> np.ndarray:
        return rng.standard_normal(shape).astype(np.float32)

    results = []
    # col2im: stride 2, padding, two groups of two channels, two images.
    n, groups, cg, h, w, ksize, stride, pad = 2, 2, 2, 7, 6, 3, 2, 1
    oh, ow = (h + 2 * pad - ksize) // stride + 1, (w + 2 * pad - ksize) // stride + 1
    col, image = rand(n * groups, cg * ksize * ksize, oh * ow), rand(n, groups * cg, h, w)
    want = image.copy()
    for z in range(n * groups):
        b, g = divmod(z, groups)
        im2col.col2im_add(col[z], want[b, g * cg : (g + 1) * cg], ksize, stride, stride, pad, 1,
                          oh, ow)
    geometry = dict(channels=cg, height=h, width=w, ksize=ksize, stride_x=stride,
                    stride_y=stride, pad=pad, dilation=1, out_h=oh, out_w=ow)
    got = _run_roles(device, "col2im_bwd_f32", {"col": col, "image": image}, ("image",),
                     geometry, {"spatial": h * w, "channels": cg, "slices": n * groups})
    results.append(("col2im_bwd_f32", *_verdict(got["image"], want)))

    # Bias gradient and batch norm on (N, C, H, W) = (2, 5, 3, 7).
    shape = (2, 5, 3, 7)
    c, spatial = shape[1], shape[2] * shape[3]
    channels = {"channels": c}
    values = {"spatial": spatial, "channels": c, "batch": shape[0]}
    delta, bias_grad = rand(*shape), rand(c)
    want = bias_grad.copy()
    conv.bias_grad(delta, want)
    got = _run_roles(device, "bias_bwd_f32", {"delta": delta, "bias_grad": bias_grad},
                     ("bias_grad",), {"batch": shape[0], "channels": c, "spatial": spatial},
                     channels)
    results.append(("bias_bwd_f32", *_verdict(got["bias_grad"], want)))

    x, scale, bias = rand(*shape) * np.float32(2.0) + np.float32(1.0), rand(c), rand(c)
    rolling = (rand(c), np.abs(rand(c)))
    mean, var, x_norm, out = (np.empty(c, np.float32), np.empty(c, np.float32),
                              np.empty_like(x), np.empty_like(x))
    rm, rv = rolling[0].copy(), rolling[1].copy()
    momentum = batchnorm.MOMENTUM_CONV
    batchnorm.batchnorm_forward_train(x, mean, var, x_norm, out, scale, bias, rm, rv, momentum)
    args = dict(batch=shape[0], channels=c, spatial=spatial, eps=batchnorm.EPS,
                momentum=momentum, one_minus_momentum=1.0 - momentum, exact=0)
    stats = ("mean", "variance", "rolling_mean", "rolling_variance")
    got = _run_roles(device, "batchnorm_fwd_stats_f32",
                     {"x": x, "mean": mean, "variance": var, "rolling_mean": rolling[0],
                      "rolling_variance": rolling[1]}, stats, args, channels)
    results.append(("batchnorm_fwd_stats_f32",
                    *_verdict(np.concatenate([got[s] for s in stats]),
                              np.concatenate([mean, var, rm, rv]))))
    got = _run_roles(device, "batchnorm_fwd_norm_f32",
                     {"x": x, "mean": mean, "variance": var, "scale": scale, "bias": bias,
                      "x_norm": np.empty_like(x), "out": np.empty_like(x)},
                     ("x_norm", "out"), args, values)
    results.append(("batchnorm_fwd_norm_f32",
                    *_verdict(np.stack([got["x_norm"], got["out"]]), np.stack([x_norm, out]))))
    got = _run_roles(device, "batchnorm_fwd_xnorm_f32",
                     {"x": x, "mean": mean, "variance": var, "x_norm": np.empty_like(x)},
                     ("x_norm",), args, values)
    results.append(("batchnorm_fwd_xnorm_f32", *_verdict(got["x_norm"], x_norm)))

    delta, grads = rand(*shape), (rand(c), rand(c))
    want_delta, want_sg, want_bg = delta.copy(), grads[0].copy(), grads[1].copy()
    batchnorm.batchnorm_backward(want_delta, x, mean, var, x_norm, scale, want_sg, want_bg)
    sums = _run_roles(device, "batchnorm_bwd_sums_f32",
                      {"delta": delta, "x": x, "mean": mean, "variance": var, "x_norm": x_norm,
                       "scale": scale, "scale_grad": grads[0], "bias_grad": grads[1],
                       "mean_delta": np.empty(c, np.float32),
                       "var_delta": np.empty(c, np.float32)},
                      ("scale_grad", "bias_grad", "mean_delta", "var_delta"), args, channels)
    results.append(("batchnorm_bwd_sums_f32",
                    *_verdict(np.concatenate([sums["scale_grad"], sums["bias_grad"]]),
                              np.concatenate([want_sg, want_bg]))))
    got = _run_roles(device, "batchnorm_bwd_delta_f32",
                     {"x": x, "mean": mean, "variance": var, "scale": scale,
                      "mean_delta": sums["mean_delta"], "var_delta": sums["var_delta"],
                      "delta": delta}, ("delta",), args, values)
    results.append(("batchnorm_bwd_delta_f32", *_verdict(got["delta"], want_delta)))
    return results


def _elementwise_training_checks(device: Any) -> list[tuple[str, float, bool]]:
    """The elementwise training kernels (no layer dispatches them yet) against their CPU
    reference steps; the draws and the updates must agree bit for bit."""
    from darknet_metal.cpu import activations as cpu_act
    from darknet_metal.cpu import dropout, fill, update

    rng = np.random.default_rng(6)
    n = 1001
    x = (rng.standard_normal(n) * 3).astype(np.float32)
    delta = rng.standard_normal(n).astype(np.float32)
    results = []

    def check(name, buffers, out, want, args, sizes, exact=False):
        got = _run_roles(device, name, buffers, (out,), args, sizes)[out]
        diff, ok = _verdict(got.astype(np.float64), want.astype(np.float64))
        results.append((name, diff, ok and (not exact or got.tobytes() == want.tobytes())))

    act = "mish"
    want = delta.copy().reshape(1, -1)
    cpu_act.gradient(x.reshape(1, -1), act, want)
    check("activation_bwd_f32", {"y_or_x": x, "delta": delta}, "delta", want.reshape(-1),
          {"n": n, "act": ACTIVATIONS.index(act)}, {"n": n})
    shape = (2, 7, 13, 11)
    y = rng.standard_normal(shape).astype(np.float32)
    d4 = rng.standard_normal(shape).astype(np.float32)
    for variant in sorted(CHANNEL_ACTIVATIONS):
        yv, want = y.copy(), d4.copy()
        cpu_act.activate(yv, variant)
        cpu_act.gradient(yv, variant, want)
        check(f"{variant}_bwd_f32", {"y": yv, "delta": d4}, "delta", want,
              {"batch": 2, "channels": 7, "spatial": 143}, {"spatial": 143, "batch": 2})
    want = np.full(n, 0.25, np.float32)
    check("fill_buf_f32", {"x": x}, "x", want, {"n": n, "value": 0.25}, {"n": n}, exact=True)
    check("copy_buf_f32", {"src": x, "dst": delta}, "dst", x, {"n": n}, {"n": n}, exact=True)
    want = delta.copy()
    fill.add_step(x, want, 0.5).run()
    check("add_buf_f32", {"src": x, "dst": delta}, "dst", want, {"n": n, "scale": 0.5},
          {"n": n}, exact=True)
    start, seed = 2**32 - 1, 2**40 + 17
    counter = np.array([start], np.uint64)
    rand = np.empty(n, np.float32)
    dropout.uniform_fill(rand, seed, counter)
    words = np.array([start], np.uint64).view(np.uint32)
    check("uniform_buf_f32", {"counter": words, "rand": x}, "rand", rand,
          {"n": n, "seed_lo": seed & 0xFFFFFFFF, "seed_hi": seed >> 32}, {"n": n}, exact=True)
    check("uniform_buf_advance_f32", {"counter": words}, "counter", counter.view(np.uint32),
          {"count": 1}, {"count": 1}, exact=True)
    p = np.float32(0.4)
    scale = np.float32(1.0 / (1.0 - float(p)))
    for name, role, step in (("dropout_fwd_train_f32", "x", dropout.dropout_forward_train),
                             ("dropout_bwd_f32", "delta", dropout.dropout_backward)):
        want = x.copy()
        step(want, rand, float(p))
        check(name, {"rand": rand, role: x}, role, want,
              {"n": n, "probability": p, "scale": scale}, {"n": n}, exact=True)
    w = (rng.standard_normal(n) * 0.1).astype(np.float32)
    lr = np.array([0.01], np.float32)
    want = w.copy()
    update.sgd_update(want, delta.copy(), lr, 0.0005, 0.9, 64, True, 0.5)
    args = {"n": n, "batch": 64, "apply_decay": 1, "decay": 0.0005, "momentum": 0.9,
            "lr_scale": 0.5}
    check("sgd_upd_f32", {"lr": lr, "param": w, "grad_acc": delta}, "param", want, args,
          {"n": n}, exact=True)
    m, v, t = np.abs(delta) * 0.1, delta * delta, np.array([3.0], np.float32)
    want = w.copy()
    update.adam_update(want, delta.copy(), m.copy(), v.copy(), lr, t, 0.0005, 0.9, 0.999, 1e-7,
                       64)
    args = {"n": n, "batch": 64, "decay": 0.0005, "b1": 0.9, "b2": 0.999, "eps": 1e-7,
            "lr_scale": 1.0}
    check("adam_upd_f32", {"lr": lr, "t": t, "param": w, "grad_acc": delta, "m": m, "v": v},
          "param", want, args, {"n": n})
    bad = x.copy()
    bad[n // 2] = np.inf
    flag = np.ones(1, np.float32)
    update.all_finite_step(bad, flag).run()
    check("finite_buf_f32", {"x": bad, "flag": np.ones(1, np.float32)}, "flag", flag,
          {"n": n}, {"n": n}, exact=True)
    return results


def _verdict(got: np.ndarray, want: np.ndarray) -> tuple[float, bool]:
    r = compare(got, want)
    return r["max_abs"], r["ok"]


def _run(
    device: Any,
    name: str,
    inputs: dict[str, np.ndarray],
    output: str,
    out_shape: tuple[int, ...],
    args: dict[str, int | float],
    sizes: dict[str, int],
) -> np.ndarray:
    """Upload ``inputs`` (by role), dispatch kernel ``name`` once with its ``output`` role
    bound to a new buffer of ``out_shape``, and return that output."""
    bufs = {role: device.upload(np.ascontiguousarray(a, np.float32)) for role, a in inputs.items()}
    out = device.buffer(4 * int(np.prod(out_shape)))
    try:
        device.dispatch(*pack(name, {**bufs, output: out}, args, sizes))
        result = np.empty(out_shape, np.float32)
        out.read_into(result)
        return result
    finally:
        for b in (*bufs.values(), out):
            b.release()


def _run_roles(
    device: Any,
    name: str,
    arrays: dict[str, np.ndarray],
    outputs: tuple[str, ...],
    args: dict[str, int | float],
    sizes: dict[str, int],
) -> dict[str, np.ndarray]:
    """Upload every role's array (an accumulated role's starting contents; integer roles keep
    their type, the others are float32), dispatch kernel ``name`` once and return the
    ``outputs`` roles read back."""
    arrays = {
        role: np.ascontiguousarray(
            a, None if np.issubdtype(np.asarray(a).dtype, np.integer) else np.float32)
        for role, a in arrays.items()
    }
    bufs = {role: device.upload(a) for role, a in arrays.items()}
    try:
        device.dispatch(*pack(name, bufs, args, sizes))
        result = {}
        for role in outputs:
            result[role] = np.empty_like(arrays[role])
            bufs[role].read_into(result[role])
        return result
    finally:
        for b in bufs.values():
            b.release()


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
    from darknet_metal import __version__
    from darknet_metal.metal import is_available

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
    with tempfile.TemporaryDirectory() as tmp:
        for name, text in MINI_NETWORKS:
            path = os.path.join(tmp, f"{name}.cfg")
            with open(path, "w", encoding="utf-8") as f:
                f.write(text)
            for gemm in ("tiled", "simd"):
                try:
                    report = run_parity(path, seed=1, device=device, gemm=gemm, input_seed=2)
                except Exception:
                    ok = False
                    out(f"  FAIL {name} ({gemm} GEMM): error\n{traceback.format_exc()}")
                    continue
                for row in report["layers"]:
                    exercised.update(row["kernels"])
                worst = max(r["max_abs"] for r in report["layers"])
                bad = [r["index"] for r in report["layers"] if not r["ok"]]
                out(
                    f"  {'ok  ' if not bad else 'FAIL'} {name:<22} {gemm:<5} GEMM  "
                    f"{len(report['layers']):>2} layers, max abs diff {worst:.2e}"
                    + (f", failing layers {bad}" if bad else "")
                )
                ok &= not bad
    try:
        for name, diff, passed in _direct_checks(dev):
            exercised.add(name)
            out(f"  {'ok  ' if passed else 'FAIL'} {name:<34} max abs diff {diff:.2e}")
            ok &= passed
    except Exception:
        ok = False
        out(f"  FAIL direct kernel checks: error\n{traceback.format_exc()}")
    missing = sorted(set(registry.KERNELS) - exercised)
    out(
        f"  kernels checked: {len(exercised & set(registry.KERNELS))}/{len(registry.KERNELS)}"
        + (f"; not checked: {missing}" if missing else "")
    )
    ok &= not missing

    out(_section(f"network parity: yolov3-tiny at {size}x{size}"))
    try:
        cfg, weights = _yolov3_tiny()
        start = time.perf_counter()
        report = run_parity(cfg, weights, seed=1, device=device, size=(size, size))
        out(format_report(report))
        out(f"({time.perf_counter() - start:.1f} s)")
        ok &= report["ok"]
    except Exception:
        ok = False
        out(f"FAIL: error\n{traceback.format_exc()}")

    out(_section("speed: yolov4-tiny 416x416, batch 1, random weights"))
    if device == "emu":
        out("  skipped: the emulator checks correctness; its speed says nothing of a GPU")
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
    from darknet_metal.models import get_spec
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
    from darknet_metal.models import get_spec, model_files

    try:
        files = model_files("yolov3-tiny", download=False)
    except ModelNotFoundError:
        return str(get_spec("yolov3-tiny").cfg), None
    return str(files.cfg), str(files.weights)
