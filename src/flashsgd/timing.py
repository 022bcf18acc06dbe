"""The one step timer: interleaved, barrier-separated, slowest rank, median with min and max.

Every measurement of a collective call or a training step goes through :func:`time_ops`
(``flashsgd bench *``, ``train --comm auto``'s probes, the emulated cluster's probe, the scripts
in ``benchmarks/``), so "a step's time" means the same thing everywhere (nccl-tests' convention,
doc/PERFORMANCE.md): warm-up calls excluded, each repetition after a barrier, a repetition's time
is the maximum over ranks (a collective is done when its slowest rank is), the median over the
repetitions reported with the min and max as the spread. :func:`clock` is the CUDA-aware clock
of those measurements (it synchronizes). The training step's phase times are read from
:func:`stamp` instead: points on the device's timeline taken without a host sync (CUDA events),
turned into seconds by :func:`elapsed_s` once the work before them has run (one step later).

Example::

    t = time_ops([lambda: dist.all_reduce(x), lambda: x.add_(1)], iters=5, warmup=1)[0]
    print(f"{t.median_s * 1e3:.1f} ms ({t.min_s * 1e3:.1f}..{t.max_s * 1e3:.1f})")
"""

from __future__ import annotations

import statistics
import time
from dataclasses import dataclass
from typing import Any, Callable, Sequence, Union

import torch
import torch.distributed as dist


def clock(device: torch.device | None = None) -> float:
    """``time.perf_counter()`` after the device's queued kernels finish (CUDA; a no-op elsewhere):
    a CUDA clock read without a synchronize measures the launch, not the work."""
    if device is not None and device.type == "cuda":
        torch.cuda.synchronize(device)
    return time.perf_counter()


Stamp = Union[float, "torch.cuda.Event"]
"""A point in time on one device's timeline: ``time.perf_counter()`` or a recorded CUDA event."""


def stamp(device: torch.device | None = None) -> Stamp:
    """Now, on ``device``'s timeline, without waiting: on CUDA an event recorded on the current
    stream (it is reached when the work queued before it has run), elsewhere ``perf_counter()``.
    The CUDA clock of :func:`clock` costs a ``torch.cuda.synchronize`` per read; a training step
    takes several stamps and reads them later (:func:`elapsed_s`), so its one host sync stays the
    read of its result."""
    if device is not None and device.type == "cuda":
        event = torch.cuda.Event(enable_timing=True)
        event.record(torch.cuda.current_stream(device))
        return event
    return time.perf_counter()


def reached(mark: Stamp) -> bool:
    """Whether ``mark`` is in the past (a CUDA event: its work has run; asks without waiting)."""
    return mark.query() if isinstance(mark, torch.cuda.Event) else True


def elapsed_s(start: Stamp, end: Stamp) -> float:
    """Seconds from ``start`` to ``end`` (two stamps of one device). A CUDA ``end`` not reached yet
    is waited for: a host sync, which a reader avoids by asking once :func:`reached` says so."""
    if isinstance(end, torch.cuda.Event):
        end.synchronize()
        return start.elapsed_time(end) / 1e3  # milliseconds
    return end - start


@dataclass(frozen=True)
class Timing:
    """Seconds per call over the repetitions (each the max over ranks)."""

    median_s: float
    min_s: float
    max_s: float
    reps: int
    times_s: tuple[float, ...] = ()
    """Every repetition's time (the slowest rank's), in repetition order."""


def time_ops(fns: Sequence[Callable[[], Any]], iters: int, warmup: int,
             group: dist.ProcessGroup | None = None, device: torch.device | None = None,
             active: bool = True, prepare: Sequence[Callable[[], Any]] | None = None) -> list[Timing]:
    """Time several collective calls, interleaved: warm-up excluded, barrier before each call.

    Must be called by every rank of ``group`` with the same ``fns`` (each is collective).

    1. ``warmup`` untimed calls of each function.
    2. For each of the ``iters`` repetitions, call every function once after a barrier and read
       this rank's clock around it; the order rotates by one per repetition. Interleaving makes
       background load on a shared machine hit every function alike (a comparison measured this
       way is fair even when the load drifts), rotation removes any benefit of going first.
    3. One MAX all-reduce of the (iters, len(fns)) times: a repetition's time is its slowest rank
       (the collective is done when every rank is); no extra collective inside a timed region.
    4. Median over repetitions, with min and max as the spread.

    Args:
        fns: the calls to compare (each collective over ``group``, or local).
        iters, warmup: timed repetitions and untimed calls per function.
        group, device: the barrier's and the final all-reduce's group; with a CUDA ``device`` the
            device is synchronized before each clock read.
        active: False on a rank that only takes part in the barriers (its calls are skipped and
            count as 0 s: the time is the active ranks').
        prepare: per function, an untimed call before each of its calls (warm-up included), before
            the barrier: fresh input, a check of the previous result.
    """
    times = _own_times(fns, iters, warmup, group, device, active, prepare)  # Steps 1-2
    # Step 3
    reduced = torch.tensor(times, dtype=torch.float64, device=device)  # (iters, k)
    dist.all_reduce(reduced, op=dist.ReduceOp.MAX, group=group)
    # Step 4
    per_fn = reduced.t().tolist()  # (k, iters)
    return [Timing(statistics.median(t), min(t), max(t), iters, tuple(t)) for t in per_fn]


def _own_times(fns: Sequence[Callable[[], Any]], iters: int, warmup: int, group: dist.ProcessGroup | None,
               device: torch.device | None, active: bool,
               prepare: Sequence[Callable[[], Any]] | None) -> list[list[float]]:
    """Steps 1-2 of :func:`time_ops`: this rank's own (iters, len(fns)) seconds."""
    if iters < 1 or warmup < 0:
        raise ValueError(f"iters must be >= 1 and warmup >= 0, got iters={iters}, warmup={warmup}")
    k = len(fns)
    prepare = list(prepare) if prepare is not None else [lambda: None] * k
    if len(prepare) != k:
        raise ValueError(f"prepare has {len(prepare)} entries for {k} functions")
    # Step 1
    for fn, before in zip(fns, prepare):
        for _ in range(warmup if active else 0):
            before()
            fn()
            clock(device)
    # Step 2
    times = [[0.0] * k for _ in range(iters)]
    for i in range(iters):
        for j in range(k):
            j = (i + j) % k
            if active:
                prepare[j]()
            dist.barrier(group)
            t0 = clock(device)
            if active:
                fns[j]()
            times[i][j] = clock(device) - t0 if active else 0.0
    return times


def rank_times(fn: Callable[[], Any], iters: int, warmup: int, group: dist.ProcessGroup | None = None,
               device: torch.device | None = None) -> torch.Tensor:
    """Every rank's own seconds per call of ``fn``, a (ranks, iters) tensor on the CPU: the
    discipline of :func:`time_ops` (warm-up excluded, a barrier before each call, every rank
    working at once) without taking the slowest rank, so the spread from call to call and from
    rank to rank is seen (``train --comm auto`` reads the compute's jitter from it: the simulator
    adds the slowest of P ranks itself). Collective over ``group``: one all-gather at the end."""
    own = torch.tensor([t[0] for t in _own_times([fn], iters, warmup, group, device, True, None)],
                       dtype=torch.float64, device=device)
    out = [torch.empty_like(own) for _ in range(dist.get_world_size(group))]
    dist.all_gather(out, own, group=group)
    return torch.stack(out).cpu()
