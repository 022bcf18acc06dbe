"""`flashsgd train --comm auto`: measure this cluster for a few seconds, plan, and run the plan's choice.

The planner (:mod:`flashsgd.sim.planner`) needs a cluster model and a workload; here both come from
the run itself. With ``comm.cluster`` (a preset or a cluster TOML file, such as the ``cluster.toml``
a previous auto run wrote) the network is taken from it; otherwise it is measured on the spot.
The compute is always measured, with its jitter: it is this model on these devices.

Algorithm (:func:`resolve_auto`, every rank, in lockstep; every time but the compute's is the
slowest rank's, with all ranks working at once, so CPU or NIC sharing is in the figures):

1. Compute: forward, backward and optimizer step of the model on one local batch (plain module,
   no exchange), 1 warm-up + 12 timed, each after a barrier with every rank at work, each rank's
   own time (:func:`flashsgd.timing.rank_times`): the compute is their mean, its jitter their
   coefficient of variation (std / mean over ranks and steps), recorded as the cluster's
   ``jitter_cv`` (the simulator adds the slowest of P ranks from it, Step 5 of
   :mod:`flashsgd.sim.engine`); then the same through DDP at the run's bucket size with torch's
   ``noop_hook`` (buckets built, the hook called, nothing sent), and again with one bucket per
   parameter tensor, both on 8 of the batch's samples (DDP's costs do not depend on the batch;
   the noise does; 11 untimed steps first, :data:`DDP_WARMUP`): with the buckets counted in the
   hook, the two DDP means less the plain mean on those samples give DDP's fixed cost per step
   (the cluster's ``step_overhead_s``) and its cost per bucket (``bucket_overhead_s``; assumed
   still where both caps give as many buckets). The model and the optimizer are restored
   afterwards and each probe DDP removes its autograd hooks.
2. Network (without ``comm.cluster``): ring all-reduces of two sizes inside a node (the node
   group) and across nodes (one rank per node, the others idle: the node's whole link), each fitted
   to the ring cost ``t = 2(p-1) alpha + 2(p-1)/p n (beta + gamma/2)`` of
   :func:`flashsgd.sim.costs.ring`; one level only: the other takes the same link. What the probe
   cannot see stays assumed, with the presets' ranges (:func:`measured_cluster_assumptions`): the
   slowdown of compute under overlap, and TCP incast.
3. Devices: ``gamma`` = the time of ``a += b`` per byte of the gradient; top-k selection per
   element (``comm.selection`` at density 0.01, minus the add); PowerSGD's flop rate from one
   rank-2 product of a gradient-sized matrix; the fixed costs of a sparse exchange
   (:func:`sparse_fixed_costs`): per round = one send/receive round of 8 bytes with rank XOR 1
   minus the link's alpha, per exchange = one real gTop-k exchange of the gradient minus what the
   model predicts for it with that per-round cost.
4. Plan (:func:`flashsgd.sim.planner.make_plan`) for this world, workload (the model's parameters
   in backward order, :func:`flashsgd.sim.workload.from_module`), batch and run length; rank 0
   broadcasts the choice, records ``<out>/auto.json`` (measurements, choice, top candidates) and
   ``<out>/cluster.toml`` (the measured cluster, to pass back as ``--cluster``). A ``comm.cluster``
   with assumed inputs (a preset's links and sparse costs, a file's ``*_range`` keys) is planned over
   their ranges (:func:`flashsgd.sim.uncertainty.plan_over_ranges`): auto.json records each
   candidate's step and efficiency range, what was assumed and where the choice would change, and
   the printed choice says whether it holds and what to measure; a measured cluster has no range.
5. A resumed run reuses the recorded choice (its checkpoints hold that hook's state).

Cost: 13 training steps of one local batch and 59 of 8 samples (13 plain, 23 + 23 through DDP, each
with its untimed warm-up), ~10 collectives and a few local passes over the gradient: seconds, once
per run (18-35 s for ResNet-20 on 8 Gloo ranks sharing 2 cores, docs/planner.md).
"""

from __future__ import annotations

import copy
import json
import os
import time
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any, Callable

import torch
import torch.distributed as dist

from flashsgd.sim.network import INCAST_RANGE, STEP_RANGES, STEP_STATED, ClusterModel, Link
from flashsgd.timing import rank_times, time_ops

