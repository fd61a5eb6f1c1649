"""Darknet's learning rate at an iteration: ``get_current_rate`` (darknet_network.cpp).

The value is computed with the C types Darknet's expression has, so it is the float32
Darknet hands ``update_network``, to the bit. Darknet's ``[net]`` values are C floats and
ints; the C++ overloads of ``pow``/``exp`` make some terms float and some double:

- burn-in, any policy, while ``b < burn_in``: ``lr * powf(b / burn_in, power)`` (float);
- constant: ``lr``;
- step: ``lr * pow(scale, b / step)``, integer division (double);
- steps: ``lr`` times ``scales[i]`` for every ``steps[i] <= b``, in order (float);
- exp: ``lr * pow(gamma, b)`` (double);
- poly: ``lr * powf(1 - b / max_batches, power)`` (float);
- sigmoid: ``lr * (1 / (1 + expf(gamma * (b - step))))`` (expf in float, the rest double);
- sgdr: ``lr_min + 0.5 * (lr - lr_min) * (1 + cos(pi * (b - s) / c))`` (double, but
  ``lr - lr_min`` in float), within cycles of ``c = sgdr_cycle * sgdr_mult**k``
  iterations starting at ``s``;
- random: ``lr * powf(u, power)``, u uniform in [0, 1) (float);

where b is the iteration, Darknet's ``batch_num = seen / (batch * subdivisions)``.
"double" terms are rounded to float32 once, at the end, as Darknet's ``return`` does.
``powf`` and ``expf`` are taken as the float32 rounding of the double result: glibc's
float functions agree with it except in rare near-ties, and the whole of the reference
table (every policy, iterations 0..50) matches bit for bit.

The iteration is the batch_num ``update_network`` sees: Darknet increments ``seen`` before
it calls ``get_current_rate``, so the k-th update (k = 1, 2, ...) uses ``iteration=k``.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Mapping
from typing import Any

import numpy as np

from darknet_metal.arguments import is_integer
from darknet_metal.errors import ArgumentError, ArgumentTypeError
from darknet_metal.model.cfg_schema import POLICIES

__all__ = ["learning_rate", "slow_start"]

_F32 = np.float32
_INT32_MAX = 2**31 - 1


def learning_rate(
    net_values: Mapping[str, Any], iteration: int, rng: np.random.Generator | None = None
) -> float:
    """Darknet's learning rate for update number ``iteration`` (0, 1, ...).

    ``net_values``: the ``[net]`` values as ``darknet_metal.model.cfg`` parses them
    (``NetConfig.net.values``): ``policy``, ``learning_rate``, ``burn_in``, ``power`` and
    the keys of the policy (``step``/``scale``, ``steps``/``scales``, ``gamma``,
    ``max_batches``, ``learning_rate_min``/``sgdr_cycle``/``sgdr_mult``). ``rng``: the
    generator ``policy=random`` draws from (None: a fresh one, seeded by the OS as
    Darknet's is).

    Returns a Python float holding the float32 rate. Like Darknet it may be inf or NaN
    (``poly`` past ``max_batches`` with a non-integer power, or ``max_batches=0``). Raises
    ArgumentTypeError for a value of the wrong type, and ArgumentError for a missing key, an
    iteration outside a C int's 0..2**31-1, and ``sgdr`` with ``sgdr_cycle`` or
    ``sgdr_mult`` below 1 (Darknet loops forever there).
    """
    b = _iteration(iteration)
    policy = _get(net_values, "policy")
    if policy not in POLICIES:
        raise ArgumentError(
            f"net_values['policy'] must be one of {', '.join(POLICIES)}, not {policy!r}"
        )
    lr = _float(net_values, "learning_rate")
    burn_in = _int(net_values, "burn_in")
    power = _float(net_values, "power")
    with np.errstate(all="ignore"):
        if b < burn_in:
            return float(lr * _powf(_F32(b) / _F32(burn_in), power))
        return float(_RULES[policy](net_values, b, lr, power, rng))


# --- one rule per policy: (values, b, lr, power, rng) -> float32 ------------------------------


def _constant(v: Mapping[str, Any], b: int, lr: np.float32, power: np.float32, rng: Any) -> Any:
    return lr


def _step(v: Mapping[str, Any], b: int, lr: np.float32, power: np.float32, rng: Any) -> Any:
    step = _int(v, "step")
    if step < 1:
        raise ArgumentError(f"net_values['step'] must be >= 1 with policy=step, not {step}")
    return _F32(float(lr) * math.pow(float(_float(v, "scale")), b // step))


def _steps(v: Mapping[str, Any], b: int, lr: np.float32, power: np.float32, rng: Any) -> Any:
    steps, scales = _list(v, "steps"), _list(v, "scales")
    if len(scales) != len(steps):
        raise ArgumentError(
            f"net_values['scales'] has {len(scales)} entries but 'steps' has {len(steps)}"
        )
    rate = lr
    for at, scale in zip(steps, scales, strict=True):
        if at > b:
            break
        rate = rate * _F32(scale)
    return rate


def _exp(v: Mapping[str, Any], b: int, lr: np.float32, power: np.float32, rng: Any) -> Any:
    return _F32(float(lr) * _pow64(float(_float(v, "gamma")), b))


def _poly(v: Mapping[str, Any], b: int, lr: np.float32, power: np.float32, rng: Any) -> Any:
    done = _F32(b) / _F32(_int(v, "max_batches"))
    return lr * _powf(_F32(1) - done, power)


def _sigmoid(v: Mapping[str, Any], b: int, lr: np.float32, power: np.float32, rng: Any) -> Any:
    # gamma * (int difference) is a float product; 1. / (1. + e) is double.
    e = _expf(_float(v, "gamma") * _F32(b - _int(v, "step")))
    return _F32(float(lr) * (1.0 / (1.0 + float(e))))


def _sgdr(v: Mapping[str, Any], b: int, lr: np.float32, power: np.float32, rng: Any) -> Any:
    cycle, mult = _int(v, "sgdr_cycle"), _int(v, "sgdr_mult")
    if cycle < 1 or mult < 1:
        raise ArgumentError(
            f"policy=sgdr needs sgdr_cycle >= 1 and sgdr_mult >= 1 (Darknet never finds the "
            f"cycle otherwise), got sgdr_cycle={cycle} sgdr_mult={mult}"
        )
    start, cycle = _sgdr_cycle(b, cycle, mult)
    low = _float(v, "learning_rate_min")
    span = float(lr - low)
    angle = float(_F32(b - start)) * math.pi / cycle
    return _F32(float(low) + 0.5 * span * (1.0 + math.cos(angle)))


def _sgdr_cycle(b: int, cycle: int, mult: int) -> tuple[int, int]:
    """(first iteration, length) of the sgdr cycle iteration ``b`` lies in: each cycle is
    ``mult`` times the previous, and a cycle's last iteration ``start + length`` still
    belongs to it (Darknet's ``start + size < b`` test)."""
    if mult == 1:
        return max(0, -(-b // cycle) - 1) * cycle, cycle
    start = 0
    while start + cycle < b:
        start += cycle
        cycle *= mult
    return start, cycle


def _random(v: Mapping[str, Any], b: int, lr: np.float32, power: np.float32, rng: Any) -> Any:
    if rng is None:
        rng = np.random.default_rng()
    if not isinstance(rng, np.random.Generator):
        raise ArgumentTypeError(
            f"rng must be a numpy.random.Generator or None, not {type(rng).__name__}"
        )
    return lr * _powf(rng.random(dtype=np.float32), power)


_RULES: dict[str, Callable[..., Any]] = {
    "constant": _constant,
    "step": _step,
    "steps": _steps,
    "exp": _exp,
    "poly": _poly,
    "sigmoid": _sigmoid,
    "sgdr": _sgdr,
    "random": _random,
}


# --- C float arithmetic ------------------------------------------------------------------------


def _pow64(x: float, y: float) -> float:
    """C's double ``pow`` (inf and NaN instead of Python's exceptions)."""
    return float(np.power(np.float64(x), np.float64(y)))


def _powf(x: Any, y: Any) -> np.float32:
    return _F32(_pow64(float(x), float(y)))


def _expf(x: Any) -> np.float32:
    return _F32(np.exp(np.float64(x)))


# --- reading the [net] values ------------------------------------------------------------------


def _iteration(value: Any) -> int:
    if not is_integer(value):
        raise ArgumentTypeError(
            f"iteration must be an int, not {value!r} ({type(value).__name__})"
        )
    if not 0 <= value <= _INT32_MAX:
        raise ArgumentError(f"iteration must be in [0, {_INT32_MAX}] (a C int), not {value}")
    return int(value)


def _get(values: Mapping[str, Any], key: str) -> Any:
    if not isinstance(values, Mapping):
        raise ArgumentTypeError(
            f"net_values must be a mapping of [net] values, not {type(values).__name__}"
        )
    if key not in values:
        raise ArgumentError(f"net_values has no {key!r}: pass the parsed [net] section's values")
    return values[key]


def _float(values: Mapping[str, Any], key: str) -> np.float32:
    """A [net] float as Darknet holds it: a C float."""
    value = _get(values, key)
    if isinstance(value, bool) or not isinstance(value, int | float | np.integer | np.floating):
        raise ArgumentTypeError(f"net_values[{key!r}] must be a number, not {value!r}")
    return _F32(value)


def _int(values: Mapping[str, Any], key: str) -> int:
    value = _get(values, key)
    if not is_integer(value):
        raise ArgumentTypeError(f"net_values[{key!r}] must be an int, not {value!r}")
    return int(value)


def _list(values: Mapping[str, Any], key: str) -> list[Any]:
    value = _get(values, key)
    if isinstance(value, str | bytes) or not hasattr(value, "__len__"):
        raise ArgumentTypeError(f"net_values[{key!r}] must be a list, not {value!r}")
    return list(value)


#: Most learning rates ``slow_start`` evaluates (a long run is sampled evenly).
_SLOW_START_SAMPLES = 4000


def slow_start(net_values: Mapping[str, Any], first: int, last: int, *,
               floor: float = 0.1, share: float = 0.5) -> str | None:
    """What to say when the learning rate of updates ``first``..``last`` (iterations, as
    ``learning_rate`` counts them) stays below ``floor`` x the cfg's ``learning_rate`` for
    more than ``share`` of them (a burn-in as long as the run: it learns next to nothing),
    else None. ``policy=random`` draws its rates and is never judged."""
    if last < first or _get(net_values, "policy") == "random":
        return None
    lr = float(_float(net_values, "learning_rate"))
    if not lr > 0:
        return None
    count = last - first + 1
    picks = np.unique(np.linspace(first, last, min(count, _SLOW_START_SAMPLES)).astype(int))
    low = [b for b in picks if learning_rate(net_values, int(b)) < floor * lr]
    if len(low) <= share * len(picks):
        return None
    slow = round(count * len(low) / len(picks))
    burn_in = _int(net_values, "burn_in")
    said = (f"the learning rate stays below {floor:g} x learning_rate={lr:g} for {slow} of "
            f"the {count} iterations {first}..{last}")
    if 2 * sum(b < burn_in for b in low) > len(low):
        return (f"{said} (burn_in={burn_in} warms it up as (iteration/{burn_in})^"
                f"{float(_float(net_values, 'power')):g}): the run will learn little; lower "
                "burn_in (--burn-in N with --model, or burn_in= in the cfg) or raise "
                "max_batches")
    policy = _get(net_values, "policy")
    keys = {"steps": ("steps", "scales"), "step": ("step", "scale"), "exp": ("gamma",),
            "sigmoid": ("gamma", "step"), "poly": ("power",)}.get(policy, ())
    shown = ", ".join(f"{k}={_shown(net_values.get(k))}" for k in keys if k in net_values)
    return (f"{said} (policy={policy}{', ' + shown if shown else ''}): the run will learn "
            "little; check the policy's keys in the cfg or raise max_batches")


def _shown(value: Any) -> str:
    """A cfg value as a cfg writes it (a list comma-separated)."""
    if isinstance(value, (list, tuple)):
        return ",".join(f"{v:g}" if isinstance(v, float) else str(v) for v in value)
    return f"{value:g}" if isinstance(value, float) else str(value)
