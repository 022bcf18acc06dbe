"""flashsgd in the Hugging Face Transformers ``Trainer``: a hook in one callback, its state in each checkpoint.

Use (``examples/transformers_gtopk.py`` runs it)::

    from flashsgd.integrations.transformers import FlashsgdCallback
    trainer = Trainer(model=model, args=TrainingArguments(output_dir, use_cpu=True, ...), train_dataset=data)
    FlashsgdCallback("gtopk", density=0.01, density_warmup=0.25, density_warmup_epochs=1).attach(trainer)
    trainer.train()                                  # or train(resume_from_checkpoint=True / "out/checkpoint-500")

Launch: ``torchrun --nproc-per-node N train.py`` (``accelerate launch`` too); on CPUs
``TrainingArguments(use_cpu=True)``: Gloo. A single process gets no DDP model (nothing to
exchange), and the callback says so.

Why ``attach(trainer)``: the Trainer gives its callbacks the unwrapped model, the optimizer and
the data loader, never itself, and a flashsgd hook needs three things only the Trainer holds:
the DDP model (``trainer.model_wrapped``, DDP once ``train()`` has wrapped it), the loss scaler
(``trainer.accelerator.scaler``, None without fp16) and the checkpoint ``train()`` resumes from
(its ``resume_from_checkpoint`` argument, not stored by the Trainer nor given to callbacks).
``attach`` adds the callback (``trainer.add_callback``) and keeps the trainer; it also wraps this
trainer's ``train`` to note that argument before calling the Trainer's own ``train`` unchanged
(``True``: the last checkpoint of ``args.output_dir``, found as the Trainer finds it,
``transformers.trainer_utils.get_last_checkpoint``). A checkpoint's folder alone is not enough:
``train(resume_from_checkpoint=PATH)`` may name a checkpoint outside ``output_dir``, and a
``checkpoint-N`` of ``output_dir`` may then be another run's. The Trainer's ``accelerator.save_state``
hooks are no way in either: its checkpoints of a DDP run do not go through ``save_state``.

What :class:`FlashsgdCallback` does, at these points of ``Trainer.train``:

1. ``on_train_begin`` (the model is wrapped in DDP; a resume has restored the weights, the
   optimizer and ``TrainerState``): checks ``trainer.model_wrapped`` is DDP, then
   :func:`flashsgd.comm.hooks.register_hook` on it with the run length ``state.max_steps`` (the
   trainer's step-count check, warned on rank 0 as ``flashsgd train`` does) and the loss scaler
   ``trainer.accelerator.scaler``. ``density_warmup_epochs`` is turned into steps with the
   Trainer's optimizer steps per epoch.
2. Still ``on_train_begin``, on a resume: each rank loads its own state from
   ``<checkpoint>/flashsgd_hook/rank<r>.pt`` (:mod:`flashsgd.integrations.rank_state`); a
   checkpoint without states is a warning naming it (rank 0; the hook starts from empty
   residuals), states that only some ranks see an error naming the others (one all-gather of a
   flag decides, so that every rank does the same).
3. The first training forward after a resume first rebuilds DDP's buckets
   (:func:`flashsgd.comm.hooks.rebuild_buckets`, with that batch and the model's ``loss``: the
   same backward graph; a forward pre-hook on the DDP model), so the resumed run is
   bit-identical to the uninterrupted one. (DDP rebuilds its buckets only without
   ``find_unused_parameters``: ``TrainingArguments(ddp_find_unused_parameters=False)``; the
   Trainer's default for a PreTrainedModel is True, and then the layout never changes.)
4. ``on_save`` (every rank, after the Trainer wrote ``<output_dir>/checkpoint-<global step>``):
   each rank writes its hook state to ``checkpoint-<step>/flashsgd_hook/rank<r>.pt``, inside the
   checkpoint, so that ``save_total_limit`` removes it with the checkpoint.

Not supported: FSDP, DeepSpeed and one-process ``DataParallel`` (flashsgd hooks are DDP
communication hooks: an error names what ``trainer.model_wrapped`` is), ``hyperparameter_search``
(its checkpoints go to per-trial folders). Under ``fp16=True`` a fused optimizer (transformers 5's
default ``optim="adamw_torch_fused"``) is called by GradScaler on every step with its ``found_inf``
and skips inside the kernel; the hook reads that ``found_inf`` on a non-finite step and puts its
memories back as for any other optimizer (:mod:`flashsgd.comm.hook_step`).

Example::

    >>> trainer = Trainer(model=model, args=args, train_dataset=data)                     # doctest: +SKIP
    >>> FlashsgdCallback("torus2d", grid="2x2").attach(trainer)                             # doctest: +SKIP
    >>> trainer.train(resume_from_checkpoint=True)                                          # doctest: +SKIP
"""