PROBE_DENSITY = 0.01
SMALL_BYTES = 32 * 1024
LARGE_BYTES = (1024 * 1024, 8 * 1024 * 1024)  # the large probe: the gradient, clipped to this range
LINK_REPS = 5
COMPUTE_STEPS = 12  # timed compute steps per rank: their mean and their jitter


def _timed(fn: Callable[[], Any], device: torch.device, active: bool = True, reps: int = 3) -> float:
    """Median of ``reps`` runs of ``fn`` after one warm-up, each after a barrier (and, on a GPU,
    until its kernels finish), each run's time the slowest rank's (:func:`flashsgd.timing.time_ops`;
    ranks with ``active`` False only take part in the barriers)."""
    return time_ops([fn], iters=reps, warmup=1, device=device, active=active)[0].median_s


@dataclass(frozen=True)
class Compute:
    """Step 1: one rank's compute per step (the mean over ranks and steps), its jitter, and what
    DDP's own machinery adds to a step (the same step through DDP with an exchange that sends
    nothing, minus the plain step), split into a fixed part and a part per bucket."""

    seconds: float
    jitter_cv: float
    """Standard deviation over every rank's steps / their mean (< 1: a larger spread is capped)."""
    samples: int
    ddp_overhead_s: float
    """The fixed part of DDP's cost per step, >= 0: the mean DDP step at the run's bucket cap
    (torch's ``noop_hook``: the buckets built, the hook called, nothing sent) minus the mean plain
    step on the same :data:`OVERHEAD_SAMPLES` samples, minus its buckets x
    :attr:`bucket_overhead_s` (0 where that was not measured): the simulator's ``step_overhead_s``."""
    bucket_overhead_s: float | None = None
    """DDP's cost per bucket, >= 0, from the same steps with one bucket per parameter tensor
    (:data:`FINE_BUCKET_MB`): (fine mean - run mean) / (fine buckets - run buckets); None where the
    two have as many buckets (a model of one tensor, or a run already at one tensor per bucket):
    then it stays assumed, with its range. The simulator's ``bucket_overhead_s``."""
    buckets: tuple[int, int] = (0, 0)
    """Buckets per step at the run's bucket cap and at :data:`FINE_BUCKET_MB` (counted in the hook)."""


OVERHEAD_SAMPLES = 8
"""Samples per step of the DDP probes and their plain baseline: DDP's costs do not depend on the
batch, and the noise of a step's time grows with its compute (one local batch of MNIST-1D on 4 Gloo
ranks sharing 2 cores: ~57 ms at cv ~20%, so a mean of 48 rank-steps is +-1.6 ms, more than the
overheads measured)."""

DDP_WARMUP = 11
"""Untimed steps before the DDP probes' timed ones: past DDP's bucket rebuild (at the second step,
with a broadcast: 3-6 ms against ~1.1 ms for a later step of 4 Gloo ranks here) and its runtime-stats
window (the forwards up to the 11th read the previous step's timing events, a host sync on CUDA;
torch's ``Reducer::should_collect_runtime_stats``), neither of which the training steps pay."""

FINE_BUCKET_MB = 1e-6
"""The bucket cap of the probe's second DDP, MiB: below any tensor's size, so that each parameter
tensor is a bucket of its own (DDP puts a tensor larger than the cap alone in a bucket)."""


