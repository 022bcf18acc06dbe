"""`flashsgd bench emulate`: run a benchmark on an emulated cluster of bandwidth-limited nodes.

Loopback on one machine has no network bottleneck. This command builds a cluster of network
namespaces joined by a bridge, with each node's link capped by ``tbf`` and, with ``--flow-rate``,
each TCP flow leaving a node capped below it, and with ``--switches S`` the nodes spread over S
edge switches whose uplinks to a core are capped at ``--uplink`` (see :mod:`flashsgd.emulate.netns`,
:mod:`flashsgd.emulate.flows`), starts ``RANKS`` ranks in each node (one process per rank, torchrun's
environment, ``GLOO_SOCKET_IFNAME`` = the node's interface), runs the benchmark given after ``--``
and reads rank 0's JSON on the host. It always tears the cluster down (errors, Ctrl-C, SIGTERM; a
setup left by a crashed run is removed at the next start; Ctrl-C ends it with one line and exit
status 130). Needs root and iproute2.

Steps:

1. Parse the shape, link rate and fabric (``--switches``, ``--uplink``, ``--placement``); check
   root, ``ip``, ``tc`` and namespaces (exit 2 if missing).
2. Build the cluster.
3. Run the benchmark (``python -m flashsgd bench <args> --json <tmp>``) on every rank; without a benchmark,
   run the built-in probe (all-reduce with a correctness check) as the benchmark.
4. Probe: one all-reduce per dense algorithm (:data:`flashsgd.comm.dense.ALLREDUCE`) at ``--probe-mb`` with the links' byte counters read
   before and after, giving the link bytes each algorithm moves per message byte.
5. Tear down; add the physical bound 2(N-1)/N * S / B, each row's fraction of it, the simulator's
   wire time on these links (:func:`flashsgd.emulate.report.wire_s`), the per-node / per-link
   bandwidth used and, with a flow cap, the flows each node sent on; print the table; write the
   JSON (``--json``; with switches, ``meta.emulated`` also holds the fabric and the bytes each
   uplink carried during the benchmark). The bound is the nodes' links' alone; ``wire_ms`` goes
   through the switches (:func:`flashsgd.emulate.report.emulated_fabric`).

Example::

    $ flashsgd bench emulate --cluster 4x2 --link 1gbit --json out.json -- \\
          allreduce --comm native,ring,hierarchical,torus2d --sizes 1M,10M,100M
    $ flashsgd bench emulate --cluster 2x2 --link 200mbit          # self-check only
    $ flashsgd bench emulate --cluster 4x2 --link 400mbit --flow-rate 100mbit \\
          --probe-comm ring,torus2d --sizes-mb 64,100                # one flow: a quarter of the NIC
    $ flashsgd bench emulate --cluster 4x1 --link 100mbit --switches 2 --uplink 100mbit \\
          --placement interleaved --probe-mb 0 -- sparse --comm topk,gtopk --densities 0.05 \\
          --numel 2000000 --fuse eager --link 100mbit      # 2 nodes per switch, 2:1 oversubscribed
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import shutil
import sys
import tempfile
import time
from pathlib import Path

from flashsgd.cli_flags import comm_list
from flashsgd.comm.dense import ALLREDUCE
from flashsgd.emulate.netns import (PLACEMENTS, ClusterSpec, EmulationUnavailable, check_available,
                                    burst_bytes, emulated_cluster, parse_flow_rate, parse_rate, parse_shape,
                                    switch_layout)
from flashsgd.emulate.ranks import RankError, run_ranks
from flashsgd.emulate.report import annotate, emulated_fabric, format_table
from flashsgd.fmt import plural
from flashsgd.outputs import add_output

HELP = "run a benchmark on an emulated cluster (network namespaces, tbf-capped links; needs root)"


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--cluster", default="2x2", help="NODESxRANKS, e.g. 4x2 (default 2x2)")
    parser.add_argument("--link", default="1gbit", help="each node's link rate, e.g. 1gbit, 200mbit, 10gbit")
    parser.add_argument("--flow-rate", default=None, metavar="RATE",
                        help="the most one TCP flow (connection) sends from a node: a rate as --link "
                             "(250mbit) or a fraction of the link (1/4); default: one flow can fill the link")
    parser.add_argument("--switches", type=int, default=1, metavar="N",
                        help="edge switches the nodes are spread over, 1..nodes, joined through a core "
                             "(default 1: every node on one switch, no uplinks)")
    parser.add_argument("--uplink", default=None, metavar="RATE",
                        help="each edge switch's uplink to the core, a rate as --link, both directions; "
                             "required with --switches > 1")
    parser.add_argument("--placement", default="ordered", choices=PLACEMENTS,
                        help="which switch node i is on with --switches S: ordered = i // (nodes / S) "
                             "(consecutive nodes share a switch), interleaved = i %% S, random = a shuffle "
                             "seeded by --placement-seed (default ordered)")
    parser.add_argument("--placement-seed", type=int, default=0, metavar="N",
                        help="--placement random: the shuffle's seed, >= 0 (default 0)")
    parser.add_argument("--subnet", default="10.213.0.0/24", help="private /24 for the namespaces")
    add_output(parser, "--json", default=None, help="write the annotated results here")
    parser.add_argument("--probe-mb", type=float, default=8.0,
                        help="message size (MiB, 2**20 bytes) of the link-byte probe; 0 disables the probe")
    parser.add_argument("--probe-comm", default=None, metavar="NAME[,NAME...]",
                        help=f"all-reduce algorithms of the probe, comma-separated, from "
                             f"{', '.join(ALLREDUCE.names())} (default: those in the results, or "
                             "'native' without a benchmark)")
    parser.add_argument("--sizes-mb", default="1,10",
                        help="sizes (MiB, comma-separated) of the built-in probe benchmark when no "
                             "benchmark is given")
    parser.add_argument("--timeout-s", type=float, default=900.0,
                        help="deadline per launch, seconds (default 900)")
    parser.add_argument("--logs", default=None,
                        help="keep per-rank logs here (default: a temp dir, removed after a successful run)")
    parser.add_argument("bench", nargs=argparse.REMAINDER,
                        help="-- BENCHMARK [ARGS...]: the flashsgd bench command to run on the cluster")


def _fabric_line(spec: ClusterSpec) -> str:
    """The header's words for the switches ('' with one switch)."""
    if spec.switches == 1:
        return ""
    layout = switch_layout(spec)
    counts = "/".join(str(layout.count(j)) for j in range(spec.switches)) + " nodes"
    drawn = spec.placement == "random"  # then which switch each node drew
    label = f"random, seed {spec.placement_seed}" if drawn else spec.placement
    each = "; node i on switch " + " ".join(map(str, layout)) if drawn else ""
    return f"; {spec.switches} edge switches ({label}: {counts}{each}), uplinks {spec.uplink_bps / 1e9:g} Gbit/s to a core"


