"""Typed configuration of `flashsgd train`: defaults < TOML file (``--config``) < CLI flags.

A run is described by :class:`TrainConfig`, five small dataclasses (``[data]``, ``[model]``,
``[optim]``, ``[comm]``, ``[run]`` in TOML). Every field has a docstring (shown by ``--help``) and
its field name is unique across sections, so each field is also a CLI flag with dashes
(``global_batch`` -> ``--global-batch``). ``[comm]`` holds, besides its own fields, one field per
option of the exchange catalog (:mod:`flashsgd.exchanges`), generated from the options classes
(:func:`_with_exchange_options`: type, default, choices and docstring read there). Resolution:

1. Start from the dataclass defaults (the embedded default run: 4 workers, MNIST-1D, fujitsu recipe
   at global batch 4096, torus2d on a 2x2 grid).
2. Overlay the TOML file, section by section; an unknown section or key is an error naming it and
   listing the valid ones.
3. Overlay the CLI flags that were given (argparse's SUPPRESS default: absent flags change nothing).
4. Validate every value against its type hint (``Literal`` choices, or the names of the registry
   a field's ``choices`` metadata points at, listed in the error; numbers must be finite) and the
   cross-field rules in :func:`validate`.

The resolved config is written to ``<out>/config.toml`` (:func:`save`), and that file can be passed
back with ``--config`` to repeat the run.

Example::

    >>> cfg = resolve(toml_text='[optim]\\nglobal_batch = 8192', cli={"algorithm": "ring"})
    >>> cfg.optim.global_batch, cfg.comm.algorithm, cfg.run.backend
    (8192, 'ring', 'auto')
"""

from __future__ import annotations

import dataclasses
import os
import sys
import typing
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable, Literal, Optional

from flashsgd import exchanges as X
from flashsgd.exchanges import BUCKET_MB, DENSITY_WARMUP_START
from flashsgd.sim.inputs import check_option
from flashsgd.train.config.values import choices_of, coerce

__all__ = ["TrainConfig", "DataConfig", "ModelConfig", "OptimConfig", "CommConfig", "RunConfig",
           "COMM_OPTION_KEYS", "DERIVED_OPTIONS", "UNSET_BY_PLAN", "choice", "choices_of", "coerce",
           "recipe_name", "recipe_value",
           "resolve", "validate", "to_dict", "dumps", "field_index", "field_docs", "section_types",
           "parse_fail_at", "SECTIONS"]

if sys.version_info >= (3, 11):
    import tomllib
else:  # pragma: no cover
    import tomli as tomllib



def _hook_names() -> list[str]:
    from flashsgd.comm.hooks import HOOKS

    return HOOKS.names() + ["auto"]


def _recipe_names() -> list[str]:
    from flashsgd.optim.recipes import RECIPES

    return list(RECIPES)


def _optimizer_names() -> list[str]:
    from flashsgd.optim.optimizers import OPTIMIZERS

    return OPTIMIZERS.names()


def _optimizer_help() -> str:
    from flashsgd.optim.optimizers import describe_all

    return f"A name in flashsgd.optim.optimizers.OPTIMIZERS (unset: the recipe's): {describe_all()}."


def choice(default: str, names: Callable[[], list[str]], doc: Callable[[], str] | None = None) -> Any:
    """A ``str`` field whose valid values are a registry's names (read when a value is checked,
    so registering a new algorithm or recipe is the only change needed); ``doc``: its help, made
    from the registry's entries when asked for (:func:`field_docs`)."""
    return field(default=default, metadata={"choices": names, **({"doc": doc} if doc else {})})


def _dataset_names() -> list[str]:
    from flashsgd.train.data.catalog import DATASETS

    return DATASETS.names()


def _dataset_help() -> str:
    from flashsgd.train.data.catalog import describe_all

    return f"A name in flashsgd.train.data.catalog.DATASETS: {describe_all()}."


