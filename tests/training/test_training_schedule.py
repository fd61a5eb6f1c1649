"""``darknet_metal.training.learning_rate`` against Darknet's ``get_current_rate``.

References: ``lr_schedule.json`` of the Darknet V5 training data (../shared/golden/
darknet-v5-train): Darknet's own float32 rate for nine ``[net]`` settings (every policy but
random) at iterations 0..50, compared bit for bit; the rate each update of the training
cases used; float64 formulas of the policies (close, not exact); the cfg parser's checks.
"""

from __future__ import annotations

import json
import math

import numpy as np
import pytest
from training_golden import CASES, TRAIN, cfg_net_values, net_values

from darknet_metal.errors import ArgumentError, ArgumentTypeError, CfgError
from darknet_metal.model.cfg_schema import POLICIES
from darknet_metal.trainer import learning_rate
from darknet_metal.trainer.schedule import slow_start

with open(TRAIN / "lr_schedule.json") as _f:
    SCHEDULES = json.load(_f)["schedules"]


def _bits(x) -> str:
    return f"0x{int(np.float32(x).view(np.uint32)):08x}"


BASE = "[net]\nwidth=32\nheight=32\nchannels=3\nlearning_rate=0.001\nmax_batches=50\n"


# ---------------------------------------------------------------------------------------
# Darknet's own values


@pytest.mark.parametrize("name", sorted(SCHEDULES))
def test_every_tabulated_rate_is_bit_exact(name):
    entry = SCHEDULES[name]
    values = net_values(entry["net_section"])
    assert values["policy"] == entry["net"]["policy"]
    got = [_bits(learning_rate(values, b)) for b in range(len(entry["rate_hex"]))]
    wrong = [(b, g, w) for b, (g, w) in enumerate(zip(got, entry["rate_hex"], strict=True))
             if g != w]
    assert not wrong, f"{name}: (iteration, got, Darknet) {wrong}"


def test_the_table_covers_every_deterministic_policy():
    assert {e["net"]["policy"] for e in SCHEDULES.values()} == set(POLICIES) - {"random"}
    assert all(len(e["rate_hex"]) == 51 for e in SCHEDULES.values())


@pytest.mark.parametrize("case", CASES)
def test_training_cases_updated_with_the_rate_of_their_cfg(case):
    index = json.loads((TRAIN / case / "index.json").read_text())
    values = cfg_net_values(TRAIN / case / index["cfg"])
    for step in index["steps"]:
        # The k-th update runs after seen was incremented: batch_num = k.
        assert _bits(learning_rate(values, step["step"])) == step["rate_hex"], step["step"]


# ---------------------------------------------------------------------------------------
# the formulas beyond the table


def _close(a, b):
    assert math.isclose(a, b, rel_tol=3e-7, abs_tol=1e-30), (a, b)


@pytest.mark.parametrize("burn_in,power", [(7, 4.0), (13, 1.5), (3, 0.5)])
def test_burn_in_ramps_up_under_every_policy(burn_in, power):
    for policy, extra in [("constant", ""), ("poly", ""), ("exp", "gamma=0.9\n"),
                          ("steps", "steps=1,2\nscales=.1,.1\n")]:
        values = net_values(BASE + f"policy={policy}\nburn_in={burn_in}\npower={power}\n" + extra)
        for b in range(burn_in):
            _close(learning_rate(values, b), 0.001 * (b / burn_in) ** power)
    assert learning_rate(net_values(BASE + f"burn_in={burn_in}\n"), burn_in) == np.float32(0.001)


