"""One training step, the same in `flashsgd train` and in every benchmark that times a step.

Paper: Goyal et al. 2017, "Accurate, Large Minibatch SGD" (the loss normalized by the global
batch, so that DDP's average of the W workers' gradients is the gradient of the mean loss over
the global batch of B samples, whatever the shard sizes; no update from a corrupted step).

Used by :class:`flashsgd.train.worker.Worker` (``flashsgd train``), ``bench scaling``'s rank
(:mod:`flashsgd.bench.scaling_rank`), ``bench train`` (:mod:`flashsgd.bench.train`) and
``bench sparse --hook`` (:mod:`flashsgd.bench.sparse_hook`). Algorithm (:meth:`TrainStep.__call__`):

1. Data: set the learning rate, call the caller's ``batch()`` (sampling and augmentation), move the
   batch to the device.
2. Forward and loss: ``loss_fn`` sums over the local shard (``reduction="sum"``).
3. ``zero_grad``, then backward of ``loss_sum * W / B`` through DDP: the hook exchanges the
   gradients (timed by the :class:`~flashsgd.train.rank.CommTimer` DDP's hook is wrapped in).
4. Agreement: one all-reduce of ``[loss sum, samples, non-finite flag]`` (float64, made on the
   loss's device): every rank learns the global mean loss and whether any rank saw a NaN / Inf in
   its loss or gradient.
5. Non-finite policy: ``"skip"`` zeroes the gradients and leaves the parameters and the optimizer
   state alone (the result says ``skipped``; the caller counts), ``"stop"`` raises
   FloatingPointError naming the step; otherwise the optimizer steps. A skipped step also checks
   the parameters (one tiny all-reduce, on skipped steps only): skipping cannot recover from
   non-finite parameters (every later loss is NaN), so the run has diverged and the step raises
   FloatingPointError naming the first skipped step of the streak and what to try; so it does
   after ``max_skipped`` consecutive skipped steps (:meth:`check_parameters` is the same check
   for callers about to evaluate or checkpoint).

Each phase is timed with :func:`flashsgd.timing.clock` (on CUDA, after a synchronize). Cost: one
all-reduce of 3 float64 values per step beyond the gradient exchange. Mixed precision and gradient
accumulation belong in Steps 2-3 and 5 (:meth:`forward_loss`, :meth:`backward`, :meth:`apply`).

Example::

    timer = CommTimer()
    ddp, _, _ = build_ddp(plan, model, device, timer)
    step = TrainStep(ddp, optimizer, torch.nn.CrossEntropyLoss(reduction="sum"), timer, device)
    result = step(lambda: data.train.batch(idx, aug, train=True), global_batch=1024, lr=0.4, step=0)
    print(result.loss, result.skipped, result.times())
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable, Literal

import torch
import torch.distributed as dist

from flashsgd.timing import clock

Batch = Callable[[], "tuple[torch.Tensor, torch.Tensor]"]

TRY = ("try a lower learning rate (optim.lr_per_ref), a longer warmup (optim.warmup_epochs), or "
       "run.nonfinite = 'stop' to stop at the first non-finite step")
"""What a diverged run's error suggests."""


def _where(step: int, epoch: int | None) -> str:
    return f"step {step}" + (f" (epoch {epoch})" if epoch is not None else "")


@dataclass(frozen=True)
class StepResult:
    """What one step did: the global mean loss, the global sample count, whether it was skipped,
    and the seconds of each phase on this rank."""

    loss: float
    samples: int
    skipped: bool
    data_s: float
    forward_s: float
    backward_s: float
    """Backward, including the exchange of synchronous hooks."""
    comm_s: float
    """The hook's own seconds (CommTimer; overlaps backward when the hook is asynchronous)."""
    sync_s: float
    optimizer_s: float

    @property
    def total_s(self) -> float:
        return self.data_s + self.forward_s + self.backward_s + self.sync_s + self.optimizer_s

    def times(self) -> dict[str, float]:
        """{phase: seconds}: data, forward, backward, comm, sync, optimizer."""
        return {"data": self.data_s, "forward": self.forward_s, "backward": self.backward_s,
                "comm": self.comm_s, "sync": self.sync_s, "optimizer": self.optimizer_s}


