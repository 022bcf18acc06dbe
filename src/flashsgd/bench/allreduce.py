"""`flashsgd bench allreduce`: time native, ring, hierarchical and torus2d all-reduce (nccl-tests rows).

Spawns ``--workers`` local Gloo ranks (or runs under ``torchrun`` / any launcher that sets RANK,
WORLD_SIZE, MASTER_ADDR, MASTER_PORT), then for every message size and algorithm: one verified call
(each rank contributes ``rank % 4 + 1``; the result must be the exact sum, with the cross-rank
consistency check on), ``--warmup`` untimed calls, and ``--iters`` timed repetitions in which
the algorithms take turns (interleaved, so the background load of a shared machine hits them
alike), each call after a barrier and timed as the max over ranks; the median is reported with
min/max. Rank 0 prints one
row per (size, algorithm) with ``ratio_to_native`` = native's median time / this algorithm's
(> 1: faster than native), native being measured in the same run and process group.

Example::

    flashsgd bench allreduce --workers 8 --ranks-per-node 4 --grid 2x4 --sizes 4K:128M:4 \\
        --json runs/allreduce.json
"""

from __future__ import annotations

import argparse
import os
from dataclasses import asdict, dataclass, field

import torch
import torch.distributed as dist

from flashsgd.bench.common import (ALLREDUCE_COLUMNS, DTYPES, add_run_arguments, bandwidths,
                                   bus_factor, check_memory, check_run_arguments, dtype_name,
                                   format_header, format_row, host_memory_available, human_size,
                                   parse_dtype, parse_sizes, ranks_on_this_host, run_metadata,
                                   write_json)
from flashsgd.cli_flags import add_comm_flag, comm_list
from flashsgd.comm.dense import ALLREDUCE
from flashsgd.comm.topology import divisors, get_topology, parse_grid
from flashsgd.exchanges import BUILT_IN
from flashsgd.launch import default_backend, run as launch_run, under_torchrun
from flashsgd.timing import time_ops

HELP = f"time {'/'.join(ALLREDUCE.names())} all-reduce over message sizes (nccl-tests rows)"
DEFAULT_SIZES = "4K,64K,1M,16M,128M"
# Peak buffer bytes per rank, in messages: the message and one working copy. Measured on Gloo at
# 256 MiB, W = 2 (peak RSS): native 1.25x, ring / hierarchical / torus2d 1.5x (a chunk of n/P
# received beside the message); NCCL's stages copy the message into a padded buffer: 2x.
BUFFER_COPIES = 2


@dataclass
class AllreduceBenchConfig:
    """What one run of the all-reduce benchmark measures (the same on every rank)."""

    algorithms: list[str] = field(default_factory=lambda: ALLREDUCE.names())
    """Algorithm names from ``flashsgd.comm.dense.ALLREDUCE``; native is timed first."""
    sizes: list[int] = field(default_factory=lambda: parse_sizes(DEFAULT_SIZES))
    """Bytes per rank for each message size."""
    dtype: str = "float32"
    iters: int = 10
    """Timed repetitions per (size, algorithm)."""
    warmup: int = 2
    """Untimed calls before timing (after the verified call)."""
    ranks_per_node: int | None = None
    """L for hierarchical (and the default grid X); None: LOCAL_WORLD_SIZE / hostnames."""
    grid: str | None = None
    """'XxY' for torus2d; None: X = ranks per node."""
    verbose: bool = True
    """Rank 0 prints the rows as they are measured."""


def _verify(fn, t: torch.Tensor, topo, algorithm: str) -> None:
    """One checked call on known data: rank r contributes r % 4 + 1 (exact in fp16/bf16 to P ~ 100)."""
    world, rank = topo.world_size, topo.rank
    t.fill_(rank % 4 + 1)
    fn(t, topo, op="sum", check=True)
    expected = float(sum(r % 4 + 1 for r in range(world)))
    if t.numel() and not bool(torch.all(t == expected)):
        bad = (t != expected).nonzero()[0].item()
        raise RuntimeError(f"{algorithm} gave {t[bad].item()} at element {bad} of {t.numel()} "
                           f"({t.dtype}); expected {expected}")
    t.zero_()  # timed calls reduce zeros: the values stay bounded, the work is the same


