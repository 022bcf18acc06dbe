"""Point-to-point rounds (flashsgd.comm.p2p): every send and receive goes through ``exchange``.

Real Gloo process groups: a ring round at world 2..4 with exact values (on the world group and on a
subgroup, peers given as group ranks), a pair swap, one-way and empty messages, duplex twin groups,
the NCCL control flow (grouped waits, native all-gather) run on Gloo, and a round with a missing
peer that raises PeerTimeout naming it. A source scan keeps every isend/irecv in p2p.py.
"""

from __future__ import annotations

import ast
import time
from pathlib import Path
from unittest import mock

import pytest
import torch
import torch.distributed as dist

from flashsgd.comm import PeerError, PeerTimeout, p2p
from flashsgd.comm.p2p import exchange, gather_from_peers

SRC = Path(__file__).resolve().parents[1] / "src" / "flashsgd"
TIMEOUT_S = 1.0
MARGIN_S = 4.0  # spawn and scheduling jitter on a shared 2-core machine


def _ring(device: str = "cpu"):
    """A ring round on the world group and on the subgroup of ranks 1..W-1 (group ranks as peers);
    receives in two segments, the second added by on_recv."""
    rank, world = dist.get_rank(), dist.get_world_size()
    sub = dist.new_group(list(range(1, world)))  # every rank creates it
    out = {}
    send = torch.arange(6, dtype=torch.float32, device=device) + 10 * (rank + 1)
    recv = torch.zeros(6, device=device)
    exchange([(send, (rank + 1) % world)], [(recv, (rank - 1) % world)], None, 10.0, "test ring")
    out["world"] = recv.tolist()
    got, seen = torch.zeros(6, device=device), []
    segs = [got[:4], got[4:]]
    exchange([(send[:4], (rank + 1) % world), (send[4:], (rank + 1) % world)],
             [(segs[0], (rank - 1) % world), (segs[1], (rank - 1) % world)], None, 10.0,
             "test ring, segments", on_recv=seen.append)
    out["segments"], out["on_recv"] = got.tolist(), seen
    if rank >= 1 and world > 2:
        me, size = dist.get_rank(sub), world - 1
        recv = torch.zeros(6, device=device)
        exchange([(send, (me + 1) % size)], [(recv, (me - 1) % size)], sub, 10.0, "test ring, subgroup")
        out["sub"] = recv.tolist()
    return out


@pytest.mark.parametrize("world", [2, 3, 4])
def test_a_ring_round_moves_each_rank_s_data_to_its_right(run_ranks, world):
    for rank, out in enumerate(run_ranks(_ring, world)):
        left = (rank - 1) % world
        want = [10.0 * (left + 1) + i for i in range(6)]
        assert out["world"] == want and out["segments"] == want
        assert out["on_recv"] == [0, 1]
        if rank >= 1 and world > 2:  # subgroup of global ranks 1..W-1: the left of global 1 is W-1
            sub_left = world - 1 if rank == 1 else rank - 1
            assert out["sub"] == [10.0 * (sub_left + 1) + i for i in range(6)]


def _pairs():
    rank = dist.get_rank()
    peer = 1 - rank
    out = {}
    mine, theirs = torch.full((5,), float(rank + 1)), torch.zeros(5)
    exchange([(mine, peer)], [(theirs, peer)], None, 10.0, "test swap")
    out["swap"] = theirs.tolist()
    one_way = torch.zeros(3)  # rank 0 sends, rank 1 receives
    exchange([(torch.full((3,), 7.0), 1)] if rank == 0 else [], [(one_way, 0)] if rank == 1 else [],
             None, 10.0, "test one way")
    out["one_way"] = one_way.tolist()
    seen = []  # empty tensors are neither sent nor received; on_recv still counts them
    exchange([(torch.zeros(0), peer)], [(torch.zeros(0), peer)], None, 10.0, "test empty",
             on_recv=seen.append)
    out["empty_on_recv"] = seen
    twin = dist.new_group([0, 1])  # duplex: rank 0 sends on WORLD and receives on twin
    groups = (dist.group.WORLD, twin) if rank == 0 else (twin, dist.group.WORLD)
    theirs = torch.zeros(5)
    exchange([(mine * 3, peer)], [(theirs, peer)], groups, 10.0, "test duplex")
    out["duplex"] = theirs.tolist()
    return out


