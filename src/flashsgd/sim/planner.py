"""What to run on a cluster: every way to exchange gradients, ranked by predicted step time.

Used by ``flashsgd plan`` (:mod:`flashsgd.sim.plan_cli`) and ``flashsgd train --comm auto``
(:mod:`flashsgd.train.auto`). Papers: Goyal et al. 2017 (bucketed all-reduce overlapping backward),
Mikami et al. 2018 (2D-Torus grids), Yamazaki et al. 2019 (fusion sizes of a few MB), Shi et al. 2019
(gTop-k on slow networks), Vogels et al. 2019 (PowerSGD). Horovod's autotune answers part of the
question by trial; here the calibrated simulator answers it in closed form.

Algorithm (:func:`make_plan`):

1. Candidates (:func:`candidates`): every dense algorithm (``native``, ``ring``, ``hierarchical``
   when the run spans nodes of >= 2 ranks, ``torus2d`` on every grid X x Y = P whose rows do not
   straddle nodes unevenly), every sparse exchange (``topk``, ``gtopk``, ``hgtopk``) at
   :data:`DENSITIES` (``hgtopk`` with each node split of :data:`flashsgd.exchanges.NODE_SPLITS`),
   PowerSGD at :data:`LOWRANKS`; each with DDP bucket caps of :data:`BUCKETS_MB` (1 to 128 MiB).
   The families, defaults and rules come from the catalog :mod:`flashsgd.exchanges`.
2. Accuracy (:func:`accuracy_rule`, ``accuracy_risk="low"``): a sparse candidate is kept only when
   every gradient entry can be sent at least :data:`MIN_COVERAGE` times over the run even without a
   warm-up (gTop-k's step-count bound, :func:`flashsgd.exchanges.coverage`, for Top-k too), and it runs with
   the trainer's default density warm-up (:data:`DENSITY_WARMUP`, the catalog's
   :class:`~flashsgd.exchanges.DensityWarmup`: DGC's, scaled to the run): what was measured on
   MNIST-1D (coverage 23-37 with it, 4 of 10 epochs, lost 0.4-0.5 points; 1.2 without lost 12-13;
   docs/sparse_accuracy.md). PowerSGD only at
   rank >= 2 and >= 1250 steps (rank 2 lost 0.27 points over 1250 steps, 1.02 over 120). Without
   ``steps`` neither is offered. ``accuracy_risk="any"`` keeps everything, without a warm-up. What
   is ruled out is said, one line per algorithm and density or rank.
3. Predict every candidate with :func:`flashsgd.sim.engine.simulate` (buckets fused in backward
   order, on one stream, each exchange scheduled as ``flashsgd train`` runs it: the dense hooks
   and PowerSGD overlapping backward, the sparse hooks after it; ``grad_accum`` micro-batches per
   exchange) and rank by step time; ties keep the order
   of step 1 (``native`` first: the simplest choice wins a tie).
4. The choice (:attr:`CommPlan.choice`): the fastest, except that a compressing exchange must beat the
   best dense one by :data:`COMPRESSION_MARGIN`, and of bucket caps predicting within
   :data:`BUCKET_TIE` the largest; and the plain choice (DDP's own all-reduce at its default
   25 MiB buckets, always a candidate) is kept unless that fastest beats it by more than the
   model's error between exchanges (:data:`PLAIN_NOISE`, 15%). Explained in one line
   (:meth:`CommPlan.explain`): its speed-up over the best dense choice and why (how much of that
   step the exchange leaves exposed), and why it is safe; or which faster candidate was within the
   noise.

Cost: (#dense algorithms + #grids + #densities x (2 + #node splits) + #ranks) x #bucket caps simulations, each
O(tensors + buckets x lg P): 4096 GPUs in well under a second.

Example::

    >>> from flashsgd.sim.network import CLUSTERS
    >>> from flashsgd.sim.workload import resnet50
    >>> p = make_plan(resnet50(), CLUSTERS.get("1gbe"), gpus=32, batch_per_gpu=32,
    ...               images_per_s=200.0, steps=50_000)
    >>> p.choice.candidate.compresses   # 1 GbE: a compressing exchange, its compute charged on the GPU class
    True
"""

from __future__ import annotations

