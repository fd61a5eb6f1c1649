"""Gradients of the Cython convolution and connected layers: finite differences, NumPy
references, accumulation, dtypes, determinism and argument checks."""

import numpy as np
import pytest
from grad_check import numeric_grad, rel_err
from reference import np_conv_grads

from darknet_metal.cpu import batchnorm as bn
from darknet_metal.cpu import conv, executor, im2col
from darknet_metal.errors import ArgumentError, ArgumentTypeError
from darknet_metal.model.activations import ACTIVATION_ID

LINEAR = ACTIVATION_ID["linear"]

GEOMETRIES = [
    # n, c, h, w, f, size, sx, sy, pad, dilation, groups
    (2, 3, 5, 7, 4, 3, 1, 1, 1, 1, 1),
    (1, 4, 7, 5, 6, 3, 2, 1, 1, 1, 2),
    (2, 6, 5, 5, 3, 3, 1, 2, 0, 1, 3),
    (1, 2, 9, 7, 3, 3, 1, 1, 1, 2, 1),
    (1, 3, 7, 7, 2, 5, 2, 2, 2, 1, 1),
    (2, 4, 5, 3, 6, 1, 1, 1, 0, 1, 2),  # the 1x1 path: no im2col
    (1, 3, 5, 5, 4, 1, 2, 2, 0, 1, 1),  # 1x1 strided: im2col
    (1, 3, 3, 3, 2, 1, 1, 1, 1, 1, 1),  # 1x1 padded: im2col, border taps all padding
    (1, 2, 5, 5, 2, 2, 1, 1, 0, 1, 1),
    (1, 3, 3, 5, 5, 3, 1, 1, 2, 1, 1),  # pad > (size-1)/2: the output outgrows the input
]


def out_hw(h, w, size, sx, sy, pad, dilation):
    span = dilation * (size - 1) + 1
    return (h + 2 * pad * dilation - span) // sy + 1, (w + 2 * pad * dilation - span) // sx + 1


