"""flashsgd in a Hugging Face Accelerate loop: a hook attached after ``prepare``, state in ``save_state``.

Use (docs/integrations.md; ``examples/accelerate_gtopk.py`` runs it)::

    from flashsgd.integrations.accelerate import attach_hook, recipe_optimizer
    optimizer, scheduler, setup = recipe_optimizer(model, "goyal", global_batch=256, num_samples=n, epochs=5)
    model, optimizer, loader, scheduler = accelerator.prepare(model, optimizer, loader, scheduler)
    attach_hook(accelerator, model, "gtopk", density=0.01, density_warmup=0.25, density_warmup_steps=20,
                total_steps=setup.total_steps())

Launch: ``accelerate launch --num_processes 2 train.py`` or ``torchrun --nproc-per-node 2 train.py``;
on CPUs ``ACCELERATE_USE_CPU=1`` (or ``Accelerator(cpu=True)``): Gloo. A single process gets no
DDP model from ``prepare`` (nothing to exchange), and :func:`attach_hook` says so.

:func:`attach_hook`, called on every process after ``accelerator.prepare``:

1. Refuses a flashsgd LR schedule that Accelerate would step ``num_processes`` times per
   optimizer step: a ``LambdaLR`` of :func:`flashsgd.optim.schedules.lambda_lr` that went through
   ``prepare`` (its ``AcceleratedScheduler`` steps ``num_processes`` times unless
   ``Accelerator(step_scheduler_with_optimizer=False)`` or ``split_batches=True``): on 2 processes
   it ends the whole schedule at mid-run. :class:`~flashsgd.integrations.recipe.RecipeLR` (from
   :func:`recipe_optimizer`) counts optimizer steps, so it is right either way.
2. Registers the hook (:func:`flashsgd.comm.hooks.register_hook`) on the prepared DDP model, with
   the run length when given (``total_steps``: the trainer's step-count check, warned on the main
   process as ``flashsgd train`` does; a density warm-up longer than the run is an error) and
   ``accelerator.scaler`` (fp16's GradScaler, None otherwise: :mod:`flashsgd.comm.hook_step`).
   Called after ``load_state`` (the optimizer already has state), it warns: that load did not
   restore the hook's state.
3. ``accelerator.save_state(dir)`` then also writes each process's hook state to
   ``dir/flashsgd_hook/rank<r>.pt`` (:mod:`flashsgd.integrations.rank_state`: per rank, not a
   gather into the main process's files), through ``register_save_state_pre_hook``;
   ``accelerator.load_state(dir)`` reads this process's own back (``register_load_state_pre_hook``).
   Accelerate's ``total_limit`` removes a checkpoint directory with its per-rank states.
4. After a ``load_state``, the first training forward first rebuilds DDP's buckets
   (:func:`flashsgd.comm.hooks.rebuild_buckets`, with that batch and the sum of the model's outputs,
   or their ``loss``, as the loss: the same backward graph), so the resumed run is bit-identical.
"""

from __future__ import annotations

import warnings
from collections.abc import Mapping
from pathlib import Path
from typing import Any, Callable

import torch

try:
    import accelerate  # noqa: F401
except ImportError as exc:  # pragma: no cover - the optional extra is missing
    raise ImportError("flashsgd.integrations.accelerate needs Hugging Face Accelerate: pip install "
                      "'flashsgd[integrations]' (or accelerate>=1.0)") from exc

from flashsgd.comm.hooks import HOOKS, rebuild_buckets, register_hook
from flashsgd.exchanges import EXCHANGES
from flashsgd.integrations.plan import warmup_in_steps
from flashsgd.integrations.rank_state import load_rank_state, save_rank_state
from flashsgd.integrations.recipe import RecipeLR, recipe_optimizer
from flashsgd.launch import shutdown_at_exit

__all__ = ["attach_hook", "recipe_optimizer", "RecipeLR", "STATE_DIR", "check_schedulers"]

STATE_DIR = "flashsgd_hook"
"""Subdirectory of an ``accelerator.save_state`` directory holding the per-rank hook states."""


def check_schedulers(accelerator: Any) -> None:
    """Step 1: ValueError for a flashsgd ``LambdaLR`` that Accelerate steps ``num_processes``
    times per optimizer step (a prepared scheduler, neither ``split_batches`` nor
    ``step_scheduler_with_optimizer=False``, more than one process)."""
    processes = accelerator.num_processes
    for wrapped in getattr(accelerator, "_schedulers", []):
        inner = getattr(wrapped, "scheduler", wrapped)
        if processes < 2 or not getattr(wrapped, "step_with_optimizer", False) \
                or getattr(wrapped, "split_batches", False) or isinstance(inner, RecipeLR):
            continue
        lambdas = getattr(inner, "lr_lambdas", [])
        if any(getattr(f, "__module__", "").startswith("flashsgd.") for f in lambdas):
            raise ValueError(
                f"a flashsgd LR schedule (flashsgd.optim.schedules.lambda_lr, a function of the global "
                f"optimizer step) went through accelerator.prepare: Accelerate steps it {processes} times "
                f"per optimizer step ({processes} processes), so it would end the whole schedule after "
                f"1/{processes} of the run. Use flashsgd.integrations.accelerate.recipe_optimizer's "
                f"RecipeLR (right whether prepared or not), or keep this scheduler out of prepare(), or "
                f"Accelerator(step_scheduler_with_optimizer=False)")


