"""CPU training throughput: ``train_step`` on a prepared batch of 16 (subdivisions 1), for
yolov3-tiny and yolov4-tiny with 3 classes at 224 and 416, random initial weights.

There is no peer in this run: the real Darknet's CPU trainer is timed beside ours, on the same
machine, by ``tools/cpu_train_against_darknet.py`` (docs/performance.md, "CPU training").
Each benchmark records images/s and the planner's memory for one mini-batch next to what
Darknet keeps in ``extra_info``. The cfgs' burn_in
(1000 iterations) keeps the learning rate negligible over the few measured steps.
"""

from __future__ import annotations

import re

import numpy as np
import pytest
from shared_paths import CFG_DIR

import darknet_metal as dm
from darknet_metal.runtime.memory import plan_memory
from darknet_metal.runtime.program import INPUT
from darknet_metal.trainer.trainer import Trainer

BATCH = 16
NETWORKS = [("yolov3-tiny", 224), ("yolov3-tiny", 416), ("yolov4-tiny", 224),
            ("yolov4-tiny", 416)]


def _cfg(tmp_path, name, size):
    text = (CFG_DIR / f"{name}.cfg").read_text()
    text = re.sub(r"(?m)^width=\d+", f"width={size}", text)
    text = re.sub(r"(?m)^height=\d+", f"height={size}", text)
    text = re.sub(r"(?m)^classes=\d+", "classes=3", text)
    text = re.sub(r"(?m)^filters=255", "filters=24", text)
    path = tmp_path / f"{name}-{size}.cfg"
    path.write_text(text)
    return path


@pytest.mark.parametrize(("name", "size"), NETWORKS, ids=[f"{n}-{s}" for n, s in NETWORKS])
def test_train_step(benchmark, tmp_path, name, size):
    net = dm.load(_cfg(tmp_path, name, size), seed=0, batch=BATCH, subdivisions=1)
    rng = np.random.default_rng(0)
    x = rng.random((BATCH, 3, size, size), dtype=np.float32)
    truths = [np.array([[rng.integers(3), 0.3 + 0.4 * rng.random(), 0.3 + 0.4 * rng.random(),
                         0.2, 0.3]], np.float32) for _ in range(BATCH)]
    benchmark.group = f"train-{name}-{size}-b{BATCH}"
    benchmark.pedantic(net.train_step, args=(x, truths), rounds=3, warmup_rounds=1)
    loaded = Trainer.of(net).program
    plan = plan_memory(loaded.program, external={INPUT})
    tensors = loaded.program.tensors
    # What Darknet keeps: every output and delta, batch norm's input and normalised copy,
    # maxpool's argmax, dropout's draws, and one workspace for all layers.
    kept = sum(t.nbytes for k, t in tensors.items() if t.alias_of is None and k.role in (
        "output", "delta", "raw", "x_norm", "activation_input", "indexes", "rand"))
    kept += max(t.nbytes for k, t in tensors.items() if "workspace" in k.role)
    benchmark.extra_info["images_per_s"] = BATCH / benchmark.stats.stats.median
    benchmark.extra_info["planned_MiB"] = sum(plan.slot_bytes) / 2**20
    benchmark.extra_info["darknet_kept_MiB"] = kept / 2**20


def test_emu_train_step(benchmark, tmp_path):
    """yolov4-tiny (3 classes) on the emulator at 64x64, batch 2: images/s of the emulator
    (what keeps the tests inside CI's time), the host's encode time of a training pass (goal
    under 0.3 ms), and the planner's device memory for a training pass at 416, batch 16,
    next to what Darknet keeps."""
    net = dm.load(_cfg(tmp_path, "yolov4-tiny", 64), seed=0, batch=2, subdivisions=1,
                  device="emu")
    rng = np.random.default_rng(0)
    x = rng.random((2, 3, 64, 64), dtype=np.float32)
    truths = [np.array([[1, 0.4, 0.5, 0.2, 0.3]], np.float32)] * 2
    net.train_step(x, truths)
    encode = []

    def step():
        net.train_step(x, truths)
        encode.append(Trainer.of(net).program.last_encode_seconds)

    benchmark.group = "train-emu-yolov4-tiny-64-b2"
    benchmark.pedantic(step, rounds=3, warmup_rounds=1)
    benchmark.extra_info["images_per_s"] = 2 / benchmark.stats.stats.median
    benchmark.extra_info["encode_ms"] = float(np.median(encode)) * 1e3
    big = dm.load(_cfg(tmp_path, "yolov4-tiny", 416), seed=0, batch=16, subdivisions=1,
                  device="emu")
    from darknet_metal.runtime.train_state import TrainState

    state = TrainState(big.layers, big.params, np.float32, zeros=big.executor.training_zeros)
    for spec in big.layers:
        if spec.detection_head is not None:
            state.layer(spec.index).truth_shape = (spec.values["max"], 5)
    program = big.executor.build_training_program(state, 16)
    tensors = program.tensors
    kept = sum(t.nbytes for k, t in tensors.items() if t.alias_of is None and k.role in (
        "output", "delta", "raw", "activation_input", "indexes", "rand"))
    # Darknet keeps each batch norm's x_norm beside its input (the device program keeps
    # neither x_norm: its backward recomputes it), as large as the layer's "raw".
    kept += sum(t.nbytes for k, t in tensors.items() if t.alias_of is None and k.role == "raw")
    # Darknet's one workspace holds one image's im2col columns of its largest convolution
    # (the device program's hold several images' columns: not what Darknet keeps).
    kept += max(4 * op.in_shape[0] // op.values["groups"] * op.values["size"] ** 2
                * op.out_shape[1] * op.out_shape[2]
                for op in big.layers if op.kind == "convolutional")
    planned = sum(plan_memory(program, external={INPUT}).slot_bytes)
    benchmark.extra_info["device_planned_MiB_416_b16"] = planned / 2**20
    benchmark.extra_info["darknet_kept_MiB_416_b16"] = kept / 2**20
