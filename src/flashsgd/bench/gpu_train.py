"""Check 4 of `flashsgd bench gpu`: training images/s of flashsgd's step beside a plain loop.

One rank (NCCL on one GPU; Gloo with ``--device cpu``), for every configuration of precision
(fp32 / bf16 / fp16) x channels_last (off / on) x ``torch.compile`` (off / on):

1. One GPU-resident synthetic batch (random images and labels made on the device, so no input
   pipeline limits either loop), ``settings.batch`` images of the model's input shape.
2. flashsgd's step: the run plan of :func:`flashsgd.train.plan.build_plan` for this configuration
   (``settings.recipe``'s optimizer and LR, DDP's built-in all-reduce), the rank
   :func:`flashsgd.train.rank.build_rank` builds (model, recipe tweaks, optimizer, DDP, and
   :class:`flashsgd.train.step.TrainStep` with the plan's precision, channels_last and compile),
   called as ``flashsgd train`` calls it.
3. The plain loop (:class:`PlainStep`): what a user writes from the PyTorch DDP tutorial, the AMP
   recipe and the channels_last tutorial, with the same model (same seed), the same recipe
   optimizer, LR, batch, bucket size and configuration; where torchvision imports, once more with
   ``torchvision.models``' model of the same name.
4. The loops' steps interleaved (:func:`flashsgd.timing.time_ops`: warm-up steps excluded, the
   device synchronized before each clock read, the order rotating each repetition), median with
   min and max; images/s = batch / median step time; ``x plain`` = flashsgd's images/s over the
   plain loop's (target >= :data:`~flashsgd.bench.gpu_common.RATIO_TARGET`), ``x tv`` the same
   over the torchvision plain loop's. fp16: the steps flashsgd's loss scaler skipped in the timed
   steps are counted (a skipped step does no optimizer update).

Between configurations the models are freed and TorchDynamo's caches reset (so no configuration
inherits another's compiled graphs, or runs into the recompile limit and silently runs eagerly).
"""

from __future__ import annotations

import gc
import itertools

import torch
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel as DDP

from flashsgd.bench.gpu_common import (COLLECTIVE_TIMEOUT_S, MODEL_INPUTS, RATIO_TARGET, GpuSettings,
                                       first_line, rank_device, record, verdict)
from flashsgd.bench.plain_loop import tutorial_update
from flashsgd.exchanges import BUILT_IN
from flashsgd.timing import Timing, time_ops

TRAIN_HEADER = (f"{'prec':<5} {'ch_last':>7} {'compile':>7} | {'flashsgd ms (min..max)':>26} {'img/s':>8} "
                f"{'skip':>4} | {'plain ms':>9} {'img/s':>8} | {'tv ms':>9} {'img/s':>8} | {'x plain':>7} "
                f"{'x tv':>6}  result")


def configurations(settings: GpuSettings) -> list[tuple[str, bool, bool]]:
    """(precision, channels_last, compile) of every configuration, eager ones first."""
    return [(p, cl, c) for c, p, cl in itertools.product(settings.compile, settings.precisions,
                                                          settings.channels_last)]


class ResidentBatch:
    """A split whose every batch is the same device-resident tensors (Step 1): the throughput
    input; ``len`` is the epoch the plan's schedule is computed for."""

    def __init__(self, x: torch.Tensor, y: torch.Tensor, epoch_samples: int) -> None:
        self.x, self.y, self.n = x, y, epoch_samples

    def __len__(self) -> int:
        return self.n

    def batch(self, *_, **__) -> tuple[torch.Tensor, torch.Tensor]:
        return self.x, self.y