@dataclass
class DataConfig:
    """``[data]``: what to train on."""

    dataset: str = choice("mnist1d", _dataset_names, _dataset_help)
    """The dataset (help: its catalog entries' summaries)."""
    num_samples: int = 40000
    """mnist1d: total samples (80% train / 20% test, a multiple of 10); synthetic: train samples."""
    data_dir: str = ""
    """imagefolder: root with train/<class>/*.jpg (and optional val/); mnist1d: cache folder."""
    image_shape: Literal["imagenet", "cifar"] = "imagenet"
    """synthetic: 3x224x224 with 1000 classes, or 3x32x32 with 10 classes."""
    image_size: int = 224
    """imagefolder: side of the random-resized crop (train) and center crop (eval), pixels."""
    data_seed: int = 42
    """mnist1d: generator seed of the dataset itself (not of the training run)."""
    data_workers: Optional[int] = None
    """imagefolder: DataLoader worker processes per rank decoding and augmenting beside training
    (0: in the training process); unset: this node's cores / its ranks, 1 to 8. In-memory datasets
    never use workers."""


@dataclass
class ModelConfig:
    """``[model]``: the network."""

    model: str = "mnist1d_cnn"
    """A name in MODELS (mnist1d_cnn, resnet20, resnet18, resnet50) or torchvision:NAME."""
    channels: int = 32
    """mnist1d_cnn: width of the conv layers."""
    zero_init_last_bn: Optional[bool] = None
    """Zero gamma of the last BN in each residual block; unset: the recipe decides."""


@dataclass
class OptimConfig:
    """``[optim]``: the large-batch recipe and its overrides (unset: the recipe's value)."""

    recipe: str = choice("fujitsu", _recipe_names)
    """A name in flashsgd.optim.recipes.RECIPES: optimizer, LR rule, warmup, decay, batch-size
    control, label smoothing."""
    optimizer: Optional[str] = field(default=None, metadata={"choices": _optimizer_names, "doc": _optimizer_help})
    """The optimizer; unset: the recipe's (help: its catalog entries' summaries)."""
    global_batch: int = 4096
    """Final global batch (all workers together; batch-size control starts below it)."""
    epochs: float = 15.0
    """Training length; the recipe's warmup, milestones and batch rows are rescaled to it."""
    lr_per_ref: Optional[float] = None
    """Peak LR per ``ref_batch`` samples (linear scaling: LR = lr_per_ref * batch / ref_batch)."""
    ref_batch: Optional[int] = None
    """Reference batch of the linear-scaling rule (the recipe's: 256, Goyal et al.)."""
    lr_max: Optional[float] = None
    """The LR the linear rule saturates at, LR = L / (1 + L / lr_max) (McCandlish et al. 2018);
    unset: the recipe's (most: none, linear at every batch)."""
    momentum: Optional[float] = None
    """Momentum factor in [0, 1)."""
    nesterov: Optional[bool] = None
    """Nesterov momentum."""
    weight_decay: Optional[float] = None
    """L2 coefficient (never on bias/BN when the recipe excludes them)."""
    warmup_epochs: Optional[float] = None
    """Linear warmup length in epochs (after rescaling to ``epochs``)."""
    label_smoothing: Optional[float] = None
    """CrossEntropyLoss label smoothing in [0, 1)."""
    trust_coefficient: Optional[float] = None
    """Trust ratio coefficient eta of the layer-wise optimizers (lars, lamb)."""
    proxy_tuning: bool = True
    """Use the recipe's dataset-tuned variant when one is registered (fujitsu on mnist1d:
    fujitsu-mnist1d); false: the recipe's published numbers."""
    grad_accum: int = 1
    """Micro-batches per optimizer step (gradient accumulation): each worker's shard of the global
    batch is split into N, DDP exchanges only after the last (no_sync on the others); the update is
    the whole global batch's. Every worker's smallest shard must hold >= N samples."""


DERIVED_OPTIONS: dict[str, str] = {"seed": "run.seed", "timeout_s": "run.timeout_s",
                                   "nesterov": "optim.nesterov"}
"""Exchange options with no ``[comm]`` key, and the key the plan sets each from: the run's seed, its
collective deadline, and the optimizer's Nesterov (the recipe's unless ``optim.nesterov`` is set),
which a sparse hook applies only with ``comm.momentum_correction`` (the momentum moves into the
hook, and the recipe's Nesterov form with it)."""

UNSET_BY_PLAN: dict[str, str] = {
    "density_warmup_steps": "unset: the plan derives it from comm.density_warmup_epochs (or that key's "
                            "default rule); setting both keys is an error",
}
"""Generated ``[comm]`` keys whose unset value (None) the plan derives, and what their help says."""


