"""Hierarchical sparse exchange ``hgtopk``: dense inside a node, gTop-k across nodes.

Paper: Shi et al. 2019, gTop-k S-SGD (arXiv 1901.04359) for the cross-node merge tree; the
two-level layout is the hierarchical all-reduce's (Jia et al. 2018, arXiv 1807.11205): links
inside a node are fast, so only the slow cross-node links carry sparse traffic.

On N nodes x R ranks per node (:class:`~flashsgd.comm.topology.Topology`), every rank holds its
accumulated gradient ``acc_r = grad_r + residual_r``:

1. Node sum: a dense reduce of the R ranks' ``acc`` to the node's leader (local rank 0) over the
   node group (fast links): ``A_n = sum_{r in n} acc_r``.
2. The leader selects the k largest |A_n| (any selection of :data:`~.sparse_select.SELECTIONS`).
3. gTop-k among the N leaders (the cross group of local rank 0,
   :func:`~flashsgd.comm.sparse.gtopk_allreduce`): the global k pairs and the node's counted
   indices (those of A_n's values that survived every merge).
4. The leader broadcasts the global pairs and the counted indices inside the node.
5. Each rank zeroes the counted indices of its own ``acc`` (its residual, kept per rank).

Error feedback stays exact: the global values at the counted indices of node n hold all of
``A_n`` there, i.e. every rank's acc at those indices, and exactly those are zeroed, so
``sum_r acc_r == global + sum_r residual_r`` as for flat gTop-k.

Cost (m elements, 4-byte values, k pairs of s = 8 bytes (int32 indices), a/b intra-node, A/B
cross-node): reduce and broadcast inside the node ~ log2(R)(a + 4m b) + log2(R)(a + 12k b);
gTop-k over N leaders: log2(N)(A + s k B). Flat gTop-k over N R ranks pays log2(N R) rounds of
s k bytes on the slow links (when ranks of a node share the node's link, R messages at a time) and
R times the selection work per node; hgtopk pays one selection per node and log2(N) rounds.

Example::

    >>> topo = get_topology(ranks_per_node=2)
    >>> acc = grad + residual
    >>> res = hgtopk_allreduce(acc, k, topo, out=bucket)   # bucket = global sum, sparse
    >>> residual = acc.index_fill_(0, res.counted, 0)
"""

from __future__ import annotations

from typing import Callable

import torch
import torch.distributed as dist

from flashsgd.comm.sparse import (Counted, GTopk, bytes_as_words, found_in, gtopk_allreduce,
                                  gtopk_bytes_sent, topk_exact, wire_index_dtype)
from flashsgd.comm.sparse.slices import hgtopk_slices_allreduce
from flashsgd.comm.topology import Topology, check_timeout_s
from flashsgd.comm.waits import wait_collective
from flashsgd.exchanges import NODE_SPLITS

Select = Callable[[torch.Tensor, int], tuple[torch.Tensor, torch.Tensor]]


def check_node_layout(ranks_per_node: int, world_size: int) -> int:
    """Return ``ranks_per_node`` if it is an integer >= 1 dividing ``world_size``, else ValueError
    naming the value and the valid ones (no process group work: call before building groups)."""
    if isinstance(ranks_per_node, bool) or not isinstance(ranks_per_node, int) or \
            ranks_per_node < 1 or world_size % ranks_per_node:
        valid = ", ".join(str(d) for d in range(1, world_size + 1) if world_size % d == 0)
        raise ValueError(f"hgtopk: ranks_per_node must divide the world size {world_size}; got "
                         f"{ranks_per_node!r}, valid: {valid}")
    return ranks_per_node


