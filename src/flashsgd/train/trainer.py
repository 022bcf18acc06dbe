"""The training loop of `flashsgd train`: DDP + communication hook + large-batch recipe, on W ranks.

Papers: Goyal et al. 2017 (per-worker BN, one shuffle split over workers, loss normalized by the
global batch, linear scaling + warmup), Mikami et al. 2018 (batch-size control, label smoothing,
2D-Torus), Yamazaki et al. 2019 (LARS), Shi et al. 2019 (gTop-k) - via flashsgd.optim and
flashsgd.comm.

Per rank (:func:`worker`):

1. Shorten every collective's deadline to ``run.timeout_s`` (a dead or hung peer fails the rest).
2. Build data, model (same seed on every rank), the recipe's plan (optimizer, LR schedule, batch
   table, loss), DDP (plain BatchNorm: statistics per worker; buffers not broadcast) and the hook.
3. Resume from the newest checkpoint (``run.resume = auto``) or a given one.
4. Per epoch: the global batch from the batch table; per step: LR from the schedule at the
   fractional epoch, forward, loss = sum over the local shard * W / B (so that DDP's average of
   the W gradients is the gradient of the mean over the global batch, whatever the shard sizes),
   backward (the hook exchanges gradients), one small all-reduce of [loss, samples, non-finite],
   optimizer step or a skipped step, metrics, checkpoint every N steps.
5. Per epoch end: average BN running statistics over workers, evaluate on the test split (sharded),
   checkpoint; at the end, summary.json and report.png.

:func:`train` starts the ranks: torchrun's environment when present (NCCL with CUDA, else Gloo),
otherwise W local Gloo processes via :func:`flashsgd.launch.spawn`.
"""

from __future__ import annotations

import dataclasses
import datetime
import inspect
import os
import time
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
import torch.distributed.distributed_c10d as c10d
from torch.nn.parallel import DistributedDataParallel as DDP

from flashsgd import launch
from flashsgd.optim.recipes import RECIPES, prepare
from flashsgd.optim.schedules import lr_at
from flashsgd.train import checkpoint as ckpt
from flashsgd.train.config import PROXY_EPOCHS, PROXY_TUNING, TrainConfig, dumps, from_dict, parse_fail_at, to_dict
from flashsgd.train.data import ShardedSampler, build_datasets
from flashsgd.train.models import build_model
from flashsgd.train.report import Metrics, banner, summarize


def set_group_timeouts(timeout_s: float) -> None:
    """Step 1: every existing process group (default and subgroups) gets ``timeout_s``."""
    for pg in list(c10d._world.pg_map):
        c10d._set_pg_timeout(datetime.timedelta(seconds=timeout_s), pg)


def build_recipe(cfg: TrainConfig):
    """The named recipe rescaled to ``optim.epochs``, with overrides (and proxy tuning) applied."""
    o = cfg.optim
    recipe = RECIPES.get(o.recipe).for_epochs(o.epochs)
    over = {k: getattr(o, k) for k in ("lr_per_256", "momentum", "nesterov", "weight_decay",
                                       "warmup_epochs", "label_smoothing", "trust_coefficient")
            if getattr(o, k) is not None}
    tuned = {}
    if o.proxy_tuning and cfg.data.dataset == "mnist1d":
        tuned = {k: v for k, v in PROXY_TUNING.get(o.recipe, {}).items() if k not in over}
        if "warmup_epochs" in tuned:
            tuned["warmup_epochs"] *= o.epochs / PROXY_EPOCHS
    if cfg.model.zero_init_last_bn is not None:
        over["zero_init_last_bn"] = cfg.model.zero_init_last_bn
    return dataclasses.replace(recipe, **tuned, **over), tuned


def hook_options(name: str, cfg: TrainConfig, ranks_per_node: int | None,
                 steps_per_epoch: int = 1) -> dict[str, Any]:
    """The options of ``cfg.comm`` that hook ``name``'s factory accepts."""
    from flashsgd.comm import hooks

    c = cfg.comm
    offered: dict[str, Any] = {"ranks_per_node": ranks_per_node, "grid": c.grid,
                               "density": c.density, "selection": c.selection, "seed": cfg.run.seed}
    if c.density_warmup is not None and c.density_warmup > c.density:
        offered["warmup_density"] = c.density_warmup
        offered["warmup_steps"] = max(1, round(c.density_warmup_epochs * steps_per_epoch))
    return hooks.hook_options(name, **offered)