def _with_exchange_options(cls: type) -> type:
    """Add to ``cls`` (the ``[comm]`` class, before ``@dataclass``) one field per exchange option of
    the catalog (:func:`flashsgd.exchanges.all_options`) that it does not declare itself and that is
    not in :data:`DERIVED_OPTIONS`, after its own fields, in catalog order.

    Each generated field takes from the catalog its type, its default, its choices and its
    docstring (prefixed with the exchanges that read it). The default is None ("unset") where the
    exchanges' defaults differ (``threaded``: the dense hooks True, the sparse False; each keeps its
    own) or where the plan derives the value (:data:`UNSET_BY_PLAN`); the plan passes the hook every
    generated key that is not None. So one field in an options class of :mod:`flashsgd.exchanges` is
    one ``[comm]`` key, one ``flashsgd train`` flag and one hook option, with nothing restated here.
    """
    own = cls.__annotations__  # the hand-written fields (train-only, or resolved specially)
    for name in X.all_options():
        if name in own or name in DERIVED_OPTIONS:
            continue
        readers, hint = X.option_readers(name), X.option_hint(name)
        doc = f"{', '.join(readers)}: {X.option_doc(name)}"
        try:
            default = None if name in UNSET_BY_PLAN else X.option_default(name)
        except KeyError:  # the exchanges' defaults differ: unset keeps each one's own
            default, by_value = None, {}
            for exchange, value in readers.items():
                by_value.setdefault(repr(value), []).append(exchange)
            doc += (" Unset: each exchange's own default ("
                    + "; ".join(f"{', '.join(e)}: {v}" for v, e in by_value.items()) + ").")
        if name in UNSET_BY_PLAN:
            doc += f" {UNSET_BY_PLAN[name][0].upper()}{UNSET_BY_PLAN[name][1:]}."
        if default is None and type(None) not in typing.get_args(hint):
            hint = Optional[hint]
        metadata: dict[str, Any] = {"doc": doc, "exchange_option": True}
        if X.option_choices(name):
            metadata["choices"] = lambda valid=X.option_choices(name): list(valid)
        own[name] = hint
        setattr(cls, name, field(default=default, metadata=metadata))
    return cls


@dataclass
@_with_exchange_options
class CommConfig:
    """``[comm]``: how gradients cross the network (a DDP communication hook).

    The fields written here are the train's own (the exchange, ``--comm auto``'s inputs, the bucket
    size, the density warm-up's run-relative start and length, the momentum correction) and
    the layout (resolved with the world by the plan). Every other option of the exchange catalog
    (:mod:`flashsgd.exchanges`: density, selection, node_split, threaded, start_iter, ...) is a field
    generated from its options class (:func:`_with_exchange_options`): its default, choices and help
    are the catalog's, read there, never restated here."""

    algorithm: str = choice("torus2d", _hook_names)
    """Hook name in flashsgd.comm.hooks.HOOKS (noop: no exchange, for benchmarks only), or auto: the
    planner's choice for this cluster (algorithm, bucket size, density, grid or rank; measured at
    start-up, recorded in <out>/auto.json); flag ``--comm``."""
    cluster: Optional[str] = None
    """auto: the cluster to plan for, a preset or a TOML file (e.g. the cluster.toml an earlier auto
    run measured); unset: the network is measured at start-up (a few seconds)."""
    accuracy_risk: Literal["low", "any"] = "low"
    """auto: low: compression only where it was measured to keep accuracy over this run's steps;
    any: every candidate."""
    bucket_mb: float = BUCKET_MB
    """DDP gradient bucket cap in MiB (DDP's ``bucket_cap_mb``; one bucket = one exchange call)."""
    grid: Optional[str] = None
    """torus2d grid XxY with X*Y = world size; unset: X = ranks per node (2x2 on 4 local workers)."""
    ranks_per_node: Optional[int] = None
    """Ranks per node; unset: torchrun's LOCAL_WORLD_SIZE; on local spawn one node over NCCL (every GPU
    of this machine), 2 emulated per node over Gloo."""
    density_warmup: Optional[float] = DENSITY_WARMUP_START
    """topk/gtopk/hgtopk: density at the first step, decaying exponentially to `density` over
    density_warmup_epochs (DGC's 0.25, Lin et al. 2018: on by default, without it gTop-k at 0.001
    lost 13-19 points on 1000-1250-step runs); 0 or none: no warm-up. A start at or below
    `density` is no warm-up."""
    density_warmup_epochs: Optional[float] = None
    """topk/gtopk/hgtopk: length of the density warm-up, in epochs of the first epoch's batch size;
    unset: min(4 epochs, half the run's steps), DGC's 4 epochs scaled to the run
    (flashsgd.exchanges.DensityWarmup, shown in the plan); 0: no warm-up. Or set
    comm.density_warmup_steps instead (not both)."""
    momentum_correction: float = field(default=0.0, metadata={"true_means": "the recipe's momentum"})
    """topk/gtopk/hgtopk/oktopk: DGC momentum correction (Lin et al. 2018), the momentum factor in
    [0, 1) the hook applies (0: off), as the hook's option of that name: the velocity is
    accumulated in the residual (with the recipe's Nesterov form, optim.nesterov) and the optimizer
    runs with momentum 0. true (a bare --momentum-correction, and config.toml files written when
    this key was a switch): the recipe's momentum (optim.momentum when set), resolved when the config
    is read. Helps SGD at low coverage, hurts LARS (docs/sparse_accuracy.md)."""


