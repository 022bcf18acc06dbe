"""What a training step and a stateful DDP hook tell each other: the loss scale, non-finite input,
and whether the step was kept.

Hooks with memory across steps (error-feedback residuals, DGC velocities, LARS layer norms,
PowerSGD's error and Q) break in two ways that a hook alone cannot see (Micikevicius et al. 2018,
"Mixed Precision Training", arXiv 1710.03740, loss scaling; torch's ``GradScaler``):

- under fp16 the bucket holds the gradient times the loss scale S (2^16 at the start, halved at
  each overflow, doubled after 2000 good steps): a memory kept in those units is mis-weighted at
  every change of S, and a norm taken from them is S times too large;
- a step the trainer skips (a non-finite loss or gradient on any rank, or the scaler's overflow)
  has already run the hook: its memories hold the poisoned step (a NaN residual stays NaN for the
  rest of the run) unless they are put back.

The protocol, for every hook state (``tests/test_hook_step.py`` checks that each state of the
catalog has it). It runs by itself inside any loop (a user's own torch AMP loop, Lightning,
Accelerate, the Hugging Face Trainer, ``flashsgd train``): the hook opens and closes the steps;
the loop only hands over its loss scaler, once (``register_hook(ddp, name, scaler=scaler)``, or
:meth:`use_scaler` on the state; the integrations pass their trainer's).

1. Open (:meth:`HookStep.arrive`, at the first bucket of a backward): the step before is closed
   (Step 4), and the new one starts from what the state holds now (by reference: the sparse hooks
   never edit a kept memory in place, they make new ones, so remembering costs no copy;
   PowerSGD's P and Q, which torch writes in place, are copied: (n + m) r values per matrix).
   The gradients that arrive are S times the true ones, S read from the scaler as a device
   tensor (``scaler.scale(1)``: public, no host sync; no scaler or a disabled one: 1).
2. Inside the hook: :meth:`HookStep.unscale_` turns the bucket into true gradient units (and
   notes a non-finite entry: one reduction per bucket, no host sync; the entry is exchanged as 0,
   since a NaN defeats every comparison of a selection and would make the ranks' message sizes
   differ), the exchange runs on true units, every memory is kept in them, and
   :meth:`HookStep.rescale_` gives DDP the bucket back in the units the scaler expects (it
   unscales after backward). S is a power of two, so the round trip is exact (bit-identical to
   fp32 units where nothing overflows).
3. Agree (:meth:`HookStep.finish_`, at the last bucket): one all-reduce of one value (the count of
   buckets that arrived non-finite, over the hook's group), and where it is not 0 the first entry of
   the last bucket DDP hands back is made +Inf on every rank. So the loop sees exactly what DDP's
   own all-reduce would have shown it (a NaN or Inf on any rank reaches every rank): GradScaler's
   ``unscale_`` finds the overflow, ``scaler.step`` skips ``optimizer.step`` and ``scaler.update``
   backs off the scale, on every rank alike, also where the sparse output never selected the
   non-finite entry.
4. Close (at the next step's first bucket, or in ``state_dict()``): the step is *skipped* when its
   gradients were non-finite on some rank (Step 3's agreed value) and no optimizer step ran after
   its backward (torch's public ``register_optimizer_step_post_hook``, counted for every optimizer
   of the process; GradScaler skips ``optimizer.step`` on an overflow, ``flashsgd train`` skips it
   on any non-finite step; a fused optimizer, which GradScaler calls on every step with its
   ``found_inf`` to skip inside the kernel, stepped where that is 0). A skipped step puts back everything ``state_dict()`` holds apart from
   its statistics (residuals, velocities, PowerSGD error, P and Q, the iteration, RNG streams, kept
   thresholds and their counters), and the LARS layer norms, bit for bit as they were at Step 1.
   The statistics (``stats``: bytes sent, buckets, remaps; torch's PowerSGD compression counters)
   count what happened, the skipped step included. A kept step keeps the new memories. Two
   backward passes per optimizer step without DDP's ``no_sync`` (accumulation in the exchange)
   are two kept steps of the hook when finite: nothing is rolled back unless it was non-finite.
   Not detected: a step the loop skips for a reason the hook cannot see (GradScaler finding an
   Inf in a gradient outside DDP's buckets) keeps the hook's memories.

The agreed value is read on the host only when Step 4 needs it (no optimizer step since: rare),
on CUDA from a pinned copy made when Step 3 ran (``event.synchronize()``: it waits for that
point of the previous backward only, long passed in practice). Without a scaler, such a step (non-
finite, and skipped by the loop, as GradScaler skips it) makes rank 0 warn once to pass
``scaler=``. Loss-scaled gradients without ``scaler=`` cannot be told from large ones, so that
mistake itself is not detected: docs/integrations.md says what to pass in each loop.

The same protocol by hand (``state.begin_step(grad_scale)`` before the backward,
``state.end_step(kept)`` after the decision) is still accepted: a step opened by hand is not
closed by the hook; Steps 2-3 run alike.

Cost: fp16 adds two passes over each bucket of a stateful hook (unscale, rescale); every step
adds one reduction per bucket (the non-finite check), one all-reduce of one value at the last
bucket (one alpha), and, on CUDA, one pass that zeroes non-finite entries (on the CPU only when
there are some); no host synchronization on CUDA. Memory: the memories a step started from and
the new ones both live while it is open, so each sparse memory is double-buffered (two
bucket-sized tensors per residual or velocity, written alternately: no allocation per step; the
write goes to the other buffer instead of adding in place).

Example::

    scaler = torch.amp.GradScaler("cuda")
    state = register_hook(ddp, "gtopk", density=0.01, scaler=scaler)   # the one extra keyword
    for x, y in loader:
        with torch.autocast("cuda", dtype=torch.float16):
            loss = loss_fn(ddp(x), y)
        scaler.scale(loss).backward()      # the hook runs in true units
        scaler.step(optimizer)             # skipped on an overflow on any rank ...
        scaler.update()                    # ... and then the hook's memories are put back
        optimizer.zero_grad()
"""

