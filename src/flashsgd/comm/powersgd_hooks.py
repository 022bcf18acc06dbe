"""DDP communication hook ``powersgd``: PowerSGD batched per bucket, with a checkpointable state.

Paper: Vogels, Karimireddy, Jaggi 2019, "PowerSGD: Practical Low-Rank Gradient Compression for
Distributed Optimization" (arXiv 1905.13727). The mathematics is that of torch's
``torch.distributed.algorithms.ddp_comm_hooks.powerSGD_hook.powerSGD_hook`` (the same matrices,
error feedback, warm start, random initial Q and orthogonalization; its results to rounding,
tests/test_powersgd.py), computed by :mod:`flashsgd.comm.lowrank` with one batched kernel per
matrix *shape* of a bucket instead of one kernel chain per matrix, and without the host
synchronization that ends torch's decompression of every bucket (``torch.cuda.synchronize``).
Torch's ``PowerSGDState`` is the container of the settings and of the memories, so checkpoints keep
torch's layout. This module adapts it to the registry of :mod:`flashsgd.comm.hooks`:

1. :func:`make_powersgd` builds a ``PowerSGDState`` on DDP's process group (rank
   ``matrix_approximation_rank``, dense all-reduce before ``start_iter``, error feedback and
   warm start on: torch's recommended settings).
2. :class:`PowerSGDHookState` holds it and adds ``state_dict()`` / ``load_state_dict()`` (the
   interface every hook state has): iteration, error-feedback memories, the P/Q warm-start
   memories and the NumPy RNG that seeds Q, as tensors and numbers (``torch.load(weights_only=True)``
   reads them), in torch's per-bucket layout (error: the bucket's order; P and Q: matrix by matrix,
   grouped by shape in the order a shape first occurs, as torch lays them out).
3. :func:`powersgd_hook` runs one bucket (:func:`exchange`), after re-ordering the bucket's
   memories when the bucket's parameters changed (:meth:`PowerSGDHookState.follow_layout`).
   The memories are keyed by bucket index, but DDP rebuilds its buckets after the first
   iteration of every DDP instance (reversed parameter order for a one-bucket model): after a
   resume, the first step would add one parameter's error to another's gradient. The memories are
   therefore cut per parameter (error: the parameter's slice; P: n*r, Q: m*r of each compressed
   matrix) and re-assembled for the new layout, which keeps a resumed run on the uninterrupted
   run's trajectory. The grouping of a layout is computed once (:meth:`PowerSGDHookState.plan`).
   NCCL: the bucket's all-reduces are chained through their Futures (each next step in a
   ``.then()`` callback, which runs at once on a stream that waits for the collective on the
   GPU): neither the host nor the backward stream waits. Gloo: each bucket's chain runs on a
   communication thread, one bucket after the other (the same collective order on every rank),
   while backward goes on; each wait is bounded by ``timeout_s``.

Per bucket: one all-reduce of the uncompressed tensors (biases, norms), one of all its Ps
(P = M Q, n x r per matrix M n x m) and one of all its Qs (Q = M^T P, m x r): cost
3 * 2(W-1) alpha + 2(W-1)/W (u + sum (n + m) r) * 4 bytes beta at W ranks, instead of
2(W-1) alpha + 2(W-1)/W sum n m * 4 bytes beta for the dense all-reduce; compute and kernel counts
in :mod:`flashsgd.comm.lowrank`.

Example::

    >>> state = register_hook(ddp_model, "powersgd", matrix_approximation_rank=2)  # doctest: +SKIP
    >>> ckpt["hook"] = state.state_dict(); state.load_state_dict(ckpt["hook"])     # doctest: +SKIP
"""

from __future__ import annotations

import functools
from typing import Any, Callable

import numpy as np
import torch
import torch.distributed as dist
from torch.distributed.algorithms.ddp_comm_hooks.powerSGD_hook import PowerSGDState

from flashsgd.comm import lowrank
from flashsgd.comm.dense import native_stages
from flashsgd.comm.hook_common import (CommThread, check_owner, completed_future, ddp_hook, mean_tensors,
                                       rank_and_world)
from flashsgd.comm.hook_step import HookStep
from flashsgd.host_syncs import device_path
from flashsgd.comm.topology import default_timeout_s
from flashsgd.comm.waits import grouped, wait_collective
from flashsgd.exchanges import LowRankOptions

_MEMORIES = ("error_dict", "p_memory_dict", "q_memory_dict")
_COUNTERS = ("iter", "total_numel_before_compression", "total_numel_after_compression",
             "next_stats_report")
