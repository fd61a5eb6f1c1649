"""What every executor of network programs offers (``CpuBackend``, ``GpuBackend``)."""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any, Protocol

import numpy as np

from darknet_metal.params import Params


class Backend(Protocol):
    """Runs a network's layers on one device.

    ``name``: the device ("cpu", "metal", "emu"); ``dtype``: the compute dtype. One backend
    serves one caller at a time: its buffers are reused from pass to pass.
    """

    name: str
    dtype: np.dtype

    def load_params(self, params: dict[int, Params]) -> None:
        """(Re)build the backend's copies of the parameters from the master copies."""

    def forward(
        self,
        x: np.ndarray,
        timings: list[float] | None = None,
        outputs: Sequence[int] | None = None,
    ) -> list[Any]:
        """Run every layer on ``x`` (N, C, H, W); per layer its output (an array-like valid
        until the next pass) if it is in ``outputs`` (None: all), else None. With
        ``timings``, each layer's wall time in seconds is appended."""

    def resize(self, specs: list[Any], params: dict[int, Params]) -> None:
        """Take ``specs``, the same network's layers at another input size, keeping what
        does not depend on the size (``params``: the master copies)."""

    def close(self) -> None:
        """Release what the backend holds (it may not be used afterwards)."""


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
