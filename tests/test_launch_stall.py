"""spawn's progress deadline (``stall_s``, issue 33 item 6): a job whose ranks all wait fails as a
hang; a job that computes, however long a loaded machine makes it, does not. The test harness
(tests/conftest.py) bounds every multi-process test this way instead of by a wall-clock deadline."""

from __future__ import annotations

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
