"""Training API behaviour beyond matching Darknet: errors, safety, reproducibility, no
side effects of ``gradients``."""

from __future__ import annotations

import numpy as np
import pytest
from training_golden import TRAIN

import darknet_metal as dm
from darknet_metal.errors import ArgumentError, NonFiniteError
from darknet_metal.trainer.trainer import Trainer

CASE = TRAIN / "micro-v4-sgd"


def _net(tmp_path, layers=None, name="net", device="cpu", **net_keys):
    """micro-v4-sgd with ``net_keys`` set in [net] and ``layers[k]`` (a line) added to the
    k-th layer."""
    text = (CASE / "micro-v4-sgd.cfg").read_text()
    for layer, line in (layers or {}).items():
        text = _edit_layer(text, layer, line)
    lines = text.splitlines()
    net_at = lines.index("[net]")
    net_end = next(i for i in range(net_at + 1, len(lines)) if lines[i].startswith("["))
    kept = [line for i, line in enumerate(lines)
            if i >= net_end or line.split("=")[0].strip() not in net_keys]
    text = "\n".join(kept).replace("[net]", "[net]\n" + "\n".join(
        f"{k}={v}" for k, v in net_keys.items()), 1) + "\n"
    path = tmp_path / f"{name}.cfg"
    path.write_text(text)
    return dm.load(path, CASE / "init.weights", device=device)


def _batch(net, seed=0):
    rng = np.random.default_rng(seed)
    b = net.config.net.values["batch"]
    c, h, w = net.input_shape
    x = rng.random((b, c, h, w), dtype=np.float32)
    truths = [np.array([[1, 0.3, 0.4, 0.2, 0.3], [0, 0.7, 0.6, 0.4, 0.2]], np.float32)
              for _ in range(b)]
    return x, truths


def _state(net):
    return [a.copy() for p in net.params.values() for a in p.values()]


def test_a_step_producing_nan_is_refused_and_changes_nothing(tmp_path, device):
    net = _net(tmp_path, learning_rate=3e38, burn_in=0, device=device)
    x, truths = _batch(net)
    before, seen = _state(net), net.header.seen
    grads_before = {i: {n: g.copy() for n, g in p.items()}
                    for i, p in net.gradient_buffers().items()}
    with pytest.raises(NonFiniteError) as info:
        net.train_step(x, truths)
    assert info.value.layer is not None and "layer" in str(info.value)
    for a, b in zip(_state(net), before, strict=True):
        np.testing.assert_array_equal(a, b)
    for i, p in net.gradient_buffers().items():
        for n, g in p.items():
            np.testing.assert_array_equal(g, grads_before[i][n])
    assert net.header.seen == seen and net.iteration == 0


def test_saturating_inputs_give_finite_losses_and_gradients(tmp_path, device):
    net = _net(tmp_path, device=device)
    x, truths = _batch(net)
    x = np.where(x > 0.5, 1e4, -1e4).astype(np.float32)
    g = net.gradients(x, truths)
    assert np.isfinite(g.loss)
    assert all(np.isfinite(a).all() for p in g.params.values() for a in p.values())


def test_two_seeded_runs_give_identical_weights(tmp_path, device):
    steps = 20 if device == "cpu" else 5  # the emulator's steps are slow
    files = []
    for run in range(2):
        net = _net(tmp_path, burn_in=0, device=device)
        for k in range(steps):
            x, truths = _batch(net, seed=k)
            report = net.train_step(x, truths)
            assert np.isfinite(report.loss)
        path = tmp_path / f"run{run}.weights"
        net.save_weights(path)
        files.append(path.read_bytes())
    assert files[0] == files[1]
    assert net.iteration == steps
    header = dm.load(CASE / "micro-v4-sgd.cfg", tmp_path / "run0.weights").header
    assert header.seen == steps * net.config.net.values["batch"]


