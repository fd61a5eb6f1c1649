"""The convolution, connected and batch-norm training kernels against Darknet's own
training passes (../shared/golden/darknet-v5-train, read with its read_golden.py).

For every [convolutional] layer of micro-v4-sgd and micro-classifier and both
[connected] layers of micro-classifier, each pass (step, subdivision) is replayed from
Darknet's dumped input to the layer and its dumped delta before the layer's backward:
forward (convolution or connected, batch norm with the mini-batch statistics, activation)
then backward (activation derivative, batch norm or bias gradient, weight gradient, input
gradient). Compared: the layer's output, batch-norm statistics and delta after backward
per pass; the input's delta (with what the input's other consumers sent into it first);
and per step the weight/bias/scale gradient accumulators (summed over the subdivisions,
from the previous step's momentum buffer) and the running statistics saved after the
step. Everything in float32, as Darknet computes it.
"""

import functools
import importlib.util

import numpy as np
import pytest
from grad_check import rel_l2
from shared_paths import SHARED

from darknet_metal.cpu import activation as cpu_activation
from darknet_metal.cpu import batchnorm as bn
from darknet_metal.cpu import conv

TRAIN = SHARED / "golden" / "darknet-v5-train"
pytestmark = pytest.mark.skipif(not (TRAIN / "read_golden.py").is_file(),
                                reason="Darknet training golden data not available")

TOL = 1e-4  # relative L2 error
# Activations whose derivative Darknet's backward takes from the input, not the output.
FROM_INPUT = ("mish", "swish", "hard_mish")


@functools.cache
def load(case):
    spec = importlib.util.spec_from_file_location("read_golden", TRAIN / "read_golden.py")
    reader = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(reader)
    data = reader.load_case(str(TRAIN / case))
    layers = {layer["index"]: layer for layer in data["index"]["layers"]}
    return data["index"], data["arrays"], layers


def layer_indices(case, kind):
    if not TRAIN.is_dir():
        return []
    return [i for i, layer in load(case)[2].items() if layer["type"] == kind]


class Layer:
    """One layer's parameters at the start of step k and its gradient accumulators (the
    previous step's momentum buffers; zero before the first update)."""

    def __init__(self, case, index, step):
        idx, arr, layers = load(case)
        self.arr, self.layers, self.step = arr, layers, step
        self.info = layers[index]
        self.name = f"L{index:02d}"
        params = arr["init.weights" if step == 1 else f"step{step - 1}.weights"][self.name]
        self.bn = bool(self.info["batch_normalize"])
        self.weights = params["weights"].reshape(params["weights"].shape[0], -1)
        self.bias = params["biases"]
        f = self.weights.shape[0]
        self.weight_grad = np.zeros_like(self.weights)
        self.bias_grad = np.zeros(f, np.float32)
        self.scale_grad = np.zeros(f, np.float32)
        if self.bn:
            self.scale = params["scales"]
            self.rolling = (params["rolling_mean"].copy(), params["rolling_variance"].copy())
        if step > 1:
            prev = f"s{step - 1}_{self.name}_"
            self.weight_grad += arr[prev + "weight_updates_after_update"].reshape(f, -1)
            self.bias_grad += arr[prev + "bias_updates_after_update"]
            if self.bn:
                self.scale_grad += arr[prev + "scale_updates_after_update"]
        self.passes = [p["subdivision"] for p in idx["steps"][step - 1]["passes"]]
        self.batch = idx["net"]["batch_per_subdivision"]
        self.errors = {}

    def dumped(self, sub, index, what):
        kind = self.layers[index]["type"]
        return self.arr[f"s{self.step}_sub{sub}_L{index:02d}_{kind}_{what}"]

    def input(self, sub):
        index = self.info["index"]
        if index == 0:
            return np.ascontiguousarray(self.arr["X"][sub * self.batch:(sub + 1) * self.batch])
        return self.dumped(sub, index - 1, "output")

    def check(self, label, got, want):
        self.errors[label] = max(self.errors.get(label, 0.0),
                                 rel_l2(got, np.reshape(want, got.shape)))

    def normalize_activate(self, sub, raw, momentum):
        """Batch norm (or the bias) and the activation of the raw output: (pre, post, bn
        saved values)."""
        f = raw.shape[1]
        saved = None
        if self.bn:
            mean, var = np.empty(f, np.float32), np.empty(f, np.float32)
            x_norm, pre = np.empty_like(raw), np.empty_like(raw)
            bn.batchnorm_forward_train(raw, mean, var, x_norm, pre, self.scale, self.bias,
                                       *self.rolling, momentum)
            stats = f"s{self.step}_sub{sub}_{self.name}_bn_"
            self.check("bn_mean", mean, self.arr[stats + "mean"])
            self.check("bn_variance", var, self.arr[stats + "variance"])
            saved = (raw, mean, var, x_norm)
        else:
            pre = raw + self.bias.reshape((1, f) + (1,) * (raw.ndim - 2))
        post = pre.copy()
        cpu_activation.activate(post, self.info["activation"])
        return pre, post, saved

    def backward_through(self, delta, pre, post, saved):
        """delta (with respect to the output) -> with respect to the raw output, in place;
        the bias (and scale) gradients accumulated."""
        act = self.info["activation"]
        cpu_activation.gradient(pre if act in FROM_INPUT else post, act, delta)
        if saved is None:
            conv.bias_grad(delta, self.bias_grad)
        else:
            raw, mean, var, x_norm = saved
            bn.batchnorm_backward(delta, raw, mean, var, x_norm, self.scale, self.scale_grad,
                                  self.bias_grad)

    def check_accumulators(self):
        prefix = f"s{self.step}_{self.name}_"
        self.check("weight_updates", self.weight_grad, self.arr[prefix + "weight_updates"])
        self.check("bias_updates", self.bias_grad, self.arr[prefix + "bias_updates"])
        if self.bn:
            self.check("scale_updates", self.scale_grad, self.arr[prefix + "scale_updates"])
            saved = self.arr[f"step{self.step}.weights"][self.name]
            self.check("rolling_mean", self.rolling[0], saved["rolling_mean"])
            self.check("rolling_variance", self.rolling[1], saved["rolling_variance"])

    def assert_close(self):
        bad = {k: v for k, v in self.errors.items() if not v <= TOL}
        assert not bad, f"{self.name} step {self.step}: relative L2 errors {self.errors}"