class CommTimer:
    """Wraps the hook DDP calls, adding up each bucket's seconds from the hook call until its future
    completes: the whole exchange for synchronous and threaded hooks alike (overlapped with backward
    when the hook is asynchronous, so the sum can exceed the exposed time). DDP's built-in
    all-reduce (``native``) registers no hook and is not measured."""

    def __init__(self) -> None:
        self.seconds = 0.0

    def wrap(self, hook):
        def timed(state, bucket):
            t0 = time.perf_counter()

            def done(fut):  # runs when the exchange completes; never blocks (value is ready)
                self.seconds += time.perf_counter() - t0
                return fut.value()

            return hook(state, bucket).then(done)
        return timed


@torch.no_grad()
def average_buffers(model: torch.nn.Module, inplace: bool = True) -> dict[str, torch.Tensor]:
    """Average the float buffers (BN running statistics) over workers; returns {name: average}.

    Training never reads them (BN uses batch statistics), so averaging before eval changes no
    parameter. ``inplace=False`` leaves the model's per-worker buffers untouched (checkpoints).
    """
    named = [(n, b) for n, b in model.named_buffers() if b.is_floating_point()]
    if not named:
        return {}
    flat = torch.cat([b.reshape(-1) for _, b in named])
    if dist.get_world_size() > 1:
        dist.all_reduce(flat)
        flat /= dist.get_world_size()
    avg = dict(zip([n for n, _ in named],
                   [t.view_as(b) for t, (_, b) in zip(flat.split([b.numel() for _, b in named]), named)]))
    if inplace:
        for n, b in named:
            b.copy_(avg[n])
    return avg


@torch.no_grad()
def evaluate(model: torch.nn.Module, split, rank: int, world: int, device: torch.device,
             chunk: int = 1024) -> tuple[float, float]:
    """(accuracy %, mean loss) on ``split``, each rank scoring a contiguous shard."""
    model.eval()
    n = len(split)
    lo, hi = rank * n // world, (rank + 1) * n // world
    stats = torch.zeros(3, dtype=torch.float64, device=device)
    for i in range(lo, hi, chunk):
        x, y = split.batch(torch.arange(i, min(i + chunk, hi)), train=False)
        out = model(x.to(device))
        y = y.to(device)
        stats[0] += (out.argmax(1) == y).sum().item()
        stats[1] += len(y)
        stats[2] += torch.nn.functional.cross_entropy(out, y, reduction="sum").item()
    model.train()
    dist.all_reduce(stats)
    return 100.0 * stats[0].item() / stats[1].item(), stats[2].item() / stats[1].item()


def inject_fault(spec: str, rank: int, step: int) -> bool:
    """Debug (tests): at ``step`` on ``rank`` exit the process, hang, or return True (NaN loss).

    Only in the first attempt of a torchrun elastic group (TORCHELASTIC_RESTART_COUNT 0/unset).
    """
    if not spec or os.environ.get("TORCHELASTIC_RESTART_COUNT", "0") != "0":
        return False
    r, s, mode = parse_fail_at(spec)
    if r != rank or s != step:
        return False
    if mode == "exit":
        print(f"[flashsgd] fault injection: rank {rank} exits at step {step}", flush=True)
        os._exit(17)
    if mode == "hang":
        print(f"[flashsgd] fault injection: rank {rank} hangs at step {step}", flush=True)
        time.sleep(10 ** 6)
    return mode == "nan"