COMM_OPTION_KEYS: tuple[str, ...] = tuple(f.name for f in dataclasses.fields(CommConfig)
                                          if f.metadata.get("exchange_option"))
"""The ``[comm]`` keys generated from the exchange catalog (:func:`_with_exchange_options`)."""


@dataclass
class RunConfig:
    """``[run]``: processes, how the step executes (precision, memory format, compile), outputs,
    checkpoints and failure handling."""

    workers: Optional[int] = None
    """Local worker processes when not under torchrun (torchrun's WORLD_SIZE wins); unset: one per
    visible GPU with CUDA, else 4 CPU processes."""
    backend: Literal["auto", "gloo", "nccl"] = "auto"
    """auto: NCCL with one rank per GPU when CUDA is available (Gloo on the CPU when more workers than
    GPUs are asked for), Gloo otherwise."""
    out: str = "runs/train"
    """Run directory: config.toml, metrics.jsonl, TensorBoard events, summary, report, checkpoints."""
    seed: int = 0
    """Seed of model init, data order and augmentation."""
    resume: str = "auto"
    """auto: continue from <out>/checkpoints if one exists; never: start fresh; or a checkpoint dir."""
    checkpoint_every: int = 50
    """Checkpoint every N optimizer steps (0: only at epoch ends)."""
    keep_checkpoints: int = 2
    """Newest checkpoints kept (older ones deleted), >= 1."""
    eval_every: int = 1
    """Evaluate on the test split every N epochs (and always after the last)."""
    target_accuracy: float = 97.0
    """Test accuracy (%) whose first crossing is reported as time-to-accuracy."""
    timeout_s: float = 300.0
    """Deadline of every collective: a dead or hung worker fails the others within it."""
    nonfinite: Literal["skip", "stop"] = "skip"
    """Non-finite loss or gradient: skip the step and count it, or stop with the step number."""
    max_skipped: int = 10
    """Stop (exit 1, naming the first skipped step) after this many consecutive skipped steps
    (0: no bound); non-finite parameters stop the run at the first skipped step either way."""
    max_steps: int = 0
    """Stop after this many optimizer steps in total (0: train all epochs)."""
    progress: bool = True
    """Progress on rank 0: a tqdm bar when stderr is a terminal, else a line every few seconds."""
    deterministic: bool = False
    """torch.use_deterministic_algorithms(True) (resume equivalence tests)."""
    threads: int = 0
    """torch intra-op threads per worker (0: cores / local workers)."""
    precision: Literal["fp32", "bf16", "fp16"] = "fp32"
    """Forward and loss under torch.autocast in this dtype (bf16 also on CPU; fp16 with a loss
    scaler, torch.amp.GradScaler); parameters, gradients and their exchange stay fp32."""
    channels_last: bool = False
    """Model and 4-D inputs in torch.channels_last memory format (ignored, with a note, for inputs
    that are not 4-D images, e.g. mnist1d)."""
    compile: bool = False
    """torch.compile the DDP model (falls back to eager with a one-line message if compilation fails;
    the first steps are slow while it compiles)."""
    fail_at: str = ""
    """Debug fault injection RANK:STEP:MODE (MODE exit|hang|nan); also env FLASHSGD_FAIL_AT."""