def test_a_pair_swaps_one_way_and_duplex(run_ranks):
    for rank, out in enumerate(run_ranks(_pairs, 2)):
        peer = 1 - rank
        assert out["swap"] == [float(peer + 1)] * 5
        assert out["one_way"] == ([7.0] * 3 if rank == 1 else [0.0] * 3)
        assert out["empty_on_recv"] == [0]
        assert out["duplex"] == [3.0 * (peer + 1)] * 5


def _nccl_flow():
    """The NCCL branch (grouped=True): one batch_isend_irecv of P2POp, waits without a deadline,
    the native all-gather; run on Gloo, which implements all three."""
    rank, world = dist.get_rank(), dist.get_world_size()
    out = {}
    with mock.patch.object(p2p, "grouped", lambda tensor, group: True):
        recv, seen = torch.zeros(4), []
        exchange([(torch.full((4,), float(rank)), (rank + 1) % world)], [(recv, (rank - 1) % world)],
                 None, 10.0, "test grouped", on_recv=seen.append)
        out["ring"], out["on_recv"] = recv.tolist(), seen
        sub = dist.new_group([1, 2])  # P2POp with group_peer on a subgroup: peers are group ranks
        if rank in (1, 2):
            back = torch.zeros(2)
            exchange([(torch.full((2,), float(rank)), 2 - rank)], [(back, 2 - rank)], sub, 10.0,
                     "test grouped, subgroup")
            out["sub"] = back.tolist()
        rows = gather_from_peers(torch.tensor([rank, 10 * rank]), None, 10.0, "test native gather")
        out["gather"] = rows.tolist()
        twin = dist.new_group(list(range(world)))
        try:
            exchange([(torch.ones(1), (rank + 1) % world)], [(torch.zeros(1), (rank - 1) % world)],
                     (None, twin), 10.0, "test duplex on nccl")
        except ValueError as exc:
            out["duplex"] = str(exc)
    return out


def test_the_nccl_branch_groups_the_round_and_gathers_natively(run_ranks):
    world = 3
    for rank, out in enumerate(run_ranks(_nccl_flow, world)):
        assert out["ring"] == [float((rank - 1) % world)] * 4 and out["on_recv"] == [0]
        assert out.get("sub") == {1: [2.0, 2.0], 2: [1.0, 1.0]}.get(rank)
        assert out["gather"] == [[r, 10 * r] for r in range(world)]
        assert "one process group" in out["duplex"]


def _failed_round(where: str, peers, when: str):
    class Failed:
        def wait(self):
            raise RuntimeError("NCCL watchdog: Timed out after 600000 ms")

    def issue(ops):
        if when == "issue":
            raise RuntimeError("NCCL error: unhandled system error")
        return [Failed()]

    ops = [mock.Mock(peer=p) for p in peers]
    try:
        with mock.patch.object(p2p.dist, "batch_isend_irecv", issue):
            p2p._wait_round(ops, where)
    except PeerError as exc:
        return type(exc).__name__, exc.peer, str(exc)


@pytest.mark.parametrize("when", ["issue", "wait"])
def test_an_nccl_failure_names_the_round_s_peer(run_ranks, when):
    (name, peer, message), = run_ranks(_failed_round, 1, "gtopk all-reduce, butterfly round 0", [3, 3], when)
    assert (name, peer) == ("PeerError", 3) and "butterfly round 0" in message and "[3]" in message
    (_, peer, message), = run_ranks(_failed_round, 1, "topk all-gather", [1, 2], when)
    assert peer is None and "[1, 2]" in message


