"""`flashsgd bench sparse`: Top-k, gTop-k and hierarchical gTop-k against dense all-reduce, split
into phases and set beside the wire time and the memory floor; top-k selection speed.

Exchange mode (default): ``--workers`` ranks (spawned, or under torchrun / ``flashsgd bench emulate``),
each with a random fp32 gradient of ``--numel`` elements (default 25,557,032: ResNet-50). For every
density, interleaved (timing.time_ops: barrier before each call, a call's time is its slowest rank,
median over ``--iters``):

1. ``add``: one ``torch.add`` over the gradient on every rank at once: the unit of a memory pass
   (ranks sharing a core included).
2. ``dense``: ``torch.distributed.all_reduce`` of the whole gradient (native; the baseline).
3. per algorithm (``topk``, ``gtopk``, ``hgtopk`` once per ``--node-splits`` entry, rows named
   ``hgtopk node_split=slices``) and variant (eager, or the add and block maxima
   fused by ``torch.compile``: ``--fuse``): the sparse DDP hook's own step on one bucket, with error
   feedback (:mod:`flashsgd.bench.sparse_steps`; untimed before each call: the gradient copied
   into the bucket): its phases accum / select / exchange / merge / scatter are clocked on rank 0.

Row columns: ``e2e`` (median, min, max), the phase medians, ``passes`` = (accum + select +
scatter) / add (the compression's cost in memory passes), ``wire`` = bytes through the busiest
node link / ``--link`` rate (0 without ``--link``), ``floor`` = FLOOR_PASSES x add + wire (what this
design cannot go below on this machine), ``e2e/floor``, bytes sent per rank (max over ranks), and
``x dense`` = dense time / e2e time in the same run.

Hook mode (``--hook``, :mod:`flashsgd.bench.sparse_hook`): whole DDP training steps of an MLP with
4-5 buckets through each sparse hook, synchronous vs ``threaded=True`` (the exchange on a
communication thread, overlapping the next bucket's selection), beside ``noop`` and ``native``.

Selection mode (``--selection-speed``): one process, a random fp32 vector of ``--numel``, per density:
``torch.add`` (the pass unit), ``torch.topk(|x|)``, the exact / sampled / threshold selections
(threshold with and without reuse), and the compression of one bucket (add + maxima + selection,
eager and compiled); time, speed-up over torch.topk, passes, and the squared mass kept.

Example::

    flashsgd bench emulate --cluster 8x1 --link 1gbit -- sparse --densities 0.001,0.01 --link 1gbit
    flashsgd bench emulate --cluster 4x2 --link 1gbit -- sparse --comm gtopk,hgtopk \
        --node-splits leader,slices,sparse --link 1gbit
    flashsgd bench sparse --selection-speed --fuse both --json runs/selection.json
"""

from __future__ import annotations

import argparse
import os
import statistics
import time
import warnings
from dataclasses import asdict, dataclass, field

import torch
import torch.distributed as dist

from flashsgd.bench.common import (add_run_arguments, check_run_arguments, format_header, format_row,
                                   ranks_on_this_host, run_metadata, write_json)
from flashsgd.bench.sparse_hook import measure_hook
from flashsgd.bench.sparse_steps import (DEFAULT_NODE_SPLIT, FLOOR_PASSES, SparseStep,
                                         step_name, wire_bytes_per_node)
from flashsgd.cli_flags import add_comm_flag, add_option_flag, comm_list
from flashsgd.comm.sparse import SELECTIONS, SelectionWorkspace, k_from_density, validate_density
from flashsgd.comm.sparse.fused import compiled_available, compress_
from flashsgd.comm.sparse.hier import check_node_layout
from flashsgd.comm.sparse.hooks import SPARSE_EXCHANGES
from flashsgd.comm.sparse.select import ThresholdReuse, topk_threshold
from flashsgd.emulate.netns import parse_rate
from flashsgd.exchanges import BUCKET_MB, DEFAULT_DENSITY, NODE_SPLITS, reads
from flashsgd.launch import run as launch_run, under_torchrun
from flashsgd.timing import time_ops

HELP = "time Top-k / gTop-k / hierarchical gTop-k against dense all-reduce, and top-k selection"
RESNET50_NUMEL = 25_557_032

