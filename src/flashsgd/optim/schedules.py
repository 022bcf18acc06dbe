"""Learning-rate and batch-size schedules as pure functions of an explicit position in training.

Papers: Goyal et al. 2017 (linear scaling rule, gradual warmup, step decay; arXiv 1706.02677);
Mikami et al. 2018 (batch-size control; arXiv 1811.05233); You et al. 2017 / MLPerf (polynomial
decay with LARS); Loshchilov & Hutter 2017 (cosine decay).

Positions are measured in **epochs** (a float: ``3.5`` is half-way through the fourth epoch), so
that warmup and decay lengths mean the same thing whatever the batch size; :func:`epoch_at_step`
turns an explicit global step index into that float under a batch-size table. The LR at a point
in training is::

    lr(t) = scaled_lr(lr_per_ref, batch_at(t)) * warmup(t) * decay(t)

1. Linear scaling (Goyal): ``lr = lr_per_ref * global_batch / ref_batch`` (LR per ``ref_batch``
   samples in, 256 by default; effective LR out), saturating at ``lr_max`` when one is set
   (McCandlish et al. 2018: ``L / (1 + L / lr_max)`` for the linear ``L``; :func:`scaled_lr`).
   With batch-size control the scaled LR follows the current batch.
2. Gradual warmup over ``warmup_epochs``: the factor grows linearly (per step, via the fractional
   epoch) from ``warmup_start_factor`` to 1. ``warmup_start_factor=None`` is Goyal's rule: start
   at the reference-batch LR, i.e. factor ``ref_batch / global_batch``.
3. Decay after warmup: ``step`` (multiply by ``gamma`` at each milestone epoch), ``poly``
   (``(1 - p) ** power`` with ``p`` the post-warmup progress in [0, 1]), ``cosine``
   (``(1 + cos(pi p)) / 2``), or ``none``; ``final_factor`` is the floor for poly and cosine.

Example::

    >>> s = Schedule(lr_per_ref=0.1, epochs=90, warmup_epochs=5, warmup_start_factor=None, decay="step",
    ...              milestones=(30, 60, 80))
    >>> table = BatchTable.constant(8192)
    >>> round(lr_at(0.0, s, table), 4), round(lr_at(5.0, s, table), 4), round(lr_at(85.0, s, table), 6)
    (0.1, 3.2, 0.0032)
    >>> sched = lambda_lr(optimizer, s, table, num_samples=1_281_167)  # doctest: +SKIP
"""

from __future__ import annotations

import bisect
import math
import operator
from dataclasses import dataclass
from typing import Literal

import torch

DecayKind = Literal["none", "step", "poly", "cosine"]


def as_int(name: str, value: object, minimum: int = 1) -> int:
    """``value`` as a plain int (any integral number: ``int``, ``numpy.int64``, a 0-d integer tensor).

    ``operator.index`` accepts exactly the integral types (floats such as ``512.0`` are refused,
    never truncated); ``bool`` is refused too. Raises ``ValueError`` naming ``name``.
    """
    try:
        if isinstance(value, bool):
            raise TypeError
        n = operator.index(value)
    except TypeError:
        raise ValueError(f"{name} must be an integer >= {minimum}, got {value!r} "
                         f"({type(value).__name__})") from None
    if n < minimum:
        raise ValueError(f"{name} must be an integer >= {minimum}, got {n!r}")
    return n


def scaled_lr(lr_per_ref: float, global_batch: int, ref_batch: int = 256,
              lr_max: float | None = None) -> float:
    """The LR for ``global_batch`` given the LR per ``ref_batch`` samples: the linear scaling rule
    ``L = lr_per_ref * global_batch / ref_batch`` (Goyal et al. 2017, sec. 2.1), saturating at
    ``lr_max`` when it is set.

    Saturation (McCandlish et al. 2018, "An Empirical Model of Large-Batch Training", arXiv
    1812.06162, for SGD): the best LR grows linearly while the batch is below the gradient
    noise scale ``B_noise`` and levels off above it, ``lr(B) = lr_max / (1 + B_noise / B)``. Its
    small-batch slope is ``lr_max / B_noise``, which is ``lr_per_ref / ref_batch``, so
    ``B_noise = lr_max * ref_batch / lr_per_ref`` and ``lr = L / (1 + L / lr_max)``: the linear
    rule below ``B_noise`` (within 2x at it), ``lr_max`` far above it.

    Example::

        >>> scaled_lr(0.1, 8192)  # Goyal et al.: 0.1 per 256 -> 3.2 at 8k
        3.2
        >>> round(scaled_lr(0.1, 8192, lr_max=3.2), 3), round(scaled_lr(0.1, 128, lr_max=3.2), 4)
        (1.6, 0.0492)
    """
    if not (math.isfinite(lr_per_ref) and lr_per_ref >= 0.0):
        raise ValueError(f"lr_per_ref must be a finite number >= 0, got {lr_per_ref!r}")
    global_batch, ref_batch = as_int("global_batch", global_batch), as_int("ref_batch", ref_batch)
    linear = lr_per_ref * global_batch / ref_batch
    return linear if lr_max is None else linear / (1.0 + linear / lr_max)


