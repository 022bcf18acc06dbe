"""`flashsgd bench sparse`: Top-k and gTop-k exchange vs dense all-reduce; top-k selection speed.

Exchange mode (default): ``--world`` ranks (spawned, or under torchrun / any launcher that sets
RANK, WORLD_SIZE, MASTER_ADDR, MASTER_PORT), each with a random fp32 gradient of ``--numel``
elements (default 25,557,032: ResNet-50). For every density, interleaved (common.time_ops:
barrier before each call, a call's time is its slowest rank, median over ``--iters``):

1. ``dense``: ``torch.distributed.all_reduce`` of the whole gradient (native; the baseline).
2. ``select``: the local selection of k = ceil(density * numel) entries (``--selector``).
3. ``topk`` / ``gtopk`` communication only: the exchange of pre-selected pairs.
4. ``topk`` / ``gtopk`` end to end: acc = grad + residual, select, exchange, dense average,
   residual update (what the DDP hook does for one bucket of that size).

Rows: select / comm milliseconds and their sum (``sel+comm``: one aggregation, as in Shi et al.),
the end-to-end step (``e2e``: plus error feedback and the dense average, what the hook does),
bytes sent per rank, and ratios to dense measured in the same run (``x dense`` = dense time /
sel+comm time, ``e2e x`` = dense time / e2e time). Bytes: dense is the ring volume
2(P-1)/P * 4 m (what Gloo's bandwidth-optimal algorithms move), topk (P-1) messages (its direct
exchange sends the bytes of a ring all-gather), gtopk the exact bytes our sends hand to Gloo (max over ranks); a message is 12 bytes per
(fp32 value, int64 index) pair.

Selection mode (``--selection``): one process, a random fp32 vector of ``--numel``, per density:
``torch.topk(|x|)`` (the raw op), :func:`~flashsgd.comm.sparse.topk_exact` and
:func:`~flashsgd.comm.sparse.topk_sampled`; median time, speed-up over torch.topk, and the fraction
of the exact top-k's squared L2 mass that the sampled one keeps.

Densities default to 0.001 (:data:`~flashsgd.comm.sparse.DEFAULT_DENSITY`, Shi et al.'s and the
hooks' default); selection to ``sampled``.

Example::

    flashsgd bench sparse --world 8 --densities 0.001,0.01 --json runs/sparse.json
    flashsgd bench sparse --selection --json runs/selection.json
"""

from __future__ import annotations

import argparse
import math
import os
import statistics
import time
from dataclasses import asdict, dataclass, field

import torch
import torch.distributed as dist

from flashsgd.bench.common import (add_run_arguments, check_run_arguments, format_header, format_row,
                                   run_metadata, time_ops, write_json)
from flashsgd.comm.sparse import (DEFAULT_DENSITY, SELECTIONS, SelectionWorkspace, gtopk_allreduce,
                                  gtopk_bytes_sent, k_from_density, topk_allgather, topk_bytes_sent,
                                  validate_density)
from flashsgd.launch import run as launch_run, under_torchrun

HELP = "time Top-k / gTop-k sparse exchange against dense all-reduce, and top-k selection"
RESNET50_NUMEL = 25_557_032

EXCHANGE_COLUMNS = [
    ("algorithm", "algorithm", 10, "s"), ("density", "density", 9, "g"), ("k", "k", 10, "d"),
    ("select_ms", "select(ms)", 11, ".1f"), ("comm_ms", "comm(ms)", 10, ".1f"),
    ("agg_ms", "sel+comm", 10, ".1f"), ("e2e_ms", "e2e(ms)", 10, ".1f"), ("e2e_ms_min", "min", 9, ".1f"),
    ("e2e_ms_max", "max", 9, ".1f"), ("bytes_per_rank", "bytes/rank", 12, "d"),
    ("agg_ratio_to_dense", "x dense", 9, ".2f"), ("ratio_to_dense", "e2e x", 7, ".2f"),
    ("bytes_ratio_to_dense", "B/dense", 9, ".4f"),
]
SELECTION_COLUMNS = [
    ("method", "method", 12, "s"), ("density", "density", 9, "g"), ("k", "k", 10, "d"),
    ("time_ms", "time(ms)", 10, ".1f"), ("time_ms_min", "min", 9, ".1f"),
    ("time_ms_max", "max", 9, ".1f"), ("speedup_vs_torch_topk", "x topk", 8, ".2f"),
    ("l2_mass_kept", "L2 kept", 9, ".4f"),
]


