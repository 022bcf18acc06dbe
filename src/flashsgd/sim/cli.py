"""`flashsgd simulate`: predict iteration time, exposed communication and scaling efficiency.

Inputs that are assumptions (a preset's links, compute rate and sparse costs, a cluster file's
``*_range`` keys, ``--samples-per-s-range``, a rate from :mod:`flashsgd.sim.compute_rates`) are varied over their ranges
(:func:`flashsgd.sim.uncertainty.runs_over_ranges`): every number of the table and the breakdown is
printed with its ``[low-high]`` range and the ``assumed:`` line says what was assumed (the same line
as ``flashsgd plan``'s); measured inputs (``--calibration``, a cluster file's values without a
range, a given ``--samples-per-s``) have none, and the output says so. Rates are printed in the
workload's unit (images/s, sequences/s).

Examples:
  flashsgd simulate --cluster abci --gpus 1024 --model resnet50 --batch-per-gpu 32 \\
      --comm torus2d --grid 32x32 --precision fp16
  flashsgd simulate --cluster abci --sweep-gpus 8,64,512,4096 --comm all --json runs/eff.json
      # table, runs/eff.json, and the efficiency plot next to it: runs/eff.png
  flashsgd simulate --cluster 1gbe --gpus 16 --comm gtopk,hgtopk --node-split slices --images-per-s 200
  flashsgd simulate --cluster dgx-h100 --gpus 64 --model bert-large --batch-per-gpu 8 --precision fp16
      # no rate given: the one used, its range and source are printed; sequences/s
  flashsgd simulate --cluster abci --gpus 128 --schedule horovod --fusion-mb 64 --cycle-ms 1 --precision fp16
  flashsgd simulate --to-efficiency weak-scaling 7.91 --gpus 8   # a published figure as efficiency
  flashsgd simulate --cluster local --calibration ar.json --gpus 8 --comm ring
  flashsgd simulate --calibration ar.json --validate        # fit on half the sizes, predict the rest
  flashsgd simulate --calibrate scaling.json --calibrate-on 2x1,8x1
      # fit the step model to `bench scaling` rows of these shapes, predict every row
"""

from __future__ import annotations

import argparse
import json
import time
from dataclasses import replace
from pathlib import Path

from flashsgd.comm.topology import parse_grid
from flashsgd.exchanges import BUILT_IN, DEFAULT_DENSITY, INT32_NUMEL, NODE_SPLITS, WIRE_INDEX_BYTES, option_default
from flashsgd.fmt import percent, plural, size, span
from flashsgd.outputs import add_output
from flashsgd.sim.algorithms import SIMULATED
from flashsgd.sim.engine import (BYTES, SimConfig, SimResult, bucket_bounds, simulate,
                                  straddling_alternative, sweep)
from flashsgd.sim.cluster_file import load_cluster
from flashsgd.sim.network import CLUSTERS, get_cluster
from flashsgd.sim.published import KINDS, to_efficiency
from flashsgd.sim.plan_cli import add_fusion_arguments, add_rate_arguments, rate_choice
from flashsgd.sim.uncertainty import RangedRuns, assumed_lines, runs_over_ranges
from flashsgd.sim.workload import MODEL_HELP, SCHEDULES, get_workload, trainer_schedule

RANGED = ("iteration_s", "compute_s", "comm_s", "exposed_comm_s", "straggler_s", "slowdown_s", "step_overhead_s",
          "input_wait_s", "images_per_s", "efficiency")
"""The :class:`SimResult` fields printed and written with their range over the assumed inputs."""


