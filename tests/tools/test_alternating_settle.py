"""The benchmarks' pause between the two sides' calls (``alternating.settle``) lasts until the
process's threads stop spinning, however long that takes, within its cap."""

import threading
import time

import alternating


def _spin(seconds: float, ended: list[float]) -> None:
    stop = time.perf_counter() + seconds
    while time.perf_counter() < stop:
        pass
    ended.append(time.perf_counter())


def test_settle_waits_for_a_spinning_thread_to_stop():
    ended: list[float] = []
    spinner = threading.Thread(target=_spin, args=(0.25, ended))
    spinner.start()
    settle_start = time.perf_counter()
    alternating.settle()
    settled = time.perf_counter()
    spinner.join()
    # The spinner ran past SETTLE_SECONDS; settle must not return before it stopped.
    assert ended and ended[0] <= settled
    assert settled - settle_start < alternating.SETTLE_MAX_SECONDS + 0.1


def test_settle_on_an_idle_process_is_the_fixed_pause():
    start = time.perf_counter()
    alternating.settle()
    elapsed = time.perf_counter() - start
    assert alternating.SETTLE_SECONDS <= elapsed < alternating.SETTLE_MAX_SECONDS


def test_settle_gives_up_at_its_cap():
    ended: list[float] = []
    spinner = threading.Thread(target=_spin, args=(alternating.SETTLE_MAX_SECONDS + 0.4, ended))
    spinner.start()
    start = time.perf_counter()
    alternating.settle()
    elapsed = time.perf_counter() - start
    spinner.join()
    assert alternating.SETTLE_MAX_SECONDS <= elapsed < alternating.SETTLE_MAX_SECONDS + 0.2
