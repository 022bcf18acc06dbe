"""The training loop of `flashsgd train`: DDP + communication hook + large-batch recipe, on W ranks.

Papers: Goyal et al. 2017 (per-worker BN, one shuffle split over workers, loss normalized by the
global batch, linear scaling + warmup), Mikami et al. 2018 (batch-size control, label smoothing,
2D-Torus), Yamazaki et al. 2019 (LARS), Shi et al. 2019 (gTop-k) - via flashsgd.optim and
flashsgd.comm.

:func:`train` builds the :class:`~flashsgd.train.plan.RunPlan` once (before any worker starts),
opens the run directory (:mod:`flashsgd.train.rundir`: lock, resume checks, config and plan
written), then runs :class:`Worker` on every rank through :func:`flashsgd.launch.run` (torchrun's
group when present, NCCL with CUDA, else W local Gloo processes). Per rank:

1. Set up the process: intra-op threads, determinism, device.
2. Build the model (same seed on every rank), the recipe's optimizer, DDP (plain BatchNorm:
   statistics per worker; buffers not broadcast) and the hook with its deadline.
3. Restore the checkpoint the run directory chose (or start at step 0).
4. Per epoch: the global batch from the batch table; per step: LR at the fractional epoch,
   forward, loss = sum over the local shard * W / B (so that DDP's average of the W gradients is
   the gradient of the mean over the global batch, whatever the shard sizes), backward (the hook
   exchanges gradients), one small all-reduce of [loss, samples, non-finite], optimizer step or a
   skipped step, metrics, checkpoint every N steps.
5. Per epoch end: average BN running statistics over workers, evaluate on the test split
   (sharded), checkpoint. A run stopped by ``run.max_steps`` checkpoints, then evaluates.
6. Rank 0: summary.json and report.png.
"""

from __future__ import annotations

import inspect
import os
import time
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel as DDP

from flashsgd import launch
from flashsgd.optim.plan import prepare
from flashsgd.train import checkpoint as ckpt
from flashsgd.train.config import TrainConfig, parse_fail_at
from flashsgd.train.data import Datasets, ShardedSampler, build_datasets
from flashsgd.train.models import build_model
from flashsgd.train.plan import RunPlan, build_plan
from flashsgd.train.report import Metrics, summarize
from flashsgd.train.rundir import RunDirError, Start, open_run_dir


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