class PlainStep:
    """Step 3: the tutorial's training iteration over one model.

    DDP with its defaults (built-in all-reduce, the plan's bucket size; BN buffers broadcast from
    rank 0 before each forward, where flashsgd's DDP keeps them per worker as Goyal et al. do: at
    one rank a broadcast to itself), the recipe's optimizer at
    a fixed LR, a mean cross-entropy with the recipe's label smoothing, ``torch.autocast`` around
    forward and loss (bf16 / fp16), ``torch.amp.GradScaler`` for fp16, the model and each step's
    input in ``torch.channels_last`` when asked, ``torch.compile`` of the DDP model when asked.
    """

    def __init__(self, model: torch.nn.Module, plan, device: torch.device, batch: tuple[torch.Tensor, torch.Tensor],
                 lr: float, precision: str, channels_last: bool, compiled: bool) -> None:
        from flashsgd.optim.plan import build_optimizer
        from flashsgd.train.step import PRECISIONS

        model = model.to(device)
        if channels_last:
            model = model.to(memory_format=torch.channels_last)
        self.ddp = DDP(model, bucket_cap_mb=plan.config.comm.bucket_mb,
                       device_ids=[device.index] if device.type == "cuda" else None)
        self.forward = torch.compile(self.ddp) if compiled else self.ddp
        self.optimizer = build_optimizer(plan.recipe, model, plan.config.optim.global_batch)
        for group in self.optimizer.param_groups:
            group["lr"] = lr
        self.loss_fn = torch.nn.CrossEntropyLoss(label_smoothing=plan.recipe.label_smoothing)
        self.dtype = PRECISIONS[precision]
        self.scaler = torch.amp.GradScaler(device.type) if precision == "fp16" else None
        self.device, self.batch, self.channels_last = device, batch, channels_last

    def step(self) -> None:
        x, y = self.batch
        if self.channels_last:
            x = x.contiguous(memory_format=torch.channels_last)
        tutorial_update(self.forward, self.loss_fn, self.optimizer, self.scaler, self.dtype, x, y)


def _plan(settings: GpuSettings, precision: str, channels_last: bool, compiled: bool, epoch_samples: int):
    """Step 2's run plan: the configuration as ``flashsgd train`` would resolve it on one rank."""
    from flashsgd.train.config import resolve
    from flashsgd.train.plan import build_plan

    cfg = resolve(cli={"dataset": "synthetic", "image_shape": MODEL_INPUTS[settings.model][2],
                       "model": settings.model, "num_samples": epoch_samples, "recipe": settings.recipe,
                       "proxy_tuning": False, "global_batch": settings.batch, "algorithm": BUILT_IN,
                       "workers": 1, "timeout_s": COLLECTIVE_TIMEOUT_S, "progress": False, "seed": 0,
                       "precision": precision, "channels_last": channels_last, "compile": compiled})
    return build_plan(cfg, world=dist.get_world_size(), num_train=epoch_samples, local_spawn=False)


def _loop_row(t: Timing, batch: int) -> dict:
    return {"ms": t.median_s * 1e3, "min_ms": t.min_s * 1e3, "max_ms": t.max_s * 1e3, "reps": t.reps,
            "times_ms": [s * 1e3 for s in t.times_s], "images_per_s": batch / t.median_s}


