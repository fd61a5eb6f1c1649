"""Every variant of the hand-written FMA kernels computes the same bits.

The packed product and the direct convolution exist as an AVX-512, an AVX2 and a portable
variant (kernels.h); the CPU picks the widest it has, and ``DARKNET_METAL_CPU_KERNELS`` caps
it. The packed product reads its right-hand rows in place or from a copy (Intel CPUs;
``DARKNET_METAL_CPU_COPY_ROWS`` decides). Each variant this CPU can run, both ways, computes
the same layers in a process of its own, and the outputs must agree bit for bit: the packed
product's partial blocks of columns and filters, its unfolded shapes (5x5, stride 2,
dilation), the Winograd products, the direct convolution at stride 1 and 2 (Darknet's
arithmetic and fused), and a whole yolov4-tiny forward.
"""

import os
import subprocess
import sys

import numpy as np
import pytest
from darknet_metal.cpu.blas import cpu_kernels
from shared_paths import CFG_DIR

from darknet_metal.cpu.checks import (
    CPU_COPY_ROWS_VARIABLE,
    CPU_KERNEL_SETTINGS,
    CPU_KERNEL_VARIANTS,
    CPU_KERNELS_VARIABLE,
    check_cpu_kernels_setting,
)
from darknet_metal.errors import ArgumentError

# Computes every case with the variant the environment selects and saves the outputs.
SCRIPT = r"""
import sys
import numpy as np
import darknet_metal as dm
from darknet_metal.cpu import conv, packed_conv, winograd
from darknet_metal.cpu.blas import cpu_kernels
from darknet_metal.model.activations import ACTIVATION_ID

LEAKY, LINEAR = ACTIVATION_ID["leaky"], ACTIVATION_ID["linear"]
rng = np.random.default_rng(7)
outputs = {"variant": np.array(cpu_kernels())}

def data(n, c, h, w, f, k):
    x = rng.standard_normal((n, c, h, w)).astype(np.float32)
    wt = (rng.standard_normal((f, c * k * k)) / np.sqrt(c * k * k)).astype(np.float32)
    return x, wt, rng.standard_normal(f).astype(np.float32)

# packed product: n, c, h, w, f, ksize, stride, pad, dilation
for case in [(1, 3, 2, 3, 5, 1, 1, 0, 1), (2, 40, 13, 13, 17, 1, 1, 0, 1),
             (1, 64, 5, 7, 8, 1, 1, 0, 1), (1, 24, 19, 21, 13, 3, 2, 1, 1),
             (2, 8, 17, 40, 9, 5, 1, 2, 1), (1, 32, 30, 30, 70, 3, 1, 1, 2)]:
    n, c, h, w, f, k, s, pad, dil = case
    x, wt, b = data(n, c, h, w, f, k)
    oh, ow = (h + 2 * pad - k) // s + 1, (w + 2 * pad - k) // s + 1
    out = np.empty((n, f, oh, ow), np.float32)
    size = packed_conv.workspace_size(c, k, s, s, pad, oh, ow)
    ws = np.empty(size, np.float32) if size else None
    packed_conv.conv_forward(x, packed_conv.pack_weights(wt), b, out, ws, k, s, s, pad, dil,
                             LEAKY)
    outputs[f"packed{case}"] = out

# Winograd (its products are the packed product): c, h, w, f, tile
for case in [(32, 20, 28, 40, 4), (33, 13, 13, 9, 2)]:
    c, h, w, f, tile = case
    x, wt, b = data(1, c, h, w, f, 3)
    out = np.empty((1, f, h, w), np.float32)
    ws = np.empty(winograd.workspace_size(c, f, h, w, tile), np.float32)
    winograd.winograd_forward(x, winograd.transform_filters(wt, c, tile), b, out, ws, LINEAR)
    outputs[f"winograd{case}"] = out

# direct 3x3, Darknet's arithmetic and fused: c, h, w, f, stride
for case in [(3, 37, 45, 16, 1), (16, 24, 33, 20, 1), (3, 41, 50, 32, 2), (16, 22, 31, 12, 2)]:
    c, h, w, f, s = case
    x, wt, b = data(1, c, h, w, f, 3)
    oh, ow = (h + 2 - 3) // s + 1, (w + 2 - 3) // s + 1
    direct = conv.direct_workspace_size(c, f, h, w, 3, s, s, 1, 1, 1)
    assert direct > 0  # the direct kernel takes this case
    size = max(direct, conv.workspace_size(c, 3, 1, oh, ow))
    for fused in (False, True):
        out = np.empty((1, f, oh, ow), np.float32)
        conv.conv2d_forward(x, wt, b, out, np.empty(size, np.float32), 3, s, s, 1, 1, 1, LEAKY,
                            fused=fused)
        outputs[f"direct{case}{'fused' if fused else ''}"] = out

net = dm.load(sys.argv[2], seed=3, input_size=(160, 160))
y = net.forward(rng.random((2, 3, 160, 160), dtype=np.float32))
for i, a in enumerate(y if isinstance(y, (list, tuple)) else [y]):
    outputs[f"yolov4-tiny{i}"] = np.asarray(a)
np.savez(sys.argv[1], **outputs)
"""