def setup_process(plan: RunPlan) -> torch.device:
    """Step 1: intra-op threads (cores shared by this node's ranks), determinism, device."""
    r = plan.config.run
    local_world = int(os.environ.get("LOCAL_WORLD_SIZE", plan.world))
    torch.set_num_threads(r.threads or max(1, (os.cpu_count() or 1) // local_world))
    torch.use_deterministic_algorithms(r.deterministic)
    if dist.get_backend() == "nccl":
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device("cpu")


def build_ddp(plan: RunPlan, model: torch.nn.Module, device: torch.device, timer: CommTimer):
    """Step 2 (second half): DDP with per-worker BN buffers, the hook; returns (ddp, state, topology)."""
    from flashsgd.comm.hooks import register_hook
    from flashsgd.comm.topology import get_topology

    c = plan.config.comm
    topo = get_topology(ranks_per_node=plan.ranks_per_node, grid=c.grid, timeout_s=plan.config.run.timeout_s)
    # BN buffers stay per worker during training (Goyal); averaged before eval and checkpoints.
    sync = {"forward_sync_buffers": False} if "forward_sync_buffers" in \
        inspect.signature(DDP.__init__).parameters else {"broadcast_buffers": False}
    ddp = DDP(model, bucket_cap_mb=c.bucket_mb,
              device_ids=[device.index] if device.type == "cuda" else None, **sync)
    state = register_hook(ddp, c.algorithm, wrap=timer.wrap, **plan.hook_options)
    return ddp, state, topo


class Worker:
    """One rank of a run: Steps 1-6 of the module docstring (:meth:`run`)."""

    def __init__(self, plan: RunPlan, data: Datasets, start: Start) -> None:
        self.plan, self.data, self.cfg = plan, data, plan.config
        self.rank, self.world = dist.get_rank(), dist.get_world_size()
        self.device = setup_process(plan)                                              # Step 1
        torch.manual_seed(self.cfg.run.seed)                                           # Step 2
        self.model = build_model(self.cfg.model.model, data.num_classes, self.cfg.model.channels).to(self.device)
        recipe_plan = prepare(plan.recipe, self.model, self.cfg.optim.global_batch, plan.num_train,
                              epochs=plan.recipe.epochs)  # the recipe is already rescaled
        self.optimizer, self.model_tweaks = recipe_plan.optimizer, recipe_plan.model_tweaks
        self.timer = CommTimer()
        self.ddp, self.hook_state, self.topology = build_ddp(plan, self.model, self.device, self.timer)
        self.loss_fn = torch.nn.CrossEntropyLoss(label_smoothing=plan.recipe.label_smoothing, reduction="sum")
        self.sampler = ShardedSampler(plan.num_train, self.rank, self.world, self.cfg.run.seed)
        self.aug = torch.Generator().manual_seed(self.cfg.run.seed * 7919 + self.rank)  # per-rank augmentation
        self.progress: dict[str, Any] = {"step": 0, "epoch": 0, "elapsed_s": 0.0, "skipped": 0,
                                         "tta_s": None, "evals": []}
        self.out = Path(self.cfg.run.out)
        self.start = start
        if start.checkpoint is not None:                                               # Step 3
            self.restore(start.checkpoint)
        else:
            self.sampler.set_epoch(0, plan.batch_at(0))
        self.metrics = Metrics(self.out, self.rank == 0,
                               resumed_from=self.progress["step"] if start.checkpoint else None)
        self.bar = None
        self.fault = self.cfg.run.fail_at or os.environ.get("FLASHSGD_FAIL_AT", "")

    # ---------------------------------------------------------------- Step 3: checkpoints -------
    def restore(self, target: Path) -> None:
        """Load model, optimizer, sampler position, hook state, RNG streams and progress."""
        shared, local = ckpt.load(target, self.rank, self.world)
        ckpt.load_model_state(self.model, shared["model"], str(target))
        with torch.no_grad():  # this worker's own BN statistics (shared["model"] has the average)
            for name, b in self.model.named_buffers():
                if name in local["buffers"]:
                    b.copy_(local["buffers"][name])
        self.optimizer.load_state_dict(shared["optimizer"])
        self.sampler.load_state_dict(shared["sampler"])
        self.hook_state.load_state_dict(local["hook"])
        ckpt.set_rng_state(local["rng"])
        self.aug.set_state(local["aug"])
        self.progress = dict(shared["progress"])

    def save_checkpoint(self) -> None:
        """Shared: the model with worker-averaged BN statistics (for eval / inference); local: this
        worker's own statistics, so that a resumed run continues exactly as an uninterrupted one."""
        avg = average_buffers(self.model, inplace=False)
        local = {"hook": self.hook_state.state_dict(), "rng": ckpt.rng_state(), "aug": self.aug.get_state(),
                 "buffers": {n: b.clone() for n, b in self.model.named_buffers() if n in avg}}
        shared = None
        if self.rank == 0:
            shared = {"model": {**self.model.state_dict(), **avg}, "optimizer": self.optimizer.state_dict(),
                      "sampler": self.sampler.state_dict(), "progress": self.progress}
        ckpt.save(self.out / "checkpoints", self.progress["step"], shared, local,
                  keep=self.cfg.run.keep_checkpoints)

    # ---------------------------------------------------------------- Step 4: one step ----------
    def train_step(self, epoch: int, i: int, idx: torch.Tensor, sizes: list[int]) -> None:
        """Forward, backward (hook exchange), agreement on the loss and non-finite values, step."""
        step, world, r = self.progress["step"], self.world, self.cfg.run
        t0 = time.perf_counter()
        make_nan = inject_fault(self.fault, self.rank, step)
        lr = self.plan.lr_at(epoch + i / len(sizes))
        for group in self.optimizer.param_groups:
            group["lr"] = lr
        x, y = self.data.train.batch(idx, self.aug, train=True)
        x, y = x.to(self.device, non_blocking=True), y.to(self.device, non_blocking=True)
        comm0 = self.timer.seconds
        t1 = time.perf_counter()
        loss_sum = self.loss_fn(self.ddp(x), y)
        if make_nan:
            loss_sum = loss_sum * float("nan")
        t2 = time.perf_counter()
        self.optimizer.zero_grad(set_to_none=False)
        (loss_sum * (world / sizes[i])).backward()
        t3 = time.perf_counter()
        grads = [p.grad for p in self.model.parameters() if p.grad is not None]
        bad = (~torch.isfinite(torch.stack([g.sum() for g in grads]).sum())).float() \
            + (~torch.isfinite(loss_sum.detach())).float()
        stats = torch.stack([loss_sum.detach().double(), torch.tensor(float(len(y)), dtype=torch.float64,
                             device=self.device), bad.double()]).to(self.device)
        dist.all_reduce(stats)
        t4 = time.perf_counter()
        skipped = stats[2].item() > 0
        if skipped and r.nonfinite == "stop":
            raise FloatingPointError(f"non-finite loss or gradient at step {step} (epoch {epoch}); "
                                     "set run.nonfinite = 'skip' to skip such steps instead")
        if skipped:
            self.progress["skipped"] += 1
            self.optimizer.zero_grad(set_to_none=False)
        else:
            self.optimizer.step()
        t5 = time.perf_counter()
        self.progress["step"] = step + 1
        self.progress["elapsed_s"] = time.perf_counter() - self.t_start
        loss = stats[0].item() / stats[1].item()
        self.metrics.step(step=step, epoch=epoch + (i + 1) / len(sizes), loss=loss, lr=lr,
                          global_batch=sizes[i], scheduled_batch=self.sampler.global_batch,
                          local_batch=len(y), images_per_s=sizes[i] / (t5 - t0), t_step_s=t5 - t0,
                          t_data_s=t1 - t0, t_forward_s=t2 - t1, t_backward_s=t3 - t2,
                          t_comm_s=self.timer.seconds - comm0, t_sync_s=t4 - t3, t_optimizer_s=t5 - t4,
                          skipped=bool(skipped))
        if self.bar is not None:
            self.bar.update(1)
            self.bar.set_postfix(epoch=epoch, loss=f"{loss:.3f}", lr=f"{lr:.3g}", refresh=False)

    # ---------------------------------------------------------------- Steps 4-5: epochs ---------
    def run_epoch(self, epoch: int) -> bool:
        """Train the rest of ``epoch``; True when ``run.max_steps`` stopped it."""
        r = self.cfg.run
        if self.sampler.global_batch != self.plan.batch_at(epoch) or self.sampler.epoch != epoch:
            self.sampler.set_epoch(epoch, self.plan.batch_at(epoch))
        sizes = self.sampler.global_sizes()
        for idx in self.sampler:
            self.train_step(epoch, self.sampler.position - 1, idx, sizes)
            if r.checkpoint_every and self.progress["step"] % r.checkpoint_every == 0 \
                    and self.sampler.position < len(sizes):
                self.save_checkpoint()
            if r.max_steps and self.progress["step"] >= r.max_steps:
                return True
        return False

    def evaluate_now(self, epoch: float, at_stop: bool = False) -> None:
        """Step 5: worker-averaged BN statistics, test accuracy and loss, time to accuracy."""
        average_buffers(self.model)
        acc, test_loss = evaluate(self.model, self.data.test, self.rank, self.world, self.device)
        p = self.progress
        p["elapsed_s"] = time.perf_counter() - self.t_start
        if p["tta_s"] is None and acc >= self.cfg.run.target_accuracy:
            p["tta_s"] = p["elapsed_s"]
        p["evals"].append([epoch, p["step"], acc, p["elapsed_s"]])
        self.metrics.eval(epoch=epoch, step=p["step"], test_accuracy=acc, test_loss=test_loss,
                          elapsed_s=p["elapsed_s"], **({"at_stop": True} if at_stop else {}))
        if self.bar is not None:
            self.bar.set_postfix(epoch=epoch, acc=f"{acc:.2f}%", refresh=True)

    def end_epoch(self, epoch: int) -> None:
        """Step 5: after the last step of ``epoch`` (0-based): evaluate when due, checkpoint."""
        done = epoch + 1
        self.progress["epoch"] = done
        if done % self.cfg.run.eval_every == 0 or done == self.plan.epochs:
            self.evaluate_now(done)
        self.sampler.set_epoch(done, self.plan.batch_at(min(done, self.plan.epochs - 1)))
        self.save_checkpoint()

    def train_loop(self) -> None:
        """Step 4-5 over the remaining epochs; a stop at ``run.max_steps`` checkpoints, then evaluates."""
        epoch = self.sampler.epoch
        while epoch < self.plan.epochs:
            if self.run_epoch(epoch):
                self.save_checkpoint()
                if not self.progress["evals"] or self.progress["evals"][-1][1] != self.progress["step"]:
                    self.evaluate_now(epoch + self.sampler.position / len(self.sampler), at_stop=True)
                return
            self.end_epoch(epoch)
            epoch += 1

    def run(self) -> dict[str, Any]:
        """Steps 4-6; returns the summary (rank 0) or {} (other ranks)."""
        r = self.cfg.run
        if self.rank == 0:
            print(self.plan.describe(self.topology.describe())
                  + f"\n  model       {self.cfg.model.model} "
                  f"({sum(p.numel() for p in self.model.parameters()):,} parameters) on {self.device}; "
                  f"tweaks: {'; '.join(self.model_tweaks) or 'none'}"
                  f"\n  start       {self.start.describe()}", flush=True)
            if r.progress:
                from tqdm import tqdm
                self.bar = tqdm(total=self.plan.target_steps, initial=self.progress["step"], unit="step",
                                dynamic_ncols=True)
        self.t_start = time.perf_counter() - self.progress["elapsed_s"]
        try:
            self.train_loop()
        except RuntimeError as exc:  # a peer died or hung: say so, with the step
            raise RuntimeError(
                f"rank {self.rank}: failed at step {self.progress['step']} - a collective failed, so a "
                f"worker died or hung longer than run.timeout_s={r.timeout_s:g} s "
                f"({str(exc).splitlines()[0][:300]})") from exc
        if self.bar is not None:
            self.bar.close()
        result = {}
        if self.rank == 0:
            result = summarize(self.plan, self.progress, self.topology, self.metrics, self.timer.seconds)
        self.metrics.close()
        return result


def load_data(cfg: TrainConfig) -> Datasets:
    """The run's datasets (MNIST-1D is generated once and cached; see flashsgd.train.data)."""
    d = cfg.data
    return build_datasets(d.dataset, d.num_samples, d.data_dir, d.image_shape, d.image_size, d.data_seed)


def worker(plan: RunPlan, data: Datasets, start: Start) -> dict[str, Any]:
    """One rank's run (see :class:`Worker`)."""
    return Worker(plan, data, start).run()


def _torchrun_worker(cfg: TrainConfig) -> dict[str, Any]:
    """Under torchrun (each process is one rank): data, plan and run directory, then the worker.

    Local rank 0 builds the data first (MNIST-1D is generated and cached once per node); rank 0
    opens the run directory and tells every rank how to start (or why not).
    """
    local_rank = int(os.environ.get("LOCAL_RANK", dist.get_rank()))
    if local_rank != 0:
        dist.barrier()
    data = load_data(cfg)
    if local_rank == 0:
        dist.barrier()
    plan = build_plan(cfg, dist.get_world_size(), len(data.train), local_spawn=False)
    if dist.get_rank() != 0:
        box: list[Any] = [None]
        dist.broadcast_object_list(box, src=0)
        if isinstance(box[0], str):
            raise RunDirError(box[0])
        return worker(plan, data, box[0])
    try:
        with open_run_dir(plan) as start:
            dist.broadcast_object_list([start], src=0)
            if start.kind == "complete":
                print(f"flashsgd train: {start.describe()}", flush=True)
                return start.summary or {}
            return worker(plan, data, start)
    except RunDirError as exc:
        dist.broadcast_object_list([str(exc)], src=0)
        raise


def train(cfg: TrainConfig) -> dict[str, Any]:
    """Run ``cfg``: under torchrun's group if there is one, else on ``run.workers`` local ranks.

    On local spawn every check (plan, run directory) happens here, before any process starts;
    a ValueError names the config key. Returns rank 0's summary (this rank's under torchrun).
    """
    r = cfg.run
    backend = None if r.backend == "auto" else r.backend
    if launch.under_torchrun():
        return launch.run(_torchrun_worker, (cfg,), world_size=int(os.environ["WORLD_SIZE"]),
                          backend=backend, timeout_s=r.timeout_s)
    data = load_data(cfg)
    plan = build_plan(cfg, r.workers, len(data.train), local_spawn=True)
    with open_run_dir(plan) as start:
        if start.kind == "complete":
            print(f"flashsgd train: {start.describe()}", flush=True)
            return start.summary or {}
        return launch.run(worker, (plan, data, start), world_size=r.workers,
                          backend=backend or "gloo", timeout_s=r.timeout_s)
