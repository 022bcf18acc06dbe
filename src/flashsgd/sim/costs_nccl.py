"""``native`` for the simulator: the all-reduce DDP gets from its backend, costed as that backend picks it.

On ``gloo`` (:attr:`flashsgd.sim.network.ClusterModel.backend`) it is Gloo's ring, the same cost as
flashsgd's ``ring`` (:func:`flashsgd.sim.costs.ring`). On ``nccl`` it is whichever of NCCL's ring and
tree costs less at each bucket's size, as NCCL's own tuning model chooses (NVIDIA/nccl,
``src/graph/tuning.cc``, ``ncclTopoTuneModel`` and ``ncclTopoGetAlgoTime``; the Simple protocol,
which NCCL uses for the megabyte buckets of DDP). P ranks, L per node, N = P / L nodes, n bytes,
a_intra / a_inter the step latencies of the two link levels, b the seconds per byte of the ring's
slowest level (``1 / busBw`` in NCCL's terms):

==== =============================================================================================
ring (2(P-1) - 2(N-1)) a_intra + 2(N-1) a_inter + 2(P-1)/P n b + (P-1)/P n g
tree 2 ((L-1) a_intra + floor(lgN) a_inter) + 2 n b / (0.92 c(n)) + (P-1)/P n g
==== =============================================================================================

Ring latency: a chunk travels the ring, so its latency is the sum of the hops on its path, of which
only the 2(N-1) that leave a node pay the network's step (NCCL: ``(nsteps - nInterSteps) * intraLat
+ nInterSteps * interLat``). The ring of :func:`flashsgd.sim.costs.ring`, flashsgd's own, charges
every one of its 2(P-1) steps the slowest link's latency instead (each step of its Python loop
waits for the slowest hop); on one node, or with one rank per node, the two agree. Tree: NCCL's
double binary tree among the nodes with a chain inside each (latency ``2 * ((nRanks/nNodes - 1) *
intraLat + log2i(nNodes) * interLat)``); its bus bandwidth is the ring's x 0.92, its algorithm
bandwidth half of that (``ratio = .5``), and for medium sizes NCCL scales it by
``treeCorrectionFactor`` (c(n), :data:`TREE_CORRECTION`). So at large P the tree's latency grows
with lgN where the ring's grows with P: NCCL picks the tree for a latency-bound all-reduce on many
nodes (small buckets, small batches), the ring for a bandwidth-bound one.

Left out (inside the ranges of the presets' latencies, :mod:`flashsgd.sim.network`): NCCL's floor on
a ring's intra-node step when the ring crosses nodes (its "net overhead", 3-6 us with Simple), the
1.4x (1.9x before Ampere) on a multi-node ring's latency for large messages ("plateau effect"), the
LL and LL128 protocols (lower latency, for messages of kilobytes), NVLink SHARP and CollNet.

Example (64 H100s, 8 nodes, one 25 MiB bucket: the ring pays 112 NVLink and 14 network steps, the
tree 14 and 6)::

    >>> from flashsgd.sim.costs import CommSetup
    >>> from flashsgd.sim.network import CLUSTERS
    >>> setup = CommSetup(gpus=64, cluster=CLUSTERS.get("dgx-h100"))
    >>> ring, tree = nccl_ring(25 * 2**20, setup), nccl_tree(25 * 2**20, setup)
    >>> [round(float(c.latency_s) * 1e6, 1) for c in (ring, tree)]
    [576.8, 131.6]
"""

from __future__ import annotations

import math

import numpy as np

from flashsgd.sim.costs import CommSetup, Cost, cost, ring, ring_levels

TREE_BUS_FACTOR = 0.92
"""NCCL's tree all-reduce bus bandwidth over the ring's (``busBw * .92``, ``tuning.cc``)."""
TREE_CORRECTION = (.9, .9, .9, .9, .9, .9, .9, .8, .7, .6, .6, .5, .5, .5, .5, .6, .7, .8, .7, .7, .8, .9, .9)
"""NCCL's ``treeCorrectionFactor`` for the Simple protocol: the tree's bandwidth x this for a message
of 64 x 2^i bytes (i = floor(lg(n / 64)), 0..22; 1 below 64 bytes and from 512 MiB on)."""


def tree_correction(n: np.ndarray) -> np.ndarray:
    """c(n) of :data:`TREE_CORRECTION`, per element of ``n`` (bytes)."""
    blocks = np.floor(n / 64.0)
    i = np.floor(np.log2(np.maximum(blocks, 1.0))).astype(int)
    table = np.asarray(TREE_CORRECTION + (1.0,))
    return np.where(blocks < 1, 1.0, table[np.minimum(i, len(TREE_CORRECTION))])


def _levels(setup: CommSetup) -> tuple[float, float, float]:
    """(a_intra, a_inter, b): the two step latencies and the seconds per byte of the flat ring's
    slowest level (the same links and flows as :func:`flashsgd.sim.costs.ring`)."""
    c = setup.cluster
    b = max(beta for _, beta in ring_levels(setup.gpus, 1, setup))
    return c.intra.alpha_s, c.inter.alpha_s, b


def _reduce_and_call(n: np.ndarray, setup: CommSetup) -> tuple[np.ndarray, np.ndarray]:
    """Summing (P-1)/P n bytes, and one collective call, shaped like ``n``."""
    c = setup.cluster
    return (setup.gpus - 1) / setup.gpus * n * c.gamma_s_per_byte, np.full_like(n, c.call_overhead_s)


def nccl_ring(n_bytes, setup: CommSetup) -> Cost:
    """NCCL's ring all-reduce: a chunk's latency is the sum of the hops on its path (module docstring)."""
    n = np.asarray(n_bytes, dtype=float)
    p, nodes = setup.gpus, setup.gpus // setup.ranks_per_node_used
    a_intra, a_inter, b = _levels(setup)
    inter_steps = 2 * (nodes - 1)
    lat = np.full_like(n, (2 * (p - 1) - inter_steps) * a_intra + inter_steps * a_inter)
    return Cost(lat, 2 * (p - 1) / p * n * b, *_reduce_and_call(n, setup))


def nccl_tree(n_bytes, setup: CommSetup) -> Cost:
    """NCCL's tree all-reduce: a chain in each node, a double binary tree among the nodes."""
    n = np.asarray(n_bytes, dtype=float)
    lr = setup.ranks_per_node_used
    nodes = setup.gpus // lr
    a_intra, a_inter, b = _levels(setup)
    lat = np.full_like(n, 2 * ((lr - 1) * a_intra + math.floor(math.log2(nodes)) * a_inter))
    return Cost(lat, 2 * n * b / (TREE_BUS_FACTOR * tree_correction(n)), *_reduce_and_call(n, setup))


@cost("native")
def native(n_bytes, setup: CommSetup) -> Cost:
    """DDP's all-reduce: Gloo's ring on ``gloo``; on ``nccl`` the cheaper of :func:`nccl_ring` and
    :func:`nccl_tree` for each size, as NCCL's tuner picks."""
    if setup.cluster.backend == "gloo":
        return ring(n_bytes, setup)
    r, t = nccl_ring(n_bytes, setup), nccl_tree(n_bytes, setup)
    tree = t.total < r.total
    return Cost(*(np.where(tree, tv, rv) for tv, rv in
                  ((t.latency_s, r.latency_s), (t.bandwidth_s, r.bandwidth_s),
                   (t.compute_s, r.compute_s), (t.overhead_s, r.overhead_s))))