_SEED_RANGE = 1_000_000_000  # torch's hook seeds each draw of Q with rng.randint(10**9)


class PowerSGDHookState:
    """Holds torch's ``PowerSGDState`` (``.powersgd``) and checkpoints it (Step 2).

    Args:
        powersgd: torch's state (settings, memories, RNG, counters).
        param_positions: ``{id(parameter): position in model.parameters()}`` (memory re-ordering).
        timeout_s: Gloo's deadline per all-reduce (None: the default group's timeout).
    """

    __slots__ = ("powersgd", "param_positions", "timeout_s",  # settings
                 "layouts", "pending", "plans",  # bucket layouts: memories follow them
                 "comm", "step", "saved")  # the open step

    def __init__(self, powersgd: PowerSGDState, param_positions: dict[int, int],
                 timeout_s: float | None = None) -> None:
        self.powersgd = powersgd
        self.param_positions = param_positions
        self.timeout_s = timeout_s
        self.comm: CommThread | None = CommThread()  # Gloo: each bucket's chain, in bucket order (None: inline)
        self.layouts: dict[int, tuple] = {}  # bucket index -> ((position, shape), ...) in buffer order
        self.pending: dict[str, dict[int, torch.Tensor]] = {}  # memory name -> position -> piece
        self.plans: dict[tuple, lowrank.BucketPlan] = {}  # shapes of a bucket -> its grouping (Step 1)
        self.step = HookStep("powersgd")  # the open training step: loss scale, non-finite inputs (hook_step)
        self.saved: dict | None = None  # what the open step started from (begin_step)

    def use_scaler(self, scaler: Any) -> "PowerSGDHookState":
        """The loop's ``torch.amp.GradScaler`` (None: none): the hook reads each step's loss scale
        from it (:mod:`flashsgd.comm.hook_step`). Returns the state."""
        self.step.scaler = scaler
        return self

    def begin_step(self, grad_scale: torch.Tensor | None = None) -> None:
        """Step 1 of :mod:`flashsgd.comm.hook_step`: this step's buckets carry ``grad_scale``;
        remember the state. Each step makes a new error tensor (``e = M - M'``) but writes P and
        Q in place (matrix products into them, orthogonalization): those are copied (n*r + m*r
        per matrix: small), the rest is kept by reference."""
        self.step.begin(grad_scale)
        s = self.powersgd
        self.saved = {"iter": s.iter, "error_dict": dict(s.error_dict),
                      "p_memory_dict": {k: v.clone() for k, v in s.p_memory_dict.items()},
                      "q_memory_dict": {k: v.clone() for k, v in s.q_memory_dict.items()},
                      "rng": s.rng.get_state(), "layouts": dict(self.layouts),
                      "pending": {name: dict(d) for name, d in self.pending.items()}}

    def nonfinite_inputs(self) -> torch.Tensor | None:
        """Step 3: buckets that arrived non-finite on this rank in the open step (None: none ran)."""
        return self.step.bad

    def end_step(self, kept: bool) -> None:
        """Step 4: keep the step, or put back exactly what :meth:`begin_step` saw (the
        compression statistics keep counting)."""
        saved, self.saved = self.saved, None
        self.step.end()
        if kept or saved is None:
            return
        s = self.powersgd
        s.iter, s.error_dict = saved["iter"], saved["error_dict"]
        s.p_memory_dict, s.q_memory_dict = saved["p_memory_dict"], saved["q_memory_dict"]
        s.rng.set_state(saved["rng"])
        self.layouts, self.pending = saved["layouts"], saved["pending"]

    def layout(self, bucket: dist.GradBucket) -> tuple:
        """((parameter position, shape), ...) of the bucket, in buffer order."""
        return tuple((self.param_positions[id(p)], tuple(p.shape)) for p in bucket.parameters())

    def plan(self, layout: tuple) -> lowrank.BucketPlan:
        """The grouping of a bucket of ``layout`` (:func:`flashsgd.comm.lowrank.plan_bucket`),
        computed once per distinct list of shapes."""
        shapes = tuple(shape for _, shape in layout)
        plan = self.plans.get(shapes)
        if plan is None:
            s = self.powersgd
            plan = self.plans[shapes] = lowrank.plan_bucket(shapes, s.matrix_approximation_rank,
                                                            s.min_compression_rate)
        return plan

    def follow_layout(self, bucket: dist.GradBucket) -> None:
        """Step 3: when this bucket's layout changed, cut every bucket's memories per parameter;
        then give this bucket the pieces of its parameters."""
        idx, layout = bucket.index(), self.layout(bucket)
        if self.layouts.get(idx, layout) != layout:
            for name in _MEMORIES:
                pieces = self.pending.setdefault(name, {})
                for i, flat in getattr(self.powersgd, name).items():
                    positions = [pos for pos, _ in self.layouts[i]]
                    pieces.update(zip(positions, self._cut(name, flat, self.layouts[i])))
                getattr(self.powersgd, name).clear()
            self.layouts = {}
        self.layouts[idx] = layout
        buf = bucket.buffer()
        order = [layout[i][0] for i in self.plan(layout).gather]  # positions, P and Q memory order
        for name in _MEMORIES:
            pieces = self.pending.get(name)
            if pieces and all(pos in pieces for pos, _ in layout):
                positions = [pos for pos, _ in layout] if name == "error_dict" else order
                getattr(self.powersgd, name)[idx] = torch.cat([pieces[pos] for pos in positions])
                for pos, _ in layout:
                    del pieces[pos]
            memory = getattr(self.powersgd, name)
            if idx in memory and (memory[idx].device != buf.device or memory[idx].dtype != buf.dtype):
                memory[idx] = memory[idx].to(buf)  # a checkpoint loads on the CPU: follow the bucket

    def _cut(self, name: str, flat: torch.Tensor, layout: tuple) -> list[torch.Tensor]:
        """``flat`` (memory ``name`` of a bucket of ``layout``) as one piece per parameter, in
        layout order (empty in P and Q for parameters that are not compressed)."""
        plan = self.plan(layout)
        if name == "error_dict":
            return [piece.clone() for piece in flat.split(plan.numels)]
        pieces = plan.p_pieces if name == "p_memory_dict" else plan.q_pieces
        return [flat[at:at + size].clone() for at, size in pieces]

    def state_dict(self) -> dict:
        """Iteration, counters, per-bucket memories (cloned) and the RNG state, as plain values. A
        step whose backward is done is closed first (:mod:`flashsgd.comm.hook_step`, Step 4)."""
        self.step.settle(self)
        s = self.powersgd
        kind, keys, pos, has_gauss, cached = s.rng.get_state()
        rank, world = rank_and_world(s.process_group) or (None, None)
        return {"algorithm": "powersgd", "rank": rank, "world": world,  # error_dict is this rank's
                **{name: getattr(s, name) for name in _COUNTERS},
                **{name: {k: v.clone() for k, v in getattr(s, name).items()} for name in _MEMORIES},
                "layouts": {i: [[pos, list(shape)] for pos, shape in lay]
                            for i, lay in self.layouts.items()},
                "pending": {name: {k: v.clone() for k, v in d.items()} for name, d in self.pending.items()},
                "rng": {"kind": kind, "keys": torch.from_numpy(keys.astype(np.int64)), "pos": int(pos),
                        "has_gauss": int(has_gauss), "cached_gaussian": float(cached)}}

    def load_state_dict(self, state: dict) -> None:
        """Restore :meth:`state_dict` (also one written while torch's own hook ran inside: the
        same keys and layout)."""
        if state.get("algorithm") != "powersgd":
            raise ValueError(f"state_dict is for hook {state.get('algorithm')!r}, not 'powersgd'")
        check_owner(state, "powersgd", self.powersgd.process_group)
        self.step.end()  # an open step is forgotten: the loaded state is where the next one starts
        self.saved = None
        s = self.powersgd
        for name in _COUNTERS:
            setattr(s, name, int(state[name]))
        for name in _MEMORIES:
            setattr(s, name, {int(k): v.clone() for k, v in state[name].items()})
        self.layouts = {int(i): tuple((int(pos), tuple(shape)) for pos, shape in lay)
                        for i, lay in state["layouts"].items()}
        self.pending = {name: {int(k): v.clone() for k, v in d.items()}
                        for name, d in state["pending"].items()}
        r = state["rng"]
        s.rng.set_state((r["kind"], r["keys"].numpy().astype(np.uint32), r["pos"], r["has_gauss"],
                         r["cached_gaussian"]))

    @staticmethod
    def regroup(states: list[dict], rank: int, world: int) -> dict:
        """This rank's state on ``world`` ranks from the ``states`` of every rank of another world
        size (an elastic resume): the error feedback (``error_dict``, per rank) is averaged over
        the old ranks (its contribution to the update, sum over ranks / world, is kept); P and Q,
        the counters and the RNG are the same on every rank and are taken from rank 0's."""
        first = states[0]
        out = {**first, "rank": rank, "world": world,
               "error_dict": mean_tensors([st["error_dict"] for st in states])}
        if first["pending"].get("error_dict"):
            out["pending"] = {**first["pending"],
                              "error_dict": mean_tensors([st["pending"].get("error_dict", {}) for st in states])}
        return out


