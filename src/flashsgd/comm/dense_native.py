"""Dense all-reduce as a chain of NCCL's own collectives, asynchronous and in place: what a dense
algorithm with a :class:`NativeChain` in its record (:data:`flashsgd.comm.dense.DENSE`: ``ring``,
``hierarchical``, ``torus2d``) runs on CUDA tensors over NCCL (:mod:`flashsgd.comm.dense` picks it,
the DDP hooks return its Future).

A DDP hook runs on the backward stream; a synchronous NCCL collective makes that stream wait, so
every later backward kernel would wait for this bucket's exchange. :func:`native_chain` issues each
stage from a ``.then()`` callback of the previous stage's Future instead (as torch's PowerSGD hook
chains its all-reduces): nothing waits on the host or on the caller's stream, and the exchange
overlaps the rest of backward, as DDP's own all-reduce does. The stages are NCCL's in-place forms
(no copy of the bucket when the group size divides it), and averaging is folded into the reducing
stages (``ReduceOp.AVG``). On Gloo the same chain runs with every stage waited for (the tests check
it on CPU ranks); the algorithms use their own send/recv rings there.

Example::

    >>> topo = get_topology(grid="2x4")                      # 8 ranks, NCCL
    >>> fut = native_chain(bucket, topo.row_group, topo.col_group, "avg")
    >>> fut = NativeChain("row", "col").future(bucket, topo, "avg")   # the same, as torus2d's record says
"""

from __future__ import annotations

import functools
from dataclasses import dataclass
from typing import Any, Callable

import torch
import torch.distributed as dist
from torch.distributed import ProcessGroup

from flashsgd.comm.hook_common import completed_future
from flashsgd.comm.topology import Topology, default_timeout_s
from flashsgd.comm.waits import grouped, wait_collective

# torch >= 2.13 renames the tensor-in/tensor-out collectives (the old names warn); accept both.
all_gather_single = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor
_reduce_scatter_single = getattr(dist, "reduce_scatter_single", None) or dist.reduce_scatter_tensor

GROUP_KINDS = ("world", "row", "col", "node", "cross")
"""The topology's group kinds a chain can run over (:func:`stage_group`)."""


@dataclass(frozen=True)
class NativeChain:
    """The NCCL path of a dense algorithm: :func:`native_chain` over two of the topology's group kinds.

    Reduce-scatter and all-gather over the ``inner`` group, all-reduce of the shard over the
    ``outer`` one (``None``: no such stage). Cost: :func:`native_chain`'s with X = |inner|,
    Y = |outer|: ``NativeChain("world", None)`` is the ring's 2(P-1) a + 2(P-1)/P n b,
    ``NativeChain(None, "world")`` one NCCL all-reduce (NCCL picks ring or tree itself).

    Example::

        >>> NativeChain("node", "cross").future(bucket, topo, "avg")   # hierarchical on NCCL
    """

    inner: str | None
    """Group kind of the reduce-scatter and the all-gather (one of :data:`GROUP_KINDS`, or None)."""
    outer: str | None
    """Group kind of the shard's all-reduce (one of :data:`GROUP_KINDS`, or None)."""

    def __post_init__(self) -> None:
        for field, kind in (("inner", self.inner), ("outer", self.outer)):
            if kind is not None and kind not in GROUP_KINDS:
                raise ValueError(f"NativeChain {field}={kind!r} is not a group kind; valid: "
                                 f"{', '.join(GROUP_KINDS)} or None")
        if self.inner is None and self.outer is None:
            raise ValueError("NativeChain needs an inner or an outer group kind (both None: no "
                             "stage); a Gloo-only algorithm registers native=None instead")

    def future(self, tensor: torch.Tensor, topology: Topology, op: str = "sum",
               where: str = "native chain") -> torch.futures.Future:
        """:func:`native_chain` of ``tensor`` over this rank's groups of ``topology``."""
        return native_chain(tensor, stage_group(topology, self.inner), stage_group(topology, self.outer),
                            op, timeout_s=topology.timeout_s, where=where)


def stage_group(topo: Topology, kind: str | None) -> ProcessGroup | None:
    """This rank's group of ``kind`` ("world", "row", "col", "node", "cross"; ``None``: no group);
    ``None`` for a group of one rank (nothing to communicate)."""
    if kind is None:
        return None
    if kind == "world":
        return dist.group.WORLD if topo.world_size > 1 else None
    return getattr(topo, f"{kind}_group")