def _ints(text: str) -> list[int]:
    try:
        out = [int(v) for v in text.split(",") if v.strip()]
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected comma-separated integers, got {text!r}") from None
    if not out or min(out) < 1:
        raise argparse.ArgumentTypeError(f"expected positive integers, got {text!r}")
    return out


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--cluster", default=None,
                   help=f"preset ({', '.join(CLUSTERS.names())}; default abci), a cluster file "
                        "NAME.toml (flashsgd.sim.cluster_file), or 'local' (implied by --calibration)")
    p.add_argument("--calibration", metavar="PATH", help="`flashsgd bench allreduce --json` file")
    p.add_argument("--fit", choices=("joint", "per-algorithm"), default="joint",
                   help="calibration fit: one (alpha, beta, gamma) for all, or per algorithm")
    p.add_argument("--statistic", choices=("time_us", "time_us_min"), default="time_us",
                   help="bench column to fit: median (default) or fastest repetition")
    p.add_argument("--validate", action="store_true",
                   help="with --calibration: fit on every other size, predict the others, and exit")
    p.add_argument("--predict", metavar="PATH",
                   help="with --calibration: predict every point of another bench file (same world "
                        "and layout, e.g. a second run) from the fit, print the errors, and exit")
    p.add_argument("--calibrate", action="append", metavar="PATH",
                   help="`flashsgd bench scaling --json` file (repeatable): fit the step model "
                        "(flashsgd.sim.scaling) to its rows, predict every row, and exit")
    p.add_argument("--calibrate-on", metavar="NxR,...",
                   help="with --calibrate: shapes whose rows calibrate (default: the smallest and "
                        "largest multi-rank shape of the first file); the others validate")
    p.add_argument("--show", action="store_true", help="print the cluster parameters")
    p.add_argument("--to-efficiency", nargs=2, metavar=("KIND", "VALUE"),
                   help=f"print the scaling efficiency a published figure means at --gpus and exit; KIND: "
                        f"{'; '.join(f'{k}: {v}' for k, v in KINDS.items())} (flashsgd.sim.published)")
    p.add_argument("--base-gpus", type=int, default=1, help="--to-efficiency speedup: the GPUs it is over (default 1)")
    p.add_argument("--gpus", type=int, default=256, help="number of GPUs (default 256)")
    p.add_argument("--sweep-gpus", type=_ints, metavar="N,N,...", help="simulate each GPU count")
    p.add_argument("--model", default="resnet50", metavar="NAME_OR_PROFILE", help=MODEL_HELP)
    p.add_argument("--batch-per-gpu", type=int, default=32)
    add_rate_arguments(p)
    p.add_argument("--comm", metavar="NAME[,NAME...]",
                   help=f"exchanges to simulate, comma-separated, or 'all' (default native): "
                        f"{', '.join(SIMULATED.names())}")
    p.add_argument("--grid", help="torus2d grid XxY, X*Y = --gpus or one of --sweep-gpus "
                                  "(default: near-square, X per node)")
    p.add_argument("--precision", choices=("fp32", "fp16"), default="fp32",
                   help="gradient element type on the wire (default fp32, as flashsgd train)")
    p.add_argument("--bucket-mb", type=float, default=25.0,
                   help="DDP bucket cap in MiB (DDP's bucket_cap_mb; default 25)")
    p.add_argument("--groups", type=_ints, metavar="N,N,...",
                   help="fixed fusion groups (tensor counts in backward order, e.g. 3,21,57,80)")
    p.add_argument("--schedule", choices=(*SCHEDULES, "trainer"), default="overlap",
                   help="when the exchanges run: overlap (default: each bucket during backward as soon "
                        "as it is ready, DDP), after_backward (all after it), horovod (fused once per "
                        "--cycle-ms into buffers of at most --fusion-mb), or trainer (each exchange as "
                        "flashsgd train runs it on Gloo: the sparse hooks after backward); with "
                        "--grad-accum N one exchange per N micro-batches")
    add_fusion_arguments(p)
    p.add_argument("--grad-accum", type=int, default=1, metavar="N",
                   help="micro-batches per exchange, as flashsgd train --grad-accum: --batch-per-gpu "
                        "split in N, the first N-1 without an exchange; --samples-per-s is the "
                        "throughput at the micro-batch (default 1)")
    p.add_argument("--density", type=float, default=DEFAULT_DENSITY,
                   help=f"topk/gtopk/hgtopk density (default {DEFAULT_DENSITY:g})")
    p.add_argument("--node-split", choices=NODE_SPLITS, default=option_default("node_split"),
                   help=f"hgtopk's node step (default {option_default('node_split')})")
    p.add_argument("--matrix-approximation-rank", type=int, default=option_default("matrix_approximation_rank"),
                   help="powersgd's rank (default %(default)s)")
    p.add_argument("--index-bytes", type=int, choices=(4, 8), default=WIRE_INDEX_BYTES,
                   help=f"sparse bytes per index on the wire (default {WIRE_INDEX_BYTES}: what flashsgd's "
                        f"comm/sparse/__init__.py sends for buckets under {INT32_NUMEL:,} elements); 4: int32, as "
                        f"in the papers; 8: int64, comm/sparse/__init__.py's format for larger buckets")
    add_output(p, "--json", metavar="PATH", help="write inputs and results as JSON")
    add_output(p, "--out", "dir", metavar="DIR",
                   help="with --sweep-gpus: write the scaling-efficiency plot as DIR/sim_sweep.png")
    add_output(p, "--plot", metavar="PATH",
                   help="with --sweep-gpus: the plot's path (default: next to --json, same name .png, "
                        "or in --out; none without either)")