EXCHANGE_COLUMNS = [
    ("algorithm", "algorithm", 16, "s"), ("density", "density", 8, "g"), ("k", "k", 9, "d"),
    ("e2e_ms", "e2e(ms)", 9, ".1f"), ("e2e_ms_min", "min", 8, ".1f"), ("e2e_ms_max", "max", 8, ".1f"),
    ("accum_ms", "accum", 7, ".1f"), ("select_ms", "select", 7, ".1f"),
    ("exchange_ms", "exch", 7, ".1f"), ("merge_ms", "merge", 7, ".1f"), ("scatter_ms", "scat", 7, ".1f"),
    ("passes", "passes", 7, ".2f"), ("wire_ms", "wire", 7, ".1f"), ("floor_ms", "floor", 7, ".1f"),
    ("e2e_over_floor", "e2e/fl", 7, ".2f"), ("bytes_per_rank", "bytes/rank", 11, "d"),
    ("ratio_to_dense", "x dense", 8, ".2f"),
]
SELECTION_COLUMNS = [
    ("method", "method", 20, "s"), ("density", "density", 9, "g"), ("k", "k", 10, "d"),
    ("time_ms", "time(ms)", 10, ".1f"), ("time_ms_min", "min", 9, ".1f"),
    ("time_ms_max", "max", 9, ".1f"), ("passes", "passes", 7, ".2f"),
    ("speedup_vs_torch_topk", "x topk", 8, ".2f"), ("l2_mass_kept", "L2 kept", 9, ".4f"),
]


@dataclass
class SparseBenchConfig:
    """What one run measures (the same on every rank)."""

    numel: int = RESNET50_NUMEL
    """Gradient elements per rank (fp32)."""
    densities: list[float] = field(default_factory=lambda: [DEFAULT_DENSITY])
    algorithms: list[str] = field(default_factory=lambda: ["topk", "gtopk"])
    """Sparse algorithms timed against dense (topk, gtopk, hgtopk, oktopk)."""
    node_splits: list[str] = field(default_factory=lambda: [DEFAULT_NODE_SPLIT])
    """hgtopk: one row per node split (:data:`flashsgd.exchanges.NODE_SPLITS`)."""
    selection: str = "threshold"
    """Selection used by the exchange rows (:data:`flashsgd.exchanges.SELECTIONS`): the bench's own
    default, threshold (the fastest; the one ``--fuse`` compiles), not the hooks' sampled."""
    fuse: list[bool] = field(default_factory=lambda: [False])
    """Variants: eager (False) and/or the add + block maxima fused by torch.compile (True)."""
    link_bps: int | None = None
    """Link rate of the emulated cluster in bits/s (wire time); None: no wire time."""
    ranks_per_node: int | None = None
    """hgtopk's and the wire time's node layout (None: LOCAL_WORLD_SIZE, else 1)."""
    iters: int = 5
    warmup: int = 1
    verbose: bool = True
    hook: bool = False
    """Time whole DDP steps through the hooks, synchronous vs threaded (:mod:`.sparse_hook`)."""
    hook_layers: int = 8
    hook_width: int = 1024
    bucket_mb: float = 8.0
    batch: int = 16


# ------------------------------------------------------------------------------ exchange --------

def _rpn(cfg: SparseBenchConfig, world: int) -> int:
    rpn = cfg.ranks_per_node or int(os.environ.get("LOCAL_WORLD_SIZE", "1") or 1)
    return check_node_layout(rpn, world)


def _bytes_per_call(steps: list[SparseStep], calls: int) -> list[int]:
    """Bytes the busiest rank handed to the backend per call of each step: the hooks' own traffic
    counters (``SparseHookState.bytes_sent``) over the ``calls`` made, the max over ranks (one
    all-reduce); not a formula, so a new exchange needs none here."""
    sent = torch.tensor([s.state.bytes_sent for s in steps], dtype=torch.float64)
    dist.all_reduce(sent, op=dist.ReduceOp.MAX)
    return [round(b / calls) for b in sent.tolist()]