def _launch(cluster, module_args: list[str], log_dir: Path, timeout_s: float) -> float:
    return run_ranks(cluster, [sys.executable, "-m", *module_args], log_dir, timeout_s=timeout_s)


def _probe(cluster, algorithms: str, sizes_mb: str, out: Path, log_dir: Path, timeout_s: float,
           warmup: int, reps: int) -> dict:
    _launch(cluster, ["flashsgd.emulate.probe", "--comm", algorithms, "--sizes-mb", sizes_mb,
                      "--warmup", str(warmup), "--reps", str(reps), "--json", str(out)], log_dir, timeout_s)
    return json.loads(out.read_text())


def _measure(spec: ClusterSpec, bench: list[str], args: argparse.Namespace, work: Path,
             log_dir: Path) -> tuple[dict, dict | None, float, list[dict], list[dict]]:
    """Steps 2-4: build, run the benchmark and the probe, tear down (always, by the context manager).

    Returns (benchmark JSON, probe JSON or None, benchmark wall seconds, per-node link bytes,
    per-edge-switch uplink bytes (empty with one switch)), the bytes counted over the benchmark.
    """
    # Step 2: build (torn down by the context manager, whatever happens)
    with emulated_cluster(spec) as cluster:
        before, up_before = cluster.link_bytes(), cluster.uplink_bytes()
        # Step 3: the benchmark
        if bench:
            out = work / "bench.json"
            wall = _launch(cluster, ["flashsgd", "bench", *bench, "--json", str(out)], log_dir / "bench",
                           args.timeout_s)
            if not out.exists():
                raise ValueError(f"'flashsgd bench {bench[0]}' wrote no JSON at {out} "
                                 "(it must accept --json PATH and write it on rank 0)")
            doc = json.loads(out.read_text())
        else:
            t0 = time.monotonic()
            doc = _probe(cluster, args.probe_comm or "native", args.sizes_mb, work / "bench.json",
                         log_dir / "bench", args.timeout_s, warmup=1, reps=3)
            wall = time.monotonic() - t0
        after, up_after = cluster.link_bytes(), cluster.uplink_bytes()
        run_bytes = [{k: a[k] - b[k] for k in a} for a, b in zip(after, before)]
        up_bytes = [{k: a[k] - b[k] for k in a} for a, b in zip(up_after, up_before)]
        # Step 4: link bytes per message byte of each dense algorithm
        if not bench:
            return doc, doc, wall, run_bytes, up_bytes
        present = sorted({r.get("algorithm") for r in doc.get("results", [])} & set(ALLREDUCE))
        algos = args.probe_comm or ",".join(present)
        probe_doc = None
        if args.probe_mb > 0 and algos:
            probe_doc = _probe(cluster, algos, f"{args.probe_mb:g}", work / "probe.json",
                               log_dir / "probe", args.timeout_s, warmup=0, reps=1)
        return doc, probe_doc, wall, run_bytes, up_bytes