from dataclasses import dataclass, field, replace
from functools import lru_cache
from typing import Literal

from flashsgd.exchanges import (BUCKET_MB, DEFAULT_DENSITY, DENSE_ITERATIONS, EXCHANGES, MIN_COVERAGE, NODE_SPLITS,
                                WIRE_INDEX_BYTES, DensityWarmup, SparseOptions, coverage, names, reads)
from flashsgd.fmt import plural
from flashsgd.sim.engine import SimConfig, SimResult, simulate
from flashsgd.sim.network import ClusterModel
from flashsgd.sim.workload import SCHEDULES, Workload, trainer_schedule

DENSE = tuple(names("dense"))
SPARSE = tuple(names("sparse"))
LOWRANK = tuple(names("lowrank"))
BUCKETS_MB = (1.0, 2.0, 4.0, 8.0, 16.0, 32.0, 64.0, 128.0)
"""DDP bucket caps tried, MiB (DDP's ``bucket_cap_mb`` unit)."""
DENSITIES = (DEFAULT_DENSITY, 0.01, 0.1)
LOWRANKS = (1, 2, 4)
SPARSE_START_ITER = DENSE_ITERATIONS
"""The sparse hooks exchange densely for their first steps (the catalog's ``start_iter``)."""
DENSITY_WARMUP = DensityWarmup()
"""The warm-up a sparse choice runs with at low accuracy risk: the catalog's default rule, the one
``flashsgd train`` applies (DGC's start decaying exponentially over min(4 epochs, half the run);
the measured runs: 4 of 10 epochs)."""
POWERSGD_MIN_STEPS = 1250
POWERSGD_MIN_RANK = 2
BUCKET_TIE = 1.01
"""Bucket caps predicting within 1% of the best one count as a tie, won by the largest cap: per-call
costs the model does not see (Python-level hooks, CPU sharing) favour fewer buckets."""
COMPRESSION_MARGIN = 1.05
"""A compressing exchange is chosen only when it predicts a step this much faster than the best
dense one: within the model's error a dense exchange, which changes nothing in the training, wins."""
PLAIN_NOISE = 0.15
"""The model's error on the difference between two exchanges, relative: the plain choice
(:data:`PLAIN`) is kept unless another predicts a step more than this much shorter. Measured on the
emulated cluster (docs/simulator.md, "What these show"): the model gave torus2d and hierarchical a
14% shorter exchange than the ring (1.5 n against 1.75 n bytes per node), and the measured times
were within 3-11% of one another (error -14 to -15%, one-signed)."""
PLAIN_ALGORITHM = "native"
"""The plain choice is DDP's own all-reduce (NCCL's on GPUs) at DDP's default bucket cap
(:data:`flashsgd.exchanges.BUCKET_MB`): what a run without flashsgd's hooks does."""
Risk = Literal["low", "any"]


@dataclass(frozen=True)
class Candidate:
    """One way to run the exchange: algorithm, DDP bucket cap and the algorithm's own setting."""

    algorithm: str
    bucket_mb: float
    """DDP bucket cap, MiB."""
    grid: tuple[int, int] | None = None
    """torus2d: X x Y."""
    density: float | None = None
    """topk / gtopk / hgtopk: fraction of the gradient sent."""
    node_split: str | None = None
    """hgtopk: how a node combines its ranks (:data:`flashsgd.exchanges.NODE_SPLITS`)."""
    matrix_approximation_rank: int | None = None
    """powersgd: rank of the approximation."""

    def setting(self) -> str:
        """``hgtopk density 0.01 node_split=slices``: the algorithm and its setting, no bucket cap."""
        what = self.algorithm
        if self.grid:
            what += f" {self.grid[0]}x{self.grid[1]}"
        if self.density is not None:
            what += f" density {self.density:g}"
        if self.node_split is not None:
            what += f" node_split={self.node_split}"
        if self.matrix_approximation_rank is not None:
            what += f" rank {self.matrix_approximation_rank}"
        return what

    def label(self) -> str:
        """``gtopk density 0.01, 4 MiB buckets``."""
        return f"{self.setting()}, {self.bucket_mb:g} MiB buckets"

    @property
    def compresses(self) -> bool:
        return EXCHANGES.get(self.algorithm).compresses


