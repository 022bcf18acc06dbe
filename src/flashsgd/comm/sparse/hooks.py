"""DDP communication hooks ``topk``, ``gtopk``, ``hgtopk`` and ``oktopk``: sparsified gradient exchange with error feedback.

Paper: Shi et al. 2019, gTop-k S-SGD (arXiv 1901.04359); the exchanges are in
:mod:`flashsgd.comm.sparse`. Use::

    state = register_hook(ddp_model, "gtopk", density=0.001, density_warmup=0.25,
                          density_warmup_steps=steps_per_epoch)
    ...train...
    ckpt["hook"] = state.state_dict(); state.load_state_dict(ckpt["hook"])

Per bucket and step (after ``start_iter`` dense iterations):
    1. acc = bucket gradient + this bucket's residual (local, un-averaged units). With DGC's
       corrections (Lin et al. 2018, arXiv 1712.01887; :mod:`flashsgd.comm.sparse.corrections`):
       the gradient is first clipped to ``local_clip``; with ``momentum_correction`` = m > 0 the
       velocity u = m*u + g (not g) is added to the residual, and the optimizer must run
       without momentum (``state.owns_momentum``).
    2. k = ceil(density(step) * numel), step = iterations seen by the hook (dense ones included);
       select the k largest |acc| (``exact``: torch.topk,
       ``sampled``: sampled threshold, :func:`~flashsgd.comm.sparse.topk_sampled`, ``threshold``:
       block maxima and a kept threshold; without momentum correction its block maxima come
       fused with step 1's add, :func:`_accumulate`).
    3. Exchange: ``topk`` all-gathers every rank's pairs and sums them; ``gtopk`` runs the
       butterfly merge tree and keeps the global k; ``oktopk`` sends each region's pairs to its
       owner, which sums them and keeps the region's top k/P, then gathers the regions
       (:mod:`flashsgd.comm.sparse.oktopk`).
    4. residual = acc with the counted local entries zeroed (error feedback invariant:
       sum_r acc_r == world * update + sum_r residual_r); with ``momentum_masking`` the
       velocity is zeroed there too (DGC's momentum-factor masking).
    5. The bucket becomes sum / world (DDP's average semantics), zero outside the selected indices.

Units and skipped steps (:mod:`flashsgd.comm.hook_step`): the bucket is first divided by the
step's loss scale (fp16; 1 otherwise), so that residuals, velocities, clipping and LARS layer norms
are all in true gradient units, and multiplied back before it returns to DDP; a step the trainer
skips puts back every memory it started from (``begin_step`` / ``end_step``).

Iterations ``0 .. start_iter-1`` use a dense all-reduce (grad / world, summed; with momentum
correction the velocity u = m*u + g, so that these steps are plain momentum SGD), as DDP does: DDP
rebuilds its buckets after the first iteration, so no residual exists before the layout is final.
Residuals are keyed by bucket index and remember which parameters (by position in the model) they
cover; if the layout ever differs (a rebuild, or a checkpoint from another ``bucket_cap_mb``),
all residuals (and velocities) are split per parameter and re-assembled for the new buckets, so
no mass is lost.

Gloo has no futures for send/recv. By default the sparse step runs synchronously inside the hook
and returns a completed Future. With ``threaded=True`` steps 3-5 of a bucket (and the hook's
other collectives) run on one communication thread (:class:`~flashsgd.comm.hook_common.CommThread`,
FIFO, so every rank issues them in bucket order), and the hook returns at once: the selection of
the next bucket and the rest of backward overlap the exchange (measured: docs/benchmarks.md,
"overlap"). Not for models that issue collectives inside backward themselves (SyncBatchNorm).
The dense warm-up iterations are synchronous.

Phase timing (``flashsgd bench sparse`` times this step, not a copy of it): ``state.clock`` is
None, and then nothing is timed and no clock is read; a benchmark sets it to an object with
``lap(phase)`` and a ``timings`` dict (:class:`flashsgd.bench.sparse_steps.PhaseClock`), and the
synchronous step calls ``lap`` after each phase (``accum``, ``select``, ``exchange``, ``scatter``:
steps 1, 2, 3, 4-5) and hands ``timings`` to gTop-k (its ``merge`` seconds, inside ``exchange``).

Checkpoints: ``state.state_dict()`` / ``load_state_dict()`` (iteration, residuals with their
layouts, the sampled selection's RNG state, counters). Pickling drops the process group and the
id-based parameter map; an unpickled state must be re-attached with
``ddp.register_comm_hook(state.bind(ddp), sparse_hook)`` (it refuses to run unbound).

``hgtopk`` (:mod:`flashsgd.comm.sparse.hier`): the node's ranks reduce acc densely to their
leader, which selects and runs gTop-k with the other nodes' leaders, then broadcasts the result
inside the node; every rank keeps its own residual. Options ``ranks_per_node`` and ``node_split``
("leader"; "slices": R parallel gTop-k over R slices; "sparse": gTop-k inside the node instead of
the dense reduce, the fastest on the emulated 4x2 cluster, docs/benchmarks.md).

Options: :class:`flashsgd.exchanges.SparseOptions` (``topk``, ``gtopk``) and
:class:`~flashsgd.exchanges.HierSparseOptions` (``hgtopk``: ``ranks_per_node``, ``node_split``),
every default stated there once with its source. ``timeout_s`` is the deadline of every wait on a
peer, dense warm-up included: a rank that stops makes the others raise
:class:`~flashsgd.comm.errors.PeerTimeout` naming the peer they waited for; with ``threaded`` it
reaches ``backward()`` through the Future.

Per-exchange behaviour is one row of :data:`EXCHANGE_STEPS` (where the selection runs, the
exchange call, the bytes it sends); the shared per-bucket step (:func:`prepare_sparse`) never asks
which exchange it runs. The state (residuals, layouts, checkpoints) is
:mod:`flashsgd.comm.sparse.state`.

Sparse step of one bucket (numbers as in the hooks' module docstring):

1. ``acc = residual + grad`` into a new tensor (the kept residual stays intact until the step is
   kept: a skipped step puts it back, :mod:`flashsgd.comm.hook_step`). When the selection reads
   block maxima of acc (``threshold`` selection on acc: ``topk``, ``gtopk``, ``hgtopk`` with the
   ``sparse`` node split) and no momentum correction sits between the add and the selection, the
   add and the block maxima are one call (:func:`~flashsgd.comm.sparse.fused.add_block_maxima`,
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
"""

