"""DDP communication hook ``powersgd``: torch's own PowerSGD hook, with a checkpointable state.

Paper: Vogels, Karimireddy, Jaggi 2019, "PowerSGD: Practical Low-Rank Gradient Compression for
Distributed Optimization" (arXiv 1905.13727). The algorithm is torch's
``torch.distributed.algorithms.ddp_comm_hooks.powerSGD_hook.powerSGD_hook`` with its
``PowerSGDState``, not a re-implementation; this module only adapts it to the registry of
:mod:`flashsgd.comm.hooks`:

1. :func:`make_powersgd` builds a ``PowerSGDState`` on DDP's process group (rank
   ``matrix_approximation_rank``, dense all-reduce before ``start_iter``, error feedback and
   warm start on: torch's recommended settings).
2. :class:`PowerSGDHookState` holds it and adds ``state_dict()`` / ``load_state_dict()`` (the
   interface every hook state has): iteration, error-feedback memories, the P/Q warm-start
   memories and the NumPy RNG that seeds Q, as tensors and numbers (``torch.load(weights_only=True)``
   reads them).
3. :func:`powersgd_hook` calls torch's hook with the inner state, after re-ordering the bucket's
   memories when the bucket's parameters changed (:meth:`PowerSGDHookState.follow_layout`).
   torch keys its memories by bucket index only, but DDP rebuilds its buckets after the first
   iteration of every DDP instance (reversed parameter order for a one-bucket model): after a
   resume, the first step would add one parameter's error to another's gradient. The memories are
   therefore cut per parameter (error: the parameter's slice; P: n*r, Q: m*r of each compressed
   matrix, torch's order) and re-assembled for the new layout, which keeps a resumed run on the
   uninterrupted run's trajectory.
   On Gloo each bucket's chain of all-reduces runs on a communication thread, one bucket after the
   other (torch's callbacks would otherwise interleave the buckets' collectives differently on
   each rank), while backward goes on.

Per bucket, torch's hook all-reduces the 1-D tensors (biases, norms) uncompressed and, for each
matrix M (n x m) of the bucket, two all-reduces of P = M Q (n x r) and Q = M^T P (m x r): cost
2 * alpha + (n + m) * r * 4 bytes * 2(P-1)/P per matrix instead of n * m * 4 * 2(P-1)/P.

Example::

    >>> state = register_hook(ddp_model, "powersgd", matrix_approximation_rank=2)  # doctest: +SKIP
    >>> ckpt["hook"] = state.state_dict(); state.load_state_dict(ckpt["hook"])     # doctest: +SKIP
"""

from __future__ import annotations

import math
from typing import Any, Callable

import numpy as np
import torch
import torch.distributed as dist
from torch.distributed.algorithms.ddp_comm_hooks import powerSGD_hook as _torch_powersgd
from torch.distributed.algorithms.ddp_comm_hooks.powerSGD_hook import (PowerSGDState, _should_compress,
                                                                      powerSGD_hook)

from flashsgd.comm.dense import native_stages
from flashsgd.comm.hook_common import CommThread, check_owner, ddp_hook, mean_tensors, rank_and_world
from flashsgd.comm.hook_step import HookStep
from flashsgd.exchanges import LowRankOptions

_MEMORIES = ("error_dict", "p_memory_dict", "q_memory_dict")
_COUNTERS = ("iter", "total_numel_before_compression", "total_numel_after_compression",
             "next_stats_report")


