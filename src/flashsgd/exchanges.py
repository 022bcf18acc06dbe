"""Every gradient exchange flashsgd runs, described once: name, family, options, wire, coverage, cost.

The bottom of the import graph (no torch, no other flashsgd module but the registry): the DDP hooks
(:mod:`flashsgd.comm.hooks`), the config and CLI flags of ``flashsgd train``, the simulator's cost
registry (:mod:`flashsgd.sim.algorithms`), the planner, ``train --comm auto`` and the benches all
read this module, so a name, a default or a rule is written here and nowhere else.

Papers: Goyal et al. 2017 (DDP's bucketed all-reduce), Mikami et al. 2018 (2D-Torus, arXiv
1811.05233), Shi et al. 2019 (Top-k and gTop-k, arXiv 1901.04359), Li & Hoefler 2022 (Ok-Topk,
arXiv 2201.07598), Lin et al. 2018 (DGC's warm-up
and corrections, arXiv 1712.01887), Vogels et al. 2019 (PowerSGD, arXiv 1905.13727).

============ ======= ================== ===================================================
exchange     family  options class      cost (alpha-beta, P ranks, n bytes; sim.costs)
============ ======= ================== ===================================================
native       dense   CommonOptions      DDP's all-reduce: Gloo's ring, NCCL's ring or tree
noop         none    CommonOptions      nothing sent (the benchmarks' ceiling)
ring         dense   DenseOptions       2(P-1) a + 2(P-1)/P n b
hierarchical dense   DenseOptions       node reduce-scatter, N-ring of n/L, node all-gather
torus2d      dense   DenseOptions       2(X-1) a_x + 2(Y-1) a_y + 2(X-1)/X n b_x + ...
topk         sparse  SparseOptions      a + (P-1) k s b (direct exchange of k pairs)
gtopk        sparse  SparseOptions      lgP a + lgP k s b (butterfly of pairwise merges)
hgtopk       sparse  HierSparseOptions  node step (node_split) + gTop-k among the nodes
oktopk       sparse  OkTopkOptions      2 a + 3k (P-1)/P s b (split and reduce, then gather)
powersgd     lowrank LowRankOptions     2 a + (n+m) r 4 b 2(P-1)/P per n x m matrix
============ ======= ================== ===================================================

(s: bytes of one (value, index) pair on the wire, :func:`wire_index_bytes`.)

Adding an exchange is one :data:`EXCHANGES` entry (and its hook factory and cost function, named
here). Adding an option is one field of its options class, with its docstring under it (and its
check in the class's ``__post_init__``; a fixed set of values in :data:`OPTION_CHOICES`). The rest
reads the field: ``flashsgd train``'s ``[comm]`` key and ``--flag`` are generated from it (type,
default, choices, help: :mod:`flashsgd.train.config`), the trainer passes the key to the hook when
set and validates it with the class's check, the banner and plan.json show it when it differs from
the exchange's default, and the benches declare their flags with
:func:`flashsgd.cli_flags.add_option_flag`. An option with different defaults in two classes (e.g.
``threaded``) is unset in the config: each exchange keeps its own.

Example::

    >>> EXCHANGES["gtopk"].family, EXCHANGES["gtopk"].defaults()["density"]
    ('sparse', 0.001)
    >>> names("sparse")
    ['topk', 'gtopk', 'hgtopk', 'oktopk']
    >>> EXCHANGES["gtopk"].options_from(density=0.01, grid="2x2").density   # grid is not gtopk's
    0.01
"""

from __future__ import annotations

import ast
import dataclasses
import inspect
import math
import textwrap
import typing
from dataclasses import dataclass
from typing import Any, Literal, Optional

from flashsgd.registry import Registry

Family = Literal["none", "dense", "sparse", "lowrank"]
FAMILIES: tuple[str, ...] = ("none", "dense", "sparse", "lowrank")

# ------------------------------------------------------------------------ shared constants -----

DEFAULT_DENSITY = 0.001
"""Fraction of gradient entries each rank sends: Shi et al. 2019 train at 0.001."""
DENSE_ITERATIONS = 2
"""Dense all-reduce iterations before a compressing hook starts (``start_iter``): DDP rebuilds its
buckets after the first iteration, so no per-bucket state (residual, P/Q memory) exists before the
layout is final; torch's PowerSGD default is 1000, ours matches the sparse hooks'."""
SELECTIONS: tuple[str, ...] = ("auto", "exact", "sampled", "threshold")
"""How a sparse hook picks its k entries (:mod:`flashsgd.comm.sparse.select`); all give the same
entries (exact top-k, ties to the lower index); ``auto``: :data:`SELECTION_BY_DEVICE`."""
SELECTION_BY_DEVICE: dict[str, str] = {"cuda": "exact", "cpu": "sampled"}
"""The selection ``auto`` (the default) runs on a bucket of each device type, resolved at the hook's
first call (``flashsgd train``: in its plan, from the run's backend).
cuda: ``exact`` (``torch.topk``, no host synchronization): on one H200, ResNet-50 bf16 at batch 256
and density 0.001, gtopk ran at 0.970x plain DDP with 0 host syncs per step, against 0.792x and 20
with ``sampled`` (docs/gpu.md, the default selection by device); on an H100 ``torch.topk`` was the fastest selection
of a 25.6M-element gradient (0.71 ms; sampled 0.74-1.05 ms, threshold 2.7-7.5 ms).
cpu: ``sampled``: 3.2-11.3x faster than ``torch.topk`` on the 2-core VM (docs/benchmarks.md,
"Selection"). Another device type gets ``exact``."""


