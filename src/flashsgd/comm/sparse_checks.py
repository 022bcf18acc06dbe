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

from typing import Any

import torch

from flashsgd.comm.sparse_corrections import check_momentum_owner
from flashsgd.exchanges import EXCHANGES, MIN_COVERAGE, SparseOptions, coverage, steps_for_coverage
from flashsgd.fmt import plural


def check_sparse_run(algorithm: str, options: Any, total_steps: int,
                     optimizer_momentum: float = 0.0) -> list[str]:
    """Errors and warnings for the hook ``algorithm`` with ``options`` (its options object) on a run
    of ``total_steps``.

    Raises ValueError: a density warm-up longer than the run; momentum correction together with
    an optimizer momentum > 0. Returns the warnings (the step-count bound), one line each; none
    for an exchange that is not sparse.
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
            f"step-count bound): expect a loss of accuracy against dense (docs/sparse_accuracy.md); "
            f"for >= {MIN_COVERAGE:g} use >= {plural(steps_for_coverage(options), 'step')}, a higher "
            f"density or a denser warm-up"]


def check_optimizer_momentum(hook_state: Any, optimizer: torch.optim.Optimizer) -> None:
    """ValueError when the hook owns the momentum (``hook_state.owns_momentum``) and a parameter
    group of ``optimizer`` has momentum > 0 as well."""
    if getattr(hook_state, "owns_momentum", False):
        momentum = max(g.get("momentum", 0.0) for g in optimizer.param_groups)
        check_momentum_owner(hook_state.momentum, momentum)