def _one_rank_silent(silent: int, gather: bool):
    rank, world = dist.get_rank(), dist.get_world_size()
    if rank == silent:
        time.sleep(TIMEOUT_S + 3)
        return None
    t0 = time.monotonic()
    try:
        if gather:
            gather_from_peers(torch.ones(3), None, TIMEOUT_S, "test gather")
        else:
            exchange([(torch.ones(3), silent)], [(torch.zeros(3), silent)], None, TIMEOUT_S, "test swap")
    except PeerTimeout as exc:
        return exc.peer, exc.sending, time.monotonic() - t0, str(exc)
    return "no error"


@pytest.mark.parametrize("world, silent, gather", [(2, 1, False), (3, 2, True), (4, 0, True)])
def test_a_missing_peer_raises_peer_timeout_naming_it(run_ranks, world, silent, gather):
    where = "test gather" if gather else "test swap"
    for rank, result in enumerate(run_ranks(_one_rank_silent, world, silent, gather)):
        if rank == silent:
            assert result is None
            continue
        peer, sending, elapsed, message = result
        assert (peer, sending) == (silent, False), result
        assert elapsed < TIMEOUT_S + MARGIN_S
        assert message == f"rank {rank}: no data from peer rank {silent} within 1 s ({where})"


P2P_NAMES = {"isend", "irecv", "P2POp", "batch_isend_irecv"}


def _p2p_uses(path: Path) -> list[str]:
    """Code (not docstrings) that names a point-to-point call: ``x.isend``, ``dist.send(``, an
    imported ``irecv``..."""
    hits = []
    for node in ast.walk(ast.parse(path.read_text())):
        name = None
        if isinstance(node, ast.Attribute):
            if node.attr in P2P_NAMES or (node.attr in ("send", "recv") and isinstance(node.value, ast.Name)
                                          and node.value.id == "dist"):
                name = node.attr
        elif isinstance(node, ast.Name) and node.id in P2P_NAMES:
            name = node.id
        elif isinstance(node, ast.ImportFrom):
            names = {a.name for a in node.names} & (P2P_NAMES | {"send", "recv"})
            if names and (node.module or "").startswith("torch.distributed"):
                name = ",".join(sorted(names))
        if name:
            hits.append(f"{path.relative_to(SRC)}:{node.lineno} {name}")
    return hits


def test_every_send_and_receive_goes_through_p2p():
    hits = [h for p in sorted(SRC.rglob("*.py")) if p != SRC / "comm" / "p2p.py" for h in _p2p_uses(p)]
    assert hits == []
    assert _p2p_uses(SRC / "comm" / "p2p.py")  # the scan sees them where they are


# ------------------------------------------------------------------------------------- GPU -----

def _nccl_one_rank():
    """One NCCL rank: a grouped round to itself (NCCL allows a self send/recv inside a group, as its
    all-to-all does), two segments with on_recv, and the native gather."""
    a, b = torch.arange(4.0, device="cuda"), torch.arange(10.0, 13.0, device="cuda")
    x, y = torch.empty_like(a), torch.empty_like(b)
    seen = []
    exchange([(a, 0), (b, 0)], [(x, 0), (y, 0)], None, 10.0, "test nccl self round", on_recv=seen.append)
    msg = torch.tensor([3, 4, 5], device="cuda")
    rows = gather_from_peers(msg, None, 10.0, "test nccl gather")  # native all_gather_into_tensor
    return p2p.grouped(msg, None), x.tolist(), y.tolist(), seen, rows.tolist()


@pytest.mark.gpu  # NCCL cannot put two ranks on one GPU: a world of one, sending to itself
def test_a_grouped_nccl_round_and_the_native_gather(run_ranks):
    assert run_ranks(_nccl_one_rank, 1, backend="nccl") == [
        (True, [0.0, 1.0, 2.0, 3.0], [10.0, 11.0, 12.0], [0, 1], [[3, 4, 5]])]


def _cuda_on_gloo():
    try:
        exchange([(torch.ones(2, device="cuda"), 0)], [], None, 1.0, "test")
    except ValueError as exc:
        return str(exc)
    return None


@pytest.mark.gpu
def test_cuda_tensors_on_gloo_are_refused(run_ranks):
    (message,) = run_ranks(_cuda_on_gloo, 1)
    assert message is not None and "Gloo sends and receives host memory only" in message