def _schedule_text(args) -> str:
    """When the exchanges run, in words (``--schedule``, ``--grad-accum``)."""
    text = {"overlap": "overlapped with backward, bucket by bucket (DDP)",
            "after_backward": "after backward, one bucket after another",
            "trainer": "as flashsgd train runs each exchange (the sparse hooks after backward)"}.get(
        args.schedule, args.schedule)
    if args.schedule == "horovod":
        text = (f"Horovod: every {args.cycle_ms:g} ms the gradients ready are fused into buffers of at most "
                f"{args.fusion_mb:g} MiB")
    if args.grad_accum > 1:
        text += f"; one exchange per {args.grad_accum} micro-batches (after accumulation)"
    return text


def _algorithms(value: str | None) -> list[str]:
    """``--comm``: comma-separated names (default native) or 'all'; ValueError on an unknown one."""
    names = [n.strip() for n in (value or "native").split(",") if n.strip()]
    if "all" in names:
        return SIMULATED.names()
    for n in names:
        SIMULATED.get(n)  # ValueError listing the known names
    return list(dict.fromkeys(names))


def _scheduled(base: SimConfig, algorithm: str, schedule: str) -> SimConfig:
    """``base`` for ``algorithm`` with ``--schedule`` (``trainer``: :func:`trainer_schedule`)."""
    return replace(base, algorithm=algorithm,
                   schedule=trainer_schedule(algorithm) if schedule == "trainer" else schedule)


def _grid(text: str | None, gpus: list[int]) -> tuple[int, int] | None:
    """``--grid`` parsed by :func:`flashsgd.comm.topology.parse_grid` against the GPU count(s)."""
    if text is None:
        return None
    errors = []
    for p in gpus:
        try:
            return parse_grid(text, p)
        except ValueError as exc:
            errors.append(exc)
    if len(gpus) == 1:
        raise errors[0]
    raise ValueError(f"--grid {text!r} fits none of --sweep-gpus {','.join(map(str, gpus))}: X*Y must "
                     f"equal one of them ({errors[0]})")


