"""`flashsgd bench scaling`: real training steps on an emulated slow cluster, per node count and hook.

What the scaling figures of the papers plot (Shi et al. 2019, arXiv 1901.04359, Fig. 6: scaling
efficiency vs nodes per algorithm on 1 GbE), measured here with the trainer's own step
(:mod:`flashsgd.bench.scaling_rank`: model, data, recipe optimizer, DDP + hook) on an emulated
cluster of network namespaces with tbf-capped links (:mod:`flashsgd.emulate.netns`). Needs root
and iproute2, as ``flashsgd bench emulate``.

Algorithm (:func:`run`):

1. Settings (``--quick``: 1 and 2 nodes, fewer and smaller steps), the hooks (default: every name in
   ``flashsgd.comm.hooks.HOOKS``, ``noop`` first: it is each node count's ceiling, and ``auto``
   last: ``train --comm auto``'s choice, planned on the spot, beside them); check root,
   ``ip``, ``tc`` and namespaces (exit 2 with the reason when missing).
2. Node counts from the largest down. Link rate: ``--link RATE``, or with ``--comm-compute R`` the
   rate at which a dense ring all-reduce of the gradient (2(W-1)/W x S bytes on each node's link)
   takes R times the noop step at the largest node count, measured first on a fast link
   (:func:`noop_probe`, :func:`choose_rate`); with ``--link-follows-cpu`` every other node count
   gets that rate x noop(largest) / noop(N), each from its own probe. The chosen rates are printed.
   ``--flow-rate`` (a rate, or a fraction of the link such as ``1/4``): the most one TCP flow may
   send from a node (:attr:`flashsgd.emulate.netns.ClusterSpec.flow_rate_bps`; :func:`flashsgd.emulate.netns.parse_flow_rate`).
3. Per node count: build the cluster; hooks whose dense all-reduce would outlast the collective
   timeout at this rate are skipped with the reason; the others run in one job (rank 0 writes each
   hook's row as it finishes). A job that fails or passes its deadline marks the hook it was on as
   failed (with the rank's log tail) and the remaining hooks run in a new job. The cluster is torn
   down whatever happens (errors, Ctrl-C, SIGTERM).
4. Rows: step time (median, min..max over steps of the slowest rank), samples/s, compute (the noop
   step at the same node count; with ``--grad-accum K`` every timed step is K micro-batches of
   ``--batch`` samples per rank with one exchange, the trainer's accumulation, noop included),
   exposed communication (step - compute), compression (sparse
   hooks' selection, timed apart), scaling efficiency vs noop at the same N and vs one node
   (:mod:`flashsgd.bench.scaling_report`); each row records ``link_bps``, ``flow_bps`` (None: no
   per-flow cap) and ``grad_accum``. A row whose slowest step beat the noop's fastest contradicts
   its baseline (load slowed the noop more: :func:`flashsgd.sim.scaling.baseline_contradiction`):
   ``contradicts_baseline`` and its evidence in the JSON, ``!`` and a footnote in the table.
5. Simulator: :func:`flashsgd.sim.scaling.fit` on the calibration rows (those that contradict
   their baseline left out, and counted), prediction of every row; table, JSON (``--json``), plot
   of efficiency vs nodes with the prediction beside each line.

Example::

    flashsgd bench scaling --comm-compute 2 --json docs/data/scaling.json     # 1,2,4,8 nodes x 1
    flashsgd bench scaling --nodes 4 --ranks-per-node 2 --comm-compute 2 --comm noop,native,torus2d
    flashsgd bench scaling --quick --link 100mbit
    flashsgd bench scaling --nodes 2,4 --ranks-per-node 2 --link 100mbit --flow-rate 1/4 --grad-accum 4
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import sys
import tempfile
import time
from pathlib import Path

from flashsgd.bench import scaling_rank
from flashsgd.cli_flags import add_option_flag
from flashsgd.comm.hooks import HOOKS
from flashsgd.emulate.netns import (ClusterSpec, EmulationUnavailable, check_available,
                                    emulated_cluster, parse_flow_rate, parse_rate)
from flashsgd.emulate.ranks import MASTER_PORT, RankError, run_ranks
from flashsgd.emulate.report import wire_s
from flashsgd.exchanges import BUCKET_MB, COMPUTE_ONLY
from flashsgd.fmt import size
from flashsgd.outputs import add_output

HELP = "training steps per hook on an emulated cluster of 1..N nodes: efficiency vs nodes, with the simulator"
AUTO = "auto"  # the trainer's --comm auto: its choice is measured beside every hook
FAST_LINK_BPS = 10 ** 10  # the link of the --comm-compute measurement (noop sends nothing)
QUICK = {"nodes": "1,2", "warmup": 2, "iters": 3, "batch": 16}
FULL = {"nodes": "1,2,4,8", "warmup": 3, "iters": 12, "batch": 32}


def _ints(text: str) -> list[int]:
    try:
        out = sorted({int(v) for v in text.split(",") if v.strip()})
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected comma-separated node counts, got {text!r}") from None
    if not out or out[0] < 1:
        raise argparse.ArgumentTypeError(f"node counts must be >= 1, got {text!r}")
    return out


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--nodes", type=_ints, default=None, help="node counts (default 1,2,4,8; --quick 1,2)")
    parser.add_argument("--ranks-per-node", type=int, default=1, help="ranks per node (N x R clusters)")
    parser.add_argument("--comm", default=None,
                        help="comma-separated hooks (default: every hook in flashsgd.comm.hooks.HOOKS)")
    link = parser.add_mutually_exclusive_group()
    link.add_argument("--link", default=None, help="each node's link rate, e.g. 100mbit, 1gbit")
    link.add_argument("--comm-compute", type=float, default=None, metavar="R",
                      help="choose the link so that dense ring all-reduce takes R x the noop step at the "
                           "largest node count (default 2 when --link is not given)")
    parser.add_argument("--link-follows-cpu", action="store_true",
                        help="with --comm-compute: at N nodes use the link rate x noop(largest N) / noop(N), "
                             "so link time / compute is what a cluster of whole machines would have at every "
                             "N (ranks here share the cores: compute per rank grows with N)")
    parser.add_argument("--flow-rate", default=None, metavar="RATE",
                        help="the most one TCP flow (connection) may send from a node: a rate as --link "
                             "(25mbit) or a fraction of the link (1/4); default: one flow can fill the link")
    parser.add_argument("--grad-accum", type=int, default=1, metavar="K",
                        help="micro-batches of --batch per timed step, gradients exchanged once after the "
                             "last (the trainer's --grad-accum: DDP no_sync on the first K-1); default 1")
    parser.add_argument("--model", default="resnet20", help="a name in flashsgd.train.models.MODELS")
    parser.add_argument("--dataset", default="synthetic", help="the trainer's data.dataset")
    parser.add_argument("--image-shape", default="cifar", help="synthetic input: cifar or imagenet")
    parser.add_argument("--channels", type=int, default=32, help="mnist1d_cnn width")
    parser.add_argument("--batch", type=int, default=None, help="per-rank batch (default 32; --quick 16)")
    parser.add_argument("--recipe", default="fujitsu", help="a name in flashsgd.optim.recipes.RECIPES")
    add_option_flag(parser, "density")
    add_option_flag(parser, "selection")
    parser.add_argument("--bucket-mb", type=float, default=BUCKET_MB, help="DDP bucket cap (MiB)")
    parser.add_argument("--warmup", type=int, default=None, help="untimed steps per hook (>= 2)")
    parser.add_argument("--iters", type=int, default=None, help="timed steps per hook")
    parser.add_argument("--threads", type=int, default=1, help="torch threads per rank")
    parser.add_argument("--timeout-s", type=float, default=120.0,
                        help="deadline of every collective, seconds: longer all-reduces are skipped")
    parser.add_argument("--quick", action="store_true", help="1 and 2 nodes, 2+3 steps of batch 16")
    add_output(parser, "--json", default=None, help="write rows, predictions and settings here")
    add_output(parser, "--plot", default=None, help="efficiency plot (default: next to --json, .png)")
    parser.add_argument("--logs", default=None, help="keep per-rank logs here")
    parser.add_argument("--subnet", default="10.214.0.0/24", help="private /24 for the namespaces")


def default_comms() -> list[str]:
    """Every registered hook, ``noop`` first (the ceiling); one that cannot run at a node count
    is reported there as skipped, with the reason."""
    return [COMPUTE_ONLY] + [n for n in HOOKS.names() if n != COMPUTE_ONLY] + [AUTO]


def settings(args: argparse.Namespace) -> dict:
    """Step 1: the spec every rank reads; ValueError naming a bad value."""
    base = QUICK if args.quick else FULL
    pick = lambda name: getattr(args, name) if getattr(args, name) is not None else base[name]  # noqa: E731
    comms = [c.strip() for c in args.comm.split(",") if c.strip()] if args.comm else default_comms()
    for c in comms:
        if c != AUTO:
            HOOKS.get(c)  # ValueError listing the known names
    if COMPUTE_ONLY not in comms:
        comms = [COMPUTE_ONLY] + comms  # each node count's ceiling (efficiency = noop step / step)
    spec = {"nodes": args.nodes or _ints(base["nodes"]),
            "ranks_per_node": args.ranks_per_node, "comms": list(dict.fromkeys(comms)),
            "warmup": pick("warmup"), "iters": pick("iters"), "batch": pick("batch"),
            "model": args.model, "dataset": args.dataset, "image_shape": args.image_shape,
            "channels": args.channels, "recipe": args.recipe, "density": args.density,
            "selection": args.selection, "bucket_mb": args.bucket_mb, "threads": args.threads,
            "timeout_s": args.timeout_s, "grad_accum": args.grad_accum, "flow_rate": args.flow_rate}
    if spec["warmup"] < 2:
        raise ValueError(f"--warmup must be >= 2 (DDP rebuilds buckets after step 1, sparse hooks "
                         f"compress from step 3), got {spec['warmup']}")
    for key in ("iters", "batch", "ranks_per_node", "threads", "grad_accum"):
        if spec[key] < 1:
            raise ValueError(f"--{key.replace('_', '-')} must be >= 1, got {spec[key]}")
    if args.timeout_s <= 0:
        raise ValueError(f"--timeout-s must be > 0 seconds, got {args.timeout_s}")
    if args.comm_compute is not None and not args.comm_compute > 0:
        raise ValueError(f"--comm-compute must be > 0, got {args.comm_compute}")
    # the form now; against the link once it is known (--link: here, --comm-compute: when chosen)
    parse_flow_rate(args.flow_rate, parse_rate(args.link) if args.link else FAST_LINK_BPS)
    return spec


def ring_link_bytes(grad_bytes: float, world: int) -> float:
    """Bytes a dense ring all-reduce puts on each node's link: 2(W-1)/W x S (Patarasuk & Yuan 2009)."""
    return 2 * (world - 1) / world * grad_bytes


