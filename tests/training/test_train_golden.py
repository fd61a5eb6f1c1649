"""Whole training iterations on the CPU against the real Darknet's (the golden build).

For each case: the network from the case's cfg and ``init.weights``, the case's images and
truths; ``Network.gradients`` against Darknet's accumulated gradients of the first step
(momentum is zero then, so ``s1_*_updates`` is the pure gradient), and ``train_step`` for
every step against Darknet's loss, learning rate and the ``.weights`` after each update.
"""

from __future__ import annotations

import numpy as np
import pytest
from float64_judge import judge
from training_golden import TRAIN, read_golden

import darknet_metal as dm
from darknet_metal.trainer.trainer import Trainer

GOLDEN = read_golden()


def _rel(got: np.ndarray, want: np.ndarray) -> float:
    got, want = np.asarray(got, np.float64).ravel(), np.asarray(want, np.float64).ravel()
    return float(np.linalg.norm(got - want) / max(np.linalg.norm(want), 1e-30))


def _truths(truth: np.ndarray) -> list[np.ndarray]:
    """Darknet's (images, boxes, 6) x, y, w, h, class, track -> ours, (k, 5) class, x, y, w, h
    per image, the rows Darknet reads (it stops at the first x == 0)."""
    out = []
    for rows in truth:
        used = []
        for r in rows:
            if r[0] == 0:
                break
            used.append([r[4], r[0], r[1], r[2], r[3]])
        out.append(np.array(used, np.float32).reshape(-1, 5))
    return out


def _case(name: str, tmp_path=None, dtype=np.float32, device="cpu"):
    case = GOLDEN.load_case(TRAIN / name)
    index, arrays = case["index"], case["arrays"]
    folder = TRAIN / name
    cfg = folder / index["cfg"]
    if tmp_path is not None and "adam=1" in cfg.read_text():
        # Darknet's CPU build parses adam=1 and runs SGD: reproduce it with Adam off.
        off = tmp_path / cfg.name
        off.write_text(cfg.read_text().replace("adam=1", "adam=0"))
        cfg = off
    net = dm.load(cfg, folder / "init.weights", dtype=dtype, device=device)
    x = arrays["X"].astype(dtype)
    c, h, w = net.input_shape
    x = x.reshape(-1, c, h, w)
    truths = _truths(arrays["truth"].reshape(x.shape[0], -1, 6))
    return net, x, truths, index, arrays


def _golden_params(weights: dict, layer: int) -> dict[str, np.ndarray]:
    return weights[f"L{layer:02d}"]


NAMES = {"weights": "weight_updates", "biases": "bias_updates", "scales": "scale_updates"}


CASES = ["micro-v4-sgd", "micro-v4-diou", "micro-v3-adam", "micro-layers"]


@pytest.mark.parametrize("name", CASES)
def test_first_step_gradients_match_darknet(name, device):
    _first_step_gradients_match_darknet(name, np.float32, device)


# float64 training (on the CPU): the same arrays, from Darknet's float32 within its rounding.
@pytest.mark.parametrize("name", ["micro-v4-sgd", "micro-layers"])
def test_first_step_float64_gradients_match_darknet(name):
    _first_step_gradients_match_darknet(name, np.float64, "cpu")


def _first_step_gradients_match_darknet(name, dtype, device):
    net, x, truths, index, arrays = _case(name, dtype=dtype, device=device)
    before = {i: {k: v.copy() for k, v in p.items()} for i, p in net.params.items()}
    g = net.gradients(x, truths)
    # A device's per-channel sums are trees, not Darknet's serial order: beyond the bound, an
    # array is judged against the CPU path in float64 as well (tests/float64_judge.py).
    exact = None
    if device != "cpu":
        ref, x64, truths64, _, _ = _case(name, dtype=np.float64)
        exact = ref.gradients(x64, truths64)
    assert abs(g.loss - index["steps"][0]["loss"]) <= 1e-4 * abs(index["steps"][0]["loss"])
    checked, failures = 0, []
    for layer, grads in g.params.items():
        for pname, grad in grads.items():
            key = f"s1_L{layer:02d}_{NAMES[pname]}"
            if key not in arrays:
                continue
            want = arrays[key].reshape(grad.shape)
            assert grad.dtype == dtype
            if exact is None:
                assert _rel(grad, want) <= 1e-4, (layer, pname, _rel(grad, want))
            else:
                failures.append(judge(f"{name} {device} layer {layer} {pname} gradient", grad,
                                      want, exact.params[layer][pname], 1e-4))
            checked += 1
    assert [f for f in failures if f] == []
    assert checked >= 10
    # Nothing changed: parameters, statistics, counters.
    for i, p in net.params.items():
        for k, v in p.items():
            np.testing.assert_array_equal(v, before[i][k])
    assert net.iteration == 0