@dataclass
class TrainConfig:
    """The whole run (TOML sections data, model, optim, comm, run)."""

    data: DataConfig = field(default_factory=DataConfig)
    model: ModelConfig = field(default_factory=ModelConfig)
    optim: OptimConfig = field(default_factory=OptimConfig)
    comm: CommConfig = field(default_factory=CommConfig)
    run: RunConfig = field(default_factory=RunConfig)


SECTIONS = tuple(f.name for f in dataclasses.fields(TrainConfig))


def section_types() -> dict[str, type]:
    return {f.name: f.default_factory for f in dataclasses.fields(TrainConfig)}  # type: ignore[misc]


def field_index() -> dict[str, tuple[str, dataclasses.Field, Any]]:
    """flat field name -> (section, Field, resolved type hint); names are unique across sections."""
    out: dict[str, tuple[str, dataclasses.Field, Any]] = {}
    for section, cls in section_types().items():
        hints = typing.get_type_hints(cls)
        for f in dataclasses.fields(cls):
            assert f.name not in out, f"duplicate config field {f.name}"
            out[f.name] = (section, f, hints[f.name])
    return out


def field_docs(cls: type) -> dict[str, str]:
    """Attribute docstrings (the string literal after each field) of a config dataclass, and the
    ``doc`` metadata of the fields generated from the exchange catalog (:data:`COMM_OPTION_KEYS`)."""
    import ast
    import inspect
    import textwrap

    tree = ast.parse(textwrap.dedent(inspect.getsource(cls)))
    body = tree.body[0].body  # type: ignore[attr-defined]
    docs = {}
    for a, b in zip(body, body[1:]):
        if isinstance(a, ast.AnnAssign) and isinstance(b, ast.Expr) and isinstance(b.value, ast.Constant):
            docs[a.target.id] = str(b.value.value)  # type: ignore[union-attr]
    if dataclasses.is_dataclass(cls):  # a callable doc is made from a catalog when asked for
        docs.update({f.name: f.metadata["doc"]() if callable(f.metadata["doc"]) else f.metadata["doc"]
                     for f in dataclasses.fields(cls) if "doc" in f.metadata})
    return docs


MAX_CHANNELS = 4096
"""The widest ``model.channels``: mnist1d_cnn at 4096 has 101M parameters (400 MB in fp32, per copy:
weights, gradients, momentum, on every rank); wider is no experiment on 40-value signals, and
99,999,999 asked torch for 1.2e17 bytes."""
MAX_EPOCHS = 2 ** 30
"""The longest ``optim.epochs``: the epoch number enters the seeds of the data order and of each
sample's augmentation ((seed * 7919 + epoch) * 1_000_003 + index, :mod:`flashsgd.train.data.images`),
which stay below torch's 2**63 for seed and epoch < 2**30 (run.seed's bound) and index < 2**32."""


def check_accuracy_percent(value: float, what: str) -> None:
    """ValueError naming ``what`` unless ``value`` is a test accuracy in percent, 0-100 (the one rule
    of run.target_accuracy and `flashsgd compare --target`)."""
    if not 0 <= value <= 100:  # NaN too
        raise ValueError(f"{what} is a test accuracy in percent: valid 0-100, got {value:g}")


def _positive(cfg: TrainConfig, section: str, key: str, allow_zero: bool = False) -> None:
    v = getattr(getattr(cfg, section), key)
    if v < 0 or (v == 0 and not allow_zero):
        raise ValueError(f"config key {section}.{key} must be {'>= 0' if allow_zero else '> 0'}, got {v!r}")


