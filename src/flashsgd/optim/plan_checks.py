"""The traps of using a recipe from one's own training loop, each caught by a one-line warning or an error.

Found by plugging :func:`flashsgd.optim.plan.prepare` into plain DDP scripts (PyTorch's ImageNet
example among them); each check names what happened and what to write instead:

1. :func:`rescale_note` - a recipe whose warm-up, milestones or batch rows are the user's own (not
   a registered preset's) is rescaled by ``epochs / recipe.epochs`` when ``prepare(...,
   epochs=N)`` asks for another length: the values are probably already meant for N epochs.
2. :class:`LRWatch` - ``plan.optimizer`` steps while nothing drives its LR (``plan.set_lr(step)``
   forgotten): the LR stays at the value written for step 0, which is 0 for every recipe whose
   warm-up starts from 0 (``sony``, ``fujitsu``, ``fujitsu-mnist1d``).
3. :func:`replaced_settings` and :func:`forbid_steps` - ``prepare(..., replaces=optimizer)``: the
   settings of the script's own optimizer (its ``--lr``, ``--momentum``, ``--wd``) that stop
   mattering are listed, and stepping that optimizer afterwards is an error.
4. :func:`unread_fields_note` - a recipe whose optimizer does not read a field set in it
   (``Recipe(optimizer="sgd", trust_coefficient=0.01)``: SGD has no trust ratio; the fields each
   optimizer reads are its catalog entry's ``reads``, :data:`~flashsgd.optim.optimizers.OPTIMIZERS`).
"""

from __future__ import annotations

import warnings
from typing import Any, Callable, Optional

import torch

from flashsgd.optim.optimizers import OPTIMIZERS
from flashsgd.optim.recipes import RECIPES, Recipe


class RecipeWarning(UserWarning):
    """A plan and the loop that runs it disagree (run length, steps per epoch, LR, optimizer)."""


def _lengths(recipe: Recipe) -> tuple:
    """The fields :meth:`Recipe.for_epochs` rescales (milestones only where step decay uses them)."""
    return (recipe.epochs, recipe.warmup_epochs, recipe.milestones if recipe.decay == "step" else (),
            recipe.batch_fractions)


def rescale_note(recipe: Recipe, rescaled: Recipe) -> Optional[str]:
    """Check 1: the warning for ``recipe`` rescaled to ``rescaled.epochs``, or None.

    None when nothing but the length changes (no warm-up, no step milestones, one batch row) or when
    the lengths are those of a registered recipe (a preset or a variant of one, e.g.
    ``dataclasses.replace(RECIPES["goyal"], lr_per_ref=0.2)``: the documented rescaling).
    """
    if any(_lengths(recipe) == _lengths(r) for r in RECIPES.values()):
        return None
    changed = []
    if recipe.warmup_epochs > 0:
        changed.append(f"warm-up {recipe.warmup_epochs:g} -> {rescaled.warmup_epochs:.4g} epochs")
    if recipe.decay == "step":
        changed.append(f"milestones {_epochs(recipe.milestones)} -> {_epochs(rescaled.milestones)}")
    if len(recipe.batch_fractions) > 1:
        changed.append(f"batch rows from epochs {_epochs(e for e, _ in recipe.batch_fractions)} -> "
                       f"{_epochs(e for e, _ in rescaled.batch_fractions)}")
    if not changed:
        return None
    n, k = rescaled.epochs, f"{rescaled.epochs:g}/{recipe.epochs:g}"
    return (f"recipe {recipe.name!r} is written for {recipe.epochs:g} epochs (Recipe.epochs); "
            f"prepare(..., epochs={n:g}) rescales it by {k}: {'; '.join(changed)}. If those values are "
            f"already for {n:g} epochs, build the recipe with Recipe(..., epochs={n:g}); to rescale on "
            f"purpose, pass recipe.for_epochs({n:g}) (no warning)")


def _epochs(values) -> str:
    return "(" + ", ".join(f"{v:.4g}" for v in values) + ")"


