"""The resolved run: everything every rank executes, derived once from the config and the world.

Papers: Goyal et al. 2017 (linear scaling per reference batch, gradual warmup, one shuffle split over
workers), Mikami et al. 2018 (batch-size control), Shi et al. 2019 (density warm-up of gTop-k).

:func:`build_plan` is called once per run, before any worker starts (or, under torchrun, on each
process before training), and is the only place that derives:

1. the recipe: the registered recipe (or its dataset-tuned variant, ``optim.proxy_tuning``),
   rescaled to ``optim.epochs``, with the user's overrides;
2. the world layout: world size, ranks per node (:func:`local_ranks_per_node` on local spawn: one
   node over NCCL, emulated nodes of 2 ranks over Gloo), torus grid;
3. the batch table and the steps it gives (every worker needs >= 1 sample per step);
4. the communication hook's options (deadline, grid, seed) and, for a sparse exchange, its density
   warm-up in steps: the user's, else the default rule :class:`flashsgd.exchanges.DensityWarmup`
   (DGC's 0.25 -> density over min(4 epochs, half the run); shown in the banner and plan.json);
5. how the step executes (:func:`execution`): autocast precision and loss scaler, micro-batches per
   step (``optim.grad_accum``, each worker's shard split, the global batch unchanged),
   channels_last (only for 4-D image inputs) and ``torch.compile``.

The plan is printed at start-up (:meth:`RunPlan.describe`) and written to ``<out>/plan.json``;
workers read nothing else from the config that the plan resolves.

Example::

    >>> from flashsgd.train.config import resolve
    >>> cfg = resolve(cli={"workers": 8, "global_batch": 8192})
    >>> plan = build_plan(cfg, world=8, num_train=32000, local_spawn=True)
    >>> plan.grid, plan.table.rows, plan.total_steps
    ((2, 4), ((0, 8192),), 60)
"""

from __future__ import annotations

import dataclasses
import math
import os
from dataclasses import dataclass, field
from typing import Any

from flashsgd.comm.dense import DENSE, native_path
from flashsgd.comm.sparse.checks import check_sparse_run
from flashsgd.comm.topology import parse_grid
from flashsgd.exchanges import (EXCHANGES, MIN_COVERAGE, SELECTION_BY_DEVICE, DensityWarmup, coverage,
                                resolved_selection)
from flashsgd.fmt import number, plural
from flashsgd.optim.plan import build_batch_table
from flashsgd.optim.recipes import RECIPES, Recipe
from flashsgd.optim.schedules import BatchTable, Schedule, batch_at, lr_at, steps_in_epochs, steps_per_epoch
from flashsgd.optim.stability import few_steps_warning
from flashsgd.train.config import COMM_OPTION_KEYS, TrainConfig, parse_fail_at, recipe_name, to_dict
from flashsgd.train.config.file import applies, set_but_unread
from flashsgd.train.data.catalog import DATASETS

# Recipe fields a config key may override (config key -> Recipe field; the same names).
RECIPE_OVERRIDES = ("optimizer", "lr_per_ref", "ref_batch", "lr_max", "momentum", "nesterov", "weight_decay",
                    "warmup_epochs", "label_smoothing", "trust_coefficient")


SHOWN = ("ranks_per_node", "grid", "density", "selection", "seed", "timeout_s", "density_warmup",
         "density_warmup_steps", "momentum_correction", "nesterov")
"""Hook options the banner and plan.json show whenever the exchange takes them (the layout, what a
sparse exchange sends, the seed, the deadline, the warm-up, the momentum correction). Every other
option is a switch, shown (and passed) only where it differs from the exchange's default: an option
added to the catalog stays out of the banner until a run sets it."""


def emulated_ranks_per_node(world: int) -> int:
    """Local spawn emulates nodes of 2 ranks (1 when the world is odd), so the two-level
    algorithms (hierarchical, torus2d) have two levels to work with on one machine."""
    return 2 if world % 2 == 0 else 1


def local_ranks_per_node(world: int, backend: str) -> int:
    """Ranks per node of a run spawned on this machine, unless the user sets them.

    NCCL: every rank is one of this machine's GPUs, so the run is ONE node of ``world`` ranks (an
    8-GPU machine is 1 node x 8, not 4 emulated nodes x 2: the two-level algorithms' cross-node
    stage must not run inside one NVLink domain, and torus2d's default grid is ``world`` x 1).
    Gloo: CPU ranks emulate nodes of 2 (:func:`emulated_ranks_per_node`).
    """
    return world if backend == "nccl" else emulated_ranks_per_node(world)


