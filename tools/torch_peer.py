"""A PyTorch build of a Darknet cfg's layers: the peer the GPU benchmarks time ours against.

    from torch_peer import TorchPeer
    peer = TorchPeer(net, torch)          # net: a darknet_metal.Network (its parsed layers)
    step_ms = peer.time_training_step(batch, repeats=20)
    pass_ms = peer.time_inference(batch, repeats=50)

Layers: [convolutional] (groups, Darknet's padding, batch norm with Darknet's epsilon and
momentum, the activations the bundled models use), [maxpool] (Darknet's padding rule: size-1
split left/top and right/bottom, ``-inf`` padded), [route] (with ``groups``/``group_id``),
[shortcut] (plain sum), [upsample] (nearest) and [yolo] (its input as the output). Training: a
squared-error loss of every head's output against fixed random targets, backward, and an SGD
step with Darknet's momentum and decay. cuDNN with TF32 off, the same batch and size; timed
with CUDA events (median). Runs only where PyTorch and a CUDA GPU are: PyTorch is never a
dependency of the package.
"""

from __future__ import annotations

import statistics
import time
from typing import Any

__all__ = ["TorchPeer", "cuda_event_ms", "wall_ms"]

_EPS = 1e-5  # Darknet's batch-norm epsilon (.000001 in its CPU build: close enough for timing)


def wall_ms(torch: Any, run: Any, repeats: int = 20, warmup: int = 5) -> float:
    """Median milliseconds of ``run()`` as a caller waits for it: the host's clock from the
    call until the GPU has finished it (``torch.cuda.synchronize``), after ``warmup`` runs."""
    for _ in range(warmup):
        run()
    torch.cuda.synchronize()
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        run()
        torch.cuda.synchronize()
        times.append(1e3 * (time.perf_counter() - start))
    return statistics.median(times)


def cuda_event_ms(torch: Any, run: Any, repeats: int = 20, warmup: int = 5) -> float:
    """Median milliseconds of ``run()`` between two CUDA events, after ``warmup`` runs."""
    for _ in range(warmup):
        run()
    torch.cuda.synchronize()
    times = []
    for _ in range(repeats):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        run()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end))
    return statistics.median(times)