from __future__ import annotations

import warnings
from typing import Any

import torch
import torch.distributed as dist
from torch.optim.optimizer import register_optimizer_step_post_hook

from flashsgd.host_syncs import device_path

__all__ = ["HookStep", "optimizer_steps"]

_STEPS: dict[str, Any] = {"plain": 0, "conditional": 0, "found_inf": None, "handle": None}
"""Optimizer steps taken in this process: ``plain`` ones, and ``conditional`` ones (a fused or
capturable optimizer under GradScaler is called on every step with the scaler's ``found_inf`` set
on it, and skips inside its kernel where it is not 0; the last one's ``found_inf``)."""


def optimizer_steps() -> tuple[int, int]:
    """(plain, conditional) optimizer steps taken in this process since the first call (every
    ``torch.optim.Optimizer``: torch's global step post-hook, registered once; Step 4's "did an
    optimizer step run")."""
    if _STEPS["handle"] is None:
        def count(optimizer: Any, args: Any, kwargs: Any) -> None:
            # GradScaler hands a fused optimizer its found_inf as an attribute for the call (torch 2.x,
            # GradScaler.step), or as a keyword to an optimizer that takes one: the kernel skips
            found = getattr(optimizer, "found_inf", kwargs.get("found_inf"))
            if isinstance(found, torch.Tensor):  # GradScaler left the skip to the optimizer's kernel
                _STEPS["conditional"] += 1
                _STEPS["found_inf"] = found
            else:
                _STEPS["plain"] += 1
        _STEPS["handle"] = register_optimizer_step_post_hook(count)
    return _STEPS["plain"], _STEPS["conditional"]


