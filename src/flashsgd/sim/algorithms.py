"""The simulator's algorithm names: one registry, filled from the exchange catalog, and the cost of
an exchange by name.

Every name maps to a cost function ``cost(n_bytes, setup) -> Cost`` (:data:`flashsgd.sim.costs.CostFn`).
The exchanges flashsgd runs come from :data:`flashsgd.exchanges.EXCHANGES`: each one with a ``cost``
name gets the function of that name in :data:`COSTS` (``native`` as its backend runs it,
:mod:`flashsgd.sim.costs_nccl`; ``noop`` sends nothing and has none); a catalog entry whose cost is missing here fails at import. The
simulator-only references (:data:`REFERENCES`: ``recursive_doubling``, ``rabenseifner``,
``binomial``, ``gtopk_tree``) are registered as references where they are defined. The CLI (``--comm``), the calibration and the
tests read the names from :data:`SIMULATED`.

Example::

    >>> from flashsgd.sim.costs import CommSetup
    >>> from flashsgd.sim.network import CLUSTERS
    >>> setup = CommSetup(gpus=64, cluster=CLUSTERS.get("abci"))
    >>> round(float(exchange_cost("torus2d", 100e6, setup).total) * 1e3, 2)  # ms for 100 MB
    11.69
"""

from __future__ import annotations

import numpy as np

from flashsgd.exchanges import EXCHANGES
from flashsgd.registry import Registry
from flashsgd.sim import costs, costs_hier, costs_lowrank, costs_nccl, costs_sparse
from flashsgd.sim.costs import CommSetup, Cost, CostFn, zero_cost

# the modules that define cost functions, for their registrations (@cost, :data:`COSTS`)
_REGISTERING = (costs, costs_hier, costs_lowrank, costs_nccl, costs_sparse)
COSTS = costs.COSTS
"""Cost function of each ``cost`` name of the catalog (:attr:`flashsgd.exchanges.Exchange.cost`),
registered where each is defined (``@cost("ring")``). ``native`` is Gloo's ring or NCCL's ring or
tree, whichever NCCL's tuning model finds faster (:mod:`flashsgd.sim.costs_nccl`)."""
REFERENCES = {name: COSTS[name] for name in costs.REFERENCES}
"""Simulator-only algorithms (no hook runs them): references for the papers' figures."""

SIMULATED: Registry[CostFn] = Registry("simulated exchange")
for _name, _exchange in EXCHANGES.items():
    if _exchange.cost is not None:
        if _exchange.cost not in COSTS:
            raise KeyError(f"exchange {_name!r}: cost function {_exchange.cost!r} is not in "
                           "flashsgd.sim.algorithms.COSTS")
        SIMULATED.add(_name, COSTS[_exchange.cost])
for _name, _fn in REFERENCES.items():
    SIMULATED.add(_name, _fn)
del _name, _exchange, _fn


def exchange_cost(algorithm: str, n_bytes, setup: CommSetup) -> Cost:
    """Cost of ``algorithm`` (a registered name) moving ``n_bytes`` per rank; zero for one GPU."""
    fn = SIMULATED.get(algorithm)
    n = np.asarray(n_bytes, dtype=float)
    if np.any(n < 0):
        raise ValueError(f"n_bytes must be >= 0, got {float(n.min())}")
    if setup.gpus == 1:
        return zero_cost(n)
    return fn(n, setup)