def measure(cfg: SparseBenchConfig) -> list[dict]:
    """Per-rank body: time add, dense and every sparse step for every density (collective)."""
    rank, world = dist.get_rank(), dist.get_world_size()
    m, rpn = cfg.numel, _rpn(cfg, world)
    grad = torch.randn(m, generator=torch.Generator().manual_seed(rank))
    dense_buf, add_out, bucket = torch.zeros(m), torch.empty(m), torch.empty(m)
    talk = cfg.verbose and rank == 0
    if talk:
        print(format_header(EXCHANGE_COLUMNS), flush=True)
    rows = []
    for density in cfg.densities:
        k = k_from_density(m, density)
        variants = [(a, s, f) for a in cfg.algorithms
                    for s in (cfg.node_splits if reads(a, "node_split") else [None]) for f in cfg.fuse]
        steps = [SparseStep(a, bucket, density, selection=cfg.selection, compiled=f, ranks_per_node=rpn,
                           node_split=s or DEFAULT_NODE_SPLIT) for a, s, f in variants]
        fns = [lambda: torch.add(grad, dense_buf, out=add_out), lambda: dist.all_reduce(dense_buf)]
        fresh = [lambda: None] * len(fns) + [lambda: bucket.copy_(grad)] * len(steps)  # untimed
        timings = time_ops(fns + steps, cfg.iters, cfg.warmup, prepare=fresh)
        add_s, dense_s = timings[0].median_s, timings[1].median_s
        rate = cfg.link_bps / 8 if cfg.link_bps else None
        dense_wire = wire_bytes_per_node("dense", k, m, world, rpn) / rate * 1e3 if rate else 0.0
        # the pass unit: no e2e_ms key, so `bench emulate` does not take it for an exchange
        batch = [{"algorithm": "add (1 pass)", "density": 1.0, "k": m, "accum_ms": add_s * 1e3,
                  "add_ms_min": timings[0].min_s * 1e3, "add_ms_max": timings[0].max_s * 1e3,
                  "passes": 1.0, "for_density": density},
                 {"algorithm": "dense", "density": 1.0, "k": m, "e2e_ms": dense_s * 1e3,
                  "e2e_ms_min": timings[1].min_s * 1e3, "e2e_ms_max": timings[1].max_s * 1e3,
                  "exchange_ms": dense_s * 1e3, "wire_ms": dense_wire,
                  "floor_ms": dense_wire, "e2e_over_floor": dense_s * 1e3 / dense_wire if dense_wire else None,
                  "bytes_per_rank": 2 * (world - 1) * m * 4 // world, "ratio_to_dense": 1.0,
                  "for_density": density}]
        sent = _bytes_per_call(steps, cfg.warmup + cfg.iters)
        for (algo, split, fused), step, t, bytes_sent in zip(variants, steps, timings[2:], sent):
            phases = {f"{p}_ms": s * 1e3 for p, s in step.phases(cfg.warmup).items()}
            wire = (wire_bytes_per_node(algo, k, m, world, rpn, split or DEFAULT_NODE_SPLIT) / rate * 1e3
                    if rate else 0.0)
            name = step_name(algo, split)
            floor = FLOOR_PASSES[(name, fused)] * add_s * 1e3 + wire
            batch.append({
                "algorithm": name + ("+compiled" if fused else ""), "node_split": split,
                "density": density, "k": k,
                "e2e_ms": t.median_s * 1e3, "e2e_ms_min": t.min_s * 1e3, "e2e_ms_max": t.max_s * 1e3,
                **phases,
                "passes": (phases["accum_ms"] + phases["select_ms"] + phases["scatter_ms"]) / (add_s * 1e3),
                "wire_ms": wire, "floor_ms": floor, "floor_passes": FLOOR_PASSES[(name, fused)],
                "e2e_over_floor": t.median_s * 1e3 / floor,
                "bytes_per_rank": bytes_sent,
                "ratio_to_dense": dense_s / t.median_s,
                "ratio_to_topk": None,
            })
        by_name = {r["algorithm"]: r for r in batch}
        for row in batch[2:]:
            base = by_name.get("topk+compiled" if row["algorithm"].endswith("+compiled") else "topk")
            if base:
                row["ratio_to_topk"] = base["e2e_ms"] / row["e2e_ms"]
        for row in batch:
            if talk:
                print(format_row(row, EXCHANGE_COLUMNS), flush=True)
        rows += batch
    return rows