def worker(cfg_dict: dict, emulate_nodes: bool = False) -> dict[str, Any]:
    """Steps 1-5 on this rank; returns the summary (rank 0) or {} (other ranks)."""
    cfg = from_dict(cfg_dict)
    r = cfg.run
    rank, world = dist.get_rank(), dist.get_world_size()
    local_world = int(os.environ.get("LOCAL_WORLD_SIZE", world))
    torch.set_num_threads(r.threads or max(1, (os.cpu_count() or 1) // local_world))
    torch.use_deterministic_algorithms(r.deterministic)
    device = torch.device("cuda", torch.cuda.current_device()) if dist.get_backend() == "nccl" \
        else torch.device("cpu")
    out = Path(r.out)
    # Step 2: data (local rank 0 generates/caches MNIST-1D first), model, plan, DDP, hook
    if int(os.environ.get("LOCAL_RANK", rank)) != 0:
        dist.barrier()
    data = build_datasets(cfg.data.dataset, cfg.data.num_samples, cfg.data.data_dir,
                          cfg.data.image_shape, cfg.data.image_size, cfg.data.data_seed)
    if int(os.environ.get("LOCAL_RANK", rank)) == 0:
        dist.barrier()
    torch.manual_seed(r.seed)
    recipe, tuned = build_recipe(cfg)
    model = build_model(cfg.model.model, data.num_classes, cfg.model.channels).to(device)
    plan = prepare(recipe, model, cfg.optim.global_batch, len(data.train))
    rpn = cfg.comm.ranks_per_node or ((2 if world % 2 == 0 else 1) if emulate_nodes else None)
    from flashsgd.comm.topology import get_topology
    topo = get_topology(ranks_per_node=rpn, grid=cfg.comm.grid)
    # BN buffers stay per worker during training (Goyal); averaged before eval and checkpoints.
    sync = {"forward_sync_buffers": False} if "forward_sync_buffers" in \
        inspect.signature(DDP.__init__).parameters else {"broadcast_buffers": False}
    ddp = DDP(model, bucket_cap_mb=cfg.comm.bucket_mb,
              device_ids=[device.index] if device.type == "cuda" else None, **sync)
    timer = CommTimer()
    options = hook_options(cfg.comm.comm, cfg, rpn,
                           steps_per_epoch=max(1, len(data.train) // plan.batch_at(0)))
    from flashsgd.comm.hooks import register_hook
    hook_state = register_hook(ddp, cfg.comm.comm, wrap=timer.wrap, **options)
    set_group_timeouts(r.timeout_s)  # Step 1 (after the hook created its subgroups)
    label_smoothing = plan.loss_fn.label_smoothing
    loss_fn = torch.nn.CrossEntropyLoss(label_smoothing=label_smoothing, reduction="sum")
    sampler = ShardedSampler(len(data.train), rank, world, r.seed)
    aug = torch.Generator().manual_seed(r.seed * 7919 + rank)  # per-rank augmentation stream
    progress = {"step": 0, "epoch": 0, "elapsed_s": 0.0, "skipped": 0, "tta_s": None, "evals": []}
    # Step 3: resume
    ckpt_dir = out / "checkpoints"
    target = None
    if r.resume == "auto":
        target = ckpt.find_latest(ckpt_dir)
    elif r.resume != "never":
        target = Path(r.resume)
    if target is not None:
        shared, local = ckpt.load(target, rank, world)
        ckpt.load_model_state(model, shared["model"], str(target))
        with torch.no_grad():  # this worker's own BN statistics (shared["model"] has the average)
            for name, b in model.named_buffers():
                if name in local["buffers"]:
                    b.copy_(local["buffers"][name])
        plan.optimizer.load_state_dict(shared["optimizer"])
        sampler.load_state_dict(shared["sampler"])
        hook_state.load_state_dict(local["hook"])
        ckpt.set_rng_state(local["rng"])
        aug.set_state(local["aug"])
        progress = dict(shared["progress"])
    else:
        sampler.set_epoch(0, plan.batch_at(0))
    metrics = Metrics(out, rank == 0, resumed_from=progress["step"] if target else None)
    if rank == 0:
        print(banner(cfg, world, topo, plan, options, data, model, tuned, device, target), flush=True)

    def save_checkpoint() -> None:
        # shared: the model with worker-averaged BN statistics (for eval / inference); local: this
        # worker's own statistics, so that a resumed run continues exactly as an uninterrupted one
        avg = average_buffers(model, inplace=False)
        local = {"hook": hook_state.state_dict(), "rng": ckpt.rng_state(), "aug": aug.get_state(),
                 "buffers": {n: b.clone() for n, b in model.named_buffers() if n in avg}}
        shared = None
        if rank == 0:
            shared = {"model": {**model.state_dict(), **avg}, "optimizer": plan.optimizer.state_dict(),
                      "sampler": sampler.state_dict(), "progress": progress}
        ckpt.save(ckpt_dir, progress["step"], shared, local, keep=r.keep_checkpoints)

    total_steps = sum(len(ShardedSampler.batch_ends(len(data.train), plan.batch_at(e), world))
                      for e in range(plan.epochs))
    if r.max_steps:
        total_steps = min(total_steps, r.max_steps)
    bar = None
    if rank == 0 and r.progress:
        from tqdm import tqdm
        bar = tqdm(total=total_steps, initial=progress["step"], unit="step", dynamic_ncols=True)
    t_start = time.perf_counter() - progress["elapsed_s"]
    try:
        stop = False
        epoch = sampler.epoch
        while epoch < plan.epochs and not stop:
            # Step 4
            if sampler.global_batch != plan.batch_at(epoch) or sampler.epoch != epoch:
                sampler.set_epoch(epoch, plan.batch_at(epoch))
            sizes = sampler.global_sizes()
            for idx in sampler:
                i, step = sampler.position - 1, progress["step"]
                t0 = time.perf_counter()
                make_nan = inject_fault(r.fail_at or os.environ.get("FLASHSGD_FAIL_AT", ""), rank, step)
                lr = lr_at(epoch + i / len(sizes), plan.schedule, plan.table)
                for group in plan.optimizer.param_groups:
                    group["lr"] = lr
                x, y = data.train.batch(idx, aug, train=True)
                x, y = x.to(device, non_blocking=True), y.to(device, non_blocking=True)
                comm0 = timer.seconds
                t1 = time.perf_counter()
                loss_sum = loss_fn(ddp(x), y)
                if make_nan:
                    loss_sum = loss_sum * float("nan")
                t2 = time.perf_counter()
                plan.optimizer.zero_grad(set_to_none=False)
                (loss_sum * (world / sizes[i])).backward()
                t3 = time.perf_counter()
                grads = [p.grad for p in model.parameters() if p.grad is not None]
                bad = (~torch.isfinite(torch.stack([g.sum() for g in grads]).sum())).float() \
                    + (~torch.isfinite(loss_sum.detach())).float()
                stats = torch.stack([loss_sum.detach().double(), torch.tensor(float(len(y)), dtype=torch.float64,
                                     device=device), bad.double()]).to(device)
                dist.all_reduce(stats)
                t4 = time.perf_counter()
                skipped = stats[2].item() > 0
                if skipped and r.nonfinite == "stop":
                    raise FloatingPointError(
                        f"non-finite loss or gradient at step {step} (epoch {epoch}); "
                        "set run.nonfinite = 'skip' to skip such steps instead")
                if skipped:
                    progress["skipped"] += 1
                    plan.optimizer.zero_grad(set_to_none=False)
                else:
                    plan.optimizer.step()
                t5 = time.perf_counter()
                progress["step"] = step + 1
                progress["elapsed_s"] = time.perf_counter() - t_start
                loss = stats[0].item() / stats[1].item()
                metrics.step(step=step, epoch=epoch + (i + 1) / len(sizes), loss=loss, lr=lr,
                             global_batch=sizes[i], scheduled_batch=sampler.global_batch, local_batch=len(y),
                             images_per_s=sizes[i] / (t5 - t0), t_step_s=t5 - t0, t_data_s=t1 - t0,
                             t_forward_s=t2 - t1, t_backward_s=t3 - t2, t_comm_s=timer.seconds - comm0,
                             t_sync_s=t4 - t3, t_optimizer_s=t5 - t4, skipped=bool(skipped))
                if bar is not None:
                    bar.update(1)
                    bar.set_postfix(epoch=epoch, loss=f"{loss:.3f}", lr=f"{lr:.3g}", refresh=False)
                if r.checkpoint_every and progress["step"] % r.checkpoint_every == 0 \
                        and sampler.position < len(sizes):
                    save_checkpoint()
                if r.max_steps and progress["step"] >= r.max_steps:
                    stop = True
                    break
            else:
                # Step 5: epoch end
                epoch += 1
                progress["epoch"] = epoch
                if epoch % r.eval_every == 0 or epoch == plan.epochs:
                    average_buffers(model)
                    acc, test_loss = evaluate(model, data.test, rank, world, device)
                    progress["elapsed_s"] = time.perf_counter() - t_start
                    if progress["tta_s"] is None and acc >= r.target_accuracy:
                        progress["tta_s"] = progress["elapsed_s"]
                    progress["evals"].append([epoch, progress["step"], acc, progress["elapsed_s"]])
                    metrics.eval(epoch=epoch, step=progress["step"], test_accuracy=acc, test_loss=test_loss,
                                 elapsed_s=progress["elapsed_s"])
                    if bar is not None:
                        bar.set_postfix(epoch=epoch, acc=f"{acc:.2f}%", refresh=True)
                sampler.set_epoch(epoch, plan.batch_at(min(epoch, plan.epochs - 1)))
                save_checkpoint()
                continue
    except RuntimeError as exc:  # a peer died or hung: say so, with the step
        raise RuntimeError(
            f"rank {rank}: failed at step {progress['step']} - a collective failed, so a worker "
            f"died or hung longer than run.timeout_s={r.timeout_s:g} s "
            f"({str(exc).splitlines()[0][:300]})") from exc
    if stop:
        save_checkpoint()
    if bar is not None:
        bar.close()
    result = {}
    if rank == 0:
        result = summarize(cfg, out, progress, world, topo, plan, metrics, timer_total=timer.seconds)
    metrics.close()
    return result


def train(cfg: TrainConfig) -> dict[str, Any]:
    """Run ``cfg`` under torchrun's group if there is one, else on ``run.workers`` local ranks."""
    out = Path(cfg.run.out)
    out.mkdir(parents=True, exist_ok=True)
    (out / "config.toml").write_text(dumps(cfg))
    backend = None if cfg.run.backend == "auto" else cfg.run.backend
    if launch.under_torchrun():
        launch.init_from_env(backend, cfg.run.timeout_s)
        try:
            return worker(to_dict(cfg), False)
        finally:
            launch.shutdown()
    # local spawn: the whole-run deadline is loose (collectives have run.timeout_s each)
    deadline = max(cfg.run.timeout_s, 7 * 24 * 3600.0)
    return launch.spawn(worker, cfg.run.workers, (to_dict(cfg), True), backend=backend or "gloo",
                        timeout_s=deadline)[0]
