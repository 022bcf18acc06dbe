"""The state of the sparse hooks (:mod:`flashsgd.comm.sparse.hooks`): options, per-bucket residuals
and velocities with the parameters they cover, checkpoints, counters.

Paper: Shi et al. 2019, gTop-k S-SGD (arXiv 1901.04359), error feedback; Lin et al. 2018, DGC
(arXiv 1712.01887), momentum correction. Nothing here depends on which exchange runs: the state
is the same for ``topk``, ``gtopk`` and ``hgtopk``; the hook module holds the behaviour.

Residuals are keyed by bucket index and remember which parameters (by position in the model) they
cover; if the layout ever differs (DDP's rebuild after the first iteration, or a checkpoint from
another ``bucket_cap_mb``), all residuals (and velocities) are split per parameter and
re-assembled for the new buckets, so no mass is lost.

The state is per rank (each rank's residuals are its own): :meth:`SparseHookState.state_dict`
records the rank and world size, :meth:`~SparseHookState.load_state_dict` refuses another rank's
(the message names both), and :meth:`~SparseHookState.regroup` maps a checkpoint onto another
world size (elastic resume). After loading, :func:`flashsgd.comm.hooks.rebuild_buckets` gives DDP
its final buckets before the first step, so that the resume is exact.

Example::

    >>> state = SparseHookState("gtopk", SparseOptions(density=0.01)).bind(ddp_model)  # doctest: +SKIP
    >>> torch.save({"hook": state.state_dict()}, f"ckpt/rank{rank}.pt")  # one file per rank  # doctest: +SKIP
    >>> state.load_state_dict(torch.load(f"ckpt/rank{rank}.pt")["hook"])  # this rank's own  # doctest: +SKIP
    >>> rebuild_buckets(ddp_model, lambda: loss_fn(ddp_model(x), y))                   # doctest: +SKIP
"""

from __future__ import annotations

import warnings
from typing import Any

import torch
import torch.distributed as dist

from flashsgd.comm.hook_common import CommThread, check_owner, mean_tensors, rank_and_world
from flashsgd.comm.hook_step import HookStep
from flashsgd.comm.sparse.corrections import layer_norms
from flashsgd.comm.sparse.select import SelectionWorkspace, ThresholdReuse
from flashsgd.comm.sparse.oktopk import Regions
from flashsgd.comm.topology import default_timeout_s, get_topology
from flashsgd.exchanges import HierSparseOptions, SparseOptions