@pytest.mark.parametrize("name", CASES)
def test_steps_match_darknet_weights(name, device, tmp_path):
    net, x, truths, index, arrays = _case(name, tmp_path, device=device)
    assert not net.config.net.values["adam"]
    # On a device, arrays beyond the bounds are judged against float64 (tests/float64_judge.py):
    # the CPU path in float64 trains alongside, from the same weights.
    exact = None if device == "cpu" else _case(name, tmp_path, dtype=np.float64)[0]
    initial = {i: {n: a.copy() for n, a in p.items()} for i, p in net.params.items()}
    failures = []
    for k, step in enumerate(index["steps"], start=1):
        previous = {i: {n: a.copy() for n, a in p.items()} for i, p in net.params.items()}
        report = net.train_step(x, truths)
        if exact is not None:
            exact_previous = {i: {n: a.copy() for n, a in p.items()}
                              for i, p in exact.params.items()}
            exact.train_step(x.astype(np.float64), truths)
        assert report.iteration == k == net.iteration
        assert np.float32(report.learning_rate) == np.float32(step["rate"])
        assert abs(report.loss - step["loss"]) <= 1e-4 * abs(step["loss"]), (k, report.loss)
        want = arrays[step["weights_file"]]
        for layer, params in net.params.items():
            golden = want.get(f"L{layer:02d}")
            if golden is None:
                continue
            for pname, value in params.items():
                target = golden[pname].reshape(value.shape)
                start = initial[layer][pname]
                label = f"{name} {device} step {k} layer {layer} {pname}"
                # An array Darknet starts at 0 (biases) is nothing but its accumulated
                # changes, which the change bound below checks.
                if np.abs(start).max() > 0:
                    if exact is None:
                        assert _rel(value, target) <= 1e-5, (k, layer, pname,
                                                              _rel(value, target))
                    else:
                        failures.append(judge(label, value, target,
                                              exact.params[layer][pname], 1e-5))
                moved = target.astype(np.float64) - previous[layer][pname]
                if np.abs(moved).max() > 1e-6 * max(np.abs(target).max(), 1e-30):
                    change = value.astype(np.float64) - previous[layer][pname]
                    if exact is None:
                        assert _rel(change, moved) <= 1e-3, (k, layer, pname,
                                                             _rel(change, moved))
                    else:
                        exact_change = (exact.params[layer][pname]
                                        - exact_previous[layer][pname])
                        failures.append(judge(label + " change", change, moved, exact_change,
                                              1e-3))
    assert [f for f in failures if f] == []


@pytest.mark.parametrize("name", ["micro-v4-sgd", "micro-v4-diou", "micro-layers"])
def test_head_statistics_match_darknet_v5s_line(name):
    """StepReport.heads hold the last mini-batch's statistics as Darknet V5 prints them."""
    net, x, truths, index, _ = _case(name)
    report = net.train_step(x, truths)
    last = index["steps"][0]["passes"][-1]["yolo"]
    assert [h.layer for h in report.heads] == [y["layer"] for y in last]
    for head, want in zip(report.heads, last, strict=True):
        assert head.count == want["count"]
        for key in ("avg_iou", "class_loss_per_image", "iou_loss_per_image",
                    "total_loss_per_image", "cost"):
            assert abs(head.values[key] - want[key]) <= 1e-4 * max(1.0, abs(want[key])), key


def test_classifier_with_darknets_dropout_draws(monkeypatch):
    """micro-classifier: BN and grouped convolutions, maxpool, global avgpool, [connected]
    with and without batch norm, [dropout], [softmax] with cross-entropy and [cost] sse. Its
    dropout draws come from Darknet's OS-seeded generator; they are handed to the dropout
    step here (the dumped ``dropout_rand`` of each step) instead of the package's stream."""
    from types import SimpleNamespace

    from darknet_metal.cpu import dropout, fill
    from darknet_metal.ops import identity

    draws: dict[str, np.ndarray] = {}

    def golden_draws(rand, seed, counter):
        draws.setdefault("buffer", np.zeros_like(rand))
        return fill.copy_step(draws["buffer"], rand)

    monkeypatch.setattr(identity, "dropout", SimpleNamespace(
        uniform_fill_step=golden_draws,
        dropout_forward_train_step=dropout.dropout_forward_train_step,
        dropout_backward_step=dropout.dropout_backward_step))
    case = GOLDEN.load_case(TRAIN / "micro-classifier")
    index, arrays = case["index"], case["arrays"]
    folder = TRAIN / "micro-classifier"
    net = dm.load(folder / index["cfg"], folder / "init.weights")
    c, h, w = net.input_shape
    x = arrays["X"].astype(np.float32).reshape(-1, c, h, w)
    truths = list(arrays["truth"].reshape(x.shape[0], -1))
    dropout_layer = next(s.index for s in net.layers if s.kind == "dropout")

    def use_draws(step):
        rand = arrays[f"s{step}_sub0_L{dropout_layer:02d}_dropout_rand"]
        Trainer.of(net)  # the program (and the draw buffer) exist from here on
        np.copyto(draws["buffer"], rand.reshape(draws["buffer"].shape))

    use_draws(1)
    g = net.gradients(x, truths)
    want_loss = index["steps"][0]["loss"]
    assert abs(g.loss - want_loss) <= 1e-4 * abs(want_loss)
    checked = 0
    for layer, grads in g.params.items():
        for pname, grad in grads.items():
            key = f"s1_L{layer:02d}_{NAMES[pname]}"
            if key in arrays:
                assert _rel(grad, arrays[key].reshape(grad.shape)) <= 1e-4, (layer, pname)
                checked += 1
    assert checked >= 10
    for k, step in enumerate(index["steps"], start=1):
        use_draws(k)
        report = net.train_step(x, truths)
        assert abs(report.loss - step["loss"]) <= 1e-4 * abs(step["loss"]), (k, report.loss)
        golden = arrays[step["weights_file"]]
        for layer, params in net.params.items():
            if f"L{layer:02d}" not in golden:
                continue
            for pname, value in params.items():
                target = golden[f"L{layer:02d}"][pname].reshape(value.shape)
                if np.abs(target).max() > 0:
                    assert _rel(value, target) <= 1e-5, (k, layer, pname, _rel(value, target))
