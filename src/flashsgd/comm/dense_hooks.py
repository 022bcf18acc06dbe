"""DDP communication hooks for flashsgd's dense all-reduce algorithms (and ``native``, ``noop``).

Hooks (factories registered in :data:`flashsgd.comm.hooks.HOOKS`):

=============== ===============================================================================
``native``      registers nothing: DDP's built-in all-reduce (grad / W, then a sum all-reduce on
                DDP's process group). The baseline; same as ``default_hooks.allreduce_hook``.
``ring``        :func:`flashsgd.comm.dense.ring` on each bucket, average over the world.
``hierarchical`` :func:`~flashsgd.comm.dense.hierarchical`; option ``ranks_per_node`` (L).
``torus2d``     :func:`~flashsgd.comm.dense.torus2d`; option ``grid`` ("XxY").
``noop``        returns the bucket unchanged: gradients are NOT averaged, every rank steps on its
                own gradient. The ceiling of the training benchmark (zero communication), never
                for real training.
=============== ===============================================================================

The three dense hooks take ``ranks_per_node``, ``grid`` (the :class:`Topology`, built once at
registration, a collective call on every rank), ``threaded`` and ``timeout_s`` (the deadline of
every wait on a peer, :attr:`Topology.timeout_s`; ``None``: the default process group's timeout):
a rank that stops makes its peers raise :class:`~flashsgd.comm.errors.PeerTimeout` from
``backward()`` within about ``timeout_s``. ``native`` accepts ``timeout_s`` too, so one set of
options fits every hook, but DDP's built-in all-reduce is bounded by its process group's timeout
(``init_process_group(timeout=...)``); ``noop`` never waits. They call the algorithm with
``op="avg"`` (the average over the world: DDP's default semantics) and ``check=False``
(DDP gives every rank identical buckets; a per-bucket length check would add latency).

Futures and overlap. DDP calls a hook when a bucket's gradients are ready, during backward, and
waits for the returned futures at the end of backward. Three cases:

* NCCL (CUDA buckets on an NCCL group): the hook returns the Future of a chain of asynchronous
  native collectives (:func:`flashsgd.comm.dense.allreduce_future`: reduce-scatter, all-reduce
  of the shard, all-gather; each issued with ``async_op=True`` from a ``.then()`` of the
  previous one's Future, as torch's PowerSGD hook chains its all-reduces). Each stage waits for
  the previous one on the GPU; neither the host nor the backward stream waits for the exchange,
  so the backward kernels of the layers that remain run while it is in flight, as with DDP's own
  hook. DDP's wait at the end of backward makes its stream wait for the chain's last stage. (A
  collective with ``async_op=False`` would instead make the backward stream wait for it: every
  later backward kernel would queue behind this bucket's exchange.) ``threaded`` is ignored.
  Averaging is folded into the stages (``ReduceOp.AVG``); a bucket whose length is a multiple of
  the inner group's size is never copied, another is padded once and copied back once.
* Gloo, ``threaded=True`` (default): Gloo gives no futures for send/recv, so the bucket is handed
  to one communication thread per state (FIFO, so every rank issues the same collectives in the
  same order, since DDP launches buckets in index order) and the hook returns its pending Future
  at once; backward continues meanwhile, and DDP waits for the Futures at the end of backward.
  Not for models that run collectives inside backward themselves (SyncBatchNorm): two threads
  would then issue collectives concurrently.
* Gloo, ``threaded=False``: the bucket is reduced synchronously inside the hook and a completed
  Future is returned. Lost: overlap of this bucket's communication with the backward computation
  of the layers that remain; the backward thread waits for each bucket's all-reduce.

CUDA buckets on a Gloo group (several ranks on one GPU) are staged through the host and reduced
there (:func:`flashsgd.comm.hook_common.ddp_hook`): no overlap.

Measured (``python benchmarks/hook_threading.py --workers 4 --grid 2x2 --rounds 4 --steps 5``,
docs/benchmarks.md "DDP hooks: synchronous vs communication thread"), on the shared 2-core
machine: a 1.09 M-parameter MLP training step took 93.5 ms with the ring hook synchronous vs
85.6 ms threaded (native DDP: 59.1 ms), torus2d 98.3 vs 75.5 ms (1.08-1.30x for the thread); it
pays even with 4 ranks on 2 cores, since a rank waiting on its peers leaves the core to backward.

bucket_cap_mb (DDP's knob, in MiB: default 25 MiB; DDP's own first bucket is 1 MiB only when no cap is
given, and flashsgd always gives one) sets the message size of
each call: one bucket = one all-reduce. Large buckets put the algorithms in the bandwidth regime,
where ring, hierarchical and torus2d move the same 2(P-1)/P n bytes per rank and differ little;
small buckets are latency-bound, where torus2d's 2(X-1) + 2(Y-1) steps and hierarchical's
2(L-1) + 2(N-1) beat the flat ring's 2(P-1). Fewer, larger buckets also start later in backward,
which reduces overlap (on NCCL, or with ``threaded=True``). A bucket shorter than P elements still
works (empty chunks are skipped).

Example::

    >>> model = DDP(net, bucket_cap_mb=4)
    >>> state = register_hook(model, "hierarchical", ranks_per_node=4)
    >>> loss_fn(model(x), y).backward()      # gradients averaged by the hierarchical all-reduce
"""