def local_backend(cfg: TrainConfig, world: int, gpus: int | None = None) -> str:
    """The backend of ``world`` ranks spawned on this machine: ``run.backend`` when set, else the
    choice of :func:`flashsgd.launch.local_ranks` (NCCL when the ranks fit on the visible GPUs,
    ``gpus``: default ``torch.cuda.device_count()``; Gloo otherwise)."""
    if cfg.run.backend != "auto":
        return cfg.run.backend
    from flashsgd.launch import local_ranks

    return local_ranks(world, "auto", gpus=gpus)[1]


def resolve_recipe(cfg: TrainConfig) -> tuple[Recipe, str]:
    """Step 1: the recipe this run trains with, and a one-line account of where it came from."""
    o = cfg.optim
    name = recipe_name(cfg)
    recipe = RECIPES[name].for_epochs(o.epochs)
    over = {k: getattr(o, k) for k in RECIPE_OVERRIDES if getattr(o, k) is not None}
    if cfg.model.zero_init_last_bn is not None:
        over["zero_init_last_bn"] = cfg.model.zero_init_last_bn
    source = name if name == o.recipe else f"{name} (the {cfg.data.dataset}-tuned variant of {o.recipe})"
    if over:
        source += " with " + ", ".join(f"{k}={v}" for k, v in over.items())
    return dataclasses.replace(recipe, **over), source


