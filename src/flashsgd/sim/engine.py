"""One data-parallel training iteration: backward, bucket fusion, overlapped communication.

Algorithm (per iteration, one GPU's view; all GPUs are identical in data parallelism):

1. The single-GPU step time is ``T1 = batch / images_per_s``; the optimizer update takes
   ``update_fraction`` of it, once per step. The rest is ``grad_accum`` = N micro-batches of
   ``batch / N`` samples (``flashsgd train --grad-accum``), each forward (``forward_fraction`` of
   T1 / N) then backward; the first N-1 exchange nothing (DDP's ``no_sync``). The last one's
   backward is spread over the gradient tensors by their backward share.
2. Gradients are fused into buckets in backward order: DDP-style by size (close a bucket once it
   holds >= ``bucket_mb`` MiB, DDP's ``bucket_cap_mb`` unit) or by fixed tensor counts (Fujitsu-style ``groups``, e.g. 3, 21, 57, 80).
3. A bucket's exchange starts when its last gradient is ready and the previous bucket's exchange
   has finished (one communication stream; ``schedule="overlap"``); with
   ``schedule="after_backward"`` all start when backward ends; with ``schedule="horovod"`` the
   buckets are Horovod's fusion buffers, formed once per cycle from the gradients ready by then and
   capped by the fusion threshold (:func:`fusion_cycles`) (:data:`flashsgd.sim.workload.SCHEDULES`).
   With more than one GPU each bucket's time on the stream is its exchange plus the cluster's
   ``bucket_overhead_s`` (the framework's hook and bookkeeping per bucket): ``d_i = exchange_i + b``.
   While the stream is busy, compute runs at ``1 - s`` of its speed (``overlap_slowdown`` s: the
   collective's kernels take SMs and memory bandwidth from backward), so backward takes
   ``1 / (1 - s)`` times longer for the time an exchange overlaps it (:func:`comm_timeline`); the
   readiness of later buckets and the end of backward move with it.
4. The optimizer update runs after backward and the last exchange. The exchanges still running
   when backward ends (the last buckets in backward order, which become ready last) are the
   step's non-overlappable tail: ``exposed = max(0, end of the last exchange - end of backward)``.
5. Beyond the exchange, with more than one GPU: the step waits for the slowest of P ranks,
   whose compute is ``T1 (1 + cv e(P))`` for a jitter ``cv`` of one rank's compute over steps and GPUs
   (:attr:`~flashsgd.sim.network.ClusterModel.jitter_cv`; :func:`straggler_factor`: e(P) the
   expected maximum of P standard normal draws, :func:`expected_max_normal`), so the whole timeline of steps 1-4 is stretched
   by that factor; and each step pays the cluster's fixed ``step_overhead_s``.
6. The input pipeline, with L > 1 GPUs on a node: its CPUs prepare every image they train on, ``c``
   seconds each (:attr:`~flashsgd.sim.network.ClusterModel.input_s_per_image`), working ahead
   while the GPUs compute and exchange, so a step lasts at least ``batch x L x c``; the remainder
   is the step's ``input_wait_s``. One GPU had the whole host when T1 was measured, so with one
   GPU per node the host's load is T1's and it adds nothing.

With N micro-batches only the last backward can hide the exchange, but one exchange serves N
micro-batches: T1 grows N-fold at the same samples per micro-batch while the exchange stays.

So ``iteration = max(T1' + slowdown + exposed + step_overhead, batch x L x c)`` (P > 1; the
second term only for L > 1),
``slowdown`` the time backward lost to overlapped exchanges.

Outputs: iteration time, compute time (T1), total and exposed communication, the straggler,
slowdown and overhead terms, throughput and scaling efficiency = throughput / (P x single-GPU throughput) =
T1 / iteration (a single GPU communicates nothing, waits for no other rank and pays no overhead).

Example::

    >>> from flashsgd.sim.network import CLUSTERS
    >>> from flashsgd.sim.workload import resnet50
    >>> cfg = SimConfig(algorithm="ring", gpus=256, images_per_s=1200, precision="fp16")
    >>> r = simulate(resnet50(), CLUSTERS.get("abci"), cfg)
    >>> r.iteration_s >= r.compute_s
    True
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, replace
from functools import lru_cache
from statistics import NormalDist
from typing import Literal

import numpy as np

from flashsgd.exchanges import DEFAULT_DENSITY, WIRE_INDEX_BYTES, option_default, reads
from flashsgd.sim.algorithms import exchange_cost
from flashsgd.sim.costs import CommSetup, Cost
from flashsgd.sim.inputs import check_option
from flashsgd.sim.network import ClusterModel
from flashsgd.sim.workload import SCHEDULES, Workload

BYTES = {"fp16": 2, "fp32": 4}


EXCHANGE_OPTIONS = ("density", "node_split", "matrix_approximation_rank")
"""The :class:`SimConfig` fields that are options of the exchange catalog (:mod:`flashsgd.exchanges`)."""


@dataclass(frozen=True)
class SimConfig:
    """What to simulate: algorithm, scale, per-GPU work and fusion policy."""

    algorithm: str
    """A name from flashsgd.sim.algorithms.SIMULATED (native, ring, hierarchical, torus2d, topk, ...)."""
    gpus: int
    """Number of GPUs (ranks)."""
    images_per_s: float
    """Single-GPU training throughput at ``batch_per_gpu`` (forward + backward + update)."""
    batch_per_gpu: int = 32
    """Samples per GPU per iteration (optimizer step): with ``grad_accum`` N, N micro-batches of
    ``batch_per_gpu / N`` (``images_per_s`` is then the throughput at that micro-batch)."""
    grad_accum: int = 1
    """Micro-batches per exchange: the trainer's ``--grad-accum`` (``optim.grad_accum``); the first
    N-1 run forward and backward without exchanging."""
    precision: Literal["fp16", "fp32"] = "fp32"
    """Gradient element type on the wire."""
    bucket_mb: float = 25.0
    """DDP-style bucket cap in MiB (2**20 bytes: DDP's ``bucket_cap_mb``); ignored when ``groups``
    is set."""
    groups: tuple[int, ...] | None = None
    """Fixed fusion groups: numbers of tensors per group in backward order (must sum to all)."""
    schedule: str = "overlap"
    """When the exchanges run (:data:`flashsgd.sim.workload.SCHEDULES`): ``overlap`` (each bucket
    during backward as soon as it is ready) or ``after_backward`` (all after it);
    :func:`flashsgd.sim.workload.trainer_schedule` gives the one ``flashsgd train`` runs."""
    grid: tuple[int, int] | None = None
    """torus2d grid X x Y (None: near-square, X a multiple of the node size)."""
    density: float = DEFAULT_DENSITY
    """topk / gtopk / hgtopk: fraction of elements sent (the catalog's default)."""
    index_bytes: int = WIRE_INDEX_BYTES
    """topk / gtopk / hgtopk: bytes per sparse index, 4 (int32: the papers, and ``comm/sparse/__init__.py``
    for buckets under 2**31 elements) or 8 (int64, ``comm/sparse/__init__.py`` for larger buckets)."""
    node_split: str = option_default("node_split")
    """hgtopk: how a node combines its ranks (:data:`flashsgd.exchanges.NODE_SPLITS`)."""
    matrix_approximation_rank: int = 1
    """powersgd: rank of the approximation (torch's ``matrix_approximation_rank``)."""
    fusion_mb: float = 64.0
    """``schedule="horovod"``: the fusion buffer's ceiling in MiB (Horovod's default
    HOROVOD_FUSION_THRESHOLD = 67108864 bytes = 64 MiB, docs/tensor-fusion.rst)."""
    cycle_ms: float = 1.0
    """``schedule="horovod"``: the background cycle in ms (HOROVOD_CYCLE_TIME: default 1 ms since
    v0.21.0, 5 ms before it)."""
    forward_fraction: float = 1 / 3
    """Share of T1 spent in forward (backward ~ 2x forward)."""
    update_fraction: float = 0.0
    """Share of T1 spent in the optimizer update (after the last exchange)."""

    def __post_init__(self) -> None:
        if not self.images_per_s > 0:
            raise ValueError(f"images_per_s must be > 0, got {self.images_per_s!r}")
        if not (isinstance(self.batch_per_gpu, int) and self.batch_per_gpu >= 1):
            raise ValueError(f"batch_per_gpu must be an int >= 1, got {self.batch_per_gpu!r}")
        if self.precision not in BYTES:
            raise ValueError(f"precision must be one of {sorted(BYTES)}, got {self.precision!r}")
        if not self.bucket_mb > 0:
            raise ValueError(f"bucket_mb must be > 0, got {self.bucket_mb!r}")
        fractions = (self.forward_fraction, self.update_fraction)
        if min(fractions) < 0 or sum(fractions) >= 1:
            raise ValueError(
                f"forward_fraction and update_fraction must be >= 0 with sum < 1, got {fractions}"
            )
        if not (self.fusion_mb > 0 and self.cycle_ms > 0):
            raise ValueError(f"fusion_mb (MiB) and cycle_ms (ms) must be > 0, got {self.fusion_mb!r}, "
                             f"{self.cycle_ms!r}")
        if self.groups is not None and (not self.groups or min(self.groups) < 1):
            raise ValueError(f"groups must be positive tensor counts, got {self.groups!r}")
        if self.schedule not in SCHEDULES:
            raise ValueError(f"schedule must be one of {', '.join(SCHEDULES)}, got {self.schedule!r}")
        if not (isinstance(self.grad_accum, int) and not isinstance(self.grad_accum, bool)
                and 1 <= self.grad_accum <= self.batch_per_gpu):
            raise ValueError(f"grad_accum must be an int in [1, batch_per_gpu={self.batch_per_gpu}] "
                             f"(every micro-batch needs >= 1 sample), got {self.grad_accum!r}")
        for name in EXCHANGE_OPTIONS:  # the catalog's rules, as flashsgd train's [comm] keys
            check_option(name, getattr(self, name))


@dataclass(frozen=True)
class SimResult:
    """Breakdown of one simulated iteration (seconds unless named otherwise)."""

    algorithm: str
    gpus: int
    iteration_s: float
    compute_s: float
    comm_s: float
    """Sum of all bucket exchange times (overlapped or not)."""
    exposed_comm_s: float
    """Communication not hidden behind backward: iteration = compute + straggler + slowdown + exposed
    + overhead + input wait."""
    images_per_s: float
    efficiency: float
    """throughput / (gpus x single-GPU throughput)."""
    buckets: int
    bucket_bytes_max: float
    latency_s: float
    bandwidth_s: float
    comm_compute_s: float
    overhead_s: float
    grid: tuple[int, int] | None = None
    """torus2d: the grid X x Y it ran on (given, or :func:`flashsgd.sim.costs.auto_grid`'s); None
    for the other algorithms."""
    schedule: str = "overlap"
    """When the exchanges ran (``SimConfig.schedule``)."""
    grad_accum: int = 1
    """Micro-batches per exchange (``SimConfig.grad_accum``)."""
    straggler_s: float = 0.0
    """Time the step waited for its slowest rank (Step 5: T1 cv e(P), and the exchange's timeline
    stretched with it)."""
    step_overhead_s: float = 0.0
    """The cluster's fixed per-step cost of a multi-GPU step (Step 5)."""
    slowdown_s: float = 0.0
    """Time backward lost to the exchanges that overlapped it (Step 3: ``overlap_slowdown``)."""
    input_wait_s: float = 0.0
    """Time the step waited for its node's input pipeline beyond everything else (Step 6)."""

    def to_dict(self) -> dict:
        return asdict(self)


_GRID = np.linspace(-10.0, 10.0, 8001)
_PHI = np.array([NormalDist().cdf(x) for x in _GRID])  # the standard normal CDF on that grid


@lru_cache(maxsize=None)
def expected_max_normal(p: int) -> float:
    """E[max of ``p`` independent standard normal draws]: integral of x d(Phi(x)^p), i.e.
    int_0^inf (1 - Phi^p) dx - int_-inf^0 Phi^p dx, by the trapezoid rule on [-10, 10] (the tails
    beyond add < 1e-20 up to p = 10^6): 0 at p = 1, 0.5642 at 2 (1 / sqrt(pi), exact), 2.0697 at
    32, 3.2482 at 1,024, 3.6261 at 4,096 (tables: 3.2414 at 1,000)."""
    cdf = _PHI ** p
    pos, neg = _GRID >= 0, _GRID <= 0
    return float(np.trapezoid(1.0 - cdf[pos], _GRID[pos]) - np.trapezoid(cdf[neg], _GRID[neg]))


def straggler_factor(gpus: int, jitter_cv: float) -> float:
    """``1 + cv e(P)``: the expected compute of the slowest of ``gpus`` ranks in units of one rank's
    mean, for independent, normally distributed step times with coefficient of variation
    ``jitter_cv`` (e(P) = :func:`expected_max_normal`). The maximum keeps growing with P (as
    sqrt(2 ln P)), which is why a synchronous step degrades with scale however well its exchange
    overlaps (Chen et al. 2016, "Revisiting Distributed Synchronous SGD", arXiv 1604.00981)."""
    if gpus <= 1 or jitter_cv == 0:
        return 1.0
    return 1.0 + jitter_cv * expected_max_normal(gpus)


def comm_timeline(ready: list[float], durations: list[float], done: float,
                  slowdown: float = 0.0) -> tuple[float, float]:
    """(end of the last exchange, end of backward) for buckets ready after ``ready[i]`` seconds of
    compute, each ``durations[i]`` long on one stream in order, and ``done`` seconds of compute up to
    the end of backward, when compute runs at ``1 - slowdown`` of its speed while the stream is busy.

    A bucket starts at ``max(when its compute is reached, end of the previous bucket)``. The stream
    is busy without a gap from the moment the last bucket became ready to the end of the stream, so
    the wall time ``W(r)`` at which compute reaches ``r`` seconds of its work, from ``(w, c)`` (wall
    time, compute done) and the stream busy until ``e``: ``w + (r - c) / (1 - s)`` while
    ``c + (e - w)(1 - s) >= r``, else ``e + r - c - (e - w)(1 - s)``. With ``slowdown`` 0 this is the
    plain ``end = max(ready_i, end) + d_i`` and backward ends at ``done``. Example: two buckets of
    1 s ready after 1 and 2 s of a 3 s compute, s = 0.5: the first runs 1-2 (compute reaches 1.5 by
    2), compute reaches 2 at 2.5 and the second runs 2.5-3.5 (compute reaches 2.5), then 3 at 4:
    ``(3.5, 4.0)`` (with s = 0: ``(3.0, 3.0)``)."""
    if slowdown == 0:
        end = 0.0
        for r, d in zip(ready, durations):
            end = max(r, end) + d
        return end, done
    rate = 1.0 - slowdown
    wall = work = end = 0.0

    def reach(target: float) -> float:
        nonlocal wall, work
        if end > wall:  # the stream is busy from `wall` to `end`: compute at `rate`
            slow = (end - wall) * rate
            if work + slow >= target:
                wall += (target - work) / rate
                work = target
                return wall
            work, wall = work + slow, end
        wall, work = wall + target - work, target
        return wall

    for r, d in zip(ready, durations):
        end = max(reach(r), end) + d
    return end, reach(done)


def bucket_bounds(numels: np.ndarray, elem_bytes: int, bucket_mb: float,
                  groups: tuple[int, ...] | None) -> np.ndarray:
    """Index one past each bucket's last tensor (backward order), e.g. [3, 24, 81, 161]."""
    t = numels.size
    if groups is not None:
        if sum(groups) != t:
            raise ValueError(f"groups {groups} sum to {sum(groups)}, need {t} (the workload's tensors)")
        return np.cumsum(groups)
    cap = bucket_mb * 2 ** 20  # MiB, as DDP's bucket_cap_mb
    ends, size = [], 0.0
    for i, n in enumerate(numels):
        size += float(n) * elem_bytes
        if size >= cap:  # DDP closes a bucket once it reaches the cap
            ends.append(i + 1)
            size = 0.0
    if not ends or ends[-1] != t:
        ends.append(t)
    return np.asarray(ends)


def fusion_cycles(ready: np.ndarray, numels: np.ndarray, elem_bytes: int, fusion_mb: float,
                  cycle_s: float) -> tuple[np.ndarray, np.ndarray]:
    """Horovod's buckets: (index one past each buffer's last tensor, when each buffer is handed to
    the stream), for gradients ready at ``ready`` (seconds from the step's start, backward order).

    Step 1: the background thread wakes every ``cycle_s`` (ticks at k x cycle from the step's start
    [assumption: the phase of the cycle; it is arbitrary]) and takes every gradient that became ready
    since the last tick: a gradient ready at r goes at tick ceil(r / cycle). Step 2: a tick's
    gradients, in order, fill buffers of at most ``fusion_mb`` MiB (a gradient larger than that goes
    alone): the threshold caps a buffer, nothing waits to fill it (unlike DDP's ``bucket_cap_mb``).
    Ready times are compute time; the stream's slowdown of backward (Step 3 of the module) is not
    fed back into the ticks. Example: 4 tensors of 1 MiB ready at 0.2, 0.4, 1.1, 1.2 ms, cycle 1 ms,
    threshold 64 MiB: buffers [0, 2) at 1 ms and [2, 4) at 2 ms."""
    cap = fusion_mb * 2 ** 20
    ticks = np.ceil(ready / cycle_s - 1e-9)  # the tick each gradient is taken at
    ends, when = [], []
    size = 0.0
    for i, n in enumerate(numels):
        b = float(n) * elem_bytes
        new_tick = i > 0 and ticks[i] != ticks[i - 1]
        if i > 0 and (new_tick or size + b > cap):  # close the buffer: next tick, or it would pass the cap
            ends.append(i)
            when.append(ticks[i - 1] * cycle_s)
            size = 0.0
        size += b
    ends.append(numels.size)
    when.append(ticks[-1] * cycle_s)
    return np.asarray(ends), np.asarray(when)


def _bucket_costs(algorithm: str, nbytes: np.ndarray, setup: CommSetup, workload: Workload,
                  ends: np.ndarray) -> Cost:
    """Every bucket's exchange cost; PowerSGD's depends on the bucket's matrices, not only its size."""
    if not reads(algorithm, "matrix_approximation_rank") or workload.matrices is None:
        return exchange_cost(algorithm, nbytes, setup)
    starts = np.concatenate(([0], ends[:-1]))
    parts = [exchange_cost(algorithm, n, replace(setup, matrices=tuple(map(tuple, workload.matrices[a:b].tolist()))))
             for n, a, b in zip(nbytes.tolist(), starts.tolist(), ends.tolist())]
    return Cost(*(np.array([float(getattr(c, f)) for c in parts])
                  for f in ("latency_s", "bandwidth_s", "compute_s", "overhead_s")))


def simulate(workload: Workload, cluster: ClusterModel, cfg: SimConfig) -> SimResult:
    """Simulate one iteration of ``workload`` on ``cfg.gpus`` GPUs of ``cluster``."""
    elem = BYTES[cfg.precision]
    t_one = cfg.batch_per_gpu / cfg.images_per_s  # one GPU's T1: the efficiency's reference
    stretch = straggler_factor(cfg.gpus, cluster.jitter_cv)  # Step 5: the slowest rank's timeline
    setup = CommSetup(gpus=cfg.gpus, cluster=cluster, grid=cfg.grid, density=cfg.density,
                      value_bytes=elem, index_bytes=cfg.index_bytes, node_split=cfg.node_split,
                      matrix_approximation_rank=cfg.matrix_approximation_rank)
    t1 = t_one * stretch
    upd = cfg.update_fraction * t1
    done = t1 - upd  # backward of the last micro-batch ends here
    # Step 1: time at which each gradient tensor of the last micro-batch is ready; the N-1 micro-
    # batches before it exchange nothing.
    fwd = cfg.forward_fraction * t1 / cfg.grad_accum
    bwd = (t1 - upd) / cfg.grad_accum - fwd
    start = done - fwd - bwd  # = (N-1) (fwd + bwd)
    ready = np.minimum(start + fwd + np.cumsum(workload.backward_share) * bwd, done)  # no round-off past the end
    # Step 2: fuse into buckets.
    if cfg.schedule == "horovod":  # Horovod: fused per cycle, up to the threshold
        ends, bucket_ready = fusion_cycles(ready, workload.numels, elem, cfg.fusion_mb, cfg.cycle_ms * 1e-3)
    else:
        ends = bucket_bounds(workload.numels, elem, cfg.bucket_mb, cfg.groups)
        bucket_ready = ready[ends - 1] if cfg.schedule == "overlap" else np.full(ends.size, done)
    csum = np.concatenate(([0], np.cumsum(workload.numels)))
    nbytes = (csum[ends] - csum[np.concatenate(([0], ends[:-1]))]).astype(float) * elem
    cost = _bucket_costs(cfg.algorithm, nbytes, setup, workload, ends)
    multi = cfg.gpus > 1  # one GPU exchanges nothing: no bucket overhead, no slowdown, no step overhead
    per_bucket = cluster.bucket_overhead_s if multi else 0.0
    durations = cost.total + per_bucket  # d_i = exchange_i + bucket overhead
    # Step 3: one communication stream, buckets in order; compute at 1 - s while it is busy.
    end, backward_end = comm_timeline(bucket_ready.tolist(), durations.tolist(), done,
                                      cluster.overlap_slowdown if multi else 0.0)
    # Step 4: update after backward and the last exchange (the tail: what runs past backward's end);
    # Step 5: the fixed per-step overhead.
    slowdown = backward_end - done
    exposed = max(0.0, end - backward_end)
    overhead = cluster.step_overhead_s if multi else 0.0
    busy = t1 + slowdown + exposed + overhead  # = max(end, backward_end) + upd (+ overhead)
    # Step 6: the node's host prepares batch x L images per step, ahead of the GPUs (L = 1: one GPU's
    # load on its host, as when T1 was measured: no bound beyond T1).
    sharing = min(cfg.gpus, cluster.ranks_per_node)
    host = cfg.batch_per_gpu * sharing * cluster.input_s_per_image if sharing > 1 else 0.0
    iteration = max(busy, host)
    return SimResult(
        algorithm=cfg.algorithm, gpus=cfg.gpus, iteration_s=iteration, compute_s=t_one,
        comm_s=float(durations.sum()), exposed_comm_s=exposed,
        images_per_s=cfg.gpus * cfg.batch_per_gpu / iteration, efficiency=t_one / iteration,
        buckets=int(ends.size), bucket_bytes_max=float(nbytes.max()),
        latency_s=float(cost.latency_s.sum()), bandwidth_s=float(cost.bandwidth_s.sum()),
        comm_compute_s=float(cost.compute_s.sum()),
        overhead_s=float(cost.overhead_s.sum()) + per_bucket * int(ends.size),
        grid=setup.torus_grid if reads(cfg.algorithm, "grid") else None, schedule=cfg.schedule,
        grad_accum=cfg.grad_accum, straggler_s=t1 - t_one, step_overhead_s=overhead, slowdown_s=slowdown,
        input_wait_s=iteration - busy,
    )


def node_aligned_grid(cluster: ClusterModel, gpus: int) -> tuple[int, int] | None:
    """The torus grid whose rows are the nodes, X = GPUs per node (Mikami et al. 2018's layout:
    horizontal rings inside a node, vertical rings across nodes); None on one node or with one GPU
    per node (X = 1 would be the flat ring)."""
    per_node = min(gpus, cluster.ranks_per_node)
    if per_node < 2 or gpus <= per_node:
        return None
    return per_node, gpus // per_node


def straddling_alternative(workload: Workload, cluster: ClusterModel, cfg: SimConfig,
                           result: SimResult) -> SimResult | None:
    """The node-aligned torus's prediction when ``result`` ran torus2d on the automatic grid, whose
    rows span several nodes (X > GPUs per node), and the node-aligned grid is faster; else None.

    The automatic grid (:func:`flashsgd.sim.costs.auto_grid`) minimises message steps; rows that
    straddle nodes send their horizontal ring across the NICs, which the node-aligned grid keeps
    inside the node (32 nodes x 6 GPUs: automatic 12x16, node-aligned 6x32).
    """
    aligned = node_aligned_grid(cluster, cfg.gpus)
    if not reads(cfg.algorithm, "grid") or cfg.grid is not None or aligned is None or result.grid is None \
            or result.grid[0] <= aligned[0]:
        return None
    other = simulate(workload, cluster, replace(cfg, grid=aligned))
    return other if other.iteration_s < result.iteration_s else None


def sweep(workload: Workload, cluster: ClusterModel, base: SimConfig, algorithms: list[str],
          gpus: list[int]) -> list[SimResult]:
    """Simulate every (algorithm, gpus) pair; ``base.grid`` is dropped when gpus vary."""
    out = []
    for algo in algorithms:
        for p in gpus:
            grid = base.grid if (base.grid and base.grid[0] * base.grid[1] == p) else None
            out.append(simulate(workload, cluster, replace(base, algorithm=algo, gpus=p, grid=grid)))
    return out