@ddp_hook(host_staged=False)  # Gloo all-reduces CUDA tensors itself
def powersgd_hook(state: PowerSGDHookState, bucket: dist.GradBucket) -> torch.futures.Future:
    """Step 3: :func:`exchange` of the bucket (memories re-ordered first when DDP changed the
    bucket's parameters, and moved to the bucket's device), in true gradient units: the bucket is
    divided by the step's loss scale first and multiplied back after, so that the error feedback
    and Q are kept unscaled (:mod:`flashsgd.comm.hook_step`)."""
    step, last, group = state.step, bucket.is_last(), state.powersgd.process_group
    step.arrive(state, bucket)  # the first bucket of a backward closes the step before (hook_step)
    state.follow_layout(bucket)
    buf, index = bucket.buffer(), bucket.index()
    step.unscale_(buf)

    def done(out: torch.Tensor) -> torch.Tensor:  # loss-scaled units again; the last bucket shows the agreement
        return step.finish_(step.rescale_(out), last, group)

    if native_stages(buf):  # NCCL: the chain is enqueued on the GPU in order, nothing waits
        if last:
            step.agree(buf, group)  # before the chain: no collective of the step in a callback of another
        fut = exchange(state, index, buf, last)
        return fut if step.scale is None and not last else fut.then(lambda f: done(f.value()))

    # Gloo: one bucket's whole chain (its three all-reduces) before the next bucket's, on the
    # communication thread (FIFO: one order on every rank, test_powersgd) while backward goes on
    def run() -> torch.Tensor:
        return done(exchange(state, index, buf, last).value())

    return completed_future(run()) if state.comm is None else state.comm.submit(run)