def measure(settings: GpuSettings, device: torch.device, batch: tuple[torch.Tensor, torch.Tensor],
            precision: str, channels_last: bool, compiled: bool) -> dict:
    """Steps 2-4 for one configuration: its row."""
    from flashsgd.train.data import Datasets
    from flashsgd.train.models import build_model
    from flashsgd.train.rank import build_rank

    classes, epoch = MODEL_INPUTS[settings.model][1], settings.batch * 100
    plan = _plan(settings, precision, channels_last, compiled, epoch)
    split = ResidentBatch(*batch, epoch)
    parts = build_rank(plan, Datasets(split, split, classes, "GPU-resident synthetic batch"), device)
    lr = plan.peak_lr()  # the largest LR of the schedule (after the warm-up)
    results = []

    def flashsgd_step() -> None:
        results.append(parts.step(lambda: batch, settings.batch, lr=lr, step=len(results)))

    loops = {"flashsgd": flashsgd_step}
    config = (precision, channels_last, compiled)
    torch.manual_seed(plan.config.run.seed)  # the same initial weights as flashsgd's model
    loops["plain"] = PlainStep(build_model(settings.model, classes), plan, device, batch, lr, *config).step
    if settings.torchvision:
        torch.manual_seed(plan.config.run.seed)
        loops["torchvision"] = PlainStep(build_model(f"torchvision:{settings.model}", classes), plan, device,
                                         batch, lr, *config).step
    timings = dict(zip(loops, time_ops(list(loops.values()), settings.steps, settings.warmup, device=device)))
    row = {"check": "train", "model": settings.model, "batch": settings.batch, "precision": precision,
           "channels_last": channels_last, "compile": compiled, "recipe": plan.recipe.name, "lr": lr,
           "error": None, **{name: _loop_row(t, settings.batch) for name, t in timings.items()}}
    row["flashsgd"]["skipped"] = sum(r.skipped for r in results[settings.warmup:])
    forward = parts.step.forward
    row["flashsgd"]["compiled"] = None if not compiled else getattr(forward, "fn", forward) is not parts.ddp
    ips = {name: row[name]["images_per_s"] for name in timings}
    row["ratio_to_plain"] = ips["flashsgd"] / ips["plain"]
    row["ratio_to_torchvision"] = ips["flashsgd"] / ips["torchvision"] if "torchvision" in ips else None
    row["target"] = RATIO_TARGET
    row["passed"] = all(r >= RATIO_TARGET for r in (row["ratio_to_plain"], row["ratio_to_torchvision"])
                        if r is not None)
    return row


def _free(device: torch.device) -> None:
    """Drop the configuration's models and compiled graphs before the next one."""
    torch._dynamo.reset()
    gc.collect()
    if device.type == "cuda":
        torch.cuda.empty_cache()


def format_train(row: dict) -> str:
    head = f"{row['precision']:<5} {_on(row['channels_last']):>7} {_on(row['compile']):>7}"
    if row.get("error"):
        return f"{head} | FAIL: {row['error']}"
    f, p, tv = row["flashsgd"], row["plain"], row.get("torchvision")
    spread = f"{f['ms']:.1f} ({f['min_ms']:.1f}..{f['max_ms']:.1f})"
    tv_cols = f"{tv['ms']:>9.1f} {tv['images_per_s']:>8.1f}" if tv else f"{'-':>9} {'-':>8}"
    x_tv = "-" if row["ratio_to_torchvision"] is None else f"{row['ratio_to_torchvision']:.3f}"
    note = "  (compile fell back to eager)" if f.get("compiled") is False else ""
    return (f"{head} | {spread:>26} {f['images_per_s']:>8.1f} {f['skipped']:>4} | {p['ms']:>9.1f} "
            f"{p['images_per_s']:>8.1f} | {tv_cols} | {row['ratio_to_plain']:>7.3f} {x_tv:>6}  "
            f"{verdict(row['passed'])}{note}")


def _on(flag: bool) -> str:
    return "on" if flag else "off"


def train_rank(settings: GpuSettings, configs: list[tuple[str, bool, bool]], progress: str) -> list[dict]:
    """Every configuration in this rank, each row printed and recorded in ``progress`` as it is
    measured (:func:`~flashsgd.bench.gpu_common.record`); a configuration that raises (out of
    memory, a compile error of the plain loop) is a failed row."""
    device = rank_device(settings)
    shape, classes, _ = MODEL_INPUTS[settings.model]
    g = torch.Generator(device=device).manual_seed(0)
    batch = (torch.randn(settings.batch, *shape, device=device, generator=g),          # Step 1
             torch.randint(0, classes, (settings.batch,), device=device, generator=g))
    rows = []
    for precision, channels_last, compiled in configs:
        try:
            row = measure(settings, device, batch, precision, channels_last, compiled)
        except Exception as exc:  # noqa: BLE001 - one configuration's failure is its row
            row = {"check": "train", "model": settings.model, "batch": settings.batch, "precision": precision,
                   "channels_last": channels_last, "compile": compiled, "passed": False,
                   "error": f"{type(exc).__name__}: {first_line(exc)}"}
        _free(device)
        rows.append(row)
        record(progress, row, format_train(row))
    return rows
