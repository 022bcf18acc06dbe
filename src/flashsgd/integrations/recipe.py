"""A recipe's optimizer and an LR scheduler that any trainer may step any number of times per step.

The recipe's LR is a pure function of the global optimizer step (:func:`flashsgd.optim.schedules.lr_at_step`:
Goyal et al. 2017's linear scaling and gradual warm-up, then the recipe's decay). Trainers step a
scheduler in their own ways: Lightning once per optimizer step (``"interval": "step"``), Accelerate
``num_processes`` times per step for a scheduler that went through ``accelerator.prepare`` (its
``AcceleratedScheduler`` assumes a schedule counted in samples of one process; with
``split_batches`` or ``step_scheduler_with_optimizer=False`` once), a script wherever it calls
``step()``. A plain ``LambdaLR`` counts its ``step()`` calls: on 2 processes under Accelerate it
finished the whole schedule at mid-run (LR 0 for the second half), silently.

:class:`RecipeLR` counts optimizer steps instead (a step post-hook on the optimizer: a step that a
loss scaler skips is not counted), and each ``step()`` sets the LR of the step count: stepping it
once or ``num_processes`` times per optimizer step gives the same LR, so it is correct whether or
not it goes through ``accelerator.prepare``. Its ``state_dict`` holds the count (checkpointed by
both trainers with the scheduler).

Example::

    >>> optimizer, scheduler, setup = recipe_optimizer(model, "goyal", global_batch=1024,   # doctest: +SKIP
    ...                                                num_samples=50_000, epochs=30)
    >>> for x, y in loader: ...; optimizer.step(); scheduler.step()                          # doctest: +SKIP
"""

from __future__ import annotations

from typing import Any

import torch

from flashsgd.optim.plan import RecipeSetup, prepare
from flashsgd.optim.recipes import RECIPES, Recipe
from flashsgd.optim.schedules import lr_at_step


class RecipeLR(torch.optim.lr_scheduler.LambdaLR):
    """The LR of ``setup``'s recipe at the optimizer's own step count (module docstring).

    Every parameter group gets the schedule's LR (LARS's exclusions change decay and adaptation,
    not the LR), as :func:`flashsgd.optim.schedules.lambda_lr`. ``step()`` is idempotent between
    optimizer steps."""

    def __init__(self, setup: RecipeSetup) -> None:
        schedule, table, samples, drop_last = setup.schedule, setup.table, setup._samples(), setup.drop_last
        optimizer = setup.optimizer
        for group in optimizer.param_groups:  # the multiplier is the LR itself
            group["lr"] = 1.0
            group["initial_lr"] = 1.0
        self.optimizer_steps = 0
        self._counter = optimizer.register_step_post_hook(self._count)
        super().__init__(optimizer, lambda step: lr_at_step(step, schedule, table, samples, drop_last))

    def _count(self, optimizer: torch.optim.Optimizer, args: Any, kwargs: Any) -> None:
        self.optimizer_steps += 1

    def step(self, epoch: int | None = None) -> None:
        """Set the LR of the optimizer's step count (any number of calls per optimizer step)."""
        if epoch is not None:
            raise ValueError("RecipeLR.step() takes no epoch: the LR follows the optimizer's step count")
        self.last_epoch = self.optimizer_steps - 1  # LRScheduler.step() adds one
        super().step()

    def state_dict(self) -> dict:
        state = super().state_dict()
        state.pop("_counter", None)  # a hook handle, re-made at construction
        return state

    def load_state_dict(self, state_dict: dict) -> None:
        state_dict = {k: v for k, v in state_dict.items() if k != "_counter"}
        super().load_state_dict(state_dict)


def recipe_optimizer(model: torch.nn.Module, recipe: Recipe | str, *, global_batch: int, num_samples: int,
                     epochs: float | None = None, drop_last: bool = False,
                     model_tweaks: bool = True) -> tuple[torch.optim.Optimizer, RecipeLR, RecipeSetup]:
    """The recipe's optimizer, a :class:`RecipeLR` and the :class:`~flashsgd.optim.plan.RecipeSetup`
    (its ``loss_fn``, ``describe()``, ``total_steps()``) at ``global_batch`` (the final global
    batch: every rank's batch x ranks x accumulation) over ``epochs`` of ``num_samples``
    (:func:`flashsgd.optim.plan.prepare`; ``model_tweaks``: the recipe's BatchNorm changes)."""
    if isinstance(recipe, str):
        recipe = RECIPES.get(recipe)
    setup = prepare(recipe, model, global_batch, num_samples, drop_last, epochs=epochs, model_tweaks=model_tweaks)
    return setup.optimizer, RecipeLR(setup), setup
