"""How fast the Metal kernels run on the 'cuda' device, against the vendor libraries and a
PyTorch build of the same network, all on one card in one process.

    python tools/gpu_speed.py [--model yolov4-tiny] [--size 416] [--batch 16]
                              [--json FILE] [--skip-peer] [--skip-network]

Prints, with the card's name:
- peaks: cuBLAS FP32 (TF32 off) at 4096^3 and a 256 MiB device copy (PyTorch), and ours
  (``runtime.profile.measure_peaks``);
- reductions at 16 x 32 x 208 x 208 (88.6 MB): our batch-norm statistics against
  ``torch.var_mean``, and each of our sums' fraction of the copy bandwidth;
- GEMMs: our tiled float32 GEMM at 1024^3 and at the shapes of the network's three largest
  convolutions (forward, weight gradient, input gradient) against ``torch.matmul``;
- the network: ``Network.profile`` of a training step (--batch, one mini-batch) and of
  inference passes at batch 1 and 8, and their wall times, against the PyTorch peer
  (``tools/torch_peer.py``).
Needs an NVIDIA GPU, a build with the CUDA kernels, and PyTorch (never a dependency of the
package: the benchmark machine has it).
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent))

from torch_peer import TorchPeer, cuda_event_ms  # noqa: E402

import darknet_metal as dm  # noqa: E402
from darknet_metal.metal import get_device  # noqa: E402
from darknet_metal.metal.dispatch import gemm_args, gemm_kernel, pack  # noqa: E402
from darknet_metal.model.bundled import get_spec  # noqa: E402
from darknet_metal.runtime.profile import DevicePeaks, measure_peaks  # noqa: E402
from darknet_metal.runtime.projection import (  # noqa: E402
    APPLE_GPUS,
    kernel_efficiencies,
    project,
)


def ours_ms(device, dispatches, repeats=10) -> dict[str, float]:
    """Median device ms of each kernel name over ``repeats`` runs of ``dispatches`` (packed
    tuples), summed per name."""
    for d in dispatches:
        device.dispatch(*d)
    device.synchronize()
    runs = []
    for _ in range(repeats):
        device.profile_begin()
        for d in dispatches:
            device.dispatch(*d)
        records, _ = device.profile_end()
        per: dict[str, float] = {}
        for name, _, ns in records:
            per[name] = per.get(name, 0.0) + ns / 1e6
        runs.append(per)
    return {k: statistics.median(r[k] for r in runs) for k in runs[0]}


def peaks(torch, device) -> dict:
    torch.backends.cuda.matmul.allow_tf32 = False
    a = torch.rand(4096, 4096, device="cuda")
    b = torch.rand(4096, 4096, device="cuda")
    ms = cuda_event_ms(torch, lambda: torch.mm(a, b))
    cublas = 2 * 4096**3 / (ms * 1e-3) / 1e12  # TFLOP/s
    x = torch.empty(64 << 20, device="cuda")
    y = torch.empty_like(x)
    ms_copy = cuda_event_ms(torch, lambda: y.copy_(x))
    copy = 2 * x.numel() * 4 / (ms_copy * 1e-3) / 1e9  # GB/s, read and written
    ours = measure_peaks(device)
    out = {"cublas_tflops": cublas, "torch_copy_gbs": copy,
           "ours_gemm_tflops": ours.flops_per_second / 1e12,
           "ours_copy_gbs": ours.bytes_per_second / 1e9}
    print(f"peaks: cuBLAS FP32 4096^3 {out['cublas_tflops']:.1f} TFLOP/s; torch copy "
          f"{copy:.0f} GB/s; ours: gemm_nn_f32 2048^3 {out['ours_gemm_tflops']:.1f} TFLOP/s, "
          f"copy_buf_f32 {out['ours_copy_gbs']:.0f} GB/s")
    return out


def reductions(torch, device, copy_gbs: float) -> dict:
    from darknet_metal.metal.kernels.batchnorm import sum_runs

    n, c, h, w = 16, 32, 208, 208
    spatial = h * w
    rng = np.random.default_rng(0)
    x = (rng.standard_normal((n, c, h, w), dtype=np.float32) * 2 + 3).astype(np.float32)
    delta = rng.standard_normal((n, c, h, w), dtype=np.float32)
    runs = sum_runs(n, spatial)
    args = dict(batch=n, channels=c, spatial=spatial, eps=1e-5, momentum=0.99,
                one_minus_momentum=0.01, exact=0, act=0, **runs)
    grid_runs = {"chunks": runs["chunks"], "channels": c}
    bufs = {k: device.upload(v) for k, v in (("x", x), ("delta", delta))}
    for name, size in (("mean", c), ("variance", c), ("rm", c), ("rv", c), ("scale", c),
                       ("sg", c), ("bg", c), ("md", c), ("vd", c)):
        bufs[name] = device.upload(np.ones(size, np.float32))
    bufs["p1"] = device.buffer(4 * c * runs["chunks"])
    bufs["p3"] = device.buffer(12 * c * runs["chunks"])
    stats = [
        pack("batchnorm_fwd_mean_part_f32", {"x": bufs["x"], "partials": bufs["p1"]}, args,
             grid_runs),
        pack("batchnorm_fwd_mean_f32", {"partials": bufs["p1"], "mean": bufs["mean"]}, args,
             {"channels": c}),
        pack("batchnorm_fwd_var_part_f32", {"x": bufs["x"], "mean": bufs["mean"],
                                            "partials": bufs["p1"]}, args, grid_runs),
        pack("batchnorm_fwd_var_f32", {"partials": bufs["p1"], "mean": bufs["mean"],
                                       "variance": bufs["variance"], "rolling_mean": bufs["rm"],
                                       "rolling_variance": bufs["rv"]}, args, {"channels": c}),
    ]
    ours = ours_ms(device, stats)
    total = sum(ours.values())
    mean = bufs["mean"].read(np.float32, c)
    var = bufs["variance"].read(np.float32, c)
    xt = torch.from_numpy(x).cuda()
    ref_ms = cuda_event_ms(torch, lambda: torch.var_mean(xt, dim=(0, 2, 3), unbiased=True))
    tv, tm = torch.var_mean(xt, dim=(0, 2, 3), unbiased=True)
    x64 = x.astype(np.float64).transpose(1, 0, 2, 3).reshape(c, -1)
    exact_var = x64.var(axis=1, ddof=1)

    def rel(a):
        return float(np.linalg.norm(np.asarray(a, np.float64) - exact_var)
                     / np.linalg.norm(exact_var))

    print(f"batch-norm statistics 16x32x208x208 ({x.nbytes / 1e6:.1f} MB): ours "
          f"{total:.3f} ms ({', '.join(f'{k} {v:.3f}' for k, v in ours.items())}), "
          f"torch.var_mean {ref_ms:.3f} ms: ours/torch {total / ref_ms:.2f}; variance "
          f"relative error vs float64: ours {rel(var):.2e}, torch {rel(tv.cpu().numpy()):.2e}")
    del tm, mean
    bias = [pack("bias_bwd_part_f32", {"delta": bufs["delta"], "partials": bufs["p1"]},
                 {"batch": n, "channels": c, "spatial": spatial, **runs}, grid_runs),
            pack("bias_bwd_f32", {"partials": bufs["p1"], "bias_grad": bufs["bg"]},
                 {"batch": n, "channels": c, "spatial": spatial, **runs}, {"channels": c})]
    bwd = [pack("batchnorm_bwd_part_f32", {"delta": bufs["delta"], "x": bufs["x"],
                                           "mean": bufs["mean"], "variance": bufs["variance"],
                                           "partials": bufs["p3"]}, args, grid_runs),
           pack("batchnorm_bwd_sums_f32", {"partials": bufs["p3"], "variance": bufs["variance"],
                                           "scale": bufs["scale"], "scale_grad": bufs["sg"],
                                           "bias_grad": bufs["bg"], "mean_delta": bufs["md"],
                                           "var_delta": bufs["vd"]}, args, {"channels": c})]
    out = {"bn_stats_ms": total, "torch_var_mean_ms": ref_ms, "kernels": {}}
    for label, steps, tensors in (("bias gradient", bias, 1), ("batch-norm statistics", stats, 2),
                                  ("batch-norm backward sums", bwd, 2)):
        times = ours_ms(device, steps)
        ms = sum(times.values())
        gbs = tensors * x.nbytes / (ms * 1e-3) / 1e9
        out["kernels"][label] = {"ms": ms, "gbs": gbs, "fraction": gbs / copy_gbs}
        print(f"  {label}: {ms:.3f} ms, {gbs:.0f} GB/s read = {100 * gbs / copy_gbs:.0f}% of "
              "the copy bandwidth")
    for b in bufs.values():
        b.release()
    return out


def gemms(torch, device, net) -> list[dict]:
    shapes = [("1024^3", "nn", 1024, 1024, 1024)]
    convs = sorted((op for op in net.layers if op.kind == "convolutional"),
                   key=lambda op: -op.flops)[:3]
    for op in convs:
        c, _, _ = op.in_shape
        f, oh, ow = op.out_shape
        k = c * op.values["size"] ** 2 // op.values["groups"]
        hw = oh * ow
        shapes += [(f"L{op.index} fwd", "nn", f, hw, k), (f"L{op.index} wgrad", "nt", f, k, hw),
                   (f"L{op.index} xgrad", "tn", k, hw, f)]
    out = []
    for label, trans, m, nn_, kk in shapes:
        a = np.random.default_rng(1).random(m * kk, dtype=np.float32)
        b = np.random.default_rng(2).random(kk * nn_, dtype=np.float32)
        lda = m if trans[0] == "t" else kk
        ldb = kk if trans[1] == "t" else nn_
        ba, bb, bc = device.upload(a), device.upload(b), device.buffer(4 * m * nn_)
        args, sizes = gemm_args(M=m, N=nn_, K=kk, lda=lda, ldb=ldb, ldc=nn_, bias_mode=0,
                                act=0)
        name = gemm_kernel(trans, False)
        ms = sum(ours_ms(device, [pack(name, {"a": ba, "b": bb, "bias": ba, "c": bc}, args,
                                       sizes)], repeats=5).values())
        ta = torch.from_numpy(a).cuda().reshape((kk, m) if trans[0] == "t" else (m, kk))
        tb = torch.from_numpy(b).cuda().reshape((nn_, kk) if trans[1] == "t" else (kk, nn_))
        opa = ta.t() if trans[0] == "t" else ta
        opb = tb.t() if trans[1] == "t" else tb
        ref = cuda_event_ms(torch, lambda opa=opa, opb=opb: torch.matmul(opa, opb))
        flops = 2 * m * nn_ * kk
        row = {"shape": label, "M": m, "N": nn_, "K": kk,
               "ours_tflops": flops / (ms * 1e-3) / 1e12,
               "cublas_tflops": flops / (ref * 1e-3) / 1e12, "fraction": ref / ms}
        out.append(row)
        print(f"gemm {label:<10} {trans} M={m} N={nn_} K={kk}: ours {row['ours_tflops']:.1f} "
              f"TFLOP/s, cuBLAS {row['cublas_tflops']:.1f}: {100 * row['fraction']:.0f}%")
        for buf in (ba, bb, bc):
            buf.release()
    return out


def apple_projection(profile, args, what: str, target_ratio: int,
                     efficiencies: dict[str, float] | None = None) -> list[dict]:
    """The profile projected onto Apple GPUs (runtime.projection: a roofline model with the
    efficiencies measured here), and the Darknet CPU time on the same Mac that the target
    ratio would need."""
    rows = []
    for name, peaks_apple in APPLE_GPUS.items():
        p = project(profile, name, peaks_apple, efficiencies=efficiencies)
        top = sorted(p.kernel_seconds.items(), key=lambda kv: -kv[1])[:3]
        rows.append({"gpu": name, "ms": 1e3 * p.seconds, "source": peaks_apple.source,
                     "efficiency": p.efficiency, "target_ratio": target_ratio,
                     "darknet_cpu_ms_needed": target_ratio * 1e3 * p.seconds,
                     "top": {k: 1e3 * v for k, v in top}})
        print(f"projection {args.model} {args.size} {what} on {name}: {1e3 * p.seconds:.1f} ms "
              f"(efficiency here {p.efficiency:.2f}; top "
              + ", ".join(f"{k} {1e3 * v:.1f}" for k, v in top)
              + f"); {target_ratio}x Darknet's CPU needs Darknet at >= "
              f"{target_ratio * 1e3 * p.seconds:.0f} ms there")
    return rows


#: The kernels of each direction of a convolution's GEMMs in a training step (the weight
#: gradient's partial sums added by sum_slices).
DIRECTION_KERNELS = {"fwd": ("gemm_nn_f32",), "wgrad": ("gemm_nt_f32", "sum_slices_buf_f32"),
                     "xgrad": ("gemm_tn_f32",)}


def network_gemms(torch, net, train, batch: int) -> list[dict]:
    """The GEMMs of the three costliest convolutions as the training step dispatched them
    (several images a dispatch, weight gradients split along K and summed), against cuBLAS
    doing the same batch's products: batched matmuls forward and for the input gradient, one
    matmul over the batch's pixels for the weight gradient."""
    convs = sorted((op for op in net.layers if op.kind == "convolutional"
                    and op.values["groups"] == 1), key=lambda op: -op.flops)[:3]
    out = []
    for op in convs:
        c, _, _ = op.in_shape
        f, oh, ow = op.out_shape
        k, hw = c * op.values["size"] ** 2, oh * ow
        rng = np.random.default_rng(3)
        w = torch.from_numpy(rng.random((f, k), dtype=np.float32)).cuda()
        cols = torch.from_numpy(rng.random((batch, k, hw), dtype=np.float32)).cuda()
        delta = torch.from_numpy(rng.random((batch, f, hw), dtype=np.float32)).cuda()
        delta_rows = delta.permute(1, 0, 2).reshape(f, batch * hw).contiguous()
        cols_rows = cols.permute(1, 0, 2).reshape(k, batch * hw).contiguous()
        peers = {"fwd": lambda w=w, cols=cols: torch.matmul(w, cols),
                 "wgrad": lambda d=delta_rows, c=cols_rows: torch.matmul(d, c.t()),
                 "xgrad": lambda w=w, delta=delta: torch.matmul(w.t(), delta)}
        for direction, kernels in DIRECTION_KERNELS.items():
            mine = [d for d in train.dispatches if d.layer == op.index and d.kernel in kernels]
            ms = 1e3 * sum(d.seconds for d in mine)
            ref = cuda_event_ms(torch, peers[direction])
            flops = 2 * f * k * hw * batch
            row = {"layer": op.index, "direction": direction, "M": f, "N": k, "K": hw,
                   "batch": batch, "dispatches": len(mine), "ours_ms": ms, "cublas_ms": ref,
                   "ours_tflops": flops / (ms * 1e-3) / 1e12,
                   "cublas_tflops": flops / (ref * 1e-3) / 1e12, "fraction": ref / ms}
            out.append(row)
            print(f"gemm in the step L{op.index} {direction:<5} (f {f}, k {k}, pixels {hw}, "
                  f"batch {batch}; {len(mine)} dispatches): ours {ms:.3f} ms "
                  f"{row['ours_tflops']:.1f} TFLOP/s, cuBLAS {ref:.3f} ms "
                  f"{row['cublas_tflops']:.1f}: {100 * row['fraction']:.0f}%")
    return out


