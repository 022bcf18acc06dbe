"""Check 5 of `flashsgd bench gpu`: what each DDP hook of the catalog costs a training step.

At world 1 every exchange is a no-op on the wire (a ring of one rank sends nothing), so a hook's
time beyond DDP's own all-reduce is its own work: the selection, the merges, the compression and
the bookkeeping, and any host synchronization, which also stops the CPU from queuing the backward
ahead of the exchange. One rank (NCCL on one GPU; Gloo with ``--device cpu``):

1. One device-resident synthetic batch of the model's input shape (as the ``train`` check).
2. Per exchange of :data:`flashsgd.exchanges.EXCHANGES`, at its catalog defaults: the model (the
   same seed for all), ``channels_last``, DDP (25 MiB buckets, torch's default) with the hook
   registered through the library API (:func:`flashsgd.comm.hooks.register_hook`), momentum SGD
   (``foreach=True``, lr 0.1, momentum 0.9, weight decay 1e-4), and the tutorial's update
   (:func:`flashsgd.bench.plain_loop.tutorial_update`) under ``torch.autocast`` in
   :data:`PRECISION`. ``native`` registers nothing: its row is the plain loop measured twice, the
   noise floor of every other row.
3. The plain loop: the same model, optimizer and update with DDP's built-in all-reduce.
4. Every loop's steps interleaved (:func:`flashsgd.timing.time_ops`, the order rotating each
   repetition; at least ``DENSE_ITERATIONS + 1`` warm-up steps, past the exchanges' dense start),
   median with min and max;
   ``x plain`` = the plain loop's median step time over the hook's (images/s ratio).
5. Host synchronizations of one steady-state step of each loop
   (:func:`flashsgd.host_syncs.count_host_syncs`): on CUDA torch's own count; on the CPU the calls
   that would wait on CUDA, with the hooks on their CUDA code path
   (:func:`flashsgd.host_syncs.as_if_cuda`) and unthreaded where the option exists (a counter
   sees the calling thread and the hook call; PowerSGD's Gloo thread is not seen).

Targets (on CUDA; the issue's bars): ``x plain`` >= :func:`target` of the hook's family, and no
host synchronization beyond the plain loop's. On the CPU only the synchronization target applies:
its times say nothing about a GPU.

Example::

    flashsgd bench gpu --checks overhead --json runs/overhead.json
"""

from __future__ import annotations

import torch
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel as DDP

from flashsgd.bench.gpu_common import MODEL_INPUTS, RATIO_TARGET, GpuSettings, rank_device, record, verdict
from flashsgd.bench.plain_loop import tutorial_update
from flashsgd.exchanges import DENSE_ITERATIONS, EXCHANGES
from flashsgd.timing import time_ops

PRECISION = "bf16"
"""The overhead check's autocast precision (ResNet-50 on a GPU trains in bf16 today)."""

BUCKET_MB = 25.0
"""DDP's default bucket cap, MiB (what a user's own loop gets)."""

TARGETS = {"lowrank": 0.90}
"""``x plain`` a hook of this family must reach on CUDA; every other family :data:`RATIO_TARGET`
(PowerSGD's matrix products are real compute: Vogels et al. report its step time above the
sparse hooks' selection)."""

HEADER = (f"{'hook':<13} {'batch':>5} | {'hook ms (min..max)':>24} {'plain ms':>9} {'x plain':>7} "
          f"{'target':>6} | {'syncs':>5} {'plain':>5}  result")


def target(hook: str) -> float:
    """The ``x plain`` target of ``hook`` (by its catalog family)."""
    return TARGETS.get(EXCHANGES[hook].family, RATIO_TARGET)


def hooks() -> list[str]:
    """Every exchange of the catalog, in catalog order."""
    return list(EXCHANGES)


def overhead_batches(settings: GpuSettings) -> tuple[int, ...]:
    """The batches of the check: the settings' batch and a quarter of it (256 and 64 on CUDA),
    where a quarter is still a batch."""
    quarter = settings.batch // 4
    return (settings.batch, quarter) if quarter >= 1 and settings.cuda else (settings.batch,)