def validate(cfg: TrainConfig) -> TrainConfig:
    """Cross-field and range checks; every error names the key and what would be valid."""
    from flashsgd.train.models import MODELS

    for s, k in (("data", "num_samples"), ("data", "image_size"), ("model", "channels"),
                 ("optim", "global_batch"), ("optim", "epochs"),
                 ("comm", "bucket_mb"), ("run", "keep_checkpoints"),
                 ("run", "eval_every"), ("run", "timeout_s"), ("optim", "grad_accum")):
        _positive(cfg, s, k)
    for s, k in (("run", "checkpoint_every"), ("run", "max_steps"), ("run", "threads"),
                 ("run", "max_skipped")):
        _positive(cfg, s, k, allow_zero=True)
    cores = os.cpu_count() or 1
    if cfg.run.threads > cores:  # torch.set_num_threads(100000) kills the workers with SIGSEGV
        raise ValueError(f"config key run.threads must be at most this machine's {cores} cores, got "
                         f"{cfg.run.threads}; valid: 0 (automatic: the cores shared by a node's "
                         f"ranks) to {cores}")
    if cfg.model.channels > MAX_CHANNELS:  # 99999999 was a traceback (a 1e17-byte allocation)
        raise ValueError(f"config key model.channels must be in [1, {MAX_CHANNELS}] (the width of "
                         f"mnist1d_cnn's conv layers; {MAX_CHANNELS} is 101M parameters), got "
                         f"{cfg.model.channels}")
    if cfg.optim.epochs > MAX_EPOCHS:
        raise ValueError(f"config key optim.epochs must be in (0, 2**30] = (0, {MAX_EPOCHS}] (the epoch "
                         f"number enters the data order's and the augmentation's 64-bit seeds, as "
                         f"run.seed does), got {cfg.optim.epochs:g}")
    for s, k in (("run", "seed"), ("data", "data_seed")):
        v = getattr(getattr(cfg, s), k)
        # the derived streams must fit torch's 64-bit seeds: a sample's augmentation seed is
        # (seed * 7919 + epoch) * 1_000_003 + index (flashsgd.train.data.images), < 2**63 for seed < 2**30
        if not 0 <= v < 2 ** 30:
            raise ValueError(f"config key {s}.{k} must be in [0, 2**30 - 1] = [0, 1073741823], got {v}")
    check_accuracy_percent(cfg.run.target_accuracy, "config key run.target_accuracy")
    from flashsgd.train.data.catalog import DATASETS

    DATASETS.get(cfg.data.dataset).check(cfg.data)  # the dataset's own rules (catalog)
    if cfg.run.workers is not None and cfg.run.workers < 1:
        raise ValueError(f"config key run.workers must be >= 1 (or unset: one per GPU, else 4), "
                         f"got {cfg.run.workers}")
    if cfg.data.data_workers is not None and cfg.data.data_workers < 0:
        raise ValueError(f"config key data.data_workers must be >= 0 (0: decode in the training "
                         f"process) or unset (automatic), got {cfg.data.data_workers}")
    _check_exchange_options(cfg.comm)
    _resolve_momentum_correction(cfg)
    if cfg.comm.density_warmup is None:  # `none` was given (unset is DENSITY_WARMUP_START): off,
        cfg.comm.density_warmup = 0.0    # written as 0 so that config.toml repeats it (no null)
    warm = cfg.comm.density_warmup
    # the default start under a density above it is no warm-up; a start set below it is an error
    if not (warm == 0 or cfg.comm.density <= warm <= 1 or warm == DENSITY_WARMUP_START):
        raise ValueError(f"config key comm.density_warmup must be in [comm.density, 1] = "
                         f"[{cfg.comm.density:g}, 1] or 0 (no warm-up), got {warm:g}")
    if cfg.comm.density_warmup_epochs is not None:  # unset: the default rule
        _positive(cfg, "comm", "density_warmup_epochs", allow_zero=True)
        if cfg.comm.density_warmup_steps is not None:
            raise ValueError(f"config keys comm.density_warmup_epochs ({cfg.comm.density_warmup_epochs:g}) "
                             f"and comm.density_warmup_steps ({cfg.comm.density_warmup_steps}) both set "
                             f"the density warm-up's length: set one of them")
    if cfg.comm.cluster is not None:
        if cfg.comm.algorithm != "auto":
            raise ValueError(f"config key comm.cluster is read only with comm.algorithm = auto, got "
                             f"comm.algorithm = {cfg.comm.algorithm!r}")
        from flashsgd.sim.cluster_file import load_cluster

        try:
            load_cluster(cfg.comm.cluster)
        except ValueError as exc:
            raise ValueError(f"config key comm.cluster: {exc}") from None
    _check_optim_overrides(cfg.optim)
    if cfg.run.resume not in ("auto", "never") and not Path(cfg.run.resume).is_dir():
        raise ValueError(f"config key run.resume: {cfg.run.resume!r} is not a checkpoint directory; "
                         "valid: auto, never, or a directory such as <out>/checkpoints/step-00000050")
    name = cfg.model.model
    if not name.startswith("torchvision:") and name not in MODELS:
        raise ValueError(f"config key model.model: unknown model {name!r}; valid choices: "
                         f"{', '.join(MODELS.names())}, torchvision:NAME")
    if cfg.run.fail_at:
        parse_fail_at(cfg.run.fail_at)
    return cfg