def measure(cfg: AllreduceBenchConfig) -> list[dict]:
    """Per-rank body: time every (size, algorithm) of ``cfg`` in the current process group.

    Collective: every rank calls it with the same ``cfg``. Returns the result rows (identical on
    every rank, since times are maxima over ranks) with the keys of the JSON ``results``.

    For each size:

    1. one verified call per algorithm (:func:`_verify`: exact sum, ``check=True``);
    2. :func:`~flashsgd.timing.time_ops`: ``warmup`` untimed calls each, then ``iters``
       repetitions with the algorithms interleaved (barrier before each call, max over ranks);
    3. one row per algorithm: median time, min/max, algbw, busbw, ratio to native's median.
    """
    topo = get_topology(ranks_per_node=cfg.ranks_per_node, grid=cfg.grid)
    world = topo.world_size
    dtype = parse_dtype(cfg.dtype)
    backend = dist.get_backend()
    device = (torch.device("cuda", torch.cuda.current_device()) if backend == "nccl"
              else torch.device("cpu"))
    order = sorted(cfg.algorithms, key=lambda a: a != BUILT_IN)  # the built-in first: the baseline
    elem = torch.empty((), dtype=dtype).element_size()
    talk = cfg.verbose and topo.rank == 0
    if talk:
        print(format_header(ALLREDUCE_COLUMNS), flush=True)
    rows = []
    for size in cfg.sizes:
        count = size // elem
        t = torch.zeros(count, dtype=dtype, device=device)
        # Step 1: one verified call per algorithm (exact sum, consistency check on)
        fns = [ALLREDUCE.get(name) for name in order]
        for name, fn in zip(order, fns):
            _verify(fn, t, topo, name)
        # Step 2: interleaved timing of the hot path (check=False, as in the DDP hooks)
        timings = time_ops([lambda fn=fn, t=t: fn(t, topo, op="sum", check=False) for fn in fns],
                           cfg.iters, cfg.warmup, device=device)
        native_s = timings[0].median_s if order[0] == BUILT_IN else None
        # Step 3: one row per algorithm
        for name, timing in zip(order, timings):
            algbw, busbw = bandwidths(count * elem, timing.median_s, bus_factor("allreduce", world))
            row = {
                "algorithm": name, "size_bytes": count * elem, "count": count,
                "dtype": dtype_name(dtype), "time_us": timing.median_s * 1e6,
                "time_us_min": timing.min_s * 1e6, "time_us_max": timing.max_s * 1e6,
                "algbw_gbps": algbw, "busbw_gbps": busbw,
                "ratio_to_native": (native_s / timing.median_s
                                    if native_s is not None and timing.median_s > 0 else None),
            }
            rows.append(row)
            if talk:
                print(format_row(row, ALLREDUCE_COLUMNS), flush=True)
        del t
    return rows


def bench_worker(cfg: AllreduceBenchConfig) -> dict | None:
    """Rank body used by ``run``: measure, and on rank 0 return ``{"meta", "results"}``."""
    topo = get_topology(ranks_per_node=cfg.ranks_per_node, grid=cfg.grid)
    load_start = os.getloadavg()[0]
    if cfg.verbose and topo.rank == 0:
        print(f"# flashsgd bench allreduce: {topo.describe()}, backend {dist.get_backend()}, "
              f"dtype {cfg.dtype}, iters {cfg.iters}, warmup {cfg.warmup}, torch {torch.__version__}, "
              f"{os.cpu_count()} cpu(s), loadavg {load_start:.1f}", flush=True)
    results = measure(cfg)
    if topo.rank != 0:
        return None
    x, y = topo.grid
    meta = run_metadata(
        benchmark="allreduce", world=topo.world_size, grid=f"{x}x{y}",
        ranks_per_node=topo.ranks_per_node, backend=dist.get_backend(),
        launcher="torchrun/env" if under_torchrun() else "flashsgd.launch.spawn",
        iters=cfg.iters, warmup=cfg.warmup, dtype=cfg.dtype,
        algorithms=sorted(cfg.algorithms, key=lambda a: a != BUILT_IN),
        sizes=cfg.sizes, torch_threads_per_rank=torch.get_num_threads(),
        loadavg_1m_start=load_start,  # run_metadata's loadavg_1m is taken at the end
        timing="median over iters of the max over ranks of one barrier-synchronized call")
    return {"meta": meta, "results": results}


