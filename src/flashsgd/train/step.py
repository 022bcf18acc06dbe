"""One training step, the same in `flashsgd train` and in every benchmark that times a step.

Paper: Goyal et al. 2017, "Accurate, Large Minibatch SGD" (the loss normalized by the global
batch, so that DDP's average of the W workers' gradients is the gradient of the mean loss over
the global batch of B samples, whatever the shard sizes; no update from a corrupted step).

Used by :class:`flashsgd.train.worker.Worker` (``flashsgd train``), ``bench scaling``'s rank
(:mod:`flashsgd.bench.scaling_rank`), ``bench train`` (:mod:`flashsgd.bench.train`) and
``bench sparse --hook`` (:mod:`flashsgd.bench.sparse_hook`). Algorithm (:meth:`TrainStep.__call__`):

1. Data: set the learning rate, call the caller's ``batch()`` (sampling and augmentation), move the
   batch to the device; ``zero_grad``. With ``grad_accum`` N the shard is split into N micro-batches
   (``torch.tensor_split``: sizes differ by at most 1); Steps 2-3 run once per micro-batch.
2. Forward and loss (:meth:`forward_loss`): 4-D inputs in ``channels_last`` when asked, the model
   (or its ``torch.compile``), ``loss_fn`` summing over the (micro-)batch (``reduction="sum"``),
   under ``torch.autocast(device type, dtype)`` for bf16 / fp16; the loss sum is fp32.
3. Backward of ``loss_sum * W / B`` (B: the step's global batch, so the N micro-batches' gradients
   add up to the whole global batch's) through DDP: the hook exchanges the gradients (timed by the
   :class:`~flashsgd.train.rank.CommTimer` DDP's hook is wrapped in); the first N-1 micro-batches
   under DDP's ``no_sync()`` (gradients accumulate locally, no exchange). fp16: the loss is first
   multiplied by the loss scaler's scale (``torch.amp.GradScaler``), so the hook exchanges scaled
   gradients, which are unscaled after the exchange (``scaler.unscale_``).
4. Agreement: one all-reduce of ``[loss sum, samples, non-finite flags]`` (float64, made on the
   loss's device): every rank learns the global mean loss and whether any rank saw a NaN / Inf in
   its loss (counted in units of :data:`LOSS_FLAG`) or its gradient (units of 1).
5. Non-finite policy: ``"skip"`` zeroes the gradients and leaves the parameters, the optimizer
   state and the hook's memories alone (the optimizer does not step, so the hook puts back what
   it started from, as in any loop: :mod:`flashsgd.comm.hook_step`; it is handed the loss scaler,
   so that those memories are in true gradient units under fp16, and a non-finite input the
   sparse output did not select still reaches every rank's gradients, so Step 4 sees it; the
   result says ``skipped``; the caller counts), ``"stop"`` raises FloatingPointError naming the step;
   otherwise the optimizer steps. A skipped step also checks the parameters (one tiny all-reduce, on skipped steps only): skipping cannot recover from
   non-finite parameters (every later loss is NaN), so the run has diverged and the step raises
   FloatingPointError naming the first skipped step of the streak and what to try; so it does
   after ``max_skipped`` consecutive skipped steps (:meth:`check_parameters` is the same check
   for callers about to evaluate or checkpoint). fp16: through public GradScaler calls only
   (``scale``, ``unscale_``, ``update``; ``optimizer.step`` itself when Step 4 says so): every
   rank's gradients show a non-finite value of any rank (DDP's all-reduce, or the hook's Step 3
   agreement), so every rank's ``unscale_`` finds the same overflow and ``update`` keeps one
   scale everywhere; a step
   whose loss is finite on every rank but whose gradients overflow is the scaler's *overflow*
   skip (``StepResult.overflow``): counted and reported as skipped, the scale halved, but neither
   stopped by ``"stop"`` nor counted in the ``max_skipped`` streak while the scale is above 1
   (from GradScaler's 2^16 the early back-off is up to 16 skips in a row; a gradient that still
   overflows at a scale <= 1 is non-finite without any scaling, and counts).

Host syncs: exactly one per step, the read of Step 4's three agreed values (the loss, the
samples and the flag decide what Step 5 does, so that read must wait). Nothing else in the step
waits for the device: the phases are timed with :func:`flashsgd.timing.stamp` (CUDA events on the
device's timeline, elapsed times read when :attr:`StepResult.ready`, e.g. one step later; on CPU
``perf_counter``), the sample count is filled on the device (no host-to-device copy), the
non-finite check of the gradients is one batched ``torch._foreach_norm``, and fp16's loss scale
is kept on the device until read (:attr:`StepResult.loss_scale`). A skipped step adds the
parameter check (one more read). :func:`flashsgd.host_syncs.count_host_syncs` counts them (the
test of this promise: tests/test_host_syncs.py). With N micro-batches forward and backward are
the sums over them. Cost: one all-reduce of 3 float64 values per step beyond the gradient
exchange; fp16 adds one pass over the gradients (unscale).

Example::

    timer = CommTimer()
    ddp, _, _ = build_ddp(plan, model, device, timer)
    step = TrainStep(ddp, optimizer, torch.nn.CrossEntropyLoss(reduction="sum"), timer, device)
    result = step(lambda: data.train.batch(idx, True, key), global_batch=1024, lr=0.4, step=0)
    print(result.loss, result.skipped, result.times())
"""