@dataclass(frozen=True)
class RunPlan:
    """A resolved run (see the module docstring). Picklable: it is handed to every worker."""

    config: TrainConfig
    world: int
    """Ranks in the run."""
    ranks_per_node: int | None
    """Ranks per (emulated) node; None: detected at start-up (torchrun's LOCAL_WORLD_SIZE)."""
    grid: tuple[int, int] | None
    """Torus grid (X, Y); None until the ranks per node are known (detected at start-up)."""
    recipe: Recipe
    recipe_source: str
    num_train: int
    """Training samples per epoch."""
    table: BatchTable
    """Batch-size control: (first epoch, global batch) rows."""
    schedule: Schedule
    """The recipe's LR schedule (linear scaling per reference batch, warmup, decay)."""
    epochs: int
    """Epochs the loop runs (the recipe's length, rounded up)."""
    total_steps: int
    """Optimizer steps of the whole run (before ``run.max_steps``)."""
    first_epoch_steps: int
    """Optimizer steps of the first epoch (its batch): the unit of ``comm.density_warmup_epochs``."""
    hook_options: dict[str, Any] = field(default_factory=dict)
    """Options of the communication hook ``config.comm.algorithm`` as shown (banner, plan.json):
    :data:`SHOWN` always, the other switches where not at their default."""
    exchange_options: Any = None
    """The hook's checked options object (the exchange's options class, :mod:`flashsgd.exchanges`),
    what :func:`flashsgd.train.rank.build_ddp` hands ``register_hook``; None under ``--comm auto``
    until the choice (:meth:`with_comm`)."""
    warnings: tuple[str, ...] = ()
    """Settings that will cost accuracy (the sparse step-count bound), printed at start-up."""
    density_warmup: dict[str, Any] = field(default_factory=dict)
    """A sparse exchange's density warm-up: its steps, the rule they come from and the run's
    coverage (:func:`density_warmup_record`); empty for the other exchanges."""
    execution: dict[str, Any] = field(default_factory=dict)
    """Step 5: how :class:`~flashsgd.train.step.TrainStep` runs (:func:`execution`)."""
    backend: str | None = None
    """The backend of a local spawn (:func:`local_backend`); None under torchrun (the environment's)."""

    def batch_at(self, epoch: int) -> int:
        """Global batch of ``epoch`` (batch-size control; the last row past the end)."""
        return batch_at(epoch, self.table)

    @property
    def target_steps(self) -> int:
        """Steps this invocation trains to: ``total_steps``, or ``run.max_steps`` if smaller."""
        m = self.config.run.max_steps
        return min(self.total_steps, m) if m else self.total_steps

    def lr_at(self, epoch: float) -> float:
        """LR at a fractional epoch (linear scaling, warmup, decay; pure)."""
        return lr_at(epoch, self.schedule, self.table)

    def peak_lr(self) -> float:
        """Largest LR over the run (sampled at 401 points)."""
        end = self.recipe.epochs
        return max(self.lr_at(min(end * k / 400, end - 1e-9)) for k in range(401))

    def describe(self, topology: str | None = None) -> str:
        """Start-up lines: world, grid, per-worker and global batch, effective LR, algorithm."""
        cfg, r = self.config, self.recipe
        batches = [b for _, b in self.table.rows]
        per_worker = "/".join(f"{b // self.world}" + ("+" if b % self.world else "") for b in batches)
        layout = topology or (f"{plural(self.ranks_per_node, 'rank')}/node, grid {self.grid[0]}x{self.grid[1]}"
                              if self.grid else "ranks per node detected at start-up")
        return "\n".join([
            f"flashsgd train | world {self.world} ({layout}) | backend {self.backend or cfg.run.backend}",
            f"  algorithm   {cfg.comm.algorithm} {self.hook_options or ''} bucket {cfg.comm.bucket_mb:g} MiB"
            + (f", selection {self.selection}" if self.selection else ""),
            *([f"  warm-up     {self.density_warmup['text']}"] if self.density_warmup else []),
            f"  batch       global {' -> '.join(map(str, batches))} (table {list(self.table.rows)}), "
            f"per worker {per_worker}; {plural(self.total_steps, 'step')} in {plural(self.epochs, 'epoch')}",
            f"  lr          effective peak {self.peak_lr():.4g} (lr_per_ref {r.lr_per_ref:g} x "
            f"batch/{r.ref_batch}{'' if r.lr_max is None else f', saturating at {r.lr_max:g}'}), warmup {plural(r.warmup_epochs, 'epoch')}, decay {r.decay}",
            f"  recipe      {self.recipe_source}",
            f"  step        {describe_execution(self.execution)}",
            f"  run dir     {cfg.run.out}",
            *(f"  WARNING     {w}" for w in self.warnings),
        ])

    @property
    def selection(self) -> str | None:
        """A sparse exchange's top-k selection as its hook will run it: ``comm.selection``, with
        ``auto`` resolved for the buckets' device (NCCL's are on CUDA, Gloo's on the host:
        :data:`flashsgd.exchanges.SELECTION_BY_DEVICE`; under torchrun, where the plan does not know
        the backend, ``auto (exact on cuda, sampled on cpu)``); None for other exchanges."""
        algorithm = self.config.comm.algorithm
        if algorithm not in EXCHANGES or EXCHANGES[algorithm].family != "sparse":
            return None
        name = self.hook_options.get("selection") or "auto"
        device = {"nccl": "cuda", "gloo": "cpu"}.get(self.backend or "")
        if name != "auto":
            return name
        if device is None:
            return "auto (" + ", ".join(f"{v} on {k}" for k, v in SELECTION_BY_DEVICE.items()) + ")"
        return f"{resolved_selection(name, device)} (auto on {device})"

    def with_comm(self, **changes: Any) -> "RunPlan":
        """This plan with ``comm`` keys changed (the choice of ``--comm auto``): only the
        exchange's part (Step 4: grid, hook options, warnings) is derived again; the recipe, the
        layout, the batch table and the run length stay this plan's."""
        cfg = dataclasses.replace(self.config, comm=dataclasses.replace(self.config.comm, **changes))
        rpn = self.ranks_per_node if cfg.comm.ranks_per_node is None else cfg.comm.ranks_per_node
        grid, options, checked, recipe, warnings, warm = _derive_comm(
            cfg, self.recipe, self.world, rpn, self.first_epoch_steps, self.total_steps)
        return dataclasses.replace(self, config=cfg, ranks_per_node=rpn, grid=grid, recipe=recipe,
                                   schedule=recipe.schedule(), hook_options=options, exchange_options=checked,
                                   warnings=tuple(warnings), density_warmup=warm)

    def to_dict(self) -> dict[str, Any]:
        """JSON-able form (``<out>/plan.json``)."""
        return {"world": self.world, "backend": self.backend, "ranks_per_node": self.ranks_per_node,
                "grid": list(self.grid) if self.grid else None, "num_train": self.num_train,
                "batch_rows": [list(r) for r in self.table.rows], "epochs": self.epochs,
                "total_steps": self.total_steps, "peak_lr": self.peak_lr(),
                "algorithm": self.config.comm.algorithm, "hook_options": self.hook_options,
                "selection": self.selection,
                "recipe_source": self.recipe_source, "warnings": list(self.warnings),
                "density_warmup": self.density_warmup,
                "execution": self.execution,
                "recipe": {k: v for k, v in dataclasses.asdict(self.recipe).items()},
                "config": to_dict(self.config)}