def bench_worker(cfg: SparseBenchConfig) -> dict | None:
    """Rank body used by ``launch.run``: measure; rank 0 returns ``{"meta", "results"}``."""
    rank, world = dist.get_rank(), dist.get_world_size()
    on_host = ranks_on_this_host(world)
    if cfg.verbose and rank == 0:
        size = "hook steps" if cfg.hook else f"numel {cfg.numel}"
        print(f"# flashsgd bench sparse: world {world}, backend {dist.get_backend()}, {size}, "
              f"selection {cfg.selection}, iters {cfg.iters}, warmup {cfg.warmup}, torch "
              f"{torch.__version__}, {os.cpu_count()} cpu(s), {on_host} rank(s) on this host, "
              f"{torch.get_num_threads()} thread(s)/rank, loadavg {os.getloadavg()[0]:.1f}", flush=True)
    load_start = os.getloadavg()[0]
    if cfg.hook:
        results = measure_hook(cfg.densities, cfg.algorithms, cfg.selection, cfg.hook_layers,
                               cfg.hook_width, cfg.bucket_mb, cfg.batch, cfg.iters, cfg.warmup,
                               cfg.verbose)
    else:
        results = measure(cfg)
    if rank != 0:
        return None
    meta = run_metadata(benchmark="sparse", mode="hook" if cfg.hook else "exchange", world=world, backend=dist.get_backend(),
                        launcher="torchrun/env" if under_torchrun() else "flashsgd.launch.spawn",
                        torch_threads_per_rank=torch.get_num_threads(),
                        ranks_per_core=on_host / (os.cpu_count() or 1),
                        loadavg_1m_start=load_start, loadavg_1m_end=os.getloadavg()[0],
                        compiled_available=compiled_available() if True in cfg.fuse else None,
                        timing="median over iters of the max over ranks of one barrier-synchronized "
                               "call; all functions of a density interleaved; phases: rank 0's medians",
                        bytes="dense: ring volume 2(P-1)/P*4m; topk: (P-1) messages (direct exchange); "
                              "gtopk: exact bytes sent, max over ranks; hgtopk: leader's or a member's "
                              "dense acc, the larger; 8 B per fp32 pair (int32 indices "
                              "under 2**31 elements)",
                        wire="bytes through the busiest node link / link rate (sparse_steps.wire_bytes_per_node)",
                        floor="FLOOR_PASSES x add time (same run, all ranks adding) + wire")
    return {"meta": meta, "results": results}


# ----------------------------------------------------------------------------- selection --------

def selection_methods(x: torch.Tensor, k: int) -> dict:
    """name -> call on ``x`` (top ``k``): one ``torch.add`` over it (the pass unit), ``torch.topk``
    of its magnitudes (the baseline) and every selection (each returns (values, indices)); state
    (workspace, generator, threshold reuse) made on ``x``'s device. ``bench sparse
    --selection-speed`` and ``bench gpu`` time these."""
    ws, reuse = SelectionWorkspace(), ThresholdReuse()
    gen = torch.Generator(device=x.device).manual_seed(1)
    out = torch.empty_like(x)
    return {
        "add (1 pass)": lambda: torch.add(x, x, out=out),
        "torch.topk": lambda: torch.topk(x.abs(), k, sorted=False),
        "exact": lambda: SELECTIONS["exact"](x, k),
        "sampled": lambda: SELECTIONS["sampled"](x, k, workspace=ws, generator=gen),
        "threshold": lambda: topk_threshold(x, k),
        "threshold+reuse": lambda: topk_threshold(x, k, reuse=reuse),
    }


def _selection_methods(cfg: SparseBenchConfig, x: torch.Tensor, k: int) -> dict:
    """name -> callable, for :func:`measure_selection`: :func:`selection_methods` and the
    compression of one bucket (eager / compiled)."""
    methods = selection_methods(x, k)
    residual, grad = torch.zeros_like(x), x * 0.5
    # the pass unit also resets the compression's residual once per repetition
    methods["add (1 pass)"] = lambda: torch.add(x, grad, out=residual)
    for fused in cfg.fuse:  # one bucket's compression: residual += grad, maxima, selection
        kept = ThresholdReuse()
        methods["compress" + ("+compiled" if fused else "")] = (
            lambda fused=fused, kept=kept: compress_(residual, grad, k, reuse=kept, compiled=fused))
    return methods


