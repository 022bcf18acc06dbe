"""DDP communication hooks ``topk``, ``gtopk`` and ``hgtopk``: sparsified gradient exchange with error feedback.

Paper: Shi et al. 2019, gTop-k S-SGD (arXiv 1901.04359); the exchanges are in
:mod:`flashsgd.comm.sparse`. Use::

    state = register_hook(ddp_model, "gtopk", density=0.001, density_warmup=0.25,
                          density_warmup_steps=steps_per_epoch, selection="sampled")
    ...train...
    ckpt["hook"] = state.state_dict(); state.load_state_dict(ckpt["hook"])

Per bucket and step (after ``start_iter`` dense iterations):
    1. acc = bucket gradient + this bucket's residual (local, un-averaged units). With DGC's
       corrections (Lin et al. 2018, arXiv 1712.01887; :mod:`flashsgd.comm.sparse_corrections`):
       the gradient is first clipped to ``local_clip``; with ``momentum_correction`` = m > 0 the
       velocity u = m*u + g (not g) is added to the residual, and the optimizer must run
       without momentum (``state.owns_momentum``).
    2. k = ceil(density(step) * numel), step = iterations seen by the hook (dense ones included);
       select the k largest |acc| (``exact``: torch.topk,
       ``sampled``: sampled threshold, :func:`~flashsgd.comm.sparse.topk_sampled`, ``threshold``:
       block maxima and a kept threshold; without momentum correction its block maxima come
       fused with step 1's add, :mod:`flashsgd.comm.sparse_step`).
    3. Exchange: ``topk`` all-gathers every rank's pairs and sums them; ``gtopk`` runs the
       butterfly merge tree and keeps the global k.
    4. residual = acc with the counted local entries zeroed (error feedback invariant:
       sum_r acc_r == world * update + sum_r residual_r); with ``momentum_masking`` the
       velocity is zeroed there too (DGC's momentum-factor masking).
    5. The bucket becomes sum / world (DDP's average semantics), zero outside the selected indices.

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

Checkpoints: ``state.state_dict()`` / ``load_state_dict()`` (iteration, residuals with their
layouts, the sampled selection's RNG state, counters). Pickling drops the process group and the
id-based parameter map; an unpickled state must be re-attached with
``ddp.register_comm_hook(state.bind(ddp), sparse_hook)`` (it refuses to run unbound).

``hgtopk`` (:mod:`flashsgd.comm.sparse_hier`): the node's ranks reduce acc densely to their
leader, which selects and runs gTop-k with the other nodes' leaders, then broadcasts the result
inside the node; every rank keeps its own residual. Options ``ranks_per_node`` and ``node_split``
("leader"; "slices": R parallel gTop-k over R slices; "sparse": gTop-k inside the node instead of
the dense reduce, the fastest on the emulated 4x2 cluster, docs/benchmarks.md).

Options (``register_hook(ddp, "topk" | "gtopk" | "hgtopk", ...)``): ``density`` (0.001, the paper's),
``density_warmup`` (None: the start density of the warm-up), ``density_warmup_steps`` (0),
``density_warmup_mode`` ("exponential"), ``start_iter`` (2), ``selection`` ("exact" | "sampled" |
"threshold"), ``threshold_tolerance`` (0.25) and ``threshold_every`` (8) for "threshold",
``seed`` (0, for the sampled selection), ``momentum_correction`` (0.0: off; the momentum
factor, e.g. 0.9), ``nesterov`` (False), ``momentum_masking`` (True; used with momentum
correction), ``local_clip`` (None: off; the L2 norm each rank's bucket gradient is clipped to
before accumulation), ``layer_trust`` (False; per-parameter dense gradient norms for LARS,
:meth:`SparseHookState.grad_norms`), ``timeout_s`` (None: the default process group's timeout;
the deadline of every wait on a peer, dense warm-up included: a rank that stops makes the others
raise :class:`~flashsgd.comm.errors.PeerTimeout` naming the peer they waited for; with
``threaded`` it reaches ``backward()`` through the Future), ``compiled`` (False; fuse step 1's add
and the threshold selection's block maxima with ``torch.compile``, eager on failure), ``threaded``
(False; the exchange on a communication thread).
"""

