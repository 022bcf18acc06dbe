"""flashsgd in PyTorch Lightning: a hook in one callback, a recipe in ``configure_optimizers``.

Use (docs/integrations.md; ``examples/lightning_gtopk.py`` runs it)::

    from flashsgd.integrations.lightning import FlashsgdHook, configure_optimizers
    trainer = L.Trainer(strategy="ddp", callbacks=[FlashsgdHook("gtopk", density=0.01, density_warmup_epochs=1)])
    # in the LightningModule:
    def configure_optimizers(self):
        return configure_optimizers(self, "goyal", global_batch=256, num_samples=len(self.train_set))

Why a Callback, not a ``DDPStrategy`` subclass: the callback composes with the strategy the user
already has (``strategy="ddp"``, ``DDPStrategy(bucket_cap_mb=..., timeout=...)``, a cluster
environment, the CLI's strategy strings) instead of replacing it, it is one line in ``callbacks``,
and it needs nothing a strategy alone has: the wrapped model (``trainer.strategy.model``), the
run length (``trainer.estimated_stepping_batches``) and the checkpoint hooks are all public to a
callback. Lightning's own hook arguments cannot take a flashsgd hook:
``DDPStrategy(ddp_comm_hook=..., ddp_comm_state=...)`` builds the state before the process group
and the DDP model exist (a flashsgd state needs both: ``HOOKS["gtopk"](None, options)`` fails),
and Lightning registers it on CUDA only (dropped silently on CPU).

What :class:`FlashsgdHook` does, at these points of ``Trainer.fit``:

1. ``setup``: checks the strategy is Lightning's DDP (flashsgd hooks are DDP communication
   hooks) and wraps the strategy's checkpoint IO so that rank 0 prunes the per-rank states of a
   checkpoint Lightning removes (``ModelCheckpoint(save_top_k=...)``).
2. ``on_load_checkpoint`` (a resume; before the model is wrapped): notes where the checkpoint's
   per-rank states are.
3. ``on_fit_start`` (after ``strategy.setup``: the process group exists, the model is wrapped in
   DDP): :func:`flashsgd.comm.hooks.register_hook` on ``trainer.strategy.model`` with the run
   length ``trainer.estimated_stepping_batches``: the trainer's step-count check warns on rank 0 as
   ``flashsgd train`` does, a warm-up longer than the run is an error. ``density_warmup_epochs`` is
   turned into steps with the trainer's steps per epoch. On a resume, each rank loads its own state.
   Under ``precision="16-mixed"`` the precision plugin's GradScaler is handed to the hook
   (:func:`loss_scaler`): memories in true gradient units, and a step the scaler skips for an
   overflow leaves them as they were (:mod:`flashsgd.comm.hook_step`).
4. ``on_train_batch_start`` of the first batch after a resume:
   :func:`flashsgd.comm.hooks.rebuild_buckets` with that batch (through
   ``trainer.strategy.training_step``, its logging discarded), so DDP's buckets are the
   uninterrupted run's and the resume is bit-identical (with automatic optimization; a manual one
   would step its optimizer in that call: not rebuilt, with a warning).
5. ``on_save_checkpoint`` (every rank, while Lightning builds the checkpoint): each rank writes its
   hook state to ``<checkpoint dir>/flashsgd-hook-state/step=<global step>/rank<r>.pt``
   (:mod:`flashsgd.integrations.rank_state`: per rank, not gathered into rank 0's file), and the
   checkpoint records where.

:func:`configure_optimizers` returns Lightning's dict: the recipe's optimizer and a per-step
:class:`~flashsgd.integrations.recipe.RecipeLR` (``"interval": "step"``).
"""

from __future__ import annotations

import dataclasses
import os
import shutil
import warnings
from collections.abc import Mapping
from pathlib import Path
from typing import Any, Callable

import torch

try:
    import lightning.pytorch as pl
    from lightning.fabric.plugins.io.checkpoint_io import CheckpointIO
    from lightning.pytorch.strategies import DDPStrategy
    from lightning.pytorch.utilities import rank_zero_info
except ImportError as exc:  # pragma: no cover - the optional extra is missing
    raise ImportError("flashsgd.integrations.lightning needs PyTorch Lightning: pip install "
                      "'flashsgd[integrations]' (or lightning>=2.4)") from exc

from flashsgd.comm.hooks import rebuild_buckets, register_hook
from flashsgd.exchanges import EXCHANGES
from flashsgd.integrations.plan import check_callback_options, warmup_in_steps
from flashsgd.integrations.rank_state import load_rank_state, save_rank_state
from flashsgd.integrations.recipe import RecipeLR, recipe_optimizer
from flashsgd.launch import shutdown_at_exit
from flashsgd.optim.plan_checks import RecipeWarning
from flashsgd.optim.recipes import Recipe

