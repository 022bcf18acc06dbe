"""From a planner's choice to what a trainer needs: the hook, its options, DDP's bucket size.

``flashsgd plan --json`` (:mod:`flashsgd.sim.plan_cli`) writes the choice as a dict: the exchange
(``algorithm``), ``bucket_mb``, the grid, density, node split or PowerSGD rank, and for a sparse
choice the start of DGC's density warm-up (``density_warmup``, Lin et al. 2018) but not its
length: the planner leaves the length to the run (:class:`flashsgd.exchanges.DensityWarmup`:
min(4 epochs, half the run)). :func:`comm_from_plan` does what ``flashsgd train --comm auto``
does with it (:func:`flashsgd.train.auto.comm_changes`), for any trainer:

1. The hook's options from the choice (the keys its exchange reads; ``grid`` [X, Y] -> "XxY").
2. The density warm-up in steps for this run (``total_steps``, ``steps_per_epoch``), by the
   trainer's rule; never dropped (a start without a length is an error in
   :func:`flashsgd.comm.hooks.hook_options`: it used to be a silent no-op, 13 points on MNIST-1D).
3. The options checked (:func:`~flashsgd.comm.hooks.hook_options`) and the run checked as
   ``flashsgd train`` checks it (:func:`flashsgd.comm.sparse.checks.check_sparse_run`: a warm-up
   longer than the run is an error; the step-count bound's warning is kept in ``warnings``).
4. DDP's ``bucket_cap_mb`` from ``bucket_mb`` (the same unit, MiB): it goes to the trainer's DDP
   arguments, before the model is wrapped (``DDPStrategy(**comm.ddp_kwargs)``,
   ``DistributedDataParallelKwargs(**comm.ddp_kwargs)``, ``DDP(model, **comm.ddp_kwargs)``).

Example::

    >>> comm = comm_from_plan({"algorithm": "gtopk", "bucket_mb": 128.0, "density": 0.001,
    ...                        "grid": None, "density_warmup": 0.25}, total_steps=1000, steps_per_epoch=125)
    >>> comm.hook, comm.options["density_warmup_steps"], comm.ddp_kwargs
    ('gtopk', 500, {'bucket_cap_mb': 128.0})
"""

from __future__ import annotations

import json
import os
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Mapping

from flashsgd.exchanges import EXCHANGES, DensityWarmup

PLAN_KEYS = ("density", "grid", "node_split", "matrix_approximation_rank")
"""The keys of a planner choice that are hook options (where the exchange reads them)."""


@dataclass(frozen=True)
class TrainerComm:
    """What a trainer needs from a plan's choice (:func:`comm_from_plan`)."""

    hook: str
    """The hook's name (:data:`flashsgd.comm.hooks.HOOKS`)."""
    options: dict[str, Any]
    """Its options by name, for ``register_hook(ddp, hook, **options)`` or the integrations."""
    bucket_cap_mb: float
    """DDP's gradient bucket cap in MiB (the plan's ``bucket_mb``)."""
    total_steps: int
    """The run length the warm-up and the checks were derived for."""
    warnings: tuple[str, ...] = field(default=())
    """The step-count bound's warning for this run (``flashsgd train`` prints it), if any."""

    @property
    def ddp_kwargs(self) -> dict[str, float]:
        """DDP's constructor arguments (``bucket_cap_mb``)."""
        return {"bucket_cap_mb": self.bucket_cap_mb}

    def describe(self) -> str:
        """One line: hook, options, bucket cap."""
        opts = ", ".join(f"{k}={v}" for k, v in self.options.items())
        return f"hook {self.hook}({opts}), DDP buckets of {self.bucket_cap_mb:g} MiB over {self.total_steps} steps"


def read_choice(plan: Mapping[str, Any] | str | os.PathLike) -> dict[str, Any]:
    """The choice of ``plan``: a ``flashsgd plan --json`` file (its path), that document, or its
    ``choice`` dict itself."""
    if isinstance(plan, (str, os.PathLike)):
        path = Path(plan)
        try:
            plan = json.loads(path.read_text())
        except (OSError, ValueError) as exc:
            raise ValueError(f"plan {str(path)!r}: not a readable `flashsgd plan --json` file ({exc})") from None
    if not isinstance(plan, Mapping):
        raise ValueError(f"a plan must be a `flashsgd plan --json` document, its 'choice' or the file's "
                         f"path; got {type(plan).__name__}")
    choice = plan.get("choice", plan)
    if not isinstance(choice, Mapping) or "algorithm" not in choice or "bucket_mb" not in choice:
        raise ValueError(f"plan choice {dict(choice) if isinstance(choice, Mapping) else choice!r}: needs "
                         f"'algorithm' and 'bucket_mb' (the 'choice' of `flashsgd plan --json`)")
    return dict(choice)


