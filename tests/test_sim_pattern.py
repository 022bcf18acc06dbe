"""The simulator's exchanges send what comm's send: bytes per rank and rounds, pinned on real Gloo runs.

For ring, topk, gtopk (4 ranks) and hgtopk with each node split (2 nodes x 2 ranks), every rank
runs comm's function with torch.distributed's isend / irecv / reduce / broadcast wrapped for the
duration of the call, counting the bytes it hands to the backend and its message rounds (a round:
posts before the next wait; a node reduce or broadcast: ceil(lg L) rounds of a binomial tree, its
bytes counted as the simulator counts them). The counts must equal
:func:`flashsgd.sim.costs_sparse.message_pattern` for the same k, numel and P, whose rounds must in
turn be the latency of the cost function on a link of alpha = 1 s.
"""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch
import torch.distributed as dist

from flashsgd.sim.algorithms import exchange_cost
from flashsgd.sim.costs import CommSetup
from flashsgd.sim.costs_sparse import message_pattern
from flashsgd.sim.network import ClusterModel, Link

NUMEL, DENSITY = 4000, 0.01  # k = 40; 2 slices of 2000 entries, 20 pairs each
CASES = [("ring", None, 1), ("topk", None, 1), ("gtopk", None, 1),
         ("hgtopk", "leader", 2), ("hgtopk", "slices", 2), ("hgtopk", "sparse", 2)]
_WRAPPED = ("isend", "irecv", "reduce", "broadcast")
_UNEXPECTED = ("send", "recv", "all_reduce", "all_gather", "all_gather_into_tensor", "reduce_scatter",
               "reduce_scatter_tensor", "gather", "scatter", "all_to_all_single")


def _children(local: int, size: int) -> int:
    return sum(1 for i in range(max(size - 1, 0).bit_length()) if local < (1 << i) and local + (1 << i) < size)


def _counted(fn) -> dict:
    """Run ``fn()`` counting the bytes this rank hands to the backend and its message rounds."""
    state = {"bytes": 0, "rounds": 0, "waited": True, "unexpected": []}
    orig = {name: getattr(dist, name) for name in _WRAPPED + _UNEXPECTED}

    class Work:
        def __init__(self, work):
            self.work = work

        def wait(self, *args, **kwargs):
            state["waited"] = True
            return self.work.wait(*args, **kwargs)

    def post(tensor, sending: bool) -> None:
        if state["waited"]:
            state["rounds"], state["waited"] = state["rounds"] + 1, False
        if sending:
            state["bytes"] += tensor.numel() * tensor.element_size()

    def isend(tensor, *args, **kwargs):
        post(tensor, True)
        return Work(orig["isend"](tensor, *args, **kwargs))

    def irecv(tensor, *args, **kwargs):
        post(tensor, False)
        return Work(orig["irecv"](tensor, *args, **kwargs))

    def tree(name: str, root_key: str):
        def call(tensor, *args, **kwargs):
            group = kwargs.get("group")
            size = dist.get_world_size(group)
            root = dist.get_group_rank(group, kwargs[root_key]) if group is not None else kwargs[root_key]
            local = (dist.get_rank(group) - root) % size
            if name == "reduce":  # binomial reduce: every non-root rank sends the tensor once
                state["bytes"] += tensor.numel() * tensor.element_size() if local else 0
            else:  # binomial broadcast: one message per child
                state["bytes"] += _children(local, size) * tensor.numel() * tensor.element_size()
            state["rounds"] += math.ceil(math.log2(size)) if size > 1 else 0
            state["waited"] = True
            return orig[name](tensor, *args, **kwargs)
        return call

    def unexpected(name: str):
        def call(*args, **kwargs):
            state["unexpected"].append(name)
            return orig[name](*args, **kwargs)
        return call

    patched = {"isend": isend, "irecv": irecv, "reduce": tree("reduce", "dst"),
               "broadcast": tree("broadcast", "src"), **{n: unexpected(n) for n in _UNEXPECTED}}
    try:
        for name, f in patched.items():
            setattr(dist, name, f)
        fn()
    finally:
        for name, f in orig.items():
            setattr(dist, name, f)
    return {k: state[k] for k in ("bytes", "rounds", "unexpected")}


def _patterns_body() -> dict:
    from flashsgd.comm.dense import ring_allreduce
    from flashsgd.comm.sparse import gtopk_allreduce, topk_allgather, topk_exact
    from flashsgd.comm.sparse.hier import hgtopk_allreduce
    from flashsgd.comm.sparse.select import k_from_density
    from flashsgd.comm.topology import get_topology

    rank, world = dist.get_rank(), dist.get_world_size()
    x = torch.randn(NUMEL, generator=torch.Generator().manual_seed(rank))
    k = k_from_density(NUMEL, DENSITY)
    values, indices = topk_exact(x, k)
    topo = get_topology(ranks_per_node=2)  # every rank builds the groups before any count
    runs = {
        ("ring", None): lambda: ring_allreduce(x.clone(), list(range(world)), dist.group.WORLD),
        ("topk", None): lambda: topk_allgather(values, indices, NUMEL, check=False),
        ("gtopk", None): lambda: gtopk_allreduce(values, indices, k, NUMEL, check=False),
    }
    for split in ("leader", "slices", "sparse"):
        runs["hgtopk", split] = lambda s=split: hgtopk_allreduce(x, k, topo, out=torch.empty(NUMEL),
                                                                  check=False, split=s)
    out = {}
    for key, fn in runs.items():
        dist.barrier()
        out[key] = _counted(fn)
    return {"k": k, **out}


def _unit(ranks_per_node: int, alpha: float = 0.0, gbps: float = 1e300) -> ClusterModel:
    link = Link(alpha_s=alpha, bandwidth_gbps=gbps)
    return ClusterModel(name="unit", ranks_per_node=ranks_per_node, intra=link, inter=link,
                        call_overhead_s=0.0, exchange_fixed_s=0.0, select_s_per_elem=0.0)


def test_simulated_exchanges_send_what_comm_sends(run_ranks):
    measured = run_ranks(_patterns_body, 4)
    assert all(r["k"] == 40 for r in measured)
    for algorithm, node_split, ranks_per_node in CASES:
        what = f"{algorithm} {node_split or ''}"
        got = [r[(algorithm, node_split)] for r in measured]
        assert all(g["unexpected"] == [] for g in got), (what, got)
        split = {"node_split": node_split} if node_split else {}
        setup = CommSetup(gpus=4, cluster=_unit(ranks_per_node), density=DENSITY, **split)
        want = message_pattern(algorithm, NUMEL, setup)
        assert [g["bytes"] for g in got] == want.bytes_per_rank.tolist(), what
        assert max(g["rounds"] for g in got) == want.rounds, what
        # the cost function pays one alpha per round of the pattern
        timed = CommSetup(gpus=4, cluster=_unit(ranks_per_node, alpha=1.0), density=DENSITY, **split)
        assert float(exchange_cost(algorithm, NUMEL * 4.0, timed).latency_s) == want.rounds, what
        if ranks_per_node == 1:  # one link level, one flow: the cost's bytes are a rank's bytes
            per_byte = CommSetup(gpus=4, cluster=_unit(1, gbps=1e-9), density=DENSITY)
            assert float(exchange_cost(algorithm, NUMEL * 4.0, per_byte).bandwidth_s) == pytest.approx(
                float(np.max(want.bytes_per_rank))), what