from __future__ import annotations

from typing import Any, Callable

import torch
import torch.distributed as dist

from flashsgd.comm.dense import DENSE, DTYPES, allreduce_future, duplex_groups, native_path, native_stages
from flashsgd.comm.hook_common import (CommThread, HookFactory, StatelessHookState,
                                       completed_future, ddp_hook)
from flashsgd.comm.topology import Topology, get_topology
from flashsgd.exchanges import BUILT_IN, CommonOptions, DenseOptions, names

DENSE_HOOKS = tuple(n for n in names("dense") if n != BUILT_IN)
"""The catalog's dense exchanges with a hook of their own (``native`` is DDP's); each runs its
record in :data:`flashsgd.comm.dense.DENSE` (function and NCCL chain)."""


class DenseHookState(StatelessHookState):
    """State of the ``ring`` / ``hierarchical`` / ``torus2d`` hooks.

    Nothing here changes the numerics across steps, so the checkpointed state is empty; the
    process groups and the thread are dropped when pickled (``__getstate__``) and rebuilt lazily.

    Args:
        name: the algorithm (one of :data:`DENSE_HOOKS`).
        options: :class:`~flashsgd.exchanges.DenseOptions` (ranks per node, grid, threaded,
            timeout_s: every field documented there).
    """

    __slots__ = (
        "options",                                  # hyper-parameters
        "topology", "comm",                         # internal (not checkpointed)
        "buckets", "elements",                      # stats: calls and elements reduced
    )

    def __init__(self, name: str, options: DenseOptions = DenseOptions()) -> None:
        if name not in DENSE_HOOKS:
            raise ValueError(f"dense hook algorithm must be one of {', '.join(DENSE_HOOKS)}, got {name!r}")
        DENSE.get(name)  # a catalog name without its record fails here, listing the registered ones
        super().__init__(name)
        self.options = options
        self.topology: Topology | None = self._topology()
        duplex_groups(self.topology)  # collective: create any extra groups now, not in backward
        self.comm: CommThread | None = CommThread() if options.threaded else None
        self.buckets = 0
        self.elements = 0

    def _topology(self) -> Topology:
        o = self.options
        return get_topology(ranks_per_node=o.ranks_per_node, grid=o.grid, timeout_s=o.timeout_s)

    def __getstate__(self) -> dict:
        return {"name": self.name, "options": self.options, "buckets": self.buckets,
                "elements": self.elements}

    def __setstate__(self, state: dict) -> None:
        for key, value in state.items():
            setattr(self, key, value)
        self.topology = None
        self.comm = CommThread() if self.options.threaded else None