def make_case(geometry, dtype, seed=0):
    n, c, h, w, f, size, sx, sy, pad, dilation, groups = geometry
    rng = np.random.default_rng(seed + sum(geometry))
    oh, ow = out_hw(h, w, size, sx, sy, pad, dilation)
    x = rng.standard_normal((n, c, h, w)).astype(dtype)
    wt = rng.standard_normal((f, c // groups * size * size)).astype(dtype)
    delta = rng.standard_normal((n, f, oh, ow)).astype(dtype)
    ws = np.empty(conv.backward_workspace_size(c, size, groups, oh, ow), dtype)
    return x, wt, delta, ws, (size, sx, sy, pad, dilation, groups)


def forward(x, wt, geom, out_shape):
    out = np.empty(out_shape, x.dtype)
    ws = np.empty(conv.workspace_size(x.shape[1], geom[0], geom[5], *out_shape[2:]), x.dtype)
    conv.conv2d_forward(x, wt, np.zeros(wt.shape[0], x.dtype), out, ws, *geom, LINEAR)
    return out


@pytest.mark.parametrize("geometry", GEOMETRIES)
def test_conv_gradients_match_finite_differences(geometry):
    x, wt, delta, ws, geom = make_case(geometry, np.float64)

    def loss():
        return float(np.sum(forward(x, wt, geom, delta.shape) * delta))

    wgrad = np.zeros_like(wt)
    conv.conv2d_backward_weights(x, delta, wgrad, ws, *geom)
    xgrad = np.zeros_like(x)
    conv.conv2d_backward_input(wt, delta, xgrad, ws, *geom)
    # The loss is linear in x and in the weights: the differences are exact but for rounding.
    assert rel_err(wgrad, numeric_grad(loss, wt, 1e-3)) < 1e-9
    assert rel_err(xgrad, numeric_grad(loss, x, 1e-3)) < 1e-9


@pytest.mark.parametrize("geometry", GEOMETRIES)
@pytest.mark.parametrize("dtype", [np.float32, np.float64])
def test_conv_gradients_accumulate_and_match_numpy(geometry, dtype):
    x, wt, delta, ws, geom = make_case(geometry, dtype, seed=1)
    ref_w, ref_x = np_conv_grads(x, wt, delta, *geom)
    rng = np.random.default_rng(7)
    wgrad0 = rng.standard_normal(wt.shape).astype(dtype)
    xgrad0 = rng.standard_normal(x.shape).astype(dtype)
    wgrad, xgrad = wgrad0.copy(), xgrad0.copy()
    conv.conv2d_backward_weights(x, delta, wgrad, ws, *geom)
    conv.conv2d_backward_input(wt, delta, xgrad, ws, *geom)
    tol = 1e-5 if dtype == np.float32 else 1e-13
    assert rel_err(wgrad - wgrad0, ref_w) < tol
    assert rel_err(xgrad - xgrad0, ref_x) < tol


# Wide rows of many channels: the backward unfolds one output row a block, the last
# block a partial one; float32 big enough to be shared among the GEMM threads.
BIG = (2, 64, 5, 300, 32, 3, 1, 1, 1, 1, 1)
BIG_GROUPED = (1, 48, 9, 560, 24, 3, 2, 1, 1, 1, 2)


@pytest.mark.parametrize("geometry", [BIG, BIG_GROUPED])
def test_conv_gradients_in_row_blocks(geometry):
    n, c, h, w, f, size, sx, sy, pad, dilation, groups = geometry
    oh, ow = out_hw(h, w, size, sx, sy, pad, dilation)
    k = c // groups * size * size
    assert conv.backward_workspace_size(c, size, groups, oh, ow) < k * oh * ow
    x64, wt64, d64, _, geom = make_case(geometry, np.float64)
    ref_w, ref_x = np_conv_grads(x64, wt64, d64, *geom)
    results = []
    for dtype in (np.float64, np.float32, np.float32):
        x, wt, delta = x64.astype(dtype), wt64.astype(dtype), d64.astype(dtype)
        ws = np.empty(conv.backward_workspace_size(c, size, groups, oh, ow), dtype)
        wgrad, xgrad = np.zeros_like(wt), np.zeros_like(x)
        conv.conv2d_backward_weights(x, delta, wgrad, ws, *geom)
        conv.conv2d_backward_input(wt, delta, xgrad, ws, *geom)
        tol = 1e-5 if dtype == np.float32 else 1e-12
        assert rel_err(wgrad, ref_w) < tol
        assert rel_err(xgrad, ref_x) < tol
        results.append((wgrad, xgrad))
    # float32 twice: bit-identical.
    for a, b in zip(results[1], results[2], strict=True):
        assert np.array_equal(a, b)


def test_conv_backward_accepts_the_forward_workspace_and_none_for_1x1():
    x, wt, delta, _, geom = make_case((1, 3, 6, 6, 4, 3, 1, 1, 1, 1, 1), np.float64)
    big = np.empty(conv.workspace_size(3, 3, 1, 6, 6))
    small = np.empty(conv.backward_workspace_size(3, 3, 1, 6, 6))
    grads = []
    for ws in (big, small):
        wgrad = np.zeros_like(wt)
        conv.conv2d_backward_weights(x, delta, wgrad, ws, *geom)
        grads.append(wgrad)
    assert np.array_equal(grads[0], grads[1])
    x, wt, delta, _, geom = make_case((2, 4, 5, 3, 6, 1, 1, 1, 0, 1, 2), np.float64)
    xgrad = np.zeros_like(x)
    conv.conv2d_backward_input(wt, delta, xgrad, None, *geom)
    assert rel_err(xgrad, np_conv_grads(x, wt, delta, *geom)[1]) < 1e-13


def test_conv_backward_steps_bind_and_rerun():
    x, wt, delta, ws, geom = make_case(GEOMETRIES[1], np.float32)
    wgrad, xgrad = np.zeros_like(wt), np.zeros_like(x)
    steps = [conv.conv2d_backward_weights_step(x, delta, wgrad, ws, *geom),
             conv.conv2d_backward_input_step(wt, delta, xgrad, ws, *geom)]
    assert [s.kind for s in steps] == ["conv2d_backward_weights", "conv2d_backward_input"]
    for s in steps:
        s.run()
    once = wgrad.copy(), xgrad.copy()
    for s in steps:
        s.run()
    np.testing.assert_allclose(wgrad, 2 * once[0], rtol=1e-6)
    np.testing.assert_allclose(xgrad, 2 * once[1], rtol=1e-6)


def test_conv_backward_rejects_bad_arguments():
    x, wt, delta, ws, geom = make_case((1, 4, 6, 6, 2, 3, 1, 1, 1, 1, 1), np.float32)
    wgrad, xgrad = np.zeros_like(wt), np.zeros_like(x)
    bw, bx = conv.conv2d_backward_weights_step, conv.conv2d_backward_input_step
    with pytest.raises(ArgumentError, match="delta spatial size"):
        bw(x, delta[:, :, :5].copy(), wgrad, ws, *geom)
    with pytest.raises(ArgumentError, match="weight_grad shape"):
        bw(x, delta, np.zeros((2, 35), np.float32), ws, *geom)
    with pytest.raises(ArgumentError, match="weight_grad must be writable"):
        ro = wgrad.copy()
        ro.flags.writeable = False
        bw(x, delta, ro, ws, *geom)
    with pytest.raises(ArgumentError, match="delta must have the dtype"):
        bw(x, delta.astype(np.float64), wgrad, ws, *geom)
    with pytest.raises(ArgumentError, match="workspace has"):
        bw(x, delta, wgrad, ws[:10].copy(), *geom)
    with pytest.raises(ArgumentTypeError, match="workspace must be a numpy array"):
        bw(x, delta, wgrad, None, *geom)
    with pytest.raises(ArgumentError, match="groups=3"):
        bw(x, delta, wgrad, ws, 3, 1, 1, 1, 1, 3)
    with pytest.raises(ArgumentError, match="must be >= 1"):
        bx(wt, delta, xgrad, ws, 3, 0, 1, 1, 1, 1)
    with pytest.raises(ArgumentError, match=r"delta shape \(1, 2, \.\.\.\) does not match"):
        bx(np.zeros((3, 36), np.float32), delta, xgrad, ws, *geom)
    with pytest.raises(ArgumentError, match="x_grad must be C-contiguous"):
        bx(wt, delta, np.zeros((1, 4, 6, 12), np.float32)[..., ::2], ws, *geom)
    with pytest.raises(ArgumentError, match="weights must have the dtype of x_grad"):
        bx(wt.astype(np.float64), delta, xgrad, ws, *geom)
    with pytest.raises(ArgumentError, match="no output pixels"):
        bx(wt, np.zeros((1, 2, 0, 0), np.float32), np.zeros((1, 4, 2, 2), np.float32), ws,
           3, 1, 1, 0, 1, 1)


@pytest.mark.parametrize("geometry", GEOMETRIES)
def test_col2im_is_the_adjoint_of_im2col_and_adds(geometry):
    _, c, h, w, _, size, sx, sy, pad, dilation, _ = geometry
    oh, ow = out_hw(h, w, size, sx, sy, pad, dilation)
    rng = np.random.default_rng(3)
    image = rng.standard_normal((c, h, w))
    col = rng.standard_normal((c * size * size, oh * ow))
    cols = im2col.im2col_forward(image, size, sx, sy, pad * dilation, dilation, oh, ow)
    start = rng.standard_normal((c, h, w))
    folded = start.copy()
    im2col.col2im_add(col, folded, size, sx, sy, pad * dilation, dilation, oh, ow)
    assert np.sum(cols * col) == pytest.approx(np.sum(image * (folded - start)), rel=1e-12)


def test_col2im_rejects_bad_arguments():
    image = np.zeros((2, 5, 5))
    with pytest.raises(ArgumentError, match="col shape"):
        im2col.col2im_add(np.zeros((17, 25)), image, 3, 1, 1, 1, 1, 5, 5)
    with pytest.raises(ArgumentError, match="col must have the dtype of image"):
        im2col.col2im_add(np.zeros((18, 25), np.float32), image, 3, 1, 1, 1, 1, 5, 5)
    with pytest.raises(ArgumentError, match="invalid output size"):
        im2col.col2im_add(np.zeros((18, 25)), image, 3, 1, 1, 1, 1, 0, 5)


@pytest.mark.parametrize("shape", [(3, 5, 4, 3), (4, 7)])
@pytest.mark.parametrize("dtype", [np.float32, np.float64])
def test_bias_grad_sums_over_images_and_pixels(shape, dtype):
    rng = np.random.default_rng(5)
    delta = rng.standard_normal(shape).astype(dtype)
    start = rng.standard_normal(shape[1]).astype(dtype)
    grad = start.copy()
    conv.bias_grad(delta, grad)
    axes = (0, 2, 3) if len(shape) == 4 else (0,)
    want = start.astype(np.float64) + delta.astype(np.float64).sum(axis=axes)
    assert rel_err(grad, want) < (1e-6 if dtype == np.float32 else 1e-14)


def test_bias_grad_rejects_bad_arguments():
    delta = np.zeros((2, 3, 4, 4), np.float32)
    with pytest.raises(ArgumentError, match="bias_grad has 4 entries"):
        conv.bias_grad_step(delta, np.zeros(4, np.float32))
    with pytest.raises(ArgumentError, match="bias_grad must have the dtype of delta"):
        conv.bias_grad_step(delta, np.zeros(3))
    with pytest.raises(ArgumentError, match="delta must have shape"):
        conv.bias_grad_step(np.zeros((2, 3, 4), np.float32), np.zeros(3, np.float32))


def connected_case(dtype, batch=3, inputs=7, outputs=5, seed=11):
    rng = np.random.default_rng(seed)
    x = rng.standard_normal((batch, inputs)).astype(dtype)
    wt = rng.standard_normal((outputs, inputs)).astype(dtype)
    delta = rng.standard_normal((batch, outputs)).astype(dtype)
    return x, wt, delta


def test_connected_gradients_match_finite_differences():
    x, wt, delta = connected_case(np.float64)
    zero = np.zeros(wt.shape[0])

    def loss():
        out = np.empty(delta.shape)
        conv.connected_forward(x, wt, zero, out, LINEAR)
        return float(np.sum(out * delta))

    wgrad, xgrad = np.zeros_like(wt), np.zeros_like(x)
    conv.connected_backward(x, wt, delta, wgrad, xgrad)
    assert rel_err(wgrad, numeric_grad(loss, wt, 1e-3)) < 1e-9
    assert rel_err(xgrad, numeric_grad(loss, x, 1e-3)) < 1e-9


@pytest.mark.parametrize("dtype", [np.float32, np.float64])
def test_connected_gradients_accumulate(dtype):
    x, wt, delta = connected_case(dtype)
    rng = np.random.default_rng(2)
    wgrad0 = rng.standard_normal(wt.shape).astype(dtype)
    xgrad0 = rng.standard_normal(x.shape).astype(dtype)
    wgrad, xgrad = wgrad0.copy(), xgrad0.copy()
    conv.connected_backward(x, wt, delta, wgrad, xgrad)
    x64, w64, d64 = (a.astype(np.float64) for a in (x, wt, delta))
    tol = 1e-5 if dtype == np.float32 else 1e-14
    assert rel_err(wgrad - wgrad0, d64.T @ x64) < tol
    assert rel_err(xgrad - xgrad0, d64 @ w64) < tol
    # Without an input delta only the weights' gradient is taken.
    conv.connected_backward(x, wt, delta, wgrad, None)
    assert rel_err(wgrad - wgrad0, 2 * d64.T @ x64) < tol


def test_connected_backward_rejects_bad_arguments():
    x, wt, delta = connected_case(np.float32)
    wgrad, xgrad = np.zeros_like(wt), np.zeros_like(x)
    step = conv.connected_backward_step
    with pytest.raises(ArgumentError, match="weights shape"):
        step(x, wt[:, :6].copy(), delta, wgrad, xgrad)
    with pytest.raises(ArgumentError, match="delta shape"):
        step(x, wt, delta[:2].copy(), wgrad, xgrad)
    with pytest.raises(ArgumentError, match="weight_grad shape"):
        step(x, wt, delta, wgrad.T.copy(), xgrad)
    with pytest.raises(ArgumentError, match="x_grad shape"):
        step(x, wt, delta, wgrad, xgrad[:2].copy())
    with pytest.raises(ArgumentError, match="x_grad must have the dtype of x"):
        step(x, wt, delta, wgrad, xgrad.astype(np.float64))
    with pytest.raises(ArgumentTypeError, match="weight_grad must be a numpy array"):
        step(x, wt, delta, None, xgrad)


def test_training_steps_run_as_one_step_list():
    x, wt, delta, ws, geom = make_case((2, 4, 7, 5, 6, 3, 1, 1, 1, 1, 2), np.float32)
    f = wt.shape[0]

    def arrays():
        return dict(raw=np.empty_like(delta), mean=np.empty(f, np.float32),
                    var=np.empty(f, np.float32), x_norm=np.empty_like(delta),
                    out=np.empty_like(delta), rolling=(np.zeros(f, np.float32),
                                                       np.zeros(f, np.float32)),
                    delta=delta.copy(), grads=[np.zeros(f, np.float32) for _ in range(2)],
                    wgrad=np.zeros_like(wt), xgrad=np.zeros_like(x))

    def steps(a):
        scale, bias = np.ones(f, np.float32), np.zeros(f, np.float32)
        return [conv.conv2d_step(x, wt, np.zeros(f, np.float32), a["raw"],
                                 np.empty(conv.workspace_size(4, 3, 2, 7, 5), np.float32),
                                 *geom, LINEAR),
                *bn.batchnorm_forward_train_step(a["raw"], a["mean"], a["var"], a["x_norm"],
                                                 a["out"], scale, bias, *a["rolling"]),
                bn.batchnorm_backward_step(a["delta"], a["raw"], a["mean"], a["var"],
                                           a["x_norm"], scale, *a["grads"]),
                conv.conv2d_backward_weights_step(x, a["delta"], a["wgrad"], ws, *geom),
                conv.conv2d_backward_input_step(wt, a["delta"], a["xgrad"], ws, *geom)]

    one_by_one, listed = arrays(), arrays()
    for s in steps(one_by_one):
        s.run()
    executor.StepList(steps(listed)).run()
    for key in ("out", "delta", "wgrad", "xgrad"):
        assert np.array_equal(one_by_one[key], listed[key])
    assert np.abs(listed["xgrad"]).max() > 0
