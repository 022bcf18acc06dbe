"""One DDP bucket through the sparse hooks (:mod:`flashsgd.comm.sparse_hooks`): the dense warm-up
iteration, and the sparse step split into the part that stays on the backward thread and the part
that may run on the communication thread.

Paper: Shi et al. 2019, gTop-k S-SGD (arXiv 1901.04359) for the error-fed exchange; Lin et al.
2018, DGC (arXiv 1712.01887) for the corrections (:mod:`flashsgd.comm.sparse_corrections`).

Sparse step of one bucket (numbers as in the hooks' module docstring):

1. ``acc = residual + grad`` in place (the residual buffer becomes acc). When the selection reads
   block maxima of acc (``threshold`` selection on acc: ``topk``, ``gtopk``, ``hgtopk`` with the
   ``sparse`` node split) and no momentum correction sits between the add and the selection, the
   add and the block maxima are one call (:func:`~flashsgd.comm.sparse_fused.add_block_maxima_`,
   one fused pass with ``compiled=True``); the selection then reuses the maxima. Same result bit
   for bit: the add is the same IEEE add, the maxima are exact.
2. ``topk`` / ``gtopk``: select k of acc, on the backward thread.
3. The exchange (``hgtopk``: with its selection on the node sum inside), then
4. the residual (counted entries of acc zeroed; velocity masked) and
5. the bucket = sum / world.

With a communication thread (``threaded=True``), steps 3-5 of bucket i (and every other use of
the process group by the hook: the once-per-bucket size check, ``layer_trust``'s norms) run on
it, so the selection of bucket i + 1 overlaps the exchange of bucket i; all collectives of the
hook are issued by that one thread in bucket order, the same on every rank (DDP launches
buckets in index order). ``hgtopk`` hands steps 2-5 to the thread (its selection needs the node
reduce). Before a residual layout change (bucket rebuild, checkpoint of another layout), which
touches every bucket's residual, the hook waits for the thread's pending buckets.

Example::

    >>> job = prepare_sparse(state, bucket, buf, world)   # steps 1-2, backward thread
    >>> job()                                             # steps 3-5 (or state.comm.submit(job))
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Callable

import torch
import torch.distributed as dist

from flashsgd.comm.sparse import (SELECTIONS, check_sizes, gtopk_allreduce, gtopk_bytes_sent,
                                  k_from_density, topk_allgather, topk_bytes_sent)
from flashsgd.comm.sparse_corrections import accumulate_velocity_, mask_momentum_
from flashsgd.comm.sparse_fused import add_block_maxima_
from flashsgd.comm.sparse_hier import hgtopk_allreduce, hgtopk_bytes_sent
from flashsgd.comm.sparse_select import auto_block, topk_threshold
from flashsgd.comm.topology import default_timeout_s
from flashsgd.comm.waits import wait_collective

if TYPE_CHECKING:
    from flashsgd.comm.sparse_hooks import SparseHookState


def dense_iteration(state: SparseHookState, bucket: dist.GradBucket, buf: torch.Tensor,
                    world: int) -> None:
    """Iterations before ``start_iter``: grad / world summed by a dense all-reduce (with momentum
    correction, the bucket first becomes this rank's momentum update)."""
    if state.owns_momentum:  # dense momentum SGD: the bucket becomes this rank's velocity
        _dense_momentum(state, bucket, buf)
    buf.div_(world)
    n = buf.numel()
    if n:
        work = dist.all_reduce(buf, group=state.process_group, async_op=True)
        timeout_s = default_timeout_s() if state.timeout_s is None else state.timeout_s
        wait_collective(work, state.process_group, timeout_s,
                        f"{state.algorithm} hook, dense iteration {state.iter}")
    state.bytes_sent += (2 * (world - 1) * n * buf.element_size()) // world  # ring volume
    state.dense_buckets += 1
    state.last_density = 1.0


def _dense_momentum(state: SparseHookState, bucket: dist.GradBucket, buf: torch.Tensor) -> None:
    """A dense iteration with momentum correction: ``buf`` <- the momentum update of its gradient
    (``u = m*u + g``, or ``g + m*u`` after ``u = m*u + g`` for Nesterov, torch.optim.SGD's forms)."""
    velocity = state.velocity(bucket)
    update = torch.zeros_like(buf)
    # DGC's velocity is m * (torch's buffer) in the Nesterov form; the update is the same
    accumulate_velocity_(update, velocity, buf, state.momentum, state.nesterov)
    buf.copy_(update)
    state.keep(bucket.index(), state.layout(bucket), None, velocity)


def _selects_acc(state: SparseHookState) -> bool:
    """Whether the selection runs on this rank's acc (not on a node sum)."""
    return state.algorithm != "hgtopk" or state.node_split == "sparse"


def _accumulate(state: SparseHookState, bucket: dist.GradBucket, buf: torch.Tensor, k: int
                ) -> tuple[torch.Tensor, torch.Tensor | None, torch.Tensor | None]:
    """Step 1: (acc, velocity or None, block maxima of acc or None). acc is the residual plus the
    (clipped) gradient, or plus the velocity with momentum correction (the residual tensor is
    reused as acc's storage); the maxima come fused with the add when the selection uses them."""
    acc = state.residual(bucket)
    if state.owns_momentum:
        velocity = state.velocity(bucket)
        accumulate_velocity_(acc, velocity, buf, state.momentum, state.nesterov)
        return acc, velocity, None
    block = auto_block(buf.numel(), k) if state.selection == "threshold" and _selects_acc(state) else None
    if block is None:
        return acc.add_(buf), None, None
    return acc, None, add_block_maxima_(acc, buf, block, state.compiled)


def select(state: SparseHookState, x: torch.Tensor, k: int, idx: int, rank: int,
           bmax: torch.Tensor | None = None):
    """Step 2: the state's selection of k entries of x (bucket ``idx``; ``bmax``: x's block
    maxima at :func:`~flashsgd.comm.sparse_select.auto_block`, for the threshold selection)."""
    if state.selection == "threshold":
        return topk_threshold(x, k, reuse=state.reuse, key=idx, bmax=bmax)
    if state.selection == "sampled":
        if state.generator is None:
            state.generator = torch.Generator().manual_seed(state.seed * 65537 + rank)
        return SELECTIONS["sampled"](x, k, generator=state.generator, workspace=state.workspace)
    return SELECTIONS["exact"](x, k)


def prepare_sparse(state: SparseHookState, bucket: dist.GradBucket, buf: torch.Tensor,
                   world: int) -> Callable[[], torch.Tensor]:
    """Steps 1-2 of one bucket now; returns the rest (steps 3-5, and the hook's collectives), a
    call that returns the averaged bucket."""
    group, idx, n = state.process_group, bucket.index(), buf.numel()
    rank = dist.get_rank(group)
    layout = state.layout(bucket)
    density = state.schedule(state.iter)
    k = k_from_density(n, density)
    # Step 1 (a layout change splits every bucket's residual: none may be in flight then)
    if state.layout_changed(bucket):
        state.drain()
    acc, velocity, bmax = _accumulate(state, bucket, buf, k)
    # Step 2 (hgtopk: inside the exchange, after its node reduce)
    picked = select(state, acc, k, idx, rank, bmax) if state.algorithm != "hgtopk" else None

    def rest() -> torch.Tensor:
        if state.layer_trust:  # buf is still the (clipped) gradient here
            state.record_layer_norms(layout, idx, buf)
        if idx not in state.checked:  # once per bucket: the same numel on every rank
            check_sizes(k, n, k, group, f"{state.algorithm} hook, bucket {idx}", state.timeout_s)
            state.checked.add(idx)
        counted = _exchange(state, buf, acc, k, picked, (idx, rank, world), bmax)
        # Step 4: residual = acc minus what was counted; momentum-factor masking
        acc.index_fill_(0, counted, 0)
        if velocity is not None and state.momentum_masking:
            mask_momentum_(velocity, counted)
        state.keep(idx, layout, acc, velocity)
        state.sparse_buckets += 1
        state.last_density = density
        return buf

    return rest


def _exchange(state: SparseHookState, buf: torch.Tensor, acc: torch.Tensor, k: int, picked,
              where: tuple[int, int, int], bmax: torch.Tensor | None) -> torch.Tensor:
    """Steps 3 and 5: the exchange, the bucket = sum / world; returns this rank's counted indices."""
    (idx, rank, world), group, n = where, state.process_group, buf.numel()
    if state.algorithm == "hgtopk":  # Step 2 by the node's leader, on the node sum
        res = hgtopk_allreduce(acc, k, state.topology, out=buf, check=False, timeout_s=state.timeout_s,
                               select=lambda x, k_: select(state, x, k_, idx, rank,
                                                           bmax if x is acc else None),
                               split=state.node_split)
        buf.div_(world)
        state.bytes_sent += sum(hgtopk_bytes_sent(k, state.topology, n, buf.dtype).values())
        return res.counted
    values, indices = picked
    if state.algorithm == "topk":
        topk_allgather(values, indices, n, group, check=False, out=buf,
                       timeout_s=state.timeout_s).div_(world)
        state.bytes_sent += topk_bytes_sent(k, world, values.dtype, n)
        return indices
    res = gtopk_allreduce(values, indices, k, n, group, check=False, timeout_s=state.timeout_s)
    buf.zero_()
    buf[res.indices] = res.values.div(world)
    state.bytes_sent += gtopk_bytes_sent(k, world, rank, values.dtype, n)
    return res.counted