from __future__ import annotations

from typing import Any, Callable, NamedTuple

import torch
import torch.distributed as dist

from flashsgd.comm.hook_common import completed_future, ddp_hook
from flashsgd.comm.sparse import (SELECTIONS, Counted, check_sizes, gtopk_allreduce, gtopk_bytes_sent,
                                  k_from_density, topk_allgather, topk_bytes_sent)
from flashsgd.comm.sparse.corrections import accumulate_velocity, clip_local_, mask_momentum_
from flashsgd.comm.sparse.fused import add_block_maxima
from flashsgd.comm.sparse.hier import check_node_layout, hgtopk_allreduce, hgtopk_bytes_sent
from flashsgd.comm.sparse.oktopk import oktopk_allreduce
from flashsgd.comm.sparse.select import auto_block, topk_threshold
from flashsgd.comm.sparse.state import SparseHookState
from flashsgd.comm.topology import default_timeout_s
from flashsgd.comm.waits import wait_collective
from flashsgd.exchanges import SparseOptions, names, resolved_selection
from flashsgd.host_syncs import path_device_type

__all__ = ["SPARSE_EXCHANGES", "EXCHANGE_STEPS", "SparseHookState", "sparse_hook", "sparse_factory",
           "prepare_sparse", "dense_iteration", "select"]


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
        timeout_s = default_timeout_s() if state.options.timeout_s is None else state.options.timeout_s
        wait_collective(work, state.process_group, timeout_s,
                        f"{state.algorithm} hook, dense iteration {state.iter}", buf)
    state.bytes_sent += (2 * (world - 1) * n * buf.element_size()) // world  # ring volume
    state.dense_buckets += 1
    state.last_density = 1.0


def _dense_momentum(state: SparseHookState, bucket: dist.GradBucket, buf: torch.Tensor) -> None:
    """A dense iteration with momentum correction: ``buf`` <- the momentum update of its gradient
    (``u = m*u + g``, or ``g + m*u`` after ``u = m*u + g`` for Nesterov, torch.optim.SGD's forms)."""
    # DGC's velocity is m * (torch's buffer) in the Nesterov form; the update is the same
    update, velocity = accumulate_velocity(torch.zeros_like(buf), state.velocity(bucket), buf,
                                           state.momentum, state.options.nesterov,
                                           out_velocity=state.scratch("velocity", bucket.index(), buf))
    buf.copy_(update)
    state.keep(bucket.index(), state.layout(bucket), None, velocity)


