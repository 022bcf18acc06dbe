"""Hierarchical gTop-k over R slices: each rank of a node owns 1/R of the gradient's indices.

Paper: Shi et al. 2019, gTop-k S-SGD (arXiv 1901.04359) for the cross-node merges; the slicing is
the reduce-scatter / all-gather split of the hierarchical all-reduce (Jia et al. 2018,
arXiv 1807.11205). The variant "R parallel gTop-k over R slices" of
:mod:`flashsgd.comm.sparse.hier`; same error feedback, same result format.

On N nodes x R ranks, local rank l owns slice l = [b_l, b_{l+1}) with b_j = j m // R:

1. Node reduce-scatter by direct exchange: every rank sends slice j of its ``acc`` to local rank
   j and sums the R pieces of its own slice: ``A_n[slice l]`` (R - 1 sends of m/R per rank, all
   at once; no rank receives more than its slice).
2. Rank l selects k_l = ceil(k m_l / m) entries of its slice of the node sum (all ranks select at
   once, each over m / R entries).
3. gTop-k of slice l among the N ranks with local rank l (the cross group, one per local rank:
   R exchanges run in parallel, each with k_l pairs).
4. Node all-gather of the R slices' results (global pairs and counted indices, shifted to global
   positions), so every rank holds the whole result and its node's counted indices.
5. The caller zeroes the counted indices of its own ``acc`` (residual kept per rank).

Cost per rank: intra-node (R-1) m/R values sent and received + m/R adds; selection over m/R; a
gTop-k of k/R pairs over N ranks; an all-gather of R (k/R)-pair messages inside the node.

Example::

    >>> res = hgtopk_slices_allreduce(acc, k, get_topology(ranks_per_node=2), out=bucket)
    >>> acc.index_fill_(0, res.counted, 0)
"""

from __future__ import annotations

import math

import torch

from flashsgd.comm.p2p import exchange, gather_from_peers
from flashsgd.comm.sparse import Counted, GTopk, bytes_as_words, gtopk_allreduce, topk_exact, wire_index_dtype
from flashsgd.comm.topology import Topology


def slice_bounds(numel: int, ranks: int) -> list[int]:
    """b_0 = 0 < ... < b_R = numel with b_j = j numel // R (slice j = [b_j, b_{j+1}))."""
    return [j * numel // ranks for j in range(ranks + 1)]


def slice_k(k: int, numel: int, size: int) -> int:
    """Pairs of a slice of ``size`` entries: ceil(k size / numel), in [1, size] (k = numel: all)."""
    return max(1, min(size, math.ceil(k * size / numel)))


def _reduce_scatter(acc: torch.Tensor, out: torch.Tensor, bounds: list[int], topology: Topology,
                    timeout_s: float) -> torch.Tensor:
    """Step 1: ``out[slice l]`` = the node sum of slice l; returns that view."""
    local, group = topology.local_rank, topology.node_group
    mine = out[bounds[local]:bounds[local + 1]]
    mine.copy_(acc[bounds[local]:bounds[local + 1]])
    if group is None:
        return mine
    peers = [j for j in range(topology.ranks_per_node) if j != local]
    bufs = [torch.empty_like(mine) for _ in peers]
    exchange([(acc[bounds[j]:bounds[j + 1]].contiguous(), j) for j in peers], list(zip(bufs, peers)),
             group, timeout_s, "hgtopk slices, node reduce-scatter")
    for buf in bufs:  # sum in local-rank order: the same on every node
        mine.add_(buf)
    return mine


def _pack_slice(res: GTopk, offset: int, kmax: int, numel: int) -> torch.Tensor:
    """Message of words of wire_index_dtype(numel): kmax global indices, kmax counted indices
    (both padded with -1), the values' bytes."""
    word = wire_index_dtype(numel)
    device = res.values.device
    idx = torch.full((kmax,), -1, dtype=word, device=device)
    cnt = torch.full((kmax,), -1, dtype=word, device=device)
    idx[:res.indices.numel()] = res.indices + offset
    mine = res.mine
    cnt[:mine.positions.numel()] = torch.where(mine.survived, mine.positions + offset, -1)
    vals = torch.zeros(kmax, dtype=res.values.dtype, device=device)
    vals[:res.values.numel()] = res.values
    return torch.cat([idx, cnt, bytes_as_words(vals.view(torch.uint8), word)])


def hgtopk_slices_allreduce(acc: torch.Tensor, k: int, topology: Topology, *, out: torch.Tensor,
                            select=topk_exact, check: bool = True, timeout_s: float,
                            timings: dict | None = None) -> GTopk:
    """Hierarchical gTop-k, R parallel slices (Steps 1-4 of the module docstring).

    Arguments and result as :func:`~flashsgd.comm.sparse.hier.hgtopk_allreduce` (which
    validates them and calls this with ``split="slices"``); the result holds sum_l k_l pairs.
    """
    n, r, local = acc.numel(), topology.ranks_per_node, topology.local_rank
    bounds = slice_bounds(n, r)
    sizes = [bounds[j + 1] - bounds[j] for j in range(r)]
    ks = [slice_k(k, n, s) if s else 0 for s in sizes]
    # Step 1
    part = _reduce_scatter(acc, out, bounds, topology, timeout_s)
    # Steps 2-3 (a slice may be empty when numel < R: nothing to select there)
    if ks[local]:
        values, indices = select(part, ks[local])
        if topology.num_nodes > 1:
            res = gtopk_allreduce(values, indices, ks[local], sizes[local], topology.cross_group,
                                  check=check, timeout_s=timeout_s, timings=timings)
        else:
            res = GTopk(values, indices, Counted.every(indices))
    else:
        none = torch.zeros(0, dtype=torch.int64, device=acc.device)
        res = GTopk(acc[:0], none, Counted.every(none))
    # Step 4
    kmax = max(ks)
    msg = _pack_slice(res, bounds[local], kmax, n)
    rows = (gather_from_peers(msg, topology.node_group, timeout_s, "hgtopk slices, node all-gather")
            if topology.node_group is not None else msg.unsqueeze(0))
    item = acc.element_size()
    vals = rows[:, 2 * kmax:].contiguous().view(torch.uint8)[:, :kmax * item].contiguous().view(acc.dtype)
    idx, cnt = rows[:, :kmax].to(torch.int64), rows[:, kmax:2 * kmax].to(torch.int64)
    # Row j holds exactly ks[j] pairs (gTop-k keeps k; padding after them): sizes known on the
    # host, so no boolean mask (a host synchronization on CUDA). Slices in order, ascending.
    values = torch.cat([vals[j, :ks[j]] for j in range(r)])
    indices = torch.cat([idx[j, :ks[j]] for j in range(r)])
    out.zero_()
    out[indices] = values
    cnt = cnt.flatten()
    return GTopk(values, indices, Counted(cnt.clamp(min=0), cnt >= 0))
