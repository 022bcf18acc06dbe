"""From a recipe to a training plan: optimizer, LR schedule, batch table, loss and model tweaks.

Papers: Goyal et al. 2017 (arXiv 1706.02677: linear scaling, warmup, zero-gamma of the last BN of
each residual block), Mikami et al. 2018 (arXiv 1811.05233: batch-size control), You et al. 2017
(LARS). A :class:`~flashsgd.optim.recipes.Recipe` holds batch-size-independent values; everything
that depends on the global batch, the dataset size and the run length is derived here, in
:func:`prepare`:

0. The run length: ``epochs`` given -> the recipe rescaled with ``Recipe.for_epochs``.
1. :func:`apply_model_tweaks` (only with ``model_tweaks=True``, the default) - BatchNorm
   running-statistics momentum and zero-gamma of residual blocks' last BN; what it changed is
   recorded in ``RecipeSetup.model_tweaks`` and printed by :meth:`RecipeSetup.describe`.
2. :func:`build_optimizer` - parameter groups (no decay / no LARS adaptation for bias and norm
   parameters), then the recipe's optimizer from :data:`~flashsgd.optim.optimizers.OPTIMIZERS` (SGD,
   :class:`~flashsgd.optim.lars.LARS`, :class:`~flashsgd.optim.lamb.LAMB`), LR set for step 0.
3. :func:`build_schedule` + :func:`build_batch_table` - the LR schedule and the batch-size table.
4. :func:`build_loss` - ``torch.nn.CrossEntropyLoss(label_smoothing=...)`` (torch's, not ours).

A plan is stepped by global step; it warns (:class:`RecipeWarning`) when stepped past its
:meth:`RecipeSetup.total_steps` and :meth:`RecipeSetup.check_loader` compares a loader's length with the plan's
steps per epoch, so that a ``drop_last`` mismatch cannot silently stop the LR short of its end. The
traps of a user's own loop (a custom recipe rescaled, ``set_lr`` forgotten, the script's own
optimizer left behind, a recipe field its optimizer does not read) are caught by
:mod:`flashsgd.optim.plan_checks`.

``global_batch`` is the **final** global batch: under batch-size control (``sony``) the run starts
below it (``plan.describe()`` says at which batch, for how many epochs). ``num_samples`` may come
later (:meth:`RecipeSetup.set_num_samples`): the optimizer does not depend on it.

Example (what a trainer does)::

    recipe = RECIPES["fujitsu"]                                 # presets are for 90 epochs
    plan = prepare(recipe, model, global_batch=4096, epochs=15)  # the optimizer exists from here
    plan.set_num_samples(len(train_set))                        # the dataset size, once known
    print(plan.describe())                                      # batch, LR, warmup, decay, tweaks
    step = 0
    for epoch in range(plan.epochs):
        loader = make_loader(plan.batch_at(epoch), drop_last=plan.drop_last)  # batch-size control
        plan.check_loader(loader, epoch)                        # same number of steps as planned
        for x, y in loader:
            plan.set_lr(step)                                   # pure function of the global step
            loss = plan.loss_fn(model(x), y)
            plan.optimizer.zero_grad(); loss.backward(); plan.optimizer.step(); step += 1
"""

from __future__ import annotations

import math
import warnings
from collections.abc import Sized
from dataclasses import dataclass, field
from typing import Optional

import torch
from torch import nn

from flashsgd.fmt import plural
from flashsgd.optim.lars import param_groups
from flashsgd.optim.optimizers import OPTIMIZERS
from flashsgd.optim.plan_checks import (LRWatch, RecipeWarning, forbid_steps, replaced_settings, rescale_note,
                                       unread_fields_note)
from flashsgd.optim.recipes import PRESET_EPOCHS, Recipe
from flashsgd.optim.schedules import (BatchTable, Schedule, as_int, batch_at, epoch_at_step, lr_at,
                                      steps_per_epoch)

__all__ = ["RecipeSetup", "RecipeWarning", "prepare", "apply_model_tweaks", "build_optimizer",
           "build_schedule", "build_batch_table", "build_loss"]


