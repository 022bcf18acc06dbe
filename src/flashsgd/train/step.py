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
   FloatingPointError naming the step; otherwise the optimizer steps.

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
    """

    __slots__ = ("ddp", "optimizer", "loss_fn", "timer", "device", "nonfinite", "world")

    def __init__(self, ddp: torch.nn.Module, optimizer: torch.optim.Optimizer, loss_fn: Callable,
                 timer=None, device: torch.device | None = None,
                 nonfinite: Literal["skip", "stop"] = "skip") -> None:
        if getattr(loss_fn, "reduction", "sum") != "sum":
            raise ValueError(f"loss_fn must sum over the batch (reduction='sum'), got "
                             f"reduction={loss_fn.reduction!r}: the step divides by the global batch")
        if nonfinite not in ("skip", "stop"):
            raise ValueError(f"nonfinite must be 'skip' or 'stop', got {nonfinite!r}")
        self.ddp, self.optimizer, self.loss_fn, self.timer = ddp, optimizer, loss_fn, timer
        self.device = device if device is not None else torch.device("cpu")
        self.nonfinite = nonfinite
        self.world = dist.get_world_size()

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
            where = f"step {step}" + (f" (epoch {epoch})" if epoch is not None else "")
            raise FloatingPointError(f"non-finite loss or gradient at {where}; "
                                     "set run.nonfinite = 'skip' to skip such steps instead")
        if skipped:
            self.optimizer.zero_grad(set_to_none=False)
        else:
            self.optimizer.step()

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