@dataclass(frozen=True)
class BatchTable:
    """Batch-size control: global batch per epoch, as (first epoch, global batch) rows.

    Row ``(e, b)`` means "from epoch ``e`` on, the global batch is ``b``" (Mikami et al. 2018
    grow the batch during training). The first row starts at epoch 0; epochs strictly increase;
    batches never decrease.
    """

    rows: tuple[tuple[int, int], ...]
    """(start epoch, global batch) rows, sorted by epoch."""

    def __post_init__(self) -> None:
        rows = tuple((int(e), as_int(f"batch table (rows) batch at epoch {e}", b)) for e, b in self.rows)
        object.__setattr__(self, "rows", rows)
        if not rows:
            raise ValueError("batch table (rows) must not be empty; e.g. rows=((0, 4096),)")
        if rows[0][0] != 0:
            raise ValueError(f"batch table (rows) must start at epoch 0, got first epoch {rows[0][0]}")
        for (e0, b0), (e1, b1) in zip(rows, rows[1:]):
            if e1 <= e0:
                raise ValueError(f"batch table (rows) epochs must strictly increase, got {e0} then {e1}")
            if b1 < b0:
                raise ValueError(f"batch table (rows) batches must not decrease, got {b0} then {b1}")

    @classmethod
    def constant(cls, global_batch: int) -> "BatchTable":
        """One batch size for the whole run."""
        return cls(((0, global_batch),))

    @classmethod
    def scaled(cls, rows: tuple[tuple[int, float], ...], final_batch: int) -> "BatchTable":
        """A table given as fractions of ``final_batch`` (rounded, at least 1)."""
        final_batch = as_int("final_batch", final_batch)
        return cls(tuple((e, max(1, round(f * final_batch))) for e, f in rows))

    @property
    def final_batch(self) -> int:
        return self.rows[-1][1]


def batch_at(epoch: float, table: BatchTable) -> int:
    """The global batch in force at ``epoch`` (a float; its integer part selects the row)."""
    if epoch < 0:
        raise ValueError(f"epoch must be >= 0, got {epoch!r}")
    starts = [e for e, _ in table.rows]
    return table.rows[bisect.bisect_right(starts, int(math.floor(epoch))) - 1][1]


def batch_ends(num_samples: int, global_batch: int, drop_last: bool = False,
               min_last: int = 1) -> list[int]:
    """End offsets of one epoch's global batches: the one rule for steps per epoch.

    Full batches of ``global_batch``, then the remainder: dropped with ``drop_last``, else one more
    (smaller) batch when it holds at least ``min_last`` samples, else merged into the last full
    batch. The trainer passes ``min_last`` = the world size (every worker needs >= 1 sample per
    step); a plain single-process loader is ``min_last=1`` (DataLoader's ``drop_last=False``).

    Example::

        >>> batch_ends(10, 4), batch_ends(10, 4, drop_last=True), batch_ends(9, 4, min_last=2)
        ([4, 8, 10], [4, 8], [4, 9])
    """
    num_samples, global_batch = as_int("num_samples", num_samples), as_int("global_batch", global_batch)
    min_last = as_int("min_last", min_last)
    b = min(global_batch, num_samples)
    ends = list(range(b, num_samples + 1, b))
    if drop_last:
        if global_batch > num_samples:
            raise ValueError(f"global_batch {global_batch} > num_samples {num_samples} with drop_last")
        return ends
    if ends[-1] != num_samples:
        if num_samples - ends[-1] < min_last:
            ends[-1] = num_samples  # merge a too-small remainder into the last full batch
        else:
            ends.append(num_samples)
    return ends