def boxes(batch: int, classes: int) -> list[np.ndarray]:
    """Three seeded boxes (class, cx, cy, w, h) per image."""
    rng = np.random.default_rng(0)
    return [np.column_stack([rng.integers(classes, size=3), rng.uniform(0.2, 0.8, (3, 2)),
                             rng.uniform(0.05, 0.4, (3, 2))]).astype(np.float32)
            for _ in range(batch)]


def network(torch, args, peaks_ours: DevicePeaks) -> dict:
    cfg = get_spec(args.model).cfg
    out: dict = {}
    net = dm.load(cfg, device="cuda", batch=args.batch, subdivisions=1,
                  input_size=(args.size, args.size))
    train = net.profile(train=True, repeats=3, peaks=peaks_ours)
    print(train.table(20))
    out["train_profile"] = train.to_dict()
    # Wall time of steps on a network of its own (they change its weights).
    stepper = dm.load(cfg, device="cuda", batch=args.batch, subdivisions=1,
                      input_size=(args.size, args.size))
    x = np.random.default_rng(0).random((args.batch, 3, args.size, args.size),
                                        dtype=np.float32)
    truths = boxes(args.batch, stepper.yolo_heads()[0].classes)
    stepper.train_step(x, truths)
    walls = []
    for _ in range(5):
        t = time.perf_counter()
        stepper.train_step(x, truths)
        walls.append(1e3 * (time.perf_counter() - t))
    out["network_gemms"] = network_gemms(torch, net, train, args.batch)
    out["apple_training"] = apple_projection(train, args, "training step", 10)
    out["train_wall_ms"] = statistics.median(walls)
    out["train_device_ms"] = 1e3 * train.seconds
    out["train_host_copies_ms"] = 1e3 * train.host_copies.get("seconds", 0.0)
    profiles = {}
    for batch in (1, 8):
        inf = dm.load(cfg, device="cuda", batch=batch, input_size=(args.size, args.size))
        prof = inf.profile(repeats=5, peaks=peaks_ours)
        print(prof.table(12))
        xb = np.random.default_rng(0).random((batch, 3, args.size, args.size), dtype=np.float32)
        inf.forward(xb)
        walls = []
        for _ in range(10):
            t = time.perf_counter()
            inf.forward(xb)
            walls.append(1e3 * (time.perf_counter() - t))
        out[f"infer{batch}_device_ms"] = 1e3 * prof.seconds
        out[f"infer{batch}_wall_ms"] = statistics.median(walls)
        out[f"infer{batch}_profile"] = prof.to_dict()
        profiles[batch] = prof
    # At batch 1 the H200 is far from filled (its efficiency is latency's); an M1 has 1/16 of
    # its cores, so the batch-8 pass's per-kernel efficiencies are the other bound.
    out["apple_inference"] = apple_projection(profiles[1], args, "inference batch 1", 14)
    out["apple_inference_b8_efficiency"] = apple_projection(
        profiles[1], args, "inference batch 1 (batch-8 efficiencies)", 14,
        efficiencies=kernel_efficiencies(profiles[8]))
    if not args.skip_peer:
        peer = TorchPeer(net, torch)
        out["peer_train_ms"] = peer.time_training_step(args.batch)
        out["peer_infer1_ms"] = peer.time_inference(1)
        out["peer_infer8_ms"] = peer.time_inference(8)
        print(f"{args.model} {args.size} training step batch {args.batch}: ours device "
              f"{out['train_device_ms']:.1f} ms (wall {out['train_wall_ms']:.1f}, driver host "
              f"copies {out['train_host_copies_ms']:.1f}), PyTorch {out['peer_train_ms']:.1f} "
              f"ms: ours/peer {out['train_device_ms'] / out['peer_train_ms']:.2f}")
        for b in (1, 8):
            print(f"{args.model} {args.size} inference batch {b}: ours device "
                  f"{out[f'infer{b}_device_ms']:.2f} ms (wall {out[f'infer{b}_wall_ms']:.2f}), "
                  f"PyTorch {out[f'peer_infer{b}_ms']:.2f} ms: ours/peer "
                  f"{out[f'infer{b}_device_ms'] / out[f'peer_infer{b}_ms']:.2f}")
    return out


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="yolov4-tiny")
    parser.add_argument("--size", type=int, default=416)
    parser.add_argument("--batch", type=int, default=16)
    parser.add_argument("--json", type=Path)
    parser.add_argument("--skip-peer", action="store_true")
    parser.add_argument("--skip-network", action="store_true")
    parser.add_argument("--skip-reductions", action="store_true")
    args = parser.parse_args()
    import torch

    device = get_device("cuda")
    print(f"card: {torch.cuda.get_device_name(0)} ({device.name})")
    result: dict = {"card": torch.cuda.get_device_name(0)}
    result["peaks"] = peaks(torch, device)
    if not args.skip_reductions:
        result["reductions"] = reductions(torch, device, result["peaks"]["torch_copy_gbs"])
    net = dm.load(get_spec(args.model).cfg, device="cpu", input_size=(args.size, args.size),
                  batch=args.batch)
    result["gemms"] = gemms(torch, device, net)
    if not args.skip_network:
        p = result["peaks"]
        ours_peaks = DevicePeaks(p["cublas_tflops"] * 1e12, p["torch_copy_gbs"] * 1e9,
                                 "cuBLAS FP32 at 4096^3 and a PyTorch device copy, same card")
        result["network"] = network(torch, args, ours_peaks)
    if args.json:
        args.json.write_text(json.dumps(result, indent=1, default=str))
    return 0


if __name__ == "__main__":
    sys.exit(main())