# ------------------------------------------------------------------------------------ CLI -------

def add_arguments(parser: argparse.ArgumentParser) -> None:
    add_run_arguments(parser, iters=10, warmup=2)
    parser.add_argument("--grid", default=None,
                        help="torus2d grid XxY, X*Y = world (default X = ranks per node)")
    parser.add_argument("--ranks-per-node", type=int, default=None,
                        help="L for hierarchical; emulates N = world/L nodes (default: detected)")
    add_comm_flag(parser, None, "all-reduce algorithms to time (native first)", known=ALLREDUCE.names())
    parser.add_argument("--sizes", default=DEFAULT_SIZES,
                        help="bytes per rank: list '4K,1M' and/or ranges '4K:128M' (x2) or '4K:128M:4'")
    parser.add_argument("--dtype", default="float32", help=f"one of {', '.join(DTYPES)}")


def config_from_args(args: argparse.Namespace) -> tuple[AllreduceBenchConfig, int]:
    """Validate the options (clear ValueErrors) and return the config and the world size."""
    world = check_run_arguments(args)
    if args.ranks_per_node is not None and (args.ranks_per_node < 1 or world % args.ranks_per_node):
        raise ValueError(f"--ranks-per-node {args.ranks_per_node} must divide the world size {world}; "
                         f"valid: {', '.join(map(str, divisors(world)))}")
    if args.grid is not None:
        parse_grid(args.grid, world)  # raises with the valid grids
    algorithms = comm_list(args.comm, ALLREDUCE.names())  # unknown, empty or repeated: ValueError
    dtype = parse_dtype(args.dtype)
    sizes = parse_sizes(args.sizes)
    elem = torch.empty((), dtype=dtype).element_size()
    if sizes[0] < elem:
        raise ValueError(f"--sizes: {sizes[0]} B is smaller than one {args.dtype} element ({elem} B)")
    _check_memory(sizes[-1], world)
    cfg = AllreduceBenchConfig(algorithms=algorithms, sizes=sizes, dtype=args.dtype, iters=args.iters,
                               warmup=args.warmup, ranks_per_node=args.ranks_per_node, grid=args.grid)
    return cfg, world


def _check_memory(size_bytes: int, world: int) -> None:
    """ValueError unless every rank sharing this rank's memory can hold ``BUFFER_COPIES`` buffers
    of the largest size: the GPU's free memory under torchrun with NCCL, else the host's."""
    if under_torchrun() and default_backend() == "nccl":
        gpus = torch.cuda.device_count()
        device = int(os.environ.get("LOCAL_RANK", 0)) % gpus  # as flashsgd.launch places ranks
        per_gpu = -(-int(os.environ.get("LOCAL_WORLD_SIZE", 1)) // gpus)  # ceil: ranks on one GPU
        check_memory(size_bytes, per_gpu, BUFFER_COPIES, torch.cuda.mem_get_info(device)[0],
                     f"free memory on GPU {device}")
        return
    check_memory(size_bytes, ranks_on_this_host(world), BUFFER_COPIES, host_memory_available(),
                 "host memory available (MemAvailable)")


def run(args: argparse.Namespace) -> int:
    cfg, world = config_from_args(args)  # ValueError: flashsgd.cli prints it as a one-line error
    out = launch_run(bench_worker, (cfg,), world_size=world, timeout_s=args.timeout_s,
                     deadline_s=args.timeout_s)
    if out is not None and args.json:
        out["meta"]["config"] = asdict(cfg)
        write_json(args.json, out["meta"], out["results"])
        print(f"# wrote {args.json} ({len(out['results'])} rows, sizes "
              f"{', '.join(human_size(s) for s in cfg.sizes)})", flush=True)
    return 0