def test_gradients_change_no_state_and_equal_accumulate(tmp_path):
    net = _net(tmp_path)
    x, truths = _batch(net)
    before, seen = _state(net), net.header.seen
    g = net.gradients(x, truths)
    for a, b in zip(_state(net), before, strict=True):
        np.testing.assert_array_equal(a, b)
    assert net.header.seen == seen
    assert set(g.deltas) and all(d.shape[0] == 2 for d in g.deltas.values())
    loss = net.accumulate(x, truths)
    assert loss == g.loss and net.header.seen == seen + 4
    for i, p in net.gradient_buffers().items():
        for n, buf in p.items():
            np.testing.assert_array_equal(buf, g.params[i][n])


def test_learning_rate_and_iteration(tmp_path):
    net = _net(tmp_path, burn_in=5)
    assert net.learning_rate(0) == 0.0
    x, truths = _batch(net)
    report = net.train_step(x, truths)
    assert report.iteration == 1 and report.learning_rate == net.learning_rate(1)
    net.iteration = 7
    assert net.header.seen == 7 * net.config.net.values["batch"]
    with pytest.raises(ArgumentError):
        net.iteration = -1


@pytest.mark.parametrize(("bad", "match"), [
    (lambda t: t[:3], "sequence of 4"),
    (lambda t: [t[0], t[1], np.array([[7, .5, .5, .1, .1]]), t[3]], r"truths\[2\]"),
    (lambda t: [t[0], np.array([[0, .5, .5, 0, .1]]), t[2], t[3]], r"truths\[1\] row 0"),
    (lambda t: [t[0], t[1], t[2], np.array([[0, np.nan, .5, .1, .1]])], r"truths\[3\]"),
])
def test_bad_truths_name_image_and_row(tmp_path, bad, match):
    net = _net(tmp_path)
    x, truths = _batch(net)
    with pytest.raises(ArgumentError, match=match):
        net.train_step(x, bad(truths))
    assert net.iteration == 0


def test_bad_input(tmp_path):
    net = _net(tmp_path)
    x, truths = _batch(net)
    with pytest.raises(ArgumentError, match="shape"):
        net.train_step(x[:2], truths)
    x[0, 0, 0, 0] = np.nan
    with pytest.raises(ArgumentError, match="NaN"):
        net.train_step(x, truths)