def _cluster(args):
    if args.calibration:
        from flashsgd.sim.calibrate import fit, load_bench

        if args.cluster not in (None, "local"):
            raise ValueError(f"--calibration builds the 'local' cluster, not {args.cluster!r}: "
                             "drop --cluster or use --cluster local")
        bench = load_bench(args.calibration, args.statistic)
        f = fit(bench, args.fit)
        print(f"calibration {args.calibration}: {len(bench.measurements)} points, fit {args.fit}, "
              f"rms rel error {f.rms_rel_error:.1%}, max {f.max_rel_error:.1%}"
              + (f"; skipped {bench.skipped}" if bench.skipped else ""))
        for algo, (a, b, g) in f.params.items():
            print(f"  {algo:>14}: alpha={a * 1e6:9.2f} us  beta={b * 1e9:8.4f} ns/B "
                  f"({1 / b / 1e9 if b else float('inf'):.3g} GB/s)  gamma={g * 1e9:.4f} ns/B")
        return f.cluster, bench, f
    if args.cluster == "local":
        get_cluster("local")  # ValueError: 'local' needs --calibration
    return load_cluster(args.cluster or "abci"), None, None


def _print_errors(rows: list[dict]) -> None:
    """One line per prediction: algorithm, size, measured and predicted time, relative error."""
    print(f"{'algorithm':>14} {'size_B':>10} {'measured_us':>12} {'predicted_us':>12} {'error':>8}")
    for r in rows:
        print(f"{r['algorithm']:>14} {int(r['size_bytes']):>10} {r['measured_us']:>12.1f} "
              f"{r['predicted_us']:>12.1f} {r['rel_error']:>+8.1%}")


def _validate(bench, mode: str) -> dict:
    from flashsgd.sim.calibrate import validate

    v = validate(bench, mode)
    print(f"validation ({mode} fit on sizes {[int(s) for s in v.fit_sizes]}; predicting the others):")
    _print_errors(v.rows)
    print(f"max |error| for messages >= 1 MiB: {percent(v.max_error(1 << 20), than=0.25, missing='none')} "
          f"(target 25%); all sizes: {percent(v.max_error(), missing='none')}")
    return {"mode": mode, "fit_sizes": v.fit_sizes, "rows": v.rows,
            "max_error_ge_1MB": v.max_error(1 << 20), "max_error": v.max_error()}


def _predict_file(path: str, params: dict, statistic: str, calib) -> dict:
    from flashsgd.sim.calibrate import load_bench, predict

    other = load_bench(path, statistic)
    if (other.world, other.ranks_per_node, other.grid) != (calib.world, calib.ranks_per_node, calib.grid):
        raise ValueError(f"--predict {path!r}: world/ranks_per_node/grid "
                         f"{(other.world, other.ranks_per_node, other.grid)} differ from the "
                         f"calibration's {(calib.world, calib.ranks_per_node, calib.grid)}")
    ms = [m for m in other.measurements if m.algorithm in params or "*" in params]
    pred = predict(params, ms, other)
    rows = [dict(algorithm=m.algorithm, size_bytes=m.size_bytes, measured_us=m.time_s * 1e6,
                 predicted_us=p * 1e6, rel_error=(p - m.time_s) / m.time_s) for m, p in zip(ms, pred)]
    print(f"prediction of {path} ({len(rows)} points):")
    _print_errors(rows)
    big = [float(abs(r["rel_error"])) for r in rows if r["size_bytes"] >= 1 << 20]  # Python floats for fmt
    worst = max(big) if big else float("nan")
    print(f"max |error| for messages >= 1 MiB: {percent(worst, than=0.25, missing='none (no message that large)')} "
          f"(target 25%)")
    return {"path": path, "rows": rows, "max_error_ge_1MB": worst}


def grid_text(r: SimResult, cluster, given: bool) -> str:
    """``12x16 (automatic: ...; rows span 2 nodes)``: the torus grid ``r`` ran on and where it
    came from."""
    x, y = r.grid
    per_node = min(r.gpus, cluster.ranks_per_node)
    how = ("given by --grid" if given else
           f"automatic: near-square, X a multiple of {plural(per_node, 'GPU')}/node")
    if r.gpus > per_node:
        how += (f"; rows span {plural(x // per_node, 'node')}" if x > per_node else
                "; a row is a node" if x == per_node else f"; {plural(per_node // x, 'row')} per node")
    return f"{x}x{y} ({how})"