def density_warmup_of(cfg: TrainConfig) -> DensityWarmup:
    """The run's density warm-up rule from ``[comm]``: ``density_warmup`` the start (0, or None
    from ``--comm auto``'s choice: off), ``density_warmup_steps`` the length in steps when set, else
    ``density_warmup_epochs`` in epochs (unset: the default rule of
    :class:`~flashsgd.exchanges.DensityWarmup`)."""
    c = cfg.comm
    if c.density_warmup_steps is not None:  # the config refuses both; the steps as set win
        return DensityWarmup(start=c.density_warmup or 0.0, fixed_steps=c.density_warmup_steps)
    return DensityWarmup(start=c.density_warmup or 0.0, epochs=c.density_warmup_epochs)


def density_warmup_record(cfg: TrainConfig, options: Any, total_steps: int) -> dict[str, Any]:
    """What plan.json and the banner say about a sparse exchange's warm-up: start, steps, the rule
    (set or default, :meth:`DensityWarmup.rule`) and the coverage it gives the run."""
    warm = density_warmup_of(cfg)
    steps = options.density_warmup_steps if options.density_warmup is not None else 0
    cover = coverage(total_steps, options)
    if steps:
        text = (f"density {options.density_warmup:g} -> {options.density:g} ({options.density_warmup_mode}) "
                f"over {steps} of {plural(total_steps, 'step')} = {warm.rule()}")
    elif warm.start == 0 or warm.epochs == 0 or warm.fixed_steps == 0:
        text = f"none: {warm.rule()}"
    else:
        text = f"none (its start {warm.start:g} is not above the density {options.density:g})"
    text += f"; coverage {number(cover, than=MIN_COVERAGE)} (step-count bound; >= {MIN_COVERAGE:g} kept accuracy)"
    return {"start": options.density_warmup if steps else None, "steps": steps,
            "mode": options.density_warmup_mode, "default_length": warm.is_default and bool(steps),
            "rule": warm.rule(), "coverage": round(cover, 3), "text": text}


def _hook_options(cfg: TrainConfig, recipe: Recipe, ranks_per_node: int | None,
                  steps_per_epoch: int, total_steps: int) -> tuple[dict[str, Any], Any, Recipe]:
    """Step 4: the options of ``cfg.comm`` that exchange ``cfg.comm.algorithm`` takes, as shown
    and passed (:data:`SHOWN` always, the other switches only when not at their default) and as its
    checked options object (:mod:`flashsgd.exchanges`; None for ``auto``), and the recipe the
    optimizer runs (without momentum when the hook applies it: DGC's momentum correction moves the
    momentum into the compressor, Lin et al. 2018).

    Offered to the exchange: the layout (``ranks_per_node`` as resolved, ``grid``); every
    ``[comm]`` key generated from the catalog (:data:`~flashsgd.train.config.COMM_OPTION_KEYS`)
    that is set and read by the run (None, unset, leaves the exchange its own default; ``layer_trust``
    only for an optimizer that takes layer norms, :func:`~flashsgd.train.config.file.applies`);
    the options the plan derives
    (:data:`~flashsgd.train.config.DERIVED_OPTIONS`: ``seed``, ``timeout_s``; ``nesterov`` with the
    momentum correction); a sparse exchange's density warm-up in steps (:func:`density_warmup_of`:
    the user's steps or epochs, else the default rule scaled to ``total_steps``)."""
    c = cfg.comm
    if c.algorithm == "auto":  # chosen at start-up (flashsgd.train.auto), then derived again
        if c.momentum_correction:
            raise ValueError("config key comm.momentum_correction: --comm auto chooses the algorithm "
                             "itself; name a sparse algorithm (topk, gtopk, hgtopk) to use it")
        return {}, None, recipe
    exchange = EXCHANGES[c.algorithm]
    # set (None keeps the exchange's own) and read by the run (the plan warns about the others)
    keys = [k for k in COMM_OPTION_KEYS if getattr(c, k) is not None and applies(cfg, "comm", k)]
    offered: dict[str, Any] = {"ranks_per_node": ranks_per_node, "grid": c.grid}
    offered.update({k: getattr(c, k) for k in keys if k in SHOWN})  # the banner's order: shown first
    offered.update(seed=cfg.run.seed, timeout_s=cfg.run.timeout_s)
    offered.update({k: getattr(c, k) for k in keys if k not in SHOWN})
    offered.pop("density_warmup_steps", None)  # the warm-up's length: density_warmup_of, below
    if exchange.family == "sparse":
        offered.update(density_warmup_of(cfg).options(c.density, total_steps, steps_per_epoch))
    if c.momentum_correction:
        if "momentum_correction" not in exchange.option_names():
            takers = ", ".join(n for n, e in EXCHANGES.items() if e.reads("momentum_correction"))
            raise ValueError(f"config key comm.momentum_correction: hook {c.algorithm!r} has no momentum "
                             f"correction; it applies to the sparse hooks ({takers})")
        offered.update(momentum_correction=c.momentum_correction, nesterov=recipe.nesterov)
        recipe = dataclasses.replace(recipe, momentum=0.0, nesterov=False)
    try:
        options = exchange.options_from(**offered)  # every value checked by the options class
    except ValueError as exc:
        raise ValueError(f"config section [comm] for {c.algorithm!r}: {exc}") from None
    defaults = exchange.defaults()
    # the switches are left out where they equal the hook's own default: the banner stays short
    return {k: v for k, v in offered.items()
            if k in defaults and (k in SHOWN or defaults[k] != v)}, options, recipe