@ddp_hook
def dense_hook(state: DenseHookState, bucket: dist.GradBucket) -> torch.futures.Future:
    """Average one DDP bucket with ``state.name``'s algorithm (in place on the bucket's buffer).

    1. Take the bucket's flat buffer (DDP's gradients of several parameters, contiguous).
    2. All-reduce it with ``op="avg"``: on NCCL as a chain of asynchronous collectives (averaging
       folded in); on Gloo on the calling thread or on the state's communication thread (sum,
       then / world size).
    3. Return a Future of the buffer: the chain's (NCCL), completed later by the thread, or
       completed.
    """
    # Step 1
    buf = bucket.buffer()
    if state.topology is None:  # unpickled state: rebuild (every rank does it at the same bucket)
        state.topology = state._topology()
    fn, topo = DENSE.get(state.name).fn, state.topology
    state.buckets += 1
    state.elements += buf.numel()
    # Step 2
    if native_stages(buf):  # NCCL: Steps 2-3, a Future chained from asynchronous collectives
        return allreduce_future(buf, state.name, topo, op="avg")
    if state.comm is not None:  # Step 3 (pending Future, completed by the thread)
        return state.comm.submit(lambda: fn(buf, topo, op="avg", check=False))
    fn(buf, topo, op="avg", check=False)
    # Step 3
    return completed_future(buf)


@ddp_hook
def noop_hook(state: StatelessHookState, bucket: dist.GradBucket) -> torch.futures.Future:
    """Return the bucket untouched: no communication, gradients stay local (not averaged)."""
    return completed_future(bucket.buffer())


def make_native(ddp_model: Any, options: CommonOptions) -> tuple[StatelessHookState, None]:
    """``native``: register nothing, DDP's built-in all-reduce stays (bounded by its process
    group's timeout; ``timeout_s`` is validated, so every hook takes the same options)."""
    return StatelessHookState("native"), None


def make_noop(ddp_model: Any, options: CommonOptions) -> tuple[StatelessHookState, Callable]:
    """``noop``: no communication (the benchmark ceiling), hence no wait for ``timeout_s`` to bound."""
    return StatelessHookState("noop"), noop_hook


def dense_factory(name: str) -> HookFactory:
    """The factory of the dense hook ``name`` (one of :data:`DENSE_HOOKS`)."""
    def make(ddp_model: Any, options: DenseOptions) -> tuple[DenseHookState, Callable]:
        _check_model(ddp_model, name)
        return DenseHookState(name, options), dense_hook

    make.__name__ = f"make_{name}"
    make.__doc__ = f"Hook averaging each bucket with the {name} all-reduce."
    return make


def _check_model(ddp_model: Any, name: str) -> None:
    """The dense hooks reduce over the default group, in fp32/fp16/bf16, and on NCCL only with a
    native path in their record (:func:`~flashsgd.comm.dense.native_path`): refuse anything else
    at registration, not at the first backward."""
    pg = getattr(ddp_model, "process_group", None)
    if pg is not None and dist.get_world_size(pg) != dist.get_world_size():
        raise ValueError(f"hook {name!r} all-reduces over the default process group, but this DDP "
                         f"model uses a group of {dist.get_world_size(pg)} of "
                         f"{dist.get_world_size()} ranks; use hook 'native' for subgroup DDP")
    trained = [(pname, p) for pname, p in ddp_model.module.named_parameters() if p.requires_grad]
    for pname, p in trained:
        if p.dtype not in DTYPES:
            raise ValueError(f"hook {name!r}: parameter {pname!r} is {p.dtype}; supported dtypes: "
                             f"{', '.join(DTYPES.values())}")
    if any(native_stages(p, pg) for _, p in trained):  # CUDA buckets on NCCL: the record's chain runs
        native_path(name, f"hook {name!r}")