def resolved_selection(selection: str, device_type: str) -> str:
    """``selection`` with ``auto`` resolved for a bucket on ``device_type`` (:data:`SELECTION_BY_DEVICE`)."""
    return SELECTION_BY_DEVICE.get(device_type, "exact") if selection == "auto" else selection


NODE_SPLITS: tuple[str, ...] = ("leader", "slices", "sparse")
"""How ``hgtopk`` combines the ranks of a node (:mod:`flashsgd.comm.sparse.hier`)."""
DENSITY_WARMUP_MODES: tuple[str, ...] = ("exponential", "linear")
"""How a density warm-up goes from its start to ``density`` (:func:`density_at`)."""
OPTION_CHOICES: dict[str, tuple[str, ...]] = {"selection": SELECTIONS, "node_split": NODE_SPLITS,
                                              "density_warmup_mode": DENSITY_WARMUP_MODES}
"""Options whose value is one of a fixed set of names: the choices of their flags and ``[comm]``
keys (:func:`option_choices`); the options classes check them."""
MIN_COVERAGE = 20.0
"""Coverage (:func:`coverage`) below which a sparse run loses accuracy: measured on MNIST-1D
(docs/sparse_accuracy.md), coverage 1.2 lost 12-13 points, 3.7-6.4 lost 1.5-4.7, 12-13 lost
0.7-2.3, 23 and 37 lost 0.4-0.5. ``flashsgd train`` warns below it; the planner offers no sparse
exchange below it."""
BUCKET_MB = 25.0
"""Gradient bucket cap in MiB (DDP's ``bucket_cap_mb`` default and unit: 25 x 2**20 bytes, the first
bucket 1 MiB): one bucket is one exchange call; the trainer, the benches and the simulator use it."""
INT32_NUMEL = 2 ** 31
"""Buckets shorter than this send int32 indices (every index <= 2**31 - 1 fits), longer ones int64."""
WIRE_INDEX_BYTES = 4
"""Bytes per index in a sparse message for every bucket under :data:`INT32_NUMEL` elements (all but
the largest single tensors): what the planner and ``--comm auto`` assume."""


def wire_index_bytes(numel: int) -> int:
    """Bytes of one index on the wire for a bucket of ``numel`` elements: 4 (int32) under 2**31
    elements, else 8 (int64). A message is k indices then the k values bit-cast into the same
    words, each part padded to whole words (``comm/sparse/__init__.py``)."""
    return WIRE_INDEX_BYTES if numel < INT32_NUMEL else 8


# --------------------------------------------------------------------------- checks ------------

def _flag(name: str, value: Any) -> None:
    if not isinstance(value, bool):
        raise ValueError(f"{name} must be True or False, got {value!r}")


def _int_at_least(name: str, value: Any, low: int, why: str = "") -> None:
    if isinstance(value, bool) or not isinstance(value, int) or value < low:
        raise ValueError(f"{name} must be an integer >= {low}{why}, got {value!r}")


def _choice(name: str, value: Any, valid: tuple[str, ...]) -> None:
    if value not in valid:
        raise ValueError(f"{name} must be one of {', '.join(valid)}, got {value!r}")


def check_density(density: Any, name: str = "density") -> float:
    """``density`` as a float if it lies in (0, 1], else ValueError naming ``name``."""
    if isinstance(density, bool) or not isinstance(density, (int, float)) or not 0 < density <= 1:
        raise ValueError(f"{name} must be a number in (0, 1] (fraction of entries sent), got {density!r}")
    return float(density)


def check_timeout_s(timeout_s: Any, name: str = "timeout_s") -> float:
    """``timeout_s`` as a float if it is a finite number of seconds > 0, else ValueError."""
    if isinstance(timeout_s, bool) or not isinstance(timeout_s, (int, float)) or \
            not math.isfinite(timeout_s) or timeout_s <= 0:
        raise ValueError(f"{name} must be a finite number of seconds > 0, got {timeout_s!r}")
    return float(timeout_s)