def steps_per_epoch(num_samples: int, global_batch: int, drop_last: bool = False,
                    min_last: int = 1) -> int:
    """Optimizer steps in one pass over ``num_samples`` samples at ``global_batch``
    (:func:`batch_ends`)."""
    return len(batch_ends(num_samples, global_batch, drop_last, min_last))


def steps_in_epochs(num_samples: int, table: BatchTable, epochs: int, drop_last: bool = False,
                    min_last: int = 1) -> int:
    """Optimizer steps of the first ``epochs`` epochs under ``table``, in closed form: each row's
    epochs times its :func:`steps_per_epoch` (a run of 10^9 epochs is counted at once).

    Example::

        >>> steps_in_epochs(10, BatchTable(((0, 2), (1, 4))), 3)  # 5 + 3 + 3
        11
    """
    epochs = as_int("epochs", epochs, minimum=0)
    ends = [e for e, _ in table.rows[1:]] + [max(epochs, table.rows[-1][0])]
    return sum((min(end, epochs) - start) * steps_per_epoch(num_samples, batch, drop_last, min_last)
               for (start, batch), end in zip(table.rows, ends) if start < epochs)


def epoch_at_step(step: int, table: BatchTable, num_samples: int, drop_last: bool = False) -> float:
    """Fractional epoch at the start of global step ``step`` (0-based) under ``table``."""
    step = as_int("step", step, minimum=0)
    epoch = 0
    while True:
        n = steps_per_epoch(num_samples, batch_at(epoch, table), drop_last)
        if step < n:
            return epoch + step / n
        step -= n
        epoch += 1


@dataclass(frozen=True)
class Schedule:
    """LR schedule config: LR per reference batch, warmup and decay, lengths in epochs."""

    lr_per_ref: float = 0.1
    """LR per ``ref_batch`` samples (Goyal: 0.1 per 256)."""
    ref_batch: int = 256
    """Reference batch of the linear scaling rule (Goyal et al.: 256)."""
    lr_max: float | None = None
    """The LR the scaled LR saturates at (McCandlish et al. 2018; :func:`scaled_lr`); None: linear."""
    epochs: float = 90.0
    """Total training length; decays end here."""
    warmup_epochs: float = 0.0
    """Length of the linear warmup (0: none)."""
    warmup_start_factor: float | None = 0.0
    """Warmup starts at this fraction of the scaled LR; None: Goyal's ``ref_batch/global_batch``."""
    decay: DecayKind = "none"
    """Decay after warmup: none | step | poly | cosine."""
    milestones: tuple[float, ...] = ()
    """Step decay: epochs at which the LR is multiplied by ``gamma``."""
    gamma: float = 0.1
    """Step decay factor in (0, 1]."""
    power: float = 2.0
    """Poly decay exponent (> 0)."""
    final_factor: float = 0.0
    """Poly/cosine end value as a fraction of the peak, in [0, 1)."""

    def __post_init__(self) -> None:
        if not (math.isfinite(self.lr_per_ref) and self.lr_per_ref >= 0.0):
            raise ValueError(f"lr_per_ref must be a finite number >= 0, got {self.lr_per_ref!r}")
        object.__setattr__(self, "ref_batch", as_int("ref_batch", self.ref_batch))
        if self.lr_max is not None and not (math.isfinite(self.lr_max) and self.lr_max > 0.0):
            raise ValueError(f"lr_max must be None or a finite number > 0, got {self.lr_max!r}")
        if not (math.isfinite(self.epochs) and self.epochs > 0):
            raise ValueError(f"epochs must be a finite number > 0, got {self.epochs!r}")
        if not 0.0 <= self.warmup_epochs <= self.epochs:
            raise ValueError(f"warmup_epochs must be in [0, epochs={self.epochs}], got {self.warmup_epochs!r}")
        if self.warmup_start_factor is not None and not 0.0 <= self.warmup_start_factor <= 1.0:
            raise ValueError(f"warmup_start_factor must be in [0, 1] or None, got {self.warmup_start_factor!r}")
        if self.decay not in ("none", "step", "poly", "cosine"):
            raise ValueError(f"decay must be one of none, step, poly, cosine; got {self.decay!r}")
        object.__setattr__(self, "milestones", tuple(float(m) for m in self.milestones))
        ms = self.milestones
        if self.decay == "step" and not ms:
            raise ValueError("milestones must be non-empty for decay='step'")
        if any(b <= a for a, b in zip(ms, ms[1:])) or any(not 0 < m <= self.epochs for m in ms):
            raise ValueError(f"milestones must strictly increase within (0, epochs={self.epochs}], got {ms}")
        if not 0.0 < self.gamma <= 1.0:
            raise ValueError(f"gamma must be in (0, 1], got {self.gamma!r}")
        if not self.power > 0.0:
            raise ValueError(f"power must be > 0, got {self.power!r}")
        if not 0.0 <= self.final_factor < 1.0:
            raise ValueError(f"final_factor must be in [0, 1), got {self.final_factor!r}")