def _accumulate(state: SparseHookState, bucket: dist.GradBucket, buf: torch.Tensor, k: int
                ) -> tuple[torch.Tensor, torch.Tensor | None, torch.Tensor | None]:
    """Step 1: (acc, velocity or None, block maxima of acc or None). acc is the residual plus the
    (clipped) gradient, or plus the velocity with momentum correction, written into the state's
    spare buffers (:meth:`~flashsgd.comm.sparse.state.SparseHookState.scratch`: the kept residual
    and velocity stay as they were until the step is kept, :mod:`flashsgd.comm.hook_step`); the
    maxima come fused with the add when the selection uses them."""
    idx = bucket.index()
    residual, out = state.residual(bucket), state.scratch("residual", idx, buf)
    if state.owns_momentum:
        acc, velocity = accumulate_velocity(residual, state.velocity(bucket), buf, state.momentum,
                                            state.options.nesterov, out=out,
                                            out_velocity=state.scratch("velocity", idx, buf))
        return acc, velocity, None
    reads_acc = EXCHANGE_STEPS[state.algorithm].selects_acc(state.options)
    threshold = resolved_selection(state.options.selection, path_device_type(buf)) == "threshold"
    block = auto_block(buf.numel(), k) if threshold and reads_acc else None
    if block is None:
        return torch.add(residual, buf, out=out), None, None
    acc, bmax = add_block_maxima(residual, buf, block, state.options.compiled, out=out)
    return acc, None, bmax


def select(state: SparseHookState, x: torch.Tensor, k: int, idx: int, rank: int,
           bmax: torch.Tensor | None = None):
    """Step 2: the state's selection of k entries of x (bucket ``idx``; ``bmax``: x's block
    maxima at :func:`~flashsgd.comm.sparse.select.auto_block`, for the threshold selection)."""
    selection = resolved_selection(state.options.selection, path_device_type(x))
    if selection == "threshold":
        return topk_threshold(x, k, reuse=state.reuse, key=idx, bmax=bmax)
    if selection == "sampled":
        return SELECTIONS["sampled"](x, k, generator=state.sampling_generator(x.device, rank),
                                     workspace=state.workspace)
    return SELECTIONS["exact"](x, k)


def prepare_sparse(state: SparseHookState, bucket: dist.GradBucket, buf: torch.Tensor,
                   world: int) -> Callable[[], torch.Tensor]:
    """Steps 1-2 of one bucket now; returns the rest (steps 3-5, and the hook's collectives), a
    call that returns the averaged bucket."""
    group, idx, n = state.process_group, bucket.index(), buf.numel()
    rank = dist.get_rank(group)
    layout = state.layout(bucket)
    density = state.options.density_at(state.iter)
    k = k_from_density(n, density)
    # Step 1 (a layout change splits every bucket's residual: none may be in flight then)
    if state.layout_changed(bucket):
        state.drain()
    acc, velocity, bmax = _accumulate(state, bucket, buf, k)
    _lap(state, "accum")
    # Step 2 (hgtopk: inside the exchange, after its node step)
    exchange = EXCHANGE_STEPS[state.algorithm]
    picked = select(state, acc, k, idx, rank, bmax) if exchange.selects_first else None
    _lap(state, "select")

    def rest() -> torch.Tensor:
        if state.options.layer_trust:  # buf is still the (clipped) gradient here
            state.record_layer_norms(layout, idx, buf)
        if idx not in state.checked:  # once per bucket: the same numel on every rank
            check_sizes(k, n, k, group, f"{state.algorithm} hook, bucket {idx}", state.options.timeout_s,
                        buf.device)
            state.checked.add(idx)
        # Steps 3 and 5: the exchange, the bucket = sum / world
        counted = exchange.run(state, buf, acc, k, picked, (idx, rank, world), bmax)
        # Step 4: residual = acc minus what was counted; momentum-factor masking (fixed sizes: no
        # host sync, flashsgd.comm.sparse.Counted)
        counted.zero_(acc)
        if velocity is not None and state.options.momentum_masking:
            mask_momentum_(velocity, counted)
        state.keep(idx, layout, acc, velocity)
        state.sparse_buckets += 1
        state.last_density = density
        _lap(state, "scatter")
        return buf

    return rest