# -------------------------------------------------------------------------- options ------------

@dataclass(frozen=True)
class CommonOptions:
    """Options every hook takes (``native`` and ``noop`` take only these)."""

    timeout_s: Optional[float] = None
    """Deadline of every wait on a peer, seconds (None: the default process group's timeout); a
    rank that stops makes the others raise ``PeerTimeout`` naming it. ``native`` is bounded by its
    process group's own timeout; ``noop`` never waits."""

    def __post_init__(self) -> None:
        if self.timeout_s is not None:
            check_timeout_s(self.timeout_s)


@dataclass(frozen=True)
class DenseOptions(CommonOptions):
    """``ring``, ``hierarchical``, ``torus2d`` (:mod:`flashsgd.comm.dense_hooks`)."""

    ranks_per_node: Optional[int] = None
    """Ranks per node L (None: detected); the two levels of hierarchical and the torus's default X."""
    grid: Optional[str] = None
    """torus2d grid "XxY" with X*Y = world size (None: X = ranks per node)."""
    threaded: bool = True
    """Gloo: run each bucket's all-reduce on a communication thread, overlapping backward (NCCL
    buckets ignore it: the hook returns a chain of asynchronous collectives)."""

    def __post_init__(self) -> None:
        super().__post_init__()
        if self.ranks_per_node is not None:
            _int_at_least("ranks_per_node", self.ranks_per_node, 1)
        _flag("threaded", self.threaded)


@dataclass(frozen=True)
class SparseOptions(CommonOptions):
    """``topk``, ``gtopk`` (:mod:`flashsgd.comm.sparse.hooks`): error-fed sparsified exchange."""

    density: float = DEFAULT_DENSITY
    """Fraction of gradient entries each rank sends, k = ceil(density x bucket), in (0, 1]
    (Shi et al. 2019: 0.001)."""
    density_warmup: Optional[float] = None
    """Density at the first iteration, decaying to ``density`` over ``density_warmup_steps``
    (DGC: 0.25); None: no warm-up."""
    density_warmup_steps: int = 0
    """Iterations of the density warm-up."""
    density_warmup_mode: str = "exponential"
    """exponential (interpolate the log of the density: DGC's 0.25, 0.063, 0.016, 0.004, 0.001)
    or linear."""
    start_iter: int = DENSE_ITERATIONS
    """Dense iterations before sparsification, >= 2 (DDP rebuilds its buckets after the first)."""
    selection: str = "auto"
    """auto (by the bucket's device: :data:`SELECTION_BY_DEVICE`, exact on CUDA, sampled on the CPU),
    exact (torch.topk), sampled (threshold from a sample, then an exact trim) or threshold
    (candidates from block maxima, the threshold kept across steps): the same entries."""
    threshold_tolerance: float = 0.25
    """threshold selection: re-estimate a kept threshold that selects more than (1 + tol) k entries
    (Ok-Topk's reuse; 0: every step)."""
    threshold_every: int = 8
    """threshold selection: re-estimate the kept threshold at least every N steps."""
    seed: int = 0
    """Seed of the sampled selection's sample (rank added, so ranks sample differently)."""
    momentum_correction: float = 0.0
    """DGC momentum correction: the momentum factor applied in the hook (0: off); the optimizer then
    runs without momentum."""
    nesterov: bool = False
    """Nesterov form of the hook's momentum (with momentum_correction)."""
    momentum_masking: bool = True
    """With momentum_correction: zero the velocity where entries were sent (DGC)."""
    local_clip: Optional[float] = None
    """L2 norm each rank's bucket gradient is clipped to before accumulation (DGC); None: off."""
    layer_trust: bool = False
    """Record each parameter's dense gradient norm per step (one small all-reduce per bucket), for
    LARS's trust ratio."""
    compiled: bool = False
    """Fuse the residual add and the threshold selection's block maxima with torch.compile (eager
    on failure; the same result)."""
    threaded: bool = False
    """Gloo: run each bucket's exchange on a communication thread, so the next bucket's selection
    overlaps it."""

    def __post_init__(self) -> None:
        super().__post_init__()
        check_density(self.density)
        if self.density_warmup is not None:
            check_density(self.density_warmup, "density_warmup")
        _int_at_least("density_warmup_steps", self.density_warmup_steps, 0)
        _choice("density_warmup_mode", self.density_warmup_mode, DENSITY_WARMUP_MODES)
        _int_at_least("start_iter", self.start_iter, DENSE_ITERATIONS,
                      " (DDP rebuilds its buckets after the first iteration)")
        _choice("selection", self.selection, SELECTIONS)
        if isinstance(self.threshold_tolerance, bool) or not self.threshold_tolerance >= 0:
            raise ValueError(f"threshold_tolerance must be >= 0, got {self.threshold_tolerance!r}")
        _int_at_least("threshold_every", self.threshold_every, 1)
        if isinstance(self.momentum_correction, bool) or not isinstance(self.momentum_correction, (int, float)) \
                or not 0 <= self.momentum_correction < 1:
            raise ValueError(f"momentum_correction must be a momentum factor in [0, 1) (0: off; DGC and "
                             f"the recipes use 0.9), got {self.momentum_correction!r}")
        for name in ("nesterov", "momentum_masking", "layer_trust", "compiled", "threaded"):
            _flag(name, getattr(self, name))
        if self.nesterov and not self.momentum_correction:
            raise ValueError("nesterov=True needs momentum_correction > 0 (got 0: no momentum in the hook)")
        if self.local_clip is not None and (isinstance(self.local_clip, bool)
                                            or not isinstance(self.local_clip, (int, float))
                                            or not self.local_clip > 0 or not math.isfinite(self.local_clip)):
            raise ValueError(f"local_clip must be None (off) or a gradient norm > 0, got {self.local_clip!r}")

    def density_at(self, step: int) -> float:
        """The density at iteration ``step`` (:func:`density_at` of these options)."""
        return density_at(step, self.density, self.density_warmup, self.density_warmup_steps,
                          self.density_warmup_mode)