class AgreedFlag:
    """Step 3's agreed count of non-finite buckets (``tensor``, on the buckets' device), readable on
    the host later without stalling the device: a CPU tensor is read directly; a CUDA one is
    copied to pinned memory at once (``non_blocking``) behind an event."""

    __slots__ = ("tensor", "host", "event")

    def __init__(self, flag: torch.Tensor) -> None:
        self.tensor, self.host, self.event = flag, flag, None
        if flag.is_cuda:
            self.host = torch.empty(flag.shape, dtype=flag.dtype, pin_memory=True)
            self.host.copy_(flag, non_blocking=True)
            self.event = torch.cuda.Event()
            self.event.record()

    def read(self) -> bool:
        """Whether some rank's input was non-finite (CUDA: waits for the device to reach Step 3 of
        that step, long passed when Step 4 asks)."""
        if self.event is not None:
            self.event.synchronize()
        return bool(self.host > 0)


class HookStep:
    """The training step as a hook state sees it (Steps 1-4 of the module docstring).

    Args:
        name: the hook's name (for its messages).

    Attributes:
        scaler: the loop's ``torch.amp.GradScaler`` (None: gradients in true units).
        scale: the loss scale the bucket gradients carry (0-dim tensor), None for 1.
        inverse: 1 / scale (computed once per step), None for 1.
        bad: buckets that arrived with a non-finite entry this step (0-dim float tensor, on the
            buckets' device), None before the first check.
        open: a step is open (Step 1 done, Step 4 not yet).
        by_hand: the open step was opened by ``begin_step`` (closed by ``end_step`` only).
        closed: the open step's last bucket has run (Step 3 done).
        agreed: Step 3's :class:`AgreedFlag`, None before it.
        steps_at_open: :func:`optimizer_steps` when the step opened.
        warned: the no-scaler warning was given.
    """

    __slots__ = ("name", "scaler", "scale", "inverse", "bad", "open", "by_hand", "closed", "agreed",
                 "steps_at_open", "warned")

    def __init__(self, name: str = "hook") -> None:
        self.name, self.scaler, self.warned = name, None, False
        self.end()

    # ------------------------------------------------------------------ opening and closing ---
    def begin(self, grad_scale: torch.Tensor | float | None, by_hand: bool = True) -> None:
        """Step 1: the gradients of the next exchanges are ``grad_scale`` times the true ones."""
        if grad_scale is not None and not isinstance(grad_scale, torch.Tensor):
            grad_scale = torch.tensor(float(grad_scale))
        self.scale, self.bad, self.open, self.by_hand = grad_scale, None, True, by_hand
        self.inverse = None if grad_scale is None else grad_scale.reciprocal()
        self.closed, self.agreed, self.steps_at_open = False, None, optimizer_steps()

    def end(self) -> None:
        """Step 4's bookkeeping: no step open, units as they arrive."""
        self.scale, self.inverse, self.bad, self.open, self.by_hand = None, None, None, False, False
        self.closed, self.agreed, self.steps_at_open = False, None, (0, 0)

    def loss_scale(self, device: torch.device) -> torch.Tensor | None:
        """The scaler's scale as a 0-dim tensor on ``device`` (``scaler.scale(1)``: no host sync);
        None without a scaler or with a disabled one."""
        if self.scaler is None:
            return None
        one = torch.ones((), device=device)
        scaled = self.scaler.scale(one)
        return None if scaled is one else scaled

    def arrive(self, state: Any, bucket: Any) -> None:
        """Steps 1 and 4 at each bucket: the first bucket of a backward closes the step before
        (``state.end_step(kept)``) and opens this one (``state.begin_step(scale)``). A step opened
        by hand is left to its caller."""
        if self.open and (self.by_hand or not self.closed):
            return
        self.settle(state)
        params = bucket.parameters()  # the scale on the parameters' device (a host-staged bucket's too)
        state.begin_step(self.loss_scale(params[0].device if params else bucket.buffer().device))
        self.by_hand = False

    def settle(self, state: Any) -> None:
        """Step 4 for a step the hook opened and whose backward is done: ``state.end_step(kept)``."""
        if self.open and not self.by_hand and self.closed:
            state.end_step(kept=self.kept())

    def kept(self) -> bool:
        """Step 4's decision: False when the step's gradients were non-finite on some rank and no
        optimizer step ran since it opened (the agreed count is read only then); a fused optimizer
        under GradScaler is called on every step and skips inside its kernel, so after such a
        call the step is skipped where the count is not 0 and the scaler's ``found_inf`` is not
        (the count read each step, from pinned memory; ``found_inf`` on a non-finite step only).
        Warns once (rank 0) when a skipped step had no scaler."""
        plain, conditional = optimizer_steps()
        if plain != self.steps_at_open[0] or self.agreed is None:
            return True
        bad = self.agreed.read()
        if conditional != self.steps_at_open[1]:
            return not (bad and bool(_STEPS["found_inf"] > 0))
        if bad and self.scaler is None and not self.warned:
            self.warned = True
            if not dist.is_initialized() or dist.get_rank() == 0:
                warnings.warn(
                    f"{self.name} hook: the gradients of a step were non-finite on some rank and the hook was "
                    "given no loss scaler. Under fp16 autocast with torch.amp.GradScaler, pass it: "
                    f"register_hook(ddp, {self.name!r}, ..., scaler=scaler) (or state.use_scaler(scaler)), "
                    "so that the hook keeps its memories in true gradient units and a step GradScaler "
                    "skips leaves them as they were (docs/integrations.md, mixed precision)",
                    UserWarning, stacklevel=2)
        return not bad

    # ------------------------------------------------------------------ inside the hook -------
    def unscale_(self, buf: torch.Tensor) -> torch.Tensor:
        """Step 2: note a non-finite entry of ``buf`` and exchange it as 0 (a step is open: a NaN
        must not reach a selection, where it defeats every comparison and the ranks' message sizes
        would differ; Step 3 shows it to the loop), then divide ``buf`` by the scale in place (a
        power of two: exact). Returns ``buf``."""
        if self.open and buf.numel():
            # one reduction: a NaN or Inf anywhere makes the sum non-finite
            flag = (~torch.isfinite(buf.sum())).float()
            self.bad = flag if self.bad is None else self.bad + flag.to(self.bad.device)
            # CUDA: one more pass rather than a host sync; the CPU reads the flag for free
            if device_path(buf) or flag.item():
                buf.nan_to_num_(nan=0.0, posinf=0.0, neginf=0.0)
        if self.scale is not None:
            buf.mul_(self.inverse.to(buf.device))
        return buf

    def rescale_(self, buf: torch.Tensor) -> torch.Tensor:
        """Step 2: the bucket back in the loss-scaled units DDP and the scaler expect. Returns it."""
        if self.scale is not None:
            buf.mul_(self.scale.to(buf.device))
        return buf

    def agree(self, buf: torch.Tensor, group: Any) -> None:
        """Step 3, first half (the last bucket, after its :meth:`unscale_`, in the order of the
        hook's other collectives): the count of non-finite buckets over ``group``, one all-reduce
        of one value (the group's timeout bounds it)."""
        if not self.open or self.agreed is not None:
            return
        flag = self.bad.clone() if self.bad is not None else torch.zeros((), device=buf.device)
        dist.all_reduce(flag, group=group)
        self.agreed = AgreedFlag(flag)

    def finish_(self, buf: torch.Tensor, last: bool, group: Any) -> torch.Tensor:
        """Step 3 at the last bucket (``last``): :meth:`agree` unless done, then the bucket DDP
        hands back shows an overflow (+Inf in its first entry) wherever the agreed count is not
        0, on every rank; the step's backward is done. Other buckets: ``buf`` as it is. Returns
        ``buf``."""
        if not (last and self.open):
            return buf
        self.agree(buf, group)
        flag = self.agreed.tensor
        if buf.numel() and (device_path(flag) or bool(flag > 0)):  # CUDA: a select, not a host read
            buf[:1].add_(torch.where(flag.to(buf.device) > 0, float("inf"), 0.0).to(buf.dtype))
        self.closed = True
        return buf