def broadcast_len(k: int, dtype: torch.dtype, numel: int) -> int:
    """Words (of :func:`~flashsgd.comm.sparse.wire_index_dtype` (numel)) of the node broadcast:
    2 k indices + the k values' bytes in whole words."""
    word = wire_index_dtype(numel).itemsize
    return 2 * k + -(-k * dtype.itemsize // word)


def _broadcast_msg(res: GTopk, k: int, numel: int) -> torch.Tensor:
    """Message of words of wire_index_dtype(numel): k global indices, k counted indices padded
    with -1, the values' bytes."""
    word = wire_index_dtype(numel)
    counted = torch.where(res.mine.survived, res.mine.positions, -1).to(word)  # fixed k: no size read
    return torch.cat([res.indices.to(word), counted,
                      bytes_as_words(res.values.contiguous().view(torch.uint8), word)])


def _unpack_broadcast(msg: torch.Tensor, k: int, dtype: torch.dtype) -> GTopk:
    item = dtype.itemsize
    counted = msg[k:2 * k].to(torch.int64)
    values = msg[2 * k:].view(torch.uint8)[:k * item].view(dtype)
    return GTopk(values, msg[:k].to(torch.int64), Counted(counted.clamp(min=0), counted >= 0))


def hgtopk_allreduce(acc: torch.Tensor, k: int, topology: Topology, *, out: torch.Tensor,
                     select: Select = topk_exact, check: bool = True,
                     timeout_s: float | None = None, timings: dict | None = None,
                     split: str = "leader") -> GTopk:
    """Hierarchical gTop-k of the sum of every rank's ``acc``: node reduce, leaders' gTop-k, broadcast.

    Steps 1-4 of the module docstring; step 5 (the residual) is the caller's:
    ``acc.index_fill_(0, result.counted, 0)``.

    Args:
        acc: this rank's flat accumulated gradient (read only).
        k: pairs in the result, 1 <= k <= numel (the same on every rank).
        topology: from :func:`~flashsgd.comm.topology.get_topology` (node and cross groups).
        out: flat tensor of acc's numel; overwritten with the global sum at the k indices, zero
            elsewhere (not averaged).
        select: ``select(x, k) -> (values, int64 indices)``, the leader's local selection.
        check: verify equal k and numel across the leaders first (one tiny exchange).
        timeout_s: deadline of each wait on a peer (``None``: the topology's).
        timings: passed to :func:`~flashsgd.comm.sparse.gtopk_allreduce` (leaders' merge time).
        split: ``"leader"`` (this module's steps), ``"slices"`` (R parallel gTop-k over R
            slices of the gradient, :mod:`flashsgd.comm.sparse.slices`) or ``"sparse"`` (each
            rank selects, gTop-k inside the node replaces the dense reduce; no dense traffic).

    Returns:
        :class:`~flashsgd.comm.sparse.GTopk`: the global values and indices (identical on every
        rank) and the indices of this rank's ``acc`` whose values are inside the sum.

    Raises:
        PeerTimeout: a peer of the node collectives or of the leaders' exchange did not answer.

    Example::

        >>> res = hgtopk_allreduce(acc, k, get_topology(ranks_per_node=2), out=bucket)
        >>> bucket.div_(dist.get_world_size()); acc.index_fill_(0, res.counted, 0)
    """
    n = acc.numel()
    if out.dim() != 1 or out.numel() != n or acc.dim() != 1:
        raise ValueError(f"acc and out must be flat with the same numel, got {tuple(acc.shape)} "
                         f"and {tuple(out.shape)}")
    if isinstance(k, bool) or not isinstance(k, int) or not 1 <= k <= n:
        raise ValueError(f"k must be an integer in [1, numel={n}], got {k!r}")
    if split not in NODE_SPLITS:
        raise ValueError(f"hgtopk: split must be one of {', '.join(NODE_SPLITS)}, got {split!r}")
    timeout_s = topology.timeout_s if timeout_s is None else check_timeout_s(timeout_s)
    if split == "slices":
        return hgtopk_slices_allreduce(acc, k, topology, out=out, select=select, check=check,
                                       timeout_s=timeout_s, timings=timings)
    if split == "sparse":
        return _sparse_in_node(acc, k, topology, out, select, check, timeout_s, timings)
    leader = topology.local_rank == 0
    node = topology.node_group
    # Step 1: node sum on the leader (out is the buffer; acc stays this rank's)
    out.copy_(acc)
    if node is not None:
        work = dist.reduce(out, dst=topology.node_ranks[0], group=node, async_op=True)
        wait_collective(work, node, timeout_s, "hgtopk, node reduce", out)
    msg = torch.empty(broadcast_len(k, acc.dtype, n), dtype=wire_index_dtype(n), device=acc.device)
    if leader:
        # Step 2: the leader's selection over the node sum
        values, indices = select(out, k)
        # Step 3: gTop-k among the leaders (a single node: its own selection is the result)
        if topology.num_nodes > 1:
            res = gtopk_allreduce(values, indices, k, n, topology.cross_group, check=check,
                                  timeout_s=timeout_s, timings=timings)
        else:
            res = GTopk(values, indices, Counted.every(indices))
        msg = _broadcast_msg(res, k, n)
    # Step 4: the result to every rank of the node
    if node is not None:
        work = dist.broadcast(msg, src=topology.node_ranks[0], group=node, async_op=True)
        wait_collective(work, node, timeout_s, "hgtopk, node broadcast", msg)
    res = _unpack_broadcast(msg, k, acc.dtype)
    out.zero_()
    out[res.indices] = res.values
    return res


def _sparse_in_node(acc: torch.Tensor, k: int, topology: Topology, out: torch.Tensor, select: Select,
                    check: bool, timeout_s: float, timings: dict | None) -> GTopk:
    """``split="sparse"``: every rank selects k of its own acc; gTop-k inside the node (fast
    links) gives the node's k pairs to all its ranks; the leaders run gTop-k across nodes and
    broadcast the result inside the node. A rank's value is counted if it survived the node
    merge and the node's entry survived the cross-node merges."""
    n = acc.numel()
    values, indices = select(acc, k)
    node = topology.node_group
    if node is not None:  # Step 1': the node's merge, identical on its R ranks
        res = gtopk_allreduce(values, indices, k, n, node, check=check, timeout_s=timeout_s,
                              timings=timings)
        values, indices, mine = res.values, res.indices, res.mine
    else:
        mine = Counted.every(indices)
    msg = torch.empty(broadcast_len(k, acc.dtype, n), dtype=wire_index_dtype(n), device=acc.device)
    if topology.local_rank == 0:  # Step 3 among the leaders
        res = (gtopk_allreduce(values, indices, k, n, topology.cross_group, check=check,
                               timeout_s=timeout_s, timings=timings)
               if topology.num_nodes > 1 else GTopk(values, indices, Counted.every(indices)))
        msg = _broadcast_msg(res, k, n)
    if node is not None:  # Step 4
        work = dist.broadcast(msg, src=topology.node_ranks[0], group=node, async_op=True)
        wait_collective(work, node, timeout_s, "hgtopk, node broadcast", msg)
    res = _unpack_broadcast(msg, k, acc.dtype)
    out.zero_()
    out[res.indices] = res.values
    # counted: survived the node merge, and the node's entry survived the cross-node merges
    node_counted = torch.where(res.mine.survived, res.mine.positions, -1).sort().values  # -1s first: never found
    return GTopk(res.values, res.indices, Counted(mine.positions, mine.survived & found_in(mine.positions, node_counted)))


def hgtopk_bytes_sent(k: int, topology: Topology, numel: int,
                      dtype: torch.dtype = torch.float32, split: str = "leader") -> dict[str, int]:
    """Bytes this rank hands to the backend in :func:`hgtopk_allreduce`, by link level.

    ``{"node": ..., "cross": ...}`` for each ``split`` (upper bounds where a backend's tree may
    forward more on larger nodes):

    * ``"leader"``: inside the node, a non-leader sends its dense acc (4 m bytes for fp32) and the
      leader the broadcast message to each of the R - 1 others (Gloo's broadcast tree at most);
      across nodes, the leader the bytes of :func:`~flashsgd.comm.sparse.gtopk_bytes_sent` over
      the N leaders.
    * ``"slices"``: inside the node, slice j of acc to each local rank j (the reduce-scatter) and
      this rank's packed slice result to each of the R - 1 others (the all-gather); across nodes,
      gTop-k of k_l pairs of its slice over the N ranks of its local rank.
    * ``"sparse"``: inside the node, gTop-k among the R ranks and, on the leader, the broadcast;
      across nodes, the leader's gTop-k over the N leaders.
    """
    from flashsgd.comm.sparse.slices import slice_bounds, slice_k

    if split not in NODE_SPLITS:
        raise ValueError(f"hgtopk: split must be one of {', '.join(NODE_SPLITS)}, got {split!r}")
    item = dtype.itemsize
    r, local, nodes = topology.ranks_per_node, topology.local_rank, topology.num_nodes
    word = wire_index_dtype(numel).itemsize
    bcast = word * broadcast_len(k, dtype, numel)
    if split == "slices":
        bounds = slice_bounds(numel, r)
        sizes = [bounds[j + 1] - bounds[j] for j in range(r)]
        ks = [slice_k(k, numel, size) if size else 0 for size in sizes]
        kmax = max(ks)
        packed = word * (2 * kmax + -(-kmax * item // word))  # sparse_slices._pack_slice
        node = sum(size for j, size in enumerate(sizes) if j != local) * item + (r - 1) * packed
        cross = gtopk_bytes_sent(ks[local], nodes, topology.node, dtype, sizes[local]) if ks[local] else 0
        return {"node": node, "cross": cross}
    if split == "sparse":
        node = gtopk_bytes_sent(k, r, local, dtype, numel) + (0 if local else (r - 1) * bcast)
        cross = 0 if local else gtopk_bytes_sent(k, nodes, topology.node, dtype, numel)
        return {"node": node, "cross": cross}
    if local:
        return {"node": numel * item, "cross": 0}
    return {"node": (r - 1) * bcast, "cross": gtopk_bytes_sent(k, nodes, topology.node, dtype, numel)}