@dataclass(frozen=True)
class Prediction:
    """A candidate and its simulated step."""

    candidate: Candidate
    result: SimResult

    @property
    def step_s(self) -> float:
        return self.result.iteration_s

    @property
    def compression_s(self) -> float:
        """Selection, merges and matrix products of a compressing exchange (0 for dense)."""
        return self.result.comm_compute_s if self.candidate.compresses else 0.0

    def to_dict(self) -> dict:
        c, r = self.candidate, self.result
        return {"algorithm": c.algorithm, "bucket_mb": c.bucket_mb, "grid": list(c.grid) if c.grid else None,
                "density": c.density, "node_split": c.node_split,
                "matrix_approximation_rank": c.matrix_approximation_rank, "label": c.label(), "step_s": r.iteration_s,
                "compute_s": r.compute_s, "exposed_comm_s": r.exposed_comm_s,
                "compression_s": self.compression_s, "efficiency": r.efficiency,
                "images_per_s": r.images_per_s}


@dataclass(frozen=True)
class CommPlan:
    """Ranked predictions (fastest first) and what the accuracy rule ruled out."""

    cluster: ClusterModel
    workload: Workload
    gpus: int
    steps: int | None
    accuracy_risk: Risk
    ranked: list[Prediction]
    ruled_out: list[str] = field(default_factory=list)

    @property
    def best(self) -> Prediction:
        """The fastest predicted candidate."""
        return self.ranked[0]

    @property
    def plain(self) -> Prediction | None:
        """The plain choice's prediction (:data:`PLAIN_ALGORITHM` at DDP's default bucket cap);
        None when it was not a candidate."""
        return next((p for p in self.ranked if p.candidate == Candidate(PLAIN_ALGORITHM, BUCKET_MB)), None)

    @property
    def fastest(self) -> Prediction:
        """The best, unless it compresses and the best dense one is within the margin; of its
        bucket caps, the largest within :data:`BUCKET_TIE` of its best."""
        dense, pick = self.best_dense(), self.best
        if pick.candidate.compresses and dense is not None \
                and dense.step_s <= pick.step_s * COMPRESSION_MARGIN:
            pick = dense
        same = replace(pick.candidate, bucket_mb=0.0)
        ties = [p for p in self.ranked if replace(p.candidate, bucket_mb=0.0) == same
                and p.step_s <= pick.step_s * BUCKET_TIE]
        return max(ties, key=lambda p: p.candidate.bucket_mb)

    @property
    def within_noise(self) -> Prediction | None:
        """:attr:`fastest` when the plain choice is kept over it: it predicts a step shorter, but by
        no more than :data:`PLAIN_NOISE`."""
        fast, chosen = self.fastest, self.choice
        return fast if chosen is not fast and fast.step_s < chosen.step_s else None

    @property
    def choice(self) -> Prediction:
        """Step 4: :attr:`fastest`, unless the plain choice is within :data:`PLAIN_NOISE` of it (or
        faster): then the plain choice."""
        fast, plain = self.fastest, self.plain
        return plain if plain is not None and fast.step_s * (1 + PLAIN_NOISE) > plain.step_s else fast

    def best_dense(self) -> Prediction | None:
        return next((p for p in self.ranked if p.candidate.algorithm in DENSE), None)

    def explain(self) -> str:
        """Step 4: one line on why the chosen candidate wins."""
        best, dense = self.choice, self.best_dense()
        c = best.candidate
        near = self.within_noise
        if near is not None:
            gain = best.step_s / near.step_s - 1
            return (f"{c.label()} (DDP's own all-reduce, its default buckets): {best.step_s * 1e3:.1f} ms "
                    f"predicted step at {best.result.efficiency:.0%} scaling efficiency; "
                    f"{near.candidate.label()} is within the noise (predicted {gain:.1%} faster; the "
                    f"model's error between exchanges is up to {PLAIN_NOISE:.0%}, docs/simulator.md), "
                    f"so the plain choice is kept")
        if not c.compresses or dense is None:
            nxt = next((p for p in self.ranked if p.candidate.compresses), None)
            other = (f"; the best compressed choice ({nxt.candidate.label()}) predicts "
                     f"{nxt.step_s * 1e3:.1f} ms" if nxt else
                     "; compressed exchanges ruled out for accuracy" if self.ruled_out else "")
            if nxt is not None and nxt.step_s < best.step_s:
                other += f", less than {COMPRESSION_MARGIN - 1:.0%} faster: not worth its accuracy risk"
            elif nxt is not None and dense is not None and nxt.compression_s > compression_saving(nxt, dense):
                other += (f": its compression ({nxt.compression_s * 1e3:.1f} ms per step on "
                          f"{self.cluster.device or 'this cluster'}) costs more than the exchange time it "
                          f"saves ({max(compression_saving(nxt, dense), 0.0) * 1e3:.1f} ms)")
            return (f"{c.label()}: {best.step_s * 1e3:.1f} ms predicted step at "
                    f"{best.result.efficiency:.0%} scaling efficiency, exposed communication "
                    f"{best.result.exposed_comm_s * 1e3:.1f} ms{other}")
        share = dense.result.exposed_comm_s / dense.step_s
        safe = (f"safe for accuracy: {coverage_note(c, self.steps)}"
                if self.accuracy_risk == "low" else "accuracy not checked (--accuracy-risk any)")
        return (f"{c.label()}: {dense.step_s / best.step_s:.2f}x faster than the best dense choice "
                f"({dense.candidate.label()}, {dense.step_s * 1e3:.1f} ms), whose exposed "
                f"communication is {share:.0%} of its step; {safe}")

    @property
    def density_warmup(self) -> DensityWarmup | None:
        """The density warm-up the sparse choice runs with (low risk only)."""
        if self.accuracy_risk == "low" and self.choice.candidate.algorithm in SPARSE:
            return DENSITY_WARMUP
        return None

    def to_dict(self, top: int | None = None) -> dict:
        warm = self.density_warmup
        # the start; the length is the rule's for the run it is applied to (comm.density_warmup_epochs unset)
        choice = {**self.choice.to_dict(), **({"density_warmup": warm.start} if warm else {})}
        return {"cluster": self.cluster.describe(), "gpus": self.gpus, "workload": self.workload.name,
                "steps": self.steps, "accuracy_risk": self.accuracy_risk,
                "choice": choice, "explain": self.explain(),
                "ruled_out": self.ruled_out, "ranked": [p.to_dict() for p in self.ranked[:top]]}