def warmup_factor(epoch: float, s: Schedule, global_batch: int) -> float:
    """Step 2: linear warmup multiplier in [start, 1]; 1 after ``s.warmup_epochs``."""
    if s.warmup_epochs <= 0 or epoch >= s.warmup_epochs:
        return 1.0
    start = s.warmup_start_factor
    if start is None:  # Goyal: begin at the reference-batch LR (k-fold smaller), reach k*LR
        start = min(1.0, s.ref_batch / global_batch)
    return start + (1.0 - start) * epoch / s.warmup_epochs


def decay_factor(epoch: float, s: Schedule) -> float:
    """Step 3: decay multiplier in [final_factor, 1] (step: gamma ** milestones passed)."""
    if s.decay == "step":
        return s.gamma ** bisect.bisect_right(s.milestones, epoch)
    if s.decay == "none" or epoch <= s.warmup_epochs:
        return 1.0
    span = s.epochs - s.warmup_epochs
    p = min(1.0, (epoch - s.warmup_epochs) / span) if span > 0 else 1.0  # post-warmup progress
    if s.decay == "poly":
        shape = (1.0 - p) ** s.power
    else:  # cosine
        shape = 0.5 * (1.0 + math.cos(math.pi * p))
    return s.final_factor + (1.0 - s.final_factor) * shape


def lr_at(epoch: float, s: Schedule, table: BatchTable) -> float:
    """The LR at fractional ``epoch``: scaled LR of the current batch x warmup x decay."""
    if epoch < 0:
        raise ValueError(f"epoch must be >= 0, got {epoch!r}")
    b = batch_at(epoch, table)
    # Step 1-3
    return scaled_lr(s.lr_per_ref, b, s.ref_batch, s.lr_max) * warmup_factor(epoch, s, b) * decay_factor(epoch, s)


def lr_at_step(step: int, s: Schedule, table: BatchTable, num_samples: int,
               drop_last: bool = False) -> float:
    """The LR at global step ``step`` (0-based) for a dataset of ``num_samples`` per epoch."""
    return lr_at(epoch_at_step(step, table, num_samples, drop_last), s, table)


def lambda_lr(optimizer: torch.optim.Optimizer, s: Schedule, table: BatchTable, num_samples: int,
              drop_last: bool = False) -> torch.optim.lr_scheduler.LambdaLR:
    """A ``LambdaLR`` that sets every group's LR to :func:`lr_at_step` (call ``.step()`` per step).

    The groups' current ``lr`` is overwritten with 1.0 so that LambdaLR's multiplier is the LR
    itself; every group gets the same LR (LARS exclusion changes decay/adaptation, not the LR).
    Batch changes are only visible through the LR: the trainer still has to change the loader's
    batch with :func:`batch_at`.
    """
    for group in optimizer.param_groups:
        group["lr"] = 1.0
        group["initial_lr"] = 1.0
    return torch.optim.lr_scheduler.LambdaLR(
        optimizer, lambda step: lr_at_step(step, s, table, num_samples, drop_last))


def lr_table(s: Schedule, table: BatchTable, points: list[float]) -> list[tuple[float, int, float]]:
    """(epoch, batch, lr) rows at ``points``: for printing and plotting a schedule."""
    return [(e, batch_at(e, table), lr_at(e, s, table)) for e in points]