def consumers(layers, j):
    """Indices of the layers that read layer j's output."""
    found = []
    for c, layer in layers.items():
        if layer["type"] == "route":
            sources = layer["route_layers"]
        elif layer["type"] == "shortcut":
            sources = [c - 1, *layer["from"]]
        else:
            sources = [c - 1]
        if j in sources:
            found.append(c)
    return found


def others_sent(layer, sub, j, i):
    """What layer j's consumers other than conv i added into its delta, or None when one
    of them is of a kind not replayed here."""
    total = np.zeros(layer.dumped(sub, j, "output").shape, np.float32)
    for c in consumers(layer.layers, j):
        info = layer.layers[c]
        if c == i:
            continue
        plain_route = (info["type"] == "route" and info["route_layers"] == [j]
                       and info["groups"] == 1)
        plain_shortcut = (info["type"] == "shortcut" and info["nweights"] == 0
                          and info["activation"] == "linear")
        if not (plain_route or plain_shortcut):
            return None
        # Both pass their delta on unchanged.
        total += layer.dumped(sub, c, "delta")
    return total


def replay_conv(case, index, step):
    layer = Layer(case, index, step)
    info = layer.info
    f = info["filters"]
    _, out_h, out_w = info["out_chw"]
    geometry = (info["size"], info["stride"], info["stride"], info["pad"], 1, info["groups"])
    for sub in layer.passes:
        x = layer.input(sub)
        workspace = np.empty(conv.workspace_size(x.shape[1], info["size"], info["groups"],
                                                 out_h, out_w), np.float32)
        raw = np.empty((x.shape[0], f, out_h, out_w), np.float32)
        conv.conv2d_forward(x, layer.weights, np.zeros(f, np.float32), raw, workspace,
                            *geometry, cpu_activation.activation_id("linear"))
        pre, post, saved = layer.normalize_activate(sub, raw, bn.MOMENTUM_CONV)
        layer.check("conv_output", post, layer.dumped(sub, index, "output"))
        delta = layer.dumped(sub, index, "delta_in").copy()
        layer.backward_through(delta, pre, post, saved)
        layer.check("conv_delta", delta, layer.dumped(sub, index, "delta"))
        conv.conv2d_backward_weights(x, delta, layer.weight_grad, workspace, *geometry)
        if index == 0:
            continue
        j = index - 1
        x_grad = others_sent(layer, sub, j, index)
        if x_grad is None:
            continue
        conv.conv2d_backward_input(layer.weights, delta, x_grad, workspace, *geometry)
        target = "delta_in" if layer.layers[j]["type"] == "conv" else "delta"
        layer.check("input_delta", x_grad, layer.dumped(sub, j, target))
    layer.check_accumulators()
    return layer