def check_auto_cluster(spec: str, world: int, ranks_per_node: int | None) -> None:
    """``comm.cluster`` must describe the run's layout (``--comm auto`` plans for it)."""
    from flashsgd.sim.cluster_file import load_cluster

    try:
        cluster = load_cluster(spec)
        if ranks_per_node is not None and cluster.ranks_per_node != ranks_per_node:
            raise ValueError(f"{cluster.name!r} has {plural(cluster.ranks_per_node, 'rank')} per node, this run "
                             f"{ranks_per_node}: describe the cluster the run is on")
        cluster.check_gpus(world)
    except ValueError as exc:
        raise ValueError(f"config key comm.cluster={spec!r}: {exc}") from None


def build_plan(cfg: TrainConfig, world: int, num_train: int, local_spawn: bool,
               backend: str | None = None) -> RunPlan:
    """Steps 1-4; ValueError (naming the config key) when the config cannot run on ``world`` ranks.

    Args:
        cfg: the validated config.
        world: ranks of the run (``run.workers`` on local spawn, torchrun's WORLD_SIZE).
        num_train: training samples per epoch.
        local_spawn: True when flashsgd spawns the ranks itself: one node over NCCL, emulated
            nodes of 2 ranks over Gloo (:func:`local_ranks_per_node`), unless
            ``comm.ranks_per_node`` (or env FLASHSGD_RANKS_PER_NODE) says otherwise.
        backend: the local spawn's backend (the launcher's choice); None: :func:`local_backend`.
            Ignored under torchrun.
    """
    recipe, source = resolve_recipe(cfg)                                   # Step 1
    if local_spawn and backend is None:                                    # Step 2
        backend = local_backend(cfg, world)
    if backend == "nccl" and cfg.comm.algorithm in DENSE:  # CUDA buckets on NCCL: its NCCL chain runs
        native_path(cfg.comm.algorithm, f"config key comm.algorithm={cfg.comm.algorithm!r} on backend nccl")
    rpn = cfg.comm.ranks_per_node
    if rpn is None:
        env = os.environ.get("FLASHSGD_RANKS_PER_NODE") or (None if local_spawn else
                                                             os.environ.get("LOCAL_WORLD_SIZE"))
        rpn = int(env) if env else (local_ranks_per_node(world, backend) if local_spawn else None)
    if rpn is not None and (rpn < 1 or world % rpn):
        raise ValueError(f"config key comm.ranks_per_node={rpn} must divide the world size {world}; "
                         f"valid: {', '.join(str(d) for d in range(1, world + 1) if world % d == 0)}")
    if cfg.comm.algorithm == "auto" and cfg.comm.cluster:
        check_auto_cluster(cfg.comm.cluster, world, rpn)
    table = build_batch_table(recipe, cfg.optim.global_batch)              # Step 3
    if table.final_batch > num_train:  # a step cannot take more than every sample once
        raise ValueError(f"config key optim.global_batch={cfg.optim.global_batch} is larger than the "
                         f"{num_train} training samples (the LR would be scaled for a batch no step "
                         f"takes); valid: optim.global_batch <= {_largest_batch(recipe, num_train)}")
    small = [b for _, b in table.rows if b < world]
    if small:
        raise ValueError(f"config key optim.global_batch={cfg.optim.global_batch} gives a global batch "
                         f"of {small[0]} for {plural(world, 'worker')}: every worker needs >= 1 sample per step; "
                         f"use optim.global_batch >= {world * cfg.optim.global_batch // small[0]}")
    epochs = math.ceil(recipe.epochs)
    # the one steps-per-epoch rule (a remainder smaller than the world joins the last full batch),
    # in closed form per batch-table row
    total = steps_in_epochs(num_train, table, epochs, min_last=world)
    _check_fail_at(cfg, world, total)
    first_epoch_steps = steps_per_epoch(num_train, table.rows[0][1], min_last=world)
    grid, options, checked, recipe, warnings, warm = _derive_comm(cfg, recipe, world, rpn, first_epoch_steps,
                                                                  total)  # Step 4
    few = few_steps_warning(first_epoch_steps, table.rows[0][1])  # the first epoch: its own batch
    warnings += [few] if few else []
    return RunPlan(config=cfg, world=world, ranks_per_node=rpn, grid=grid, recipe=recipe,
                   recipe_source=source, num_train=num_train, table=table,
                   schedule=recipe.schedule(), epochs=epochs, total_steps=total,
                   first_epoch_steps=first_epoch_steps, hook_options=options, exchange_options=checked,
                   warnings=tuple(warnings),
                   density_warmup=warm, backend=backend if local_spawn else None,
                   execution=execution(cfg, table, world,
                                       world if local_spawn else int(os.environ.get("LOCAL_WORLD_SIZE", world))))



