"""`flashsgd plan`: which algorithm, grid, bucket size and density to run on a cluster, and what to expect.

Ranks every candidate by the simulator's predicted step (:mod:`flashsgd.sim.planner`), shows the
best setting of each algorithm with its split (compute / exposed communication / compression) and
scaling efficiency, and explains the choice in one line. Inputs that are assumptions (the presets'
compute rates, sparse fixed costs and links, a cluster file's ``*_range`` keys, ``--images-per-s-range``)
are varied over their ranges (:mod:`flashsgd.sim.uncertainty`): each step and efficiency is shown
as a range, and the output says whether the choice changes inside them and what to measure. Sparse and low-rank exchanges are offered
only when the run is long enough to keep accuracy (``--steps``, else a built-in model's reference
run at the planned batch, :func:`run_steps`; ``--accuracy-risk any`` offers them anyway).

Examples:
  flashsgd plan --cluster 1gbe --gpus 32 --model resnet50 --steps 50000
  flashsgd plan --cluster abci --gpus 4096 --model resnet50 --batch-per-gpu 32 --steps 1000
  flashsgd plan --cluster lab.toml --gpus 8 --model flashsgd.train.models:resnet20 --images-per-s 900 \
      --steps 20000
      # a cluster file: flashsgd.sim.cluster_file (docs/planner.md has an example)
  flashsgd plan --cluster 1gbe --gpus 16 --model profile.json --images-per-s 300 --json plan.json
"""

from __future__ import annotations

import argparse
import json
import math
import time
from pathlib import Path

from flashsgd.exchanges import SELECTIONS
from flashsgd.fmt import plural, span
from flashsgd.outputs import add_output
from flashsgd.sim.cluster_file import load_cluster
from flashsgd.sim.compute_rates import RateChoice, lookup
from flashsgd.sim.device_costs import DEVICES
from flashsgd.sim.network import CLUSTERS, ClusterModel, on_device
from flashsgd.sim.planner import sparse_crossover
from flashsgd.sim.uncertainty import RangedPlan, plan_over_ranges, preset_compute_range
from flashsgd.sim.workload import MODEL_HELP, SCHEDULES, Workload, get_workload


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--cluster", required=True, metavar="PRESET_OR_FILE",
                   help=f"a preset ({', '.join(CLUSTERS.names())}) or a cluster file NAME.toml")
    p.add_argument("--gpus", type=int, required=True, help="number of GPUs (ranks)")
    p.add_argument("--model", default="resnet50", metavar="NAME_OR_PROFILE", help=MODEL_HELP)
    p.add_argument("--batch-per-gpu", type=int, default=32, help="samples per GPU per step (default 32)")
    add_rate_arguments(p)
    p.add_argument("--steps", type=int, default=None,
                   help="optimizer steps of the run (decides whether sparse / low-rank keep accuracy; "
                        "default: a built-in model's reference run at this batch, e.g. resnet50's 90 "
                        "ImageNet epochs; none for other models)")
    p.add_argument("--accuracy-risk", choices=("low", "any"), default="low",
                   help="low (default): offer compression only where measured to keep accuracy; any: all")
    p.add_argument("--precision", choices=("fp32", "fp16"), default="fp32",
                   help="gradient element type on the wire (flashsgd train: fp32)")
    p.add_argument("--grad-accum", type=int, default=1, metavar="N",
                   help="micro-batches per exchange, as flashsgd train --grad-accum (default 1)")
    p.add_argument("--schedule", choices=("trainer", *SCHEDULES), default="trainer",
                   help="when the exchanges run: trainer (default: as flashsgd train runs each one, "
                        "the sparse hooks after backward), overlap or after_backward for all")
    add_fusion_arguments(p)
    p.add_argument("--device", choices=tuple(DEVICES), default=None, metavar="CLASS",
                   help=f"the device class whose compression costs to charge ({', '.join(DEVICES)}; default: "
                        "the preset's own; flashsgd.sim.device_costs)")
    p.add_argument("--selection", choices=SELECTIONS, default=None,
                   help="the top-k selection the sparse hooks run (default auto: by the device, exact on "
                        "GPUs, sampled on CPUs, as the hooks resolve it)")
    p.add_argument("--top", type=int, default=6, help="algorithms shown (best setting of each; default 6)")
    add_output(p, "--json", metavar="PATH", help="write the plan (every candidate, ranked) as JSON")