def exchange(state: PowerSGDHookState, index: int, buf: torch.Tensor, last: bool) -> torch.futures.Future:
    """One bucket of PowerSGD (:mod:`flashsgd.comm.lowrank`, Steps 2-6), averaged over the
    state's group, in place in ``buf``; a Future of ``buf``. Before ``start_powerSGD_iter``: the
    dense average (the bucket / W, all-reduced). The steps after an all-reduce run in a
    ``.then()`` callback of its Future: on NCCL (CUDA tensors) it completes when enqueued, so the
    callbacks run at once on streams that wait on the GPU; elsewhere every all-reduce is waited
    for (at most ``state.timeout_s``) and its Future is completed, so the callbacks run inline.
    The iteration advances at the last bucket (torch's rule)."""
    s = state.powersgd
    group = s.process_group if s.process_group is not None else dist.group.WORLD
    world = group.size()
    allreduce = functools.partial(_allreduce, group=group, timeout_s=state.timeout_s)
    if s.iter < s.start_powerSGD_iter:  # dense iterations (DDP's bucket rebuild happens in them)
        if last:
            s.iter += 1
        buf.div_(world)  # first: no overflow in half precision
        return allreduce(buf).then(functools.partial(_value_is, buf))

    # Step 2 (lowrank), with torch's bookkeeping: statistics, fresh memories, its RNG draw
    plan = state.plan(state.layouts[index])
    s.total_numel_before_compression += plan.numel_before
    s.total_numel_after_compression += plan.numel_after
    if last and s.iter >= s.next_stats_report:
        s.next_stats_report = s.iter + s.compression_stats_logging_frequency
    error = s.error_dict.get(index) if s.use_error_feedback else None
    if not s.warm_start or index not in s.p_memory_dict:
        s.p_memory_dict[index] = buf.new_empty(plan.p_numel)
        s.q_memory_dict[index] = buf.new_empty(plan.q_numel)  # pageable source: staged, no host wait
        draw = lowrank.draw_q(plan, s.rng.randint(_SEED_RANGE), buf.dtype)
        s.q_memory_dict[index].copy_(draw, non_blocking=buf.is_cuda)
    p, q = s.p_memory_dict[index], s.q_memory_dict[index]
    if error is not None:
        _used_here(error)
    # batched on the CUDA path (one kernel per group); matrix by matrix in place on a CPU (lowrank.compress)
    ops = lowrank.compress(buf, plan, error, p, q, s.orthogonalization_epsilon, batched=device_path(buf))

    # Step 3: all-reduce u and P (issued together); Steps 4-6 follow in callbacks
    fut_u = allreduce(ops.u) if plan.uncompressed else None
    fut_p = allreduce(p) if plan.p_numel else None
    first = fut_p if fut_p is not None else fut_u if fut_u is not None else completed_future(None)
    chain = first.then(functools.partial(_project_back, state, plan, ops, p, q, fut_u, world, allreduce))
    return chain.then(functools.partial(_decompress, state, index, plan, buf, ops, p, q, world, last))


