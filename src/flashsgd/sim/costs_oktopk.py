"""Cost of ``oktopk`` as :mod:`flashsgd.comm.sparse.oktopk` runs it (Li & Hoefler 2022, Ok-Topk).

On P ranks, a message of n bytes = m gradient elements, k = ceil(density m) picks per rank, the
region capacities of the hook (c_send = 2k / P pairs to each region owner, c_keep = k / P pairs kept
per region; :func:`flashsgd.comm.sparse.oktopk.capacities`):

1. Local selection of k of m (+ the residual add, a pass over m) and a sort of the k picks.
2. Split and reduce: one round of direct exchange, every rank's c_send-pair message to each of
   the P-1 others at once (:func:`~flashsgd.sim.costs_sparse.direct_levels`), and P c_send adds.
3. Keep: the top c_keep of the rank's region, m / P elements.
4. Gather: one round of direct exchange of c_keep-pair messages (NCCL: its all-gather), then the
   k result values written into the bucket.

Cost: select(m) + 2a + (P-1)(c_send + c_keep) s b + select(m / P) with one level; across nodes each
round the slower of its levels, as Top-k's one round (:func:`~flashsgd.sim.costs_sparse.topk`).
With c_send + c_keep = 3k / P: 2a + 3k (P-1)/P s b, against gTop-k's lgP a + lgP k s b and Top-k's
a + (P-1) k s b. So Ok-Topk moves less than gTop-k where 3 (P-1)/P < lg P (P >= 8 with one level;
at P = 4, 2.25 k against 2 k pairs) and pays one more latency than Top-k: it wins where the volume
dominates (large k, many ranks, slow links) and loses at small P or latency-bound messages.

Example::

    >>> from flashsgd.sim.costs import CommSetup
    >>> from flashsgd.sim.network import CLUSTERS
    >>> setup = CommSetup(gpus=16, cluster=CLUSTERS.get("1gbe"), density=0.01)
    >>> message_pattern_oktopk(1_000_000, setup).rounds
    2
"""

from __future__ import annotations

import numpy as np

from flashsgd.sim.costs import CommSetup, Cost, cost, step_cost, zero_cost
from flashsgd.sim.costs_sparse import (MessagePattern, _k, direct_levels, fixed_rounds,
                                       sparse_message_bytes)


def capacities(k, p: int) -> tuple[np.ndarray, np.ndarray]:
    """(c_send, c_keep) of k picks on p ranks, as the hook sizes its messages (at least 1 pair)."""
    k = np.asarray(k, dtype=float)
    return np.maximum(1.0, np.floor(2 * k / p)), np.maximum(1.0, np.floor(k / p))


@cost("oktopk")
def oktopk(n_bytes, setup: CommSetup) -> Cost:
    """Steps 1-4 of the module docstring (one call per bucket of ``n_bytes``)."""
    n = np.asarray(n_bytes, dtype=float)
    if setup.gpus == 1:
        return zero_cost(n)
    c, p = setup.cluster, setup.gpus
    m, k = _k(n, setup)
    c_send, c_keep = capacities(k, p)
    z = np.zeros_like(n)
    # Step 1: select k of m (+ the residual add); sort the k picks by index.
    comp = m * c.select_s_per_elem + n * c.gamma_s_per_byte + k * c.select_s_per_elem
    total = Cost(z, z, comp, np.full_like(n, c.exchange_fixed_s))
    levels = direct_levels(setup)
    # Step 2: one round of c_send-pair messages to every other rank; P c_send adds.
    lat, bw = step_cost(sparse_message_bytes(c_send, setup), 1, levels)
    total = total + Cost(lat, bw, p * c_send * setup.value_bytes * c.gamma_s_per_byte, z)
    # Step 3: the top c_keep of this rank's region (m / P elements).
    total = total + Cost(z, z, m / p * c.select_s_per_elem, z)
    # Step 4: one round of c_keep-pair messages; the k result values written.
    lat, bw = step_cost(sparse_message_bytes(c_keep, setup), 1, levels)
    total = total + Cost(lat, bw, p * c_keep * setup.value_bytes * c.gamma_s_per_byte, z)
    return total + fixed_rounds(n, 2, setup)


def message_pattern_oktopk(numel: int, setup: CommSetup) -> MessagePattern:
    """Bytes each rank sends and the rounds of ``oktopk`` over a bucket of ``numel`` elements:
    (P-1) messages of c_send pairs and (P-1) of c_keep pairs, in 2 rounds (the hook's traffic
    counter must equal it: ``tests/test_oktopk.py``)."""
    p = setup.gpus
    if p == 1:
        return MessagePattern(np.zeros(1), 0)
    k = _k(np.asarray(float(numel * setup.value_bytes)), setup)[1]
    c_send, c_keep = capacities(k, p)
    per_rank = (p - 1) * float(sparse_message_bytes(c_send, setup) + sparse_message_bytes(c_keep, setup))
    return MessagePattern(np.full(p, per_rank), 2)