def grid_warning(r: SimResult, aligned: SimResult) -> str:
    """The automatic grid straddles nodes and the node-aligned one predicts a faster step."""
    return (f"warning: the automatic torus2d grid {r.grid[0]}x{r.grid[1]} on {plural(r.gpus, 'GPU')} "
            f"straddles nodes; the node-aligned grid {aligned.grid[0]}x{aligned.grid[1]} is faster: "
            f"{aligned.iteration_s * 1e3:.2f} ms ({aligned.efficiency:.1%}) vs {r.iteration_s * 1e3:.2f} "
            f"ms ({r.efficiency:.1%}); pass --grid {aligned.grid[0]}x{aligned.grid[1]} to use it")


def _grid_lines(results: list[SimResult], workload, cluster, base: SimConfig, schedule: str) -> list[str]:
    """The grid of every torus2d result and, where the automatic one straddles nodes and the
    node-aligned grid is faster, a warning with both predictions (:func:`straddling_alternative`)."""
    lines = []
    for r in results:
        if r.grid is None:
            continue
        cfg = replace(_scheduled(base, r.algorithm, schedule), gpus=r.gpus,
                      grid=base.grid if base.grid and base.grid[0] * base.grid[1] == r.gpus else None)
        lines.append(f"torus2d on {plural(r.gpus, 'GPU')}: grid {grid_text(r, cluster, cfg.grid is not None)}")
        aligned = straddling_alternative(workload, cluster, cfg, r)
        if aligned is not None:
            lines.append(grid_warning(r, aligned))
    return lines


def _print_breakdown(r: SimResult, ranged: RangedRuns, i: int, unit: str = "images") -> None:
    """One run's breakdown; each line's ``[low-high]`` over the assumed inputs (none when measured)."""
    ms = 1e3

    def rng(field: str, scale: float, fmt: str) -> str:
        if not ranged.inputs:
            return ""
        lo, hi = ranged.range(i, field)
        return f" [{span(lo * scale, hi * scale, fmt)}]"

    when = {"overlap": "overlapping backward", "horovod": "as Horovod fuses them per cycle"}.get(
        r.schedule, "after backward")
    accum = f", {plural(r.grad_accum, 'micro-batch', 'micro-batches')} per exchange" if r.grad_accum > 1 else ""
    print(f"algorithm {r.algorithm}, {plural(r.gpus, 'GPU')}, {plural(r.buckets, 'bucket')} "
          f"(largest {size(r.bucket_bytes_max)}) exchanged {when}{accum}")
    print(f"  iteration        {r.iteration_s * ms:9.2f} ms{rng('iteration_s', ms, '.2f')}")
    print(f"  compute          {r.compute_s * ms:9.2f} ms{rng('compute_s', ms, '.2f')}  "
          "(forward + backward + update, one GPU)")
    print(f"  communication    {r.comm_s * ms:9.2f} ms{rng('comm_s', ms, '.2f')}  (latency {r.latency_s * ms:.2f}, "
          f"bandwidth {r.bandwidth_s * ms:.2f}, compute {r.comm_compute_s * ms:.2f}, overhead {r.overhead_s * ms:.2f}"
          f"{' at the stated values' if ranged.inputs else ''})")
    print(f"  exposed comm     {r.exposed_comm_s * ms:9.2f} ms{rng('exposed_comm_s', ms, '.2f')}")
    print(f"  stragglers       {r.straggler_s * ms:9.2f} ms{rng('straggler_s', ms, '.2f')}  (waiting for the "
          f"slowest of {plural(r.gpus, 'rank')})")
    print(f"  overlap slowdown {r.slowdown_s * ms:9.2f} ms{rng('slowdown_s', ms, '.2f')}  (backward slowed by "
          "the exchanges beside it)")
    print(f"  step overhead    {r.step_overhead_s * ms:9.2f} ms{rng('step_overhead_s', ms, '.2f')}")
    print(f"  input wait       {r.input_wait_s * ms:9.2f} ms{rng('input_wait_s', ms, '.2f')}  (the node's host "
          "preparing its GPUs' images)")
    print(f"  throughput       {r.images_per_s:9.0f} {unit}/s{rng('images_per_s', 1.0, '.0f')}")
    print(f"  efficiency       {r.efficiency:9.1%}{rng('efficiency', 100.0, '.1f')}  "
          "(throughput / (GPUs x single-GPU throughput))")