def comm_from_plan(plan: Mapping[str, Any] | str | os.PathLike, *, total_steps: int,
                   steps_per_epoch: float, **overrides: Any) -> TrainerComm:
    """Steps 1-4: the hook, its options (the density warm-up in steps) and DDP's bucket cap of a
    planner choice for a run of ``total_steps`` optimizer steps with ``steps_per_epoch`` in its
    first epoch. ``overrides`` are further hook options (e.g. ``selection="threshold"``).

    Raises ValueError: an unknown exchange, a bad option, a warm-up longer than the run."""
    from flashsgd.comm.hooks import hook_options  # torch: only here
    from flashsgd.comm.sparse.checks import check_sparse_run

    choice = read_choice(plan)
    name = choice["algorithm"]
    exchange = EXCHANGES.get(name)
    if isinstance(total_steps, bool) or not isinstance(total_steps, int) or total_steps < 1:
        raise ValueError(f"total_steps must be the run's optimizer steps, an integer >= 1, got {total_steps!r}")
    if isinstance(steps_per_epoch, bool) or not isinstance(steps_per_epoch, (int, float)) or not steps_per_epoch > 0:
        raise ValueError(f"steps_per_epoch must be a number > 0 (optimizer steps per epoch), got {steps_per_epoch!r}")
    options: dict[str, Any] = {}
    for key in PLAN_KEYS:                                                           # Step 1
        value = choice.get(key)
        if value is not None and exchange.reads(key):
            options[key] = f"{value[0]}x{value[1]}" if key == "grid" else value
    start = choice.get("density_warmup")                                            # Step 2
    if start is not None and exchange.reads("density_warmup"):
        density = options.get("density", exchange.defaults()["density"])
        options.update(DensityWarmup(start=start).options(density, total_steps, steps_per_epoch))
    options.update(overrides)
    checked = hook_options(name, **options)                                         # Step 3
    unread = sorted(k for k in options if not exchange.reads(k))
    if unread:
        raise ValueError(f"hook {name!r} does not take option(s) {', '.join(unread)}; valid: "
                         f"{', '.join(exchange.option_names())}")
    warnings = tuple(check_sparse_run(name, checked, total_steps, steps_per_epoch=steps_per_epoch))
    bucket = choice["bucket_mb"]                                                    # Step 4
    if isinstance(bucket, bool) or not isinstance(bucket, (int, float)) or not bucket > 0:
        raise ValueError(f"plan choice bucket_mb must be a number of MiB > 0, got {bucket!r}")
    return TrainerComm(name, options, float(bucket), total_steps, warnings)


def check_callback_options(owner: str, name: str, options: Any, kwargs: dict[str, Any],
                           density_warmup_epochs: float | None) -> None:
    """A trainer callback's checks of hook ``name`` and its options at construction, before the
    trainer starts any process (``owner``: the callback's name, for the messages): a known name,
    an options object or options by name (not both), every option and value valid, and a density
    warm-up with its length (``density_warmup_steps`` or ``density_warmup_epochs``)."""
    from flashsgd.comm.hooks import HOOKS

    HOOKS.get(name)  # an unknown name lists the known ones
    if options is not None:
        if kwargs or density_warmup_epochs is not None:
            raise ValueError(f"{owner}({name!r}): pass either an options object or options by name")
        return
    EXCHANGES[name].make_options(**kwargs)  # unknown options and bad values
    if kwargs.get("density_warmup") is not None and "density_warmup_steps" not in kwargs \
            and density_warmup_epochs is None:
        raise ValueError(f"{owner}({name!r}): density_warmup={kwargs['density_warmup']:g} needs "
                         f"its length: density_warmup_epochs=E (epochs of this run) or "
                         f"density_warmup_steps=N; or density_warmup=None for no warm-up")
    warmup_in_steps(name, kwargs, 1.0, density_warmup_epochs)  # checks the epochs' value


def warmup_in_steps(name: str, options: dict[str, Any], steps_per_epoch: float | None,
                    epochs: float | None) -> dict[str, Any]:
    """``options`` with ``density_warmup_epochs`` (a trainer integration's keyword: the warm-up's
    length in epochs, as ``flashsgd train --density-warmup-epochs``) turned into
    ``density_warmup_steps`` at ``steps_per_epoch``; a ValueError names what is missing."""
    if epochs is None:
        return options
    if not EXCHANGES[name].reads("density_warmup"):
        raise ValueError(f"density_warmup_epochs: hook {name!r} has no density warm-up (the sparse hooks "
                         f"have: {', '.join(n for n, e in EXCHANGES.items() if e.reads('density_warmup'))})")
    if "density_warmup_steps" in options:
        raise ValueError("give the density warm-up's length once: density_warmup_epochs or "
                         "density_warmup_steps, not both")
    if isinstance(epochs, bool) or not isinstance(epochs, (int, float)) or not epochs > 0:
        raise ValueError(f"density_warmup_epochs must be a number of epochs > 0, got {epochs!r}")
    if steps_per_epoch is None:
        raise ValueError("density_warmup_epochs needs the run's steps per epoch (steps_per_epoch=...), "
                         "or give density_warmup_steps instead")
    start = options.get("density_warmup", DensityWarmup().start)
    return {**options, "density_warmup": start,
            "density_warmup_steps": DensityWarmup(start=start, epochs=epochs).steps(1, steps_per_epoch)}