@dataclass
class SparseBenchConfig:
    """What one run measures (the same on every rank)."""

    numel: int = RESNET50_NUMEL
    """Gradient elements per rank (fp32)."""
    densities: list[float] = field(default_factory=lambda: [DEFAULT_DENSITY])
    algorithms: list[str] = field(default_factory=lambda: ["topk", "gtopk"])
    """Sparse algorithms timed against dense."""
    selector: str = "sampled"
    """Selection used by the exchange rows: a name in SELECTIONS ('exact' or 'sampled')."""
    iters: int = 5
    warmup: int = 1
    verbose: bool = True


# ------------------------------------------------------------------------------ exchange --------

def _exchange_fns(cfg: SparseBenchConfig, algo: str, density: float, grad: torch.Tensor,
                  state: dict) -> tuple:
    """(comm-only fn, end-to-end fn) for one algorithm and density (see module docstring)."""
    m, world = grad.numel(), dist.get_world_size()
    k = k_from_density(m, density)
    select = SELECTIONS[cfg.selector]
    kwargs = {"workspace": state["ws"]} if cfg.selector == "sampled" else {}
    values, indices = select(grad, k, **kwargs)
    out = state["out"]

    def exchange(v, i):
        if algo == "topk":
            topk_allgather(v, i, m, check=False, out=out).div_(world)
            return i
        res = gtopk_allreduce(v, i, k, m, check=False)
        out.zero_()
        out[res.indices] = res.values.div(world)
        return res.counted

    def end_to_end():
        acc = torch.add(grad, state["residual"], out=state["acc"])      # Step 1
        v, i = select(acc, k, **kwargs)                                    # Step 2
        counted = exchange(v, i)                                           # Step 3
        acc.index_fill_(0, counted, 0)                                     # Step 4: residual
        state["acc"], state["residual"] = state["residual"], acc

    return (lambda: exchange(values, indices)), end_to_end, k