def _topk(state: SparseHookState, buf: torch.Tensor, acc: torch.Tensor, k: int, picked,
          where: tuple[int, int, int], bmax: torch.Tensor | None) -> torch.Tensor:
    """``topk``: every rank's k pairs to every other rank, summed; every local pick is counted."""
    (_, _, world), n = where, buf.numel()
    values, indices = picked
    topk_allgather(values, indices, n, state.process_group, check=False, out=buf,
                   timeout_s=state.options.timeout_s)
    _lap(state, "exchange")
    buf.div_(world)
    state.bytes_sent += topk_bytes_sent(k, world, values.dtype, n)
    return Counted.every(indices)


def _gtopk(state: SparseHookState, buf: torch.Tensor, acc: torch.Tensor, k: int, picked,
           where: tuple[int, int, int], bmax: torch.Tensor | None) -> torch.Tensor:
    """``gtopk``: the butterfly merge tree; counted: the local picks that survived every merge."""
    (_, rank, world), n = where, buf.numel()
    values, indices = picked
    res = gtopk_allreduce(values, indices, k, n, state.process_group, check=False,
                          timeout_s=state.options.timeout_s, timings=_timings(state))
    _lap(state, "exchange")
    buf.zero_()
    buf[res.indices] = res.values.div(world)
    state.bytes_sent += gtopk_bytes_sent(k, world, rank, values.dtype, n)
    return res.mine


def _hgtopk(state: SparseHookState, buf: torch.Tensor, acc: torch.Tensor, k: int, picked,
            where: tuple[int, int, int], bmax: torch.Tensor | None) -> torch.Tensor:
    """``hgtopk``: the node step (``node_split``), Step 2 on the node's sum, gTop-k among nodes."""
    (idx, rank, world), n = where, buf.numel()

    def node_select(x: torch.Tensor, k_: int):
        _lap(state, "exchange")  # the node step so far
        picked = select(state, x, k_, idx, rank, bmax if x is acc else None)
        _lap(state, "select")
        return picked

    res = hgtopk_allreduce(acc, k, state.topology, out=buf, check=False, timeout_s=state.options.timeout_s,
                           select=node_select, split=state.options.node_split, timings=_timings(state))
    _lap(state, "exchange")
    buf.div_(world)
    state.bytes_sent += sum(hgtopk_bytes_sent(k, state.topology, n, buf.dtype,
                                                 state.options.node_split).values())
    return res.mine


def _oktopk(state: SparseHookState, buf: torch.Tensor, acc: torch.Tensor, k: int, picked,
            where: tuple[int, int, int], bmax: torch.Tensor | None) -> torch.Tensor:
    """``oktopk``: split and reduce by regions, gather each region's top k/P (counted: the local
    picks sent and in the result); the bucket's regions re-balanced from the result."""
    (idx, _, world), n = where, buf.numel()
    values, indices = picked
    bounds, starts = state.regions.of(idx, n, world, buf.device)
    traffic = {"bytes": 0}
    res = oktopk_allreduce(values, indices, k, n, bounds, state.process_group, out=buf, starts=starts,
                           timeout_s=state.options.timeout_s, traffic=traffic)
    _lap(state, "exchange")
    buf.div_(world)
    state.regions.after(idx, res.indices, n, world)
    state.bytes_sent += traffic["bytes"]
    return res.mine


def _lap(state: SparseHookState, phase: str) -> None:
    """Phase timing (module docstring): the time since the clock's last lap goes to ``phase``;
    nothing without a clock."""
    if state.clock is not None:
        state.clock.lap(phase)


def _timings(state: SparseHookState) -> dict | None:
    """gTop-k's own split of its time (``merge``) for the clock; None without one."""
    return None if state.clock is None else state.clock.timings


class ExchangeStep(NamedTuple):
    """What differs between the sparse exchanges inside one bucket's step."""

    selects_first: bool
    """Step 2 on the backward thread, before the exchange (False: the exchange selects inside)."""
    selects_acc: Callable[[Any], bool]
    """Whether the selection reads this rank's acc (so its block maxima can be fused with Step 1)."""
    run: Callable[..., torch.Tensor]
    """Steps 3 and 5: ``run(state, buf, acc, k, picked, (idx, rank, world), bmax) -> counted``."""