@dataclass(frozen=True)
class OkTopkOptions(SparseOptions):
    """``oktopk`` (:mod:`flashsgd.comm.sparse.oktopk`): split and reduce by regions, gather each
    region's top entries."""

    region_every: int = 8
    """Sparse steps between re-balancings of a bucket's regions (Ok-Topk's periodic space
    repartition); the first sparse step always does. Each costs one host read of P - 1 integers per
    bucket. Measured on the 1000-step MNIST-1D run (4 workers, density 0.001, 3 seeds): 64 steps
    lost 1.01 pt to dense, 8 steps 0.65 and every step 0.67, as gTop-k (0.62): the regions must
    follow the gradient more closely than Li & Hoefler's few hundred steps on this short run."""

    def __post_init__(self) -> None:
        super().__post_init__()
        _int_at_least("region_every", self.region_every, 1)


@dataclass(frozen=True)
class HierSparseOptions(SparseOptions):
    """``hgtopk`` (:mod:`flashsgd.comm.sparse.hier`): gTop-k among nodes, a node step inside."""

    ranks_per_node: Optional[int] = None
    """Ranks per node (None: detected)."""
    node_split: str = "leader"
    """leader (dense reduce to one rank per node, gTop-k among leaders), slices (each rank runs
    gTop-k on 1/L of the gradient) or sparse (gTop-k inside the node too)."""

    def __post_init__(self) -> None:
        super().__post_init__()
        if self.ranks_per_node is not None:
            _int_at_least("ranks_per_node", self.ranks_per_node, 1)
        _choice("node_split", self.node_split, NODE_SPLITS)


@dataclass(frozen=True)
class LowRankOptions(CommonOptions):
    """``powersgd``: PowerSGD with torch's hook's arithmetic and memories, batched per matrix shape
    (:mod:`flashsgd.comm.powersgd_hooks`, :mod:`flashsgd.comm.lowrank`)."""

    matrix_approximation_rank: int = 1
    """Rank r of the low-rank approximation, >= 1 (torch's default 1; Vogels et al. use 1-4; rank 2
    was within 0.3 pt of dense on the 1250-step MNIST-1D run)."""
    start_iter: int = DENSE_ITERATIONS
    """Dense iterations before compression, >= 2."""
    min_compression_rate: float = 2.0
    """A matrix n x m is compressed only if (n + m) r x rate < n m (torch's default)."""
    seed: int = 0
    """Seed of torch's RNG for the random initial Q (the same on every rank)."""

    def __post_init__(self) -> None:
        super().__post_init__()
        _int_at_least("matrix_approximation_rank", self.matrix_approximation_rank, 1)
        _int_at_least("start_iter", self.start_iter, DENSE_ITERATIONS,
                      " (DDP rebuilds its buckets after the first iteration)")
        if isinstance(self.min_compression_rate, bool) or not self.min_compression_rate > 0:
            raise ValueError(f"min_compression_rate must be > 0, got {self.min_compression_rate!r}")


# ------------------------------------------------------------------------- the catalog ---------