def compression_saving(p: Prediction, dense: Prediction) -> float:
    """What compressing saves of a step beside ``dense``, before paying for it: the dense step less
    ``p``'s step without its compression (``p.compression_s``: selection, merges, matrix products on
    the cluster's device, :mod:`flashsgd.sim.device_costs`). ``p`` beats ``dense`` only where its
    compression costs less than this, so the planner never picks a compressing exchange whose compute
    exceeds the exchange time it saves (it must moreover win by :data:`COMPRESSION_MARGIN`)."""
    return dense.step_s - (p.step_s - p.compression_s)


def grids(gpus: int, ranks_per_node: int) -> list[tuple[int, int]]:
    """Every torus grid X x Y = gpus with X, Y >= 2 and X dividing or a multiple of the node size."""
    local = min(gpus, ranks_per_node)
    out = []
    for x in range(2, gpus // 2 + 1):
        if gpus % x == 0 and (gpus <= local or x % local == 0 or local % x == 0):
            out.append((x, gpus // x))
    return out


@lru_cache(maxsize=None)
def coverage_without_warmup(steps: int, density: float) -> float:
    """:func:`flashsgd.exchanges.coverage` of a run of ``steps`` at ``density`` without a warm-up
    (the catalog's ``start_iter``): the bound the planner counts on (cached: one per density)."""
    return coverage(steps, SparseOptions(density=density))


def warmup_note() -> str:
    return (f"with the trainer's density warm-up ({DENSITY_WARMUP.start:g} -> the density over "
            f"{DENSITY_WARMUP.rule().split(', the default')[0]}), as measured")


def coverage_note(c: Candidate, steps: int | None) -> str:
    if c.algorithm in LOWRANK:
        return (f"rank {c.matrix_approximation_rank} >= {POWERSGD_MIN_RANK} over {steps} >= "
                f"{POWERSGD_MIN_STEPS} steps")
    cover = plural(coverage_without_warmup(steps, c.density), "time", than=MIN_COVERAGE)
    return (f"each entry can be sent {cover} over {plural(steps, 'step')} even "
            f"without a warm-up (>= {MIN_COVERAGE:g}), run {warmup_note()}")


def accuracy_rule(c: Candidate, steps: int | None, risk: Risk) -> str | None:
    """Step 2: None when ``c`` keeps accuracy (or the risk is accepted), else the reason."""
    if risk == "any" or not c.compresses:
        return None
    if steps is None:
        return "the run length is unknown (give --steps)"
    if c.algorithm in LOWRANK:
        if c.matrix_approximation_rank < POWERSGD_MIN_RANK or steps < POWERSGD_MIN_STEPS:
            return (f"kept accuracy only at rank >= {POWERSGD_MIN_RANK} over >= {POWERSGD_MIN_STEPS} "
                    "steps (measured; rank 2 over 120 steps lost 1 point)")
        return None
    cover = coverage_without_warmup(steps, c.density)
    if cover < MIN_COVERAGE:
        return (f"each entry could be sent only {plural(cover, 'time', than=MIN_COVERAGE)} over "
                f"{plural(steps, 'step')} (< {MIN_COVERAGE:g}: step-count bound)")
    return None


def candidates(gpus: int, cluster: ClusterModel, buckets_mb=BUCKETS_MB,
               algorithms: tuple[str, ...] = DENSE + SPARSE + LOWRANK) -> list[Candidate]:
    """Step 1, in tie-breaking order (simplest first)."""
    local = min(gpus, cluster.ranks_per_node)
    two_level = local > 1 and gpus > local
    out = []
    for algo in algorithms:
        if EXCHANGES[algo].one_level and not two_level:
            continue  # one level: the same as its flat form (ring, gtopk)
        if reads(algo, "grid"):
            settings = [{"grid": g} for g in grids(gpus, cluster.ranks_per_node)]
        elif reads(algo, "node_split"):
            settings = [{"density": d, "node_split": s} for d in DENSITIES for s in NODE_SPLITS]
        elif reads(algo, "density"):
            settings = [{"density": d} for d in DENSITIES]
        elif reads(algo, "matrix_approximation_rank"):
            settings = [{"matrix_approximation_rank": r} for r in LOWRANKS]
        else:
            settings = [{}]
        caps = sorted({*buckets_mb, BUCKET_MB}) if algo == PLAIN_ALGORITHM else buckets_mb  # + the plain choice
        out += [Candidate(algo, float(b), **s) for s in settings for b in caps]
    return out


def _ruled_out_lines(rejected: dict[str, str]) -> list[str]:
    """One line per algorithm and density or rank ruled out, with its reason (every bucket cap and
    node split)."""
    return [f"{setting}: {why}" for setting, why in rejected.items()]


def make_plan(workload: Workload, cluster: ClusterModel, gpus: int, batch_per_gpu: int,
              images_per_s: float, steps: int | None = None, accuracy_risk: Risk = "low",
              precision: str = "fp32", index_bytes: int = WIRE_INDEX_BYTES, buckets_mb=BUCKETS_MB,
              algorithms: tuple[str, ...] = DENSE + SPARSE + LOWRANK, grad_accum: int = 1,
              schedule: str = "trainer", fusion_mb: float = 64.0, cycle_ms: float = 1.0) -> CommPlan:
    """Steps 1-3 for ``gpus`` ranks of ``cluster`` training ``workload`` (see the module docstring).

    ``index_bytes``: bytes per sparse index on the wire (default: what ``comm/sparse/__init__.py`` sends).
    ``grad_accum``: micro-batches per exchange (``flashsgd train --grad-accum``). ``schedule``:
    ``trainer`` (default) simulates every candidate as ``flashsgd train`` runs it
    (:func:`flashsgd.sim.workload.trainer_schedule`: the sparse hooks exchange after backward),
    or one of :data:`flashsgd.sim.workload.SCHEDULES` for all (``horovod``: with ``fusion_mb`` and
    ``cycle_ms``, :func:`flashsgd.sim.engine.fusion_cycles`; the candidates' bucket caps then do not apply).
    """
    if schedule != "trainer" and schedule not in SCHEDULES:
        raise ValueError(f"schedule must be 'trainer' or one of {', '.join(SCHEDULES)}, got {schedule!r}")
    if accuracy_risk not in ("low", "any"):
        raise ValueError(f"accuracy_risk must be 'low' or 'any', got {accuracy_risk!r}")
    if steps is not None and (not isinstance(steps, int) or steps < 1):
        raise ValueError(f"steps must be an integer >= 1, got {steps!r}")
    cluster.check_gpus(gpus)
    base = SimConfig(algorithm="native", gpus=gpus, images_per_s=images_per_s,
                     batch_per_gpu=batch_per_gpu, precision=precision, index_bytes=index_bytes,
                     grad_accum=grad_accum, fusion_mb=fusion_mb, cycle_ms=cycle_ms)
    kept, rejected = [], {}
    for c in candidates(gpus, cluster, buckets_mb, algorithms):              # Step 1
        why = accuracy_rule(c, steps, accuracy_risk)                          # Step 2
        if why is not None:
            rejected[replace(c, node_split=None).setting()] = why
            continue
        cfg = replace(base, algorithm=c.algorithm, bucket_mb=c.bucket_mb, grid=c.grid,
                      schedule=trainer_schedule(c.algorithm) if schedule == "trainer" else schedule,
                      density=c.density or base.density, node_split=c.node_split or base.node_split,
                      matrix_approximation_rank=c.matrix_approximation_rank or 1)
        kept.append(Prediction(c, simulate(workload, cluster, cfg)))          # Step 3
    if not kept:
        raise ValueError("no candidate left: every algorithm was ruled out ("
                         + "; ".join(_ruled_out_lines(rejected)) + ")")
    ranked = sorted(kept, key=lambda p: p.step_s)  # stable: ties keep the simplest first
    return CommPlan(cluster, workload, gpus, steps, accuracy_risk, ranked, _ruled_out_lines(rejected))


SPARSE_PAIR = ("oktopk", "gtopk")
"""The O(k) and the O(k lg P) sparse all-reduces (Li & Hoefler 2022; Shi et al. 2019), whose order
depends on P, k and the link: :func:`sparse_crossover` says where."""
CROSSOVER_GPUS = tuple(2 ** i for i in range(1, 13))
"""GPU counts :func:`sparse_crossover` tries (2 to 4096)."""


def sparse_crossover(plan: CommPlan) -> str | None:
    """When the choice compresses and both exchanges of :data:`SPARSE_PAIR` were ranked: their steps
    here and the smallest GPU count of :data:`CROSSOVER_GPUS` (whole nodes) from which the first's
    exchange of one bucket (the first's best setting: its bucket cap and density) costs less than
    the second's on this cluster (``flashsgd.sim.costs_sparse.oktopk``: 2a + 3k (P-1)/P pairs per rank
    against lg P (a + k pairs)); None otherwise."""
    from flashsgd.sim.algorithms import exchange_cost
    from flashsgd.sim.costs import CommSetup

    best: dict[str, Prediction] = {}
    for p in plan.ranked:
        best.setdefault(p.candidate.algorithm, p)
    first, second = SPARSE_PAIR
    if not plan.choice.candidate.compresses or first not in best or second not in best:
        return None
    a, b = best[first], best[second]
    density, n_bytes = a.candidate.density, a.candidate.bucket_mb * 2 ** 20
    rpn = plan.cluster.ranks_per_node

    def cheaper(gpus: int) -> bool:
        setup = CommSetup(gpus, plan.cluster, density=density)
        return float(exchange_cost(first, n_bytes, setup).total) < float(exchange_cost(second, n_bytes, setup).total)

    cross = next((g for g in CROSSOVER_GPUS if g >= rpn and g % rpn == 0 and cheaper(g)), None)
    where = (f"costs less from {cross} GPUs" if cross is not None
             else f"costs more at every count up to {CROSSOVER_GPUS[-1]}")
    return (f"{first} vs {second}: {a.step_s * 1e3:.1f} vs {b.step_s * 1e3:.1f} ms at {plan.gpus} GPUs; "
            f"{first}'s exchange of a {a.candidate.bucket_mb:g} MiB bucket at density {density:g} {where} "
            f"on this cluster (2 latencies and 3k(P-1)/P pairs per rank against lg P of each)")
