"""Sparse exchanges for the simulator: Top-k S-SGD, gTop-k as flashsgd runs it, and Shi et al.'s tree.

Paper: Shi et al. 2019, "A Distributed Synchronous SGD Algorithm with Global Top-k Sparsification for
Low Bandwidth Networks" (arXiv 1901.04359). Registered by name in
:data:`flashsgd.sim.algorithms.ALGORITHMS` (formulas in the docstring table of
:mod:`flashsgd.sim.costs`, whose link helpers they use):

- ``topk``: local top-k, Bruck all-gather of every rank's k pairs, scatter-add.
- ``gtopk``: the butterfly of ``flashsgd.comm.sparse.gtopk_allreduce``: lgP' rounds in which every
  rank swaps its k pairs with rank XOR 2^i and both merge; the P - P' extra ranks folded in before
  and out after (P' = largest power of two <= P). Per-rank bytes: :func:`gtopk_bytes_per_rank`,
  equal to ``flashsgd.comm.sparse.gtopk_bytes_sent`` with ``index_bytes=4`` (int32, buckets under
  2**31 elements) and ``index_bytes=8`` (int64, larger buckets) (tested).
- ``hgtopk``: ``flashsgd.comm.sparse_hier``: dense reduce to a leader per node, gTop-k among the
  leaders, broadcast inside the node (:func:`hgtopk`).
- ``hgtopk_sparse``: ``hgtopk_allreduce(split="sparse")``: every rank selects, gTop-k inside the
  node, gTop-k among the leaders, broadcast inside the node (:func:`hgtopk_sparse`).
- ``hgtopk_slices``: ``hgtopk_allreduce(split="slices")``: node reduce-scatter into L slices, L
  gTop-k of k/L pairs across nodes at once, node all-gather of the results (:func:`hgtopk_slices`).
- ``gtopk_tree`` (simulator-only): Shi et al.'s reference implementation, a tree reduction of
  pairwise merges then a broadcast of the k result pairs (2 ceil(lgP) rounds); what the paper's
  figures were measured with.

Every function has the signature ``cost(n_bytes, setup) -> Cost`` of :mod:`flashsgd.sim.costs`.

Example::

    >>> from flashsgd.sim.algorithms import exchange_cost
    >>> from flashsgd.sim.costs import CommSetup
    >>> from flashsgd.sim.network import CLUSTERS
    >>> setup = CommSetup(gpus=32, cluster=CLUSTERS.get("1gbe"))
    >>> t = exchange_cost("gtopk", 102e6, setup).bandwidth_s  # 5 rounds of 25,500 8-byte pairs
    >>> round(float(t) * 1e3, 2), round(float(exchange_cost("gtopk_tree", 102e6, setup).bandwidth_s) * 1e3, 2)
    (9.19, 18.38)
"""

from __future__ import annotations

import dataclasses
import math

import numpy as np

from flashsgd.sim.costs import CommSetup, Cost, pair_levels, step_cost, zero_cost


def _k(n: np.ndarray, setup: CommSetup) -> tuple[np.ndarray, np.ndarray]:
    m = n / setup.value_bytes  # gradient elements in the message
    return m, np.maximum(1.0, np.ceil(setup.density * m))


def topk(n_bytes, setup: CommSetup) -> Cost:
    """Top-k S-SGD: local top-k, all-gather of k (value, index) pairs, scatter-add of P*k."""
    n = np.asarray(n_bytes, dtype=float)
    if setup.gpus == 1:
        return zero_cost(n)
    c, p = setup.cluster, setup.gpus
    m, k = _k(n, setup)
    pair = setup.value_bytes + setup.index_bytes
    # Step 1: select the k largest |g| of m local elements (plus the residual add, a pass over m).
    comp = m * c.select_s_per_elem + n * c.gamma_s_per_byte
    cost = Cost(np.zeros_like(n), np.zeros_like(n), comp, np.full_like(n, c.sparse_overhead_s))
    # Step 2: Bruck all-gather: round i sends min(2^i, P-2^i) blocks of k pairs to distance 2^i;
    # sum over rounds = (P-1) k pairs.
    for i in range(math.ceil(math.log2(p))):
        blocks = min(1 << i, p - (1 << i))
        lat, bw = step_cost(blocks * k * pair, 1, pair_levels(1 << i, setup.local_ranks, setup))
        cost = cost + Cost(lat, bw, np.zeros_like(n), np.zeros_like(n))
    # Step 3: scatter-add the P*k received values into a dense buffer.
    return cost + Cost(np.zeros_like(n), np.zeros_like(n), p * k * setup.value_bytes * c.gamma_s_per_byte,
                       np.zeros_like(n))


