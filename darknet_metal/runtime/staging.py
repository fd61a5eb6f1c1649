"""Staging on the host: a training iteration's mini-batch passes when a device cannot stage
them itself, a batch copied where the device reads it part by part, and the check of a pass's
input."""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import numpy as np

from darknet_metal.cpu.fill import copy_finite
from darknet_metal.errors import ArgumentError

__all__ = ["STAGE_PARTS", "STAGE_PART_BYTES", "check_finite_input", "run_staged_passes",
           "stage_in_parts"]

#: A batch is staged in up to this many parts of at least STAGE_PART_BYTES, each sent to the
#: device as soon as it is written: on a device with memory of its own the copy engines take
#: one part while the host copies and checks the next.
STAGE_PARTS = 4
STAGE_PART_BYTES = 4 << 20


def run_staged_passes(run: Callable[[np.ndarray], None], images_per_pass: int, x: np.ndarray,
                      stage_in: Sequence[tuple[np.ndarray, np.ndarray]],
                      stage_out: Sequence[tuple[np.ndarray, np.ndarray]]) -> None:
    """``run`` once per mini-batch of ``images_per_pass`` images of ``x``, staging on the
    host: before pass s each ``(whole, per_pass)`` of ``stage_in`` copies rows
    [s*k, (s+1)*k) of ``whole`` into ``per_pass`` (k = its rows); after it each
    ``(per_pass, whole)`` of ``stage_out`` copies ``per_pass`` into ``whole[s]``."""
    m = images_per_pass
    for s in range(x.shape[0] // m):
        for whole, per_pass in stage_in:
            k = per_pass.shape[0]
            np.copyto(per_pass, whole[s * k:(s + 1) * k])
        run(x[s * m:(s + 1) * m])
        for per_pass, whole in stage_out:
            np.copyto(whole[s], per_pass)


def check_finite_input(x: np.ndarray) -> None:
    """ArgumentError naming how many values of a pass's input ``x`` are NaN or infinite and
    where the first is, if any are. A NaN or an infinity makes the sum non-finite; so may
    finite values whose sum overflows, and only then is each value looked at (the sum reads
    ``x`` once and allocates nothing)."""
    with np.errstate(over="ignore", invalid="ignore"):
        total = x.sum()
    if not np.isfinite(total) and not (finite := np.isfinite(x)).all():
        bad = np.argwhere(~finite)
        raise ArgumentError(
            f"x holds {len(bad)} NaN or infinite values (the first at index "
            f"{tuple(int(i) for i in bad[0])}); they would make every output they reach NaN")



def stage_in_parts(x: np.ndarray, into: np.ndarray, buffer: Any) -> bool:
    """Copies float32 ``x`` into ``into`` (as many elements, C-contiguous; ``buffer`` a
    resident wrap of it), checking it finite in the same read, in up to STAGE_PARTS parts,
    each flushed to the device once written. Waits first for the work still reading
    ``into``. Whether ``x`` is finite (every part is copied either way)."""
    buffer.sync()
    src, dst = x.reshape(-1), into.reshape(-1)
    parts = max(1, min(STAGE_PARTS, dst.nbytes // STAGE_PART_BYTES))
    per = -(-dst.size // parts)
    finite = True
    for at in range(0, dst.size, per):
        end = min(at + per, dst.size)
        finite = copy_finite(src[at:end], dst[at:end]) and finite
        buffer.flush(at * dst.itemsize, (end - at) * dst.itemsize)
    return finite
