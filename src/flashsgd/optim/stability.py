"""Large-batch instability said at once: a loss that climbs while the learning rate ramps up, and a
batch with too few steps per epoch for the recipe.

Goyal et al. 2017 (sec. 2.2) and You et al. 2017 (LARS) describe the failure this watches for: at a
large batch the linearly scaled LR diverges early in training, before the warm-up has brought the
weights to where that LR is stable; the loss then climbs for several steps and the run ends far
below the small-batch accuracy (flashsgd's MNIST-1D proxy at global batch 16384: the loss fell to
1.74 at step 4, then rose 1.77, 1.99, 2.83 at LR 5.3-6.4, and the run ended at 65%).

1. :class:`LossRiseGuard`, fed every step's global loss: during the warm-up and as long again after
   it (where the LR is at or near its peak), it fires once when the loss has risen for
   :data:`RISING_STEPS` consecutive steps and stands more than :data:`RISE` above the lowest mean of
   any :data:`RISING_STEPS` consecutive losses before (a mean, so one lucky batch does not set the
   bar) and has given back more than :data:`GIVE_BACK` of what the run had gained from its first
   mean down to that best (late in a good run a loss of 0.04 can spike 7-fold and recover: a
   relative rise alone is no collapse, a climb back towards the start is). Its message names
   the step, the LR and the global batch, and what to change.
2. :func:`few_steps_warning`: a run whose first epoch has fewer than :data:`MIN_STEPS_PER_EPOCH`
   optimizer steps is outside the regime the recipes were validated in.

Cost: O(1) per step (a few floats), no tensor op: the loss is already a float on the host.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

from flashsgd.fmt import plural

RISING_STEPS = 3
"""Consecutive rising steps the guard waits for (the 16384 collapse above rose for 3)."""
RISE = 0.2
"""How far above its best earlier mean the loss must stand (a collapse, not noise)."""
GIVE_BACK = 0.25
"""The share of the loss's fall so far (first mean -> best mean) that the climb must undo. Measured
on the large MNIST-1D proxy (625,000 samples, 5 epochs, docs/recipe.md): the runs that collapsed
at 16384 (LR 6.4, ending at 31% and 46%) climbed back by 121% and 70%; spikes the runs recovered
from gave back 1-12% (the rule at 4096: 0.063 -> 0.082, 0.044 -> 0.172, 0.039 -> 0.292 from ~2.2,
ending at 99.55%; 8192 at LR 1.21: 0.155 -> 0.322, ending at 99.51%). One run climbed back 70%
and still recovered (16384, LR 3.2, 1-epoch warm-up: 99.34%): it is named, a warning, not a stop."""
MIN_STEPS_PER_EPOCH = 8
"""The fewest optimizer steps per epoch the recipes were validated with: ``fujitsu-mnist1d`` at
global batch 4096 on MNIST-1D's 32,000 training samples (docs/recipe.md); ``large-batch-mnist1d``
was validated down to 15.3 (batch 32768 on the large proxy's 500,000: 1.5 points below batch 128);
the papers' own runs had 15.6 (Fujitsu, 81,920 on 1.28M images) and 156 (Goyal et al., 8k)."""
ADVICE = ("a longer warm-up (optim.warmup_epochs), a smaller LR (optim.lr_per_ref), LARS or LAMB "
          "(optim.optimizer), or a smaller global batch; docs/recipe.md")


@dataclass
class LossRiseGuard:
    """Step 1 of the module docstring, for one run (``warmup_epochs`` of its recipe)."""

    warmup_epochs: float
    fired: bool = False
    _losses: list[float] = field(default_factory=list)
    _best_mean: float = math.inf
    _first_mean: float | None = None
    _rising: int = 0

    def update(self, step: int, epoch: float, loss: float, lr: float, global_batch: int) -> str | None:
        """The warning when this step (``epoch``: fractional, at its start) completes a climb, else
        None; fires at most once. Non-finite losses are left to ``run.nonfinite``."""
        if self.fired or not math.isfinite(loss) or epoch > 2 * self.warmup_epochs:
            return None
        prev = self._losses[-1] if self._losses else None
        self._rising = self._rising + 1 if prev is not None and loss > prev else 0
        before = self._best_mean  # the bar from the losses before this one
        self._losses = (self._losses + [loss])[-RISING_STEPS:]
        if len(self._losses) == RISING_STEPS:
            mean = sum(self._losses) / RISING_STEPS
            self._best_mean = min(self._best_mean, mean)
            self._first_mean = mean if self._first_mean is None else self._first_mean
        gained = (self._first_mean or before) - before  # how far the loss had come down
        if self._rising >= RISING_STEPS and loss > (1 + RISE) * before and loss - before > GIVE_BACK * gained:
            self.fired = True
            return (f"the training loss rose for {RISING_STEPS} consecutive steps to {loss:.3g} at step "
                    f"{step} (LR {lr:.3g}, global batch {global_batch}), {loss / before - 1:.0%} above its "
                    f"best so far, while the LR is {'warming up' if epoch < self.warmup_epochs else 'at its peak'}:"
                    f" the large-batch recipe is unstable here; try {ADVICE}")
        return None


def few_steps_warning(steps_per_epoch: int, global_batch: int) -> str | None:
    """Step 2: the warning for a first epoch of fewer than :data:`MIN_STEPS_PER_EPOCH` steps."""
    if steps_per_epoch >= MIN_STEPS_PER_EPOCH:
        return None
    return (f"global batch {global_batch} gives {plural(steps_per_epoch, 'optimizer step')} per epoch; the "
            f"recipes were validated with >= {MIN_STEPS_PER_EPOCH} (MNIST-1D at 4096; the large proxy's 32768: "
            f"15): expect lower "
            f"accuracy or instability; more training data or a smaller batch")