def compute_seconds(model: torch.nn.Module, optimizer: torch.optim.Optimizer,
                    batch: tuple[torch.Tensor, torch.Tensor], loss_fn: Callable,
                    bucket_mb: float) -> Compute:
    """Step 1: forward, backward and optimizer step of ``model`` on ``batch``, every rank's own time
    of :data:`COMPUTE_STEPS` steps; then on :data:`OVERHEAD_SAMPLES` of its samples, plain and
    through DDP with torch's ``noop_hook``, at ``bucket_mb`` buckets and at :data:`FINE_BUCKET_MB`.
    The model and the optimizer are left as they were, and each probe DDP takes its autograd hooks
    with it (``_remove_autograd_hooks``, torch#96490: the trainer wraps the same module next)."""
    saved = copy.deepcopy((model.state_dict(), optimizer.state_dict()))
    x, y = batch
    devices = [x.device] if x.device.type == "cuda" else []

    def step(net: torch.nn.Module, samples: int | None = None) -> Callable[[], None]:
        xs, ys = x[:samples], y[:samples]

        def run() -> None:
            optimizer.zero_grad(set_to_none=True)
            loss_fn(net(xs), ys).backward()
            optimizer.step()
        return run

    def mean_s(fn: Callable[[], None], warmup: int = 1) -> float:
        return float(rank_times(fn, COMPUTE_STEPS, warmup=warmup, device=x.device).mean())

    def through_ddp(cap_mb: float) -> tuple[float, int]:
        ddp, buckets = _noop_ddp(model, x.device, cap_mb)
        try:
            return mean_s(step(ddp, OVERHEAD_SAMPLES), DDP_WARMUP), buckets()
        finally:
            ddp._remove_autograd_hooks()
            del ddp

    with torch.random.fork_rng(devices=devices):  # a model with dropout draws the same numbers later
        times = rank_times(step(model), COMPUTE_STEPS, warmup=1, device=x.device)  # (ranks, steps)
        small_mean = mean_s(step(model, OVERHEAD_SAMPLES))
        (run_mean, n_run), (fine_mean, n_fine) = through_ddp(bucket_mb), through_ddp(FINE_BUCKET_MB)
    model.load_state_dict(saved[0])
    optimizer.load_state_dict(saved[1])
    optimizer.zero_grad(set_to_none=True)
    mean = float(times.mean())
    cv = float(times.std(correction=1)) / mean if times.numel() > 1 else 0.0
    # DDP step = plain + fixed + buckets x per_bucket, at two bucket counts: two equations, two unknowns
    per_bucket = max((fine_mean - run_mean) / (n_fine - n_run), 0.0) if n_fine > n_run else None
    fixed = max(run_mean - small_mean - n_run * (per_bucket or 0.0), 0.0)
    return Compute(mean, min(cv, MAX_JITTER_CV), times.numel(), fixed, per_bucket, (n_run, n_fine))


def _noop_ddp(model: torch.nn.Module, device: torch.device, bucket_mb: float):
    """``model`` in DDP as the trainer wraps it (:func:`flashsgd.train.ddp_wrap.wrap_ddp`) with torch's
    ``noop_hook`` (no exchange), and a function that says how many buckets its last step had."""
    from torch.distributed.algorithms.ddp_comm_hooks.debugging_hooks import noop_hook

    from flashsgd.train.ddp_wrap import wrap_ddp

    ddp = wrap_ddp(model, device, bucket_mb)
    seen = {"current": 0, "last_step": 0}

    def counting_noop(state, bucket):  # unannotated: DDP compares annotations, here strings
        seen["current"] += 1
        if bucket.is_last():
            seen["last_step"], seen["current"] = seen["current"], 0
        return noop_hook(state, bucket)

    ddp.register_comm_hook(None, counting_noop)
    return ddp, lambda: seen["last_step"]


MAX_JITTER_CV = 0.99
"""The largest jitter recorded (:class:`~flashsgd.sim.network.ClusterModel` needs < 1)."""


def fit_ring(times: tuple[float, float], sizes: tuple[int, int], p: int, gamma: float) -> Link:
    """Step 2: alpha and bandwidth of a ring of ``p`` ranks from two all-reduce times."""
    per_byte = 2 * (p - 1) / p
    slope = (times[1] - times[0]) / (per_byte * (sizes[1] - sizes[0]))
    if slope <= 0:  # noise larger than the bytes' time: charge the large probe's time to its bytes
        slope = times[1] / (per_byte * sizes[1])
    beta = max(slope - gamma / 2, slope / 10)  # the ring's sum costs (p-1)/p n gamma of it
    alpha = max((times[0] - per_byte * sizes[0] * (beta + gamma / 2)) / (2 * (p - 1)), 0.0)
    return Link(alpha_s=alpha, bandwidth_gbps=1.0 / beta / 1e9)


