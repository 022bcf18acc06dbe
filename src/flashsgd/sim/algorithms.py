"""The simulator's algorithm names: one registry, filled here, and the cost of an exchange by name.

Every name maps to a cost function ``cost(n_bytes, setup) -> Cost`` (:data:`flashsgd.sim.costs.CostFn`):
the dense all-reduces of :mod:`flashsgd.sim.costs` and the sparse exchanges of
:mod:`flashsgd.sim.costs_sparse` (formulas in the docstring table of :mod:`flashsgd.sim.costs`).
``native``, ``ring``, ``hierarchical``, ``torus2d``, ``topk``, ``gtopk``, ``hgtopk`` and ``powersgd``
are flashsgd's own hooks (``flashsgd.comm.dense``, ``flashsgd.comm.sparse``, ``comm.sparse_hier``,
``comm.powersgd_hooks``; PowerSGD in :mod:`flashsgd.sim.costs_lowrank`); the others are simulator-only
references. Adding an algorithm is one line in :data:`ALGORITHMS`: the CLI (``--algorithm``), the
calibration and the tests read the names from it.

Example::

    >>> from flashsgd.sim.costs import CommSetup
    >>> from flashsgd.sim.network import CLUSTERS
    >>> setup = CommSetup(gpus=64, cluster=CLUSTERS.get("abci"))
    >>> round(float(exchange_cost("torus2d", 100e6, setup).total) * 1e3, 2)  # ms for 100 MB
    11.69
"""

from __future__ import annotations

import numpy as np

from flashsgd.registry import Registry
from flashsgd.sim import costs, costs_lowrank, costs_sparse
from flashsgd.sim.costs import CommSetup, Cost, CostFn, zero_cost

ALGORITHMS: Registry[CostFn] = Registry("simulated algorithm")
for _name, _fn in (
    ("ring", costs.ring),
    ("native", costs.ring),  # NCCL/Gloo pick a ring for large messages (stated assumption)
    ("hierarchical", costs.hierarchical),
    ("torus2d", costs.torus2d),
    ("recursive_doubling", costs.recursive_doubling),
    ("rabenseifner", costs.rabenseifner),
    ("binomial", costs.binomial),
    ("topk", costs_sparse.topk),
    ("gtopk", costs_sparse.gtopk),
    ("gtopk_tree", costs_sparse.gtopk_tree),
    ("hgtopk", costs_sparse.hgtopk),
    ("hgtopk_sparse", costs_sparse.hgtopk_sparse),
    ("hgtopk_slices", costs_sparse.hgtopk_slices),
    ("powersgd", costs_lowrank.powersgd),
):
    ALGORITHMS.add(_name, _fn)
del _name, _fn


def exchange_cost(algorithm: str, n_bytes, setup: CommSetup) -> Cost:
    """Cost of ``algorithm`` (a registered name) moving ``n_bytes`` per rank; zero for one GPU."""
    fn = ALGORITHMS.get(algorithm)
    n = np.asarray(n_bytes, dtype=float)
    if np.any(n < 0):
        raise ValueError(f"n_bytes must be >= 0, got min {float(n.min())}")
    if setup.gpus == 1:
        return zero_cost(n)
    return fn(n, setup)
