"""Benchmarks of ours against a peer in alternating rounds.

A shared machine's speed drifts for seconds at a time (another tenant takes a core); timing
all of ours and then all of the peer's rounds lets one side meet a slow stretch the other
misses. Here each of our rounds follows one timed call of the peer, so both are measured over
the same moments.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import Any

#: Idle time between the two sides' calls: thread pools keep spinning for a while after their
#: work (ONNX Runtime's intra-op threads by default), and the side called next would find a
#: core taken (measured: yolov3-tiny 23 -> 46 ms right after ONNX Runtime). Longer idles are
#: not neutral either: a pass after an idle stretch finds less of its data in the shared cache
#: (and, before the pool moved a helper woken onto its caller's CPU, ran at one core's speed
#: in about half the passes), so the pause is just long enough for the spinning to end.
SETTLE_SECONDS = 0.05

#: Beside other work a spinning pool gets half a core and spins longer in wall time (ONNX
#: Runtime's about 60 ms after a yolov3-tiny pass beside two busy loops, against 40 ms on a
#: quiet machine), so after SETTLE_SECONDS the pause goes on in steps of SETTLE_STEP_SECONDS
#: while this process still used more than SETTLE_CPU_SECONDS of CPU in a step, for at most
#: SETTLE_MAX_SECONDS.
SETTLE_STEP_SECONDS = 0.01
SETTLE_CPU_SECONDS = 0.001
SETTLE_MAX_SECONDS = 0.5


def settle() -> None:
    """Sleeps until this process's threads have stopped spinning after a call: at least
    SETTLE_SECONDS, then while a step of SETTLE_STEP_SECONDS still saw the process's CPU time
    grow by more than SETTLE_CPU_SECONDS (at most SETTLE_MAX_SECONDS in all)."""
    start = time.perf_counter()
    time.sleep(SETTLE_SECONDS)
    while time.perf_counter() - start < SETTLE_MAX_SECONDS:
        cpu = time.process_time()
        time.sleep(SETTLE_STEP_SECONDS)
        if time.process_time() - cpu <= SETTLE_CPU_SECONDS:
            return


def pedantic_alternating(benchmark: Any, ours: Callable[[], Any], peer: Callable[[], Any], *,
                         rounds: int, warmup_rounds: int = 2) -> None:
    """Benchmark ``ours`` (pytest-benchmark's statistics) with one call of ``peer`` timed
    before each of its rounds, warm-ups included; the peer's seconds of the measured rounds
    go to ``benchmark.extra_info["peer_seconds"]``, from which the benchmark summary
    (``conftest.py``) takes the peer's median."""
    peer_seconds: list[float] = []

    def timed_peer() -> None:
        settle()
        start = time.perf_counter()
        peer()
        peer_seconds.append(time.perf_counter() - start)
        settle()

    benchmark.pedantic(ours, setup=timed_peer, rounds=rounds, warmup_rounds=warmup_rounds)
    benchmark.extra_info["peer_seconds"] = peer_seconds[warmup_rounds:]