def choose_rate(grad_bytes: float, world: int, noop_step_s: float, ratio: float) -> int:
    """Link rate (bit/s) at which a dense ring all-reduce takes ``ratio`` x the noop step."""
    if world < 2:
        raise ValueError("--comm-compute needs a largest node count with >= 2 ranks (nothing is "
                         "communicated on one rank)")
    return max(int(ring_link_bytes(grad_bytes, world) * 8 / (ratio * noop_step_s)), 10 ** 5)


class Progress:
    """tqdm bar over all steps of the run, advanced from the rank-0 progress file of each job
    (one line, the hook's name, per step started)."""

    def __init__(self, total: int) -> None:
        from tqdm import tqdm

        self.bar = tqdm(total=total, unit="step", dynamic_ncols=True, file=sys.stderr)
        self.file: Path | None = None
        self.seen = 0

    def watch(self, file: Path, label: str) -> None:
        self.file, self.seen = file, 0
        self.bar.set_description(label)

    def lines(self) -> list[str]:
        try:
            return self.file.read_text().split() if self.file else []
        except OSError:
            return []

    def poll(self) -> None:
        n = len(self.lines())
        if n > self.seen:
            self.bar.update(n - self.seen)
            self.seen = n

    def running(self) -> str | None:
        """The hook whose step was started last (the one a failed job was on)."""
        lines = self.lines()
        return lines[-1] if lines else None

    def skip(self, steps: int) -> None:
        self.bar.update(steps)


