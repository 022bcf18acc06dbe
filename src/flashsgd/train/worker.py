"""One rank of a `flashsgd train` run (:func:`flashsgd.train.trainer.train` starts one per rank).

Papers: Goyal et al. 2017 (per-worker BN, the loss normalized by the global batch, linear scaling
and warmup), Mikami et al. 2018 (batch-size control), Yamazaki et al. 2019 (LARS), Shi et al. 2019
(gTop-k) - through the :class:`~flashsgd.train.plan.RunPlan` every rank receives. Building blocks
from :mod:`flashsgd.train.rank`; the step is :class:`flashsgd.train.step.TrainStep` (the one every
benchmark times). Per rank (:class:`Worker`):

1. Set up the process: intra-op threads, determinism, device.
2. Build the model (same seed on every rank), the recipe's optimizer, DDP (plain BatchNorm:
   statistics per worker; buffers not broadcast), the hook with its deadline, and the step.
3. Restore the checkpoint the run directory chose (or start at step 0).
4. Per epoch: the global batch from the batch table; per step: LR at the fractional epoch, then
   the :class:`~flashsgd.train.step.TrainStep` (forward, loss = sum over the local shard * W / B,
   backward with the hook's exchange, one small all-reduce of [loss, samples, non-finite],
   optimizer step or a skipped step), metrics, checkpoint every N steps.
5. Per epoch end: average BN running statistics over workers, evaluate on the test split
   (sharded), checkpoint. A run stopped by ``run.max_steps`` checkpoints, then evaluates.
6. Rank 0: summary.json and report.png.
"""

from __future__ import annotations

import os
import sys
import time
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

from flashsgd.fmt import plural
from flashsgd.launch.failures import TIMEOUT_TEXT, comm_failures, one_line
from flashsgd.optim.stability import LossRiseGuard
from flashsgd.train.records import checkpoint as ckpt
from flashsgd.train.data import Datasets, ShardedSampler
from flashsgd.train.data.loader import BatchStream, augmentation_key
from flashsgd.train.plan import RunPlan
from flashsgd.train.progress import progress_bar
from flashsgd.train.records import Eval, Progress, eval_row, step_row
from flashsgd.train.records.report import Metrics, summarize
from flashsgd.train.rank import (average_buffers, build_rank, evaluate, inject_fault,
                                 setup_process)
from flashsgd.train.records.rundir import Start, write_plan


class CheckpointWriteError(OSError):
    """A checkpoint could not be written (a full disk); the message names the step, the path, the
    OS error and the checkpoint a rerun resumes from."""


