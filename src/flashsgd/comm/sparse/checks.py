"""Checks of a sparse run's settings before training: conflicts (errors) and the step-count bound
(a warning).

Papers: Shi et al. 2019 (gTop-k, arXiv 1901.04359), Lin et al. 2018 (DGC, arXiv 1712.01887);
measurements in docs/sparse_accuracy.md. Call :func:`check_sparse_run` once the run length is
known (the plan) and :func:`check_optimizer_momentum` once the optimizer and the hook exist.

The step-count bound (:func:`flashsgd.exchanges.coverage`, the one rule the planner applies too):
with error feedback every coordinate's gradient is delayed in the residual until it is among the k
largest, so over the sparse steps of a run each coordinate can be sent at most ``coverage`` times.
When that is a few units (1000 steps at density 0.001: 1.0), most coordinates are updated once or
twice in the whole run, each time with the sum of a long stretch of gradients: no correction to the
update rule recovers dense accuracy then; only more steps, a higher density, or a denser warm-up do.
Below :data:`~flashsgd.exchanges.MIN_COVERAGE` (measured, docs/sparse_accuracy.md) the run warns.

Example::

    >>> from flashsgd.exchanges import SparseOptions
    >>> check_sparse_run("gtopk", SparseOptions(density=0.001), total_steps=1250)[0][:40]
    'gtopk at density 0.001 over 1250 steps c'
"""

from __future__ import annotations

import dataclasses
import math
from typing import Any

import torch

from flashsgd.comm.sparse.corrections import check_momentum_owner
from flashsgd.exchanges import (EXCHANGES, MIN_COVERAGE, DensityWarmup, SparseOptions, coverage,
                                density_for_coverage, steps_to_coverage)
from flashsgd.fmt import plural


def check_sparse_run(algorithm: str, options: Any, total_steps: int,
                     optimizer_momentum: float = 0.0, warmup: DensityWarmup | None = None,
                     steps_per_epoch: float | None = None, epochs: float | None = None) -> list[str]:
    """Errors and warnings for the hook ``algorithm`` with ``options`` (its options object) on a run
    of ``total_steps``.

    Raises ValueError: a density warm-up longer than the run; momentum correction together with
    an optimizer momentum > 0. Returns the warnings (the step-count bound, with the density and the
    run length that would reach :data:`MIN_COVERAGE`: :func:`remedy`), one line each; none for an
    exchange that is not sparse. ``warmup`` (the run's warm-up rule), ``steps_per_epoch`` (of its
    first epoch) and ``epochs`` (its length) let the remedy rescale the warm-up as the run would
    and name ``--epochs``; without them the warm-up of ``options`` is kept and steps are named.
    """
    if EXCHANGES[algorithm].family != "sparse":
        return []
    assert isinstance(options, SparseOptions)
    warm = options.density_warmup_steps
    if options.density_warmup is not None and warm > total_steps:
        raise ValueError(f"the density warm-up lasts {plural(warm, 'step')}, longer than the run "
                         f"({plural(total_steps, 'step')}): shorten comm.density_warmup_epochs or train longer")
    check_momentum_owner(options.momentum_correction, optimizer_momentum)
    cover = coverage(total_steps, options)
    if cover >= MIN_COVERAGE:
        return []
    return [f"{algorithm} at density {options.density:g} over {plural(total_steps, 'step')} can send each "
            f"gradient entry at most {plural(cover, 'time', than=MIN_COVERAGE)} (density x steps; "
            f"step-count bound{_with_warmup(options)}): expect a loss of accuracy against dense "
            f"(docs/sparse_accuracy.md); for >= {MIN_COVERAGE:g}: "
            f"{remedy(options, total_steps, warmup, steps_per_epoch, epochs)}"]


def _with_warmup(options: SparseOptions) -> str:
    if options.density_warmup is None or options.density_warmup_steps < 1:
        return "; no density warm-up"
    return (f"; density warm-up {options.density_warmup:g} -> {options.density:g} over "
            f"{plural(options.density_warmup_steps, 'step')}")


def remedy(options: SparseOptions, total_steps: int, warmup: DensityWarmup | None = None,
           steps_per_epoch: float | None = None, epochs: float | None = None) -> str:
    """What would reach :data:`MIN_COVERAGE`: the smallest density at this length and the shortest
    run at this density (:func:`~flashsgd.exchanges.density_for_coverage`,
    :func:`~flashsgd.exchanges.steps_to_coverage`), each with ``warmup`` rescaled as the run
    would rescale it (else the warm-up of ``options`` as it is)."""
    if warmup is not None and steps_per_epoch:
        bare = dataclasses.replace(options, density_warmup=None, density_warmup_steps=0)

        def at_density(d: float) -> SparseOptions:
            return dataclasses.replace(bare, density=d, **warmup.options(d, total_steps, steps_per_epoch))

        def at_steps(n: int) -> SparseOptions:
            return dataclasses.replace(bare, **warmup.options(options.density, n, steps_per_epoch))
        same = ", each with this warm-up rule" if options.density_warmup else ""
    else:
        def at_density(d: float) -> SparseOptions:
            return dataclasses.replace(options, density=d)

        def at_steps(n: int) -> SparseOptions:
            return options
        same = ""
    density = density_for_coverage(total_steps, at_density)
    steps = steps_to_coverage(at_steps, total_steps)
    if epochs and warmup is not None:  # name the flags; epochs at this run's steps per epoch
        need = math.ceil(round(steps * epochs / total_steps, 6))
        by_density = (f"--density >= {density:g}" if density is not None else
                      f"no density is enough in {plural(total_steps, 'step')}")
        return (f"{by_density}, or --epochs >= {need} at density {options.density:g} (about "
                f"{plural(steps, 'step')}){same}")
    by_density = (f"a density >= {density:g}" if density is not None else
                  f"(no density is enough in {plural(total_steps, 'step')})")
    return f"use >= {plural(steps, 'step')} or {by_density}{same}"


def check_optimizer_momentum(hook_state: Any, optimizer: torch.optim.Optimizer) -> None:
    """ValueError when the hook owns the momentum (``hook_state.owns_momentum``) and a parameter
    group of ``optimizer`` has momentum > 0 as well."""
    if getattr(hook_state, "owns_momentum", False):
        momentum = max(g.get("momentum", 0.0) for g in optimizer.param_groups)
        check_momentum_owner(hook_state.momentum, momentum)