# The variants a CPU with the widest one runs, narrowest last.
BELOW = {"avx512": ["avx512", "avx2", "portable"], "avx2": ["avx2", "portable"]}


def run_variant(variant, copy_rows, path):
    env = dict(os.environ, **{CPU_KERNELS_VARIABLE: variant, CPU_COPY_ROWS_VARIABLE: copy_rows})
    done = subprocess.run([sys.executable, "-c", SCRIPT, str(path), str(CFG_DIR /
                           "yolov4-tiny.cfg")], env=env, capture_output=True, text=True,
                          timeout=600)
    assert done.returncode == 0, done.stderr[-3000:]
    return dict(np.load(path))


def test_every_variant_computes_the_same_bits(tmp_path):
    widest = cpu_kernels()
    if widest not in BELOW:
        pytest.skip(f"this CPU runs only the {widest} variant: nothing to compare")
    results = {(v, rows): run_variant(v, rows, tmp_path / f"{v}-{rows}.npz")
               for v in BELOW[widest] for rows in ("0", "1")}
    first = results[widest, "0"]
    for (variant, _), outputs in results.items():
        assert str(outputs.pop("variant")) == variant  # the cap took effect
    first_keys = sorted(first)
    assert len(first_keys) == 18
    for (variant, rows), outputs in results.items():
        assert sorted(outputs) == first_keys
        for key in first_keys:
            assert np.isfinite(first[key]).all(), key
            np.testing.assert_array_equal(
                outputs[key].view(np.uint32), first[key].view(np.uint32),
                err_msg=f"{variant}, copy_rows={rows} against {widest} in place: {key}")


@pytest.mark.parametrize(("name", "value", "expected"), [
    (CPU_KERNELS_VARIABLE, "avx3", "avx512, avx2"), (CPU_KERNELS_VARIABLE, "AVX2", "avx512"),
    (CPU_KERNELS_VARIABLE, " avx2", "portable"), (CPU_COPY_ROWS_VARIABLE, "yes", "0, 1"),
    (CPU_COPY_ROWS_VARIABLE, "2", "0, 1")])
def test_an_unknown_setting_is_refused_naming_it(name, value, expected):
    with pytest.raises(ArgumentError, match=f"{name}='{value}'.*{expected}"):
        check_cpu_kernels_setting({name: value})


@pytest.mark.parametrize("name", list(CPU_KERNEL_SETTINGS))
def test_the_known_settings_and_empty_are_accepted(name):
    for value in [*CPU_KERNEL_SETTINGS[name][0], ""]:
        check_cpu_kernels_setting({name: value})
    check_cpu_kernels_setting({})
    assert CPU_KERNEL_SETTINGS[CPU_KERNELS_VARIABLE][0] == CPU_KERNEL_VARIANTS


def test_a_network_refuses_an_unknown_setting_before_running(monkeypatch):
    import darknet_metal as dm

    monkeypatch.setenv(CPU_KERNELS_VARIABLE, "avx1024")
    net = dm.load(CFG_DIR / "yolov3-tiny.cfg", seed=0, input_size=(64, 64))
    with pytest.raises(ArgumentError, match="avx1024"):
        net.forward(np.zeros((1, 3, 64, 64), np.float32))
