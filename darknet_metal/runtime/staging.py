"""Mini-batch passes staged on the host: the executors' common way of running a training
iteration's passes when a device cannot stage them itself."""

from __future__ import annotations

from collections.abc import Callable, Sequence

import numpy as np

__all__ = ["run_staged_passes"]


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