def build_batch_table(recipe: Recipe, global_batch: int) -> BatchTable:
    """Step 3: the batch-size table, ``global_batch`` (any integral number) being the **final** batch:
    row ``(epoch, fraction)`` of ``recipe.batch_fractions`` runs at ``fraction * global_batch``
    (``sony``: half of it for the first third of the epochs)."""
    global_batch = as_int("global_batch", global_batch)
    return BatchTable(tuple((int(e), max(1, int(round(f * global_batch))))
                            for e, f in recipe.batch_fractions))


def build_schedule(recipe: Recipe) -> Schedule:
    """Step 3: the LR schedule."""
    return recipe.schedule()


def build_loss(recipe: Recipe) -> nn.CrossEntropyLoss:
    """Step 4: cross-entropy with the recipe's label smoothing (torch's implementation)."""
    return nn.CrossEntropyLoss(label_smoothing=recipe.label_smoothing)


def _last_bn_of_residual_blocks(model: nn.Module) -> list[nn.modules.batchnorm._BatchNorm]:
    """The last BN of each residual block: a ``last_bn`` attribute (flashsgd models set it), or
    torchvision's block classes (``Bottleneck.bn3``, ``BasicBlock.bn2``)."""
    found = []
    for module in model.modules():
        bn = getattr(module, "last_bn", None)
        if bn is None:
            bn = {"Bottleneck": getattr(module, "bn3", None),
                  "BasicBlock": getattr(module, "bn2", None)}.get(type(module).__name__)
        if isinstance(bn, nn.modules.batchnorm._BatchNorm) and bn.weight is not None:
            found.append(bn)
    return found


def apply_model_tweaks(recipe: Recipe, model: nn.Module) -> list[str]:
    """Step 1: the recipe's BatchNorm tweaks, in place; returns one line per change made.

    1. ``bn_momentum`` (if set): written into every BatchNorm's running-statistics ``momentum``.
    2. ``zero_init_last_bn``: zero the gamma of each residual block's last BN (Goyal et al. sec.
       5.1), found by :func:`_last_bn_of_residual_blocks`.

    Example::

        >>> apply_model_tweaks(RECIPES["fujitsu-mnist1d"], MNIST1DCNN())  # doctest: +SKIP
        ['bn_momentum=0.3 on 3 BatchNorm layers']
    """
    changes = []
    # Step 1: running-statistics momentum of every BN layer
    if recipe.bn_momentum is not None:
        bns = [m for m in model.modules() if isinstance(m, nn.modules.batchnorm._BatchNorm)]
        for bn in bns:
            bn.momentum = recipe.bn_momentum
        changes.append(f"bn_momentum={recipe.bn_momentum:g} on {len(bns)} BatchNorm layers")
    # Step 2: zero-gamma of residual blocks' last BN
    if recipe.zero_init_last_bn:
        last_bns = _last_bn_of_residual_blocks(model)
        with torch.no_grad():
            for bn in last_bns:
                bn.weight.zero_()
        changes.append(f"zero gamma of {len(last_bns)} last BNs"
                       + ("" if last_bns else " (no residual block with a last BN found)"))
    return changes


def build_optimizer(recipe: Recipe, model: nn.Module, global_batch: int) -> torch.optim.Optimizer:
    """Step 2: the recipe's optimizer (:data:`~flashsgd.optim.optimizers.OPTIMIZERS`) over
    :func:`param_groups`, LR set to the schedule's value at step 0.

    ``global_batch`` is the final global batch; the first row of the batch table sets the LR. A
    recipe whose warm-up starts from 0 gives an optimizer at LR 0: the loop sets each step's LR
    (:meth:`RecipeSetup.set_lr`).
    """
    groups = param_groups(model, recipe.weight_decay, recipe.exclude_bias_and_norm)
    table = build_batch_table(recipe, global_batch)
    lr0 = lr_at(0.0, recipe.schedule(), table)
    return OPTIMIZERS.get(recipe.optimizer).build(groups, recipe, lr0)