class PowerSGDHookState:
    """Holds torch's ``PowerSGDState`` (``.powersgd``) and checkpoints it (Step 2).

    Args:
        powersgd: torch's state.
        param_positions: ``{id(parameter): position in model.parameters()}`` (memory re-ordering).
    """

    __slots__ = ("powersgd", "param_positions", "layouts", "pending", "comm", "step", "saved")

    def __init__(self, powersgd: PowerSGDState, param_positions: dict[int, int]) -> None:
        self.powersgd = powersgd
        self.param_positions = param_positions
        self.comm = CommThread()  # Gloo: each bucket's chain of all-reduces, in bucket order
        self.layouts: dict[int, tuple] = {}  # bucket index -> ((position, shape), ...) in buffer order
        self.pending: dict[str, dict[int, torch.Tensor]] = {}  # memory name -> position -> piece
        self.step = HookStep("powersgd")  # the open training step: loss scale, non-finite inputs (hook_step)
        self.saved: dict | None = None  # what the open step started from (begin_step)

    def use_scaler(self, scaler: Any) -> "PowerSGDHookState":
        """The loop's ``torch.amp.GradScaler`` (None: none): the hook reads each step's loss scale
        from it (:mod:`flashsgd.comm.hook_step`). Returns the state."""
        self.step.scaler = scaler
        return self

    def begin_step(self, grad_scale: torch.Tensor | None = None) -> None:
        """Step 1 of :mod:`flashsgd.comm.hook_step`: this step's buckets carry ``grad_scale``;
        remember the state. torch's hook replaces each error tensor (``error_dict[i] = M' - M``)
        but writes P and Q in place (``matmul(..., out=)``, orthogonalization): those are copied
        (n*r + m*r per matrix: small), the rest is kept by reference."""
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
        """Step 4: keep the step, or put back exactly what :meth:`begin_step` saw (torch's
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
        for name in _MEMORIES:
            pieces = self.pending.get(name)
            if pieces and all(pos in pieces for pos, _ in layout):
                getattr(self.powersgd, name)[idx] = torch.cat([pieces.pop(pos) for pos, _ in layout])
            memory = getattr(self.powersgd, name)
            if idx in memory and (memory[idx].device != buf.device or memory[idx].dtype != buf.dtype):
                memory[idx] = memory[idx].to(buf)  # a checkpoint loads on the CPU: follow the bucket

    def _cut(self, name: str, flat: torch.Tensor, layout: tuple) -> list[torch.Tensor]:
        """``flat`` (memory ``name`` of a bucket of ``layout``) as one piece per parameter (empty
        for parameters torch does not compress), following torch's own size rules."""
        sizes = []
        for _, shape in layout:
            n, m = shape[0] if shape else 1, math.prod(shape[1:]) if len(shape) > 1 else 1
            rank = min(n, m, self.powersgd.matrix_approximation_rank)
            rate = self.powersgd.min_compression_rate
            compressed = len(shape) > 1 and _should_compress(n, m, rank, rate)[0]
            numel = math.prod(shape)
            sizes.append({"error_dict": numel, "p_memory_dict": n * rank if compressed else 0,
                          "q_memory_dict": m * rank if compressed else 0}[name])
        return [piece.clone() for piece in flat.split(sizes)]

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
        """Restore :meth:`state_dict` (same model and bucket layout: torch's memories are per bucket)."""
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
    """Step 3: torch's ``powerSGD_hook`` on the inner ``PowerSGDState`` (memories re-ordered first
    when DDP changed the bucket's parameters, and moved to the bucket's device), in true gradient
    units: the bucket is divided by the step's loss scale first and multiplied back after, so
    that the error feedback and Q are kept unscaled (:mod:`flashsgd.comm.hook_step`)."""
    step, last, group = state.step, bucket.is_last(), state.powersgd.process_group
    step.arrive(state, bucket)  # the first bucket of a backward closes the step before (hook_step)
    state.follow_layout(bucket)
    step.unscale_(bucket.buffer())

    def done(out: Any) -> torch.Tensor:  # loss-scaled units again; the last bucket shows the agreement
        return step.finish_(step.rescale_(_tensor(out)), last, group)

    if native_stages(bucket.buffer()):  # NCCL: the chain is enqueued on the stream in order
        if last:
            step.agree(bucket.buffer(), group)  # before torch's chain: no collective in a callback
        fut = powerSGD_hook(state.powersgd, bucket)
        return fut if step.scale is None and not last else fut.then(lambda f: done(f.value()))
    # Gloo: torch's hook issues the Q all-reduce (and the decompression) in Future callbacks, on
    # Gloo's threads, while the backward thread goes on to the next bucket's P all-reduce: with
    # several buckets the ranks then issue collectives in different orders (a size mismatch or a
    # hang). The communication thread runs each bucket's whole chain before the next bucket's
    # (FIFO: one order on every rank, test_powersgd) while backward goes on.
    return state.comm.submit(lambda: done(powerSGD_hook(state.powersgd, bucket).wait()))


