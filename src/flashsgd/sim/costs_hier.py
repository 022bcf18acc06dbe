"""hgtopk for the simulator: hierarchical gTop-k, one cost per node split, chosen by ``setup.node_split``.

Paper: Shi et al. 2019 (gTop-k, arXiv 1901.04359) for the merges among nodes; the two levels are
the hierarchical all-reduce's (Jia et al. 2018, arXiv 1807.11205). In ``comm`` the node split is an
option of the one ``hgtopk`` exchange (``node_split`` of
:class:`flashsgd.exchanges.HierSparseOptions`, :data:`flashsgd.exchanges.NODE_SPLITS`); here too:
:func:`hgtopk` dispatches through :data:`NODE_SPLIT_COSTS` on :attr:`CommSetup.node_split`
(``comm/sparse/hier.py`` and ``comm/sparse/slices.py`` run them):

- ``leader``: dense binomial reduce to one rank per node, gTop-k among the N leaders, broadcast of
  the result inside the node (:func:`hgtopk_leader`);
- ``slices``: node reduce-scatter into L slices by direct exchange, L gTop-k of k/L pairs across
  the nodes at once (sharing the node link), node all-gather of the results (:func:`hgtopk_slices`);
- ``sparse``: every rank selects, gTop-k inside the node, gTop-k among the leaders, broadcast
  inside the node (:func:`hgtopk_sparse`).

With one rank per node every split is :func:`~flashsgd.sim.costs_sparse.gtopk` among the nodes.
Signature ``cost(n_bytes, setup) -> Cost`` of :mod:`flashsgd.sim.costs`.

Example::

    >>> from flashsgd.sim.network import CLUSTERS
    >>> setup = CommSetup(gpus=8, cluster=CLUSTERS.get("abci"), node_split="slices")
    >>> hgtopk(4e6, setup) == hgtopk_slices(4e6, setup)
    True
"""

from __future__ import annotations

import dataclasses
import math

import numpy as np

from flashsgd.exchanges import NODE_SPLITS
from flashsgd.sim.costs import CommSetup, Cost, CostFn, cost, step_cost, zero_cost
from flashsgd.sim.costs_sparse import _k, _sparse_start, fixed_rounds, gtopk, sparse_message_bytes


def _leaders(setup: CommSetup) -> CommSetup:
    """The setup of the gTop-k among node leaders: one rank per node crosses the inter link."""
    return dataclasses.replace(setup, gpus=setup.gpus // setup.ranks_per_node_used, grid=None,
                               cluster=dataclasses.replace(setup.cluster, ranks_per_node=1))


def _node_broadcast(n: np.ndarray, setup: CommSetup, steps: int) -> Cost:
    """The k global pairs and the k counted indices (w = index_bytes each) back to every rank of
    the node: ceil(lgL) (a + (k s + w k) b) on the intra link."""
    k = _k(n, setup)[1]
    intra = setup.cluster.intra
    lat, bw = step_cost(sparse_message_bytes(k, setup) + setup.index_bytes * k, steps,
                        [(intra.alpha_s, intra.flow_beta(1))])
    return Cost(lat, bw, np.zeros_like(n), np.zeros_like(n)) + fixed_rounds(n, steps, setup)


def hgtopk_leader(n_bytes, setup: CommSetup) -> Cost:
    """hgtopk, ``node_split="leader"`` (``comm/sparse/hier.py``): dense inside a node, gTop-k across.

    Steps (L ranks per node, N nodes): 1. binomial reduce of the n-byte accumulated gradient to the
    node's leader over the intra link: ceil(lgL) (a + n b + n g); 2-3. the leader's selection and
    :func:`gtopk` among the N leaders (one flow per node on the inter link); 4. broadcast of the k
    result pairs and the k counted indices inside the node: ceil(lgL) (a + (k s + w k) b).
    """
    n = np.asarray(n_bytes, dtype=float)
    if setup.gpus == 1:
        return zero_cost(n)
    c, lr = setup.cluster, setup.ranks_per_node_used
    nodes = setup.gpus // lr
    z = np.zeros_like(n)
    intra = [(c.intra.alpha_s, c.intra.flow_beta(1))]
    steps = math.ceil(math.log2(lr)) if lr > 1 else 0
    cost = zero_cost(n)
    if steps:
        # Step 1: node sum to the leader (binomial tree, full n bytes per round).
        lat, bw = step_cost(n, steps, intra)
        cost = cost + Cost(lat, bw, steps * n * c.gamma_s_per_byte, z) + fixed_rounds(n, steps, setup)
    if nodes > 1:
        # Steps 2-3: selection at the leader, gTop-k among the leaders (one rank per node crosses).
        cost = cost + gtopk(n, _leaders(setup))
    else:
        cost = cost + _sparse_start(n, setup)[2]
    if steps:
        cost = cost + _node_broadcast(n, setup, steps)  # Step 4
    return cost