@dataclass
class RecipeSetup:
    """Everything a trainer needs from a recipe at one global batch, dataset size and run length."""

    recipe: Recipe
    """The recipe as run (rescaled to the run's epochs)."""
    optimizer: torch.optim.Optimizer
    schedule: Schedule
    table: BatchTable
    loss_fn: nn.CrossEntropyLoss
    num_samples: Optional[int] = None
    """Training samples per epoch (sets steps per epoch at each batch size); None until known
    (:meth:`set_num_samples`)."""
    drop_last: bool = False
    """Whether the loader drops the last partial batch of an epoch (build it with this value)."""
    model_tweaks: list[str] = field(default_factory=list)
    """What :func:`prepare` changed in the model, one line per change (empty: nothing)."""
    _warned_past_end: bool = field(default=False, init=False, repr=False, compare=False)
    _lr_watch: Optional[LRWatch] = field(default=None, init=False, repr=False, compare=False)

    def __post_init__(self) -> None:
        if self.num_samples is not None:
            self.num_samples = as_int("num_samples", self.num_samples)
        # the LR build_optimizer wrote (step 0's); a warning if the optimizer steps with it unchanged
        self._lr_watch = LRWatch(self.optimizer, self.optimizer.param_groups[0]["lr"], self._expected_lr)

    def set_num_samples(self, num_samples: int) -> "RecipeSetup":
        """Give the dataset size once it is known (``prepare`` without ``num_samples``); returns self.

        The optimizer and the schedule do not depend on it; the steps per epoch and so
        :meth:`set_lr` do. Setting another size than the one already given is a ValueError.
        """
        n = as_int("num_samples", num_samples)
        if self.num_samples is not None and n != self.num_samples:
            raise ValueError(f"num_samples is already {self.num_samples} (the plan's steps per epoch "
                             f"follow it); got {n}: prepare a new plan for another dataset")
        self.num_samples = n
        return self

    def _samples(self) -> int:
        if self.num_samples is None:
            raise RuntimeError(
                "the plan does not know the dataset size yet: call plan.set_num_samples(len(train_set)) "
                "(or prepare(..., num_samples=N)) before asking for steps or setting the LR of a step")
        return self.num_samples

    def _expected_lr(self, step: int) -> Optional[float]:
        """The schedule's LR at ``step`` without the past-the-end warning; None while the size is unknown."""
        if self.num_samples is None:
            return None
        epoch = epoch_at_step(step, self.table, self.num_samples, self.drop_last)
        return lr_at(epoch, self.schedule, self.table)

    @property
    def epochs(self) -> int:
        """Whole epochs to run (the schedule's length rounded up)."""
        return int(math.ceil(self.schedule.epochs))

    def batch_at(self, epoch: int) -> int:
        """Global batch for ``epoch`` (batch-size control)."""
        return batch_at(epoch, self.table)

    def steps_in_epoch(self, epoch: int) -> int:
        """Optimizer steps the plan expects in ``epoch`` (its batch, ``num_samples``, ``drop_last``)."""
        return steps_per_epoch(self._samples(), self.batch_at(epoch), self.drop_last)

    def total_steps(self) -> int:
        """Optimizer steps over the whole run (follows the batch table)."""
        return sum(self.steps_in_epoch(e) for e in range(self.epochs))

    def lr_at_step(self, step: int) -> float:
        """LR at global step ``step`` (a function of ``step`` alone; follows the batch table and the
        scaling rule).

        Past :meth:`total_steps` the LR stays at its final value and a :class:`RecipeWarning` is
        given once per plan: the loop runs more steps than planned (a loader that keeps the last
        partial batch while the plan has ``drop_last=True``, or more epochs than ``plan.epochs``).
        """
        lr = lr_at(epoch_at_step(step, self.table, self._samples(), self.drop_last),
                   self.schedule, self.table)
        if not self._warned_past_end and step >= self.total_steps():
            self._warned_past_end = True
            warnings.warn(
                f"step {step} is past the plan's end ({plural(self.total_steps(), 'step')}: "
                f"{plural(self.epochs, 'epoch')} of {plural(self.num_samples, 'sample')}, "
                f"drop_last={self.drop_last}); the LR stays at its final value {lr:.4g}. Does the loader "
                f"keep the last partial batch while the plan drops it, or does the loop run more than "
                f"plan.epochs?", RecipeWarning, stacklevel=2)
        return lr

    def set_lr(self, step: int) -> float:
        """Write :meth:`lr_at_step` into every parameter group; returns it.

        Call it before every optimizer step: the optimizer holds step 0's LR until then (0 for a
        warm-up from 0), and an optimizer stepped with that LR unchanged while the schedule has
        moved on gives a :class:`RecipeWarning` (:class:`~flashsgd.optim.plan_checks.LRWatch`).
        """
        lr = self.lr_at_step(step)
        self._lr_watch.stop()  # the loop drives the LR
        for group in self.optimizer.param_groups:
            group["lr"] = lr
        return lr

    def check_loader(self, loader: Sized | int, epoch: int = 0) -> None:
        """Raise ``ValueError`` unless ``loader`` (its ``len``, or an int) gives the planned steps.

        A loader built with another ``drop_last`` than the plan has one step more or less per
        epoch, and the LR schedule then ends early (at a large LR) or runs past its end. For one
        worker of several, pass that worker's loader: with per-worker batches of
        ``batch / world`` its length equals the global number of steps.
        """
        n = as_int("len(loader)", len(loader) if isinstance(loader, Sized) else loader, minimum=0)
        expected = self.steps_in_epoch(epoch)
        if n != expected:
            raise ValueError(
                f"the loader gives {plural(n, 'batch', 'batches')} in epoch {epoch}, the plan expects {expected} "
                f"({plural(self.num_samples, 'sample')} at global batch {self.batch_at(epoch)}, "
                f"drop_last={self.drop_last}); build the loader with drop_last={self.drop_last}, "
                f"or the plan with prepare(..., drop_last={not self.drop_last}) if that is the "
                f"loader's setting")

    def describe(self) -> str:
        """One start-up line: recipe, global batch (and batch-size control), peak LR, warmup, decay,
        model tweaks."""
        r, s = self.recipe, self.schedule
        peak = lr_at(min(s.warmup_epochs, s.epochs - 1e-9), s, self.table)  # end of warmup (or 0)
        return (f"recipe={r.name} optimizer={r.optimizer} {self.describe_batch()} "
                f"lr_per_ref={r.lr_per_ref:g} ref_batch={r.ref_batch} "
                + (f"lr_max={r.lr_max:g} " if r.lr_max is not None else "")
                + f"peak_lr={peak:.4g} "
                f"warmup_epochs={s.warmup_epochs:g} "
                f"decay={s.decay} epochs={s.epochs:g} label_smoothing={r.label_smoothing:g} "
                f"weight_decay={r.weight_decay:g} momentum={r.momentum:g} nesterov={r.nesterov}"
                + (f" bn_momentum={r.bn_momentum:g}" if r.bn_momentum is not None else "")
                + OPTIMIZERS.get(r.optimizer).describe(r)
                + f" model_tweaks=[{'; '.join(self.model_tweaks) or 'none'}]")

    def describe_batch(self) -> str:
        """``global_batch=N``, and under batch-size control which batch runs for which epochs.

        Example (``sony`` at 512 over 90 epochs)::

            global_batch=512 (the final batch; batch-size control: 256 for epochs 0-29 (33% of the
            epochs), 512 from epoch 30)
        """
        rows = self.table.rows
        text = f"global_batch={self.table.final_batch}"
        if len(rows) == 1:
            return text
        parts = [(f"{b} for epoch {e}" if e_next == e + 1 else f"{b} for epochs {e}-{e_next - 1}")
                 + f" ({(e_next - e) / self.schedule.epochs:.0%} of the epochs)"
                 for (e, b), (e_next, _) in zip(rows, rows[1:])]
        last = f"{rows[-1][1]} from epoch {rows[-1][0]}"
        return f"{text} (the final batch; batch-size control: {', '.join(parts)}, {last})"