from __future__ import annotations

import warnings
from typing import Any, Callable

import torch
import torch.distributed as dist

from flashsgd.comm.hook_common import CommThread, completed_future, ddp_hook
from flashsgd.comm.sparse import DEFAULT_DENSITY, SELECTIONS, DensitySchedule, SelectionWorkspace
from flashsgd.comm.sparse_corrections import check_local_clip, check_momentum, clip_local_, layer_norms
from flashsgd.comm.sparse_hier import SPLITS, check_node_layout
from flashsgd.comm.sparse_select import ThresholdReuse
from flashsgd.comm.sparse_step import dense_iteration, prepare_sparse
from flashsgd.comm.topology import check_timeout_s, default_timeout_s, get_topology

ALGORITHMS = ("topk", "gtopk", "hgtopk")


class SparseHookState:
    """State of the ``topk`` / ``gtopk`` hooks: schedule, per-bucket residuals, counters.

    Args:
        algorithm: ``"topk"`` or ``"gtopk"``.
        schedule: the density per iteration (:class:`~flashsgd.comm.sparse.DensitySchedule`).
        start_iter: dense iterations before sparsification starts, >= 2 (DDP's bucket rebuild).
        selection: ``"exact"``, ``"sampled"`` or ``"threshold"`` (exact top-k from block maxima,
            threshold kept across iterations: :func:`~flashsgd.comm.sparse_select.topk_threshold`).
        seed: seed of the sampled selection's sample (rank added, so ranks sample differently).
        process_group: DDP's group (None: the default group).
        param_positions: ``{id(parameter): position in model.parameters()}`` (residual remapping).
        timeout_s: deadline of every wait on a peer, seconds (``None``: the default group's).
        momentum_correction: momentum factor applied in the hook (0: off; DGC's momentum correction).
        nesterov: Nesterov form of the hook's momentum.
        momentum_masking: zero the velocity where entries were sent (with momentum correction).
        local_clip: L2 norm each rank's bucket gradient is clipped to before accumulation (None: off).
        layer_trust: record each parameter's dense gradient norm per step (:meth:`grad_norms`, for
            LARS's trust ratio; one all-reduce of one float per parameter and bucket).
        ranks_per_node: ``hgtopk`` (:mod:`flashsgd.comm.sparse_hier`): ranks per node (None:
            detected by :func:`~flashsgd.comm.topology.get_topology`).
        node_split: ``hgtopk``: how a node combines its ranks' gradients, one of
            :data:`~flashsgd.comm.sparse_hier.SPLITS` ("leader": dense reduce to one leader).
        threshold_tolerance, threshold_every: the ``threshold`` selection's reuse of its threshold
            (:class:`~flashsgd.comm.sparse_select.ThresholdReuse`).
        compiled: fuse the residual add and the block maxima with ``torch.compile``
            (:func:`~flashsgd.comm.sparse_fused.add_block_maxima_`; the same result eager).
        threaded: run each bucket's exchange on a communication thread (module docstring).
    """

    __slots__ = (
        # hyper-parameters
        "algorithm", "schedule", "start_iter", "selection", "seed", "process_group", "timeout_s",
        "momentum", "nesterov", "momentum_masking", "local_clip", "layer_trust", "ranks_per_node",
        "node_split", "compiled", "threaded",
        # internal state
        "iter", "residuals", "velocities", "layer_norms", "layouts", "pending", "pending_velocities",
        "param_positions", "generator", "workspace", "checked", "reuse", "topology", "comm",
        "pending_job",
        # stats
        "bytes_sent", "sparse_buckets", "dense_buckets", "last_density", "residual_remaps",
    )

    def __init__(self, algorithm: str, schedule: DensitySchedule, start_iter: int = 2,
                 selection: str = "exact", seed: int = 0, process_group: Any = None,
                 param_positions: dict[int, int] | None = None,
                 timeout_s: float | None = None, momentum_correction: float = 0.0,
                 nesterov: bool = False, momentum_masking: bool = True,
                 local_clip: float | None = None, layer_trust: bool = False,
                 ranks_per_node: int | None = None,
                 threshold_tolerance: float = 0.25, threshold_every: int = 8,
                 node_split: str = "leader", compiled: bool = False, threaded: bool = False) -> None:
        if algorithm not in ALGORITHMS:
            raise ValueError(f"algorithm must be one of {ALGORITHMS}, got {algorithm!r}")
        if not isinstance(schedule, DensitySchedule):
            raise ValueError(f"schedule must be a DensitySchedule, got {type(schedule).__name__}")
        if isinstance(start_iter, bool) or not isinstance(start_iter, int) or start_iter < 2:
            raise ValueError(f"start_iter must be an integer >= 2 (DDP rebuilds its buckets after "
                             f"the first iteration), got {start_iter!r}")
        if selection not in SELECTIONS:
            raise ValueError(f"selection must be one of {sorted(SELECTIONS)}, got {selection!r}")
        self.algorithm, self.schedule, self.start_iter = algorithm, schedule, start_iter
        self.selection, self.seed, self.process_group = selection, int(seed), process_group
        self.timeout_s = None if timeout_s is None else check_timeout_s(timeout_s)
        self.momentum, self.nesterov = check_momentum(momentum_correction, nesterov)
        if not isinstance(momentum_masking, bool):
            raise ValueError(f"momentum_masking must be True or False, got {momentum_masking!r}")
        self.momentum_masking, self.local_clip = momentum_masking, check_local_clip(local_clip)
        if not isinstance(layer_trust, bool):
            raise ValueError(f"layer_trust must be True or False, got {layer_trust!r}")
        self.layer_trust = layer_trust
        self.layer_norms: dict[int, torch.Tensor] = {}  # parameter position -> dense gradient norm
        self.param_positions = param_positions
        self.ranks_per_node = ranks_per_node
        if node_split not in SPLITS:
            raise ValueError(f"node_split must be one of {', '.join(SPLITS)}, got {node_split!r}")
        self.node_split = node_split
        for name, flag in (("compiled", compiled), ("threaded", threaded)):
            if not isinstance(flag, bool):
                raise ValueError(f"{name} must be True or False, got {flag!r}")
        self.compiled, self.threaded = compiled, threaded
        self.comm = CommThread() if threaded else None  # the thread starts at its first bucket
        self.pending_job: torch.futures.Future | None = None  # the last bucket handed to it
        self.reuse = ThresholdReuse(threshold_tolerance, threshold_every)
        self.topology = None  # hgtopk: set by bind()
        self.iter = 0
        self.residuals: dict[int, torch.Tensor] = {}   # bucket index -> flat residual
        self.velocities: dict[int, torch.Tensor] = {}  # bucket index -> flat velocity (momentum corr.)
        self.layouts: dict[int, tuple] = {}            # bucket index -> parameter positions
        self.pending: dict[int, torch.Tensor] | None = None  # per-parameter residuals to re-assemble
        self.pending_velocities: dict[int, torch.Tensor] | None = None  # the same, for velocities
        self.generator: torch.Generator | None = None
        self.workspace = SelectionWorkspace()
        self.checked: set[int] = set()
        self.bytes_sent = 0       # bytes handed to the backend by this rank (sparse + dense phase)
        self.sparse_buckets = 0
        self.dense_buckets = 0
        self.last_density = 1.0
        self.residual_remaps = 0

    def grad_norms(self, params: list[torch.Tensor]) -> torch.Tensor | None:
        """(len(params),) dense gradient norms of ``params`` from this step (``layer_trust``), for
        :class:`flashsgd.optim.lars.LARS`'s ``grad_norm_source``; None when one is unknown."""
        pos = self.param_positions or {}
        norms = [self.layer_norms.get(pos.get(id(p), -1)) for p in params]
        return None if any(n is None for n in norms) else torch.stack(norms)

    def record_layer_norms(self, layout: tuple, idx: int, buf: torch.Tensor) -> None:
        """Step 1b (``layer_trust``): the dense norm of each parameter's gradient in bucket
        ``idx`` (``layout``: :meth:`layout` of it)."""
        timeout_s = default_timeout_s() if self.timeout_s is None else self.timeout_s
        norms = layer_norms(buf, [size for _, size in layout], self.process_group, timeout_s,
                            f"{self.algorithm} hook, layer norms of bucket {idx}")
        self.layer_norms.update((pos, norm) for (pos, _), norm in zip(layout, norms) if pos is not None)

    @property
    def owns_momentum(self) -> bool:
        """True when the hook applies momentum (momentum correction): the optimizer must not."""
        return self.momentum > 0

    # ---------------------------------------------------------------------- checkpointing ---
    def state_dict(self) -> dict:
        """Iteration, residuals with their parameter layouts, RNG state and counters (tensors cloned)."""
        return {
            "algorithm": self.algorithm, "iter": self.iter,
            "residuals": {k: v.clone() for k, v in self.residuals.items()},
            "layouts": dict(self.layouts),
            "pending": {k: v.clone() for k, v in (self.pending or {}).items()},
            "velocities": {k: v.clone() for k, v in self.velocities.items()},
            "pending_velocities": {k: v.clone() for k, v in (self.pending_velocities or {}).items()},
            "generator": None if self.generator is None else self.generator.get_state(),
            "thresholds": self.reuse.state_dict(),
            "stats": {"bytes_sent": self.bytes_sent, "sparse_buckets": self.sparse_buckets,
                      "dense_buckets": self.dense_buckets, "residual_remaps": self.residual_remaps,
                      "last_density": self.last_density},
        }

    def load_state_dict(self, state: dict) -> None:
        """Restore :meth:`state_dict`; a different bucket layout is remapped at the next step."""
        if state.get("algorithm") != self.algorithm:
            raise ValueError(f"state_dict is for hook {state.get('algorithm')!r}, not {self.algorithm!r}")
        self.iter = int(state["iter"])
        self.residuals = {int(k): v.clone() for k, v in state["residuals"].items()}
        self.layouts = {int(k): tuple(tuple(x) for x in v) for k, v in state["layouts"].items()}
        self.pending = {int(k): v.clone() for k, v in state.get("pending", {}).items()} or None
        self.velocities = {int(k): v.clone() for k, v in state.get("velocities", {}).items()}
        self.pending_velocities = {int(k): v.clone()
                                   for k, v in state.get("pending_velocities", {}).items()} or None
        self.generator = None
        if state.get("generator") is not None:
            self.generator = torch.Generator()
            self.generator.set_state(state["generator"])
        if state.get("thresholds") is not None:
            self.reuse.load_state_dict(state["thresholds"])
        for key, value in state.get("stats", {}).items():
            setattr(self, key, value)
        self.checked = set()

    def __getstate__(self) -> dict:
        """Everything but the process group, the id-based parameter map and the workspace."""
        return {"hyper": (self.algorithm, self.schedule, self.start_iter, self.selection, self.seed,
                          self.timeout_s),
                "corrections": {"momentum_correction": self.momentum, "nesterov": self.nesterov,
                                "momentum_masking": self.momentum_masking, "local_clip": self.local_clip,
                                "layer_trust": self.layer_trust},
                "exchange": {"ranks_per_node": self.ranks_per_node,
                             "threshold_tolerance": self.reuse.tolerance,
                             "threshold_every": self.reuse.every, "node_split": self.node_split,
                             "compiled": self.compiled, "threaded": self.threaded},
                "state": self.state_dict()}

    def __setstate__(self, state: dict) -> None:
        algorithm, schedule, start_iter, selection, seed, timeout_s = state["hyper"]
        self.__init__(algorithm, schedule, start_iter, selection, seed, timeout_s=timeout_s,
                      **state.get("corrections", {}), **state.get("exchange", {}))
        self.load_state_dict(state["state"])

    # ------------------------------------------------------------------------- residuals ----
    def layout(self, bucket: dist.GradBucket) -> tuple:
        """((parameter position or None, numel), ...) of the bucket, in buffer order."""
        pos = self.param_positions or {}
        return tuple((pos.get(id(p)), p.numel()) for p in bucket.parameters())

    def bind(self, ddp_model: Any) -> "SparseHookState":
        """Attach to a DDP model: its process group and the parameter positions (after unpickling)."""
        module = getattr(ddp_model, "module", ddp_model)
        self.param_positions = {id(p): i for i, p in enumerate(module.parameters())}
        self.process_group = getattr(ddp_model, "process_group", None)
        if self.algorithm == "hgtopk":  # every rank builds the node / cross groups, same order
            self.topology = get_topology(self.ranks_per_node, timeout_s=self.timeout_s)
        return self

    def residual(self, bucket: dist.GradBucket) -> torch.Tensor:
        """This bucket's residual (zeros the first time), re-assembled if the layout changed."""
        self._check_layout(bucket)
        return _assemble(self.residuals.get(bucket.index()), self.pending, self.layout(bucket),
                         bucket.buffer())

    def velocity(self, bucket: dist.GradBucket) -> torch.Tensor:
        """This bucket's velocity (momentum correction; zeros the first time), as :meth:`residual`."""
        self._check_layout(bucket)
        return _assemble(self.velocities.get(bucket.index()), self.pending_velocities,
                         self.layout(bucket), bucket.buffer())

    def keep(self, idx: int, layout: tuple, residual: torch.Tensor | None,
             velocity: torch.Tensor | None) -> None:
        """Store bucket ``idx``'s residual and velocity (None: none kept) with its ``layout``."""
        if residual is not None:
            self.residuals[idx] = residual
        if velocity is not None:
            self.velocities[idx] = velocity
        self.layouts[idx] = layout

    def layout_changed(self, bucket: dist.GradBucket) -> bool:
        """Whether this bucket's stored residual / velocity was kept for another layout."""
        idx, numel = bucket.index(), bucket.buffer().numel()
        known = self.layouts.get(idx)
        stored = [t for t in (self.residuals.get(idx), self.velocities.get(idx)) if t is not None]
        return known is not None and (known != self.layout(bucket) or any(t.numel() != numel for t in stored))

    def drain(self) -> None:
        """Wait for the buckets handed to the communication thread (re-raises their error)."""
        if self.pending_job is not None:
            self.pending_job.wait()
            self.pending_job = None

    def _check_layout(self, bucket: dist.GradBucket) -> None:
        """Split every stored tensor per parameter when this bucket's layout changed."""
        if self.layout_changed(bucket):
            self._split_residuals()  # DDP rebuilt its buckets, or a checkpoint of another layout

    def _split_residuals(self) -> None:
        """Move every bucket residual (velocity) into ``pending`` (``pending_velocities``), one
        piece per parameter position."""
        if any(pos is None for layout in self.layouts.values() for pos, _ in layout):
            warnings.warn("sparse hook: the bucket layout changed and this state does not know the "
                          "parameters' positions (unpickled without register_hook); residuals "
                          "reset to zero", RuntimeWarning, stacklevel=3)
        self.pending = _split(self.residuals, self.layouts, self.pending)
        self.pending_velocities = _split(self.velocities, self.layouts, self.pending_velocities)
        self.residuals, self.velocities, self.layouts = {}, {}, {}
        self.residual_remaps += 1


