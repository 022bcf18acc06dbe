"""flashsgd.launch: results, failure attribution, deadlines, signals and orphans.

Most tests call :func:`flashsgd.launch.spawn` directly, since spawn is what they test; each one
passes a ``deadline_s`` so that a regression fails the test instead of hanging it.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest
import torch
import torch.distributed as dist

from flashsgd import launch
from flashsgd.launch import Interrupted, WorkerError, spawn
from flashsgd.launch.failures import RankOutcome, attribute, describe_exception, shorten

REPO = Path(__file__).resolve().parents[1]
GUARD_S = 120.0  # whole-run deadline of every spawn here: a hang fails the test


def _sum_of_ranks(scale):
    t = torch.ones(4) * (dist.get_rank() + 1) * scale
    dist.all_reduce(t)
    return t.tolist()


def test_results_per_rank(run_ranks):
    world = 3
    out = run_ranks(_sum_of_ranks, world, 2.0)
    assert out == [[2.0 * world * (world + 1) / 2] * 4] * world
    assert launch.run(_sum_of_ranks, (1.0,), world_size=2, timeout_s=30, deadline_s=GUARD_S) == [3.0] * 4


def _large_tensor(n):
    return torch.arange(n, dtype=torch.float32) * (dist.get_rank() + 1)


def test_a_result_arrives_after_its_rank_has_exited(monkeypatch):
    """A rank returns a 4 MiB tensor and exits at once; the launcher reads only after every rank
    has exited (or 5 s). Sent as a file descriptor (torch's multiprocessing pickler), the result
    would need its sender alive: ``ConnectionResetError`` in the launcher (issue 53)."""
    collect = launch._Job.collect

    def late_collect(job, wait_s):
        if not job.reports:  # the first reading: wait until the ranks are gone
            end = time.monotonic() + 5.0
            while time.monotonic() < end and any(p.exitcode is None for p in job.procs):
                time.sleep(0.05)
        collect(job, wait_s)

    monkeypatch.setattr(launch._Job, "collect", late_collect)
    n = 1 << 20
    out = spawn(_large_tensor, 2, (n,), timeout_s=60, deadline_s=GUARD_S, start_method="fork")
    for rank, t in enumerate(out):
        assert torch.equal(t, torch.arange(n, dtype=torch.float32) * (rank + 1))


def _unpicklable():
    return lambda: None


def test_an_unpicklable_result_is_the_ranks_error():
    with pytest.raises(WorkerError, match=r"rank 0's result \(function\) cannot be sent to the launcher"):
        spawn(_unpicklable, 1, timeout_s=60, deadline_s=GUARD_S)


@pytest.mark.parametrize("kwargs, expected", [
    (dict(world_size=0), "world_size must be an integer >= 1, got 0"),
    (dict(timeout_s=float("nan")), "timeout_s must be a finite number > 0, got nan"),
    (dict(deadline_s=0), "deadline_s must be None or a finite number > 0, got 0"),
    (dict(start_method="forkserver"), "start_method must be None, 'fork' or 'spawn'"),
])
def test_bad_arguments_are_named(kwargs, expected):
    with pytest.raises(ValueError, match=expected.replace("(", r"\(").replace(")", r"\)")):
        spawn(_sum_of_ranks, **{"world_size": 2, "args": (1.0,), **kwargs})


def _fail(mode, bad_rank):
    """All-reduce in a loop; at iteration 3 ``bad_rank`` is killed, hangs or raises."""
    t = torch.ones(1000)
    for i in range(200):
        if i == 3 and dist.get_rank() == bad_rank:
            if mode == "kill":
                os.kill(os.getpid(), signal.SIGKILL)
            if mode == "hang":
                time.sleep(3600)
            if mode == "raise":
                raise ValueError("bad shard 7")
        dist.all_reduce(t)
    return "done"


def _failure(world, mode, bad_rank=1, timeout_s=30.0):
    with pytest.raises(WorkerError) as err:
        spawn(_fail, world, (mode, bad_rank), timeout_s=timeout_s, deadline_s=GUARD_S)
    return err.value


def test_killed_rank_is_named_first_and_its_peers_as_consequences():
    err = _failure(4, "kill")
    assert err.causes == (1,)
    assert str(err) == err.summary and len(err.summary.splitlines()) == 1
    assert err.summary.startswith("rank 1 exited with code -9 (SIGKILL); "), err.summary
    assert "then failed: " in err.summary and "Connection" in err.summary
    assert "--- rank 1 exited with code -9 (SIGKILL) without a result" in err.details
    assert err.details.count("Traceback (most recent call last)") >= 1


def test_hung_rank_is_blamed_not_the_peers_that_timed_out():
    err = _failure(3, "hang", timeout_s=2.0)
    assert err.causes == (1,)
    assert err.summary == "rank 1 stopped responding (ranks 0,2 timed out waiting; killed)"
    assert "--- rank 1 was still running and was killed" in err.details
    assert "Timed out waiting" in err.details


def test_raising_rank_is_named_with_its_error_and_traceback():
    err = _failure(3, "raise", bad_rank=2)
    assert err.causes == (2,)
    assert err.summary.startswith("rank 2 failed: ValueError: bad shard 7"), err.summary
    assert 'raise ValueError("bad shard 7")' in err.details


def _sleep(seconds):
    time.sleep(seconds)


def test_deadline_of_the_whole_run_is_separate_from_the_collective_timeout():
    with pytest.raises(WorkerError) as err:
        spawn(_sleep, 2, (60,), timeout_s=300, deadline_s=1)
    assert err.value.summary == \
        "the run passed its deadline (deadline_s=1); ranks 0,1 still running (killed)"
    assert spawn(_sleep, 2, (1.5,), timeout_s=1, deadline_s=GUARD_S) == [None, None]


class _PeerError(RuntimeError):
    """What flashsgd.comm raises when a wait runs out: it names the peer."""

    def __init__(self, peer):
        super().__init__(f"no data from peer rank {peer} within 10 s")
        self.peer = peer


def test_describe_exception_finds_the_communication_failure_under_wrappers():
    try:
        try:
            raise RuntimeError("[/x/gloo/transport/tcp/pair.cc:553] Connection closed by peer "
                               "[127.0.0.1]:44957. This is typically caused by a remote crash.")
        except RuntimeError as exc:
            raise RuntimeError("rank 0: failed at step 2 - a collective failed") from exc
    except RuntimeError as exc:
        d = describe_exception(exc)
    assert d["comm"] and not d["timeout"] and d["peer"] is None
    assert d["error"] == "Connection closed by peer"
    assert "failed at step 2" in d["traceback"] and "pair.cc:553" in d["traceback"]
    d = describe_exception(_PeerError(3))
    assert d["comm"] and d["peer"] == 3 and d["timeout"] is False
    d = describe_exception(ValueError("grid 3x3 does not fit 4 workers"))
    assert not d["comm"] and d["error"] == "ValueError: grid 3x3 does not fit 4 workers"
    assert shorten("[a.cc:78] Timed out waiting 2000ms for recv operation to complete") == \
        "Timed out waiting 2000ms for recv operation to complete"


def test_attribution_rules():
    def timed_out(r, peer=None):
        return RankOutcome(r, "raised", error="Timed out waiting", comm=True, timeout=True, peer=peer)

    closed = [RankOutcome(r, "raised", error="Connection closed by peer", comm=True) for r in (0, 2, 3)]
    # a death outranks the errors it caused, whatever arrived first
    err = attribute([*closed, RankOutcome(1, "exited", exitcode=-9)])
    assert err.summary == ("rank 1 exited with code -9 (SIGKILL); "
                           "ranks 0,2,3 then failed: Connection closed by peer")
    # an error of its own outranks communication failures; equal errors are grouped
    own = [RankOutcome(r, "raised", error="FloatingPointError: non-finite loss at step 3") for r in (0, 1)]
    assert attribute(own).summary == "ranks 0,1 failed: FloatingPointError: non-finite loss at step 3"
    # several silent ranks: the one the errors name is blamed, the other is a bystander
    err = attribute([timed_out(0, peer=1), RankOutcome(1, "silent"), timed_out(2, peer=1),
                     RankOutcome(3, "silent")])
    assert err.causes == (1,)
    assert err.summary == ("rank 1 stopped responding (ranks 0,2 timed out waiting; rank 3 still "
                           "running; killed)")
    # nobody silent, nobody dead: the communication failures themselves
    assert attribute([timed_out(0), timed_out(1)]).summary == "ranks 0,1 failed: Timed out waiting"


def test_interrupted_carries_the_shell_exit_code():
    assert Interrupted(signal.SIGTERM).exit_code == 143
    assert Interrupted(signal.SIGINT).exit_code == 130
    assert not isinstance(Interrupted(signal.SIGINT), Exception)  # not swallowed as an error


# ----------------------------------------------------------------- signals and orphans -----------

LAUNCHER = textwrap.dedent("""
    import os, sys, time
    from pathlib import Path
    import torch.distributed as dist
    from flashsgd.launch import Interrupted, spawn

    def work(d):
        Path(d, f"pid-{dist.get_rank()}").write_text(str(os.getpid()))
        time.sleep(600)

    if __name__ == "__main__":
        try:
            spawn(work, 2, (sys.argv[1],), timeout_s=60, deadline_s=300)
        except Interrupted as exc:
            sys.exit(exc.exit_code)
""")


def _running(pid):
    """True while ``pid`` exists and is not a zombie (a zombie has exited; its parent reaps it)."""
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0] != "Z"
    except (FileNotFoundError, ProcessLookupError):
        return False


def _wait_until(condition, limit_s=60.0):
    end = time.monotonic() + limit_s
    while not condition() and time.monotonic() < end:
        time.sleep(0.1)
    return condition()


def _start_launcher(tmp_path):
    script = tmp_path / "launcher.py"
    script.write_text(LAUNCHER)
    env = {**os.environ, "PYTHONPATH": str(REPO / "src")}
    proc = subprocess.Popen([sys.executable, str(script), str(tmp_path)], env=env)
    assert _wait_until(lambda: len(list(tmp_path.glob("pid-*"))) == 2 or proc.poll() is not None)
    workers = [int(p.read_text()) for p in sorted(tmp_path.glob("pid-*"))]
    assert len(workers) == 2 and all(_running(w) for w in workers)
    return proc, workers


@pytest.mark.parametrize("signum, code", [(signal.SIGTERM, 143), (signal.SIGINT, 130),
                                          (signal.SIGKILL, -signal.SIGKILL)])
def test_signal_to_the_launcher_stops_its_workers(tmp_path, signum, code):
    proc, workers = _start_launcher(tmp_path)
    proc.send_signal(signum)
    assert proc.wait(timeout=60) == code
    assert _wait_until(lambda: not any(_running(w) for w in workers)), "orphaned workers"


def test_parent_watcher_fallback_kills_an_orphan():
    code = "import time; from flashsgd.launch import _watch_parent; " \
           "_watch_parent(parent_pid=-1, every_s=0.05); time.sleep(60)"
    proc = subprocess.run([sys.executable, "-c", code], env={**os.environ, "PYTHONPATH": str(REPO / "src")},
                          timeout=60)
    assert proc.returncode == -signal.SIGKILL


# ------------------------------------------------------------------ the GPU of each rank ---------

@pytest.mark.parametrize("local_rank, gpus, index", [(0, 8, 0), (3, 8, 3), (7, 8, 7), (3, 1, 0), (5, 2, 1)])
def test_cuda_index_wraps_the_local_rank_onto_the_visible_gpus(local_rank, gpus, index):
    # (3, 1): a scheduler gave each process its own single visible GPU (CUDA_VISIBLE_DEVICES=3)
    assert launch.cuda_index(local_rank, gpus) == index


def test_cuda_index_refuses_two_ranks_on_one_gpu():
    assert launch.cuda_index(3, 1, local_world=8) == 0  # one visible GPU per process: fine
    assert launch.cuda_index(3, 4, local_world=4) == 3
    with pytest.raises(RuntimeError, match="8 ranks on this node but 4 visible GPUs; NCCL cannot run two ranks"):
        launch.cuda_index(5, 4, local_world=8)


def test_cuda_index_without_a_visible_gpu_says_so():
    with pytest.raises(RuntimeError, match="backend 'nccl' needs a visible GPU; this process sees none "
                                           r"\(local rank 2; CUDA_VISIBLE_DEVICES="):
        launch.cuda_index(2, 0)


def test_init_process_group_takes_a_device_id():
    import inspect

    # NCCL's eager communicator (torch >= 2.3; the GPU images have 2.11)
    assert "device_id" in inspect.signature(dist.init_process_group).parameters


@pytest.fixture
def fake_init(monkeypatch):
    """torch.distributed's init and torch.cuda's device calls recorded, on a machine with 1 visible
    GPU (a scheduler's one-GPU-per-process layout); the process environment restored afterwards."""
    calls = {}
    monkeypatch.setattr(os, "environ", dict(os.environ))
    monkeypatch.setattr(torch, "set_num_threads", lambda n: None)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 1)
    monkeypatch.setattr(torch.cuda, "set_device", lambda i: calls.setdefault("set_device", i))
    monkeypatch.setattr(dist, "is_initialized", lambda: False)
    monkeypatch.setattr(dist, "TCPStore", lambda *a, **k: "store")
    monkeypatch.setattr(dist, "PrefixStore", lambda prefix, store: store)
    monkeypatch.setattr(dist, "init_process_group", lambda backend, **kw: calls.update(backend=backend, **kw))
    return calls


@pytest.mark.parametrize("backend", ["nccl", "gloo"])
def test_torchrun_ranks_bind_their_gpu_and_create_nccl_eagerly(fake_init, backend):
    os.environ.update(RANK="3", WORLD_SIZE="4", LOCAL_RANK="3", MASTER_ADDR="127.0.0.1", MASTER_PORT="1")
    assert launch.init_from_env(backend, timeout_s=5) == backend
    if backend == "nccl":
        assert fake_init["set_device"] == 0 and fake_init["device_id"] == torch.device("cuda", 0)
    else:
        assert "set_device" not in fake_init and "device_id" not in fake_init
    assert (fake_init["backend"], fake_init["rank"], fake_init["world_size"]) == (backend, 3, 4)


@pytest.mark.parametrize("backend", ["nccl", "gloo"])
def test_spawned_ranks_bind_their_gpu_and_create_nccl_eagerly(fake_init, backend):
    import queue

    ports = queue.Queue()
    ports.put(1)
    launch._join_group(5, 8, ports, backend, {}, timeout_s=5)
    if backend == "nccl":
        assert fake_init["set_device"] == 0 and fake_init["device_id"] == torch.device("cuda", 0)
    else:
        assert "set_device" not in fake_init and "device_id" not in fake_init
    assert (fake_init["backend"], fake_init["rank"], fake_init["world_size"]) == (backend, 5, 8)


def test_the_harness_starts_ranks_with_spawn_as_the_gpu_tests_do(run_ranks):
    # a gpu-marked test's ranks are spawned (conftest.py: cuda=True, the marker's default, and what
    # a gpu test may also pass itself): a test file's function runs there too
    assert run_ranks(_sum_of_ranks, 2, 1.0, cuda=True) == [[3.0] * 4] * 2