def execution(cfg: TrainConfig, table: BatchTable, world: int, local_ranks: int = 1) -> dict[str, Any]:
    """Step 5: precision, autocast dtype, loss scaler, micro-batches (``optim.grad_accum``: each
    worker's shard of the unchanged global batch split into N; ValueError when the smallest shard
    has fewer than N samples), channels_last (effective only for 4-D image inputs; a note
    otherwise), compile, as every rank's TrainStep runs them, the input pipeline's worker
    processes per rank (``data.data_workers``; image folders only, :mod:`flashsgd.train.data.loader`),
    and ``cudnn_benchmark``: cuDNN times its algorithms for each new input shape and keeps the
    fastest (``torch.backends.cudnn.benchmark``, as PyTorch's ImageNet example sets it); on by
    default, since a run's shapes are few (one per batch-table row, plus an epoch's remainder),
    off with ``run.deterministic`` (the timed choice may differ between runs)."""
    r, n = cfg.run, cfg.optim.grad_accum
    smallest = min(b for _, b in table.rows) // world  # the smallest shard of any step
    if smallest < n:
        raise ValueError(f"config key optim.grad_accum={n}: the smallest per-worker shard is "
                         f"{plural(smallest, 'sample')} "
                         f"(global batch {min(b for _, b in table.rows)} on {plural(world, 'worker')}), "
                         f"and every micro-batch needs >= 1; valid: optim.grad_accum <= {smallest}")
    notes = []
    data_workers = 0  # in-memory datasets are indexed in the training process
    dataset = DATASETS.get(cfg.data.dataset)
    if not dataset.in_memory:
        from flashsgd.train.data.loader import default_data_workers

        data_workers = (cfg.data.data_workers if cfg.data.data_workers is not None
                        else default_data_workers(local_ranks))
    elif cfg.data.data_workers:
        notes.append(f"data_workers ignored: {cfg.data.dataset} is in memory")
    channels_last = r.channels_last and dataset.images
    if r.channels_last and not channels_last:
        notes.append(f"channels_last ignored: {cfg.data.dataset} inputs are not 4-D images")
    return {"precision": r.precision, "autocast": {"fp32": None, "bf16": "bfloat16", "fp16": "float16"}[r.precision],
            "loss_scaler": r.precision == "fp16", "grad_accum": n,
            "micro_batch_per_worker": [-(-b // world // n) for _, b in table.rows],
            "channels_last": channels_last, "compile": r.compile, "data_workers": data_workers,
            "cudnn_benchmark": not r.deterministic, "notes": notes}


def describe_execution(e: dict[str, Any]) -> str:
    """The banner's ``step`` line of :func:`execution`'s record."""
    if not e:
        return "fp32"
    parts = [e["precision"] + (" autocast + loss scaler" if e["loss_scaler"] else
                               " autocast" if e["autocast"] else "")]
    if e["grad_accum"] > 1:
        parts.append(f"grad accum {e['grad_accum']} (micro-batch <= "
                     f"{'/'.join(map(str, e['micro_batch_per_worker']))} per worker; no exchange on the "
                     f"first {e['grad_accum'] - 1})")
    if e["channels_last"]:
        parts.append("channels_last")
    if e["compile"]:
        parts.append("torch.compile")
    if e.get("data_workers"):
        parts.append(f"{plural(e['data_workers'], 'data worker')} per rank")
    return ", ".join(parts) + "".join(f"; {note}" for note in e["notes"])


def _largest_batch(recipe: Recipe, num_train: int) -> int:
    """The largest ``optim.global_batch`` whose batch table stays within ``num_train`` samples."""
    largest = int(num_train / max(f for _, f in recipe.batch_fractions))
    while largest > 1 and build_batch_table(recipe, largest).final_batch > num_train:
        largest -= 1
    return largest


def _check_fail_at(cfg: TrainConfig, world: int, total_steps: int) -> None:
    """``run.fail_at`` (or env FLASHSGD_FAIL_AT) must name a rank and a step this run has."""
    key = "config key run.fail_at" if cfg.run.fail_at else "env FLASHSGD_FAIL_AT"
    spec = cfg.run.fail_at or os.environ.get("FLASHSGD_FAIL_AT", "")
    if not spec:
        return
    try:
        rank, step, _ = parse_fail_at(spec)
    except ValueError as exc:
        raise ValueError(str(exc).replace("config key run.fail_at", key)) from None
    if rank >= world:
        raise ValueError(f"{key}={spec!r} names rank {rank}, but the run has {plural(world, 'rank')}; "
                         f"valid ranks: 0-{world - 1}")
    if step >= total_steps:
        raise ValueError(f"{key}={spec!r} names step {step}, but the run has {plural(total_steps, 'step')}; "
                         f"valid steps: 0-{total_steps - 1}")


def _derive_comm(cfg: TrainConfig, recipe: Recipe, world: int, rpn: int | None, first_epoch_steps: int,
                 total_steps: int) -> tuple[tuple[int, int] | None, dict[str, Any], Any, Recipe, list[str],
                                            dict[str, Any]]:
    """Step 4: the torus grid, the hook's options (as shown, and the checked options object), the
    recipe the optimizer runs, the warnings and the density warm-up's record (sparse exchanges;
    :func:`density_warmup_record`)."""
    grid = None
    if rpn is not None or cfg.comm.grid is not None:
        try:
            grid = parse_grid(cfg.comm.grid, world, default_x=rpn)
        except ValueError as exc:
            raise ValueError(f"config key comm.grid: {exc}") from None
    options, checked, recipe = _hook_options(cfg, recipe, rpn, first_epoch_steps, total_steps)
    sparse = checked is not None and EXCHANGES[cfg.comm.algorithm].family == "sparse"
    try:
        warnings = [] if checked is None else check_sparse_run(
            cfg.comm.algorithm, checked, total_steps, recipe.momentum, warmup=density_warmup_of(cfg),
            steps_per_epoch=first_epoch_steps, epochs=cfg.optim.epochs)
    except ValueError as exc:
        length = "steps" if cfg.comm.density_warmup_steps is not None else "epochs"
        raise ValueError(f"config keys comm.density_warmup_{length} / comm.momentum_correction: {exc}") from None
    warm = density_warmup_record(cfg, checked, total_steps) if sparse else {}
    warnings += [f"config key {key} is set but not read by {reader}: ignored"
                 for key, reader in set_but_unread(cfg).items()]
    return grid, options, checked, recipe, warnings, warm
