"""The native steps of [route], [shortcut], [scale_channels] and [sam].

References: NumPy slicing and formulas (reference.py), and Darknet's float32 arithmetic
replayed operation by operation in NumPy float32 (for the normalisations without exp).
Steps are run both alone and through ``StepList``, the executor's GIL-free loop.
"""

from __future__ import annotations

import numpy as np
import pytest
from reference import np_shortcut, np_shortcut_darknet_f32

import darknet_metal as dm
from darknet_metal.cpu import combine, executor, route, step
from darknet_metal.errors import ArgumentError, ArgumentTypeError

DTYPES = [np.float32, np.float64]


def _rand(shape, seed, dtype=np.float32):
    return np.random.default_rng(seed).standard_normal(shape).astype(dtype)


def _run(steps):
    executor.StepList(steps if isinstance(steps, list) else [steps], None).run()


# ---------------------------------------------------------------------------------------
# route


@pytest.mark.parametrize("groups,group_id", [(1, 0), (2, 0), (2, 1), (4, 3)])
@pytest.mark.parametrize("dtype", DTYPES)
def test_route_steps_match_numpy_slicing(groups, group_id, dtype):
    # What a [route] layer binds: one step per routed layer, its group_id-th group of
    # channels after the previous layer's.
    parts = [_rand((2, c, 3, 5), 1 + i, dtype) for i, c in enumerate([8, 4, 12])]
    want = np.concatenate(
        [p[:, group_id * (p.shape[1] // groups) : (group_id + 1) * (p.shape[1] // groups)]
         for p in parts], axis=1)  # fmt: skip
    out = np.full(want.shape, np.nan, dtype)
    steps, offset = [], 0
    for p in parts:
        width = p.shape[1] // groups
        steps.append(route.route_step(p, out, group_id * width, width, offset))
        offset += width
    assert all(isinstance(s, step.NativeStep) and s.kind == "route" for s in steps)
    _run(steps)
    np.testing.assert_array_equal(out, want)


def test_route_forward_leaves_other_channels_alone():
    src = _rand((3, 6, 2, 4), 1)
    out = np.full((3, 9, 2, 4), 7.0, np.float32)
    route.route_forward(src, out, 2, 3, 5)
    np.testing.assert_array_equal(out[:, 5:8], src[:, 2:5])
    assert np.all(out[:, :5] == 7.0) and np.all(out[:, 8:] == 7.0)


@pytest.mark.parametrize("n,c,h,w,count", [(0, 4, 3, 3, 2), (2, 4, 0, 3, 2), (2, 4, 3, 3, 0)])
def test_route_step_on_empty_arrays(n, c, h, w, count):
    src = np.ones((n, c, h, w), np.float32)
    out = np.zeros((n, c, h, w), np.float32)
    _run(route.route_step(src, out, 1, count, 2))
    assert not out.any()


def _route_args(**change):
    args = {"src": np.zeros((2, 6, 3, 3), np.float32), "out": np.zeros((2, 8, 3, 3), np.float32),
            "src_channel_start": 0, "channels": 4, "out_channel_start": 0}
    args.update(change)
    return args


@pytest.mark.parametrize(
    "change, error, words",
    [
        ({"src_channel_start": 3}, ArgumentError,
         ["src_channel_start=3", "channels=4", "src has 6"]),
        ({"out_channel_start": 5}, ArgumentError,
         ["out_channel_start=5", "channels=4", "out has 8"]),
        ({"channels": 7}, ArgumentError, ["channels=7", "src has 6"]),
        ({"channels": -1}, ArgumentError, ["channels must be >= 0", "-1"]),
        ({"src_channel_start": -2}, ArgumentError, ["src_channel_start must be >= 0", "-2"]),
        ({"out_channel_start": -1}, ArgumentError, ["out_channel_start must be >= 0", "-1"]),
        ({"channels": 2.0}, ArgumentTypeError, ["channels must be an int", "2.0"]),
        ({"channels": True}, ArgumentTypeError, ["channels must be an int", "True"]),
        ({"out": np.zeros((3, 8, 3, 3), np.float32)}, ArgumentError,
         ["out must have shape", "(3, 8, 3, 3)"]),
        ({"out": np.zeros((2, 8, 3, 4), np.float32)}, ArgumentError,
         ["out must have shape (2, C_out, 3, 3)"]),
        ({"out": np.zeros((2, 8, 3, 3), np.float64)}, ArgumentError, ["out", "dtype of src"]),
        ({"out": np.zeros((2, 8, 3, 3), np.float32)[:, ::2]}, ArgumentError,
         ["out", "C-contiguous"]),
        ({"src": np.zeros((2, 6, 3), np.float32)}, ArgumentError, ["src must have shape"]),
        ({"src": [1.0]}, ArgumentTypeError, ["src must be a numpy array"]),
    ],
)  # fmt: skip
def test_route_step_bad_arguments(change, error, words):
    with pytest.raises(error) as info:
        route.route_step(**_route_args(**change))
    for word in words:
        assert word in str(info.value), (word, str(info.value))


def test_route_step_refuses_out_sharing_memory_with_src():
    a = np.zeros((2, 8, 3, 3), np.float32)
    route.route_step(a[:, :4].copy(), a, 0, 4, 4)
    with pytest.raises(ArgumentError, match="out must not share memory with src"):
        route.route_step(a, a, 0, 4, 4)
    ro = np.zeros((2, 8, 3, 3), np.float32)
    ro.flags.writeable = False
    with pytest.raises(ArgumentError, match="writable"):
        route.route_step(np.zeros((2, 4, 3, 3), np.float32), ro, 0, 4, 0)


# ---------------------------------------------------------------------------------------
# shortcut


# Channel counts of the sources: more than the four a weighted first step binds or the six
# of an unweighted one, so the sum takes several steps; some wider and some narrower than x.
MANY = [5, 3, 7, 5, 1, 6, 5, 2, 5, 8, 4, 5, 5, 3]


@pytest.mark.parametrize(
    "wtype,norm",
    [("none", "none"), ("per_feature", "none"), ("per_feature", "relu"),
     ("per_feature", "softmax"), ("per_channel", "none"), ("per_channel", "relu"),
     ("per_channel", "softmax")],
)  # fmt: skip
@pytest.mark.parametrize("count", [3, 4, 5, 6, 7, 10, 14])
@pytest.mark.parametrize("dtype", DTYPES)
def test_shortcut_with_many_sources(wtype, norm, count, dtype):
    c = 5
    x = _rand((2, c, 3, 4), 1, dtype)
    sources = [_rand((2, cs, 3, 4), 10 + i, dtype) for i, cs in enumerate(MANY[:count])]
    k = count + 1
    weights = None
    if wtype != "none":
        size = k if wtype == "per_feature" else k * c
        weights = np.random.default_rng(5).uniform(-1.5, 1.5, size).astype(dtype)
    out = np.full_like(x, np.nan)
    steps = combine.shortcut_step(x, sources, weights, wtype, norm, out)
    per_step = 4 if wtype != "none" else 6
    assert (len(steps) > 1) == (count > per_step)
    assert [s.kind for s in steps] == ["shortcut"] + ["shortcut_add"] * (len(steps) - 1)
    _run(steps)
    rtol = 1e-5 if dtype == np.float32 else 1e-13
    np.testing.assert_allclose(out, np_shortcut(x, sources, weights, wtype, norm),
                               rtol=rtol, atol=rtol)
    # In place on x, each step run on its own: the same values.
    inplace = x.copy()
    for one in combine.shortcut_step(inplace, sources, weights, wtype, norm, inplace):
        one.run()
    np.testing.assert_array_equal(inplace, out)


@pytest.mark.parametrize("wtype,norm", [("none", "none"), ("per_feature", "relu"),
                                        ("per_channel", "none"), ("per_channel", "relu")])
def test_shortcut_chain_is_darknets_float32_arithmetic(wtype, norm):
    c, count = 5, 11
    x = _rand((2, c, 3, 4), 1)
    sources = [_rand((2, cs, 3, 4), 10 + i) for i, cs in enumerate(MANY[:count])]
    weights = None
    if wtype != "none":
        size = (count + 1) * (c if wtype == "per_channel" else 1)
        weights = np.random.default_rng(5).uniform(-1.5, 1.5, size).astype(np.float32)
    out = np.empty_like(x)
    _run(combine.shortcut_step(x, sources, weights, wtype, norm, out))
    np.testing.assert_array_equal(out, np_shortcut_darknet_f32(x, sources, weights, wtype, norm))


@pytest.mark.parametrize("count", [1, 9])
@pytest.mark.parametrize("wtype", ["per_feature", "per_channel"])
def test_shortcut_steps_read_the_weights_on_every_run(wtype, count):
    # Training updates the weights in place between passes: the bound steps follow.
    c = 4
    x = _rand((2, c, 3, 3), 1)
    sources = [_rand((2, c, 3, 3), 2 + i) for i in range(count)]
    weights = np.ones((count + 1, c) if wtype == "per_channel" else count + 1, np.float32)
    out = np.empty_like(x)
    steps = executor.StepList(
        combine.shortcut_step(x, sources, weights, wtype, "softmax", out), None
    )
    steps.run()
    np.testing.assert_allclose(out, np_shortcut(x, sources, weights, wtype, "softmax"),
                               rtol=1e-5, atol=1e-6)
    weights[...] = np.random.default_rng(3).uniform(-2, 2, weights.shape)
    steps.run()
    np.testing.assert_allclose(out, np_shortcut(x, sources, weights, wtype, "softmax"),
                               rtol=1e-5, atol=1e-6)
    fresh = np.empty_like(x)
    combine.shortcut_forward(x, sources, weights, wtype, "softmax", fresh)
    np.testing.assert_array_equal(out, fresh)


def test_shortcut_step_wants_weights_it_can_bind():
    x = _rand((1, 2, 3, 3), 1)
    s = [_rand((1, 2, 3, 3), 2)]
    with pytest.raises(ArgumentError, match="C-contiguous float32 array .* not a float64 array"):
        combine.shortcut_step(x, s, np.ones(2), "per_feature", "none", np.empty_like(x))
    with pytest.raises(ArgumentError, match="not a list"):
        combine.shortcut_step(x, s, [1.0, 1.0], "per_feature", "none", np.empty_like(x))
    with pytest.raises(ArgumentError, match="needs 2 weights, got 3"):
        combine.shortcut_step(x, s, np.ones(3, np.float32), "per_feature", "none", x)
    # shortcut_forward converts what it is given.
    out = np.empty_like(x)
    combine.shortcut_forward(x, s, [1.0, 1.0], "per_feature", "none", out)
    np.testing.assert_array_equal(out, x + s[0])
    with pytest.raises(ArgumentError, match="weights must be None"):
        combine.shortcut_forward(x, s, "abc", "none", "none", out)
    with pytest.raises(ArgumentError, match="needs 2 weights"):
        combine.shortcut_forward(x, s, "abc", "per_feature", "none", out)


# ---------------------------------------------------------------------------------------
# Empty arrays


@pytest.mark.parametrize("shape", [(0, 3, 2, 2), (2, 0, 2, 2), (2, 3, 0, 2), (0, 0, 0, 0)])
@pytest.mark.parametrize("wtype", ["none", "per_feature", "per_channel"])
def test_shortcut_on_empty_arrays(shape, wtype):
    n, c, h, w = shape
    x = np.ones(shape, np.float32)
    sources = [np.ones((n, cs, h, w), np.float32) for cs in [c, 1, 0, c, c, c, c, c]]
    k = len(sources) + 1
    weights = None if wtype == "none" else np.ones(k * (c if wtype == "per_channel" else 1),
                                                   np.float32)
    out = np.empty_like(x)
    _run(combine.shortcut_step(x, sources, weights, wtype, "softmax" if weights is not None
                               else "none", out))
    assert out.shape == shape


@pytest.mark.parametrize("shape", [(0, 3, 2, 2), (2, 0, 2, 2), (2, 3, 0, 2)])
def test_scale_channels_and_sam_on_empty_arrays(shape):
    n, c, h, w = shape
    x = np.ones(shape, np.float32)
    out = np.empty_like(x)
    _run(combine.scale_channels_step(x, np.ones((n, c, 1, 1), np.float32), out))
    _run(combine.scale_channels_step(x, np.ones((n, 1, h, w), np.float32), out, True))
    _run(combine.sam_step(x, x, out))


@pytest.mark.parametrize("dtype", DTYPES)
def test_scale_channels_and_sam_steps_through_the_step_list(dtype):
    x = _rand((2, 5, 3, 7), 1, dtype)
    per_channel, per_pixel = _rand((2, 5, 1, 1), 2, dtype), _rand((2, 1, 3, 7), 3, dtype)
    a, b, s = np.empty_like(x), np.empty_like(x), np.empty_like(x)
    other = _rand(x.shape, 4, dtype)
    _run([combine.scale_channels_step(x, per_channel, a),
          combine.scale_channels_step(x, per_pixel, b, scale_wh=True),
          combine.sam_step(x, other, s)])
    np.testing.assert_array_equal(a, per_channel * x)
    np.testing.assert_array_equal(b, per_pixel * x)
    np.testing.assert_array_equal(s, other * x)


# ---------------------------------------------------------------------------------------
# In a network: the layers bind native steps and compute what the formulas give.

CFG = """[net]
width=6
height=5
channels=3

[convolutional]
filters=8
size=1
activation=leaky

[convolutional]
filters=6
size=3
pad=1
activation=linear

[route]
layers=-1,-2
groups=2
group_id=1

[convolutional]
filters=7
size=1
activation=mish

[shortcut]
from=0,1,2,-1,0,1,1
weights_type=per_channel
weights_normalization=softmax
activation=leaky

[shortcut]
from=-2,-3,-4
activation=linear

[sam]
from=-2

[avgpool]

[scale_channels]
from=-2
activation=logistic
"""


def test_network_layers_use_native_steps_and_match_numpy(tmp_path):
    path = tmp_path / "net.cfg"
    path.write_text(CFG)
    net = dm.load(path, seed=0, input_size=(6, 5))
    sc = net.layers[4]
    rng = np.random.default_rng(1)
    net.params[sc.index]["weights"][...] = rng.uniform(-1, 1, sc.param_shapes["weights"])
    x = rng.random((2, 3, 5, 6)).astype(np.float32)
    outs = net.forward(x, outputs=range(len(net.layers)))
    # Only the last output kept: the planner reuses the memory of the others.
    np.testing.assert_array_equal(net.forward(x, outputs=[8])[0], outs[8])

    for spec in net.layers[2:]:
        if spec.kind == "avgpool":
            continue
        sources = [np.zeros((2, *net.layers[i].out_shape), np.float32) for i in spec.inputs]
        state = spec.prepare_cpu(net.params.get(spec.index), np.dtype(np.float32))
        steps = spec.cpu_steps(state, sources, np.zeros((2, *spec.out_shape), np.float32), None)
        assert steps and all(s.kind != "python" for s in steps), (spec.kind, steps)

    leaky = lambda v: np.where(v > 0, v, 0.1 * v)  # noqa: E731
    route_ = np.concatenate([outs[1][:, 3:], outs[0][:, 4:]], axis=1)
    np.testing.assert_array_equal(outs[2], route_)
    srcs = [outs[i] for i in (0, 1, 2, 3, 0, 1, 1)]
    want = leaky(np_shortcut(outs[3], srcs, net.params[4]["weights"], "per_channel", "softmax"))
    np.testing.assert_allclose(outs[4], want, rtol=1e-5, atol=1e-6)
    want = np_shortcut(outs[4], [outs[3], outs[2], outs[1]], None, "none", "none")
    np.testing.assert_allclose(outs[5], want, rtol=1e-6, atol=1e-6)
    np.testing.assert_array_equal(outs[6], outs[5] * outs[4])
    want = 1 / (1 + np.exp(-(outs[7] * outs[6].astype(np.float64))))
    np.testing.assert_allclose(outs[8], want, rtol=1e-6, atol=1e-7)