def measure(cfg: SparseBenchConfig) -> list[dict]:
    """Per-rank body: time dense, selection, topk and gtopk for every density (collective)."""
    rank, world = dist.get_rank(), dist.get_world_size()
    m = cfg.numel
    grad = torch.randn(m, generator=torch.Generator().manual_seed(rank))
    state = {"ws": SelectionWorkspace(), "out": torch.empty(m), "acc": torch.empty(m),
             "residual": torch.zeros(m)}
    dense_buf = torch.zeros(m)
    select = SELECTIONS[cfg.selector]
    kwargs = {"workspace": state["ws"]} if cfg.selector == "sampled" else {}
    talk = cfg.verbose and rank == 0
    if talk:
        print(format_header(EXCHANGE_COLUMNS), flush=True)
    dense_bytes = 2 * (world - 1) * m * 4 // world  # ring volume, 4 bytes per fp32
    rows = []
    for density in cfg.densities:
        k = k_from_density(m, density)
        fns = [lambda: dist.all_reduce(dense_buf), lambda: select(grad, k, **kwargs)]
        for algo in cfg.algorithms:
            comm, e2e, _ = _exchange_fns(cfg, algo, density, grad, state)
            state["residual"].zero_()
            fns += [comm, e2e]
        timings = time_ops(fns, cfg.iters, cfg.warmup)
        dense_s, select_s = timings[0].median_s, timings[1].median_s
        dense_row = {"algorithm": "dense", "density": 1.0, "k": m, "comm_ms": dense_s * 1e3,
                     "e2e_ms": dense_s * 1e3, "e2e_ms_min": timings[0].min_s * 1e3,
                     "e2e_ms_max": timings[0].max_s * 1e3, "bytes_per_rank": dense_bytes,
                     "ratio_to_dense": 1.0, "agg_ms": dense_s * 1e3, "agg_ratio_to_dense": 1.0,
                     "bytes_ratio_to_dense": 1.0, "for_density": density}
        batch = [dense_row]
        for j, algo in enumerate(cfg.algorithms):
            comm_t, e2e_t = timings[2 + 2 * j], timings[3 + 2 * j]
            if algo == "topk":
                sent = topk_bytes_sent(k, world)
            else:
                sent = max(gtopk_bytes_sent(k, world, r) for r in range(world))
            batch.append({
                "algorithm": algo, "density": density, "k": k, "select_ms": select_s * 1e3,
                "comm_ms": comm_t.median_s * 1e3, "agg_ms": (select_s + comm_t.median_s) * 1e3,
                "agg_ratio_to_dense": dense_s / (select_s + comm_t.median_s),
                "e2e_ms": e2e_t.median_s * 1e3,
                "e2e_ms_min": e2e_t.min_s * 1e3, "e2e_ms_max": e2e_t.max_s * 1e3,
                "bytes_per_rank": sent, "ratio_to_dense": dense_s / e2e_t.median_s,
                "comm_ratio_to_dense": dense_s / comm_t.median_s,
                "bytes_ratio_to_dense": sent / dense_bytes,
                "bytes_vs_2k8log2W": (sent / (2 * k * 8 * math.log2(world))
                                      if world > 1 else None),
            })
        for row in batch:
            if talk:
                print(format_row(row, EXCHANGE_COLUMNS), flush=True)
        rows += batch
    return rows


def bench_worker(cfg: SparseBenchConfig) -> dict | None:
    """Rank body used by ``launch.run``: measure; rank 0 returns ``{"meta", "results"}``."""
    rank, world = dist.get_rank(), dist.get_world_size()
    if cfg.verbose and rank == 0:
        print(f"# flashsgd bench sparse: world {world}, backend {dist.get_backend()}, numel {cfg.numel}, "
              f"selector {cfg.selector}, iters {cfg.iters}, warmup {cfg.warmup}, torch "
              f"{torch.__version__}, {os.cpu_count()} cpu(s), {torch.get_num_threads()} thread(s)/rank, "
              f"loadavg {os.getloadavg()[0]:.1f}", flush=True)
    results = measure(cfg)
    if rank != 0:
        return None
    meta = run_metadata(benchmark="sparse", mode="exchange", world=world, backend=dist.get_backend(),
                        launcher="torchrun/env" if under_torchrun() else "flashsgd.launch.spawn",
                        torch_threads_per_rank=torch.get_num_threads(), loadavg_1m_end=os.getloadavg()[0],
                        timing="median over iters of the max over ranks of one barrier-synchronized "
                               "call; all functions of a density interleaved",
                        bytes="dense: ring volume 2(P-1)/P*4m; topk: (P-1) messages (direct exchange); "
                              "gtopk: exact bytes sent, max over ranks; 12 B per fp32 pair")
    return {"meta": meta, "results": results}


# ----------------------------------------------------------------------------- selection --------