@pytest.mark.parametrize("step", [1, 2])
@pytest.mark.parametrize("index", layer_indices("micro-v4-sgd", "conv"))
def test_micro_v4_conv_layers(index, step):
    layer = replay_conv("micro-v4-sgd", index, step)
    # Every layer but the first has its input's delta checked; 4 and 12 with the share of
    # another consumer ([shortcut] 5, [route] 14) added first.
    assert ("input_delta" in layer.errors) == (index != 0)
    layer.assert_close()


@pytest.mark.parametrize("step", [1, 2])
@pytest.mark.parametrize("index", layer_indices("micro-classifier", "conv"))
def test_micro_classifier_conv_layers(index, step):
    replay_conv("micro-classifier", index, step).assert_close()


@pytest.mark.parametrize("step", [1, 2])
def test_micro_classifier_connected_layers(step):
    # 5 [avgpool] -> 6 [connected] BN leaky -> 7 [dropout] (in place on 6) -> 8 [connected]
    # linear -> [softmax], [cost]. One subdivision.
    case = "micro-classifier"
    bn_layer, last = Layer(case, 6, step), Layer(case, 8, step)
    drop = bn_layer.layers[7]
    sub = bn_layer.passes[0]
    assert bn_layer.passes == [0] and drop["type"] == "dropout"
    rand = bn_layer.arr[f"s{step}_sub{sub}_L07_dropout_rand"]
    # Darknet's dropout: zero where rand < p, else times its float scale 1/(1-p).
    keep = np.where(rand < drop["probability"], 0, drop["scale"]).astype(np.float32)

    x = bn_layer.input(sub).reshape(bn_layer.batch, -1)
    raw = np.empty((x.shape[0], bn_layer.weights.shape[0]), np.float32)
    conv.connected_forward(x, bn_layer.weights, np.zeros(raw.shape[1], np.float32), raw,
                           cpu_activation.activation_id("linear"))
    pre, post, saved = bn_layer.normalize_activate(sub, raw, bn.MOMENTUM_CONNECTED)
    # The dumped output is after the dropout (which works in place on it).
    bn_layer.check("conn_output", post * keep, bn_layer.dumped(sub, 6, "output"))

    x8 = np.ascontiguousarray(last.dumped(sub, 6, "output").reshape(raw.shape))
    out = np.empty((x8.shape[0], last.weights.shape[0]), np.float32)
    conv.connected_forward(x8, last.weights, last.bias, out, cpu_activation.activation_id("linear"))
    last.check("conn_output", out, last.dumped(sub, 8, "output"))
    # Linear without batch norm: its delta is the same before and after its backward.
    delta8 = last.dumped(sub, 8, "delta").reshape(out.shape).copy()
    last.backward_through(delta8, out, out, None)
    x8_grad = np.zeros_like(x8)
    conv.connected_backward(x8, last.weights, delta8, last.weight_grad, x8_grad)
    # [dropout]'s backward scales the delta it shares with layer 6 the same way.
    bn_layer.check("conn_delta_in", x8_grad * keep, bn_layer.dumped(sub, 6, "delta_in"))

    delta6 = bn_layer.dumped(sub, 6, "delta_in").reshape(raw.shape).copy()
    bn_layer.backward_through(delta6, pre, post, saved)
    bn_layer.check("conn_delta", delta6, bn_layer.dumped(sub, 6, "delta"))
    x_grad = np.zeros_like(x)
    conv.connected_backward(x, bn_layer.weights, delta6, bn_layer.weight_grad, x_grad)
    bn_layer.check("input_delta", x_grad, bn_layer.dumped(sub, 5, "delta"))

    for layer in (bn_layer, last):
        layer.check_accumulators()
        layer.assert_close()