class TorchPeer:
    """The layers of ``net`` (a ``darknet_metal.Network``) as a PyTorch module on the GPU."""

    def __init__(self, net: Any, torch: Any) -> None:
        self.torch = torch
        nn = torch.nn
        torch.backends.cuda.matmul.allow_tf32 = False
        torch.backends.cudnn.allow_tf32 = False
        torch.backends.cudnn.benchmark = True
        self.layers = net.layers
        self.shape = net.input_shape
        self.heads = [op.index for op in net.layers if op.kind == "yolo"]
        modules = []
        for op in net.layers:
            v = op.values
            if op.kind == "convolutional":
                c = op.in_shape[0]
                size, stride = v["size"], v["stride_x"]
                pad = size // 2 if v["pad"] else v["padding"]
                bn = bool(v["batch_normalize"])
                conv = nn.Conv2d(c, v["filters"], size, stride, pad, groups=v["groups"],
                                 bias=not bn)
                parts = [conv]
                if bn:
                    parts.append(nn.BatchNorm2d(v["filters"], eps=_EPS, momentum=0.01))
                parts.append(_activation(nn, v["activation"], op.index))
                modules.append(nn.Sequential(*parts))
            elif op.kind in ("maxpool", "route", "shortcut", "upsample", "yolo"):
                modules.append(nn.Identity())
            else:
                raise ValueError(f"layer {op.index} [{op.kind}]: not in the PyTorch peer")
        self.model = nn.ModuleList(modules).cuda()

    def forward(self, x: Any) -> list[Any]:
        """Every head's output for input ``x`` (N, C, H, W) on the GPU."""
        F = self.torch.nn.functional
        outs: list[Any] = []
        for op, module in zip(self.layers, self.model, strict=True):
            v = op.values
            inp = x if op.inputs[0] < 0 else outs[op.inputs[0]]
            if op.kind == "convolutional":
                y = module(inp)
            elif op.kind == "maxpool":
                size, stride = v["size"], v["stride_x"]
                total = v["padding"]
                left = total // 2
                padded = F.pad(inp, (left, total - left, left, total - left),
                               value=float("-inf"))
                y = F.max_pool2d(padded, size, stride)
            elif op.kind == "route":
                parts = [outs[i] for i in op.inputs]
                if v["groups"] > 1:
                    c = parts[0].shape[1] // v["groups"]
                    parts = [p[:, v["group_id"] * c:(v["group_id"] + 1) * c] for p in parts]
                y = parts[0] if len(parts) == 1 else self.torch.cat(parts, 1)
            elif op.kind == "shortcut":
                y = inp + outs[op.inputs[1]]
            elif op.kind == "upsample":
                y = F.interpolate(inp, scale_factor=v["stride"], mode="nearest")
            else:  # yolo
                y = inp
            outs.append(y)
        return [outs[i] for i in self.heads]

    def _input(self, batch: int, source: str) -> Any:
        """A function giving the step's input: the same GPU tensor ("device"), or the batch
        copied in from host memory at every call ("pageable": a NumPy array; "pinned": page-
        locked memory), as a caller whose batches come from a loader."""
        torch = self.torch
        c, h, w = self.shape
        x = torch.rand(batch, c, h, w, device="cuda")
        if source == "device":
            return lambda: x
        host = x.cpu()
        if source == "pinned":
            host = host.pin_memory()
            return lambda: host.to("cuda", non_blocking=True)
        array = host.numpy()
        return lambda: torch.from_numpy(array).to("cuda")

    def time_training_step(self, batch: int, repeats: int = 20, *, clock: str = "events",
                           source: str = "device") -> float:
        """Median milliseconds of forward, squared-error loss, backward and an SGD step.
        ``clock``: "events" (CUDA events around the step) or "wall" (``wall_ms``: the call
        as a caller waits for it); ``source``: where the input comes from (``_input``)."""
        torch = self.torch
        self.model.train()
        get_x = self._input(batch, source)
        with torch.no_grad():
            targets = [torch.rand_like(o) for o in self.forward(get_x())]
        opt = torch.optim.SGD(self.model.parameters(), lr=1e-3, momentum=0.9,
                              weight_decay=5e-4)

        def step() -> None:
            opt.zero_grad(set_to_none=False)
            loss = sum(((o - t) ** 2).sum() for o, t in zip(self.forward(get_x()), targets,
                                                            strict=True))
            loss.backward()
            opt.step()

        timer = wall_ms if clock == "wall" else cuda_event_ms
        return timer(self.torch, step, repeats)

    def time_inference(self, batch: int, repeats: int = 50, *, clock: str = "events",
                       source: str = "device") -> float:
        """Median milliseconds of a forward pass (eval mode, no autograd); ``clock`` and
        ``source`` as ``time_training_step``'s (with "wall", the heads' outputs are also
        read back to host memory, as a caller reads them)."""
        torch = self.torch
        self.model.eval()
        get_x = self._input(batch, source)

        def run() -> None:
            with torch.no_grad():
                outs = self.forward(get_x())
                if clock == "wall":
                    for o in outs:
                        o.cpu()

        timer = wall_ms if clock == "wall" else cuda_event_ms
        return timer(self.torch, run, repeats)


def _activation(nn: Any, name: str, index: int) -> Any:
    if name == "leaky":
        return nn.LeakyReLU(0.1)
    if name == "linear":
        return nn.Identity()
    if name == "mish":
        return nn.Mish()
    if name == "relu":
        return nn.ReLU()
    if name == "logistic":
        return nn.Sigmoid()
    if name == "swish":
        return nn.SiLU()
    raise ValueError(f"layer {index}: activation {name} not in the PyTorch peer")