def _job_deadline(spec: dict, comms: list[str], est_comm_s: float) -> float:
    """Seconds a job may take: start-up plus 4x the steps at a generous step estimate (2 s of
    compute per micro-batch)."""
    steps = (spec["warmup"] + spec["iters"]) * len(comms)
    return 120.0 + 4 * steps * (2.0 * spec["grad_accum"] + 2 * est_comm_s)


def run_node_count(spec: dict, nodes: int, rate_bps: int, comms: list[str], work: Path,
                   log_dir: Path, progress: Progress, grad_bytes: float | None) -> list[dict]:
    """Step 3: every hook of ``comms`` at ``nodes`` nodes; returns their rows."""
    rpn = spec["ranks_per_node"]
    world = nodes * rpn
    flow_bps = parse_flow_rate(spec["flow_rate"], rate_bps)
    # the simulator's wire time of a dense ring on these links (its one flow per node, the cap)
    est = (wire_s("ring", grad_bytes, world, nodes, rate_bps, flow_bps) or 0.0) if grad_bytes else 0.0
    rows = []
    if est > spec["timeout_s"]:
        slow = [c for c in comms if c != COMPUTE_ONLY]
        flow = f" (one flow at most {flow_bps / 1e6:g} Mbit/s)" if flow_bps else ""
        for c in slow:
            rows.append({"comm": c, "skipped": f"a dense all-reduce of {size(grad_bytes)} at "
                         f"{rate_bps / 1e6:g} Mbit/s{flow} takes ~{est:.0f} s, over the collective timeout "
                         f"--timeout-s {spec['timeout_s']:g} s: raise --timeout-s or the link rate"})
            progress.skip(spec["warmup"] + spec["iters"])
        comms = [c for c in comms if c == COMPUTE_ONLY]
    shape = ClusterSpec(nodes, rpn, rate_bps, subnet=spec["subnet"], flow_rate_bps=flow_bps)
    with emulated_cluster(shape) as cluster:
        attempt = 0
        while comms:
            out = work / f"n{nodes}-{attempt}.json"
            (work / "spec.json").write_text(json.dumps({**spec, "comms": comms, "out_dir": str(work)}))
            progress.watch(Path(str(out) + ".progress"), f"{nodes}x{rpn}")
            try:
                run_ranks(cluster, [sys.executable, "-m", "flashsgd.bench.scaling_rank",
                                    str(work / "spec.json"), str(out)], log_dir / f"n{nodes}-{attempt}",
                          timeout_s=_job_deadline(spec, comms, est), port=MASTER_PORT + attempt,
                          poll=progress.poll)
                error = None
            except RankError as exc:
                error = str(exc)
            if error is None:
                rows += json.loads(out.read_text())["rows"]
                break
            # the job's hooks are all measured together: drop the one it failed on, rerun the rest
            failed = progress.running() or comms[0]
            rows.append({"comm": failed, "error": error[-1500:]})
            comms = [c for c in comms if c != failed]
            progress.bar.total += progress.seen - (spec["warmup"] + spec["iters"])  # rerun, minus the failed
            attempt += 1
    for r in rows:
        r.update(nodes=nodes, ranks_per_node=rpn, world=world, link_bps=rate_bps, flow_bps=flow_bps,
                 grad_accum=spec["grad_accum"])
    return rows


