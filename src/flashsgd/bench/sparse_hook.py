"""`flashsgd bench sparse --hook`: whole DDP training steps through the sparse hooks, with the
exchange inside the hook (synchronous) or on a communication thread (``threaded=True``).

What it answers: does handing bucket i's exchange to a thread, so that the selection of bucket
i + 1 and the rest of backward overlap it (:mod:`flashsgd.comm.sparse.hooks`), make a step faster?
Every rank trains an MLP of ``--hook-layers`` square layers of ``--hook-width`` (default 8 x 1024:
8.4M parameters, 32 MiB fp32) with DDP buckets of ``--bucket-mb`` (default 8: 4-5 buckets after
the rebuild) on a fixed per-rank batch, with the trainer's step (:class:`flashsgd.train.step.TrainStep`,
plain SGD). Functions timed, interleaved (:func:`flashsgd.timing.time_ops`: barrier
before each step, slowest rank, median over ``--iters``; the first ``max(--warmup, 3)`` steps
untimed, so the hooks' two dense iterations are past):

- ``noop``: no communication (the ceiling at this number of ranks per core);
- ``native``: DDP's built-in all-reduce (the dense baseline);
- per algorithm and density: the hook with ``threaded=False`` and ``threaded=True``.

Row columns: step time (median, min, max), buckets, ``x sync`` (synchronous time / this time, the
gain of the thread), ``x native`` and ``x noop`` (ratios to the baselines of the same run).

Example::

    flashsgd bench emulate --cluster 8x1 --link 1gbit -- sparse --hook --densities 0.001 \\
        --comm gtopk --json runs/hook_overlap.json
"""

from __future__ import annotations

import torch
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel as DDP

from flashsgd.bench.common import format_header, format_row
from flashsgd.comm.hooks import register_hook
from flashsgd.exchanges import BUILT_IN, COMPUTE_ONLY
from flashsgd.timing import time_ops
from flashsgd.train.rank import CommTimer
from flashsgd.train.step import TrainStep

HOOK_COLUMNS = [
    ("hook", "hook", 22, "s"), ("density", "density", 8, "g"), ("buckets", "buckets", 8, "d"),
    ("step_ms", "step(ms)", 9, ".1f"), ("step_ms_min", "min", 8, ".1f"), ("step_ms_max", "max", 8, ".1f"),
    ("ratio_to_sync", "x sync", 7, ".2f"), ("ratio_to_native", "x native", 9, ".2f"),
    ("ratio_to_noop", "x noop", 7, ".2f"),
]
DENSE_ITERATIONS = 2
"""The sparse hooks' default ``start_iter``: steps before the first sparse one (kept untimed)."""


def hook_model(layers: int, width: int) -> torch.nn.Module:
    """``layers`` Linear(width, width) + ReLU blocks and a 10-way head, the same on every rank."""
    torch.manual_seed(0)
    blocks: list[torch.nn.Module] = []
    for _ in range(layers):
        blocks += [torch.nn.Linear(width, width), torch.nn.ReLU()]
    return torch.nn.Sequential(*blocks, torch.nn.Linear(width, 10))


def hook_step(name: str, options: dict, layers: int, width: int, bucket_mb: float, batch: int):
    """(one training step, the hook's state or None) for hook ``name`` with ``options``: the
    trainer's own :class:`~flashsgd.train.step.TrainStep` (loss summed x W / B, the hook timed by a
    :class:`~flashsgd.train.rank.CommTimer`, the [loss, samples, non-finite] all-reduce), plain SGD."""
    timer = CommTimer()
    model = DDP(hook_model(layers, width), bucket_cap_mb=bucket_mb)
    state = register_hook(model, name, wrap=timer.wrap, **options)
    opt = torch.optim.SGD(model.parameters(), lr=1e-3)
    g = torch.Generator().manual_seed(dist.get_rank())
    x, y = torch.randn(batch, width, generator=g), torch.randint(0, 10, (batch,), generator=g)
    train_step = TrainStep(model, opt, torch.nn.CrossEntropyLoss(reduction="sum"), timer, hook_state=state)
    global_batch = batch * dist.get_world_size()

    def step() -> None:
        train_step(lambda: (x, y), global_batch)

    return step, state


def measure_hook(densities: list[float], algorithms: list[str], selector: str, layers: int,
                 width: int, bucket_mb: float, batch: int, iters: int, warmup: int,
                 verbose: bool = True) -> list[dict]:
    """Per-rank body (collective): time noop, native and each sparse hook sync / threaded."""
    configs = [(COMPUTE_ONLY, {}, None), (BUILT_IN, {}, None)]
    for density in densities:
        for algo in algorithms:
            for threaded in (False, True):
                configs.append((algo, {"density": density, "selection": selector, "threaded": threaded},
                                density))
    built = [hook_step(name, opts, layers, width, bucket_mb, batch) for name, opts, _ in configs]
    timings = time_ops([step for step, _ in built], iters, max(warmup, DENSE_ITERATIONS + 1))
    noop_s, native_s = timings[0].median_s, timings[1].median_s
    rows = []
    for i, ((name, opts, density), (_, state), t) in enumerate(zip(configs, built, timings)):
        threaded = opts.get("threaded")
        sync_s = timings[i - 1].median_s if threaded else t.median_s
        rows.append({"hook": name + ("" if threaded is None else f" threaded={threaded}"),
                     "algorithm": name, "threaded": threaded, "density": density,
                     "buckets": len(state.layouts) if state is not None and hasattr(state, "layouts") else None,
                     "step_ms": t.median_s * 1e3, "step_ms_min": t.min_s * 1e3,
                     "step_ms_max": t.max_s * 1e3,
                     "ratio_to_sync": sync_s / t.median_s if threaded is not None else None,
                     "ratio_to_native": native_s / t.median_s, "ratio_to_noop": noop_s / t.median_s})
    if verbose and dist.get_rank() == 0:
        params = sum(p.numel() for p in hook_model(layers, width).parameters())
        print(f"# sparse hook steps: MLP {params / 1e6:.1f}M params, bucket_cap_mb {bucket_mb}, "
              f"batch {batch}/rank, selection {selector}", flush=True)
        print(format_header(HOOK_COLUMNS), flush=True)
        for row in rows:
            print(format_row(row, HOOK_COLUMNS), flush=True)
    return rows
