"""A batch staged part by part (``runtime.staging.stage_in_parts``): every element copied
once, the parts flushed in order after the wait for the work still reading the array, each
flushed range exactly what was copied, and a NaN or an infinity in any part reported."""

import numpy as np
import pytest

from darknet_metal.runtime import staging


class _Recorder:
    """Stands in for a resident wrap: records the wait and each flushed byte range, and
    what the array held when each range was flushed."""

    def __init__(self, into: np.ndarray) -> None:
        self.into = into
        self.events: list[tuple] = []

    def sync(self) -> None:
        self.events.append(("sync",))

    def flush(self, offset: int, nbytes: int) -> None:
        flat = self.into.reshape(-1).view(np.uint8)
        self.events.append(("flush", offset, nbytes, flat[offset:offset + nbytes].copy()))


@pytest.mark.parametrize(("part_bytes", "n", "parts"), [
    (4096, 1000, 1),        # under one part: a single flush
    (4096, 4096, 4),        # four parts exactly
    (4096, 4097, 4),        # the last part a little shorter
    (4096, 1 << 16, 4),     # at most STAGE_PARTS parts, however large
])
def test_every_element_is_copied_once_and_flushed_in_order(monkeypatch, part_bytes, n, parts):
    monkeypatch.setattr(staging, "STAGE_PART_BYTES", part_bytes)
    x = np.random.default_rng(n).standard_normal((n,)).astype(np.float32)
    into = np.full(n, np.nan, np.float32)
    rec = _Recorder(into)
    assert staging.stage_in_parts(x.reshape(1, n), into.reshape(1, n), rec) is True
    assert into.tobytes() == x.tobytes()
    assert rec.events[0] == ("sync",)
    flushes = rec.events[1:]
    assert len(flushes) == parts
    at = 0
    for _, offset, nbytes, held in flushes:
        assert offset == at and nbytes > 0
        # What went up is the batch's bytes: the part was written before its flush.
        assert held.tobytes() == x.view(np.uint8)[offset:offset + nbytes].tobytes()
        at += nbytes
    assert at == x.nbytes


@pytest.mark.parametrize("bad", [np.nan, np.inf, -np.inf])
@pytest.mark.parametrize("where", [0, 2047, 4095])
def test_a_non_finite_value_in_any_part_is_reported(monkeypatch, bad, where):
    monkeypatch.setattr(staging, "STAGE_PART_BYTES", 4096)
    x = np.ones(4096, np.float32)
    x[where] = bad
    into = np.zeros_like(x)
    rec = _Recorder(into)
    assert staging.stage_in_parts(x, into, rec) is False
    # Every part is copied and flushed all the same: the device's copy is whole.
    assert into.tobytes() == x.tobytes()
    assert sum(e[2] for e in rec.events[1:]) == x.nbytes
