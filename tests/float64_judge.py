"""How a device's training arrays are judged where its sums are not Darknet's.

The device's per-channel sums are trees, more exact than Darknet's serial float32 order,
which the CPU path keeps; on real sizes Darknet's own arrays are far from exact (cancelling
sums, values at an activation's kink). So a device array ``got`` is judged with the CPU path
in Darknet's order (``darknet``) and the CPU path run in float64 (``exact``):

(a) within ``bound`` of ``darknet`` (relative L2), or within twice Darknet's own distance from
    ``exact``; and
(b) no further from ``exact`` than 2.5 times Darknet's distance, plus ``bound``.

Arrays that pass (a) only by its second term are listed in the test report, with both
distances (``REPORT``, printed by tests/conftest.py at the end of the run).
"""

from __future__ import annotations

import numpy as np

#: (label, device's distance from Darknet's array, Darknet's from float64, device's from
#: float64) of every array judged by (a)'s second term.
REPORT: list[tuple[str, float, float, float]] = []


def rel(got: np.ndarray, want: np.ndarray) -> float:
    """Relative L2 distance, in float64."""
    got, want = np.asarray(got, np.float64), np.asarray(want, np.float64)
    return float(np.linalg.norm(got - want) / max(np.linalg.norm(want), 1e-30))


def judge(label: str, got: np.ndarray, darknet: np.ndarray, exact: np.ndarray,
          bound: float) -> str | None:
    """None when ``got`` passes (a) and (b); else why it fails."""
    to_darknet, darknet_error, to_exact = rel(got, darknet), rel(darknet, exact), rel(got, exact)
    if to_exact > 2.5 * darknet_error + bound:
        return (f"{label}: {to_exact:.3g} from float64, more than 2.5 x Darknet's "
                f"{darknet_error:.3g} + {bound:g}")
    if to_darknet <= bound:
        return None
    if to_darknet <= 2.0 * darknet_error:
        REPORT.append((label, to_darknet, darknet_error, to_exact))
        return None
    return (f"{label}: {to_darknet:.3g} from Darknet's array, more than {bound:g} and than "
            f"2 x Darknet's distance from float64 ({darknet_error:.3g})")