def measure_selection(cfg: SparseBenchConfig) -> list[dict]:
    """Single process: torch.add (the pass unit), torch.topk and every selection on a random fp32
    vector, and the compression of one bucket (eager / compiled)."""
    x = torch.randn(cfg.numel, generator=torch.Generator().manual_seed(0))
    talk = cfg.verbose
    if talk:
        print(f"# flashsgd bench sparse --selection-speed: numel {cfg.numel} fp32 (randn), torch "
              f"{torch.__version__}, {torch.get_num_threads()} thread(s), {os.cpu_count()} cpu(s), "
              f"loadavg {os.getloadavg()[0]:.1f}", flush=True)
        print(format_header(SELECTION_COLUMNS), flush=True)
    rows = []
    for density in cfg.densities:
        k = k_from_density(cfg.numel, density)
        methods = _selection_methods(cfg, x, k)
        exact_mass = SELECTIONS["exact"](x, k)[0].double().square().sum().item()
        mass = {name: methods[name]()[0].double().square().sum().item() / exact_mass
                for name in ("exact", "sampled", "threshold", "threshold+reuse")}
        # interleave the methods repetition by repetition: drifting load hits all alike
        samples = {name: [] for name in methods}
        for name, fn in methods.items():
            for _ in range(cfg.warmup):
                with warnings.catch_warnings():
                    warnings.simplefilter("ignore")  # a compile fallback warns once; still timed
                    fn()
        for _ in range(cfg.iters):
            for name, fn in methods.items():
                t0 = time.perf_counter()
                fn()
                samples[name].append(time.perf_counter() - t0)
        base = statistics.median(samples["torch.topk"])
        unit = statistics.median(samples["add (1 pass)"])
        for name, ts in samples.items():
            med = statistics.median(ts)
            row = {"method": name, "density": density, "k": k, "time_ms": med * 1e3,
                   "time_ms_min": min(ts) * 1e3, "time_ms_max": max(ts) * 1e3, "passes": med / unit,
                   "speedup_vs_torch_topk": base / med if name != "add (1 pass)" else None,
                   "l2_mass_kept": mass.get(name)}
            rows.append(row)
            if talk:
                print(format_row(row, SELECTION_COLUMNS), flush=True)
    return rows


# ------------------------------------------------------------------------------------ CLI -------

def add_arguments(parser: argparse.ArgumentParser) -> None:
    add_run_arguments(parser, iters=5, warmup=1)
    parser.add_argument("--numel", type=int, default=RESNET50_NUMEL,
                        help=f"gradient elements per rank (default {RESNET50_NUMEL}, ResNet-50)")
    parser.add_argument("--densities", default=str(DEFAULT_DENSITY),
                        help=f"comma-separated, each in (0, 1], one row each (default {DEFAULT_DENSITY}, "
                             "the paper's)")
    add_comm_flag(parser, "topk,gtopk", "sparse exchanges timed against dense", known=SPARSE_EXCHANGES)
    parser.add_argument("--node-splits", default=DEFAULT_NODE_SPLIT,
                        help=f"hgtopk: comma-separated node splits, one row each, from "
                             f"{', '.join(NODE_SPLITS)} (default {DEFAULT_NODE_SPLIT})")
    add_option_flag(parser, "selection", default="threshold",
                    help="selection used in the exchange and hook rows: exact (torch.topk), sampled "
                         "(sampled threshold) or threshold (block maxima, kept threshold); this bench's "
                         "default is threshold, not the hooks' sampled: the fastest selection, the one "
                         "--fuse compiles, is what it measures")
    parser.add_argument("--fuse", default="eager", choices=["eager", "compiled", "both"],
                        help="add + block maxima: eager passes, fused by torch.compile, or both "
                             "variants side by side (default eager)")
    parser.add_argument("--link", default=None,
                        help="link rate of the emulated cluster (e.g. 1gbit) for the wire-time column")
    parser.add_argument("--ranks-per-node", type=int, default=None,
                        help="node layout for hgtopk and the wire time (default: LOCAL_WORLD_SIZE, else 1)")
    parser.add_argument("--selection-speed", action="store_true",
                        help="run the single-process selection-speed micro-benchmark instead")
    parser.add_argument("--hook", action="store_true",
                        help="time whole DDP training steps through the sparse hooks, exchange "
                             "synchronous vs on a communication thread (threaded=True)")
    parser.add_argument("--hook-layers", type=int, default=8, help="--hook: square layers of the MLP")
    parser.add_argument("--hook-width", type=int, default=1024, help="--hook: width of the MLP")
    parser.add_argument("--bucket-mb", type=float, default=8.0,
                        help=f"--hook: DDP bucket cap in MiB (default 8, not the trainer's "
                             f"{BUCKET_MB:g}: 4-5 buckets of the 32 MiB MLP)")
    parser.add_argument("--batch", type=int, default=16, help="--hook: samples per rank and step")
    parser.add_argument("--threads", type=int, default=0,
                        help="--selection-speed: torch intra-op threads (default 0: torch's default)")


