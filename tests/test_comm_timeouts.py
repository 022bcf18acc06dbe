"""Deadlines: when one rank stops, every other rank raises PeerTimeout within the timeout, naming a
peer it waited for; the named peers lead to the stopped rank (in a ring or a butterfly a rank may
wait on a neighbour that is itself stuck waiting on the stopped one). A rank whose neighbour timed
out first and exited may instead see that connection close: PeerError naming the neighbour.

Before the deadlines, Gloo's send/recv waits had none: these calls hung until the test harness
killed them. The stopped rank sleeps timeout + 3 s and then exits cleanly.
"""

from __future__ import annotations

import pickle
import re
import time

import pytest
import torch
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel as DDP

from flashsgd.comm import PeerError, PeerTimeout
from flashsgd.comm.dense import ALLREDUCE, duplex_groups
from flashsgd.comm.hooks import register_hook
from flashsgd.comm.sparse import gtopk_allreduce, topk_allgather, topk_exact
from flashsgd.comm.topology import get_topology

TIMEOUT_S = 2.0
MARGIN_S = 4.0  # a 2-core machine shared by several test runs: spawn and scheduling jitter


def _call(algorithm: str, topo) -> None:
    if algorithm in ALLREDUCE:
        ALLREDUCE.get(algorithm)(torch.ones(1000), topo, check=False)
        return
    x = torch.randn(1000, generator=torch.Generator().manual_seed(dist.get_rank()))
    values, indices = topk_exact(x, 10)
    if algorithm == "topk":
        topk_allgather(values, indices, x.numel(), check=False, timeout_s=TIMEOUT_S)
    else:
        gtopk_allreduce(values, indices, 10, x.numel(), check=False, timeout_s=TIMEOUT_S)


def _one_rank_stops(algorithm: str, sleeper: int):
    world = dist.get_world_size()
    topo = get_topology(ranks_per_node=2 if world % 2 == 0 else 1, timeout_s=TIMEOUT_S)  # collective
    duplex_groups(topo)  # collective too: created before the sleeper stops
    if dist.get_rank() == sleeper:
        time.sleep(TIMEOUT_S + 3)
        return None
    t0 = time.monotonic()
    try:
        _call(algorithm, topo)
    except PeerError as exc:  # PeerTimeout, or a lost connection to a peer that timed out first
        return exc.peer, time.monotonic() - t0, str(exc)
    return "no error", time.monotonic() - t0, ""


def _check_blame(results, sleeper, where):
    """Every other rank timed out in time; the named peers form chains that end at the sleeper."""
    blamed = {}
    for rank, result in enumerate(results):
        if rank == sleeper:
            assert result is None
            continue
        peer, elapsed, message = result
        assert peer != "no error", f"rank {rank} finished without the sleeper"
        assert elapsed < TIMEOUT_S + MARGIN_S, (rank, elapsed)
        assert re.match(rf"rank {rank}: (no data from peer rank {peer} within 2 s|peer rank {peer} did "
                        rf"not receive our data within 2 s|lost peer rank {peer}) \({where}", message), \
            message
        blamed[rank] = peer
    for rank in blamed:
        seen = set()
        while rank != sleeper:
            assert rank not in seen, f"blame cycle {blamed}"
            seen.add(rank)
            rank = blamed[rank]
    assert sleeper in blamed.values()


@pytest.mark.parametrize("algorithm, world, sleeper, where", [
    ("ring", 3, 1, "ring all-reduce, reduce-scatter step 0"),
    ("hierarchical", 4, 1, "hierarchical all-reduce, node stage"),
    ("torus2d", 4, 2, "torus2d all-reduce, row stage"),
    ("topk", 4, 1, "topk all-gather"),
    ("gtopk", 4, 1, "gtopk all-reduce, butterfly round"),
    ("gtopk", 3, 2, "gtopk all-reduce, fold-in"),
])
def test_peers_of_a_stopped_rank_time_out_naming_it(run_ranks, algorithm, world, sleeper, where):
    results = run_ranks(_one_rank_stops, world, algorithm, sleeper)
    _check_blame(results, sleeper, where.split(",")[0])
    direct = [r for r in results if r is not None and r[0] == sleeper]
    assert any(where in message for _, _, message in direct), direct


