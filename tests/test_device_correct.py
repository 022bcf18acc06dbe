"""The sparse exchanges make every tensor on the device of the data they serve (issue 22: CUDA
buckets must not meet CPU helpers). On CPU the check is strict anyway: the default device is set
to ``meta`` around the calls, so a tensor made without ``device=`` lands on ``meta`` and the first
op that mixes it with the CPU data fails. With CUDA present the same calls run on CUDA tensors
(2 ranks on one GPU over Gloo, which carries CUDA tensors)."""

from __future__ import annotations

import contextlib

import pytest
import torch
import torch.distributed as dist

DEVICES = ["cpu"] + (["cuda"] if torch.cuda.is_available() else [])


@contextlib.contextmanager
def _strict(device: str):
    """On CPU: tensors made without an explicit device go to ``meta`` (and fail when mixed)."""
    if device != "cpu":
        yield
        return
    torch.set_default_device("meta")
    try:
        yield
    finally:
        torch.set_default_device(None)


def _exchanges(device: str):
    from flashsgd.comm.sparse import gtopk_allreduce, merge_topk, topk_allgather
    from flashsgd.comm.sparse_hier import hgtopk_allreduce
    from flashsgd.comm.sparse_select import (SelectionWorkspace, ThresholdReuse, topk_exact, topk_sampled,
                                             topk_threshold)
    from flashsgd.comm.topology import get_topology

    rank = dist.get_rank()
    topo = get_topology(ranks_per_node=1)  # groups are built before the strict region
    g = torch.Generator().manual_seed(rank)
    x = torch.randn(200_000, generator=g).to(device)
    n, k = x.numel(), 2000  # k / n large enough for the sampled path (not its exact fallback)
    seen = {}
    with _strict(device):
        want = topk_exact(x, k)
        for name, (v, i) in {
            "sampled": topk_sampled(x, k, generator=torch.Generator(device=x.device).manual_seed(1),
                                    workspace=SelectionWorkspace()),
            "threshold": topk_threshold(x, k, reuse=ThresholdReuse(0.25, 8)),
        }.items():
            seen[name] = torch.equal(torch.sort(i).values, torch.sort(want[1]).values) and v.device == x.device
        va, ia = topk_exact(x, k)
        ia, order = torch.sort(ia)
        merged = merge_topk(va[order], ia, va[order] * 2, ia, k)
        seen["merge"] = merged[1].device == x.device
        dense = topk_allgather(want[0], want[1], n)
        seen["topk"] = dense.device == x.device and int((dense != 0).sum()) >= k
        res = gtopk_allreduce(want[0], want[1], k, n)
        seen["gtopk"] = res.values.device == x.device and res.indices.numel() == k
        out = torch.empty_like(x)
        for split in ("leader", "slices", "sparse"):
            res = hgtopk_allreduce(x.clone(), k, topo, out=out, split=split)
            seen[split] = res.counted.device == x.device and out.device == x.device
    return seen


@pytest.mark.parametrize("device", DEVICES)
def test_sparse_exchanges_make_tensors_on_the_datas_device(run_ranks, device):
    for seen in run_ranks(_exchanges, 2, device):
        assert all(seen.values()), seen