def _print_table(ranged: RangedRuns, algos: list[str], gpus: list[int]) -> None:
    """Efficiency and iteration ms of every (algorithm, GPUs), each with its range when assumed."""
    index = {(r.algorithm, r.gpus): i for i, r in enumerate(ranged.runs)}

    def cell(i: int) -> str:
        r = ranged.runs[i]
        if not ranged.inputs:
            return f"{r.efficiency:6.1%} ({r.iteration_s * 1e3:8.2f})"
        (elo, ehi), (lo, hi) = ranged.range(i, "efficiency"), ranged.range(i, "iteration_s")
        return (f"{r.efficiency:6.1%} [{span(elo * 100, ehi * 100, '.0f')}] "
                f"{r.iteration_s * 1e3:.2f} [{span(lo * 1e3, hi * 1e3, '.1f')}]")

    rows = [[cell(index[a, p]) for a in algos] for p in gpus]
    width = max(20, *(len(c) for row in rows for c in row))
    print("scaling efficiency [range], iteration ms [range]:" if ranged.inputs else
          "scaling efficiency (iteration ms):")
    print(f"{'GPUs':>6} " + " ".join(f"{a:>{width}}" for a in algos))
    for p, row in zip(gpus, rows):
        print(f"{p:>6} " + " ".join(f"{c:>{width}}" for c in row))


def _print_assumed(ranged: RangedRuns) -> None:
    """What was assumed (plan's ``assumed:`` line) and how the ``[low-high]`` ranges were taken."""
    for line in assumed_lines(ranged.inputs):
        print(line)
    if ranged.inputs:
        print(f"[low-high]: each number's lowest and highest at {' | '.join(c.name for c, _ in ranged.at)}")


def plot_path(plot: str | None, out: str | None, json_path: str | None) -> Path | None:
    """Where the sweep's plot goes: ``--plot``, else ``--out``/sim_sweep.png, else beside ``--json``."""
    if plot:
        return Path(plot)
    if out:
        return Path(out) / "sim_sweep.png"
    if json_path:
        return Path(json_path).with_suffix(".png")
    return None