def _tensor(value: Any) -> torch.Tensor:
    """The bucket from a PowerSGD Future's value (a tensor, or a one-tensor list on some paths)."""
    return value[0] if isinstance(value, (list, tuple)) else value


class _CudaForAnyBucket:
    """``torch.cuda`` as torch's PowerSGD module sees it after :func:`_sync_cuda_buckets_only`:
    everything is torch.cuda's, except that ``synchronize`` of a non-CUDA device does nothing."""

    def __getattr__(self, name: str) -> Any:
        return getattr(torch.cuda, name)

    @staticmethod
    def synchronize(device: Any = None) -> None:
        if device is not None and torch.device(device).type != "cuda":
            return  # a CPU bucket: nothing on a GPU to wait for
        torch.cuda.synchronize(device)


class _TorchForAnyBucket:
    """``torch`` as torch's PowerSGD module sees it: torch itself but for ``torch.cuda``."""

    cuda = _CudaForAnyBucket()

    def __getattr__(self, name: str) -> Any:
        return getattr(torch, name)


def _sync_cuda_buckets_only() -> None:
    """Let torch's PowerSGD hook run on CPU buckets where CUDA is available (torch 2.11-2.13).

    Its decompression ends with ``if torch.cuda.is_available(): torch.cuda.synchronize(device)``
    on the bucket's device, which raises ``ValueError: Expected a cuda device, but got: cpu`` for
    a CPU bucket on any machine with a GPU (Gloo ranks computing on the CPU beside it; found by
    the GPU check on an H100). The module's name ``torch`` is pointed at a view of torch whose
    ``cuda.synchronize`` skips non-CUDA devices; every other name, and CUDA buckets, are torch's
    own. Idempotent; affects that one module only."""
    if not isinstance(_torch_powersgd.torch, _TorchForAnyBucket):
        _torch_powersgd.torch = _TorchForAnyBucket()


def make_powersgd(ddp_model: Any, options: LowRankOptions) -> tuple[PowerSGDHookState, Callable]:
    """``powersgd`` (Step 1): torch's PowerSGD hook on DDP's process group.

    Options (:class:`~flashsgd.exchanges.LowRankOptions`, defaults and sources there):
    ``matrix_approximation_rank`` r, ``start_iter`` (dense all-reduce iterations before
    compression, >= 2: DDP rebuilds its buckets after the first iteration; torch's default is 1000,
    ours matches the sparse hooks'), ``min_compression_rate``, ``seed`` (torch's RNG for the random
    initial Q, the same on every rank), ``timeout_s`` (validated only: torch's hook waits with the
    process group's own timeout).
    """
    _sync_cuda_buckets_only()
    group = getattr(ddp_model, "process_group", None) or dist.group.WORLD
    inner = PowerSGDState(group, matrix_approximation_rank=options.matrix_approximation_rank,
                          start_powerSGD_iter=options.start_iter,
                          min_compression_rate=options.min_compression_rate,
                          random_seed=int(options.seed), compression_stats_logging_frequency=10 ** 9)
    module = getattr(ddp_model, "module", ddp_model)
    positions = {id(p): i for i, p in enumerate(module.parameters())}
    return PowerSGDHookState(inner, positions), powersgd_hook