def _pad(nbytes, word: int):
    """Bytes rounded up to whole words of ``word`` bytes (``comm/sparse.py`` packs a message into
    words of the index dtype)."""
    return word * np.ceil(np.asarray(nbytes, dtype=float) / word)


def sparse_message_bytes(k, setup: CommSetup, extra_bytes=0):
    """Bytes of one message of k (value, index) pairs as ``comm/sparse.py`` packs it.

    Indices, then the values' bytes and any extra bytes, each padded to words of the index's
    size w: with int32 indices (``index_bytes=4``, what flashsgd sends for buckets under 2**31
    elements) and fp32 values that is 8 k; with int64 ones 8 k + 8 ceil(4 k / 8). Equal to
    ``flashsgd.comm.sparse.message_bytes``.
    """
    k, w = np.asarray(k, dtype=float), setup.index_bytes
    return _pad(k * w, w) + _pad(k * setup.value_bytes, w) + _pad(extra_bytes, w)


def gtopk_bytes_per_rank(k: int, setup: CommSetup) -> np.ndarray:
    """Bytes each of the P ranks sends in the :func:`gtopk` butterfly, shape (P,).

    Ranks r < P' send lgP' messages of k pairs; ranks r < E = P - P' also send the fold-out
    message (k pairs + a k-byte mask); the E extra ranks send their k pairs once (fold-in). Equals
    ``flashsgd.comm.sparse.gtopk_bytes_sent(k, P, r)`` (``index_bytes`` 4 or 8: the bucket's
    wire index, tested).
    """
    p = setup.gpus
    out = np.zeros(p)
    if p == 1:
        return out
    p2 = 1 << (p.bit_length() - 1)
    msg = float(sparse_message_bytes(k, setup))
    out[:p2] = (p2.bit_length() - 1) * msg
    out[: p - p2] += float(sparse_message_bytes(k, setup, extra_bytes=k))
    out[p2:] = msg
    return out


def _sparse_start(n: np.ndarray, setup: CommSetup) -> tuple[np.ndarray, np.ndarray, Cost]:
    """k, merge cost of 2k -> k, and the local selection (+ residual add) with the call overhead."""
    c = setup.cluster
    m, k = _k(n, setup)
    comp = m * c.select_s_per_elem + n * c.gamma_s_per_byte
    merge = 2 * k * c.select_s_per_elem + k * setup.value_bytes * c.gamma_s_per_byte
    return k, merge, Cost(np.zeros_like(n), np.zeros_like(n), comp, np.full_like(n, c.sparse_overhead_s))


def gtopk(n_bytes, setup: CommSetup) -> Cost:
    """Global Top-k as ``comm/sparse.py`` runs it: a butterfly of pairwise merges (critical path)."""
    n = np.asarray(n_bytes, dtype=float)
    if setup.gpus == 1:
        return zero_cost(n)
    p = setup.gpus
    p2 = 1 << (p.bit_length() - 1)
    extra = p - p2
    z = np.zeros_like(n)
    # Step 1: local top-k of m elements (+ residual add).
    k, merge, cost = _sparse_start(n, setup)
    msg = sparse_message_bytes(k, setup)
    # The E extra ranks p2..P-1 pair with r - p2: up to min(E, L) of one node cross at once.
    fold_flows = min(extra, setup.local_ranks) if extra else 1
    if extra:
        # Step 2 (fold in): rank r + P' sends its k pairs to r, which merges them.
        lat, bw = step_cost(msg, 1, pair_levels(p2, fold_flows, setup))
        cost = cost + Cost(lat, bw, merge, z)
    for i in range(p2.bit_length() - 1):
        # Step 3 (butterfly round i): every rank r < P' swaps k pairs with r XOR 2^i (send and
        # receive at once, so one message time per round) and both merge 2k -> k. All L ranks of
        # a node cross at once once 2^i >= L.
        lat, bw = step_cost(msg, 1, pair_levels(1 << i, setup.local_ranks, setup))
        cost = cost + Cost(lat, bw, merge, z)
    if extra:
        # Step 4 (fold out): rank r sends the final k pairs + a k-byte survivor mask to r + P'.
        lat, bw = step_cost(sparse_message_bytes(k, setup, extra_bytes=k), 1,
                        pair_levels(p2, fold_flows, setup))
        cost = cost + Cost(lat, bw, z, z)
    return cost