class TrainStep:
    """Forward, loss, backward through DDP + hook, agreement, non-finite policy, optimizer step.

    Args:
        ddp: the DDP-wrapped model (its hook registered, wrapped by ``timer``).
        optimizer: the recipe's optimizer over ``ddp``'s parameters.
        loss_fn: a loss with ``reduction="sum"`` (Step 3 normalizes by the global batch).
        timer: the :class:`~flashsgd.train.rank.CommTimer` the hook was registered with (or None:
            ``comm_s`` is 0).
        device: where the batch goes (and whose clock is synchronized).
        nonfinite: ``"skip"`` or ``"stop"`` (``run.nonfinite``).
        max_skipped: stop after this many consecutive skipped steps (``run.max_skipped``; 0: no
            bound; non-finite parameters stop the run at once either way).
    """

    __slots__ = ("ddp", "optimizer", "loss_fn", "timer", "device", "nonfinite", "max_skipped", "world",
                 "skipped_in_row", "first_skipped")

    def __init__(self, ddp: torch.nn.Module, optimizer: torch.optim.Optimizer, loss_fn: Callable,
                 timer=None, device: torch.device | None = None,
                 nonfinite: Literal["skip", "stop"] = "skip", max_skipped: int = 0) -> None:
        if getattr(loss_fn, "reduction", "sum") != "sum":
            raise ValueError(f"loss_fn must sum over the batch (reduction='sum'), got "
                             f"reduction={loss_fn.reduction!r}: the step divides by the global batch")
        if nonfinite not in ("skip", "stop"):
            raise ValueError(f"nonfinite must be 'skip' or 'stop', got {nonfinite!r}")
        self.ddp, self.optimizer, self.loss_fn, self.timer = ddp, optimizer, loss_fn, timer
        self.device = device if device is not None else torch.device("cpu")
        self.nonfinite, self.max_skipped = nonfinite, max_skipped
        self.world = dist.get_world_size()
        self.skipped_in_row = 0                    # consecutive skipped steps (Step 5)
        self.first_skipped: tuple[int, int | None] | None = None  # (step, epoch) starting the streak

    # ------------------------------------------------------------------ the phases -------------
    def forward_loss(self, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        """Step 2: the loss summed over the local shard."""
        return self.loss_fn(self.ddp(x), y)

    def backward(self, loss_sum: torch.Tensor, global_batch: int) -> None:
        """Step 3: gradients of ``loss_sum * W / B`` (DDP averages them over the W ranks)."""
        self.optimizer.zero_grad(set_to_none=False)
        (loss_sum * (self.world / global_batch)).backward()

    def agree(self, loss_sum: torch.Tensor, samples: int) -> torch.Tensor:
        """Step 4: ``[global loss sum, global samples, ranks with a non-finite value]`` (float64)."""
        loss = loss_sum.detach()
        grads = [p.grad for p in self.ddp.parameters() if p.grad is not None]
        bad = (~torch.isfinite(loss)).float()
        if grads:
            bad = (~torch.isfinite(torch.stack([g.sum() for g in grads]).sum())).float().to(loss.device) + bad
        stats = torch.stack([loss.double(), torch.tensor(float(samples), dtype=torch.float64, device=loss.device),
                             bad.double()])
        dist.all_reduce(stats)
        return stats

    def apply(self, skipped: bool, step: int, epoch: int | None) -> None:
        """Step 5: the optimizer step, or the non-finite policy."""
        if skipped and self.nonfinite == "stop":
            raise FloatingPointError(f"non-finite loss or gradient at {_where(step, epoch)}; "
                                     "set run.nonfinite = 'skip' to skip such steps instead")
        if not skipped:
            self.skipped_in_row, self.first_skipped = 0, None
            self.optimizer.step()
            return
        self.optimizer.zero_grad(set_to_none=False)
        self.skipped_in_row += 1
        if self.first_skipped is None:
            self.first_skipped = (step, epoch)
        self.check_parameters(f"at {_where(step, epoch)}")
        if self.max_skipped and self.skipped_in_row >= self.max_skipped:
            raise FloatingPointError(
                f"training diverged: {self.skipped_in_row} steps in a row were skipped for a non-finite "
                f"loss or gradient (run.max_skipped = {self.max_skipped}), the first at "
                f"{_where(*self.first_skipped)}; {TRY}")

    def check_parameters(self, where: str, buffers: bool = False) -> None:
        """FloatingPointError when any rank holds a non-finite parameter, or with ``buffers`` a
        non-finite floating buffer (BN running statistics, which a skipped step's forward has
        updated); collective: one all-reduce of two values, on every rank. ``where``: "at step 7
        (epoch 0)", "after step 119"."""
        model = self.ddp.module if hasattr(self.ddp, "module") else self.ddp

        def bad(tensors):
            tensors = [t.detach() for t in tensors]
            return torch.stack([(~torch.isfinite(t)).any() for t in tensors]).any().double() if tensors \
                else torch.zeros((), dtype=torch.float64)

        flags = torch.stack([bad(model.parameters()).cpu(), bad(
            [b for b in model.buffers() if b.is_floating_point()] if buffers else []).cpu()]).to(self.device)
        dist.all_reduce(flags)
        if flags.sum().item() > 0:
            what = "parameters" if flags[0].item() > 0 else "BatchNorm running statistics (buffers)"
            first = (f"; the first non-finite loss or gradient was at {_where(*self.first_skipped)}, "
                     f"then {self.skipped_in_row} step(s) in a row were skipped") if self.first_skipped else ""
            raise FloatingPointError(f"training diverged: the model's {what} are non-finite {where}{first}; "
                                     f"skipping steps cannot recover; {TRY}")

    # ------------------------------------------------------------------ one step ---------------
    def __call__(self, batch: Batch, global_batch: int, *, lr: float | None = None, step: int = 0,
                 epoch: int | None = None, poison: bool = False) -> StepResult:
        """Steps 1-5 on ``batch()`` (this rank's shard of a global batch of ``global_batch``
        samples) at learning rate ``lr`` (None: as the optimizer has it); ``step`` and ``epoch``
        name the step in errors; ``poison`` makes the loss NaN (fault-injection tests)."""
        t0 = clock(self.device)
        if lr is not None:                                                             # Step 1
            for group in self.optimizer.param_groups:
                group["lr"] = lr
        x, y = batch()
        x, y = x.to(self.device, non_blocking=True), y.to(self.device, non_blocking=True)
        comm0 = self.timer.seconds if self.timer is not None else 0.0
        t1 = clock(self.device)
        loss_sum = self.forward_loss(x, y)                                             # Step 2
        if poison:
            loss_sum = loss_sum * float("nan")
        t2 = clock(self.device)
        self.backward(loss_sum, global_batch)                                          # Step 3
        t3 = clock(self.device)
        stats = self.agree(loss_sum, len(y))                                           # Step 4
        t4 = clock(self.device)
        skipped = stats[2].item() > 0
        self.apply(skipped, step, epoch)                                               # Step 5
        t5 = clock(self.device)
        comm = (self.timer.seconds - comm0) if self.timer is not None else 0.0
        return StepResult(loss=stats[0].item() / stats[1].item(), samples=int(stats[1].item()),
                          skipped=bool(skipped), data_s=t1 - t0, forward_s=t2 - t1, backward_s=t3 - t2,
                          comm_s=comm, sync_s=t4 - t3, optimizer_s=t5 - t4)