class ChosenLinkError(ValueError):
    """A setting that is wrong only at the link rate ``--comm-compute`` chose (``--flow-rate`` above
    it): a usage error (exit 2), found before anything is measured."""


def measure(spec: dict, args: argparse.Namespace, work: Path, log_dir: Path) -> tuple[list, dict, int, dict]:
    """Steps 2-3 over all node counts (largest first).

    Returns (rows, model info, link rate at the largest node count in bit/s, the noop probes of
    --comm-compute: {nodes: probe}).
    """
    nodes = sorted(spec["nodes"], reverse=True)
    per_comm = spec["warmup"] + spec["iters"]
    probes_planned = 0 if args.link else (sum(n > 1 for n in nodes) if args.link_follows_cpu else 1)
    progress = Progress((len(nodes) * len(spec["comms"]) + probes_planned) * per_comm)
    info = scaling_rank.model_info({**spec, "out_dir": str(work)})
    grad_bytes = 4 * info["params"]  # fp32 gradients
    rows, probes = [], {}
    top = parse_rate(args.link) if args.link else None
    try:
        for n in nodes:
            rate = top
            if top is None:  # Step 2: --comm-compute R, from the noop step at the largest N
                probes[n] = noop_probe(spec, n, work, log_dir, progress)
                top = rate = choose_rate(grad_bytes, n * spec["ranks_per_node"], probes[n]["noop_median_s"],
                                         args.comm_compute)
                try:  # --flow-rate RATE may be above the link --comm-compute chose: known only now
                    parse_flow_rate(spec["flow_rate"], rate)
                except ValueError as exc:
                    raise ChosenLinkError(str(exc)) from None
                _say_rate(spec, n, grad_bytes, probes[n]["noop_median_s"], rate, f"--comm-compute {args.comm_compute:g}")
            elif args.link_follows_cpu and n > 1:  # the link shrinks with the CPU share of a rank
                probes[n] = noop_probe(spec, n, work, log_dir, progress)
                largest = probes[max(probes)]["noop_median_s"]
                rate = max(int(top * largest / probes[n]["noop_median_s"]), 10 ** 5)
                _say_rate(spec, n, grad_bytes, probes[n]["noop_median_s"], rate, "--link-follows-cpu")
            if n in probes:
                probes[n]["link_bps"] = rate
            rows += run_node_count(spec, n, rate, spec["comms"], work, log_dir, progress, grad_bytes)
    finally:
        progress.bar.close()
    return rows, info, top, probes


