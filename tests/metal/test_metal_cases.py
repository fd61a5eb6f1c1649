"""Every kernel case of ``darknet_metal.diagnostics.kernel_cases`` (what ``darknet-metal
doctor`` runs on a user's device) on the emulator under forward, reverse and random thread
order: within its tolerance of the CPU reference in each, and bit for bit the same in all
three. And the case table itself: every registry kernel checked, every step one the registry
accepts, every check able to fail."""

from __future__ import annotations

import numpy as np
import pytest
from metal_harness import ORDERS

from darknet_metal.diagnostics.kernel_cases import CASES, case
from darknet_metal.diagnostics.kernel_parity import (
    CaseData,
    Check,
    Exact,
    KernelCase,
    Step,
    judge,
    run_case,
)
from darknet_metal.errors import ArgumentError, BindingError
from darknet_metal.metal import registry

#: Registry kernels no case dispatches, each with the test that checks it instead.
CHECKED_ELSEWHERE: dict[str, str] = {}


def _agrees_in_every_order(device, kernel_case: KernelCase) -> None:
    """Within its tolerance in each order of ORDERS, and the same bits in all of them."""
    data = kernel_case.build()
    results = []
    for order in ORDERS:
        device.set_thread_order(order, seed=7)
        result = run_case(device, kernel_case, data)
        assert result.ok, (order, result.failures)
        results.append(result)
    first = results[0].outputs
    for order, result in zip(ORDERS[1:], results[1:], strict=True):
        for name, got in result.outputs.items():
            assert got.tobytes() == first[name].tobytes(), (order, name)


@pytest.mark.parametrize("kernel_case", CASES, ids=[c.name for c in CASES])
def test_case_matches_the_reference_in_every_thread_order(emu_device, kernel_case):
    _agrees_in_every_order(emu_device, kernel_case)


@pytest.mark.parametrize("kernel_case", CASES, ids=[c.name for c in CASES])
def test_case_matches_the_reference_on_cuda_in_every_group_order(cuda_device, kernel_case):
    """The same case on an NVIDIA GPU (real warps, shared memory and barriers): the order is
    that of the threadgroups there (no result may depend on which group runs first)."""
    _agrees_in_every_order(cuda_device, kernel_case)


def test_every_registry_kernel_is_checked():
    covered = {k for c in CASES for k in c.kernels}
    assert set(registry.KERNELS) - covered == set(CHECKED_ELSEWHERE)
    assert set(CHECKED_ELSEWHERE) <= set(registry.KERNELS)


def test_case_names_are_unique_test_ids():
    names = [c.name for c in CASES]
    assert len(set(names)) == len(names)
    assert all(n.isascii() and " " not in n and "[" not in n for n in names)
    assert case(names[0]) is CASES[0]
    with pytest.raises(KeyError, match="unknown kernel case"):
        case("nope")


def test_a_step_the_registry_does_not_accept_fails_where_it_is_declared():
    with pytest.raises(KeyError, match="unknown Metal kernel 'nope_fwd_f32'"):
        Step("nope_fwd_f32", {}, {})
    with pytest.raises(ArgumentError, match="the kernel's roles are"):
        Step("sam_fwd_f32", {"n": 3}, {"n": 3}, {"x_from": "a", "x": "b"})
    with pytest.raises(ArgumentError, match="the kernel's roles are"):
        Step("sam_fwd_f32", {"n": 3}, {"n": 3}, offsets={"z": 1})
    with pytest.raises(ArgumentError, match="missing fields"):
        Step("sam_fwd_f32", {}, {"n": 3})
    with pytest.raises(ArgumentError, match="grid axes"):
        Step("sam_fwd_f32", {"n": 3}, {"m": 3})
    assert Step("sam_fwd_f32", {"n": 3}, {"n": 3}).buffers == {"x_from": "x_from", "x": "x",
                                                                "y": "y"}


def _sam(arrays: dict[str, np.ndarray], checks: tuple[Check, ...] = ()) -> KernelCase:
    return KernelCase("sam_fwd_f32-planted", (Step("sam_fwd_f32", {"n": 5}, {"n": 5}),),
                      lambda rng: CaseData(arrays, checks))


def test_an_array_that_does_not_fit_its_role_is_refused(emu_device):
    floats = np.ones(5, np.float32)
    with pytest.raises(BindingError, match="holds float32 elements, not int32"):
        run_case(emu_device, _sam({"x_from": floats, "x": np.ones(5, np.int32), "y": floats}))
    with pytest.raises(BindingError, match="role 'y' holds 16 bytes"):
        run_case(emu_device, _sam({"x_from": floats, "x": floats, "y": floats[:4]}))
    with pytest.raises(ArgumentError, match="not one of the case's arrays"):
        run_case(emu_device, _sam({"x_from": floats, "y": floats}))
    with pytest.raises(ArgumentError, match="bit equality needs one type"):
        run_case(emu_device, _sam({"x_from": floats, "x": floats, "y": floats},
                                  (Check("y", np.ones(5), Exact()),)))


def test_an_element_the_kernel_leaves_unwritten_fails(emu_device):
    # sam_fwd_f32 over 5 of 6 elements: the sixth keeps its NaN.
    x = np.ones(6, np.float32)
    y = np.full(6, np.nan, np.float32)
    result = run_case(emu_device, _sam({"x_from": x, "x": x, "y": y},
                                       (Check("y", np.full(6, 0.5, np.float32), Exact()),)))
    assert not result.ok and result.failures[0].startswith("y: Exact() does not hold")


def test_every_check_detects_a_changed_element(emu_device):
    """Each check of every case fails once one element of its reference moves by 1% (at
    least 0.01): no tolerance is so loose that it holds whatever the kernel returns."""
    emu_device.set_thread_order("forward")
    lax = []
    for kernel_case in CASES:
        data = kernel_case.build()
        outputs = run_case(emu_device, kernel_case, data).outputs
        for check in data.checks:
            want = np.array(check.want, copy=True)
            flat = want.reshape(-1)
            if flat.size == 0:
                continue
            i = flat.size // 2
            if np.issubdtype(want.dtype, np.integer):
                flat[i] ^= 1
            else:
                v = float(flat[i])
                flat[i] = v + max(abs(v), 1.0) * 0.01 if abs(v) < 1e30 else 0.0
            moved = Check(check.array, want, check.tolerance, check.where)
            if judge(kernel_case.name, (moved,), outputs).ok:
                lax.append((kernel_case.name, check.array, repr(check.tolerance)))
    assert lax == []
