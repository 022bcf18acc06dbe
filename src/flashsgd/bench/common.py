"""Shared pieces of the communication benchmarks: sizes, timing, nccl-tests columns, metadata.

Conventions (nccl-tests, doc/PERFORMANCE.md): a size is the bytes each rank contributes;
``algbw = size / time`` and ``busbw = algbw * factor`` with factor 2(P-1)/P for all-reduce and
(P-1)/P for reduce-scatter / all-gather, GB = 1e9 bytes. Timing is :func:`flashsgd.timing.time_ops`
(the one step timer): warm-up calls excluded, every repetition starts after a barrier, a
repetition's time is the maximum over ranks, the median reported with its min and max, the compared
calls interleaved repetition by repetition.

Used by ``flashsgd bench allreduce`` and reusable by the other communication benchmarks: call
:func:`~flashsgd.timing.time_ops` inside an initialized process group, build rows as dicts,
print them with :func:`format_row` under :func:`format_header` (extra columns are appended by
passing a longer column list), and save with :func:`write_json` next to :func:`run_metadata`. Before spawning,
:func:`check_memory` refuses message sizes whose buffers cannot fit in memory.

Example::

    >>> parse_sizes("4K:64K:4,1M")
    [4096, 16384, 65536, 1048576]
    >>> format_row({"size_bytes": 4096, "count": 1024, "dtype": "float32", "algorithm": "ring",
    ...             "time_us": 80.0, "algbw_gbps": 0.0512, "busbw_gbps": 0.0896,
    ...             "ratio_to_native": None}, ALLREDUCE_COLUMNS)
    '       4096       1024  float32         ring       80.0          -          -   0.051   0.090        -'
"""

from __future__ import annotations

import argparse
import datetime
import os
import platform
import re
import socket
import sys
from typing import Any, Sequence

import torch

from flashsgd.exchanges import check_timeout_s
from flashsgd.fmt import plural, size
from flashsgd.launch import under_torchrun
from flashsgd.outputs import add_output, write_json as _write_json

DTYPES = {"float32": torch.float32, "fp32": torch.float32, "float16": torch.float16,
          "fp16": torch.float16, "bfloat16": torch.bfloat16, "bf16": torch.bfloat16}
_UNITS = {"": 1, "B": 1, "K": 2**10, "M": 2**20, "G": 2**30}  # binary units, as nccl-tests -b/-e


def parse_size(text: str) -> int:
    """``"4K"`` -> 4096, ``"128M"`` -> 134217728, ``"100"`` -> 100 (bytes; K/M/G are powers of 1024)."""
    m = re.fullmatch(r"\s*(\d+)\s*([KMGB]?)\s*", str(text).upper())
    if not m or int(m.group(1)) <= 0:
        raise ValueError(f"size {text!r} must be a positive integer with an optional K/M/G suffix, "
                         "e.g. 4K, 16M, 1G")
    return int(m.group(1)) * _UNITS[m.group(2)]


def parse_sizes(spec: str) -> list[int]:
    """Comma-separated sizes and ranges: ``"4K,64K,1M"``; ``"4K:128M"`` (x2 steps); ``"4K:128M:4"``.

    Returns sorted unique sizes in bytes.
    """
    sizes: set[int] = set()
    for item in str(spec).split(","):
        if not item.strip():
            continue
        parts = item.split(":")
        if len(parts) == 1:
            sizes.add(parse_size(parts[0]))
            continue
        if len(parts) not in (2, 3):
            raise ValueError(f"size range {item!r} must be START:END or START:END:FACTOR")
        lo, hi = parse_size(parts[0]), parse_size(parts[1])
        factor = int(parts[2]) if len(parts) == 3 and parts[2].strip().isdigit() else None
        if len(parts) == 2:
            factor = 2
        if factor is None or factor < 2 or lo > hi:
            raise ValueError(f"size range {item!r}: need START <= END and an integer FACTOR >= 2")
        s = lo
        while s <= hi:
            sizes.add(s)
            s *= factor
    if not sizes:
        raise ValueError(f"--sizes {spec!r} names no size; e.g. '4K,64K,1M,16M' or '4K:128M'")
    return sorted(sizes)


def human_size(n_bytes: int) -> str:
    """4096 -> '4K', 3 * 2**20 -> '3M', 1000 -> '1000'."""
    for unit in ("G", "M", "K"):
        if n_bytes >= _UNITS[unit] and n_bytes % _UNITS[unit] == 0:
            return f"{n_bytes // _UNITS[unit]}{unit}"
    return str(n_bytes)


def parse_dtype(name: str) -> torch.dtype:
    try:
        return DTYPES[name]
    except KeyError:
        raise ValueError(f"--dtype {name!r} is not supported; valid: {', '.join(DTYPES)}") from None


def dtype_name(dtype: torch.dtype) -> str:
    return str(dtype).removeprefix("torch.")


def bus_factor(collective: str, world: int) -> float:
    """nccl-tests' busbw factor: all-reduce 2(P-1)/P, reduce-scatter / all-gather (P-1)/P."""
    if collective == "allreduce":
        return 2 * (world - 1) / world
    if collective in ("reduce_scatter", "all_gather"):
        return (world - 1) / world
    raise ValueError(f"collective must be allreduce, reduce_scatter or all_gather, got {collective!r}")