def _spec(args: argparse.Namespace) -> ClusterSpec:
    """Step 1's cluster: shape, link, flow cap and fabric; ValueError naming the flag and what is valid."""
    nodes, rpn = parse_shape(args.cluster)
    link = parse_rate(args.link)
    if not 1 <= args.switches <= nodes or nodes % args.switches:
        valid = ", ".join(str(d) for d in range(1, nodes + 1) if nodes % d == 0)
        raise ValueError(f"--switches must divide the {nodes} nodes of --cluster {args.cluster} (as many nodes on "
                         f"every edge switch), got {args.switches}; valid: {valid}")
    if args.switches > 1 and args.uplink is None:
        raise ValueError(f"--uplink RATE (each edge switch's uplink, e.g. 100mbit) is required with "
                         f"--switches {args.switches}")
    if args.switches == 1 and args.uplink is not None:
        raise ValueError(f"--uplink applies only with --switches 2..{nodes} (one switch has no uplink), "
                         f"got --uplink {args.uplink} with --switches 1")
    try:
        uplink = None if args.uplink is None else parse_rate(args.uplink)
    except ValueError as exc:
        raise ValueError(f"--uplink: {exc}") from None
    return ClusterSpec(nodes, rpn, link, subnet=args.subnet, flow_rate_bps=parse_flow_rate(args.flow_rate, link),
                       switches=args.switches, uplink_bps=uplink, placement=args.placement,
                       placement_seed=args.placement_seed)


def _add_fabric(emulated: dict, spec: ClusterSpec, uplink: str, up_bytes: list[dict]) -> None:
    """Step 5, with switches: the fabric and the bytes each uplink carried, into ``meta.emulated``."""
    emulated.update({"switches": spec.switches, "uplink_bps": spec.uplink_bps, "uplink": uplink,
                     "placement": spec.placement, "placement_seed": spec.placement_seed,
                     "node_switch": switch_layout(spec),
                     "run_uplink_bytes": up_bytes})
    emulated["shaping"] += (f"; {spec.switches} edge switches joined through a core bridge, each uplink tbf rate "
                            f"{spec.uplink_bps}bit burst {burst_bytes(spec.uplink_bps)} latency "
                            f"{spec.latency_ms:g}ms on both ends")