def attach_hook(accelerator: Any, model: Any, name: str, options: Any = None, *,
                total_steps: int | None = None, steps_per_epoch: float | None = None,
                density_warmup_epochs: float | None = None, wrap: Callable | None = None,
                **kwargs: Any) -> Any:
    """Steps 1-4: register flashsgd's hook ``name`` on the prepared ``model`` and keep its
    per-rank state in ``save_state`` / ``load_state``; returns the hook state.

    Args:
        accelerator: the ``accelerate.Accelerator``.
        model: what ``accelerator.prepare`` returned for the model (DDP in a distributed launch).
        name: a hook of :data:`flashsgd.comm.hooks.HOOKS`.
        options: its options object, or None to build it from ``kwargs``.
        total_steps: the run's optimizer steps: the trainer's step-count check runs (None: not).
        steps_per_epoch: optimizer steps per epoch (for ``density_warmup_epochs``).
        density_warmup_epochs: the density warm-up's length in epochs (sparse hooks), turned into
            ``density_warmup_steps``; its start is ``density_warmup`` (default 0.25, DGC's).
        wrap: optional ``wrap(hook) -> hook``, as :func:`register_hook`.
        **kwargs: the hook's options by name.

    Call it on every process, after ``accelerator.prepare`` and before the first backward; for a
    resume, before ``accelerator.load_state``.
    """
    HOOKS.get(name)
    check_schedulers(accelerator)                                                   # Step 1
    if options is None:
        options = EXCHANGES[name].make_options(**warmup_in_steps(name, kwargs, steps_per_epoch,
                                                                 density_warmup_epochs))
    elif kwargs or density_warmup_epochs is not None:
        raise ValueError(f"attach_hook({name!r}): pass either an options object or options by name")
    state = register_hook(model, name, options, wrap=wrap, total_steps=total_steps,  # Step 2
                          scaler=accelerator.scaler)
    _warn_if_resumed(accelerator, name)
    shutdown_at_exit()  # Accelerate never destroys its process group: flashsgd's subgroups with it
    resumed = {"pending": False}

    def save(models: list, weights: list, output_dir: str) -> None:                 # Step 3
        save_rank_state(state, Path(output_dir) / STATE_DIR, name)

    def load(models: list, input_dir: str) -> None:
        load_rank_state(state, Path(input_dir) / STATE_DIR, name, f" (accelerator.load_state({input_dir!r}))")
        resumed["pending"] = True

    def rebuild(module: Any, args: tuple, kw: dict) -> None:                         # Step 4
        if not resumed["pending"] or not module.training or not torch.is_grad_enabled():
            return
        resumed["pending"] = False
        rebuild_buckets(module, lambda: as_loss(module(*args, **kw)))

    accelerator.register_save_state_pre_hook(save)
    accelerator.register_load_state_pre_hook(load)
    model.register_forward_pre_hook(rebuild, with_kwargs=True)
    return state


def _warn_if_resumed(accelerator: Any, name: str) -> None:
    """A warning when the prepared optimizers already have state (``accelerator.load_state`` ran
    before :func:`attach_hook`, or training did): the hook's per-rank state would not be restored
    by that load, and the hook starts from empty memories."""
    if not EXCHANGES[name].compresses:  # only memories across steps are lost
        return
    stepped = [o for o in getattr(accelerator, "_optimizers", []) if getattr(o, "state", None)]
    if stepped and accelerator.is_main_process:
        warnings.warn(f"attach_hook({name!r}) after the optimizer already has state (an accelerator.load_state, "
                      f"or steps taken without the hook): the hook starts from empty error-feedback memories. "
                      f"For a resume, call attach_hook before accelerator.load_state: then load_state restores "
                      f"each rank's hook state and the resume is exact", UserWarning, stacklevel=3)


def as_loss(output: Any) -> torch.Tensor:
    """A scalar through every output of the model (its ``loss`` when it has one): the backward
    graph of the real loss, for :func:`rebuild_buckets` (whose gradients are discarded)."""
    loss = output.get("loss") if isinstance(output, Mapping) else getattr(output, "loss", None)
    if isinstance(loss, torch.Tensor) and loss.requires_grad:
        return loss
    found: list[torch.Tensor] = []

    def collect(x: Any) -> None:
        if isinstance(x, torch.Tensor):
            if x.requires_grad and x.is_floating_point():
                found.append(x.float().sum())
        elif isinstance(x, Mapping):
            for v in x.values():
                collect(v)
        elif isinstance(x, (list, tuple)):
            for v in x:
                collect(v)
    collect(output)
    if not found:
        raise ValueError(f"flashsgd: the model's first training forward after a resume returned "
                         f"{type(output).__name__} with no tensor that needs a gradient: DDP's buckets "
                         f"cannot be rebuilt from it")
    return torch.stack(found).sum()