def bandwidths(size_bytes: int, time_s: float, factor: float) -> tuple[float, float]:
    """(algbw, busbw) in GB/s (1e9 B/s): algbw = size / time, busbw = algbw * factor."""
    algbw = size_bytes / time_s / 1e9 if time_s > 0 else float("inf")
    return algbw, algbw * factor


# ------------------------------------------------------------------------------- formatting -----

# (key, header, width, format) of each printed column; benchmarks append their own.
Column = tuple[str, str, int, str]
ALLREDUCE_COLUMNS: list[Column] = [
    ("size_bytes", "size(B)", 11, "d"), ("count", "count", 11, "d"), ("dtype", "type", 9, "s"),
    ("algorithm", "algorithm", 13, "s"), ("time_us", "time(us)", 11, ".1f"),
    ("time_us_min", "min(us)", 11, ".1f"), ("time_us_max", "max(us)", 11, ".1f"),
    ("algbw_gbps", "algbw", 8, ".3f"), ("busbw_gbps", "busbw", 8, ".3f"),
    ("ratio_to_native", "x native", 9, ".2f"),
]


def format_header(columns: Sequence[Column]) -> str:
    return "".join(f"{h:>{w}}" for _, h, w, _ in columns)


def format_row(row: dict, columns: Sequence[Column]) -> str:
    """One fixed-width line; a missing or None value prints as '-'."""
    out = []
    for key, _, width, fmt in columns:
        value = row.get(key)
        out.append(f"{'-':>{width}}" if value is None else f"{value:>{width}{fmt}}")
    return "".join(out)


def add_run_arguments(parser: argparse.ArgumentParser, *, iters: int, warmup: int) -> None:
    """The options every multi-rank benchmark shares: --workers, --iters, --warmup, --timeout-s, --json."""
    parser.add_argument("--workers", type=int, default=8,
                        help="local ranks to spawn (ignored under torchrun: WORLD_SIZE wins; default 8)")
    parser.add_argument("--iters", type=int, default=iters, help=f"timed repetitions (default {iters})")
    parser.add_argument("--warmup", type=int, default=warmup,
                        help=f"untimed calls before timing (default {warmup})")
    parser.add_argument("--timeout-s", type=float, default=1800.0,
                        help="seconds before the run is aborted (default 1800)")
    add_output(parser, "--json", default=None, metavar="PATH", help="also write results + metadata here")


def check_run_arguments(args: argparse.Namespace) -> int:
    """Validate the shared options (ValueError naming the option); return the world size."""
    world = int(os.environ["WORLD_SIZE"]) if under_torchrun() else args.workers
    if not isinstance(world, int) or world < 1:
        raise ValueError(f"--workers must be an integer >= 1, got {world!r}")
    check_timeout_s(args.timeout_s, "--timeout-s")
    if args.iters < 1 or args.warmup < 0:
        raise ValueError(f"--iters must be >= 1 and --warmup >= 0, got {args.iters} and {args.warmup}")
    return world


# ------------------------------------------------------------------------------------ memory -----

def host_memory_available() -> int:
    """Bytes of host memory available to new allocations: ``MemAvailable`` of /proc/meminfo (free
    pages plus reclaimable cache), else the free physical pages (``SC_AVPHYS_PAGES``)."""
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024  # the file counts kB (KiB)
    except OSError:
        pass
    return os.sysconf("SC_AVPHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")


def ranks_on_this_host(world: int) -> int:
    """How many of the ``world`` ranks share this machine's memory.

    All of them when spawned locally or on an emulated cluster (its "nodes" are namespaces of this
    one machine: ``FLASHSGD_EMULATED`` is set); ``LOCAL_WORLD_SIZE`` under torchrun.
    """
    if under_torchrun() and not os.environ.get("FLASHSGD_EMULATED"):
        return int(os.environ.get("LOCAL_WORLD_SIZE", world))
    return world


def check_memory(size_bytes: int, ranks: int, copies: float, available_bytes: int, where: str) -> None:
    """ValueError unless ``ranks`` x ``copies`` buffers of ``size_bytes`` fit in ``available_bytes``.

    ``where`` names the memory (e.g. "host memory available (MemAvailable)"). The message names the
    size, the total needed, the memory available and the largest size that would fit.
    """
    need = size_bytes * ranks * copies
    if need <= available_bytes:
        return
    fits = int(available_bytes / (ranks * copies))
    raise ValueError(
        f"--sizes {human_size(size_bytes)}: {plural(ranks, 'rank')} x {plural(copies, 'buffer')} of "
        f"{size(size_bytes)} = {size(need)}, more than the {size(available_bytes)} of {where}; the "
        f"largest size that fits is about {size(fits)}")


def run_metadata(**extra: Any) -> dict:
    """Machine, versions, command and time of a benchmark run, plus the benchmark's own fields."""
    meta = {
        "torch": torch.__version__, "python": platform.python_version(),
        "host": socket.gethostname(), "platform": platform.platform(),
        "cpu_count": os.cpu_count(), "loadavg_1m": os.getloadavg()[0],
        "command": " ".join(sys.argv),
        "timestamp": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
    }
    meta.update(extra)
    return meta


def write_json(path: str, meta: dict, results: list[dict]) -> None:
    """Write ``{"meta": ..., "results": [...]}`` (parent folders created; :func:`flashsgd.outputs.write_json`)."""
    _write_json(path, {"meta": meta, "results": results}, indent=1)