def _split(tensors: dict[int, torch.Tensor], layouts: dict[int, tuple],
           pending: dict[int, torch.Tensor] | None) -> dict[int, torch.Tensor]:
    """``pending`` plus every bucket tensor cut into per-parameter pieces (by layout position);
    buckets whose layout has unknown positions are dropped (the caller warns)."""
    pieces: dict[int, torch.Tensor] = dict(pending or {})
    for idx, flat in tensors.items():
        layout = layouts[idx]
        if any(pos is None for pos, _ in layout):
            continue
        offset = 0
        for pos, size in layout:
            pieces[pos] = flat[offset:offset + size].clone()
            offset += size
    return pieces


def _assemble(stored: torch.Tensor | None, pending: dict[int, torch.Tensor] | None, layout: tuple,
              buf: torch.Tensor) -> torch.Tensor:
    """``stored`` (zeros when None) plus the pieces of ``pending`` this layout holds (popped)."""
    out = torch.zeros_like(buf) if stored is None else stored
    if pending:  # per-parameter pieces waiting for the bucket that now holds them
        offset = 0
        for pos, size in layout:
            piece = pending.pop(pos, None) if pos is not None else None
            if piece is not None:
                out[offset:offset + size] += piece.to(out.dtype)
            offset += size
    return out