def add_rate_arguments(p: argparse.ArgumentParser) -> None:
    """``--samples-per-s`` (alias ``--images-per-s``) and its range, for plan and simulate."""
    p.add_argument("--samples-per-s", "--images-per-s", dest="images_per_s", type=float, default=None,
                   metavar="RATE",
                   help="one GPU's training throughput at --batch-per-gpu, in the model's unit (images/s, "
                        "sequences/s; --images-per-s is the same flag). Default: the preset's ResNet-50 "
                        "figure, else a published rate for the cluster's GPU and the model, else one derived "
                        "from the GPU's peak and the model's FLOPs (flashsgd.sim.compute_rates), ranged")
    p.add_argument("--samples-per-s-range", "--images-per-s-range", dest="images_per_s_range", type=float,
                   nargs=2, default=None, metavar=("LOW", "HIGH"),
                   help="the plausible range of that throughput (default: the range of the rate used; none "
                        "for a given --samples-per-s)")


def add_fusion_arguments(p: argparse.ArgumentParser) -> None:
    """``--fusion-mb`` and ``--cycle-ms``: Horovod's schedule (``--schedule horovod``)."""
    p.add_argument("--fusion-mb", type=float, default=64.0, metavar="MiB",
                   help="--schedule horovod: the fusion buffer's ceiling in MiB (HOROVOD_FUSION_THRESHOLD; "
                        "default 64, Horovod's)")
    p.add_argument("--cycle-ms", type=float, default=1.0, metavar="MS",
                   help="--schedule horovod: the cycle in ms (HOROVOD_CYCLE_TIME; default 1, Horovod's since "
                        "v0.21; 5 before)")


def print_plan(ranged: RangedPlan, top: int) -> None:
    """The best setting of each algorithm (fastest first) with its step and efficiency ranges over
    the assumptions, the choice, what was assumed and whether the choice changes, what was ruled out."""
    plan = ranged.plan
    print(f"{'':2}{'candidate':<54} {'step ms':>8} {'range':>13} {'compute':>8} {'exposed':>8} "
          f"{'compress':>8} {'eff':>5} {'range':>8}")
    shown: dict[str, None] = {}
    for p in plan.ranked:
        if p.candidate.algorithm in shown:
            continue
        shown[p.candidate.algorithm] = None
        if p.candidate.algorithm == plan.choice.candidate.algorithm:
            p = plan.choice  # its chosen setting (a near-tied bucket cap may differ from the fastest)
        r = p.result
        lo, hi = ranged.step_range(p)
        elo, ehi = ranged.efficiency_range(p)
        mark = "*" if p is plan.choice else " "
        print(f"{mark:2}{p.candidate.label():<54} {p.step_s * 1e3:8.1f} {span(lo * 1e3, hi * 1e3, '.1f'):>13} "
              f"{r.compute_s * 1e3:8.1f} {r.exposed_comm_s * 1e3:8.1f} {p.compression_s * 1e3:8.1f} "
              f"{r.efficiency:5.0%} {span(elo * 100, ehi * 100, '.0f') + '%':>8}")
        if len(shown) == top:
            break
    lo, hi = ranged.step_range(plan.choice)
    elo, ehi = ranged.efficiency_range(plan.choice)
    speedup = ranged.speedup_range()
    faster = "" if speedup is None else f", {span(*speedup, '.2f')}x faster than the best dense"
    over = (f" (over the assumptions: step {span(lo * 1e3, hi * 1e3, '.1f')} ms, efficiency "
            f"{span(elo * 100, ehi * 100, '.0f')}%{faster})" if ranged.inputs else "")
    print(f"choice: {plan.explain()}{over}")
    crossover = sparse_crossover(plan)
    if crossover:
        print(crossover)
    for line in ranged.summary():
        print(line)
    for line in plan.ruled_out:
        print(f"ruled out: {line}")