def recipe_name(cfg: TrainConfig) -> str:
    """The registered recipe the run trains with: ``optim.recipe``, or its dataset-tuned variant
    (``optim.proxy_tuning``, :func:`flashsgd.optim.recipes.tuned_variant`)."""
    from flashsgd.optim.recipes import tuned_variant

    o = cfg.optim
    return tuned_variant(o.recipe, cfg.data.dataset) if o.proxy_tuning else o.recipe


def recipe_value(cfg: TrainConfig, key: str) -> Any:
    """The value of recipe field ``key`` the run trains with: the ``[optim]`` override when set,
    else the recipe's (:func:`recipe_name`)."""
    value = getattr(cfg.optim, key, None)
    if value is not None:
        return value
    from flashsgd.optim.recipes import RECIPES

    return getattr(RECIPES[recipe_name(cfg)], key)


def _resolve_momentum_correction(cfg: TrainConfig) -> None:
    """``comm.momentum_correction``: ``true`` (a bare flag, an older config.toml) becomes the
    recipe's momentum factor, ``false`` 0; the factor must be in [0, 1)."""
    c = cfg.comm
    if c.momentum_correction is True or c.momentum_correction is False:
        c.momentum_correction = float(recipe_value(cfg, "momentum")) if c.momentum_correction else 0.0
    if not 0.0 <= c.momentum_correction < 1.0:
        raise ValueError(f"config key comm.momentum_correction must be a momentum factor in [0, 1) (0: off; "
                         f"true: the recipe's momentum), got {c.momentum_correction:g}")


def _check_exchange_options(c: CommConfig) -> None:
    """Every generated ``[comm]`` key that is set, checked by each options class that has it
    (:func:`flashsgd.sim.inputs.check_option`, which `flashsgd simulate` reads too: the catalog's own
    rules, written once there; ``--start-iter 1`` is an error even on a run whose exchange does not
    read it); the error names the key."""
    for name in COMM_OPTION_KEYS:
        value = getattr(c, name)
        if value is None:
            continue
        try:
            check_option(name, value)
        except ValueError as exc:
            text = str(exc)
            raise ValueError(f"config key comm.{text}" if text.startswith(f"{name} ") else
                             f"config key comm.{name}: {text}") from None


# optim override -> (lowest valid, whether the lowest is allowed, highest or None, whether it is)
OPTIM_RANGES: dict[str, tuple[float, bool, float | None, bool]] = {
    "lr_per_ref": (0.0, True, None, False), "ref_batch": (0.0, False, None, False),
    "lr_max": (0.0, False, None, False),
    "momentum": (0.0, True, 1.0, False), "weight_decay": (0.0, True, None, False),
    "warmup_epochs": (0.0, True, None, False), "label_smoothing": (0.0, True, 1.0, False),
    "trust_coefficient": (0.0, False, None, False),
}


def _check_optim_overrides(o: OptimConfig) -> None:
    """Range of each set override, named by its config key (the recipe would name its own field)."""
    for key, (lo, lo_ok, hi, hi_ok) in OPTIM_RANGES.items():
        v = getattr(o, key)
        if v is None:
            continue
        if v < lo or (v == lo and not lo_ok) or (hi is not None and (v > hi or (v == hi and not hi_ok))):
            valid = f"{'[' if lo_ok else '('}{lo:g}, " + (f"{hi:g}{']' if hi_ok else ')'}" if hi is not None else "inf)")
            raise ValueError(f"config key optim.{key} must be in {valid}, got {v!r}")
    if o.warmup_epochs is not None and o.warmup_epochs >= o.epochs:
        raise ValueError(f"config key optim.warmup_epochs ({o.warmup_epochs:g}) must be shorter than "
                         f"optim.epochs ({o.epochs:g})")