def noop_probe(spec: dict, nodes: int, work: Path, log_dir: Path, progress: Progress) -> dict:
    """Step 2: the noop step at ``nodes`` on a fast link (noop sends nothing).

    It only chooses the rate: the main job measures noop again beside the other hooks (the
    compute of the efficiency), so load drift between jobs biases no row.
    """
    first = run_node_count(spec, nodes, FAST_LINK_BPS, [COMPUTE_ONLY], work, log_dir / f"probe{nodes}", progress, None)
    if "step_s" not in first[0]:
        raise RankError(f"the noop measurement at {nodes} nodes (choosing the link rate) failed: "
                        f"{first[0].get('error') or first[0].get('skipped')}")
    return {"nodes": nodes, "noop_step_s": first[0]["step_s"], "noop_median_s": statistics.median(first[0]["step_s"])}


def _say_rate(spec: dict, nodes: int, grad_bytes: float, noop_s: float, rate: int, why: str) -> None:
    world = nodes * spec["ranks_per_node"]
    ring_s = ring_link_bytes(grad_bytes, world) * 8 / rate
    tqdm_write(f"{why}: noop step {noop_s * 1e3:.1f} ms at {nodes}x{spec['ranks_per_node']}, gradient "
               f"{size(grad_bytes)}, dense ring {size(ring_link_bytes(grad_bytes, world))} per link "
               f"-> link {rate / 1e6:.3f} Mbit/s (ring {ring_s * 1e3:.0f} ms = {ring_s / noop_s:.2f} x compute)")


def tqdm_write(text: str) -> None:
    from tqdm import tqdm

    tqdm.write(text, file=sys.stderr)


def run(args: argparse.Namespace) -> int:
    from flashsgd.bench import scaling_report as report

    try:                                                                            # Step 1
        spec = settings(args)
        if args.link:
            parse_rate(args.link)
        ClusterSpec(1, 1, 10 ** 9, subnet=args.subnet)
    except ValueError as exc:
        print(f"flashsgd bench scaling: {exc}", file=sys.stderr)
        return 2
    if args.link is None and args.comm_compute is None:
        args.comm_compute = 2.0
    if args.link_follows_cpu and args.link:
        print("flashsgd bench scaling: --link-follows-cpu scales the rate chosen by --comm-compute; "
              "drop --link", file=sys.stderr)
        return 2
    spec["subnet"] = args.subnet
    try:
        check_available()
    except EmulationUnavailable as exc:
        print(f"flashsgd bench scaling: cannot emulate a cluster here: {exc}", file=sys.stderr)
        return 2
    work = Path(tempfile.mkdtemp(prefix="flashsgd-scaling-"))
    log_dir = Path(args.logs) if args.logs else work / "logs"
    started, load0 = time.time(), os.getloadavg()
    try:                                                                            # Steps 2-3
        rows, info, rate, probes = measure(spec, args, work, log_dir)
    except RankError as exc:
        print(f"flashsgd bench scaling: {exc}\n(per-rank logs kept in {log_dir})", file=sys.stderr)
        return 1
    except ChosenLinkError as exc:  # settings wrong only at the rate --comm-compute chose
        print(f"flashsgd bench scaling: {exc}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        print(f"flashsgd bench scaling: interrupted; emulated cluster torn down (logs in {log_dir})",
              file=sys.stderr)
        return 130
    if not args.logs:
        shutil.rmtree(work, ignore_errors=True)
    spec["flow_bps"] = parse_flow_rate(args.flow_rate, rate)  # at the largest node count, as link_bps
    if args.json:  # the measurements first: nothing below can lose them
        Path(args.json).parent.mkdir(parents=True, exist_ok=True)
        Path(args.json).write_text(json.dumps({"meta": {**spec, "link_bps": rate}, "rows": rows}, indent=1))
    doc = report.build_document(spec, rows, info, rate, args, started, load0)      # Steps 4-5
    doc["meta"]["noop_probes"] = probes
    doc["meta"]["link_follows_cpu"] = args.link_follows_cpu
    print(report.format_table(doc))
    if args.json:
        Path(args.json).parent.mkdir(parents=True, exist_ok=True)
        Path(args.json).write_text(json.dumps(doc, indent=1))
        print(f"wrote {Path(args.json).resolve()}")
    png = Path(args.plot) if args.plot else (Path(args.json).with_suffix(".png") if args.json else None)
    if png is not None:
        report.plot(doc, png)
        print(f"wrote {png.resolve()}")
    return 0