def padded(flat: torch.Tensor, P: int) -> tuple[torch.Tensor, int]:
    """``(work, c)`` with c = ceil(n / P): ``flat`` itself when P * c = n, else ONE new buffer of
    P * c elements holding ``flat`` then zeros (one pass over the bucket; the zeros reduce to
    zeros and are never copied back). Chunk p of :func:`~flashsgd.comm.dense.chunk_bounds` is ``work[p c:(p+1) c]``
    cut to n, so the padding keeps the module's chunking."""
    n = flat.numel()
    c = -(-n // P)
    if P * c == n:
        return flat, c
    work = flat.new_empty(P * c)
    work[:n].copy_(flat)
    work[n:].zero_()
    return work, c


def issue_collective(kind: str, shard: torch.Tensor, work: torch.Tensor, group: ProcessGroup, op: str,
                timeout_s: float, where: str) -> torch.futures.Future:
    """Issue one native collective over ``group`` in place on ``work`` (P c elements; ``shard`` is
    ``work[p c:(p+1) c]``, p this rank's position in ``group``) and return a Future of it.

    * ``"reduce-scatter"``: shard <- reduction over the group of every rank's chunk p. In place:
      NCCL's output = input + p c (what ``reduce_scatter_tensor(shard, work)`` passes it).
    * ``"all-reduce"``: shard <- reduction of shard over the group (``work`` is ``shard``).
    * ``"all-gather"``: work <- every rank's shard, in place: input = output + p c.

    ``op`` "avg" is ``ReduceOp.AVG`` (NCCL >= 2.10; Gloo's divides the sum by the group size).
    On NCCL (:func:`~flashsgd.comm.waits.grouped`) the work's own Future: completed when the
    collective is enqueued, carrying CUDA events, so whatever waits on it waits on the GPU (a
    ``.then()`` callback runs on a stream synchronized with those events). Elsewhere (Gloo: no
    Future for reduce-scatter) the work is waited for here, at most ``timeout_s``
    (:func:`~flashsgd.comm.waits.wait_collective`), and a completed Future is returned.
    Cost: as the collective (reduce-scatter and all-gather (P-1) a + (P-1)/P m b each for m = P c
    elements; all-reduce 2(P-1) a + 2(P-1)/P m b); no copy.
    """
    reduce = dist.ReduceOp.AVG if op == "avg" else dist.ReduceOp.SUM
    if kind == "reduce-scatter":
        work_ = _reduce_scatter_single(shard, work, op=reduce, group=group, async_op=True)
    elif kind == "all-reduce":
        work_ = dist.all_reduce(shard, op=reduce, group=group, async_op=True)
    else:
        work_ = all_gather_single(work, shard, group=group, async_op=True)
    if grouped(work, group):
        return work_.get_future()
    wait_collective(work_, group, timeout_s, where, work)
    return completed_future(work)


def native_chain(tensor: torch.Tensor, inner: ProcessGroup | None, outer: ProcessGroup | None,
                 op: str = "sum", *, timeout_s: float | None = None,
                 where: str = "native chain") -> torch.futures.Future:
    """All-reduce ``tensor`` in place as a chain of native collectives; return a Future of ``tensor``.

    The three phases of hierarchical all-reduce (Goyal et al. 2017) and of 2D-Torus all-reduce
    (Mikami et al. 2018) with the inner group = node / row and the outer = cross / column; the ring
    (Patarasuk & Yuan 2009) with inner = world and no outer group. X = |inner|, Y = |outer|:
    Cost: 2(X-1) a_in + 2(X-1)/X n b_in + 2(Y-1) a_out + 2(Y-1)/(XY) n b_out + (P-1)/P n g, and
    no copy of the bucket when X divides n (else two: one into the padded buffer, one back).

    1. Pad once (:func:`padded`): ``work`` is ``tensor`` itself when X divides n, else one buffer
       of X c elements, c = ceil(n/X); ``shard`` = ``work[x c:(x+1) c]``, x = this rank's position
       in ``inner`` (chunk x of :func:`~flashsgd.comm.dense.chunk_bounds`, as on Gloo).
    2. Reduce-scatter ``work`` over ``inner`` into ``shard`` (in place).
    3. All-reduce ``shard`` over ``outer``; the X outer groups run concurrently.
    4. All-gather the shards over ``inner`` into ``work`` (in place).
    5. Copy ``work[:n]`` back into ``tensor`` if it was padded; the Future's value is ``tensor``.

    Each stage is issued from a ``.then()`` callback of the previous stage's Future (as torch's
    PowerSGD hook chains its all-reduces): on NCCL those Futures are completed when enqueued, so
    the callbacks run at once, on streams that wait for the previous stage on the GPU; the host
    and the caller's stream never wait (a DDP hook returns while backward goes on). Inside a
    callback ``fut.wait()`` of the next stage only makes the callback's stream wait for it. On
    Gloo every stage is waited for (deadline ``timeout_s``; ``None``: the default group's) before
    its Future, already completed, is returned, so the callbacks run inline on the calling thread
    and block no Gloo thread.

    ``op="avg"``: the reducing stages use ``ReduceOp.AVG``. Step 2 leaves (1/X) sum_inner x and
    Step 3 (1/Y) sum_outer of that; the inner x outer groups partition the P = XY ranks (each rank
    is in one of each, and they meet in one rank), so the result is (1/(XY)) sum_all x = (1/P)
    sum_all x: the average, with no separate division pass. (NCCL's AVG of floats scales each
    input by 1/group size before summing: one rounding more per stage in half precision.)

    Args:
        tensor: contiguous fp32/fp16/bf16 tensor, reduced in place (any shape; treated as flat).
        inner: group of the reduce-scatter and all-gather (``None``: no such stage).
        outer: group of the shard's all-reduce (``None``: no such stage).
        op: ``"sum"`` or ``"avg"`` (over the ranks of inner x outer).
        timeout_s: Gloo's deadline per collective; NCCL's is its groups' timeout.
        where: the algorithm, named in errors.

    Example::

        >>> topo = get_topology(grid="2x4")                      # 8 ranks, NCCL
        >>> fut = native_chain(bucket, topo.row_group, topo.col_group, "avg")
        >>> fut.wait() is bucket                                  # current stream waits, not the host
        True
    """
    flat = tensor.view(-1)
    n = flat.numel()
    if n == 0 or (inner is None and outer is None):
        return completed_future(tensor)
    timeout_s = default_timeout_s() if timeout_s is None else timeout_s
    # Step 1
    X = 1 if inner is None else dist.get_world_size(inner)
    work, c = padded(flat, X)
    x = 0 if inner is None else dist.get_rank(inner)
    shard = work[x * c:(x + 1) * c]
    # Steps 2-4: (kind, group, op) of each stage present; the all-gather only copies (op unused)
    stages = [(kind, group, op) for kind, group in
              (("reduce-scatter", inner), ("all-reduce", outer), ("all-gather", inner)) if group is not None]
    issue = [functools.partial(issue_collective, kind, shard, work, group, o, timeout_s, f"{where}, {kind}")
             for kind, group, o in stages]
    fut = issue[0]()
    for start in issue[1:]:
        fut = fut.then(functools.partial(_next_stage, start))
    # Step 5
    return fut.then(functools.partial(_unpad, tensor, work))


def _next_stage(start: Callable[[], torch.futures.Future], previous: torch.futures.Future) -> Any:
    """A link of :func:`native_chain`: re-raise the previous stage's error, or issue this stage.

    On NCCL ``wait()`` returns at once (the Future completed when its collective was enqueued) and
    makes this callback's stream wait for the collective on the GPU; the next link's callback
    stream waits for this one's. On Gloo the Future is already completed."""
    previous.value()
    return start().wait()


def _unpad(tensor: torch.Tensor, work: torch.Tensor, previous: torch.futures.Future) -> torch.Tensor:
    """The last link of :func:`native_chain`: copy the padded buffer back (the chain's one copy
    out, on a stream that waited for the all-gather) and give ``tensor`` as the value."""
    previous.value()
    flat = tensor.view(-1)
    if work is not flat:
        flat.copy_(work[:flat.numel()])
        if work.is_cuda:  # read on this callback's stream: not reused before the copy has run
            work.record_stream(torch.cuda.current_stream(work.device))
    return tensor