def run(args: argparse.Namespace) -> int:
    # Step 1: inputs and preconditions
    try:
        spec = _spec(args)
        nodes, rpn = spec.nodes, spec.ranks_per_node
        if args.probe_comm is not None:
            comm_list(args.probe_comm, ALLREDUCE.names(), "--probe-comm")
        if not args.timeout_s > 0 or args.timeout_s == float("inf"):
            raise ValueError(f"--timeout-s must be a finite number of seconds > 0, got {args.timeout_s:g}")
        if not args.probe_mb >= 0 or args.probe_mb == float("inf"):
            raise ValueError(f"--probe-mb must be a size in MiB >= 0 (0: no probe), got {args.probe_mb:g}")
        bench = list(args.bench)
        if bench and bench[0] == "--":
            bench = bench[1:]
        if bench:  # the benchmark must exist before a cluster is built for it
            from flashsgd.bench.cli import BENCHMARKS

            if bench[0] not in BENCHMARKS or bench[0] == "emulate":
                valid = ", ".join(n for n in BENCHMARKS if n != "emulate")
                raise ValueError(f"the benchmark to run must be one of {valid}, got {bench[0]!r}")
    except ValueError as exc:
        print(f"flashsgd bench emulate: {exc}", file=sys.stderr)
        return 2
    try:
        check_available()
    except EmulationUnavailable as exc:
        print(f"flashsgd bench emulate: cannot emulate a cluster here: {exc}", file=sys.stderr)
        return 2
    work = Path(tempfile.mkdtemp(prefix="flashsgd-emulate-"))
    log_dir = Path(args.logs) if args.logs else work / "logs"
    per_flow = ("" if spec.flow_rate_bps is None
                else f", one flow at most {spec.flow_rate_bps / 1e9:g} Gbit/s (htb per flow)")
    print(f"emulated cluster: {plural(nodes, 'node')} x {plural(rpn, 'rank')}, links {spec.rate_bps / 1e9:g} Gbit/s "
          f"(tbf burst {spec.burst_bytes} B){per_flow}{_fabric_line(spec)}", flush=True)
    started = time.time()
    try:
        doc, probe_doc, wall, run_bytes, up_bytes = _measure(spec, bench, args, work, log_dir)
    except (RankError, ValueError) as exc:
        print(f"flashsgd bench emulate: {exc}\n(per-rank logs kept in {log_dir})", file=sys.stderr)
        return 1
    except KeyboardInterrupt:  # Ctrl-C: the ranks were killed and the cluster torn down on the way out
        print(f"flashsgd bench emulate: interrupted; emulated cluster torn down (per-rank logs kept in "
              f"{log_dir})", file=sys.stderr)
        return 130  # 128 + SIGINT, the shell's convention
    shutil.rmtree(work, ignore_errors=True)  # success: only --logs, if given, is kept
    # Step 5: annotate, report
    bad = [r for r in (probe_doc or {}).get("results", []) if not r.get("correct", True)]
    meta = doc.setdefault("meta", {})
    meta.setdefault("ranks_per_node", rpn)
    meta["emulated"] = {
        "nodes": nodes, "ranks_per_node": rpn, "link_bps": spec.rate_bps, "link": args.link,
        "shaping": f"tbf rate {spec.rate_bps}bit burst {spec.burst_bytes} latency {spec.latency_ms:g}ms "
                   "on both ends of each node's veth" + (
                       "" if spec.flow_rate_bps is None else
                       f"; under the upload's tbf, htb ceil {spec.flow_rate_bps}bit per TCP flow "
                       "(flow buckets by a BPF port hash, flashsgd.emulate.flows)"),
        "flow_bps": spec.flow_rate_bps,
        "subnet": spec.subnet, "bench_argv": bench, "bench_wall_s": wall,
        "run_link_bytes": run_bytes,
        "probe_mb": args.probe_mb if bench else None,
        "host": {"cpus": os.cpu_count(), "machine": platform.machine(), "kernel": platform.release(),
                 "python": platform.python_version()},
        "elapsed_s": time.time() - started,
    }
    if spec.switches > 1:
        _add_fabric(meta["emulated"], spec, args.uplink, up_bytes)
    annotate(doc, nodes, spec.rate_bps, probe_doc, flow_bps=spec.flow_rate_bps,
             fabric=emulated_fabric(nodes, spec.switches, spec.rate_bps, spec.uplink_bps or 0, spec.placement))
    print(format_table(doc))
    if args.json:
        Path(args.json).parent.mkdir(parents=True, exist_ok=True)
        Path(args.json).write_text(json.dumps(doc, indent=1))
        print(f"wrote {args.json}")
    if bad:
        print(f"flashsgd bench emulate: WRONG all-reduce result for {[r['algorithm'] for r in bad]}",
              file=sys.stderr)
        return 1
    return 0