class SparseHookState:
    """State of the ``topk`` / ``gtopk`` / ``hgtopk`` hooks: options, per-bucket residuals, counters.

    Args:
        algorithm: the exchange's name (a sparse name of :data:`flashsgd.exchanges.EXCHANGES`;
            checkpoints carry it).
        options: its :class:`~flashsgd.exchanges.SparseOptions` (or ``HierSparseOptions``): every
            option, default and its source is documented there.
        process_group: DDP's group (None: the default group; set by :meth:`bind`).
        param_positions: ``{id(parameter): position in model.parameters()}`` (residual remapping;
            set by :meth:`bind`).
    """

    __slots__ = (
        # hyper-parameters
        "algorithm", "options", "process_group",
        # internal state
        "iter", "residuals", "velocities", "layer_norms", "layouts", "pending", "pending_velocities",
        "param_positions", "generator", "saved_generator", "workspace", "checked", "reuse", "regions", "topology", "comm",
        "pending_job", "step", "saved", "spare",
        # stats
        "bytes_sent", "sparse_buckets", "dense_buckets", "last_density", "residual_remaps", "clock",
    )

    def __init__(self, algorithm: str, options: SparseOptions, process_group: Any = None,
                 param_positions: dict[int, int] | None = None) -> None:
        if not isinstance(options, SparseOptions):
            raise ValueError(f"options must be a SparseOptions, got {type(options).__name__}")
        self.algorithm, self.options, self.process_group = algorithm, options, process_group
        self.comm = CommThread() if options.threaded else None  # the thread starts at its first bucket
        self.pending_job: torch.futures.Future | None = None  # the last bucket handed to it
        self.reuse = ThresholdReuse(options.threshold_tolerance, options.threshold_every)
        self.regions = Regions(getattr(options, "region_every", 1))  # oktopk's region bounds
        self.topology = None  # hgtopk: set by bind()
        self.layer_norms: dict[int, torch.Tensor] = {}  # parameter position -> dense gradient norm
        self.param_positions = param_positions
        self.iter = 0
        self.residuals: dict[int, torch.Tensor] = {}   # bucket index -> flat residual
        self.velocities: dict[int, torch.Tensor] = {}  # bucket index -> flat velocity (momentum corr.)
        self.layouts: dict[int, tuple] = {}            # bucket index -> parameter positions
        self.pending: dict[int, torch.Tensor] | None = None  # per-parameter residuals to re-assemble
        self.pending_velocities: dict[int, torch.Tensor] | None = None  # the same, for velocities
        self.generator: torch.Generator | None = None  # sampled selection's RNG: sampling_generator()
        self.saved_generator: tuple[torch.Tensor, str | None] | None = None  # (state, device type) to continue
        self.workspace = SelectionWorkspace()
        self.checked: set[int] = set()
        self.step = HookStep(algorithm)  # the open training step: loss scale, non-finite inputs (hook_step)
        self.saved: tuple | None = None  # what the open step started from (begin_step)
        self.spare: dict[tuple[str, int], torch.Tensor] = {}  # ("residual"|"velocity", bucket) -> free buffer
        self.bytes_sent = 0       # bytes handed to the backend by this rank (sparse + dense phase)
        self.sparse_buckets = 0
        self.dense_buckets = 0
        self.last_density = 1.0
        self.residual_remaps = 0
        self.clock = None  # phase timing of the sparse step, set by a benchmark (sparse_hooks._lap)

    def grad_norms(self, params: list[torch.Tensor]) -> torch.Tensor | None:
        """(len(params),) dense gradient norms of ``params`` from this step (``layer_trust``), for
        :class:`flashsgd.optim.lars.LARS`'s ``grad_norm_source``; None when one is unknown."""
        pos = self.param_positions or {}
        norms = [self.layer_norms.get(pos.get(id(p), -1)) for p in params]
        if not norms or any(n is None for n in norms):
            return None
        # on the parameters' device: Gloo carrying CUDA buckets records them on the host (HostBucket)
        return torch.stack(norms).to(params[0].device)

    def record_layer_norms(self, layout: tuple, idx: int, buf: torch.Tensor) -> None:
        """Step 1b (``layer_trust``): the dense norm of each parameter's gradient in bucket
        ``idx`` (``layout``: :meth:`layout` of it)."""
        timeout_s = default_timeout_s() if self.options.timeout_s is None else self.options.timeout_s
        norms = layer_norms(buf, [size for _, size in layout], self.process_group, timeout_s,
                            f"{self.algorithm} hook, layer norms of bucket {idx}")
        self.layer_norms.update((pos, norm) for (pos, _), norm in zip(layout, norms) if pos is not None)

    @property
    def owns_momentum(self) -> bool:
        """True when the hook applies momentum (momentum correction): the optimizer must not."""
        return self.options.momentum_correction > 0

    @property
    def momentum(self) -> float:
        """The hook's momentum factor (0: the optimizer owns the momentum)."""
        return self.options.momentum_correction

    # ------------------------------------------------------------ sampled selection's RNG ---
    def sampling_generator(self, device: torch.device, rank: int) -> torch.Generator:
        """The sampled selection's RNG, on ``device`` (the device of the bucket it serves); the one
        place that creates it.

        Made at its first use: seeded ``options.seed * 65537 + rank`` (every rank its own stream), or,
        after :meth:`load_state_dict`, set to the saved stream, so the resumed run draws the
        uninterrupted run's samples. A stream saved by a generator of another device type (a CPU
        run's checkpoint resumed on CUDA buckets, or the reverse: the two generators' states have
        different formats) cannot be continued: it restarts from its seed, with a warning.
        """
        if self.generator is not None:
            return self.generator
        generator = torch.Generator(device=device)
        saved, self.saved_generator = self.saved_generator, None
        if saved is not None:
            state, saved_type = saved
            if saved_type in (None, generator.device.type):  # None: a checkpoint that did not record it
                try:
                    generator.set_state(state)
                    self.generator = generator
                    return generator
                except RuntimeError:  # another generator's state format
                    pass
            warnings.warn(f"{self.algorithm} hook (rank {rank}): the checkpoint's sampled-selection RNG "
                          f"stream was saved by a {saved_type or 'other'} generator and cannot continue on "
                          f"{generator.device.type}; it restarts from its seed (the selections differ "
                          "from an uninterrupted run's)", stacklevel=2)
        self.generator = generator.manual_seed(self.options.seed * 65537 + rank)
        return self.generator

    def _generator_state(self) -> dict:
        """The sampled selection's stream for :meth:`state_dict`: the live generator's, or the saved
        one that has not been used since :meth:`load_state_dict`; with its device type."""
        if self.generator is not None:
            return {"generator": self.generator.get_state(), "generator_device": self.generator.device.type}
        state, device = self.saved_generator or (None, None)
        return {"generator": None if state is None else state.clone(), "generator_device": device}

    # ------------------------------------------------------------ the step protocol -------
    def use_scaler(self, scaler: Any) -> "SparseHookState":
        """The loop's ``torch.amp.GradScaler`` (None: none): the hook reads each step's loss scale
        from it (:mod:`flashsgd.comm.hook_step`). Returns the state."""
        self.step.scaler = scaler
        return self

    def begin_step(self, grad_scale: torch.Tensor | None = None) -> None:
        """Step 1 of :mod:`flashsgd.comm.hook_step`: the gradients of this step's buckets are
        ``grad_scale`` times the true ones (None: 1); remember what the state holds now (by
        reference: the hook makes new residuals, velocities and norms, it never edits kept ones)."""
        self.step.begin(grad_scale)
        self.saved = (self.iter, dict(self.residuals), dict(self.velocities), dict(self.layouts),
                      None if self.pending is None else dict(self.pending),
                      None if self.pending_velocities is None else dict(self.pending_velocities),
                      dict(self.layer_norms), self.reuse.state_dict(), self._generator_state(),
                      self.regions.state_dict())

    def nonfinite_inputs(self) -> torch.Tensor | None:
        """Step 3: buckets that arrived non-finite on this rank in the open step (0-dim tensor; None
        when no step is open or no bucket has run)."""
        return self.step.bad

    def end_step(self, kept: bool) -> None:
        """Step 4: keep the step's new memories, or (``kept`` False: the trainer skipped the step)
        put back exactly what :meth:`begin_step` saw. The statistics (``stats``) keep counting the
        skipped step (its bytes were sent). A call without :meth:`begin_step` only ends the step."""
        saved, self.saved = self.saved, None
        self.drain()  # before the scale goes: nothing is in flight after DDP's backward, but a
        self.step.end()  # threaded bucket still running would rescale with it (a failure re-raises)
        if saved is None:
            return
        if kept:  # what the step started from is free now
            self._recycle(saved[1], self.residuals, "residual")
            self._recycle(saved[2], self.velocities, "velocity")
            return
        self._recycle(self.residuals, saved[1], "residual")  # the skipped step's new memories
        self._recycle(self.velocities, saved[2], "velocity")
        (self.iter, self.residuals, self.velocities, self.layouts, self.pending, self.pending_velocities,
         self.layer_norms, thresholds, generator, regions) = saved
        self.reuse.load_state_dict(thresholds)
        self.regions.load_state_dict(regions)
        # the sampled selection's stream: re-made from the saved state at its next use
        self.generator = None
        self.saved_generator = None if generator["generator"] is None else (generator["generator"],
                                                                            generator["generator_device"])

    # ---------------------------------------------------------------------- checkpointing ---
    def state_dict(self) -> dict:
        """Iteration, residuals with their parameter layouts, RNG state and counters (tensors cloned),
        and the rank and world size that own them: the residuals are this rank's (save one file per
        rank; :meth:`load_state_dict` refuses another rank's). A step whose backward is done is
        closed first (kept, or put back: :mod:`flashsgd.comm.hook_step`, Step 4)."""
        self.step.settle(self)
        rank, world = rank_and_world(self.process_group) or (None, None)
        return {
            "algorithm": self.algorithm, "iter": self.iter, "rank": rank, "world": world,
            "residuals": {k: v.clone() for k, v in self.residuals.items()},
            "layouts": dict(self.layouts),
            "pending": {k: v.clone() for k, v in (self.pending or {}).items()},
            "velocities": {k: v.clone() for k, v in self.velocities.items()},
            "pending_velocities": {k: v.clone() for k, v in (self.pending_velocities or {}).items()},
            **self._generator_state(),
            "thresholds": self.reuse.state_dict(),
            "regions": self.regions.state_dict(),
            "stats": {"bytes_sent": self.bytes_sent, "sparse_buckets": self.sparse_buckets,
                      "dense_buckets": self.dense_buckets, "residual_remaps": self.residual_remaps,
                      "last_density": self.last_density},
        }

    def load_state_dict(self, state: dict) -> None:
        """Restore :meth:`state_dict`; a different bucket layout is remapped at the next step.

        Raises:
            ValueError: the state is another hook's, or another rank's or world size's (the
                message names both; :meth:`regroup` maps a checkpoint onto another world size).
        """
        if state.get("algorithm") != self.algorithm:
            raise ValueError(f"state_dict is for hook {state.get('algorithm')!r}, not {self.algorithm!r}")
        check_owner(state, self.algorithm, self.process_group)
        self.drain()
        self.step.end()  # an open step is forgotten: the loaded state is where the next one starts
        self.saved = None
        self.iter = int(state["iter"])
        self.residuals = {int(k): v.clone() for k, v in state["residuals"].items()}
        self.layouts = {int(k): tuple(tuple(x) for x in v) for k, v in state["layouts"].items()}
        self.pending = {int(k): v.clone() for k, v in state.get("pending", {}).items()} or None
        self.velocities = {int(k): v.clone() for k, v in state.get("velocities", {}).items()}
        self.pending_velocities = {int(k): v.clone()
                                   for k, v in state.get("pending_velocities", {}).items()} or None
        self.generator = None  # re-created on the bucket's device at its next use (sampling_generator)
        self.saved_generator = None
        if state.get("generator") is not None:
            self.saved_generator = (state["generator"].clone(), state.get("generator_device"))
        if state.get("thresholds") is not None:
            self.reuse.load_state_dict(state["thresholds"])
        self.regions.load_state_dict(state.get("regions"))  # absent in checkpoints before oktopk
        for key, value in state.get("stats", {}).items():
            setattr(self, key, value)
        self.checked = set()
        self.spare = {}

    @staticmethod
    def regroup(states: list[dict], rank: int, world: int) -> dict:
        """This rank's state on ``world`` ranks from the ``states`` of every rank of another world
        size (an elastic resume): the residuals and velocities are averaged over the old ranks
        (their contribution to the update, sum over ranks / world, is kept; the layouts are the
        same on every rank), the iteration is kept; the sampled selection's RNG stream is this
        rank's own when it existed (a new rank seeds its own), the kept thresholds restart
        (they change the speed, not the entries)."""
        first = states[0]
        own = states[rank] if rank < len(states) else None
        return {
            "algorithm": first["algorithm"], "iter": first["iter"], "rank": rank, "world": world,
            "residuals": mean_tensors([st["residuals"] for st in states]),
            "layouts": dict(first["layouts"]),
            "pending": mean_tensors([st.get("pending", {}) for st in states]),
            "velocities": mean_tensors([st.get("velocities", {}) for st in states]),
            "pending_velocities": mean_tensors([st.get("pending_velocities", {}) for st in states]),
            "generator": own.get("generator") if own else None,
            "generator_device": own.get("generator_device") if own else None,
            "thresholds": None, "stats": own.get("stats", {}) if own else {},
            "regions": first.get("regions"),  # the same on every rank; re-made for another world
        }

    def __getstate__(self) -> dict:
        """Everything but the process group, the id-based parameter map and the workspace."""
        return {"algorithm": self.algorithm, "options": self.options, "state": self.state_dict()}

    def __setstate__(self, state: dict) -> None:
        self.__init__(state["algorithm"], state["options"])
        self.load_state_dict(state["state"])

    # ------------------------------------------------------------------------- residuals ----
    def layout(self, bucket: dist.GradBucket) -> tuple:
        """((parameter position or None, numel), ...) of the bucket, in buffer order."""
        pos = self.param_positions or {}
        return tuple((pos.get(id(p)), p.numel()) for p in bucket.parameters())

    def bind(self, ddp_model: Any) -> "SparseHookState":
        """Attach to a DDP model: its process group and the parameter positions (after unpickling);
        an exchange with a node step (``hgtopk``) builds its node / cross groups here (every rank,
        same order)."""
        module = getattr(ddp_model, "module", ddp_model)
        self.param_positions = {id(p): i for i, p in enumerate(module.parameters())}
        self.process_group = getattr(ddp_model, "process_group", None)
        if isinstance(self.options, HierSparseOptions):
            self.topology = get_topology(self.options.ranks_per_node, timeout_s=self.options.timeout_s)
        return self

    def residual(self, bucket: dist.GradBucket) -> torch.Tensor:
        """This bucket's residual (zeros the first time), re-assembled if the layout changed, on
        the bucket's device and dtype (a checkpoint loads on the CPU). Read-only: the hook keeps a
        new tensor (:meth:`keep`), so that a skipped step can put this one back."""
        self._check_layout(bucket)
        return _assemble(self.residuals.get(bucket.index()), self.pending, self.layout(bucket),
                         bucket.buffer())

    def velocity(self, bucket: dist.GradBucket) -> torch.Tensor:
        """This bucket's velocity (momentum correction; zeros the first time), as :meth:`residual`
        (read-only too)."""
        self._check_layout(bucket)
        return _assemble(self.velocities.get(bucket.index()), self.pending_velocities,
                         self.layout(bucket), bucket.buffer())

    def scratch(self, kind: str, idx: int, like: torch.Tensor) -> torch.Tensor:
        """A buffer like ``like`` to write bucket ``idx``'s next ``kind`` ("residual", "velocity")
        into: the one that memory replaced last time, when no kept memory and no open step still
        holds it (double buffering: a fresh bucket-sized tensor per step costs the CPU its page
        faults, 7x an in-place add at 25.6M floats), else a new one."""
        t = self.spare.pop((kind, idx), None)
        if t is None or t.shape != like.shape or t.dtype != like.dtype or t.device != like.device:
            t = torch.empty_like(like)
        return t

    def keep(self, idx: int, layout: tuple, residual: torch.Tensor | None,
             velocity: torch.Tensor | None) -> None:
        """Store bucket ``idx``'s residual and velocity (None: none kept) with its ``layout``; the
        tensors they replace become :meth:`scratch` buffers unless the open step holds them."""
        for kind, store, new, at in (("residual", self.residuals, residual, 1),
                                     ("velocity", self.velocities, velocity, 2)):
            if new is None:
                continue
            old = store.get(idx)
            store[idx] = new
            if old is not None and old is not new and (self.saved is None or self.saved[at].get(idx) is not old):
                self.spare[(kind, idx)] = old
        self.layouts[idx] = layout

    def _recycle(self, unused: dict[int, torch.Tensor], used: dict[int, torch.Tensor], kind: str) -> None:
        """The tensors of ``unused`` that ``used`` does not hold become :meth:`scratch` buffers."""
        for idx, t in unused.items():
            if used.get(idx) is not t:
                self.spare[(kind, idx)] = t

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
    """``stored`` (zeros when None) plus the pieces of ``pending`` this layout holds (popped), on
    ``buf``'s device and dtype; ``stored`` itself is never written (a new tensor when a piece is
    added)."""
    out = torch.zeros_like(buf) if stored is None else stored.to(buf)
    if pending and any(pos in pending for pos, _ in layout if pos is not None):
        out = out.clone() if out is stored else out
        offset = 0
        for pos, size in layout:  # per-parameter pieces waiting for the bucket that now holds them
            piece = pending.pop(pos, None) if pos is not None else None
            if piece is not None:
                out[offset:offset + size] += piece.to(out)
            offset += size
    return out