class LRWatch:
    """Check 2: a step pre-hook on ``plan.optimizer`` that warns once when nothing drives the LR.

    At optimizer steps 1, 2, 4, 8, ... (``O(log steps)`` checks, each ``O(epochs)``): if every
    parameter group still has the LR written for step 0 while the schedule has moved on, one
    :class:`RecipeWarning`. The watch ends (its hook removed) at the first ``plan.set_lr`` (see
    :meth:`stop`), at the warning, or when the LR is found changed by the loop itself (its own
    scheduler, e.g. :func:`flashsgd.optim.schedules.lambda_lr`).

    Args:
        optimizer: the plan's optimizer.
        lr_written: the LR :func:`~flashsgd.optim.plan.build_optimizer` wrote (the step-0 value).
        expected: ``expected(step)`` -> the schedule's LR at ``step``, None while the dataset size
            (and so the step -> epoch mapping) is unknown.
    """

    __slots__ = ("lr_written", "expected", "steps", "handle")

    def __init__(self, optimizer: torch.optim.Optimizer, lr_written: float,
                 expected: Callable[[int], Optional[float]]) -> None:
        self.lr_written = lr_written
        self.expected = expected
        self.steps = 0
        self.handle = optimizer.register_step_pre_hook(self)

    def stop(self) -> None:
        """Remove the hook (idempotent)."""
        self.handle.remove()

    def __call__(self, optimizer: torch.optim.Optimizer, args: Any, kwargs: Any) -> None:
        k = self.steps
        self.steps += 1
        if k == 0 or k & (k - 1):  # only at steps 1, 2, 4, 8, ...
            return None
        if any(g["lr"] != self.lr_written for g in optimizer.param_groups):
            self.stop()  # the loop drives the LR itself
            return None
        want = self.expected(k)
        if want is None:  # dataset size unknown: only an LR of 0 is surely wrong
            if self.lr_written != 0.0:
                return None
            why = ("plan.set_lr(step) was never called (it needs the dataset size: prepare(..., "
                   "num_samples=N) or plan.set_num_samples(N))")
        elif want == self.lr_written:
            return None
        else:
            why = f"the recipe's schedule is at {want:.4g} for step {k}"
        self.stop()
        warnings.warn(
            f"optimizer step {k} runs at LR {self.lr_written:.4g}, the value prepare() wrote for step 0"
            + (" (nothing is learned at LR 0)" if self.lr_written == 0.0 else "") + f", but {why}: call "
            f"plan.set_lr(step) before every optimizer step (or drive the LR yourself, e.g. "
            f"flashsgd.optim.lambda_lr)", RecipeWarning, stacklevel=3)
        return None


_KEYS = ("lr", "momentum", "weight_decay", "nesterov")


def replaced_settings(user: torch.optim.Optimizer, plan_optimizer: torch.optim.Optimizer,
                      recipe: Recipe, lr_text: str) -> list[str]:
    """Check 3: the settings of ``user`` (the loop's own optimizer) that ``plan_optimizer`` overrides.

    One entry per differing setting, ``"momentum=0.9 -> 0.95"``; the LR always (the schedule sets
    it: ``lr_text``); the class when it differs (``"SGD -> LARS"``). Empty: nothing is lost.
    """
    lost = []
    if type(user) is not type(plan_optimizer):
        lost.append(f"{type(user).__name__} -> {type(plan_optimizer).__name__}")
    for key in _KEYS:
        mine = sorted({g[key] for g in user.param_groups if key in g}, key=float)
        theirs = sorted({g[key] for g in plan_optimizer.param_groups if key in g}, key=float)
        if not mine or mine == theirs and key != "lr":
            continue
        if key == "lr":
            new = lr_text
        elif key == "weight_decay" and recipe.exclude_bias_and_norm and len(theirs) > 1:
            new = f"{recipe.weight_decay:g} (0 on biases and normalization parameters)"
        else:
            new = "/".join(f"{v:g}" if not isinstance(v, bool) else str(v) for v in theirs)
        old = "/".join(f"{v:g}" if not isinstance(v, bool) else str(v) for v in mine)
        lost.append(f"{key}={old} -> {new}")
    return lost


def forbid_steps(optimizer: torch.optim.Optimizer, recipe_name: str) -> None:
    """Check 3: stepping an optimizer given to ``prepare(..., replaces=...)`` raises RuntimeError."""

    def refuse(opt: torch.optim.Optimizer, args: Any, kwargs: Any) -> None:
        raise RuntimeError(
            f"this {type(opt).__name__} was replaced by plan.optimizer (prepare(..., replaces=...), "
            f"recipe {recipe_name!r}): step plan.optimizer instead")

    optimizer.register_step_pre_hook(refuse)


def unread_fields_note(recipe: Recipe) -> Optional[str]:
    """Check 4: the warning for the fields of ``recipe`` that its optimizer does not read, or None.

    A field counts when the user set it: its value is neither :class:`Recipe`'s default nor a
    registered recipe's (as in check 1: a preset switched to another optimizer, e.g.
    ``dataclasses.replace(RECIPES["fujitsu"], optimizer="sgd")``, keeps its LARS values unread
    without a warning)."""
    entry = OPTIMIZERS.get(recipe.optimizer)
    known = [Recipe(name="default"), *RECIPES.values()]
    unread = [f for f in entry.unread() if all(getattr(recipe, f) != getattr(r, f) for r in known)]
    if not unread:
        return None
    readers = {f: [n for n, o in OPTIMIZERS.items() if f in o.reads] for f in unread}
    return (f"recipe {recipe.name!r}: optimizer {recipe.optimizer!r} does not read "
            + "; ".join(f"{f}={getattr(recipe, f)!r} (read by {', '.join(readers[f])})" for f in unread)
            + f": ignored. Choose an optimizer that reads it (Recipe(optimizer=...)) or leave it at its default")