class HookLoop:
    """Steps 2-3: one model, its DDP (with ``hook``, or none) and the tutorial's update."""

    def __init__(self, settings: GpuSettings, hook: str | None, device: torch.device,
                 batch: tuple[torch.Tensor, torch.Tensor]) -> None:
        from flashsgd.comm.hooks import register_hook
        from flashsgd.host_syncs import watched
        from flashsgd.train.models import build_model
        from flashsgd.train.step import PRECISIONS

        torch.manual_seed(0)
        model = build_model(settings.model, MODEL_INPUTS[settings.model][1]).to(device)
        model = model.to(memory_format=torch.channels_last)
        self.ddp = DDP(model, bucket_cap_mb=BUCKET_MB,
                       device_ids=[device.index] if device.type == "cuda" else None)
        self.state = None
        if hook is not None:  # the catalog's defaults; on the CPU unthreaded, for the counter (Step 5)
            threaded = not settings.cuda and "threaded" in EXCHANGES[hook].option_names()
            options = {"threaded": False} if threaded else {}
            self.state = register_hook(self.ddp, hook, wrap=None if settings.cuda else watched, **options)
        self.optimizer = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9, weight_decay=1e-4,
                                         foreach=True)
        self.loss_fn = torch.nn.CrossEntropyLoss()
        self.dtype = PRECISIONS[PRECISION]
        self.x = batch[0].contiguous(memory_format=torch.channels_last)
        self.y = batch[1]

    def step(self) -> None:
        tutorial_update(self.ddp, self.loss_fn, self.optimizer, None, self.dtype, self.x, self.y)


def host_syncs(loop: HookLoop, device: torch.device) -> tuple[int, list[str]]:
    """Step 5: (count, 'call site' of each) of one step of ``loop``."""
    import contextlib

    from flashsgd.host_syncs import as_if_cuda, count_host_syncs

    with (contextlib.nullcontext() if device.type == "cuda" else as_if_cuda()):
        with count_host_syncs(device) as syncs:
            loop.step()
    return syncs.count, [f"{c} {s}" for c, s in zip(syncs.calls, syncs.sites)]


def measure(settings: GpuSettings, device: torch.device, batch_size: int) -> list[dict]:
    """Steps 1-5 at one batch size: one row per hook."""
    shape, classes, _ = MODEL_INPUTS[settings.model]
    g = torch.Generator(device=device).manual_seed(0)
    batch = (torch.randn(batch_size, *shape, device=device, generator=g),                 # Step 1
             torch.randint(0, classes, (batch_size,), device=device, generator=g))
    names = hooks()
    loops = {"plain": HookLoop(settings, None, device, batch)}
    loops.update({name: HookLoop(settings, name, device, batch) for name in names})
    warmup = max(settings.warmup, DENSE_ITERATIONS + 1)  # past the exchanges' dense start
    timings = dict(zip(loops, time_ops([lp.step for lp in loops.values()], settings.steps, warmup, device=device)))
    plain_syncs, plain_sites = host_syncs(loops["plain"], device)
    rows = []
    for name in names:
        t, p = timings[name], timings["plain"]
        syncs, sites = host_syncs(loops[name], device)
        ratio = p.median_s / t.median_s
        bar = target(name)
        passed = syncs <= plain_syncs and (ratio >= bar or not settings.cuda)
        rows.append({"check": "overhead", "hook": name, "family": EXCHANGES[name].family, "model": settings.model,
                     "batch": batch_size, "precision": PRECISION, "channels_last": True,
                     "ms": t.median_s * 1e3, "min_ms": t.min_s * 1e3, "max_ms": t.max_s * 1e3,
                     "plain_ms": p.median_s * 1e3, "plain_min_ms": p.min_s * 1e3, "plain_max_ms": p.max_s * 1e3,
                     "reps": t.reps, "ratio_to_plain": ratio, "target": bar if settings.cuda else None,
                     "host_syncs": syncs, "plain_host_syncs": plain_syncs, "sync_sites": sites,
                     "plain_sync_sites": plain_sites, "passed": passed})
    del loops
    return rows


def format_overhead(row: dict) -> str:
    spread = f"{row['ms']:.2f} ({row['min_ms']:.2f}..{row['max_ms']:.2f})"
    bar = "-" if row["target"] is None else f"{row['target']:.2f}"
    where = f"  ({', '.join(row['sync_sites'][:3])})" if row["host_syncs"] > row["plain_host_syncs"] else ""
    return (f"{row['hook']:<13} {row['batch']:>5} | {spread:>24} {row['plain_ms']:>9.2f} "
            f"{row['ratio_to_plain']:>7.3f} {bar:>6} | {row['host_syncs']:>5} {row['plain_host_syncs']:>5}  "
            f"{verdict(row['passed'])}{where}")


def overhead_rank(settings: GpuSettings, progress: str) -> list[dict]:
    """Every batch of :func:`overhead_batches` in this rank (world 1), each row printed and recorded
    as it is measured (:func:`~flashsgd.bench.gpu_common.record`)."""
    if dist.get_world_size() != 1:
        raise ValueError(f"the overhead check runs on 1 rank, got {dist.get_world_size()}")
    device = rank_device(settings)
    rows = []
    for batch_size in overhead_batches(settings):
        for row in measure(settings, device, batch_size):
            rows.append(row)
            record(progress, row, format_overhead(row))
        if device.type == "cuda":
            torch.cuda.empty_cache()
    return rows