from __future__ import annotations

import dataclasses
import functools
import math
import os
import warnings
from pathlib import Path
from typing import Any, Callable

import torch
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel

try:
    from transformers import TrainerCallback
    from transformers.trainer_utils import PREFIX_CHECKPOINT_DIR, get_last_checkpoint
    from transformers.utils import logging
except ImportError as exc:  # pragma: no cover - the optional extra is missing
    raise ImportError("flashsgd.integrations.transformers needs Hugging Face Transformers: pip install "
                      "'flashsgd[integrations]' (or transformers>=4.44)") from exc

from flashsgd.comm.hooks import rebuild_buckets, register_hook
from flashsgd.exchanges import EXCHANGES
from flashsgd.integrations.accelerate import as_loss
from flashsgd.integrations.plan import check_callback_options, warmup_in_steps
from flashsgd.integrations.rank_state import load_rank_state, save_rank_state
from flashsgd.launch import shutdown_at_exit

__all__ = ["FlashsgdCallback", "STATE_DIR"]

STATE_DIR = "flashsgd_hook"
"""Subdirectory of a Trainer checkpoint (``checkpoint-N``) holding the per-rank hook states."""

logger = logging.get_logger(__name__)


class FlashsgdCallback(TrainerCallback):
    """Register flashsgd's DDP hook ``name`` in a Hugging Face Trainer's DDP run, and keep its
    per-rank state in the Trainer's checkpoints (module docstring: Steps 1-4).

    Args:
        name: a hook of :data:`flashsgd.comm.hooks.HOOKS` (``ring``, ``torus2d``, ``gtopk``, ...).
        options: its options object, or None to build it from ``kwargs``.
        density_warmup_epochs: the density warm-up's length in epochs (sparse hooks), turned into
            ``density_warmup_steps`` with the Trainer's optimizer steps per epoch; its start is
            ``density_warmup`` (default 0.25, DGC's).
        wrap: optional ``wrap(hook) -> hook`` (e.g. a timer), as :func:`register_hook`.
        **kwargs: the hook's options by name; ``density_warmup`` needs a length
            (``density_warmup_steps`` or ``density_warmup_epochs``).

    The name and options are checked here, before ``train()`` starts. Give the callback its
    trainer with :meth:`attach` (the Trainer does not pass itself to callbacks). ``state`` is the
    hook state once registered (None before ``train()``).

    Example::

        >>> FlashsgdCallback("gtopk", density=0.01, density_warmup=0.25,                     # doctest: +SKIP
        ...                  density_warmup_epochs=1).attach(trainer)
    """

    def __init__(self, name: str, options: Any = None, *, density_warmup_epochs: float | None = None,
                 wrap: Callable | None = None, **kwargs: Any) -> None:
        check_callback_options("FlashsgdCallback", name, options, kwargs, density_warmup_epochs)  # now, not in train()
        self.name, self.options, self.kwargs, self.wrap = name, options, kwargs, wrap
        self.density_warmup_epochs = density_warmup_epochs
        self.state: Any = None
        self.trainer: Any = None
        self._resume_arg: str | bool | None = None  # train()'s resume_from_checkpoint, as given
        self._model: Any = None  # the DDP model the hook is registered on, with these options:
        self._registered: Any = None
        self._rebuild = False

    def attach(self, trainer: Any) -> FlashsgdCallback:
        """Give this callback its ``transformers.Trainer``: adds it to the trainer's callbacks
        (unless already there) and notes the checkpoint each ``trainer.train(...)`` resumes from
        (the Trainer's own ``train``, called unchanged). Returns the callback."""
        if self.trainer is not None:
            if self.trainer is trainer:
                return self
            raise ValueError(f"FlashsgdCallback({self.name!r}) is attached to another Trainer already: one "
                             f"callback per Trainer (its hook state belongs to that Trainer's DDP model)")
        if not callable(getattr(trainer, "train", None)) or not hasattr(trainer, "model_wrapped"):
            raise TypeError(f"FlashsgdCallback.attach needs a transformers.Trainer, got {type(trainer).__name__}")
        self.trainer = trainer
        if self not in trainer.callback_handler.callbacks:
            trainer.add_callback(self)
        train = trainer.train

        @functools.wraps(train)
        def train_noting_resume(resume_from_checkpoint: str | bool | None = None, *args: Any, **kwargs: Any) -> Any:
            self._resume_arg = resume_from_checkpoint
            return train(resume_from_checkpoint, *args, **kwargs)
        trainer.train = train_noting_resume
        return self

    # ----------------------------------------------------------------------- Steps 1 and 2 ---
    def on_train_begin(self, args: Any, state: Any, control: Any, train_dataloader: Any = None,
                       **kwargs: Any) -> None:
        trainer = self.trainer
        if trainer is None:
            raise RuntimeError(f"FlashsgdCallback({self.name!r}) has no Trainer: the Trainer does not pass itself "
                               f"to callbacks; give it with FlashsgdCallback(...).attach(trainer) (instead of "
                               f"Trainer(callbacks=[...]))")
        if state.is_hyper_param_search:
            raise ValueError(f"FlashsgdCallback({self.name!r}): Trainer.hyperparameter_search is not supported "
                             f"(its trials checkpoint into folders of their own)")
        model = trainer.model_wrapped
        if not isinstance(model, DistributedDataParallel):
            raise TypeError(_not_ddp(self.name, model, args))
        if model is not self._model:  # Step 1 (a second train() of this trainer keeps its DDP model and hook)
            self._registered = self._options(args, train_dataloader)
            self.state = register_hook(model, self.name, self._registered, wrap=self.wrap,
                                       total_steps=state.max_steps if state.max_steps > 0 else None,
                                       scaler=trainer.accelerator.scaler)
            model.register_forward_pre_hook(self._rebuild_before_first_step, with_kwargs=True)
            self._model = model
            shutdown_at_exit()  # the Trainer never destroys its process group: flashsgd's subgroups with it
        resume = self._resume_arg
        self._resume_arg = None
        if resume is True:  # as Trainer.train finds it (it has raised already when there is none)
            resume = get_last_checkpoint(args.output_dir)
        where = ""
        if resume:                                                                       # Step 2
            directory = Path(resume) / STATE_DIR
            if _seen_by_every_rank(directory, resume):
                load_rank_state(self.state, directory, self.name, f" (checkpoint {resume})")
                where = f"; each rank's state restored from {directory}"
            elif EXCHANGES[self.name].compresses and state.is_world_process_zero:
                warnings.warn(f"FlashsgdCallback({self.name!r}): the checkpoint {resume} has no flashsgd hook "
                              f"state (no {directory}{os.sep}rank<r>.pt: written without FlashsgdCallback, or "
                              f"removed): the hook starts from empty error-feedback residuals, and the run "
                              f"departs from the uninterrupted one", UserWarning)
            self._rebuild = True
        if state.is_world_process_zero:
            logger.info(f"flashsgd: hook {self.name}({_shown(self.name, self._registered)}) registered on "
                        f"{args.world_size} rank(s){where}")

    def _options(self, args: Any, loader: Any) -> Any:
        """The options object, ``density_warmup_epochs`` in steps at this run's optimizer steps
        per epoch (the Trainer's count: ceil(batches per rank / gradient_accumulation_steps))."""
        if self.options is not None:
            return self.options
        per_epoch = None
        try:
            per_epoch = max(1, math.ceil(len(loader) / args.gradient_accumulation_steps))
        except TypeError:  # no loader, or an iterable dataset without a length
            pass
        try:
            kwargs = warmup_in_steps(self.name, self.kwargs, per_epoch, self.density_warmup_epochs)
        except ValueError as exc:
            raise ValueError(f"FlashsgdCallback({self.name!r}): {exc} (this run's steps per epoch are unknown: "
                             f"an iterable dataset without a length)") from None
        return EXCHANGES[self.name].make_options(**kwargs)

    # ------------------------------------------------------------------------------ Step 3 ---
    def _rebuild_before_first_step(self, module: Any, args: tuple, kw: dict) -> None:
        if not self._rebuild or not module.training or not torch.is_grad_enabled():
            return
        self._rebuild = False
        rebuild_buckets(module, lambda: as_loss(module(*args, **kw)))

    # ------------------------------------------------------------------------------ Step 4 ---
    def on_save(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
        if self.state is None:
            return
        checkpoint = Path(args.output_dir) / f"{PREFIX_CHECKPOINT_DIR}-{state.global_step}"  # the Trainer's name
        save_rank_state(self.state, checkpoint / STATE_DIR, self.name)


def _seen_by_every_rank(directory: Path, checkpoint: Any) -> bool:
    """Whether every rank sees per-rank states in ``directory`` (collective: one all-gather of a
    flag). None does: False. Some do: FileNotFoundError on every rank, naming the others."""
    here = any(directory.glob("rank*.pt"))
    seen: list[Any] = [None] * dist.get_world_size()
    dist.all_gather_object(seen, here)
    if all(seen):
        return True
    if any(seen):
        raise FileNotFoundError(
            f"flashsgd hook states of checkpoint {checkpoint}: rank(s) {[r for r, s in enumerate(seen) if not s]} "
            f"see no {directory}, the others do: the per-rank states are written inside the checkpoint, one file "
            f"per rank; resume from a filesystem every rank reads (or copy the folder to every node)")
    return False


def _shown(name: str, options: Any) -> str:
    """The options that differ from the hook's defaults, as ``k=v, ...``."""
    defaults = EXCHANGES[name].defaults()
    return ", ".join(f"{k}={v}" for k, v in dataclasses.asdict(options).items() if v != defaults.get(k))


def _not_ddp(name: str, model: Any, args: Any) -> str:
    """What ``trainer.model_wrapped`` is instead of DDP, and how to get a DDP run."""
    kind = f"{type(model).__module__}.{type(model).__qualname__}"
    head = (f"FlashsgdCallback({name!r}) needs the Trainer's model wrapped in DistributedDataParallel "
            f"(flashsgd hooks are DDP communication hooks), but trainer.model_wrapped is {kind}")
    if args.world_size <= 1:
        return (f"{head}: this Trainer runs one process (nothing to exchange). Launch it on N >= 2 processes: "
                f"`torchrun --nproc-per-node N train.py` (or `accelerate launch --num_processes N`); on CPUs "
                f"with TrainingArguments(use_cpu=True): Gloo")
    return (f"{head} on {args.world_size} processes: FSDP, DeepSpeed and DataParallel are not supported; use "
            f"the Trainer's plain DDP (no fsdp=, no deepspeed=)")