def plot_efficiency(results: list[SimResult], path: str | Path, title: str, backend: str = "nccl") -> None:
    """Scaling efficiency vs GPUs, one line per algorithm (log2 x axis); ``native`` labelled with what
    it is costed as on ``backend`` (:mod:`flashsgd.sim.costs_nccl`)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(8, 5), dpi=120)
    algos = list(dict.fromkeys(r.algorithm for r in results))
    styles = ["-o", "--s", "-^", "-.v", ":D", "-x", "--P", "-.*", ":h", "--<"]
    for i, a in enumerate(algos):
        rs = [r for r in results if r.algorithm == a]
        ax.plot([r.gpus for r in rs], [100 * r.efficiency for r in rs], styles[i % len(styles)],
                color=plt.get_cmap("tab20")(i % 20),  # distinct colours past the default cycle's ten
                label=(f"{a} ({'NCCL ring or tree' if backend == 'nccl' else 'Gloo ring'})" if a == BUILT_IN
                       else a), markersize=5, linewidth=1.5,
                alpha=0.6 if a == BUILT_IN else 1.0)
    gpus = sorted({r.gpus for r in results})
    ax.set_xscale("log", base=2)
    ax.set_xticks(gpus, [str(g) for g in gpus])
    ax.minorticks_off()
    ax.set_xlabel("GPUs")
    ax.set_ylabel("scaling efficiency (%)")
    ax.set_ylim(0, 105)
    ax.set_title(title, fontsize=10)
    ax.grid(True, which="both", alpha=0.3)
    ax.legend(fontsize=8, ncol=2, loc="best", framealpha=0.9)
    fig.tight_layout()
    Path(path).parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path)
    plt.close(fig)


def run(args: argparse.Namespace) -> int:
    if args.to_efficiency:
        kind, text = args.to_efficiency
        try:
            value = float(text)
        except ValueError:
            raise ValueError(f"--to-efficiency {kind} {text!r}: VALUE must be a number") from None
        eff = to_efficiency(kind, value, args.gpus, args.base_gpus, args.images_per_s)
        print(f"{kind} {value:g} at {plural(args.gpus, 'GPU')}"
              f"{f' over {args.base_gpus}' if args.base_gpus > 1 and kind == 'speedup' else ''}: "
              f"scaling efficiency {eff:.2%} (as flashsgd simulate prints it)")
        return 0
    if args.calibrate:
        from flashsgd.sim.scaling_cli import run_calibration

        run_calibration(args.calibrate, args.calibrate_on, args.json)
        return 0
    if args.calibrate_on:
        raise ValueError("--calibrate-on needs --calibrate PATH")
    cluster, bench, fitted = _cluster(args)
    simulating = not (args.validate or args.predict)
    if simulating:
        workload, ips, ips_range, algos, base = _checked_inputs(args, cluster)
    report: dict = {"cluster": cluster.describe()}
    if args.show:
        print(cluster.describe())
        print(f"  source: {cluster.source}")
    if args.validate:
        if bench is None:
            raise ValueError("--validate needs --calibration PATH")
        report["validation"] = _validate(bench, args.fit)
    if args.predict:
        if bench is None:
            raise ValueError("--predict needs --calibration PATH")
        report["prediction"] = _predict_file(args.predict, fitted.params, args.statistic, bench)
    if not simulating:
        _write_json(args.json, report)
        return 0
    grad_bytes = workload.num_params * (2 if args.precision == "fp16" else 4)
    print(f"{cluster.describe()}\nworkload {workload.name}: {workload.num_tensors} tensors, "
          f"{workload.num_params:,} params, {size(grad_bytes)} of {args.precision} gradients; "
          f"{ips:g} {workload.unit}/s/GPU at batch {args.batch_per_gpu}"
          + (f" ({workload.sample} each)" if workload.sample else ""))
    for w in cluster.warnings:
        print(f"warning: {w}")
    print(args._rate.describe(args.batch_per_gpu))
    print(f"schedule: {_schedule_text(args)}")
    report["inputs"] = {k: v for k, v in vars(args).items() if not k.startswith("_")}
    report["workload"] = {"name": workload.name, "tensors": workload.num_tensors,
                          "params": workload.num_params, "note": workload.note, "unit": workload.unit,
                          "sample": workload.sample}
    report["compute_rate"] = {"rate": args._rate.rate, "range": args._rate.range, "source": args._rate.source,
                              "unit": workload.unit, "batch": args._rate.batch}
    run_ranged = _sweep if args.sweep_gpus else _breakdowns
    ranged = run_ranged(args, workload, cluster, base, algos, ips, ips_range, report)
    results = ranged.runs
    report["assumed"] = [a.to_dict() for a in ranged.inputs]
    report["range_corners"] = [c.name for c, _ in ranged.at]
    report["results"] = [{**r.to_dict(), "ranges": ranged.ranges(i, RANGED)} for i, r in enumerate(results)]
    _write_json(args.json, report)
    return 0


def _sweep(args, workload, cluster, base: SimConfig, algos: list[str], ips: float, ips_range,
           report: dict):
    """``--sweep-gpus``: the efficiency table over the assumptions' ranges, the grids, the plot."""
    def run_all(c, rate):
        cfg = replace(base, images_per_s=rate)
        return [r for a in algos for r in sweep(workload, c, _scheduled(cfg, a, args.schedule), [a],
                                                 args.sweep_gpus)]

    t0 = time.perf_counter()
    ranged = runs_over_ranges(run_all, cluster, ips, ips_range, args.precision, workload.unit)
    results = ranged.runs
    elapsed = time.perf_counter() - t0
    _print_table(ranged, algos, args.sweep_gpus)
    print(f"simulated {len(results)} configurations at {plural(1 + len(ranged.at), 'setting')} of the "
          f"assumptions in {elapsed:.3f} s")
    _print_assumed(ranged)
    report["grids"] = _grid_lines(results, workload, cluster, base, args.schedule)
    for line in report["grids"]:
        print(line)
    png = plot_path(args.plot, args.out, args.json)
    if png is not None:
        plot_efficiency(results, png, f"{workload.name}, {args.precision}, batch "
                        f"{args.batch_per_gpu}/GPU, {ips:g} {workload.unit}/s/GPU, cluster {cluster.name}",
                        cluster.backend)
        print(f"wrote {png.resolve()}")
    else:
        print("no plot written: add --plot PATH, --out DIR or --json PATH")
    report["sweep_seconds"] = elapsed
    return ranged