def _net():
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.ReLU(), torch.nn.Linear(16, 4))


def _hook_rank_stops(hook: str, options: dict, steps_before: int):
    model = DDP(_net(), bucket_cap_mb=0.0005)  # several buckets
    register_hook(model, hook, timeout_s=TIMEOUT_S, **options)
    x = torch.randn(8, 8)
    for _ in range(steps_before):
        model(x).sum().backward()
    if dist.get_rank() == 1:
        time.sleep(TIMEOUT_S + 3)
        return None
    t0 = time.monotonic()
    try:
        model(x).sum().backward()
    except RuntimeError as exc:  # DDP re-raises the hook's error as a RuntimeError with its text
        return time.monotonic() - t0, str(exc)
    return time.monotonic() - t0, "no error"


@pytest.mark.parametrize("hook, options, steps_before, peers", [
    ("torus2d", {"grid": "2x2"}, 0, {"1", "0"}),           # communication thread
    ("ring", {"threaded": False}, 0, {"1", "2", "3"}),
    ("gtopk", {"density": 0.1}, 2, {"1"}),                 # sparse phase: size check, all name 1
    ("topk", {"density": 0.1}, 0, {"ranks 0, 1, 2, 3"}),   # dense phase: a collective, no peer
])
def test_hooks_fail_backward_within_the_deadline(run_ranks, hook, options, steps_before, peers):
    results = run_ranks(_hook_rank_stops, 4, hook, options, steps_before)
    for rank, result in enumerate(results):
        if rank == 1:
            assert result is None
            continue
        elapsed, message = result
        found = re.search(rf"rank {rank}: (?:no data from peer rank (\d+)|peer rank (\d+) did not "
                          rf"receive our data|(ranks [\d, ]+) did not all take part) within 2 s "
                          rf"\({hook} ", message)
        assert found and (found[1] or found[2] or found[3]) in peers, (rank, message)
        assert elapsed < TIMEOUT_S + MARGIN_S, (rank, elapsed)


def test_peer_errors_pickle_and_read_well():
    err = PeerTimeout(0, 1, 10.0, "ring all-reduce, reduce-scatter step 2")
    assert str(err) == "rank 0: no data from peer rank 1 within 10 s (ring all-reduce, reduce-scatter step 2)"
    assert isinstance(err, TimeoutError) and isinstance(err, RuntimeError)
    again = pickle.loads(pickle.dumps(err))
    assert (type(again), again.peer, str(again)) == (PeerTimeout, 1, str(err))
    sent = PeerTimeout(2, 3, 1.5, "gtopk all-reduce, fold-out", sending=True)
    assert str(sent) == "rank 2: peer rank 3 did not receive our data within 1.5 s (gtopk all-reduce, fold-out)"
    lost = PeerError(0, 1, "topk all-gather", "Connection closed by peer")
    assert str(lost) == "rank 0: lost peer rank 1 (topk all-gather): Connection closed by peer"
    assert pickle.loads(pickle.dumps(lost)).peer == 1


class _RecordedWork:
    """A work whose ``wait`` records how it was called."""

    def __init__(self) -> None:
        self.kwargs = None

    def wait(self, **kwargs) -> None:
        self.kwargs = kwargs


@pytest.mark.parametrize("on_nccl", [True, False])
def test_a_collective_on_nccl_is_waited_on_the_stream_not_the_host(monkeypatch, on_nccl):
    """NCCL: ``work.wait(timeout=...)`` would block the CPU thread until the GPU work is done (torch's
    Work.wait); a CUDA tensor on an NCCL group is waited for without one (the stream waits, the
    group's timeout bounds it). Gloo keeps the deadline that names a late peer."""
    import datetime

    from flashsgd.comm import waits

    monkeypatch.setattr(waits, "grouped", lambda tensor, group: on_nccl)
    work = _RecordedWork()
    waits.wait_collective(work, None, 5.0, "test", torch.zeros(1))
    assert work.kwargs == ({} if on_nccl else {"timeout": datetime.timedelta(seconds=5.0)})
