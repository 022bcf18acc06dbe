"""spawn's progress deadline (``stall_s``, issue 33 item 6): a job whose ranks all wait fails as a
hang; a job that computes, however long a loaded machine makes it, does not. The test harness
(tests/conftest.py) bounds every multi-process test this way instead of by a wall-clock deadline."""

from __future__ import annotations

import os
import time

import pytest

from flashsgd.launch import WorkerError, cpu_seconds, spawn


def _sleep(seconds: float) -> str:
    time.sleep(seconds)
    return "slept"


def _compute(seconds: float) -> str:
    end = time.process_time() + seconds  # CPU time: on a loaded machine this takes longer in wall time
    while time.process_time() < end:
        sum(range(1000))
    return "computed"


def test_ranks_that_all_wait_fail_as_a_hang_within_the_stall_deadline():
    t0 = time.monotonic()
    with pytest.raises(WorkerError, match=r"no rank used the CPU for 1.5 s: every rank was waiting"):
        spawn(_sleep, 2, (600.0,), stall_s=1.5, deadline_s=300, start_method="fork")
    assert time.monotonic() - t0 < 60  # not the 600 s the ranks would sleep


def test_ranks_that_compute_longer_than_the_stall_deadline_are_not_a_hang():
    assert spawn(_compute, 2, (3.0,), stall_s=1.5, deadline_s=300, start_method="fork") == ["computed"] * 2


def _starved_compute(seconds: float) -> str:
    os.sched_setaffinity(0, {0})  # on the hog's core, at the lowest priority: runnable, rarely running
    os.nice(19)
    return _compute(seconds)


def _hog(stop) -> None:
    os.sched_setaffinity(0, {0})
    while not stop.is_set():
        sum(range(1000))


@pytest.mark.skipif(not hasattr(os, "sched_setaffinity"), reason="needs Linux CPU affinity")
def test_ranks_starved_of_cpu_are_not_a_hang():
    """A loaded machine (a clean-clone test run on 2 busy cores failed this way): ranks that have
    work but wait for a core use almost no CPU for seconds. Here two ranks at nice 19 share one core
    with a busy loop at nice 0 (about 1.5% of the core each): runnable, so not a hang."""
    import multiprocessing as mp

    ctx = mp.get_context("fork")
    stop = ctx.Event()
    hog = ctx.Process(target=_hog, args=(stop,), daemon=True)
    hog.start()
    try:
        assert spawn(_starved_compute, 2, (0.02,), stall_s=1.5, deadline_s=300, start_method="fork") \
            == ["computed"] * 2
    finally:
        stop.set()
        hog.join(10)
        if hog.is_alive():
            hog.kill()


def test_cpu_seconds_reads_the_processes_own_clocks():
    import multiprocessing as mp

    p = mp.get_context("fork").Process(target=_compute, args=(0.5,))
    p.start()
    p.join()
    assert cpu_seconds([]) == 0.0
    assert cpu_seconds([p]) == 0.0  # exited and reaped: no longer counted

    class Me:
        pid = __import__("os").getpid()

    assert cpu_seconds([Me()]) >= time.process_time() - 1.0  # this process's own CPU time, roughly
    with pytest.raises(ValueError, match="stall_s must be None or a finite number > 0"):
        spawn(_sleep, 1, (0.0,), stall_s=0)
