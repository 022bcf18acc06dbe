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
catalog has it):

1. ``state.begin_step(grad_scale)`` before the step's backward: the gradients that arrive are
   ``grad_scale`` (a 0-dim tensor, or None for 1) times the true ones; the state remembers what
   it holds now (by reference: the sparse hooks never edit a kept memory in place, they make new
   ones, so remembering costs no copy; PowerSGD's P and Q, which torch writes in place, are
   copied: (n + m) r values per matrix).
2. Inside the hook: :meth:`HookStep.unscale_` turns the bucket into true gradient units (and
   notes a non-finite entry: one reduction per bucket, no host sync), the exchange runs on true
   units, every memory is kept in them, and :meth:`HookStep.rescale_` gives DDP the bucket back
   in the units the scaler expects (it unscales after backward). S is a power of two, so the
   round trip is exact (bit-identical to fp32 units where nothing overflows).
3. ``state.nonfinite_inputs()``: a 0-dim tensor counting buckets that arrived non-finite on this
   rank (None: no step open), which the step adds to its agreed non-finite flag, so that a NaN
   a sparse exchange did not select (and the output does not show) still skips the step
   everywhere.
4. ``state.end_step(kept)`` after the agreed decision: kept, the new memories stay; skipped,
   everything ``state_dict()`` holds apart from its statistics (residuals, velocities, PowerSGD
   error, P and Q, the iteration, RNG streams, kept thresholds and their counters), and the LARS
   layer norms, is exactly what it was at step 1, bit for bit. The statistics (``stats``: bytes
   sent, buckets, remaps; torch's PowerSGD compression counters) count what happened, the
   skipped step included.

A hook used without the protocol (no ``begin_step``: a user's own loop, or a trainer that has not
called it) works as before: units as they arrive, nothing to roll back.

Cost: fp16 adds two passes over each bucket of a stateful hook (unscale, rescale); every step
adds one reduction per bucket (the non-finite check) and, on CUDA, one pass that zeroes non-finite
entries (on the CPU only when there are some); no host synchronization on CUDA. Memory: the memories a step started from and the new ones both
live while it is open, so each sparse memory is double-buffered (two bucket-sized tensors per
residual or velocity, written alternately: no allocation per step; the write goes to the other
buffer instead of adding in place).

Example::

    state.begin_step(scaler.scale(torch.ones((), device=device)) if scaler else None)
    loss.backward()                                   # the hook runs in true units
    bad = state.nonfinite_inputs()                    # added to the agreed flag
    state.end_step(kept=not skipped)
"""

from __future__ import annotations

import torch

__all__ = ["HookStep"]


class HookStep:
    """One open training step as a hook state sees it (Steps 1-3 of the module docstring).

    Attributes:
        scale: the loss scale the bucket gradients carry (0-dim tensor), None for 1.
        inverse: 1 / scale (computed once per step), None for 1.
        bad: buckets that arrived with a non-finite entry this step (0-dim float tensor, on the
            buckets' device), None before the first check.
        open: a step is open (``begin`` called, ``end`` not yet).
    """

    __slots__ = ("scale", "inverse", "bad", "open")

    def __init__(self) -> None:
        self.scale: torch.Tensor | None = None
        self.inverse: torch.Tensor | None = None
        self.bad: torch.Tensor | None = None
        self.open = False

    def begin(self, grad_scale: torch.Tensor | None) -> None:
        """Step 1: the gradients of the next exchanges are ``grad_scale`` times the true ones."""
        if grad_scale is not None and not isinstance(grad_scale, torch.Tensor):
            grad_scale = torch.tensor(float(grad_scale))
        self.scale, self.bad, self.open = grad_scale, None, True
        self.inverse = None if grad_scale is None else grad_scale.reciprocal()

    def end(self) -> None:
        """Step 4's bookkeeping: no step open, units as they arrive."""
        self.scale, self.inverse, self.bad, self.open = None, None, None, False

    def unscale_(self, buf: torch.Tensor) -> torch.Tensor:
        """Step 2: note a non-finite entry of ``buf`` and exchange it as 0 (a step is open: the
        step will be skipped, and a NaN must not reach a selection, where it defeats every
        comparison and the ranks' message sizes would differ), then divide ``buf`` by the scale in
        place (a power of two: exact). Returns ``buf``."""
        if self.open and buf.numel():
            # one reduction: a NaN or Inf anywhere makes the sum non-finite
            flag = (~torch.isfinite(buf.sum())).float()
            self.bad = flag if self.bad is None else self.bad + flag.to(self.bad.device)
            # CUDA: one more pass rather than a host sync; the CPU reads the flag for free
            if buf.is_cuda or flag.item():
                buf.nan_to_num_(nan=0.0, posinf=0.0, neginf=0.0)
        if self.scale is not None:
            buf.mul_(self.inverse.to(buf.device))
        return buf

    def rescale_(self, buf: torch.Tensor) -> torch.Tensor:
        """Step 2: the bucket back in the loss-scaled units DDP and the scaler expect. Returns it."""
        if self.scale is not None:
            buf.mul_(self.scale.to(buf.device))
        return buf