@dataclass(frozen=True)
class Exchange:
    """One exchange: what it is called, does, costs and accepts."""

    name: str
    family: Family
    options: type
    """Its typed options class (every default stated once, with its source)."""
    summary: str
    paper: str
    wire: str
    """What one rank puts on the wire per bucket."""
    cost: str | None
    """Name of its cost function in :mod:`flashsgd.sim.algorithms` (None: sends nothing)."""
    ignores: tuple[str, ...] = ()
    """Options of its (shared) options class that this algorithm never reads (ring: the grid)."""
    one_level: str | None = None
    """The exchange it is on one level (one node, or one rank per node): a two-level exchange's flat
    form (hierarchical: ring); None for a flat exchange."""

    @property
    def compresses(self) -> bool:
        """Whether it sends less than the gradient (changes the training: an accuracy question)."""
        return self.family in ("sparse", "lowrank")

    def option_names(self) -> list[str]:
        return [f.name for f in dataclasses.fields(self.options)]

    def reads(self, option: str) -> bool:
        """Whether this algorithm reads ``option`` (its class has it, and it is not ignored)."""
        return option in self.option_names() and option not in self.ignores

    def defaults(self) -> dict[str, Any]:
        """Every option's default."""
        return dataclasses.asdict(self.options())

    def make_options(self, **options: Any) -> Any:
        """The options object; an unknown option is a ValueError listing the valid ones."""
        unknown = sorted(set(options) - set(self.option_names()))
        if unknown:
            raise ValueError(f"hook {self.name!r} got unknown option(s) {', '.join(unknown)}; "
                             f"valid: {', '.join(self.option_names())}")
        return self.options(**options)

    def options_from(self, **offered: Any) -> Any:
        """The options object from the subset of ``offered`` this exchange takes (for callers, such
        as the trainer, that hold one set of settings for every exchange; an option it ignores
        keeps its default)."""
        return self.options(**{k: v for k, v in offered.items() if self.reads(k)})


EXCHANGES: Registry[Exchange] = Registry("exchange")
for _e in (
    Exchange("native", "dense", CommonOptions, "DDP's built-in all-reduce (grad / P, then a sum)",
             "Goyal et al. 2017", "the bucket, fp32/fp16/bf16 (backend's ring or tree)", "native"),
    Exchange("noop", "none", CommonOptions, "no exchange: every rank steps on its own gradient "
             "(the benchmarks' ceiling, never for training)", "-", "nothing", None),
    Exchange("ring", "dense", DenseOptions, "ring all-reduce (reduce-scatter + all-gather)",
             "Patarasuk & Yuan 2009", "2(P-1)/P of the bucket", "ring", ignores=("grid",)),
    Exchange("hierarchical", "dense", DenseOptions, "node reduce-scatter, cross-node rings, node "
             "all-gather", "Goyal et al. 2017; Jia et al. 2018", "2(P-1)/P of the bucket", "hierarchical",
             ignores=("grid",), one_level="ring"),
    Exchange("torus2d", "dense", DenseOptions, "2D-Torus: reduce-scatter along rows, all-reduce "
             "along columns, all-gather along rows", "Mikami et al. 2018", "2(P-1)/P of the bucket",
             "torus2d"),
    Exchange("topk", "sparse", SparseOptions, "Top-k S-SGD: every rank's k pairs to every other "
             "rank (direct exchange), summed", "Shi et al. 2019", "(P-1) messages of k (index, value) "
             "pairs", "topk"),
    Exchange("gtopk", "sparse", SparseOptions, "global Top-k: lgP butterfly rounds of pairwise "
             "merges keeping k", "Shi et al. 2019", "lgP messages of k (index, value) pairs", "gtopk"),
    Exchange("hgtopk", "sparse", HierSparseOptions, "hierarchical gTop-k: a node step (node_split), "
             "gTop-k among nodes, the result shared in the node", "Shi et al. 2019 (hierarchy: "
             "flashsgd)", "node step + lgN messages of k pairs", "hgtopk", one_level="gtopk"),
    Exchange("oktopk", "sparse", OkTopkOptions, "Ok-Topk: each rank's pairs to the region owners "
             "(split and reduce), each region's top k/P gathered by all", "Li & Hoefler 2022",
             "(P-1) messages of 2k/P pairs + (P-1) of k/P pairs (<= 6k(P-1)/P words)", "oktopk"),
    Exchange("powersgd", "lowrank", LowRankOptions, "PowerSGD: rank-r P and Q all-reduced per "
             "matrix, error feedback", "Vogels et al. 2019", "(n + m) r values per n x m matrix",
             "powersgd"),
):
    EXCHANGES.add(_e.name, _e)
del _e


BUILT_IN = "native"
"""The exchange that is the backend's own all-reduce (DDP's built-in): the baseline the benches
compare every other exchange with."""
COMPUTE_ONLY = "noop"
"""The exchange that sends nothing: the benchmarks' ceiling (compute alone; never for training)."""
assert EXCHANGES[BUILT_IN].family == "dense" and EXCHANGES[COMPUTE_ONLY].family == "none"


def reads(name: str, option: str) -> bool:
    """Whether exchange ``name`` reads ``option`` (:meth:`Exchange.reads`); False for a name outside
    the catalog (the simulator's reference algorithms)."""
    return name in EXCHANGES and EXCHANGES[name].reads(option)