def _for_run_length(recipe: Recipe, epochs: float | None) -> Recipe:
    """Step 0: ``recipe`` over ``epochs`` (``Recipe.for_epochs``); warns when a preset's 90-epoch
    length is used without being asked for, and when lengths of the user's own are rescaled
    (:func:`~flashsgd.optim.plan_checks.rescale_note`)."""
    if epochs is None:
        if recipe.epochs == PRESET_EPOCHS:
            warnings.warn(
                f"recipe {recipe.name!r} plans {PRESET_EPOCHS:g} epochs (the presets' ImageNet "
                f"length): pass prepare(..., epochs=N) for another run length, or "
                f"epochs={PRESET_EPOCHS:g} to silence this warning", RecipeWarning, stacklevel=3)
        return recipe
    if not (math.isfinite(epochs) and epochs > 0):
        raise ValueError(f"epochs must be a finite number > 0, got {epochs!r}")
    if epochs == recipe.epochs:
        return recipe
    rescaled = recipe.for_epochs(epochs)
    note = rescale_note(recipe, rescaled)
    if note:
        warnings.warn(note, RecipeWarning, stacklevel=3)
    return rescaled


def _warn_replaced(user: torch.optim.Optimizer, plan: RecipeSetup) -> None:
    """``prepare(..., replaces=user)``: one warning listing what of ``user`` stops mattering; its
    ``step()`` raises from now on."""
    if not isinstance(user, torch.optim.Optimizer):
        raise TypeError(f"replaces must be the torch.optim.Optimizer that plan.optimizer replaces, "
                        f"got {type(user).__name__}")
    s = plan.schedule
    peak = lr_at(min(s.warmup_epochs, s.epochs - 1e-9), s, plan.table)
    lr_text = (f"the schedule's ({plan.optimizer.param_groups[0]['lr']:.4g} at step 0, "
               f"peak {peak:.4g}; plan.set_lr)")
    lost = replaced_settings(user, plan.optimizer, plan.recipe, lr_text)
    forbid_steps(user, plan.recipe.name)
    if lost:
        warnings.warn(
            f"plan.optimizer (recipe {plan.recipe.name!r}) replaces your {type(user).__name__}, whose "
            f"settings no longer apply: {'; '.join(lost)}. Step plan.optimizer; to keep a value of "
            f"yours, put it in the recipe: dataclasses.replace(recipe, momentum=..., weight_decay=...)",
            RecipeWarning, stacklevel=3)