def _world(state: SparseHookState) -> int:
    return dist.get_world_size(state.process_group)


@ddp_hook
def sparse_hook(state: SparseHookState, bucket: dist.GradBucket) -> torch.futures.Future:
    """Average one DDP bucket through the ``topk``, ``gtopk`` or ``hgtopk`` exchange with error
    feedback.

    Steps as in the module docstring (:mod:`flashsgd.comm.sparse_step`); dense all-reduce
    (grad / world, then sum) before ``state.start_iter``. Synchronous (a completed Future) unless
    ``state.threaded``: then the exchange runs on the state's communication thread and the
    Future completes there.
    """
    if state.param_positions is None:
        raise RuntimeError("sparse hook state is not bound to a model (unpickled?): call "
                           "state.bind(ddp_model) before ddp_model.register_comm_hook(state, sparse_hook)")
    buf = bucket.buffer()
    world, n = _world(state), buf.numel()
    clip_local_(buf, state.local_clip)  # Step 1: local clipping
    if state.iter < state.start_iter:  # dense: the thread is idle (DDP waited for last iteration's)
        if state.layer_trust:
            state.record_layer_norms(state.layout(bucket), bucket.index(), buf)
        dense_iteration(state, bucket, buf, world)
        rest = None
    elif n:
        rest = prepare_sparse(state, bucket, buf, world)
    else:  # an empty bucket: only its (empty) layer norms, in order with the other buckets
        layout, idx = state.layout(bucket), bucket.index()
        rest = (lambda: state.record_layer_norms(layout, idx, buf) or buf) if state.layer_trust else None
    if bucket.is_last():
        state.iter += 1
    if rest is None:
        return completed_future(buf)
    if state.comm is not None and not buf.is_cuda:
        state.pending_job = state.comm.submit(rest)
        return state.pending_job
    return completed_future(rest())