def names(family: str | None = None) -> list[str]:
    """Exchange names (of one family), in catalog order."""
    if family is not None and family not in FAMILIES:
        raise ValueError(f"family must be one of {', '.join(FAMILIES)}, got {family!r}")
    return [n for n, e in EXCHANGES.items() if family is None or e.family == family]


def all_options() -> list[str]:
    """Every option of every exchange, once, in catalog order (each options class's fields in
    their order): what ``flashsgd train``'s ``[comm]`` keys are generated from
    (:mod:`flashsgd.train.config`)."""
    return list(dict.fromkeys(n for e in EXCHANGES.values() for n in e.option_names()))


def _options_class(name: str) -> type:
    """The first options class (catalog order) that has option ``name``."""
    for exchange in EXCHANGES.values():
        if name in exchange.option_names():
            return exchange.options
    raise KeyError(f"no exchange option {name!r}; valid: {', '.join(all_options())}")


def option_hint(name: str) -> Any:
    """The type hint of option ``name`` (``Optional[float]``, ``int`` ...), resolved."""
    return typing.get_type_hints(_options_class(name))[name]


def option_doc(name: str) -> str:
    """The docstring under option ``name`` in the first options class that declares it, on one
    line: the one text of its ``[comm]`` key's and its flags' help."""
    for cls in _options_class(name).__mro__:
        if name in cls.__dict__.get("__annotations__", {}):
            body = ast.parse(textwrap.dedent(inspect.getsource(cls))).body[0].body  # type: ignore[attr-defined]
            for a, b in zip(body, body[1:]):
                if isinstance(a, ast.AnnAssign) and getattr(a.target, "id", None) == name \
                        and isinstance(b, ast.Expr) and isinstance(b.value, ast.Constant):
                    return " ".join(str(b.value.value).split())
    raise KeyError(f"exchange option {name!r} has no docstring")


def option_choices(name: str) -> tuple[str, ...] | None:
    """The valid values of option ``name`` when it is one of a fixed set (:data:`OPTION_CHOICES`)."""
    return OPTION_CHOICES.get(name)


def option_readers(name: str) -> dict[str, Any]:
    """``{exchange: its default}`` of every exchange that reads option ``name`` (:meth:`Exchange.reads`),
    in catalog order."""
    return {n: e.options.__dataclass_fields__[name].default for n, e in EXCHANGES.items() if e.reads(name)}


def option_default(name: str) -> Any:
    """The one default of option ``name``, wherever several options classes declare it (they
    inherit it, so it is the same): what config fields and CLI flags show."""
    found = {e.options.__dataclass_fields__[name].default for e in EXCHANGES.values()
             if name in e.options.__dataclass_fields__}
    if len(found) != 1:
        raise KeyError(f"option {name!r}: {'no exchange declares it' if not found else f'defaults differ {found}'}")
    return found.pop()


# ---------------------------------------------------------------- density and coverage ---------

def density_at(step: int, density: float, density_warmup: float | None = None,
               density_warmup_steps: int = 0, density_warmup_mode: str = "exponential") -> float:
    """Density at iteration ``step``: ``density_warmup`` -> ``density`` over
    ``density_warmup_steps``, then flat (Shi et al. and DGC send more at first). ``exponential``
    interpolates the log of the density (0.25 -> 0.001 over 4 epochs: 0.25, 0.063, 0.016, 0.004,
    0.001 at the epoch boundaries), ``linear`` the density. Pure function of ``step``.

    Example::

        >>> round(density_at(50, 0.001, density_warmup=0.25, density_warmup_steps=100), 4)  # sqrt(0.25 * 0.001)
        0.0158
    """
    density = check_density(density)
    if density_warmup is None or density_warmup_steps <= 0 or step >= density_warmup_steps:
        return density
    start = check_density(density_warmup, "density_warmup")
    frac = max(step, 0) / density_warmup_steps
    if density_warmup_mode == "exponential":
        return start * (density / start) ** frac
    if density_warmup_mode == "linear":
        return start + (density - start) * frac
    raise ValueError(f"density_warmup_mode must be one of {', '.join(DENSITY_WARMUP_MODES)}, "
                     f"got {density_warmup_mode!r}")


