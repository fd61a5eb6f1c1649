"""Bad arguments, oversized networks, non-finite input and file modes: clear package errors.

Every error is a ``DarknetMetalError`` and also the built-in class a caller would catch
(``ValueError``, ``TypeError``, ``IndexError``, ``MemoryError``), and its message names the
argument, what was given and what is allowed.
"""

from __future__ import annotations

import os
import stat
import time
import tracemalloc
import warnings

import numpy as np
import pytest
from shared_paths import CFG_DIR, IMAGES

import darknet_metal as dm
from darknet_metal.errors import (
    ArgumentError,
    ArgumentTypeError,
    LayerIndexError,
    MemoryLimitError,
)

CFG = CFG_DIR / "yolov3-tiny.cfg"


@pytest.fixture(scope="module")
def net():
    return dm.load(CFG, seed=0, input_size=(64, 64))


@pytest.fixture(scope="module")
def x():
    return np.random.default_rng(0).random((1, 3, 64, 64), dtype=np.float32)


@pytest.mark.parametrize(
    "outputs, error, words",
    [
        (["15"], ArgumentTypeError, ["outputs[0]", "'15' (str)", "layer index (int)"]),
        ([1.0], ArgumentTypeError, ["outputs[0]", "1.0 (float)"]),
        ([3, True], ArgumentTypeError, ["outputs[1]", "True (bool)"]),
        ([24], LayerIndexError, ["outputs[0]", "24", "out of range", "24 layers"]),
        ([-25], LayerIndexError, ["-25", "out of range"]),
        (15, ArgumentTypeError, ["outputs", "sequence of layer indices", "15 (int)"]),
        ("15", ArgumentTypeError, ["outputs", "'15' (str)"]),
    ],
)
def test_forward_outputs(net, x, outputs, error, words):
    with pytest.raises(error) as info:
        net.forward(x, outputs=outputs)
    assert isinstance(info.value, dm.DarknetMetalError)
    for word in words:
        assert word in str(info.value), (word, str(info.value))


@pytest.mark.parametrize(
    "kwargs, error, words",
    [
        ({"input_size": 416}, ArgumentTypeError, ["input_size", "(width, height)", "416 (int)"]),
        ({"input_size": "416x416"}, ArgumentTypeError, ["input_size", "'416x416' (str)"]),
        ({"input_size": (416, 0)}, ArgumentError, ["input_size", "(416, 0)"]),
        ({"input_size": (41.5, 32)}, ArgumentError, ["input_size", "41.5"]),
        ({"batch": 0}, ArgumentError, ["batch", "positive integer", "0"]),
        ({"batch": 2.0}, ArgumentTypeError, ["batch", "2.0 (float)"]),
        ({"dtype": np.float16}, ArgumentError, ["dtype", "float32 or float64", "float16"]),
        ({"dtype": "nonsense"}, ArgumentTypeError, ["dtype", "nonsense"]),
        ({"device": "tpu"}, ArgumentError, ["unknown device 'tpu'", "cpu, metal, emu, cuda"]),
        ({"device": None}, ArgumentTypeError, ["device", "None"]),
    ],
)
def test_load_arguments(kwargs, error, words):
    with pytest.raises(error) as info:
        dm.load(CFG, **kwargs)
    assert isinstance(info.value, dm.DarknetMetalError)
    for word in words:
        assert word in str(info.value), (word, str(info.value))


def test_float16_on_emu_names_the_dtype_it_was_given():
    with pytest.raises(ArgumentError, match="not float16"):
        dm.load(CFG, dtype=np.float16, device="emu")


@pytest.mark.parametrize(
    "kwargs, error, words",
    [
        ({"thresh": "0.25"}, ArgumentTypeError, ["thresh", "number", "'0.25' (str)"]),
        ({"thresh": 2.0}, ArgumentError, ["thresh", "[0, 1]", "2.0"]),
        ({"nms": float("nan")}, ArgumentError, ["nms", "nan"]),
        ({"nms": None}, ArgumentTypeError, ["nms", "None"]),
    ],
)
def test_detect_arguments(net, kwargs, error, words):
    with pytest.raises(error) as info:
        net.detect(IMAGES / "dog.jpg", **kwargs)
    for word in words:
        assert word in str(info.value), (word, str(info.value))