def prepare(recipe: Recipe, model: nn.Module, global_batch: int, num_samples: int | None = None,
            drop_last: bool = False, *, epochs: float | None = None,
            model_tweaks: bool = True, replaces: torch.optim.Optimizer | None = None) -> RecipeSetup:
    """Steps 0-4: the run length, model tweaks, optimizer, schedule, batch table and loss.

    Args:
        recipe: the hyper-parameters (e.g. ``RECIPES["fujitsu"]``).
        model: the model to train; its BatchNorm layers are changed in place by step 1.
        global_batch: the **final** (largest) global batch, any integral number (``numpy.int64``
            too). Under batch-size control the run starts below it: ``sony`` at 512 runs its first
            30 of 90 epochs at 256 (``plan.describe()`` says so).
        num_samples: training samples per epoch, any integral number; None: given later with
            :meth:`RecipeSetup.set_num_samples` (a script that builds its optimizer before its
            dataset), before the first :meth:`RecipeSetup.set_lr`.
        drop_last: whether the loader drops the last partial batch (sets steps per epoch).
        epochs: the run length; when it differs from ``recipe.epochs`` the recipe's warmup,
            milestones and batch rows are rescaled (``Recipe.for_epochs``), with a
            :class:`RecipeWarning` when those lengths are the user's own rather than a preset's.
            Omitted: the recipe's own length, with a :class:`RecipeWarning` when that is the
            presets' 90 epochs.
        model_tweaks: apply the recipe's BatchNorm tweaks (:func:`apply_model_tweaks`); False
            leaves the model untouched. ``RecipeSetup.model_tweaks`` lists what was changed.
        replaces: the script's own optimizer, which ``plan.optimizer`` replaces: a
            :class:`RecipeWarning` lists its settings that stop mattering (its LR, and momentum,
            weight decay, Nesterov or class where the recipe's differ), and its ``step()`` raises
            RuntimeError from now on.

    Example::

        >>> plan = prepare(RECIPES["goyal"], model, 1024, epochs=30, replaces=optimizer)  # doctest: +SKIP
        >>> optimizer = plan.optimizer; plan.set_num_samples(len(train_dataset))          # doctest: +SKIP
    """
    global_batch = as_int("global_batch", global_batch)
    if num_samples is not None:
        num_samples = as_int("num_samples", num_samples)
    recipe = _for_run_length(recipe, epochs)  # Step 0
    note = unread_fields_note(recipe)
    if note:
        warnings.warn(note, RecipeWarning, stacklevel=2)
    tweaks = apply_model_tweaks(recipe, model) if model_tweaks else []  # Step 1
    plan = RecipeSetup(recipe=recipe, optimizer=build_optimizer(recipe, model, global_batch),
                       schedule=build_schedule(recipe), table=build_batch_table(recipe, global_batch),
                       loss_fn=build_loss(recipe), num_samples=num_samples, drop_last=drop_last,
                       model_tweaks=tweaks)
    if replaces is not None:
        _warn_replaced(replaces, plan)
    return plan