def coverage(total_steps: int, options: SparseOptions) -> float:
    """How many times each gradient entry can at most be sent over a run of ``total_steps``.

    With error feedback every coordinate waits in the residual until it is among the k largest;
    gTop-k keeps ``density x numel`` of the whole world's coordinates per step, so over the sparse
    steps each can be sent at most::

        coverage = sum over s in [start_iter, total_steps) of min(1, density(s))

    times. Top-k could send up to P times more (each rank picks k), but only when the ranks pick
    different coordinates; measured, they mostly do not (plain Top-k at 0.001 over 1250 steps on 8
    ranks, a world-times bound of 10, lost 2.6 points), so the same bound is counted for every
    sparse exchange. Below :data:`MIN_COVERAGE` a run loses accuracy.

    Example::

        >>> round(coverage(1250, SparseOptions(density=0.001)), 3)
        1.248
    """
    start = options.start_iter
    warm_end = max(start, min(total_steps, options.density_warmup_steps if options.density_warmup else 0))
    warm = sum(min(1.0, options.density_at(s)) for s in range(start, warm_end))  # O(warm-up steps)
    return warm + max(0, total_steps - warm_end) * min(1.0, options.density)  # flat after it


def steps_for_coverage(options: SparseOptions, target: float = MIN_COVERAGE) -> int:
    """Run length (steps) at which :func:`coverage` reaches ``target`` at the final density
    (warm-up not counted: the bound that needs no warm-up)."""
    return options.start_iter + math.ceil(round(target / options.density, 9))


# ------------------------------------------------------------- the default density warm-up -----

DENSITY_WARMUP_START = 0.25
"""Density of the first step of a density warm-up: DGC's 75% sparsity in the first epoch (Lin et
al. 2018, sec. 3.3: 75%, 93.75%, 98.4375%, 99.6%, 99.9% over epochs 0-4)."""
DENSITY_WARMUP_EPOCHS = 4.0
"""Length of DGC's warm-up in epochs (the first 4 of its runs of 90 epochs and more)."""
DENSITY_WARMUP_MAX_FRACTION = 0.5
"""The default warm-up lasts at most this fraction of the run's steps (:class:`DensityWarmup`)."""


@dataclass(frozen=True)
class DensityWarmup:
    """A run's density warm-up, derived from its length: ``flashsgd train`` runs every sparse
    exchange with one unless told otherwise (``comm.density_warmup`` = ``start``,
    ``comm.density_warmup_epochs`` = ``epochs`` or ``comm.density_warmup_steps`` = ``fixed_steps``;
    any of them 0: off).

    The default, DGC's warm-up (Lin et al. 2018, sec. 3.3; Shi et al. 2019 also send more in the
    first epoch) scaled to the run::

        start = DENSITY_WARMUP_START                                    # 0.25
        steps = min(round(DENSITY_WARMUP_EPOCHS x steps per epoch),     # DGC's 4 epochs
                    floor(DENSITY_WARMUP_MAX_FRACTION x total steps))   # at most half the run
        density(s) = start x (density / start) ** (s / steps), s < steps  # exponential, then flat

    Derivation: DGC warms up over 4 epochs of runs of 90 epochs and more, a few percent of the run.
    What a warm-up buys a short run is coverage (:func:`coverage`, the step-count bound): an
    exponential decay from s0 to d over W steps sends on average (s0 - d) / ln(s0 / d) of the
    gradient per step, so it adds W (s0 - d) / ln(s0 / d) sends of every entry: 0.045 W at
    d = 0.001, 0.075 W at d = 0.01. On MNIST-1D (docs/sparse_accuracy.md) gTop-k at 0.001 with the
    warm-up over 4 of 10 epochs (500 of 1250 steps, coverage 22.9) was 0.47 points from dense, and
    12.9 points away without it (coverage 1.2). On a run of fewer than 8 epochs DGC's 4 epochs would
    be more than half of it: the cap keeps at least half of every run at the requested density (the
    traffic the user asked for) and still gives a 1000-step run of 8 epochs 500 warm-up steps
    (coverage 22.7 at 0.001 >= :data:`MIN_COVERAGE`). On long runs the rule is DGC's own. Where even this leaves the
    coverage under :data:`MIN_COVERAGE`, :func:`density_for_coverage` and
    :func:`steps_to_coverage` say what would reach it.

    Example::

        >>> DensityWarmup().options(0.001, total_steps=1000, steps_per_epoch=125)
        {'density_warmup': 0.25, 'density_warmup_steps': 500}
        >>> DensityWarmup().steps(total_steps=120, steps_per_epoch=8)      # 4 epochs < half
        32
        >>> DensityWarmup(start=0).options(0.001, 1000, 125), DensityWarmup(epochs=1).steps(1000, 125)
        ({}, 125)
    """

    start: float = DENSITY_WARMUP_START
    """Density of the first step, in (0, 1]; 0: no warm-up. A start at or below the run's density
    is no warm-up either."""
    epochs: Optional[float] = None
    """Length in epochs (of the first epoch's batch); None: the default rule above; 0: none."""
    fixed_steps: Optional[int] = None
    """Length in steps, whatever the run's (set instead of ``epochs``); None: ``epochs``; 0: none."""

    def __post_init__(self) -> None:
        if self.start != 0:
            check_density(self.start, "density warm-up start (0: off)")
        if self.epochs is not None and (isinstance(self.epochs, bool) or not self.epochs >= 0):
            raise ValueError(f"density warm-up epochs must be >= 0 (0: off) or None (the default "
                             f"rule), got {self.epochs!r}")
        if self.fixed_steps is not None:
            _int_at_least("density warm-up steps", self.fixed_steps, 0, " (0: off)")
            if self.epochs is not None:
                raise ValueError("a density warm-up's length is set in epochs or in steps, not both")

    @property
    def is_default(self) -> bool:
        """Whether the length is the default rule's (not set by the user)."""
        return self.epochs is None and self.fixed_steps is None

    def steps(self, total_steps: int, steps_per_epoch: float) -> int:
        """Warm-up steps of a run of ``total_steps`` with ``steps_per_epoch`` in its first epoch."""
        if self.start == 0 or self.epochs == 0 or self.fixed_steps == 0:
            return 0
        if self.fixed_steps is not None:
            return self.fixed_steps
        if self.epochs is not None:
            return max(1, round(self.epochs * steps_per_epoch))
        return min(round(DENSITY_WARMUP_EPOCHS * steps_per_epoch),
                   math.floor(DENSITY_WARMUP_MAX_FRACTION * total_steps))

    def options(self, density: float, total_steps: int, steps_per_epoch: float) -> dict[str, Any]:
        """The :class:`SparseOptions` fields of this warm-up on a run at ``density``: ``{}`` when
        there is none (off, or a start at or below ``density``)."""
        steps = self.steps(total_steps, steps_per_epoch)
        if steps < 1 or not self.start > density:
            return {}
        return {"density_warmup": self.start, "density_warmup_steps": steps}

    def rule(self) -> str:
        """Where the length comes from, in words (the plan's banner and plan.json)."""
        if self.fixed_steps == 0 and self.start != 0:
            return "off (comm.density_warmup_steps set to 0)"
        if self.start == 0 or self.epochs == 0:
            return "off (comm.density_warmup or comm.density_warmup_epochs set to 0)"
        if self.fixed_steps is not None:
            return f"{self.fixed_steps} step(s), as set (comm.density_warmup_steps)"
        if self.epochs is not None:
            return f"{self.epochs:g} epoch(s), as set (comm.density_warmup_epochs)"
        return (f"min({DENSITY_WARMUP_EPOCHS:g} epochs, {DENSITY_WARMUP_MAX_FRACTION:g} x the run's "
                f"steps), the default: DGC's warm-up scaled to the run (Lin et al. 2018; "
                f"flashsgd.exchanges.DensityWarmup)")