__all__ = ["FlashsgdHook", "configure_optimizers", "CHECKPOINT_KEY", "STATE_DIR"]

CHECKPOINT_KEY = "flashsgd_hook"
"""Key of Lightning's checkpoint dict that records the hook and where its per-rank states are."""
STATE_DIR = "flashsgd-hook-state"
"""Directory of the per-rank states, in the checkpoint directory: ``STATE_DIR/step=N/rank<r>.pt``."""


class FlashsgdHook(pl.Callback):
    """Register flashsgd's DDP hook ``name`` in a Lightning DDP run, and keep its per-rank state
    with Lightning's checkpoints (module docstring: Steps 1-5).

    Args:
        name: a hook of :data:`flashsgd.comm.hooks.HOOKS` (``ring``, ``torus2d``, ``gtopk``, ...).
        options: its options object, or None to build it from ``kwargs``.
        density_warmup_epochs: the density warm-up's length in epochs (sparse hooks), turned into
            ``density_warmup_steps`` with this run's optimizer steps per epoch; its start is
            ``density_warmup`` (default 0.25, DGC's).
        wrap: optional ``wrap(hook) -> hook`` (e.g. a timer), as :func:`register_hook`.
        **kwargs: the hook's options by name; ``density_warmup`` needs a length
            (``density_warmup_steps`` or ``density_warmup_epochs``).

    The name and options are checked here, before ``fit`` starts any process. ``state`` is the
    hook state once registered (None before ``on_fit_start``).

    Example::

        >>> trainer = L.Trainer(accelerator="cpu", devices=4, strategy="ddp",          # doctest: +SKIP
        ...                     callbacks=[FlashsgdHook("torus2d", grid="2x2")])
    """

    def __init__(self, name: str, options: Any = None, *, density_warmup_epochs: float | None = None,
                 wrap: Callable | None = None, **kwargs: Any) -> None:
        check_callback_options("FlashsgdHook", name, options, kwargs, density_warmup_epochs)  # now, not at fit
        self.name, self.options, self.kwargs, self.wrap = name, options, kwargs, wrap
        self.density_warmup_epochs = density_warmup_epochs
        self.state: Any = None
        self._resume: dict[str, Any] | None = None
        self._rebuild = False
        self._saved: dict[str, str] = {}  # rank 0: checkpoint path -> its state directory

    @property
    def state_key(self) -> str:
        return f"FlashsgdHook[{self.name}]"

    # ---------------------------------------------------------------------------- Step 1 ---
    def setup(self, trainer: pl.Trainer, pl_module: pl.LightningModule, stage: str) -> None:
        if stage != "fit":
            return
        if not isinstance(trainer.strategy, DDPStrategy):
            raise ValueError(
                f"FlashsgdHook({self.name!r}) needs Lightning's DDP strategy (flashsgd hooks are DDP "
                f"communication hooks), got {type(trainer.strategy).__name__}: use Trainer(strategy='ddp') "
                f"or strategy=DDPStrategy(...) (with one device too: a one-rank DDP runs the hook)")
        if not isinstance(trainer.strategy.checkpoint_io, _PruneStates):
            trainer.strategy.checkpoint_io = _PruneStates(trainer.strategy.checkpoint_io, self)

    # ---------------------------------------------------------------------------- Step 2 ---
    def on_load_checkpoint(self, trainer: pl.Trainer, pl_module: pl.LightningModule,
                           checkpoint: dict[str, Any]) -> None:
        record = checkpoint.get(CHECKPOINT_KEY)
        if record is None:
            if trainer.ckpt_path and EXCHANGES[self.name].compresses:
                warnings.warn(f"FlashsgdHook({self.name!r}): the checkpoint {trainer.ckpt_path} has no "
                              f"flashsgd hook state (written without FlashsgdHook): the hook starts from "
                              f"empty error-feedback residuals", UserWarning)
            return
        if record["hook"] != self.name:
            raise ValueError(f"checkpoint {trainer.ckpt_path}: written with flashsgd hook {record['hook']!r}, "
                             f"this run registers {self.name!r}: resume with FlashsgdHook({record['hook']!r}, ...)")
        self._resume = {**record, "ckpt_path": str(trainer.ckpt_path) if trainer.ckpt_path else None}
        if trainer.is_global_zero and trainer.ckpt_path:
            self._saved[str(trainer.ckpt_path)] = record["dir"]

    # ---------------------------------------------------------------------------- Step 3 ---
    def on_fit_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        total = trainer.estimated_stepping_batches
        known = isinstance(total, int) or (isinstance(total, float) and total != float("inf"))
        per_epoch = None
        batches = trainer.num_training_batches
        if batches != float("inf") and batches > 0:
            per_epoch = max(1, -(-int(batches) // trainer.accumulate_grad_batches))
        options = self.options
        if options is None:
            try:
                kwargs = warmup_in_steps(self.name, self.kwargs, per_epoch, self.density_warmup_epochs)
            except ValueError as exc:
                raise ValueError(f"FlashsgdHook({self.name!r}): {exc} (this run's steps per epoch are "
                                 f"unknown: an iterable dataset without a length)") from None
            options = EXCHANGES[self.name].make_options(**kwargs)
        self.state = register_hook(trainer.strategy.model, self.name, options, wrap=self.wrap,
                                   total_steps=int(total) if known else None, scaler=loss_scaler(trainer))
        shutdown_at_exit()  # Lightning never destroys its process group: flashsgd's subgroups with it
        where = ""
        if self._resume is not None:
            directory = self._find_states(self._resume)
            load_rank_state(self.state, directory, self.name, f" (checkpoint {self._resume['ckpt_path']})")
            self._rebuild = True
            where = f"; each rank's state restored from {directory}"
        defaults = EXCHANGES[self.name].defaults()
        shown = ", ".join(f"{k}={v}" for k, v in dataclasses.asdict(options).items() if v != defaults[k])
        rank_zero_info(f"flashsgd: hook {self.name}({shown}) registered on {trainer.world_size} rank(s)"
                       + ("" if known else " (run length unknown: step-count check skipped)") + where)

    @staticmethod
    def _find_states(record: dict[str, Any]) -> Path:
        """The per-rank state directory: beside the checkpoint (moved together), else where it was written."""
        ckpt = record.get("ckpt_path")
        candidates = ([Path(ckpt).parent / record["name"]] if ckpt else []) + [Path(record["dir"])]
        return next((c for c in candidates if c.is_dir()), candidates[0])

    # ---------------------------------------------------------------------------- Step 4 ---
    def on_train_batch_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule, batch: Any,
                             batch_idx: int) -> None:
        if not self._rebuild:
            return
        self._rebuild = False
        if not pl_module.automatic_optimization:  # its training_step would step the optimizer itself
            warnings.warn(f"FlashsgdHook({self.name!r}): manual optimization: DDP's buckets are not rebuilt "
                          f"before the first step after the resume (it runs in the first-iteration "
                          f"layout): the resume continues, not bit for bit", UserWarning)
            return
        loop = trainer.fit_loop.epoch_loop
        saved_results, saved_fx = getattr(loop, "_results", None), pl_module._current_fx_name
        if saved_results is not None:  # the warm-up's self.log calls go to a throwaway collection
            loop._results = type(saved_results)(training=True)
        pl_module._current_fx_name = "training_step"
        try:
            rebuild_buckets(trainer.strategy.model, lambda: _loss_of(trainer.strategy.training_step(batch, batch_idx)))
        finally:
            if saved_results is not None:
                loop._results = saved_results
            pl_module._current_fx_name = saved_fx

    # ---------------------------------------------------------------------------- Step 5 ---
    def on_save_checkpoint(self, trainer: pl.Trainer, pl_module: pl.LightningModule,
                           checkpoint: dict[str, Any]) -> None:
        if self.state is None:
            return
        root = Path(getattr(trainer.checkpoint_callback, "dirpath", None) or trainer.default_root_dir)
        name = f"{STATE_DIR}/step={trainer.global_step}"
        save_rank_state(self.state, root / name, self.name)
        checkpoint[CHECKPOINT_KEY] = {"hook": self.name, "world": trainer.world_size, "name": name,
                                      "dir": str((root / name).resolve()), "global_step": trainer.global_step}

    # rank 0, from _PruneStates: which checkpoint holds which state directory
    def _written(self, path: str, checkpoint: dict[str, Any]) -> None:
        record = checkpoint.get(CHECKPOINT_KEY)
        if record is not None:
            old = self._saved.get(path)
            self._saved[path] = record["dir"]
            if old is not None and old != record["dir"]:  # a checkpoint overwritten at a later step
                self._forget(old)

    def _removed(self, path: str) -> None:
        old = self._saved.pop(path, None)
        if old is not None:
            self._forget(old)

    def _forget(self, directory: str) -> None:
        """Delete a state directory no checkpoint of this run refers to any more."""
        if directory not in self._saved.values():
            shutil.rmtree(directory, ignore_errors=True)


class _PruneStates(CheckpointIO):
    """The strategy's checkpoint IO, telling :class:`FlashsgdHook` (on rank 0, the only rank that
    writes and removes Lightning's checkpoint files) what was written and removed, so that a
    removed checkpoint's per-rank states go with it. Everything else is the wrapped IO's."""

    def __init__(self, inner: CheckpointIO, callback: FlashsgdHook) -> None:
        self.inner, self.callback = inner, callback

    def save_checkpoint(self, checkpoint: dict[str, Any], path: Any, storage_options: Any = None) -> None:
        self.inner.save_checkpoint(checkpoint, path, storage_options=storage_options)
        self.callback._written(os.fspath(path), checkpoint)

    def load_checkpoint(self, *args: Any, **kwargs: Any) -> dict[str, Any]:
        return self.inner.load_checkpoint(*args, **kwargs)

    def remove_checkpoint(self, path: Any) -> None:
        self.inner.remove_checkpoint(path)
        self.callback._removed(os.fspath(path))

    def teardown(self) -> None:
        self.inner.teardown()

    def __getattr__(self, name: str) -> Any:  # the wrapped IO's other attributes
        if name in ("inner", "callback"):
            raise AttributeError(name)
        return getattr(self.inner, name)


def loss_scaler(trainer: pl.Trainer) -> Any:
    """The fp16 loss scaler of the run: the precision plugin's ``scaler`` (``MixedPrecision`` with
    ``precision="16-mixed"``; None with ``bf16-mixed``, ``32-true`` and other plugins)."""
    return getattr(trainer.strategy.precision_plugin, "scaler", None)


def _loss_of(output: Any) -> torch.Tensor:
    """The loss of a ``training_step`` output (a tensor or a dict with ``"loss"``)."""
    loss = output.get("loss") if isinstance(output, Mapping) else output
    if not isinstance(loss, torch.Tensor):
        raise ValueError(f"FlashsgdHook: the training_step of the first batch after the resume returned "
                         f"{type(output).__name__}, not a loss: DDP's buckets cannot be rebuilt with it")
    return loss


def configure_optimizers(module: pl.LightningModule, recipe: Recipe | str, *, global_batch: int,
                         num_samples: int, epochs: float | None = None, drop_last: bool = False,
                         model_tweaks: bool = False) -> dict[str, Any]:
    """Lightning's ``configure_optimizers`` dict from a recipe: the recipe's optimizer
    (:func:`flashsgd.optim.plan.build_optimizer`: LARS, SGD, LAMB with its parameter groups) and a
    :class:`~flashsgd.integrations.recipe.RecipeLR` stepped per optimizer step.

    Args:
        module: the LightningModule (its parameters; its trainer for the defaults and checks).
        recipe: a :class:`~flashsgd.optim.recipes.Recipe` or a name of ``RECIPES``.
        global_batch: the final global batch (per-device batch x ranks x ``accumulate_grad_batches``).
        num_samples: training samples per epoch.
        epochs: the run length (default: the trainer's ``max_epochs``).
        drop_last: whether the loader drops the last partial batch.
        model_tweaks: apply the recipe's BatchNorm tweaks here (default False: Lightning calls
            ``configure_optimizers`` after restoring a checkpoint's weights, which a zero-gamma
            would overwrite; apply them in ``__init__`` with
            :func:`flashsgd.optim.plan.apply_model_tweaks`).

    A schedule of another length than the trainer's run (``trainer.estimated_stepping_batches``)
    gives a :class:`~flashsgd.optim.plan_checks.RecipeWarning` naming both.

    Example::

        >>> def configure_optimizers(self):                                              # doctest: +SKIP
        ...     return configure_optimizers(self, "goyal", global_batch=1024, num_samples=50_000)
    """
    trainer = module._trainer
    if epochs is None and trainer is not None and trainer.max_epochs not in (None, -1):
        epochs = trainer.max_epochs
    optimizer, scheduler, setup = recipe_optimizer(module, recipe, global_batch=global_batch,
                                                   num_samples=num_samples, epochs=epochs, drop_last=drop_last,
                                                   model_tweaks=model_tweaks)
    if trainer is not None:
        total = trainer.estimated_stepping_batches
        planned = setup.total_steps()
        if total != float("inf") and int(total) != planned and trainer.is_global_zero:
            warnings.warn(f"recipe {setup.recipe.name!r} is planned for {planned} optimizer steps ({setup.epochs} "
                          f"epochs of {num_samples} samples at global batch {global_batch}), the trainer runs "
                          f"{int(total)}: check global_batch (per-device batch x {trainer.world_size} ranks x "
                          f"{trainer.accumulate_grad_batches} accumulation), num_samples and epochs",
                          RecipeWarning, stacklevel=2)
    return {"optimizer": optimizer,
            "lr_scheduler": {"scheduler": scheduler, "interval": "step", "frequency": 1,
                             "name": f"lr-{setup.recipe.name}"}}


__all__ += ["RecipeLR"]