class Worker:
    """One rank of a run: Steps 1-6 of the module docstring (:meth:`run`)."""

    def __init__(self, plan: RunPlan, data: Datasets, start: Start) -> None:
        self.plan, self.cfg = plan, plan.config
        self.rank, self.world = dist.get_rank(), dist.get_world_size()
        self.device = setup_process(plan)                                              # Step 1
        self.data = data = data.to(self.device)  # in-memory splits resident on the rank's device
        parts = build_rank(plan, data, self.device, out=Path(self.cfg.run.out),        # Step 2
                           resume_from=start.checkpoint)
        self.model, self.optimizer, self.model_tweaks = parts.model, parts.optimizer, parts.model_tweaks
        self.ddp, self.hook_state, self.topology = parts.ddp, parts.hook_state, parts.topology
        self.timer, self.step, self.auto = parts.timer, parts.step, parts.auto
        self.out = Path(self.cfg.run.out)
        if self.auto is not None:  # --comm auto chose the exchange: the plan changed
            self.plan, self.cfg = parts.plan, parts.plan.config
            if self.rank == 0:
                write_plan(self.out, self.plan, chosen_by="auto (auto.json)")
        self.sampler = ShardedSampler(plan.num_train, self.rank, self.world, self.cfg.run.seed)
        self.data_workers = self.plan.execution.get("data_workers", 0)
        self.stream = BatchStream(data.train, self.data_workers, self.device, channels_last=self.step.channels_last)
        self.progress = Progress()
        self.start = start
        if start.checkpoint is not None:                                               # Step 3
            self.restore(start.checkpoint)
        else:
            self.sampler.set_epoch(0, plan.batch_at(0))
        self.metrics = Metrics(self.out, self.rank == 0,
                               resumed_from=self.progress.step if start.checkpoint else None)
        self.bar = None
        self.guard = LossRiseGuard(plan.recipe.warmup_epochs)  # the global loss: the same on every rank
        self.pending: list[tuple[Any, dict[str, Any]]] = []  # rows not yet written: (StepResult, own values)
        self.fault = self.cfg.run.fail_at or os.environ.get("FLASHSGD_FAIL_AT", "")

    # ---------------------------------------------------------------- Step 3: checkpoints -------
    def restore(self, target: Path) -> None:
        """Load model, optimizer, sampler position, hook state, RNG streams and progress.

        From another world size (elastic: torchrun ``--nnodes MIN:MAX``, or another
        ``--workers``), :meth:`regroup` maps the per-worker state instead."""
        try:
            shared, local = ckpt.load(target, self.rank, self.world)
        except ckpt.WorldSizeChanged:
            shared, local = self.regroup(target)
        ckpt.load_model_state(self.model, shared["model"], str(target))
        with torch.no_grad():  # this worker's own BN statistics (shared["model"] has the average)
            for name, b in self.model.named_buffers():
                if name in local.get("buffers", {}):
                    b.copy_(local["buffers"][name])
        self.optimizer.load_state_dict(shared["optimizer"])
        self.sampler.load_state_dict(shared["sampler"])
        self.hook_state.load_state_dict(local["hook"])
        if self.step.scaler is not None and "scaler" in shared:  # fp16: the same scale on every rank
            self.step.scaler.load_state_dict(shared["scaler"])
        if "rng" in local:  # (augmentation has no stream to restore: per sample, flashsgd.train.data.images)
            ckpt.set_rng_state(local["rng"])
        self.progress = Progress.from_json(shared["progress"])
        if self.progress.step > 0:  # the buckets the uninterrupted run had after its first step
            self.rebuild_buckets()

    def regroup(self, target: Path) -> tuple[dict[str, Any], dict[str, Any]]:
        """(shared, this rank's local state) of a checkpoint written by another number of workers.

        The model, optimizer, progress and the global batch and LR schedule are the run's, not
        the world's; the sampler continues at the same global sample
        (:meth:`ShardedSampler.load_state_dict`); the hook state is regrouped by its class
        (``regroup``: error-feedback memories averaged over the old workers, their contribution
        to the update kept; dense hooks have none). Not exact (another number of shards is summed
        in another order), and reset: BN statistics (every worker starts from their average, in
        ``shared``), and the RNG streams of ranks the old world did not have (their seeds)."""
        shared, ranks = ckpt.load_all_ranks(target)
        old = len(ranks)
        hooks = [r["hook"] for r in ranks]
        regroup = getattr(type(self.hook_state), "regroup", None)
        if regroup is not None:
            hook = regroup(hooks, self.rank, self.world)
        elif any(hooks):
            raise ckpt.CheckpointError(f"checkpoint {target}: the {self.cfg.comm.algorithm} hook's "
                                       f"per-worker state cannot be regrouped from {plural(old, 'worker')}")
        else:
            hook = {}
        local: dict[str, Any] = {"hook": hook}
        if self.rank < old:  # this rank's own random streams
            local.update(rng=ranks[self.rank]["rng"])
        else:
            torch.manual_seed(self.cfg.run.seed * 1_000_003 + self.rank)
        if self.rank == 0:
            print(f"[flashsgd] resuming a checkpoint of {plural(old, 'worker')} on {self.world}: the sampler "
                  f"continues at the same sample; {self.cfg.comm.algorithm} hook state "
                  f"{'regrouped (error feedback averaged over the old workers)' if any(hooks) else 'none'}; "
                  "BN statistics start from their average", flush=True)
        return shared, local

    def rebuild_buckets(self) -> None:
        """DDP's rebuilt buckets before the first step after a resume (:func:`flashsgd.comm.hooks.
        rebuild_buckets`: a forward/backward on two training samples that changes nothing)."""
        from flashsgd.comm.hooks import rebuild_buckets

        x, y = self.data.train.batch(torch.arange(min(2, len(self.data.train))), train=False)
        rebuild_buckets(self.ddp, lambda: self.step.forward_loss(x.to(self.device), y.to(self.device)))

    def save_checkpoint(self) -> None:
        """Shared: the model with worker-averaged BN statistics (for eval / inference); local: this
        worker's own statistics, so that a resumed run continues exactly as an uninterrupted one.
        Never a diverged model (FloatingPointError instead); a failed write (a full disk) is an
        OSError naming the step, the path and the OS error, and ``latest`` stays where it was."""
        self.write_rows()
        hook = self.hook_state.state_dict()
        self.step.check_parameters(f"after step {self.progress.step - 1}", buffers=True, memories=hook)
        avg = average_buffers(self.model, inplace=False)
        local = {"hook": hook, "rng": ckpt.rng_state(),
                 "buffers": {n: b.clone() for n, b in self.model.named_buffers() if n in avg}}
        shared = None
        if self.rank == 0:
            shared = {"model": {**self.model.state_dict(), **avg}, "optimizer": self.optimizer.state_dict(),
                      "sampler": self.sampler.state_dict(), "progress": self.progress.to_json()}
            if self.step.scaler is not None:  # fp16's loss scale and growth tracker (agreed: shared)
                shared["scaler"] = self.step.scaler.state_dict()
        try:
            ckpt.save(self.out / "checkpoints", self.progress.step, shared, local,
                      keep=self.cfg.run.keep_checkpoints, run=self.start.run)  # the run's identity
        except OSError as exc:
            raise CheckpointWriteError(f"cannot write the checkpoint of step {self.progress.step}: "
                                       f"{exc}; {self._resume_point()}") from exc

    def _resume_point(self) -> str:
        """Where a rerun would resume, in words (after a failed checkpoint write)."""
        try:
            target, _ = ckpt.resume_point(self.out / "checkpoints")
        except (ckpt.CheckpointError, OSError):
            target = None
        return (f"the resume point stays {target.name}" if target is not None
                else "no checkpoint was written yet")

    # ---------------------------------------------------------------- Step 4: one step ----------
    def train_step(self, epoch: int, i: int, batches, sizes: list[int]) -> None:
        """Step 4: the LR at the fractional epoch, :class:`~flashsgd.train.step.TrainStep` on the
        next of ``batches`` (step ``i`` of ``sizes``; the wait for it is the step's data time), the
        count of skipped steps, metrics."""
        p = self.progress
        step = p.step
        poison = inject_fault(self.fault, self.rank, step)
        lr = self.plan.lr_at(epoch + i / len(sizes))
        res = self.step(lambda: next(batches), sizes[i], lr=lr, step=step, epoch=epoch, poison=poison)
        if res.skipped:
            p.skipped += 1
            if res.overflow:  # fp16: the loss scaler's back-off (also counted in "skipped")
                p.overflow_skipped = (p.overflow_skipped or 0) + 1
        unstable = self.guard.update(step, epoch + i / len(sizes), res.loss, lr, sizes[i])
        if unstable and self.rank == 0:
            print(f"flashsgd train: warning: {unstable}", file=sys.stderr, flush=True)
        p.step, p.elapsed_s = step + 1, time.perf_counter() - self.t_start
        self.pending.append((res, dict(step=step, epoch=epoch + (i + 1) / len(sizes), lr=lr,
                                       global_batch=sizes[i], scheduled_batch=self.sampler.global_batch,
                                       local_batch=self.stream.last_size)))
        self.write_rows(wait=False)
        if self.bar is not None:
            self.bar.update(1)
            self.bar.set_postfix(epoch=epoch, loss=f"{res.loss:.3f}", lr=f"{lr:.3g}", refresh=False)

    def write_rows(self, wait: bool = True) -> None:
        """The metrics rows of the steps whose phase times can be read: on CPU at once, on CUDA when
        the device has passed the step's last stamp (after the next step's one host sync), so
        reading the times never waits; ``wait``: every row now (before a checkpoint, an evaluation,
        the end)."""
        while self.pending and (wait or self.pending[0][0].ready):
            res, own = self.pending.pop(0)
            self.metrics.add(step_row(res, **own))

    # ---------------------------------------------------------------- Steps 4-5: epochs ---------
    def run_epoch(self, epoch: int) -> bool:
        """Train the rest of ``epoch``; True when ``run.max_steps`` stopped it."""
        r = self.cfg.run
        if self.sampler.global_batch != self.plan.batch_at(epoch) or self.sampler.epoch != epoch:
            self.sampler.set_epoch(epoch, self.plan.batch_at(epoch))
        sizes = self.sampler.global_sizes()
        batches = self.stream.epoch(self.sampler, augmentation_key(r.seed, epoch))
        while self.sampler.position < len(sizes):
            self.train_step(epoch, self.sampler.position, batches, sizes)
            if r.checkpoint_every and self.progress.step % r.checkpoint_every == 0 \
                    and self.sampler.position < len(sizes):
                self.save_checkpoint()
            if r.max_steps and self.progress.step >= r.max_steps:
                return True
        return False

    def evaluate_now(self, epoch: float, at_stop: bool = False) -> None:
        """Step 5: worker-averaged BN statistics, test accuracy and loss, time to accuracy (never of
        a diverged model: FloatingPointError instead)."""
        self.write_rows()
        self.step.check_parameters(f"after step {self.progress.step - 1}", buffers=True)
        average_buffers(self.model)
        acc, test_loss = evaluate(self.model, self.data.test, self.rank, self.world, self.device,
                                  workers=self.data_workers, autocast=self.step.autocast,
                                  channels_last=self.step.channels_last)
        p = self.progress
        p.elapsed_s = time.perf_counter() - self.t_start
        if p.tta_s is None and acc >= self.cfg.run.target_accuracy:
            p.tta_s = p.elapsed_s
        p.evals.append(Eval(epoch, p.step, acc, p.elapsed_s))
        self.metrics.add(eval_row(epoch=epoch, step=p.step, test_accuracy=acc, test_loss=test_loss,
                                  elapsed_s=p.elapsed_s, at_stop=at_stop or None))
        if self.bar is not None:
            self.bar.set_postfix(epoch=epoch, acc=f"{acc:.2f}%", refresh=True)

    def end_epoch(self, epoch: int) -> None:
        """Step 5: after the last step of ``epoch`` (0-based): evaluate when due, checkpoint."""
        done = epoch + 1
        self.progress.epoch = done
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
                if not self.progress.evals or self.progress.evals[-1].step != self.progress.step:
                    self.evaluate_now(epoch + self.sampler.position / len(self.sampler), at_stop=True)
                return
            self.end_epoch(epoch)
            epoch += 1

    def _what_failed(self, failures: list[BaseException]) -> str:
        """A failed collective in words: a timeout on a rank of another node (or, in a job of
        several nodes, a timeout that names no rank) may be a rank stopping or the link between
        nodes (the launcher, seeing every rank, tells them apart:
        :func:`flashsgd.launch.failures.lost_connections`); else a worker died or hung."""
        timeout_s = self.cfg.run.timeout_s
        late = next((e for e in failures
                     if isinstance(e, TimeoutError) and isinstance(getattr(e, "peer", None), int)), None)
        rpn = self.topology.ranks_per_node
        if late is not None and late.peer // rpn != self.rank // rpn:
            mine, theirs = self.rank // rpn, late.peer // rpn
            return (f"no data from rank {late.peer} (node {theirs}) within "
                    f"{getattr(late, 'timeout_s', timeout_s):g} s: rank {late.peer} stopped, or the "
                    f"connection between node {mine} and node {theirs} was lost")
        timed_out = any(isinstance(e, TimeoutError) or TIMEOUT_TEXT.search(str(e)) for e in failures)
        if late is None and timed_out and self.world > rpn:  # Gloo's own collectives name no rank
            return (f"a collective timed out after run.timeout_s={timeout_s:g} s: a worker died or hung, "
                    f"or the connection between nodes was lost")
        return f"a collective failed, so a worker died or hung longer than run.timeout_s={timeout_s:g} s"

    def run(self) -> dict[str, Any]:
        """Steps 4-6; returns the summary (rank 0) or {} (other ranks)."""
        r = self.cfg.run
        if self.rank == 0:
            print(self.plan.describe(self.topology.describe())
                  + f"\n  model       {self.cfg.model.model} "
                  f"({sum(p.numel() for p in self.model.parameters()):,} parameters) on {self.device}; "
                  f"tweaks: {'; '.join(self.model_tweaks) or 'none'}"
                  + (f"\n  auto        {self.auto['measured']}\n  auto        chose {self.auto['explain']}"
                     if self.auto else "")
                  + f"\n  start       {self.start.describe()}", flush=True)
            if r.progress:  # tqdm on a terminal, else a plain line every few seconds
                self.bar = progress_bar(self.plan.target_steps, initial=self.progress.step)
        self.t_start = time.perf_counter() - self.progress.elapsed_s
        try:
            self.train_loop()
        except RuntimeError as exc:  # a peer died or hung: say so, with the step
            failures = comm_failures(exc)
            if not failures:  # this rank's own error (a bad input, a bug): as it is
                raise
            err = RuntimeError(f"rank {self.rank}: failed at step {self.progress.step} - "
                               f"{self._what_failed(failures)} ({one_line(exc)})")
            err.ranks_per_node = self.topology.ranks_per_node  # the launcher's nodes (describe_exception)
            raise err from exc
        except OSError as exc:  # a full disk: the path and the OS error, never "a collective failed"
            if isinstance(exc, CheckpointWriteError):
                raise
            raise OSError(f"failed at step {self.progress.step}: {exc}") from exc
        self.write_rows()
        if self.bar is not None:
            self.bar.close()
        result = {}
        if self.rank == 0:
            result = summarize(self.plan, self.progress, self.topology, self.metrics, self.timer.seconds)
        self.metrics.close()
        return result