def rate_choice(args: argparse.Namespace, cluster, workload: Workload) -> RateChoice:
    """One GPU's compute rate, its range and its source (:mod:`flashsgd.sim.compute_rates`):
    ``--samples-per-s`` (measured: no range unless ``--samples-per-s-range``); else the preset's own
    ResNet-50 figure; else a published rate for the cluster's device class; else one derived from the
    device's peak and the workload's FLOPs. ``--samples-per-s-range`` replaces the range."""
    unit = workload.unit
    if args.images_per_s is not None:
        if not (math.isfinite(args.images_per_s) and args.images_per_s > 0):
            raise ValueError(f"--samples-per-s must be a finite number > 0 ({unit}/s of one GPU), "
                             f"got {args.images_per_s}")
        choice = RateChoice(args.images_per_s, None, "given by --samples-per-s", unit)
    elif workload.name == "resnet50" and args.precision in cluster.resnet50_images_per_s:
        choice = RateChoice(cluster.resnet50_images_per_s[args.precision],
                            preset_compute_range(cluster, args.precision),
                            f"the {cluster.name} preset's ResNet-50 {args.precision} figure", unit)
    else:
        choice = lookup(cluster.device, workload.name, args.precision, workload.forward_flops, unit) \
            if cluster.device else None
        if choice is None:
            why = (f"cluster {cluster.name!r} names no device class (a preset does; a cluster file: device = "
                   f"\"NAME\", {', '.join(DEVICES)}; or plan --device)"
                   if not cluster.device else
                   f"no published rate for {cluster.device}/{workload.name}/{args.precision} and "
                   f"{'no FLOP count for the model' if not workload.forward_flops else 'no peak for the device'}")
            raise ValueError(f"--samples-per-s is required for model {workload.name!r} on cluster {cluster.name!r} "
                             f"at {args.precision} (one GPU's training throughput, {unit}/s): {why}")
    if args.images_per_s_range is not None:
        lo, hi = args.images_per_s_range
        if not (math.isfinite(lo) and math.isfinite(hi) and 0 < lo <= hi):
            raise ValueError(f"--samples-per-s-range must be 0 < LOW <= HIGH ({unit}/s), got {lo:g} {hi:g}")
        if not lo <= choice.rate <= hi:  # a cluster file's KEY_range must hold KEY: the same rule
            given = "--samples-per-s" if args.images_per_s is not None else f"the rate used ({choice.source})"
            raise ValueError(f"--samples-per-s-range {lo:g} {hi:g} must hold the compute rate used, {given} "
                             f"{choice.rate:g} (LOW <= value <= HIGH"
                             f"{'; or give --samples-per-s inside it' if args.images_per_s is None else ''})")
        choice = RateChoice(choice.rate, (lo, hi), choice.source + "; range from --samples-per-s-range", unit,
                            choice.batch)
    return choice


def images_per_s(args: argparse.Namespace, cluster, workload: Workload) -> float:
    """One GPU's samples/s (:func:`rate_choice`)."""
    return rate_choice(args, cluster, workload).rate


def compute_range(args: argparse.Namespace, cluster, workload: Workload) -> tuple[float, float] | None:
    """Its range (:func:`rate_choice`); None when measured (given without a range)."""
    return rate_choice(args, cluster, workload).range