def density_for_coverage(total_steps: int, options_at: Any, target: float = MIN_COVERAGE) -> float | None:
    """Smallest density, rounded up to 2 significant digits, whose options ``options_at(density)``
    (a :class:`SparseOptions`, e.g. with the run's warm-up rule) reach ``target`` coverage over
    ``total_steps``; None when not even density 1 does (fewer than ``target`` sparse steps).
    Coverage grows with the density (every step's density does), so a bisection finds it."""
    if coverage(total_steps, options_at(1.0)) < target:
        return None
    lo, hi = 1e-9, 1.0  # coverage(lo) < target <= coverage(hi)
    for _ in range(60):
        mid = math.sqrt(lo * hi)
        lo, hi = (lo, mid) if coverage(total_steps, options_at(mid)) >= target else (mid, hi)
    unit = 10.0 ** (math.floor(math.log10(hi)) - 1)
    found = min(1.0, math.ceil(round(hi / unit, 6)) * unit)  # 2 significant digits, up
    while found < 1.0 and coverage(total_steps, options_at(found)) < target:
        found = min(1.0, found + unit)
    return float(f"{found:.2g}") if found < 1.0 else 1.0


def steps_to_coverage(options_at: Any, total_steps: int, target: float = MIN_COVERAGE) -> int:
    """Smallest run length >= ``total_steps`` whose options ``options_at(steps)`` (e.g. with the
    warm-up rule scaled to that length) reach ``target`` coverage. Coverage grows with the run
    (a default warm-up only lengthens with it), and a run of :func:`steps_for_coverage` steps
    reaches it even without a warm-up, so a bisection between the two finds it."""
    if coverage(total_steps, options_at(total_steps)) >= target:
        return total_steps
    lo, hi = total_steps, max(total_steps + 1, steps_for_coverage(options_at(total_steps), target))
    while coverage(hi, options_at(hi)) < target:  # a warm-up never lowers coverage; guard anyway
        hi *= 2
    while hi - lo > 1:  # coverage(lo) < target <= coverage(hi)
        mid = (lo + hi) // 2
        lo, hi = (lo, mid) if coverage(mid, options_at(mid)) >= target else (mid, hi)
    return hi