@pytest.mark.parametrize("bad", [np.nan, np.inf, -np.inf])
def test_non_finite_input_is_refused(net, x, bad):
    y = x.copy()
    y[0, 2, 5, 7] = bad
    with pytest.raises(ArgumentError, match=r"1 NaN or infinite values \(the first at index "
                                            r"\(0, 2, 5, 7\)\)"):
        net.forward(y)
    np.testing.assert_array_equal(net.forward(x)[0], net.forward(x)[0])  # still usable


def test_finite_input_whose_sum_overflows_is_taken(net, x):
    # The check sums the input first; float32's largest values overflow that sum, and the
    # input is still finite.
    big = np.full_like(x, np.finfo(np.float32).max)
    with np.errstate(over="ignore"):
        assert not np.isfinite(big.sum())
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # and no overflow warning reaches the caller
        out = net.forward(big)
    assert out[0].shape == net.forward(x)[0].shape


def test_input_errors_are_package_errors(net, x):
    for bad in (x[0], x.astype(np.int32), np.zeros((1, 3, 32, 32), np.float32)):
        with pytest.raises(ArgumentError):
            net.forward(bad)
    with pytest.raises(ArgumentTypeError, match="NumPy array"):
        net.forward(x.tolist())


def test_an_oversized_network_is_refused_before_allocating(tmp_path):
    """A width of 100000 once allocated for 14 s and 3.4 GB before NumPy gave up; at
    100000x100000 the planned pass needs hundreds of GiB, more than any machine here."""
    text = CFG.read_text().replace("width=416", "width=100000").replace("height=416",
                                                                        "height=100000")
    cfg = tmp_path / "wide.cfg"
    cfg.write_text(text)
    tracemalloc.start()
    start = time.perf_counter()
    try:
        with pytest.raises(MemoryLimitError) as info:
            dm.load(cfg)
        _, peak = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()
    elapsed = time.perf_counter() - start
    err = info.value
    assert isinstance(err, dm.DarknetMetalError) and isinstance(err, MemoryError)
    assert err.needed > err.available
    message = str(err)
    for word in ("wide.cfg", "GiB", "100000x100000", "input_size", "width and height"):
        assert word in message, (word, message)
    assert peak < 200 * 2**20, f"{peak / 2**20:.0f} MiB traced before the error"
    assert elapsed < 30  # generous: the point is that nothing large was allocated


def test_parameters_larger_than_memory_are_refused_before_allocation(tmp_path):
    # A cfg asking for 2**31 - 1 filters (as a fuzzed one did): its weights alone are
    # terabytes, so load refuses before allocating any, naming the layer holding the most.
    text = CFG.read_text().replace("filters=32", "filters=2147483647", 1)
    cfg = tmp_path / "many.cfg"
    cfg.write_text(text)
    tracemalloc.start()
    try:
        with pytest.raises(MemoryLimitError) as info:
            dm.load(cfg, input_size=(64, 64))
        _, peak = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()
    err = info.value
    assert err.needed > err.available
    message = str(err)
    # Layer 2 makes 2**31 - 1 channels; layer 4, 64 filters over them, holds the most.
    for word in ("many.cfg", "parameters", "layer 4 [convolutional]", "GiB"):
        assert word in message, (word, message)
    assert peak < 200 * 2**20, f"{peak / 2**20:.0f} MiB traced before the error"


def test_a_larger_batch_is_checked_at_forward(net, x, monkeypatch):
    import darknet_metal.runtime.memory as memory

    needed = net.memory_bytes(4)
    monkeypatch.setattr(memory, "physical_memory", lambda: needed - 1)
    net.forward(x)  # batch 1 fits
    with pytest.raises(MemoryLimitError, match="batch of 4"):
        net.forward(np.repeat(x, 4, axis=0))