def config_from_args(args: argparse.Namespace) -> tuple[SparseBenchConfig, int]:
    """Validate the options (ValueError naming the option) and return the config and world size."""
    world = check_run_arguments(args)
    if args.numel < 1:
        raise ValueError(f"--numel must be >= 1, got {args.numel}")
    try:
        densities = [float(d) for d in args.densities.split(",") if d.strip()]
    except ValueError:
        raise ValueError(f"--densities must be comma-separated numbers, got {args.densities!r}") from None
    if not densities:
        raise ValueError("--densities is empty; e.g. 0.001,0.01")
    for d in densities:
        validate_density(d, "--densities")
    algorithms = comm_list(args.comm, list(SPARSE_EXCHANGES))  # unknown, empty or repeated: ValueError
    node_splits = [s.strip() for s in args.node_splits.split(",") if s.strip()]
    bad = [s for s in node_splits if s not in NODE_SPLITS]
    if bad or not node_splits:
        raise ValueError(f"--node-splits: unknown {bad or '(empty)'}; valid: {', '.join(NODE_SPLITS)}")
    link = parse_rate(args.link) if args.link else None
    if args.ranks_per_node is not None:
        check_node_layout(args.ranks_per_node, world)
    if args.hook:
        for name in ("hook_layers", "hook_width", "batch"):
            if getattr(args, name) < 1:
                raise ValueError(f"--{name.replace('_', '-')} must be >= 1, got {getattr(args, name)}")
        if not args.bucket_mb > 0:
            raise ValueError(f"--bucket-mb must be > 0, got {args.bucket_mb}")
        if args.selection_speed:
            raise ValueError("--hook and --selection-speed are two different modes; give one")
    fuse = {"eager": [False], "compiled": [True], "both": [False, True]}[args.fuse]
    if fuse != [False] and args.selection != "threshold" and not args.selection_speed:
        raise ValueError(f"--fuse {args.fuse} fuses the threshold selection's block maxima; "
                         f"use --selection threshold (got {args.selection!r})")
    cfg = SparseBenchConfig(numel=args.numel, densities=densities, algorithms=algorithms,
                            node_splits=node_splits,
                            selection=args.selection, fuse=fuse, link_bps=link,
                            ranks_per_node=args.ranks_per_node, iters=args.iters, warmup=args.warmup,
                            hook=args.hook, hook_layers=args.hook_layers, hook_width=args.hook_width,
                            bucket_mb=args.bucket_mb, batch=args.batch)
    return cfg, world


def run(args: argparse.Namespace) -> int:
    cfg, world = config_from_args(args)  # ValueError: flashsgd.cli prints it as a one-line error
    if args.selection_speed:
        if args.threads < 0:
            raise ValueError(f"--threads must be >= 0, got {args.threads}")
        if args.threads:
            torch.set_num_threads(args.threads)
        results = measure_selection(cfg)
        out = {"meta": run_metadata(benchmark="sparse", mode="selection", numel=cfg.numel,
                                    torch_threads=torch.get_num_threads(),
                                    loadavg_1m_end=os.getloadavg()[0]), "results": results}
    else:
        out = launch_run(bench_worker, (cfg,), world_size=world, timeout_s=args.timeout_s)
    if out is not None and args.json:
        out["meta"]["config"] = asdict(cfg)
        write_json(args.json, out["meta"], out["results"])
        print(f"# wrote {args.json} ({len(out['results'])} rows)", flush=True)
    return 0