from __future__ import annotations

import contextlib
from dataclasses import dataclass
from typing import Any, Callable, Literal

import torch
import torch.distributed as dist

from flashsgd.comm.hook_common import StatelessHookState, floating_tensors
from flashsgd.comm.hooks import hook_state_of
from flashsgd.fmt import plural
from flashsgd.timing import Stamp, elapsed_s, reached, stamp

PRECISIONS = {"fp32": None, "bf16": torch.bfloat16, "fp16": torch.float16}
"""``run.precision`` -> the autocast dtype (None: no autocast)."""

LOSS_FLAG = 2.0 ** 20
"""Step 4: a rank's non-finite loss counts this much in the agreed flag, a non-finite gradient 1
(so the flag tells the two apart for up to 2^20 ranks, in the same 3 values)."""

Batch = Callable[[], "tuple[torch.Tensor, torch.Tensor]"]

TRY = ("try a lower learning rate (optim.lr_per_ref), a longer warmup (optim.warmup_epochs), or "
       "run.nonfinite = 'stop' to stop at the first non-finite step")
"""What a diverged run's error suggests."""


def _where(step: int, epoch: int | None) -> str:
    return f"step {step}" + (f" (epoch {epoch})" if epoch is not None else "")


@dataclass(frozen=True)
class StepResult:
    """What one step did: the global mean loss, the global sample count, whether it was skipped,
    and the seconds of each phase on this rank. The phase times are read from the step's stamps
    (:func:`flashsgd.timing.stamp`) when asked: on CUDA, asking before :attr:`ready` waits for the
    device (the worker asks one step later, when they have passed)."""

    loss: float
    samples: int
    skipped: bool
    marks: tuple[Stamp, ...]
    """Start, batch on the device, backward done (with fp16's unscale), agreed, optimizer done."""
    forward_marks: tuple[tuple[Stamp, Stamp], ...]
    """(start, end) of each micro-batch's forward."""
    comm_spans: tuple[tuple[Stamp, Stamp], ...] = ()
    """(start, end) of each bucket's exchange (:class:`~flashsgd.train.rank.CommTimer`)."""
    overflow: bool = False
    """fp16: skipped for the loss scaler's gradient overflow (the loss was finite everywhere)."""
    scale: torch.Tensor | None = None
    """fp16: the loss scaler's scale after this step, on the device (read by :attr:`loss_scale`)."""

    @property
    def ready(self) -> bool:
        """Whether every phase time can be read without waiting for the device."""
        return reached(self.marks[-1]) and all(reached(b) for _, b in self.comm_spans)

    @property
    def data_s(self) -> float:
        return elapsed_s(self.marks[0], self.marks[1])

    @property
    def forward_s(self) -> float:
        return sum(elapsed_s(a, b) for a, b in self.forward_marks)

    @property
    def backward_s(self) -> float:
        """Backward, including the exchange of synchronous hooks (and fp16's unscale)."""
        return elapsed_s(self.marks[1], self.marks[2]) - self.forward_s

    @property
    def comm_s(self) -> float:
        """The hook's own seconds (overlaps backward when the hook is asynchronous)."""
        return sum(elapsed_s(a, b) for a, b in self.comm_spans)

    @property
    def sync_s(self) -> float:
        return elapsed_s(self.marks[2], self.marks[3])

    @property
    def optimizer_s(self) -> float:
        return elapsed_s(self.marks[3], self.marks[4])

    @property
    def total_s(self) -> float:
        return elapsed_s(self.marks[0], self.marks[4])

    @property
    def loss_scale(self) -> float | None:
        """fp16: the loss scaler's scale after this step (None without a scaler)."""
        return None if self.scale is None else float(self.scale)

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
        device: where the batch goes (and on whose timeline the phases are stamped).
        nonfinite: ``"skip"`` or ``"stop"`` (``run.nonfinite``).
        max_skipped: stop after this many consecutive skipped steps (``run.max_skipped``; 0: no
            bound; non-finite parameters stop the run at once either way).
        precision: ``"fp32"``, ``"bf16"`` or ``"fp16"`` (``run.precision``): autocast dtype of
            Step 2; fp16 also makes a ``torch.amp.GradScaler`` on ``device`` (:attr:`scaler`).
        grad_accum: micro-batches per optimizer step (``optim.grad_accum``).
        channels_last: 4-D inputs in ``torch.channels_last`` (the caller converts the model).
        forward: what Step 2 calls on the input (default ``ddp``; ``run.compile``: the compiled
            ``ddp``, :func:`flashsgd.train.rank.compile_model`).
        hook_state: the state :func:`flashsgd.comm.hooks.register_hook` returned for ``ddp``
            (None: the state registered on ``ddp``, if any): handed the fp16 loss scaler
            (``use_scaler``; the hook keeps its step protocol itself, :mod:`flashsgd.comm.hook_step`);
            a state without it (a hook of torch's own) is left alone.
    """

    __slots__ = ("ddp", "optimizer", "loss_fn", "timer", "device", "nonfinite", "max_skipped", "world",
                 "skipped_in_row", "first_skipped", "autocast", "scaler", "grad_accum", "channels_last",
                 "forward", "hook_state", "one")

    def __init__(self, ddp: torch.nn.Module, optimizer: torch.optim.Optimizer, loss_fn: Callable,
                 timer=None, device: torch.device | None = None,
                 nonfinite: Literal["skip", "stop"] = "skip", max_skipped: int = 0, *,
                 precision: Literal["fp32", "bf16", "fp16"] = "fp32", grad_accum: int = 1,
                 channels_last: bool = False, forward: Callable | None = None, hook_state: Any = None) -> None:
        if getattr(loss_fn, "reduction", "sum") != "sum":
            raise ValueError(f"loss_fn must sum over the batch (reduction='sum'), got "
                             f"reduction={loss_fn.reduction!r}: the step divides by the global batch")
        if nonfinite not in ("skip", "stop"):
            raise ValueError(f"nonfinite must be 'skip' or 'stop', got {nonfinite!r}")
        if precision not in PRECISIONS:
            raise ValueError(f"precision must be one of {', '.join(PRECISIONS)}, got {precision!r}")
        if grad_accum < 1:
            raise ValueError(f"grad_accum must be >= 1, got {grad_accum}")
        self.ddp, self.optimizer, self.loss_fn, self.timer = ddp, optimizer, loss_fn, timer
        self.device = device if device is not None else torch.device("cpu")
        self.nonfinite, self.max_skipped = nonfinite, max_skipped
        self.world = dist.get_world_size()
        self.autocast = PRECISIONS[precision]       # Step 2's dtype (None: fp32, no autocast)
        # Step 3/5: fp16's loss scaler, on the data's device (torch's CPU GradScaler too)
        self.scaler = torch.amp.GradScaler(self.device.type) if precision == "fp16" else None
        self.grad_accum, self.channels_last = grad_accum, channels_last
        self.forward = forward if forward is not None else ddp
        # the hook's side of the step (flashsgd.comm.hook_step) runs in the hook itself, as in any
        # loop: it is handed the loss scaler, the one thing it cannot find. Not given: the state
        # register_hook made for ddp, so it cannot be forgotten
        if hook_state is None:
            hook_state = hook_state_of(ddp)
        self.hook_state = hook_state if hasattr(hook_state, "use_scaler") else StatelessHookState("none")
        self.hook_state.use_scaler(self.scaler)
        self.one = torch.ones((), device=self.device)  # scaled by the scaler: the scale, no host sync
        self.skipped_in_row = 0                    # consecutive skipped steps (Step 5)
        self.first_skipped: tuple[int, int | None] | None = None  # (step, epoch) starting the streak

    # ------------------------------------------------------------------ the phases -------------
    def forward_loss(self, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        """Step 2: the loss summed over the (micro-)batch ``x`` (fp32, also under autocast)."""
        if self.channels_last and x.dim() == 4:
            x = x.contiguous(memory_format=torch.channels_last)
        if self.autocast is None:
            return self.loss_fn(self.forward(x), y)
        with torch.autocast(self.device.type, dtype=self.autocast):
            return self.loss_fn(self.forward(x), y).float()  # a sum over many samples: fp32

    def backward(self, loss_sum: torch.Tensor, global_batch: int) -> None:
        """Step 3: gradients of ``loss_sum * W / B`` (DDP averages them over the W ranks), added to
        ``.grad``; fp16: of the loss times the scaler's scale."""
        loss = loss_sum * (self.world / global_batch)
        if self.scaler is not None:
            loss = self.scaler.scale(loss)
        loss.backward()

    def exchange(self, sync: bool):
        """Steps 2-3 of an inner micro-batch (``sync=False``) run under DDP's ``no_sync()``: no
        exchange, the gradients accumulate locally (DDP decides in the forward, so the forward is
        inside it too)."""
        return contextlib.nullcontext() if sync or not hasattr(self.ddp, "no_sync") else self.ddp.no_sync()

    def micro_batches(self, x: torch.Tensor, y: torch.Tensor,
                      global_batch: int) -> list[tuple[torch.Tensor, torch.Tensor]]:
        """Step 1: the shard as ``grad_accum`` micro-batches (sizes differ by at most one);
        ValueError, on every rank alike, when the smallest shard of ``global_batch`` (B // W: the
        sampler's shards differ by at most one) cannot give each one a sample."""
        if self.grad_accum == 1:
            return [(x, y)]
        if min(len(y), global_batch // self.world) < self.grad_accum:
            raise ValueError(f"a shard of {plural(min(len(y), global_batch // self.world), 'sample')} cannot be "
                             f"split into grad_accum = {self.grad_accum} micro-batches of >= 1 sample "
                             f"(optim.grad_accum)")
        return list(zip(torch.tensor_split(x, self.grad_accum), torch.tensor_split(y, self.grad_accum)))

    def agree(self, loss_sum: torch.Tensor, samples: int) -> torch.Tensor:
        """Step 4: ``[global loss sum, global samples, ranks with a non-finite value]`` (float64),
        built on the loss's device without a host sync."""
        loss = loss_sum.detach()
        grads = [p.grad for p in self.ddp.parameters() if p.grad is not None]
        bad = (~torch.isfinite(loss)).float() * LOSS_FLAG
        if grads:  # sum_i |g_i| per tensor, one batched kernel: NaN and Inf propagate into it
            l1 = torch.stack(torch._foreach_norm(grads, 1)).sum()
            bad = (~torch.isfinite(l1)).float().to(loss.device) + bad
        count = torch.full((), float(samples), dtype=torch.float64, device=loss.device)  # a fill, no copy
        stats = torch.stack([loss.double(), count, bad.double()])
        dist.all_reduce(stats)
        return stats

    def apply(self, skipped: bool, step: int, epoch: int | None, overflow: bool = False) -> bool:
        """Step 5: the optimizer step, or the non-finite policy; fp16: the scaler's update (from what
        its ``unscale_`` found: the same on every rank). ``overflow``: only gradients were non-finite (the loss was finite on every
        rank). Returns whether the skip was the loss scaler's overflow skip (see the module
        docstring)."""
        before = self.scaler.get_scale() if self.scaler is not None and skipped else None  # skipped only
        # a gradient that overflows at a scale <= 1 is non-finite without any scaling
        overflow = skipped and overflow and before is not None and before > 1.0
        if overflow:  # the scaler's normal back-off: the scale halves, the streak is not advanced
            self._back_off(before)
            self.optimizer.zero_grad(set_to_none=False)
            self.check_parameters(f"at {_where(step, epoch)}")
            return True
        if skipped and self.nonfinite == "stop":
            raise FloatingPointError(f"non-finite loss or gradient at {_where(step, epoch)}; "
                                     "set run.nonfinite = 'skip' to skip such steps instead")
        if not skipped:
            self.skipped_in_row, self.first_skipped = 0, None
            self.optimizer.step()  # fp16: on the unscaled gradients (Step 3)
            if self.scaler is not None:
                self.scaler.update()
            return False
        if self.scaler is not None:
            self._back_off(before)
        self.optimizer.zero_grad(set_to_none=False)
        self.skipped_in_row += 1
        if self.first_skipped is None:
            self.first_skipped = (step, epoch)
        self.check_parameters(f"at {_where(step, epoch)}")
        if self.max_skipped and self.skipped_in_row >= self.max_skipped:
            raise FloatingPointError(
                f"training diverged: {plural(self.skipped_in_row, 'step')} in a row "
                f"{'was' if self.skipped_in_row == 1 else 'were'} skipped for a non-finite "
                f"loss or gradient (run.max_skipped = {self.max_skipped}), the first at "
                f"{_where(*self.first_skipped)}; {TRY}")
        return False

    def _back_off(self, before: float) -> None:
        """fp16, a skipped step: ``scaler.update()``, which backs the scale off where this rank's
        ``unscale_`` found the overflow (every rank, with DDP's all-reduce or a flashsgd hook: the
        overflow reaches every rank's gradients). Where it did not (a non-finite loss with finite
        gradients, or a hook that leaves a peer's overflow on the peer: ``noop``), the same back-off
        is set through the scaler's public state dict, so that every rank keeps one scale and one
        growth count."""
        self.scaler.update()
        if self.scaler.get_scale() >= before:
            state = self.scaler.state_dict()
            state.update(scale=before * state["backoff_factor"], _growth_tracker=0)
            self.scaler.load_state_dict(state)

    def check_parameters(self, where: str, buffers: bool = False, memories: Any = None) -> None:
        """FloatingPointError when any rank holds a non-finite parameter, or with ``buffers`` a
        non-finite floating buffer (BN running statistics, which a skipped step's forward has
        updated), or a non-finite tensor in ``memories`` (the hook's state_dict about to be
        checkpointed: error-feedback residuals are never checkpointed non-finite); collective: one
        all-reduce of three values, on every rank. ``where``: "at step 7 (epoch 0)", "after step
        119"."""
        model = self.ddp.module if hasattr(self.ddp, "module") else self.ddp

        def bad(tensors):
            tensors = [t.detach() for t in tensors]
            return torch.stack([(~torch.isfinite(t)).any() for t in tensors]).any().double() if tensors \
                else torch.zeros((), dtype=torch.float64)

        flags = torch.stack([bad(model.parameters()).cpu(), bad(
            [b for b in model.buffers() if b.is_floating_point()] if buffers else []).cpu(),
            bad(floating_tensors(memories) if memories is not None else []).cpu()]).to(self.device)
        dist.all_reduce(flags)
        if flags.sum().item() > 0:
            what = ("model's parameters" if flags[0].item() > 0 else "model's BatchNorm running statistics "
                    "(buffers)" if flags[1].item() > 0 else f"{getattr(self.hook_state, 'algorithm', 'hook')} "
                    "hook's memories (error feedback; not checkpointed)")
            first = (f"; the first non-finite loss or gradient was at {_where(*self.first_skipped)}, "
                     f"then {plural(self.skipped_in_row, 'step')} in a row "
                     f"{'was' if self.skipped_in_row == 1 else 'were'} skipped") if self.first_skipped else ""
            raise FloatingPointError(f"training diverged: the {what} are non-finite {where}{first}; "
                                     f"skipping steps cannot recover; {TRY}")

    # ------------------------------------------------------------------ one step ---------------
    def __call__(self, batch: Batch, global_batch: int, *, lr: float | None = None, step: int = 0,
                 epoch: int | None = None, poison: bool = False) -> StepResult:
        """Steps 1-5 on ``batch()`` (this rank's shard of a global batch of ``global_batch``
        samples) at learning rate ``lr`` (None: as the optimizer has it); ``step`` and ``epoch``
        name the step in errors; ``poison`` makes the loss NaN (fault-injection tests)."""
        dev = self.device
        t0 = stamp(dev)
        if lr is not None:                                                             # Step 1
            for group in self.optimizer.param_groups:
                group["lr"] = lr
        x, y = batch()
        x, y = x.to(dev, non_blocking=True), y.to(dev, non_blocking=True)
        micro = self.micro_batches(x, y, global_batch)
        self.optimizer.zero_grad(set_to_none=False)
        if self.timer is not None:
            self.timer.take()  # exchanges before this step (a bucket rebuild) are not its own
        t1 = stamp(dev)
        forward: list[tuple[Stamp, Stamp]] = []
        loss_total = None
        for i, (xm, ym) in enumerate(micro):
            with self.exchange(sync=i == len(micro) - 1):
                ta = stamp(dev) if i else t1
                loss_sum = self.forward_loss(xm, ym)                                   # Step 2
                if poison:
                    loss_sum = loss_sum * float("nan")
                forward.append((ta, stamp(dev)))
                self.backward(loss_sum, global_batch)                                  # Step 3
            loss_total = loss_sum if loss_total is None else loss_total + loss_sum.detach()
        if self.scaler is not None:  # the hook exchanged scaled gradients: unscale before Step 4
            self.scaler.unscale_(self.optimizer)
        t3 = stamp(dev)
        stats = self.agree(loss_total, len(y))                                         # Step 4
        t4 = stamp(dev)
        loss_sum_all, samples, flags = stats.tolist()  # the step's one host sync
        skipped = flags > 0
        overflow = self.apply(skipped, step, epoch, overflow=0 < flags < LOSS_FLAG)   # Step 5
        # fp16: the updated scale, copied on the device (reading it now would be a second sync)
        scale = self.scaler.scale(self.one) if self.scaler is not None else None
        t5 = stamp(dev)
        return StepResult(loss=loss_sum_all / samples, samples=int(samples), skipped=bool(skipped),
                          marks=(t0, t1, t3, t4, t5), forward_marks=tuple(forward),
                          comm_spans=self.timer.take() if self.timer is not None else (),
                          overflow=overflow, scale=scale)