EXCHANGE_STEPS: dict[str, ExchangeStep] = {
    "topk": ExchangeStep(True, lambda options: True, _topk),
    "gtopk": ExchangeStep(True, lambda options: True, _gtopk),
    "hgtopk": ExchangeStep(False, lambda options: options.node_split == "sparse", _hgtopk),
    "oktopk": ExchangeStep(True, lambda options: True, _oktopk),
}
SPARSE_EXCHANGES = tuple(names("sparse"))
"""The catalog's sparse exchanges (each one's hook is :func:`sparse_factory`)."""
assert set(EXCHANGE_STEPS) == set(SPARSE_EXCHANGES), "every sparse exchange of the catalog needs a step"


@ddp_hook
def sparse_hook(state: SparseHookState, bucket: dist.GradBucket) -> torch.futures.Future:
    """Average one DDP bucket through the ``topk``, ``gtopk`` or ``hgtopk`` exchange with error
    feedback.

    Steps as in the module docstring (:func:`prepare_sparse`); dense all-reduce
    (grad / world, then sum) before ``options.start_iter``. Synchronous (a completed Future) unless
    ``options.threaded``: then the exchange runs on the state's communication thread and the
    Future completes there.
    """
    if state.param_positions is None:
        raise RuntimeError("sparse hook state is not bound to a model (unpickled?): call "
                           "state.bind(ddp_model) before ddp_model.register_comm_hook(state, sparse_hook)")
    buf = bucket.buffer()
    world, n = dist.get_world_size(state.process_group), buf.numel()
    step, last, group = state.step, bucket.is_last(), state.process_group
    step.arrive(state, bucket)  # the first bucket of a backward closes the step before (hook_step)
    step.unscale_(buf)  # true gradient units (fp16: the loss scale divided out; hook_step)
    clip_local_(buf, state.options.local_clip)  # Step 1: local clipping
    if state.iter < state.options.start_iter:  # dense: the thread is idle (DDP waited for last iteration's)
        if state.options.layer_trust:
            state.record_layer_norms(state.layout(bucket), bucket.index(), buf)
        dense_iteration(state, bucket, buf, world)
        rest = None
    elif n:
        rest = prepare_sparse(state, bucket, buf, world)
    else:  # an empty bucket: only its (empty) layer norms, in order with the other buckets
        layout, idx = state.layout(bucket), bucket.index()
        rest = (lambda: state.record_layer_norms(layout, idx, buf) or buf) if state.options.layer_trust else None
    if last:
        state.iter += 1

    def done(out: torch.Tensor) -> torch.Tensor:  # loss-scaled units again; the last bucket agrees
        return step.finish_(step.rescale_(out), last, group)

    threaded = state.comm is not None and not buf.is_cuda
    if rest is None and not (last and threaded):
        return completed_future(done(buf))
    if threaded:  # the last bucket's agreement too, in order after the buckets still on the thread
        work = rest or (lambda: buf)
        state.pending_job = state.comm.submit(lambda: done(work()))
        return state.pending_job
    return completed_future(done(rest()))


def sparse_factory(algorithm: str) -> Callable:
    """The factory of the sparse hook ``algorithm`` (one of :data:`SPARSE_EXCHANGES`)."""
    def make(ddp_model: Any, options: SparseOptions) -> tuple[SparseHookState, Callable]:
        ranks_per_node = getattr(options, "ranks_per_node", None)
        if ranks_per_node is not None:  # checked before any process group is built
            check_node_layout(ranks_per_node, dist.get_world_size(getattr(ddp_model, "process_group", None)))
        module = getattr(ddp_model, "module", ddp_model)
        for name, p in module.named_parameters():
            if p.requires_grad and not p.is_floating_point():
                raise ValueError(f"hook {algorithm!r}: parameter {name!r} is {p.dtype}; "
                                 "gradients must be floating point")
        return SparseHookState(algorithm, options).bind(ddp_model), sparse_hook

    make.__name__ = f"make_{algorithm}"
    make.__doc__ = f"The {algorithm} sparse hook (options: flashsgd.exchanges; see flashsgd.comm.sparse.hooks)."
    return make