def measure_selection(cfg: SparseBenchConfig) -> list[dict]:
    """Single process: torch.topk vs topk_exact vs topk_sampled on a random fp32 vector."""
    x = torch.randn(cfg.numel, generator=torch.Generator().manual_seed(0))
    ws = SelectionWorkspace()
    gen = torch.Generator().manual_seed(1)
    talk = cfg.verbose
    if talk:
        print(f"# flashsgd bench sparse --selection: numel {cfg.numel} fp32 (randn), torch "
              f"{torch.__version__}, {torch.get_num_threads()} thread(s), {os.cpu_count()} cpu(s), "
              f"loadavg {os.getloadavg()[0]:.1f}", flush=True)
        print(format_header(SELECTION_COLUMNS), flush=True)
    rows = []
    for density in cfg.densities:
        k = k_from_density(cfg.numel, density)
        methods = {
            "torch.topk": lambda: torch.topk(x.abs(), k, sorted=False),
            "exact": lambda: SELECTIONS["exact"](x, k),
            "sampled": lambda: SELECTIONS["sampled"](x, k, workspace=ws, generator=gen),
        }
        exact_mass = SELECTIONS["exact"](x, k)[0].double().square().sum().item()
        sampled_mass = SELECTIONS["sampled"](x, k, workspace=ws, generator=gen)[0].double().square().sum().item()
        # interleave the methods repetition by repetition: drifting load hits all alike
        samples = {name: [] for name in methods}
        for name, fn in methods.items():
            for _ in range(cfg.warmup):
                fn()
        for _ in range(cfg.iters):
            for name, fn in methods.items():
                t0 = time.perf_counter()
                fn()
                samples[name].append(time.perf_counter() - t0)
        base = statistics.median(samples["torch.topk"])
        for name, ts in samples.items():
            med = statistics.median(ts)
            row = {"method": name, "density": density, "k": k, "time_ms": med * 1e3,
                   "time_ms_min": min(ts) * 1e3, "time_ms_max": max(ts) * 1e3,
                   "speedup_vs_torch_topk": base / med,
                   "l2_mass_kept": sampled_mass / exact_mass if name == "sampled" else
                   (1.0 if name == "exact" else None)}
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
                        help=f"comma-separated, each in (0, 1] (default {DEFAULT_DENSITY}, the paper's)")
    parser.add_argument("--algorithms", default="topk,gtopk", help="comma-separated from topk, gtopk")
    parser.add_argument("--selector", default="sampled", choices=sorted(SELECTIONS),
                        help="selection used in the exchange rows: exact (torch.topk) or sampled "
                             "(sampled threshold; default)")
    parser.add_argument("--selection", action="store_true",
                        help="run the single-process selection micro-benchmark instead")
    parser.add_argument("--threads", type=int, default=0,
                        help="--selection: torch intra-op threads (default 0: torch's default)")


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
    algorithms = [a.strip() for a in args.algorithms.split(",") if a.strip()]
    bad = [a for a in algorithms if a not in ("topk", "gtopk")]
    if bad or not algorithms:
        raise ValueError(f"--algorithms: unknown {bad or '(empty)'}; valid: topk, gtopk")
    cfg = SparseBenchConfig(numel=args.numel, densities=densities, algorithms=algorithms,
                            selector=args.selector, iters=args.iters, warmup=args.warmup)
    return cfg, world


def run(args: argparse.Namespace) -> int:
    cfg, world = config_from_args(args)  # ValueError: flashsgd.cli prints it as a one-line error
    if args.selection:
        if args.threads < 0:
            raise ValueError(f"--threads must be >= 0, got {args.threads}")
        if args.threads:
            torch.set_num_threads(args.threads)
        results = measure_selection(cfg)
        out = {"meta": run_metadata(benchmark="sparse", mode="selection", numel=cfg.numel,
                                    torch_threads=torch.get_num_threads(),
                                    loadavg_1m_end=os.getloadavg()[0]), "results": results}
    else:
        out = launch_run(bench_worker, (cfg,), world_size=world, timeout_s=args.timeout)
    if out is not None and args.json:
        out["meta"]["config"] = asdict(cfg)
        write_json(args.json, out["meta"], out["results"])
        print(f"# wrote {args.json} ({len(out['results'])} rows)", flush=True)
    return 0