def _ring_link(group, members: tuple[int, ...], active: bool, large: int, gamma: float,
               device: torch.device) -> Link:
    buf = torch.zeros(large // 4, device=device)
    sizes = (SMALL_BYTES, large)
    times = tuple(_timed(lambda n=n: dist.all_reduce(buf[: n // 4], group=group), device, active, LINK_REPS)
                  for n in sizes)
    return fit_ring(times, sizes, len(members), gamma)


@dataclass(frozen=True)
class Measured:
    """What Steps 1-3 found: the cluster model, Step 1's compute (one rank's step, its jitter's
    samples, the buckets its DDP probes had), and how long it took."""

    cluster: ClusterModel
    compute: Compute
    seconds: float
    given: str | None = None
    """The ``comm.cluster`` the network and devices came from (None: measured here)."""

    @property
    def compute_s(self) -> float:
        return self.compute.seconds

    def describe(self) -> str:
        c = self.cluster
        where = f"network and devices from {self.given}, " if self.given else ""
        per_bucket = f"{c.bucket_overhead_s * 1e3:.3f} ms/bucket"
        (n_run, n_fine) = self.compute.buckets
        if n_fine > n_run:
            per_bucket += f" ({n_run} vs {n_fine} buckets)"
        else:  # not measured: the given or assumed value
            per_bucket = "assumed per bucket" if "bucket_overhead_s" in c.assumed else per_bucket + " as given"
        return (f"{where}measured in {self.seconds:.1f} s: compute {self.compute_s * 1e3:.1f} ms/step, jitter "
                f"{c.jitter_cv:.1%} ({self.compute.samples} rank-steps), DDP {c.step_overhead_s * 1e3:.2f} ms/step + "
                f"{per_bucket}; "
                f"inter {c.inter.bandwidth_gbps * 8:.3g} Gbit/s, {c.inter.alpha_s * 1e6:.0f} us; intra "
                f"{c.intra.bandwidth_gbps * 8:.3g} Gbit/s, {c.intra.alpha_s * 1e6:.0f} us; add "
                f"{c.gamma_s_per_byte * 1e9:.3g} ns/B; select {c.select_s_per_elem * 1e9:.3g} ns/elem; "
                f"sparse exchange {c.exchange_fixed_s * 1e3:.2f} ms fixed + {c.round_fixed_s * 1e3:.2f} ms per round")


def measure_devices(numel: int, selection: str, device: torch.device) -> dict[str, float]:
    """Step 3 (local part): gamma, selection per element and PowerSGD's flop time."""
    from flashsgd.comm.sparse.select import k_from_density, selection_for

    g = torch.Generator().manual_seed(0)
    a, b = (torch.randn(numel, generator=g).to(device) for _ in range(2))
    t_add = _timed(lambda: a.add_(b), device)
    k = k_from_density(numel, PROBE_DENSITY)
    t_sel = _timed(lambda: selection_for(selection, device)(a.add(b), k), device)
    rows = 512 if numel >= 1024 else 1
    m, q = a[: rows * (numel // rows)].view(rows, -1), torch.randn(numel // rows, 2, generator=g).to(device)
    t_mm = _timed(lambda: m @ q, device)
    return {"gamma_s_per_byte": t_add / (4 * numel),
            "select_s_per_elem": max(t_sel - t_add, 0.0) / numel,
            "flop_s": t_mm / (2.0 * m.shape[0] * m.shape[1] * 2)}


def round_seconds(device: torch.device, timeout_s: float) -> float:
    """One message round as a sparse exchange runs it: an 8-byte send and receive with rank XOR 1
    posted at once (:func:`~flashsgd.comm.p2p.exchange`), then both waited for (ranks without a
    partner only take part in the barriers)."""
    from flashsgd.comm.p2p import exchange

    rank, world = dist.get_rank(), dist.get_world_size()
    peer = rank ^ 1
    send, recv = torch.zeros(2, device=device), torch.zeros(2, device=device)

    def swap() -> None:
        exchange([(send, peer)], [(recv, peer)], None, timeout_s, "auto probe, one round")

    return _timed(swap, device, active=peer < world)


def sparse_fixed_costs(cluster: ClusterModel, numel: int, selection: str, timeout_s: float,
                       device: torch.device) -> dict[str, float]:
    """Step 3 (exchange part): ``round_fixed_s`` = one round (:func:`round_seconds`) minus the
    model's time for it (alpha and 8 bytes to rank XOR 1); ``exchange_fixed_s`` = one real gTop-k
    exchange of ``numel`` entries minus the model's prediction for it with that per-round cost."""
    import numpy as np

    from flashsgd.comm.sparse import gtopk_allreduce
    from flashsgd.comm.sparse.select import k_from_density, selection_for
    from flashsgd.sim.algorithms import exchange_cost
    from flashsgd.sim.costs import CommSetup, pair_levels, step_cost
    from flashsgd.sim.planner import WIRE_INDEX_BYTES

    x = torch.randn(numel, generator=torch.Generator().manual_seed(dist.get_rank())).to(device)
    k = k_from_density(numel, PROBE_DENSITY)

    def exchange() -> None:
        values, indices = selection_for(selection, device)(x, k)
        gtopk_allreduce(values, indices, k, numel, timeout_s=timeout_s)

    t_round, t = round_seconds(device, timeout_s), _timed(exchange, device)
    setup = CommSetup(gpus=dist.get_world_size(), cluster=cluster, density=PROBE_DENSITY,
                      index_bytes=WIRE_INDEX_BYTES)
    lat, bw = step_cost(np.asarray(8.0), 1, pair_levels(1, 1, setup))  # the round's 8 bytes
    per_round = max(t_round - float(lat + bw), 0.0)
    setup = replace(setup, cluster=replace(cluster, round_fixed_s=per_round, exchange_fixed_s=0.0))
    return {"round_fixed_s": per_round,
            "exchange_fixed_s": max(t - float(exchange_cost("gtopk", 4.0 * numel, setup).total), 0.0)}


MEASURED_STEP_COSTS = ("jitter_cv", "step_overhead_s")
"""The step's costs beyond the exchange that Step 1 always measures (:class:`Compute`); the
per-bucket overhead too where the two bucket caps give different bucket counts
(:func:`with_measured_compute`)."""


def measured_cluster_assumptions() -> dict[str, tuple[float, float]]:
    """What a measured cluster still assumes, with the presets' stated values and ranges
    (:data:`~flashsgd.sim.network.STEP_STATED`, the cluster's; the ranges here): the step's costs beyond the
    exchange that Step 1 does not measure (:data:`~flashsgd.sim.network.STEP_RANGES` less
    :data:`MEASURED_STEP_COSTS`: the slowdown of compute under overlap, which needs an exchange
    beside the compute, and the per-bucket overhead until :func:`with_measured_compute` has Step
    1's) and TCP incast between nodes (:data:`~flashsgd.sim.network.INCAST_RANGE`): the probe runs
    rings and pairwise rounds, never a round in which many nodes send to one, and cannot tell a
    lossless fabric from TCP."""
    return {**{k: v for k, v in STEP_RANGES.items() if k not in MEASURED_STEP_COSTS},
            "inter.incast": INCAST_RANGE}


def with_measured_compute(cluster: ClusterModel, compute: Compute) -> ClusterModel:
    """``cluster`` with the jitter and DDP's fixed and per-bucket overhead measured in Step 1 (no
    longer assumptions, whatever it stated); a per-bucket overhead Step 1 could not measure stays
    as ``cluster`` had it."""
    measured = {"jitter_cv": compute.jitter_cv, "step_overhead_s": compute.ddp_overhead_s}
    if compute.bucket_overhead_s is not None:
        measured["bucket_overhead_s"] = compute.bucket_overhead_s
    assumed = {k: v for k, v in cluster.assumed.items() if k not in measured}
    return replace(cluster, **measured, assumed=assumed)


def measure(model: torch.nn.Module, optimizer: torch.optim.Optimizer, batch, loss_fn: Callable, topo,
            selection: str, timeout_s: float, given: tuple[str, ClusterModel] | None,
            bucket_mb: float) -> Measured:
    """Steps 1-3 on a world of >= 2 ranks (``given``: ``comm.cluster`` and its model, used for the
    network and the devices instead of Steps 2-3; the compute, its jitter and DDP's fixed and
    per-bucket overhead (at ``bucket_mb`` and at one bucket per tensor) are measured either way)."""
    t0 = time.perf_counter()
    device = batch[0].device
    compute = compute_seconds(model, optimizer, batch, loss_fn, bucket_mb)                 # Step 1
    numel = sum(p.numel() for p in model.parameters() if p.requires_grad)
    if given is not None:
        return Measured(with_measured_compute(given[1], compute), compute, time.perf_counter() - t0,
                        given=given[0])
    dev = measure_devices(numel, selection, device)                                        # Step 3
    large = min(max(4 * numel, LARGE_BYTES[0]), LARGE_BYTES[1])
    L, world = topo.ranks_per_node, topo.world_size
    gamma = dev["gamma_s_per_byte"]
    intra = _ring_link(topo.node_group, topo.node_ranks, True, large, gamma, device) \
        if L > 1 else None                                                                 # Step 2
    inter = _ring_link(topo.cross_group, topo.cross_ranks, topo.local_rank == 0, large, gamma,
                       device) if world > L else None
    cluster = ClusterModel(name="measured", ranks_per_node=L, nodes=world // L,
                           intra=intra or inter, inter=inter or intra, **dev, **STEP_STATED,
                           backend="nccl" if device.type == "cuda" else "gloo",
                           source=f"measured by flashsgd train --comm auto on {world} ranks",
                           assumed=measured_cluster_assumptions())
    cluster = replace(cluster, **sparse_fixed_costs(cluster, numel, selection, timeout_s, device))
    return Measured(with_measured_compute(cluster, compute), compute, time.perf_counter() - t0)


def plan_choice(measured: Measured, model: torch.nn.Module, world: int, local_batch: int,
                total_steps: int, accuracy_risk: str, grad_accum: int = 1) -> dict[str, Any]:
    """Step 4: the planner's choice for this run and what it was chosen over (JSON-able)."""
    from flashsgd.sim.cluster_file import to_toml
    from flashsgd.sim.uncertainty import plan_over_ranges
    from flashsgd.sim.workload import from_module

    # the compute is measured here (no range); a given cluster's assumed inputs are varied
    ranged = plan_over_ranges(from_module(model), measured.cluster, world, local_batch,
                              local_batch / measured.compute_s, steps=total_steps,
                              accuracy_risk=accuracy_risk, grad_accum=grad_accum)
    plan = ranged.plan
    doc = plan.to_dict(top=20)
    record = {"choice": {**doc["choice"], **ranged.prediction_dict(plan.choice)},
              "explain": doc["explain"] + ranges_note(ranged), "ruled_out": doc["ruled_out"],
              "ranked": [ranged.prediction_dict(p) for p in plan.ranked[:20]],
              **ranged.to_dict(), "measured": measured.describe(), "compute_s": measured.compute_s,
              "world": world, "ranks_per_node": measured.cluster.ranks_per_node}
    if measured.given is None:  # a measured cluster, to pass back as --cluster next time
        record["cluster_toml"] = to_toml(measured.cluster, f"measured by flashsgd train --comm auto on "
                                                           f"{world} ranks")
    return record


def ranges_note(ranged) -> str:
    """The end of the printed choice (``auto        chose ...``) for a cluster with assumed inputs:
    the chosen step's range, and whether the choice holds over the assumptions or what would be
    chosen where, and what to measure; nothing for a measured cluster."""
    if not ranged.inputs:
        return ""
    lo, hi = ranged.step_range(ranged.plan.choice)
    note = (f"; step {lo * 1e3:.1f}-{hi * 1e3:.1f} ms over the ranges of {len(ranged.inputs)} assumed inputs "
            "(auto.json: assumed)")
    changes = ranged.choice_changes()
    if not changes:
        return note + "; the choice holds over every assumed range"
    where = "; ".join(f"{setting} at {' | '.join(corners)}" for setting, corners in changes.items())
    return (note + f"; the choice could change within them: {where}; to decide, run --comm auto without "
            "--cluster: it measures the links, the devices and the sparse fixed costs here")


def _given_cluster(spec: str, topo) -> ClusterModel:
    from flashsgd.sim.cluster_file import load_cluster
    from flashsgd.train.plan import check_auto_cluster

    check_auto_cluster(spec, topo.world_size, topo.ranks_per_node)  # build_plan checked it when it could
    return load_cluster(spec)


def read_record(paths: list[Path], world: int, ranks_per_node: int) -> dict:
    """Step 5: the choice recorded at the first start (the first of ``paths`` that exists), read on
    rank 0 and sent to every rank; ValueError on every rank when there is none, it is unreadable, or
    it was made for another layout (the checkpoints hold that choice's hook state)."""
    found: list = [None, None]
    if dist.get_rank() == 0:
        try:
            path = next((q for q in paths if q.is_file()), None)
            if path is None:
                raise ValueError(f"found no auto.json at {' or '.join(map(str, paths))}")
            record = json.loads(path.read_text())
            layout = (record.get("world"), record.get("ranks_per_node"))
            if layout != (world, ranks_per_node):
                raise ValueError(f"{path} was chosen for world {layout[0]} with {layout[1]} ranks per "
                                 f"node, this run has {world} with {ranks_per_node}")
            record["measured"] = f"reusing the choice recorded in {path} at the first start"
            found[0] = record
        except (OSError, ValueError) as exc:  # json.JSONDecodeError is a ValueError
            found[1] = str(exc)
    dist.broadcast_object_list(found, src=0)
    if found[1] is not None:
        raise ValueError(f"--comm auto cannot resume: {found[1]}; the checkpoints hold the state of the "
                         "hook chosen then (start again with --resume never, or name the algorithm)")
    return found[0]


def _write_record(out: Path, record: dict) -> None:
    """Rank 0: ``auto.json`` (and the measured ``cluster.toml``), each written whole or not at all."""
    out.mkdir(parents=True, exist_ok=True)
    files = {"auto.json": json.dumps(record, indent=1)}
    if "cluster_toml" in record:
        files["cluster.toml"] = record["cluster_toml"]
    for name, text in files.items():
        tmp = out / f".{name}.tmp"
        tmp.write_text(text)
        os.replace(tmp, out / name)


def probe_batch(plan, data, device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
    """One local batch of the first epoch, from its own augmentation stream (the run's is untouched)."""
    local = max(1, plan.batch_at(0) // plan.world)
    x, y = data.train.batch(torch.arange(local), True, key=-1)
    return x.to(device), y.to(device)


def _new_record(plan, model, optimizer, data, device: torch.device, loss_fn: Callable, topo) -> dict:
    """Steps 1-4, the same decision on every rank (rank 0's, broadcast)."""
    c, world = plan.config.comm, plan.world
    if world == 1:
        record = {"choice": {"algorithm": "native", "bucket_mb": c.bucket_mb, "label": "native"},
                  "explain": "one rank: nothing to exchange", "measured": "nothing measured",
                  "world": 1, "ranks_per_node": topo.ranks_per_node}
    else:
        given = (c.cluster, _given_cluster(c.cluster, topo)) if c.cluster else None
        batch = probe_batch(plan, data, device)
        measured = measure(model, optimizer, batch, loss_fn, topo, c.selection, plan.config.run.timeout_s,
                           given, c.bucket_mb)
        record = plan_choice(measured, model, world, len(batch[1]), plan.total_steps, c.accuracy_risk,
                             min(plan.config.optim.grad_accum, len(batch[1])))
    found = [record]
    dist.broadcast_object_list(found, src=0)
    return found[0]


def comm_changes(choice: dict, ranks_per_node: int, epochs: int) -> dict[str, Any]:
    """The ``comm`` config keys of a recorded choice (a run of ``epochs`` epochs)."""
    changes = {"algorithm": choice["algorithm"], "bucket_mb": choice["bucket_mb"],
               "ranks_per_node": ranks_per_node, "density_warmup": choice.get("density_warmup")}
    if choice.get("density_warmup") is not None and "density_warmup_fraction" in choice:
        # an older record (a fraction of the run); a newer one leaves the length to the trainer's
        # default rule (flashsgd.exchanges.DensityWarmup), the one the planner assumed
        changes["density_warmup_epochs"] = choice["density_warmup_fraction"] * epochs
    if choice.get("density") is not None:
        changes["density"] = choice["density"]
    if choice.get("grid"):
        changes["grid"] = f"{choice['grid'][0]}x{choice['grid'][1]}"
    if choice.get("node_split") is not None:
        changes["node_split"] = choice["node_split"]
    rank = choice.get("matrix_approximation_rank", choice.get("rank"))  # "rank": older auto.json records
    if rank is not None:
        changes["matrix_approximation_rank"] = rank
    return changes


def resolve_auto(plan, model: torch.nn.Module, optimizer: torch.optim.Optimizer, data,
                 device: torch.device, loss_fn: Callable, out: Path | None, resume_from: Path | None):
    """Steps 1-5: the run plan with ``comm.algorithm`` (and its bucket size, density, grid or rank)
    chosen for this cluster, and the record of the choice (``out``: where to record it, or None;
    ``resume_from``: the checkpoint a resumed run starts from)."""
    from flashsgd.comm.topology import get_topology

    topo = get_topology(ranks_per_node=plan.ranks_per_node, timeout_s=plan.config.run.timeout_s)
    if resume_from is not None:                                                            # Step 5
        paths = [q / "auto.json" for q in dict.fromkeys(
            [p for p in (out, Path(resume_from).parent.parent) if p is not None])]
        record = read_record(paths, plan.world, topo.ranks_per_node)
    else:
        record = _new_record(plan, model, optimizer, data, device, loss_fn, topo)
        if dist.get_rank() == 0 and out is not None:
            _write_record(out, record)
    return plan.with_comm(**comm_changes(record["choice"], topo.ranks_per_node, plan.epochs)), record
