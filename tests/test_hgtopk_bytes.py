"""hgtopk's byte count (flashsgd.comm.sparse.hier.hgtopk_bytes_sent) is what each node split hands
to the backend: counted on real Gloo process groups by wrapping the calls that send."""

from __future__ import annotations

import pytest
import torch

from flashsgd.exchanges import NODE_SPLITS


def _count_bytes(split: str, numel: int, k: int) -> tuple[int, dict]:
    import torch.distributed as dist

    from flashsgd.comm.sparse.hier import hgtopk_allreduce, hgtopk_bytes_sent
    from flashsgd.comm.topology import get_topology

    topo = get_topology(ranks_per_node=2)
    sent = [0]

    def nbytes(t: torch.Tensor) -> int:
        return t.numel() * t.element_size()

    isend, reduce, broadcast = dist.isend, dist.reduce, dist.broadcast

    def counting_isend(t, *a, **kw):
        sent[0] += nbytes(t)
        return isend(t, *a, **kw)

    def counting_reduce(t, dst, group=None, **kw):  # a non-root hands its tensor to the backend
        if dist.get_rank() != dst:
            sent[0] += nbytes(t)
        return reduce(t, dst, group=group, **kw)

    def counting_broadcast(t, src, group=None, **kw):  # the root, to each of the others at most
        if dist.get_rank() == src:
            sent[0] += nbytes(t) * (dist.get_world_size(group) - 1)
        return broadcast(t, src, group=group, **kw)

    dist.isend, dist.reduce, dist.broadcast = counting_isend, counting_reduce, counting_broadcast
    try:
        g = torch.Generator().manual_seed(dist.get_rank())
        acc = torch.randn(numel, generator=g)
        hgtopk_allreduce(acc, k, topo, out=torch.empty(numel), check=False, split=split)
    finally:
        dist.isend, dist.reduce, dist.broadcast = isend, reduce, broadcast
    return sent[0], hgtopk_bytes_sent(k, topo, numel, torch.float32, split)


@pytest.mark.parametrize("split", NODE_SPLITS)
def test_the_count_is_what_each_rank_sends(run_ranks, split):
    """2 nodes x 2 ranks (R - 1 = 1: a broadcast's upper bound is exact), 101 elements (uneven
    slices), k = 7."""
    for rank, (counted, formula) in enumerate(run_ranks(_count_bytes, 4, split, 101, 7)):
        assert counted == sum(formula.values()), (split, rank, counted, formula)


def test_an_unknown_split_is_refused():
    from flashsgd.comm.sparse.hier import hgtopk_bytes_sent
    from flashsgd.comm.topology import Topology

    topo = Topology(4, 0, 2, (2, 2), 10.0, (0, 1), (0, 2), (0, 1), (0, 2), None, None, None, None)
    with pytest.raises(ValueError, match="split must be one of"):
        hgtopk_bytes_sent(7, topo, 101, split="rows")