def run_steps(given: int | None, workload: Workload, global_batch: int) -> tuple[int | None, str]:
    """``--steps``, else the steps of the workload's reference run at this global batch
    (:meth:`~flashsgd.sim.workload.Workload.reference_steps`) with the line that says so; None (and
    no compressed exchange offered) for a workload without one."""
    if given is not None:
        return given, ""
    steps = workload.reference_steps(global_batch)
    if steps is None:
        return None, ""
    samples, epochs, source = workload.reference_run
    return steps, (f"steps: {steps:,} assumed: {workload.name}'s reference run, {epochs:g} epochs of {samples:,} "
                   f"samples ({source}) at global batch {global_batch:,}; give --steps for your run")


def device_cluster(cluster: ClusterModel, device: str | None, selection: str | None) -> ClusterModel:
    """``cluster`` on ``--device`` running ``--selection`` (:func:`flashsgd.sim.network.on_device`);
    unchanged when neither is given. ``--selection`` alone keeps the cluster's device class."""
    if device is None and selection is None:
        return cluster
    name = device or cluster.device
    if not name:
        raise ValueError(f"--selection needs a device class: cluster {cluster.name!r} names none; give "
                         f"--device ({', '.join(DEVICES)})")
    return on_device(cluster, name, selection or "auto")


def run(args: argparse.Namespace) -> int:
    t0 = time.perf_counter()
    for flag, value in (("--top", args.top), ("--gpus", args.gpus), ("--batch-per-gpu", args.batch_per_gpu),
                        ("--steps", 1 if args.steps is None else args.steps)):
        if value < 1:
            raise ValueError(f"{flag} must be an integer >= 1, got {value}")
    cluster = device_cluster(load_cluster(args.cluster), getattr(args, "device", None),
                             getattr(args, "selection", None))
    cluster.check_gpus(args.gpus)
    workload = get_workload(args.model)
    steps, steps_note = run_steps(args.steps, workload, args.gpus * args.batch_per_gpu)
    rate = rate_choice(args, cluster, workload)
    ranged = plan_over_ranges(workload, cluster, args.gpus, args.batch_per_gpu, rate.rate, rate.range,
                              steps=steps, accuracy_risk=args.accuracy_risk, precision=args.precision,
                              grad_accum=args.grad_accum, schedule=args.schedule,
                              **({"fusion_mb": args.fusion_mb, "cycle_ms": args.cycle_ms}
                                 if args.schedule == "horovod" else {}))
    plan = ranged.plan
    elapsed = time.perf_counter() - t0
    print(f"{cluster.describe()}\nworkload {workload.name}: {workload.num_params:,} parameters in "
          f"{workload.num_tensors} tensors; {plural(args.gpus, 'GPU')} x {plural(args.batch_per_gpu, 'sample')}"
          f"{f' in {args.grad_accum} micro-batches' if args.grad_accum > 1 else ''}; exchanges: "
          f"{'as flashsgd train runs them (sparse after backward)' if args.schedule == 'trainer' else args.schedule}"
          f"{f' (fusion {args.fusion_mb:g} MiB, cycle {args.cycle_ms:g} ms)' if args.schedule == 'horovod' else ''}; "
          f"{len(plan.ranked)} candidates ranked at {plural(1 + len(ranged.at), 'setting')} of the "
          f"assumptions in {elapsed:.2f} s")
    for w in cluster.warnings:
        print(f"warning: {w}")
    print(rate.describe(args.batch_per_gpu))
    if steps_note:
        print(steps_note)
    print_plan(ranged, args.top)
    if args.json:
        Path(args.json).parent.mkdir(parents=True, exist_ok=True)
        doc = {**plan.to_dict(), **ranged.to_dict(), "seconds": elapsed, "steps": steps,
               "steps_assumed": bool(steps_note),
               "compute_rate": {"rate": rate.rate, "range": rate.range, "source": rate.source,
                                "unit": workload.unit, "batch": rate.batch},
               "choice": {**plan.to_dict()["choice"], **ranged.prediction_dict(plan.choice)},
               "ranked": [ranged.prediction_dict(p) for p in plan.ranked]}
        Path(args.json).write_text(json.dumps(doc, indent=1))
        print(f"wrote {Path(args.json).resolve()}")
    return 0