def _breakdowns(args, workload, cluster, base: SimConfig, algos: list[str], ips: float, ips_range,
                report: dict):
    """One GPU count: each algorithm's breakdown over the assumptions' ranges, with its grid."""
    ranged = runs_over_ranges(
        lambda c, rate: [simulate(workload, c, _scheduled(replace(base, images_per_s=rate), a, args.schedule))
                         for a in algos], cluster, ips, ips_range, args.precision, workload.unit)
    report["grids"] = []
    for i, r in enumerate(ranged.runs):
        _print_breakdown(r, ranged, i, workload.unit)
        for line in _grid_lines([r], workload, cluster, base, args.schedule):
            print(f"  {line}")
            report["grids"].append(line)
    _print_assumed(ranged)
    return ranged


def _checked_inputs(args, cluster):
    """``(workload, images/s, its range, algorithms, base SimConfig)``: every input of a simulation
    checked before the first line of output, by the rules `flashsgd plan` reads (the GPU counts:
    :meth:`~flashsgd.sim.network.ClusterModel.check_gpus`; the compute rate and its range) and the
    catalog's (the exchange options, in :class:`SimConfig`)."""
    for gpus in args.sweep_gpus or [args.gpus]:
        cluster.check_gpus(gpus)  # whole nodes, at most the cluster file's nodes, MAX_GPUS
    workload = get_workload(args.model)
    choice = rate_choice(args, cluster, workload)  # plan's rules: the same defaults, ranges and sources
    ips, ips_range = choice.rate, choice.range
    args._rate = choice
    algos = _algorithms(args.comm)
    base = SimConfig(algorithm=algos[0], gpus=args.gpus, images_per_s=ips,
                     batch_per_gpu=args.batch_per_gpu, precision=args.precision,
                     bucket_mb=args.bucket_mb, groups=tuple(args.groups) if args.groups else None,
                     grad_accum=args.grad_accum, fusion_mb=args.fusion_mb, cycle_ms=args.cycle_ms,
                     grid=_grid(args.grid, args.sweep_gpus or [args.gpus]), density=args.density,
                     index_bytes=args.index_bytes, node_split=args.node_split,
                     matrix_approximation_rank=args.matrix_approximation_rank)
    bucket_bounds(workload.numels, BYTES[args.precision], args.bucket_mb, base.groups)  # --groups' sum
    return workload, ips, ips_range, algos, base


def _write_json(path: str | None, report: dict) -> None:
    if path:
        Path(path).parent.mkdir(parents=True, exist_ok=True)
        with open(path, "w") as fh:
            json.dump(report, fh, indent=2, default=str)
        print(f"wrote {Path(path).resolve()}")