def test_step_policy_divides_iterations_as_integers():
    values = net_values(BASE + "policy=step\nstep=7\nscale=0.5\n")
    for b in range(60):
        _close(learning_rate(values, b), 0.001 * 0.5 ** (b // 7))


def test_steps_policy_multiplies_the_scales_of_the_steps_reached():
    values = net_values(BASE + "policy=steps\nsteps=3,5,5,9\nscales=.1,10,.5,3\n")
    want = {0: 1, 2: 1, 3: .1, 4: .1, 5: .5, 8: .5, 9: 1.5, 100: 1.5}
    for b, factor in want.items():
        _close(learning_rate(values, b), 0.001 * factor)


def test_exp_poly_and_sigmoid_policies():
    # Darknet's gamma, and its product with the iteration, are C floats.
    g97, g3 = float(np.float32(0.97)), float(np.float32(0.3))
    for b in range(0, 120, 7):
        _close(learning_rate(net_values(BASE + "policy=exp\ngamma=0.97\n"), b), 0.001 * g97**b)
        _close(learning_rate(net_values(BASE + "policy=sigmoid\ngamma=0.3\nstep=40\n"), b),
               0.001 / (1 + math.exp(np.float32(g3) * np.float32(b - 40))))
    poly = net_values(BASE + "policy=poly\npower=2.5\n")
    for b in range(51):
        left = float(np.float32(1) - np.float32(b) / np.float32(50))  # float, as in Darknet
        _close(learning_rate(poly, b), 0.001 * left**2.5)
    # Past max_batches a non-integer power of a negative base is NaN in C too.
    assert math.isnan(learning_rate(poly, 51))
    assert learning_rate(net_values(BASE + "policy=poly\npower=2\n"), 60) > 0


def _sgdr_reference(b, cycle, mult, lr=0.001, low=1e-5):
    start = 0
    while start + cycle < b:
        start, cycle = start + cycle, cycle * mult
    return low + 0.5 * (lr - low) * (1 + math.cos(math.pi * (b - start) / cycle))


@pytest.mark.parametrize("cycle,mult", [(8, 2), (5, 1), (3, 3), (1, 1)])
def test_sgdr_restarts_after_each_growing_cycle(cycle, mult):
    values = net_values(BASE + f"policy=sgdr\nsgdr_cycle={cycle}\nsgdr_mult={mult}\n")
    for b in range(200):
        _close(learning_rate(values, b), _sgdr_reference(b, cycle, mult))
    # A cycle ends at learning_rate_min and the next one starts again at learning_rate.
    assert learning_rate(values, cycle) == np.float32(1e-5)
    _close(learning_rate(values, 0), 0.001)


def test_sgdr_with_constant_cycles_at_the_last_iteration():
    # Darknet walks the cycles one by one; here that would be 400 million of them.
    b = 2**31 - 1
    start = (b - 1) // 5 * 5
    values = net_values(BASE + "policy=sgdr\nsgdr_cycle=5\nsgdr_mult=1\n")
    _close(learning_rate(values, b),
           1e-5 + 0.5 * (0.001 - 1e-5) * (1 + math.cos(math.pi * float(np.float32(b - start)) / 5)))


def test_sgdr_cycle_defaults_to_max_batches():
    values = net_values(BASE + "policy=sgdr\n")
    assert values["sgdr_cycle"] == 50 and values["sgdr_mult"] == 2
    assert learning_rate(values, 50) == np.float32(1e-5)


def test_random_policy_draws_from_the_generator():
    values = net_values(BASE + "policy=random\npower=2\n")
    got = [learning_rate(values, b, np.random.default_rng(5)) for b in range(3)]
    u = np.random.default_rng(5).random(dtype=np.float32)
    assert got == [float(np.float32(0.001) * np.float32(float(u) ** 2))] * 3
    draws = [learning_rate(values, 10, np.random.default_rng(s)) for s in range(50)]
    assert all(0 <= r < 0.001 for r in draws) and len(set(draws)) == 50
    assert 0 <= learning_rate(values, 1) < 0.001
    burn = net_values(BASE + "policy=random\nburn_in=4\n")
    assert learning_rate(burn, 2, np.random.default_rng(1)) == float(np.float32(0.001 / 16))


@pytest.mark.parametrize("policy", POLICIES)
def test_the_parsed_defaults_hold_every_key_of_each_policy(policy):
    extra = "steps=10\nscales=.1\n" if policy == "steps" else ""
    values = net_values(BASE + f"policy={policy}\n" + extra)
    for b in (0, 1, 25, 49):
        rate = learning_rate(values, b, np.random.default_rng(0))
        assert isinstance(rate, float) and np.float32(rate) == rate


# ---------------------------------------------------------------------------------------
# errors


def test_the_parser_refuses_an_unknown_policy():
    with pytest.raises(CfgError, match="unknown policy 'cosine'") as info:
        net_values(BASE + "policy=cosine\n")
    assert info.value.key == "policy" and "sgdr" in str(info.value)


@pytest.mark.parametrize(
    "change, iteration, error, words",
    [
        ({}, -1, ArgumentError, ["iteration", "-1"]),
        ({}, 2**31, ArgumentError, ["iteration", str(2**31)]),
        ({}, 1.0, ArgumentTypeError, ["iteration", "1.0"]),
        ({}, True, ArgumentTypeError, ["iteration", "True"]),
        ({"policy": "cosine"}, 1, ArgumentError, ["policy", "cosine"]),
        ({"learning_rate": "0.1"}, 1, ArgumentTypeError, ["learning_rate", "0.1"]),
        ({"burn_in": 2.5}, 1, ArgumentTypeError, ["burn_in", "2.5"]),
        ({"policy": "sgdr", "sgdr_cycle": 0}, 1, ArgumentError, ["sgdr_cycle=0"]),
        ({"policy": "sgdr", "sgdr_mult": 0}, 1, ArgumentError, ["sgdr_mult=0"]),
        ({"policy": "step", "step": 0}, 1, ArgumentError, ["step", "0"]),
        ({"policy": "steps", "steps": [1, 2], "scales": [0.1]}, 1, ArgumentError,
         ["scales", "1 entries", "2"]),
        ({"policy": "random"}, 1, ArgumentTypeError, ["rng", "RandomState"]),
    ],
)
def test_bad_arguments_are_named(change, iteration, error, words):
    values = dict(net_values(BASE))
    values.update(change)
    rng = np.random.RandomState(0) if values["policy"] == "random" else None
    with pytest.raises(error) as info:
        learning_rate(values, iteration, rng)
    for word in words:
        assert word in str(info.value)


def test_missing_keys_and_non_mappings_are_named():
    values = dict(net_values(BASE + "policy=exp\n"))
    del values["gamma"]
    with pytest.raises(ArgumentError, match="'gamma'"):
        learning_rate(values, 3)
    with pytest.raises(ArgumentTypeError, match="net_values must be a mapping"):
        learning_rate([("policy", "constant")], 3)


_RECIPE = dict(policy="steps", learning_rate=0.001, burn_in=1000, power=4.0,
               steps=[4800, 5400], scales=[0.1, 0.1], max_batches=6000)


@pytest.mark.parametrize(("values", "first", "last", "blamed"), [
    (_RECIPE, 1, 6000, None),                        # Darknet's recipe: a sixth warming up
    (_RECIPE, 1, 40, "burn_in=1000 warms it up"),    # its burn-in on a 40-iteration run
    # (b/1000)^4 < 0.1 below b = 563: 562 of 1000 iterations are slow, 562 of 1200 are not
    # most of the run.
    (_RECIPE, 1, 1000, "562 of the 1000 iterations 1..1000 (burn_in=1000 warms it up"),
    (_RECIPE, 1, 1200, None),
    (dict(_RECIPE, burn_in=0, steps=[2, 3]), 1, 40, "policy=steps, steps=2,3, scales=0.1,0.1"),
    (dict(_RECIPE, policy="random"), 1, 40, None),   # drawn rates are not judged
    (dict(_RECIPE, learning_rate=0.0), 1, 40, None),
])
def test_slow_start_says_what_holds_the_rate_down(values, first, last, blamed):
    said = slow_start(values, first, last)
    if blamed is None:
        assert said is None
    else:
        assert said is not None and blamed in said, said