def sparse_factory(algorithm: str) -> Callable:
    """The factory of the sparse hook ``algorithm`` (one of :data:`ALGORITHMS`)."""
    def make(ddp_model: Any, density: float = DEFAULT_DENSITY, density_warmup: float | None = None,
             density_warmup_steps: int = 0, density_warmup_mode: str = "exponential",
             start_iter: int = 2, selection: str = "exact", seed: int = 0,
             timeout_s: float | None = None, momentum_correction: float = 0.0,
             nesterov: bool = False, momentum_masking: bool = True,
             local_clip: float | None = None, layer_trust: bool = False,
             ranks_per_node: int | None = None, threshold_tolerance: float = 0.25, threshold_every: int = 8,
             node_split: str = "leader", compiled: bool = False,
             threaded: bool = False) -> tuple[SparseHookState, Callable]:
        schedule = DensitySchedule(density, density_warmup, density_warmup_steps, density_warmup_mode)
        if algorithm != "hgtopk":  # the node layout describes the cluster; only hgtopk uses it
            ranks_per_node = None
        elif ranks_per_node is not None:  # checked before any process group is built
            check_node_layout(ranks_per_node, dist.get_world_size(getattr(ddp_model, "process_group", None)))
        module = getattr(ddp_model, "module", ddp_model)
        for name, p in module.named_parameters():
            if p.requires_grad and not p.is_floating_point():
                raise ValueError(f"hook {algorithm!r}: parameter {name!r} is {p.dtype}; "
                                 "gradients must be floating point")
        state = SparseHookState(algorithm, schedule, start_iter, selection, seed, timeout_s=timeout_s,
                                momentum_correction=momentum_correction, nesterov=nesterov,
                                momentum_masking=momentum_masking,
                                local_clip=local_clip, layer_trust=layer_trust, ranks_per_node=ranks_per_node,
                                threshold_tolerance=threshold_tolerance,
                                threshold_every=threshold_every, node_split=node_split,
                                compiled=compiled, threaded=threaded).bind(ddp_model)
        return state, sparse_hook

    make.__name__ = f"make_{algorithm}"
    make.__doc__ = f"The {algorithm} sparse hook (options: see flashsgd.comm.sparse_hooks)."
    return make