def test_a_training_pass_too_large_for_the_machine_names_subdivisions_that_fit(
        tmp_path, monkeypatch):
    from darknet_metal.trainer import trainer

    net = _net(tmp_path, subdivisions=1)
    x, truths = _batch(net)
    sizing = trainer.Trainer(_net(tmp_path, subdivisions=1))
    one, two = (sizing.memory_bytes(m) for m in (1, 2))
    four = one + 3 * (two - one)
    assert four > two > one > 0
    # Room for a pass of 2 images but not of 4 (batch=4, subdivisions=1).
    monkeypatch.setattr(trainer, "physical_memory", lambda: (two + four) // 2)
    with pytest.raises(dm.MemoryLimitError, match="subdivisions=2") as info:
        net.train_step(x, truths)
    assert info.value.needed > info.value.available
    assert net.iteration == 0


def test_resize_keeps_parameters_and_training_state(tmp_path):
    net = _net(tmp_path, burn_in=0)
    x, truths = _batch(net)
    net.train_step(x, truths)
    buffers = net.gradient_buffers()
    weights = net.params[0]["weights"].copy()
    momentum = {i: {n: b.copy() for n, b in p.items()} for i, p in buffers.items()}
    assert net.resize(96, 160) is net
    assert net.input_shape == (3, 160, 96)
    for i, p in net.gradient_buffers().items():
        for n, b in p.items():
            assert b is buffers[i][n]
            np.testing.assert_array_equal(b, momentum[i][n])
    np.testing.assert_array_equal(net.params[0]["weights"], weights)
    small = np.random.default_rng(1).random((4, 3, 160, 96), dtype=np.float32)
    report = net.train_step(small, truths)
    assert report.iteration == 2 and np.isfinite(report.loss)
    outs = net.forward(small[:1])
    assert outs[0].shape[2:] == (160 // 16, 96 // 16)
    with pytest.raises(dm.CfgError):
        net.resize(100, 100)
    assert net.input_shape == (3, 160, 96)


def test_a_resize_that_does_not_fit_changes_nothing(tmp_path, device, monkeypatch):
    # The refused size's sizing programs must not replace the arrays the kept programs
    # were built with (a loss layer's truths): later steps equal those of a network that
    # never tried.
    from darknet_metal.trainer import trainer

    nets = [_net(tmp_path, burn_in=0, device=device, name=f"n{i}") for i in range(2)]
    x, truths = _batch(nets[0])
    for net in nets:
        net.train_step(x, truths)
    limit = Trainer.of(nets[0]).memory_bytes(4) + 1
    monkeypatch.setattr(trainer, "physical_memory", lambda: limit)
    with pytest.raises(dm.MemoryLimitError, match="at 256x256"):
        nets[0].resize(256, 256)
    assert nets[0].input_shape == nets[1].input_shape
    monkeypatch.undo()
    for seed in (1, 2):
        x, truths = _batch(nets[0], seed)
        truths = [t + np.array([0, 0.1 * seed, 0, 0, 0], np.float32) for t in truths]
        assert nets[0].train_step(x, truths).loss == nets[1].train_step(x, truths).loss
    for a, b in zip(_state(nets[0]), _state(nets[1]), strict=True):
        np.testing.assert_array_equal(a, b)


def test_kept_programs_are_built_again_when_their_arrays_were_replaced(tmp_path):
    from darknet_metal.runtime.program_cache import TrainingPrograms

    net = _net(tmp_path)
    state = Trainer.of(net).state
    plans, built = TrainingPrograms(limit=2), []

    def build(tag):
        def make():
            built.append(tag)
            return tag
        return make

    assert plans.get(state, "a", build("a")) == "a"
    assert plans.get(state, "a", build("a2")) == "a" and built == ["a"]
    yolo = next(i for i, layer in state.layers.items() if "truth" in layer.extra)
    state.layer(yolo).truth(3)  # another mini-batch: a new truth array
    assert plans.get(state, "a", build("a3")) == "a3"
    plans.get(state, "b", build("b"))
    plans.get(state, "c", build("c"))  # beyond the limit: "a" (least recent) goes
    assert plans.get(state, "a", build("a4")) == "a4"
    assert built == ["a", "a3", "b", "c", "a4"] and len(plans) == 2


def _edit_layer(text: str, layer: int, line: str) -> str:
    """``line`` added to the ``layer``-th layer section (0-based, after [net])."""
    parts = text.split("\n[")
    net = next(i for i, part in enumerate(parts) if part.startswith("net]"))
    at = net + 1 + layer
    parts[at] = parts[at].replace("]\n", "]\n" + line + "\n", 1)
    return "\n[".join(parts)


@pytest.mark.parametrize(("key", "frozen"), [("stopbackward", range(0, 5)),
                                             ("onlyforward", [4])])
def test_stopbackward_and_onlyforward_stop_gradients(tmp_path, key, frozen):
    text = (CASE / "micro-v4-sgd.cfg").read_text()
    path = tmp_path / "frozen.cfg"
    path.write_text(_edit_layer(text, 4, f"{key}=1"))
    net = dm.load(path, CASE / "init.weights")
    reference = dm.load(CASE / "micro-v4-sgd.cfg", CASE / "init.weights")
    x, truths = _batch(net)
    got, full = net.gradients(x, truths), reference.gradients(x, truths)
    assert net.layers[4].kind == "convolutional"
    for layer, grads in got.params.items():
        for name, g in grads.items():
            if layer in frozen:
                assert not g.any(), (layer, name)
            elif layer > 4:
                np.testing.assert_array_equal(g, full.params[layer][name])


TRAINABLE = ("weights", "biases", "scales")


def test_train_only_bn_freezes_the_layer_and_every_layer_before_it(tmp_path):
    # Darknet's CUDA update skips these layers; only batch norm's rolling statistics move.
    # One step equals stopping the backward at layer 4 for every later layer.
    net = _net(tmp_path, {4: "train_only_bn=1"}, learning_rate=0.01)
    stopped = _net(tmp_path, {4: "stopbackward=1"}, name="stopped", learning_rate=0.01)
    before = {i: {n: a.copy() for n, a in p.items()} for i, p in net.params.items()}
    x, truths = _batch(net)
    net.train_step(x, truths)
    stopped.train_step(x, truths)
    assert min(net.gradient_buffers()) > 4
    for i, p in net.params.items():
        for name, a in p.items():
            if i > 4 or name in ("rolling_mean", "rolling_variance"):
                np.testing.assert_array_equal(a, stopped.params[i][name], err_msg=f"{i} {name}")
                assert not np.array_equal(a, before[i][name]), (i, name)
            else:
                np.testing.assert_array_equal(a, before[i][name], err_msg=f"{i} {name}")
    net.train_step(*_batch(net, seed=1))
    for i in range(5):
        for name in TRAINABLE:
            if name in net.params.get(i, {}):
                np.testing.assert_array_equal(net.params[i][name], before[i][name])


@pytest.mark.parametrize(("line", "keys"), [("dont_update=2", {}),
                                            ("burnin_update=1", {"burn_in": 3})])
def test_a_held_layer_starts_updating_with_one_iterations_gradient(tmp_path, line, keys):
    # Iterations 1 and 2 leave layer 4's parameters alone (and drop its gradient); the
    # update of iteration 3 is plain SGD from an empty accumulator, written out in NumPy.
    net = _net(tmp_path, {4: line}, learning_rate=0.01, **keys)
    start = {n: a.copy() for n, a in net.params[4].items()}
    later = net.params[7]["weights"].copy()
    for seed in (1, 2):
        net.train_step(*_batch(net, seed=seed))
        for name in TRAINABLE:
            np.testing.assert_array_equal(net.params[4][name], start[name])
            assert not net.gradient_buffers()[4][name].any()
        assert not np.array_equal(net.params[4]["rolling_mean"], start["rolling_mean"])
    assert not np.array_equal(net.params[7]["weights"], later)
    x, truths = _batch(net, seed=3)
    grads = net.gradients(x, truths).params[4]
    values = {n: net.params[4][n].copy() for n in TRAINABLE}
    v = net.config.net.values
    images, rate = v["batch"], np.float32(net.learning_rate(3))
    net.train_step(x, truths)
    for name in TRAINABLE:
        accumulated = grads[name].copy()
        if name == "weights":
            accumulated += np.float32(-v["decay"] * images) * values[name]
        expected = values[name] + np.float32(rate / images) * accumulated
        got = net.params[4][name]
        assert not np.array_equal(got, values[name]), name
        np.testing.assert_allclose(got, expected, rtol=1e-6, atol=1e-9, err_msg=name)


def test_training_on_a_gpu_runs_where_coverage_says_and_inference_sees_it(tmp_path,
                                                                          gpu_device):
    net = _net(tmp_path, burn_in=0, learning_rate=0.01)
    gpu = dm.load(net.config.path, CASE / "init.weights", device=gpu_device)
    x, truths = _batch(gpu)
    gpu.forward(x[:1])  # device parameters uploaded before training changes them
    report = gpu.train_step(x, truths)
    coverage = gpu.executor.training_coverage()
    assert [p.index for p in coverage] == [s.index for s in gpu.layers]
    on_kernels = {p.kind for p in coverage if p.where == "kernels"}
    assert on_kernels == {"convolutional", "route", "maxpool", "upsample", "yolo", "shortcut"}
    assert all(p.where == "kernels" for p in coverage)
    assert all(p.reason for p in coverage if p.where == "fallback")
    assert report.iteration == 1 and np.isfinite(report.loss)
    path = tmp_path / "trained.weights"
    gpu.save_weights(path)
    fresh = dm.load(net.config.path, path, device=gpu_device)
    for a, b in zip(gpu.forward(x[:1]), fresh.forward(x[:1]), strict=True):
        np.testing.assert_array_equal(a, b)


def test_training_at_several_sizes_in_turn_keeps_rss_flat_on_the_cpu(tmp_path):
    # Three rounds of 64, 96 and 128 (Darknet's random=1 visiting sizes): the process's
    # resident memory after the second and third rounds equals the first's. glibc's
    # malloc keeps freed blocks below a threshold it moves at run time, which makes RSS
    # wander by tens of MiB without any live memory changing; a fixed threshold (the
    # environment variable below) makes RSS follow live memory.
    import os
    import subprocess
    import sys

    script = tmp_path / "rss.py"
    script.write_text("""
import gc, numpy as np, psutil
import darknet_metal as dm
from darknet_metal.model.bundled import get_spec
net = dm.load(get_spec("yolov4-tiny").cfg, seed=0, batch=2, input_size=(64, 64))
net.config.net.values.update(burn_in=0)
truths = [np.array([[1, 0.3, 0.4, 0.2, 0.3]], np.float32)] * 2
for r in range(3):
    for size in (64, 96, 128):
        net.resize(size, size)
        x = np.random.default_rng(size).random((2, 3, size, size), dtype=np.float32)
        net.train_step(x, truths)
    gc.collect()
    print(psutil.Process().memory_info().rss, flush=True)
""")
    env = {**os.environ, "MALLOC_MMAP_THRESHOLD_": "131072",
           "PYTHONPATH": os.path.dirname(os.path.dirname(dm.__file__))}
    out = subprocess.run([sys.executable, str(script)], capture_output=True, text=True,
                         env=env, timeout=300, check=True).stdout.split()
    rounds = [int(v) for v in out]
    assert len(rounds) == 3
    assert max(rounds[1:]) <= rounds[0] + 2**20, [r / 2**20 for r in rounds]


def _diverged(device, case, layer):
    """A golden case's network after one step, with the weights of ``layer`` gone NaN as a
    diverging run's do, and a trainer over them; the batch of the case's truths."""
    folder = TRAIN / case
    net = dm.load(folder / f"{case}.cfg", folder / "init.weights", device=device)
    b = net.config.net.values["batch"]
    c, h, w = net.input_shape
    x = np.random.default_rng(0).random((b, c, h, w), dtype=np.float32)
    truths = ([i % 3 for i in range(b)] if not net.yolo_layers
              else [np.array([[1, 0.3, 0.4, 0.2, 0.3]], np.float32)] * b)
    net.train_step(x, truths)
    net.params[layer]["weights"].flat[::7] = np.nan
    net.params_changed()
    return net, Trainer(net, seed=1), x, truths


@pytest.mark.parametrize(("case", "layer", "fault"), [
    ("micro-classifier", 2, "the loss is nan"),
    # The [yolo] loss stays finite over NaN outputs; the gradients do not.
    ("micro-v4-sgd", 2, "layer 0 (convolutional): NaN or infinity in its"),
])
def test_a_non_finite_step_names_the_first_layer_that_went_wrong(device, case, layer, fault):
    net, trainer, x, truths = _diverged(device, case, layer)
    before, seen = _state(net), net.header.seen
    grads_before = {i: {n: g.copy() for n, g in p.items()}
                    for i, p in trainer.gradient_buffers().items()}
    stats_before = {i: {n: a.copy() for n, a in p.items()}
                    for i, p in trainer.statistic_buffers().items()}
    with pytest.raises(NonFiniteError) as info:
        trainer.step(x, truths)
    message = str(info.value)
    kind = net.layers[layer].kind
    assert message.startswith(fault), message
    assert f"layer {layer} ({kind}) is the first whose output is not finite" in message
    assert info.value.layer == layer and message.endswith("the step was undone")
    for a, b in zip(_state(net), before, strict=True):
        np.testing.assert_array_equal(a, b)
    for i, p in trainer.gradient_buffers().items():
        for n, g in p.items():
            np.testing.assert_array_equal(g, grads_before[i][n])
    for i, p in trainer.statistic_buffers().items():
        for n, a in p.items():
            np.testing.assert_array_equal(a, stats_before[i][n])
    assert net.header.seen == seen


def test_the_program_cache_gives_back_what_leaves_and_keeps_what_is_held():
    from darknet_metal.runtime.program_cache import ProgramCache

    released, held = [], {"b"}
    cache = ProgramCache(2, release=released.append, held=lambda p: p in held)
    assert cache.get(1, lambda: "a") == "a" and cache.get(2, lambda: "b") == "b"
    assert cache.get(1, lambda: "a again") == "a"  # kept; 2 is now the least recent
    cache.get(3, lambda: "c")  # 2 is held: 1 leaves instead
    assert released == ["a"] and sorted(cache.values()) == ["b", "c"]
    assert cache.get(2, lambda: "b2", valid=lambda p: False) == "b2"  # no longer valid
    assert released == ["a", "b"] and (cache.builds, cache.hits) == (4, 1)
    cache.clear()
    assert sorted(released) == ["a", "b", "b2", "c"] and len(cache) == 0


def test_the_networks_trainer_lives_with_it_and_others_go_when_let_go(tmp_path):
    import gc
    import weakref

    net = _net(tmp_path)
    x, truths = _batch(net)
    net.train_step(x, truths)
    own = Trainer.of(net)
    assert Trainer.of(net) is own and own.kept  # the conveniences' trainer, kept
    other = weakref.ref(Trainer(net, seed=2))  # nobody keeps it
    gc.collect()
    assert other() is None
    assert net.executor.events.listeners == [own]
    net.train_step(x, truths)
    assert Trainer.of(net) is own and net.iteration == 2
    net.to("emu")  # the state goes back into net.params; a new trainer on the new device
    assert own.executor is None and Trainer.of(net) is not own


def test_a_batch_made_by_the_trainer_is_staged_in_place_with_the_same_result(tmp_path,
                                                                             device):
    # A loader writes batches where the device reads them (``batch_array``): the step takes
    # that array as it is and gives what a step on a copy of it gives.
    nets = [_net(tmp_path, name=f"net{k}", device=device) for k in range(2)]
    x, truths = _batch(nets[0])
    made = Trainer.of(nets[1]).batch_array(x.shape)
    assert made.shape == x.shape and made.dtype == np.float32 and not made.any()
    made[...] = x
    reports = [nets[0].train_step(x, truths), nets[1].train_step(made, truths)]
    assert reports[0].loss == reports[1].loss
    for a, b in zip(_state(nets[0]), _state(nets[1]), strict=True):
        np.testing.assert_array_equal(a, b)


def test_a_device_keeps_parameters_gradients_and_moments_in_one_block_each(tmp_path):
    net = _net(tmp_path, device="emu", adam=1)
    x, truths = _batch(net)
    net.train_step(x, truths)
    state = Trainer.of(net).state
    assert set(state.arenas) == {"value", "grad", "adam_m", "adam_v"}
    page = net.executor.training_alignment
    for layer in state.layers.values():
        for group in ("value", "grad", "adam_m", "adam_v"):
            for name, a in layer.group(group).items():
                assert np.shares_memory(a, state.arenas[group]), (layer.index, group, name)
                assert a.__array_interface__["data"][0] % page == 0
    # The network's parameters are the arena's arrays (the device trains them in place),
    # and reading them gives the trained values.
    for index, params in net.params.items():
        for name, a in params.items():
            assert a is state.layer(index).values[name]
    cpu = _net(tmp_path, name="cpu", device="cpu", adam=1)
    assert not Trainer.of(cpu).state.arenas  # the CPU trains NumPy arrays of its own


def test_a_step_that_does_not_carry_momentum_leaves_the_accumulators_at_zero(tmp_path,
                                                                              device):
    """``carry_momentum=False`` (a rank other than 0 across processes): after the update the
    accumulators are zero, on the device with the update; the parameters move exactly as
    with the momentum carried (the term only enters the next update)."""
    nets = [_net(tmp_path, burn_in=0, momentum=0.9, device=device, name=f"n{k}")
            for k in range(2)]
    x, truths = _batch(nets[0])
    reduce = lambda loss: (int(nets[0].config.net.values["batch"]), loss)  # noqa: E731
    nets[0].train_step(x, truths, reduce=reduce)
    nets[1].train_step(x, truths, reduce=reduce, carry_momentum=False)
    carried = [g for p in nets[0].gradient_buffers().values() for g in p.values()]
    dropped = [g for p in nets[1].gradient_buffers().values() for g in p.values()]
    assert any(np.any(g != 0) for g in carried)
    assert all(not np.any(g) for g in dropped)
    for a, b in zip(_state(nets[0]), _state(nets[1]), strict=True):
        np.testing.assert_array_equal(a, b)
    block = nets[1].gradient_block()
    if device == "cpu":
        assert block is None
    else:  # one contiguous block holding every accumulator
        assert block.flags.c_contiguous and all(np.shares_memory(block, g) for g in dropped)