def gtopk_tree(n_bytes, setup: CommSetup) -> Cost:
    """gTop-k as in Shi et al.'s reference implementation: tree of lgP merges, then broadcast."""
    n = np.asarray(n_bytes, dtype=float)
    if setup.gpus == 1:
        return zero_cost(n)
    pair = setup.value_bytes + setup.index_bytes
    # Step 1: local top-k of m elements (+ residual add).
    k, merge, cost = _sparse_start(n, setup)
    for i in range(math.ceil(math.log2(setup.gpus))):
        # Step 2: round i, receivers get k pairs from 2^i away and keep the top k of the 2k union;
        # Step 3 (broadcast) sends the final k pairs back down the same tree: 2 messages per level.
        lat, bw = step_cost(k * pair, 2, pair_levels(1 << i, 1, setup))
        cost = cost + Cost(lat, bw, merge, np.zeros_like(n))
    return cost


def _leaders(setup: CommSetup) -> CommSetup:
    """The setup of the gTop-k among node leaders: one rank per node crosses the inter link."""
    return dataclasses.replace(setup, gpus=setup.gpus // setup.local_ranks, grid=None,
                               cluster=dataclasses.replace(setup.cluster, ranks_per_node=1))


def _node_broadcast(n: np.ndarray, setup: CommSetup, steps: int) -> Cost:
    """The k global pairs and the k counted indices (w = index_bytes each) back to every rank of
    the node: ceil(lgL) (a + (k s + w k) b) on the intra link."""
    k = _k(n, setup)[1]
    intra = setup.cluster.intra
    lat, bw = step_cost(sparse_message_bytes(k, setup) + setup.index_bytes * k, steps,
                        [(intra.alpha_s, intra.beta_s_per_byte)])
    return Cost(lat, bw, np.zeros_like(n), np.zeros_like(n))


def hgtopk(n_bytes, setup: CommSetup) -> Cost:
    """Hierarchical gTop-k as ``comm/sparse_hier.py`` runs it: dense inside a node, gTop-k across.

    Steps (L ranks per node, N nodes): 1. binomial reduce of the n-byte accumulated gradient to the
    node's leader over the intra link: ceil(lgL) (a + n b + n g); 2-3. the leader's selection and
    :func:`gtopk` among the N leaders (one flow per node on the inter link); 4. broadcast of the k
    result pairs and the k counted indices inside the node: ceil(lgL) (a + (k s + w k) b).
    """
    n = np.asarray(n_bytes, dtype=float)
    if setup.gpus == 1:
        return zero_cost(n)
    c, lr = setup.cluster, setup.local_ranks
    nodes = setup.gpus // lr
    z = np.zeros_like(n)
    intra = [(c.intra.alpha_s, c.intra.beta_s_per_byte)]
    steps = math.ceil(math.log2(lr)) if lr > 1 else 0
    cost = zero_cost(n)
    if steps:
        # Step 1: node sum to the leader (binomial tree, full n bytes per round).
        lat, bw = step_cost(n, steps, intra)
        cost = cost + Cost(lat, bw, steps * n * c.gamma_s_per_byte, z)
    if nodes > 1:
        # Steps 2-3: selection at the leader, gTop-k among the leaders (one rank per node crosses).
        cost = cost + gtopk(n, _leaders(setup))
    else:
        cost = cost + _sparse_start(n, setup)[2]
    if steps:
        cost = cost + _node_broadcast(n, setup, steps)  # Step 4
    return cost


def hgtopk_sparse(n_bytes, setup: CommSetup) -> Cost:
    """Hierarchical gTop-k without dense traffic (``comm/sparse_hier.py``, ``split="sparse"``).

    Steps (L ranks per node, N nodes): 1. every rank's selection and :func:`gtopk` among the L
    ranks of its node (intra link; the selection is counted here); 2. :func:`gtopk` among the N
    leaders (one flow per node on the inter link, no second selection); 3. broadcast of the k
    result pairs and the k counted indices inside the node: ceil(lgL) (a + (k s + w k) b).
    """
    n = np.asarray(n_bytes, dtype=float)
    if setup.gpus == 1:
        return zero_cost(n)
    lr = setup.local_ranks
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
    """Hierarchical gTop-k over L slices (``comm/sparse_slices.py``, ``split="slices"``).

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
    c, lr = setup.cluster, setup.local_ranks
    nodes = setup.gpus // lr
    if lr == 1:
        return gtopk(n, _leaders(setup))
    z = np.zeros_like(n)
    intra = [(c.intra.alpha_s, c.intra.beta_s_per_byte)]
    # Step 1: L - 1 slices of n / L out and in, summed; the residual add over the whole acc
    lat, bw = step_cost((lr - 1) * n / lr, 1, intra)
    cost = Cost(lat, bw, (n + (lr - 1) * n / lr) * c.gamma_s_per_byte, z)
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
    lat, bw = step_cost((lr - 1) * msg, 1, intra)
    return cost + Cost(lat, bw, z, z)