@pytest.mark.parametrize("device, precision", [("cpu", "fp32"), ("emu", "fp16")])
def test_load_checks_the_bytes_the_network_counts(device, precision, monkeypatch):
    # load checks memory before allocating, and the network then trusts that check: both
    # must count the same bytes, to the byte (fp16 stores tensors in 2 bytes, the input in 4).
    import darknet_metal.runtime.memory as memory

    fits = dm.load(CFG, seed=0, input_size=(64, 64), batch=3, device=device,
                   precision=precision)
    needed = fits.memory_bytes(3)
    monkeypatch.setattr(memory, "physical_memory", lambda: needed)
    dm.load(CFG, seed=0, input_size=(64, 64), batch=3, device=device, precision=precision)
    monkeypatch.setattr(memory, "physical_memory", lambda: needed - 1)
    with pytest.raises(MemoryLimitError, match="batch of 3"):
        dm.load(CFG, seed=0, input_size=(64, 64), batch=3, device=device,
                precision=precision)


def test_memory_estimate_follows_the_planned_program(net):
    one, two = net.memory_bytes(1), net.memory_bytes(2)
    assert net.parameter_bytes < one < two < 2 * one
    assert "Memory for a batch of 1: about" in net.summary()


def test_save_weights_respects_the_umask(net, tmp_path):
    old = os.umask(0o022)
    try:
        net.save_weights(tmp_path / "a.weights")
        os.umask(0o077)
        net.save_weights(tmp_path / "b.weights")
    finally:
        os.umask(old)
    assert stat.S_IMODE(os.stat(tmp_path / "a.weights").st_mode) == 0o644
    assert stat.S_IMODE(os.stat(tmp_path / "b.weights").st_mode) == 0o600
    assert sorted(p.name for p in tmp_path.iterdir()) == ["a.weights", "b.weights"]


def test_load_model_uses_the_cache(monkeypatch):
    from shared_paths import MODELS

    monkeypatch.setenv("DARKNET_METAL_HOME", str(MODELS))
    net = dm.load_model("yolov3-tiny", input_size=(64, 64))
    assert net.names[16] == "dog" and net.input_shape == (3, 64, 64)
    with pytest.raises(dm.ModelNotFoundError, match="unknown model 'yolov9'"):
        dm.load_model("yolov9")
    with pytest.raises(ArgumentError, match="unknown device"):
        dm.load_model("yolov3-tiny", device="tpu")


# Declarations checked once at import (the kernel registry, the op table): a bad one is a bug
# in the package, not something a caller passed. A bare MemoryError() is a failed allocation.
_DECLARATION_CHECKS = {"Expr.__init__", "Expr._check", "Binding.__post_init__",
                       "Kernel.__post_init__", "parse_args_header", "register", "_table"}
_BUILTIN = {"ValueError", "TypeError", "IndexError", "RuntimeError", "MemoryError"}


def _builtin_raises(tree, prefix=""):
    import ast

    for node in ast.iter_child_nodes(tree):
        if isinstance(node, ast.ClassDef):
            yield from _builtin_raises(node, f"{prefix}{node.name}.")
        elif isinstance(node, ast.FunctionDef):
            if f"{prefix}{node.name}" in _DECLARATION_CHECKS:
                continue
            for raise_ in ast.walk(node):
                if (isinstance(raise_, ast.Raise) and isinstance(raise_.exc, ast.Call)
                        and isinstance(raise_.exc.func, ast.Name)
                        and raise_.exc.func.id in _BUILTIN):
                    yield raise_.lineno, raise_.exc.func.id


def test_the_package_raises_only_its_own_errors():
    import ast
    import pathlib
    import re

    package = pathlib.Path(dm.__file__).parent
    found = []
    for path in sorted(package.rglob("*.py")):
        tree = ast.parse(path.read_text(encoding="utf-8"))
        found += [f"{path.relative_to(package)}:{line} {name}"
                  for line, name in _builtin_raises(tree)]
    pattern = re.compile(r"raise (" + "|".join(_BUILTIN) + r")\((?!\))")
    for path in sorted(package.rglob("*.pyx")):
        for lineno, line in enumerate(path.read_text(encoding="utf-8").splitlines(), 1):
            if pattern.search(line):
                found.append(f"{path.relative_to(package)}:{lineno}")
    assert not found, "raises of built-in exceptions:\n" + "\n".join(found)