def hgtopk_sparse(n_bytes, setup: CommSetup) -> Cost:
    """hgtopk, ``node_split="sparse"`` (``comm/sparse/hier.py``): no dense traffic.

    Steps (L ranks per node, N nodes): 1. every rank's selection and :func:`gtopk` among the L
    ranks of its node (intra link; the selection is counted here); 2. :func:`gtopk` among the N
    leaders (one flow per node on the inter link, no second selection); 3. broadcast of the k
    result pairs and the k counted indices inside the node: ceil(lgL) (a + (k s + w k) b).
    """
    n = np.asarray(n_bytes, dtype=float)
    if setup.gpus == 1:
        return zero_cost(n)
    lr = setup.ranks_per_node_used
    nodes = setup.gpus // lr
    steps = math.ceil(math.log2(lr))
    leaders = _leaders(setup)
    if lr == 1:  # one rank per node: the leaders' gTop-k is the whole exchange
        return gtopk(n, leaders)
    # Step 1: selection + the node's butterfly (a node alone: L ranks on the intra link)
    cost = gtopk(n, dataclasses.replace(setup, gpus=lr, grid=None))
    if nodes > 1:
        # Step 2: the leaders' butterfly, without a second selection (a second call's overhead)
        cross, select = gtopk(n, leaders), _sparse_start(n, leaders)[2]
        cost = cost + Cost(cross.latency_s, cross.bandwidth_s, cross.compute_s - select.compute_s,
                           cross.overhead_s)
    if steps:
        cost = cost + _node_broadcast(n, setup, steps)  # Step 3
    return cost


def hgtopk_slices(n_bytes, setup: CommSetup) -> Cost:
    """hgtopk, ``node_split="slices"`` (``comm/sparse/slices.py``): L gTop-k over L slices.

    Steps (L ranks per node, N nodes, m elements of v bytes, n = v m, w = index_bytes, k pairs):

    1. node reduce-scatter by direct exchange: every rank sends the L - 1 slices it does not own
       (n / L bytes each, all at once) and sums the L - 1 it receives; with the residual add over
       its whole acc: a + (L-1) n/L b + (n + (L-1) n/L) g on the intra link;
    2-3. rank l selects k/L of its m/L entries and runs :func:`gtopk` of them among the N ranks
       with local rank l; the L exchanges cross each node's link at once (L flows share it);
    4. node all-gather by direct exchange of the L slice results (k/L global indices, k/L counted
       indices, k/L values per message): a + (L-1) ((k/L) w + sparse message of k/L) b, intra.

    With L = 1 it is :func:`gtopk` among the nodes.
    """
    n = np.asarray(n_bytes, dtype=float)
    if setup.gpus == 1:
        return zero_cost(n)
    c, lr = setup.cluster, setup.ranks_per_node_used
    nodes = setup.gpus // lr
    if lr == 1:
        return gtopk(n, _leaders(setup))
    z = np.zeros_like(n)
    intra = [(c.intra.alpha_s, c.intra.flow_beta(lr - 1))]  # per byte of one of L - 1 flows at once
    # Step 1: L - 1 slices of n / L out and in (one flow each), summed; the residual add over acc
    lat, bw = step_cost(n / lr, 1, intra)
    cost = Cost(lat, bw, (n + (lr - 1) * n / lr) * c.gamma_s_per_byte, z) + fixed_rounds(n, 1, setup)
    # Steps 2-3: selection over the slice, gTop-k of its k/L pairs among the N nodes, L flows per
    # node (the slice's own residual add is counted by gtopk's start: take it out of step 1's)
    if nodes > 1:
        shared = dataclasses.replace(c, ranks_per_node=1, inter=dataclasses.replace(
            c.inter, bandwidth_gbps=c.inter.bandwidth_gbps / lr))
        cross = gtopk(n / lr, dataclasses.replace(setup, gpus=nodes, grid=None, cluster=shared))
    else:
        cross = _sparse_start(n / lr, setup)[2]
    cost = cost + Cost(cross.latency_s, cross.bandwidth_s,
                       cross.compute_s - n / lr * c.gamma_s_per_byte, cross.overhead_s)
    # Step 4: the L results to every rank of the node
    k_slice = _k(n / lr, setup)[1]
    msg = sparse_message_bytes(k_slice, setup) + setup.index_bytes * k_slice
    lat, bw = step_cost(msg, 1, intra)  # L - 1 messages at once, one flow each
    return cost + Cost(lat, bw, z, z) + fixed_rounds(n, 1, setup)


NODE_SPLIT_COSTS: dict[str, CostFn] = {"leader": hgtopk_leader, "slices": hgtopk_slices,
                                       "sparse": hgtopk_sparse}
"""One cost per :data:`flashsgd.exchanges.NODE_SPLITS` entry."""
assert tuple(NODE_SPLIT_COSTS) == NODE_SPLITS, "a node split of the catalog has no cost here"


@cost("hgtopk")
def hgtopk(n_bytes, setup: CommSetup) -> Cost:
    """hgtopk with ``setup.node_split`` (:data:`NODE_SPLIT_COSTS`)."""
    return NODE_SPLIT_COSTS[setup.node_split](n_bytes, setup)