def parse_fail_at(spec: str) -> tuple[int, int, str]:
    """``"RANK:STEP:MODE"`` -> (rank, step, mode); mode exit | hang | nan."""
    parts = spec.split(":")
    if len(parts) != 3 or not parts[0].isdigit() or not parts[1].isdigit() or \
            parts[2] not in ("exit", "hang", "nan"):
        raise ValueError(f"config key run.fail_at must look like RANK:STEP:MODE with MODE one of "
                         f"exit, hang, nan (e.g. '1:20:exit'), got {spec!r}")
    return int(parts[0]), int(parts[1]), parts[2]


def apply(cfg: TrainConfig, section: str, values: dict[str, Any], source: str) -> None:
    """Overlay one section's ``values`` onto ``cfg`` (in place)."""
    if section not in SECTIONS:
        raise ValueError(f"{source}: unknown config section [{section}]; valid sections: "
                         f"{', '.join(SECTIONS)}")
    if not isinstance(values, dict):
        raise ValueError(f"{source}: [{section}] must be a table, got {values!r}")
    index = field_index()
    obj = getattr(cfg, section)
    valid = [f.name for f in dataclasses.fields(obj)]
    for key, value in values.items():
        if key not in valid:
            raise ValueError(f"{source}: unknown config key {section}.{key}; valid keys in "
                             f"[{section}]: {', '.join(valid)}")
        _, f, hint = index[key]
        if "true_means" in f.metadata and (isinstance(value, bool) or str(value).lower() in ("true", "false")):
            value = coerce(f"{section}.{key}", value, bool)  # resolved by validate (its metadata says how)
        else:
            value = coerce(f"{section}.{key}", value, hint, f.metadata.get("choices"))
        setattr(obj, key, value)


def _check_config_path(path: Path) -> None:
    """``--config`` must name a TOML file: ValueError saying what it names instead."""
    if path.is_file():
        return
    if path.is_dir():
        inside = path / "config.toml"
        hint = (f"; the run directory's own is {inside}" if inside.is_file() else
                " (such as a run directory's config.toml)")
        raise ValueError(f"--config {str(path)!r} is a directory; expected a TOML file{hint}")
    if path.exists():
        raise ValueError(f"--config {str(path)!r} is not a regular file; expected a TOML file")
    raise ValueError(f"--config {str(path)!r}: no such file")


def resolve(toml_path: str | Path | None = None, cli: dict[str, Any] | None = None,
            toml_text: str | None = None, preset: str | None = None) -> TrainConfig:
    """Steps 1-4: defaults < preset (:mod:`flashsgd.train.config.presets`) < TOML (file or text) < CLI
    values (flat field names) -> validated config."""
    cfg = TrainConfig()  # Step 1
    index = field_index()
    if preset is not None:
        from flashsgd.train.config.presets import PRESETS

        if preset not in PRESETS.names():
            raise ValueError(f"--preset {preset!r} is unknown; valid: {', '.join(PRESETS.names())}")
        for key, value in PRESETS.get(preset).values.items():
            apply(cfg, index[key][0], {key: value}, f"preset {preset}")
    if toml_path is not None:
        path = Path(toml_path)
        _check_config_path(path)
        try:
            toml_text, source = path.read_text(), str(path)
        except (OSError, UnicodeDecodeError) as exc:  # a binary file, unreadable: named
            raise ValueError(f"--config {str(path)!r}: not a readable TOML text file "
                             f"({type(exc).__name__}: {exc})") from None
    else:
        source = "config"
    if toml_text is not None:  # Step 2
        try:
            data = tomllib.loads(toml_text)
        except tomllib.TOMLDecodeError as exc:
            raise ValueError(f"{source}: invalid TOML: {exc}") from None
        for section, values in data.items():
            apply(cfg, section, values, source)
    for key, value in (cli or {}).items():  # Step 3
        if key not in index:
            raise ValueError(f"unknown option {key!r}; valid: {', '.join(index)}")
        apply(cfg, index[key][0], {key: value}, "command line")
    return validate(cfg)  # Step 4


def to_dict(cfg: TrainConfig) -> dict[str, dict[str, Any]]:
    """Sections as plain dicts; None values are omitted (TOML has no null)."""
    return {s: {k: v for k, v in dataclasses.asdict(getattr(cfg, s)).items() if v is not None}
            for s in SECTIONS}


def dumps(cfg: TrainConfig) -> str:
    import tomli_w

    return "# flashsgd train: resolved configuration (unset optional keys take the recipe's value)\n" \
        + tomli_w.dumps(to_dict(cfg))