def _project_back(state: PowerSGDHookState, plan: lowrank.BucketPlan, ops: lowrank.Operands, p: torch.Tensor,
                  q: torch.Tensor, fut_u: torch.futures.Future | None, world: int, allreduce: Callable,
                  previous: torch.futures.Future) -> Any:
    """Steps 4-5: u /= W, orthogonalize P, Q = M^T P, all-reduce Q (NCCL: ``wait()`` only makes this
    callback's stream wait for it)."""
    previous.value()  # re-raise an all-reduce's error
    if fut_u is not None:
        fut_u.wait()
    _used_here(ops.work if ops.work is not None else ops.u)
    lowrank.project_back(ops, plan, p, q, world, state.powersgd.orthogonalization_epsilon)
    return allreduce(q).wait() if plan.q_numel else None


def _decompress(state: PowerSGDHookState, index: int, plan: lowrank.BucketPlan, buf: torch.Tensor,
                ops: lowrank.Operands, p: torch.Tensor, q: torch.Tensor, world: int, last: bool,
                previous: torch.futures.Future) -> torch.Tensor:
    """Step 6: Q /= W, the bucket <- P Q^T (the uncompressed tensors' average beside), the new
    error kept; the iteration advances at the last bucket. The value is ``buf``."""
    previous.value()
    _used_here(ops.work if ops.work is not None else ops.u)
    s = state.powersgd
    error = lowrank.decompress(buf, ops, plan, p, q, world)
    if s.use_error_feedback:
        s.error_dict[index] = error
    if not s.warm_start:
        s.p_memory_dict.clear()
        s.q_memory_dict.clear()
    if last:
        s.iter += 1
    return buf


def _allreduce(tensor: torch.Tensor, group: Any, timeout_s: float | None) -> torch.futures.Future:
    """Sum ``tensor`` over ``group`` in place. NCCL (:func:`~flashsgd.comm.waits.grouped`): the
    work's Future, completed when enqueued; otherwise waited for here (at most ``timeout_s``) and a
    completed Future returned (no callback ever waits on a Gloo thread)."""
    work = dist.all_reduce(tensor, group=group, async_op=True)
    if grouped(tensor, group):
        return work.get_future()
    wait_collective(work, group, default_timeout_s() if timeout_s is None else timeout_s, "powersgd all-reduce",
                    tensor)
    return completed_future(tensor)


def _value_is(tensor: torch.Tensor, previous: torch.futures.Future) -> torch.Tensor:
    previous.value()
    return tensor


def _used_here(tensor: torch.Tensor) -> None:
    """A CUDA tensor made on another stream (the backward's, or an earlier callback's) and used on
    the current one: its memory is not reused before this stream's work on it has run."""
    if tensor.is_cuda:
        tensor.record_stream(torch.cuda.current_stream(tensor.device))


def make_powersgd(ddp_model: Any, options: LowRankOptions) -> tuple[PowerSGDHookState, Callable]:
    """``powersgd`` (Step 1): PowerSGD on DDP's process group, torch's ``PowerSGDState`` as its state.

    Options (:class:`~flashsgd.exchanges.LowRankOptions`, defaults and sources there):
    ``matrix_approximation_rank`` r, ``start_iter`` (dense all-reduce iterations before
    compression, >= 2: DDP rebuilds its buckets after the first iteration; torch's default is 1000,
    ours matches the sparse hooks'), ``min_compression_rate``, ``seed`` (torch's RNG for the random
    initial Q, the same on every rank), ``timeout_s`` (Gloo's deadline per all-reduce; NCCL's
    collectives are bounded by the process group's own timeout).
    """
    group = getattr(ddp_model, "process_group", None) or dist.group.WORLD
    inner = PowerSGDState(group, matrix_approximation_rank=options.matrix_approximation_rank,
                          start_powerSGD_iter=options.start_iter,
                          min_compression_rate=options.min_compression_rate,
                          random_seed=int(options.seed), compression_stats_logging_frequency=10 ** 9)
    module = getattr(ddp_model, "module", ddp_model)
    positions = {id(p): i for i, p in enumerate(module.parameters())}
    return PowerSGDHookState(inner, positions, options.timeout_s), powersgd_hook
