"""Checks of a sparse run's settings before training: conflicts (errors) and the step-count bound
(a warning).

Papers: Shi et al. 2019 (gTop-k, arXiv 1901.04359), Lin et al. 2018 (DGC, arXiv 1712.01887);
measurements in docs/sparse_accuracy.md. Call :func:`check_sparse_run` once the run length is
known (the plan) and :func:`check_optimizer_momentum` once the optimizer and the hook exist.

The step-count bound. With error feedback every coordinate's gradient is delayed in the residual
until it is among the k largest; a rank can send ``density * numel`` coordinates per step (gTop-k
keeps ``density * numel`` of the whole world's; Top-k at most ``world`` times that, fewer when the
ranks pick the same ones). So over the sparse steps of a run each coordinate can be sent at most::

    coverage = sum over sparse steps s of min(1, density(s) * (world if topk else 1))

times. When ``coverage`` is a few units (1000 steps at density 0.001 for gTop-k: 1.0), most
coordinates are updated once or twice in the whole run, each time with the sum of a long stretch
of gradients: no correction to the update rule recovers dense accuracy then; only more steps, a
higher density, or a denser warm-up do. Measured on MNIST-1D (docs/sparse_accuracy.md): coverage
1.2 lost 12-13 points, 3.7-6.4 lost 1.5-4.7, 12-13 lost 0.7-2.3, 23 and 37 lost 0.4-0.5; hence the
warning below :data:`MIN_COVERAGE`.

Example::

    >>> round(coverage("gtopk", 1250, world=8, density=0.001), 2)
    1.25
    >>> check_sparse_run("gtopk", {"density": 0.001}, total_steps=1250, world=8)[0][:40]
    'gtopk at density 0.001 over 1250 steps c'
"""

from __future__ import annotations

from typing import Any

import torch

from flashsgd.comm.sparse_corrections import check_momentum_owner
from flashsgd.comm.sparse_select import density_at

SPARSE_ALGORITHMS = ("topk", "gtopk", "hgtopk")
MIN_COVERAGE = 20.0
"""Coverage below which `flashsgd train` warns (see the module docstring)."""


def coverage(algorithm: str, total_steps: int, world: int, density: float,
             density_warmup: float | None = None, density_warmup_steps: int = 0,
             density_warmup_mode: str = "exponential", start_iter: int = 2, **_: Any) -> float:
    """How many times each coordinate can at most be sent over the run (module docstring)."""
    per_rank = world if algorithm == "topk" else 1
    return sum(min(1.0, per_rank * density_at(s, density, density_warmup, density_warmup_steps,
                                              density_warmup_mode))
               for s in range(start_iter, total_steps))


def check_sparse_run(algorithm: str, options: dict[str, Any], total_steps: int, world: int,
                     optimizer_momentum: float = 0.0) -> list[str]:
    """Errors and warnings for the hook ``algorithm`` with ``options`` on a run of ``total_steps``.

    Raises ValueError: a density warm-up longer than the run; momentum correction together with
    an optimizer momentum > 0. Returns the warnings (the step-count bound), one line each; none
    for a dense hook.
    """
    if algorithm not in SPARSE_ALGORITHMS:
        return []
    warm = options.get("density_warmup_steps", 0)
    if options.get("density_warmup") is not None and warm > total_steps:
        raise ValueError(f"the density warm-up lasts {warm} steps, longer than the run ({total_steps} "
                         f"steps): shorten comm.density_warmup_epochs or train longer")
    check_momentum_owner(options.get("momentum_correction", 0.0), optimizer_momentum)
    density = options.get("density", 0.001)
    cover = coverage(algorithm, total_steps, world, **options)
    if cover >= MIN_COVERAGE:
        return []
    need = int(MIN_COVERAGE / (density * (world if algorithm == "topk" else 1))) + 1
    return [f"{algorithm} at density {density:g} over {total_steps} steps can send each gradient "
            f"entry at most {cover:.1f} times (density x steps; step-count bound): expect a loss of "
            f"accuracy against dense (docs/sparse_accuracy.md); for >= {MIN_COVERAGE:g} use "
            f">= {need} steps, a higher density or a denser warm-up"]


def check_optimizer_momentum(hook_state: Any, optimizer: torch.optim.Optimizer) -> None:
    """ValueError when the hook owns the momentum (``hook_state.owns_momentum``) and a parameter
    group of ``optimizer`` has momentum > 0 as well."""
    if getattr(hook_state, "owns_momentum", False):
        momentum = max(g.get("momentum", 0.0) for g in optimizer.param_groups)
        check_momentum_owner(hook_state.momentum, momentum)
