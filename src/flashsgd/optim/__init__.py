"""Keeping accuracy at large batch: LARS, LAMB, schedules (pure functions of the step), recipes and plans."""

from flashsgd.optim.lamb import LAMB
from flashsgd.optim.lars import LARS, is_bias_or_norm, param_groups
from flashsgd.optim.optimizers import OPTIMIZERS
from flashsgd.optim.plan import (RecipeSetup, RecipeWarning, apply_model_tweaks, build_batch_table, build_loss,
                                 build_optimizer, build_schedule, prepare)
from flashsgd.optim.recipes import PRESET_EPOCHS, RECIPES, Recipe, tuned_variant
from flashsgd.optim.schedules import (BatchTable, Schedule, as_int, batch_at, epoch_at_step, lambda_lr,
                                      lr_at, lr_at_step, lr_table, scaled_lr, steps_per_epoch)

__all__ = [
    "LARS", "LAMB", "OPTIMIZERS", "param_groups", "is_bias_or_norm",
    "RECIPES", "Recipe", "PRESET_EPOCHS", "tuned_variant",
    "RecipeSetup", "RecipeWarning", "prepare", "build_optimizer", "build_schedule", "build_batch_table",
    "build_loss", "apply_model_tweaks",
    "Schedule", "BatchTable", "as_int", "scaled_lr", "lr_at", "lr_at_step", "batch_at", "epoch_at_step",
    "steps_per_epoch", "lambda_lr", "lr_table",
]
