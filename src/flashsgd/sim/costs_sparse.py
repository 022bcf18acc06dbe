"""Sparse exchanges for the simulator: Top-k S-SGD, gTop-k as flashsgd runs it, and Shi et al.'s tree.

Paper: Shi et al. 2019, "A Distributed Synchronous SGD Algorithm with Global Top-k Sparsification for
Low Bandwidth Networks" (arXiv 1901.04359). Registered by name in
:data:`flashsgd.sim.algorithms.SIMULATED` (formulas in the docstring table of
:mod:`flashsgd.sim.costs`, whose link helpers they use):

- ``topk``: ``flashsgd.comm.sparse.topk_allgather``: local top-k, one round in which every rank
  sends its k pairs to each of the P-1 others at once (:func:`direct_levels`: the inter-node
  messages of a node's L ranks share its link), scatter-add.
- ``gtopk``: the butterfly of ``flashsgd.comm.sparse.gtopk_allreduce``: lgP' rounds in which every
  rank swaps its k pairs with rank XOR 2^i and both merge; the P - P' extra ranks folded in before
  and out after (P' = largest power of two <= P). Per-rank bytes: :func:`gtopk_bytes_per_rank`,
  equal to ``flashsgd.comm.sparse.gtopk_bytes_sent`` with ``index_bytes=4`` (int32, buckets under
  2**31 elements) and ``index_bytes=8`` (int64, larger buckets) (tested).
- ``hgtopk``: :mod:`flashsgd.sim.costs_hier` (one cost per node split), built on :func:`gtopk`.
- ``gtopk_tree`` (simulator-only): Shi et al.'s reference implementation, a tree reduction of
  pairwise merges then a broadcast of the k result pairs (2 ceil(lgP) rounds); what the paper's
  figures were measured with.

Fixed costs (:class:`~flashsgd.sim.network.ClusterModel`): ``exchange_fixed_s`` once per exchange
(with the local selection, :func:`_sparse_start`) and ``round_fixed_s`` once per message round
(:func:`fixed_rounds`), both in ``Cost.overhead_s``; the rounds are the a terms, as
:func:`message_pattern` counts them (``gtopk_tree``: 2 ceil(lgP)).

:func:`message_pattern` gives the bytes each rank sends and the rounds of each exchange as these
costs count them; ``tests/test_sim_pattern.py`` checks them against a real Gloo run of ``comm``.

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

from flashsgd.sim.costs import CommSetup, Cost, cost, inter_level, pair_levels, step_cost, zero_cost
from flashsgd.sim.fabric import all_to_all_uplink_flows


def _k(n: np.ndarray, setup: CommSetup) -> tuple[np.ndarray, np.ndarray]:
    """(m elements, k pairs) of a message of ``n`` bytes: k = ceil(density m) in [1, m], the product
    rounded to 9 digits first as ``comm.sparse.select.k_from_density`` does (0.01 x 1000 = 10)."""
    m = n / setup.value_bytes  # gradient elements in the message
    return m, np.clip(np.ceil(np.round(setup.density * m, 9)), 1.0, np.maximum(m, 1.0))


def fixed_rounds(n: np.ndarray, rounds: int, setup: CommSetup) -> Cost:
    """The fixed cost of ``rounds`` message rounds of a sparse exchange (``round_fixed_s`` each,
    beyond the link's alpha: :attr:`flashsgd.sim.network.ClusterModel.round_fixed_s`), as overhead."""
    z = np.zeros_like(n)
    return Cost(z, z, z, np.full_like(n, rounds * setup.cluster.round_fixed_s))


def direct_levels(setup: CommSetup) -> list[tuple[float, float]]:
    """Links of one round in which every rank sends one message to each of the P-1 others at once
    (``comm/p2p.gather_from_peers``), as (a, b per byte of one message): the L-1 messages to its
    own node share the rank's intra link ((L-1) b_intra); the P-L to other nodes leave through the
    node's link, which carries them for all L ranks of the node at once ((P-L) L b_inter); each
    message is a flow, at most the link's per-flow rate (:meth:`~flashsgd.sim.network.Link.flow_beta`).
    The N - 1 other nodes all send to each node in the same round: TCP incast multiplies the inter
    level's bytes by ``1 + incast (N - 2)`` (:meth:`~flashsgd.sim.network.Link.incast_factor`; 1
    with 2 nodes, one sender each): (P-L) L b_inter (1 + c (N - 2)). The round takes as long as the
    slower level (:func:`flashsgd.sim.costs.step_cost`). Beyond the NICs, the messages to nodes on
    other edge switches share their switch's uplink (:func:`flashsgd.sim.fabric.all_to_all_uplink_flows`)."""
    c, p, lr = setup.cluster, setup.gpus, setup.ranks_per_node_used
    levels = []
    if lr > 1:  # each message its own flow: L-1 on the rank's intra link
        levels.append((c.intra.alpha_s, c.intra.flow_beta(lr - 1)))
    if p > lr:  # (P-L) L flows through the node's link, from N - 1 sending nodes at once
        levels.append(inter_level(setup, (p - lr) * lr, all_to_all_uplink_flows(c.fabric, p, lr),
                                  incast=c.inter.incast_factor(p // lr - 1)))
    return levels


@cost("topk")
def topk(n_bytes, setup: CommSetup) -> Cost:
    """Top-k S-SGD as ``comm/sparse/__init__.py`` ``topk_allgather`` runs it: local top-k, one round of direct
    exchange (every rank's k pairs to each of the P-1 others at once), scatter-add of P k values.

    Cost: select(m) + a + (P-1) k s b with one node; across nodes the slower of the node's own
    messages, a + (L-1) k s b_intra, and the other nodes', a + (P-L) k s L b_inter (1 + c (N-2))
    (the L ranks of a node share its link; N - 1 nodes converge on each: TCP incast c,
    :func:`direct_levels`); + P k adds.
    """
    n = np.asarray(n_bytes, dtype=float)
    if setup.gpus == 1:
        return zero_cost(n)
    c, p = setup.cluster, setup.gpus
    m, k = _k(n, setup)
    # Step 1: select the k largest |g| of m local elements (plus the residual add, a pass over m).
    comp = m * c.select_s_per_elem + n * c.gamma_s_per_byte
    cost = Cost(np.zeros_like(n), np.zeros_like(n), comp, np.full_like(n, c.exchange_fixed_s))
    # Step 2: one round, every rank sends its packed message to each of the P-1 others at once.
    lat, bw = step_cost(sparse_message_bytes(k, setup), 1, direct_levels(setup))
    cost = cost + Cost(lat, bw, np.zeros_like(n), np.zeros_like(n)) + fixed_rounds(n, 1, setup)
    # Step 3: scatter-add the P*k received values into a dense buffer.
    return cost + Cost(np.zeros_like(n), np.zeros_like(n), p * k * setup.value_bytes * c.gamma_s_per_byte,
                       np.zeros_like(n))


def _pad(nbytes, word: int):
    """Bytes rounded up to whole words of ``word`` bytes (``comm/sparse/__init__.py`` packs a message into
    words of the index dtype)."""
    return word * np.ceil(np.asarray(nbytes, dtype=float) / word)


def sparse_message_bytes(k, setup: CommSetup, extra_bytes=0):
    """Bytes of one message of k (value, index) pairs as ``comm/sparse/__init__.py`` packs it.

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
    return k, merge, Cost(np.zeros_like(n), np.zeros_like(n), comp, np.full_like(n, c.exchange_fixed_s))


@cost("gtopk")
def gtopk(n_bytes, setup: CommSetup) -> Cost:
    """Global Top-k as ``comm/sparse/__init__.py`` runs it: a butterfly of pairwise merges (critical path)."""
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
    fold_flows = min(extra, setup.ranks_per_node_used) if extra else 1
    if extra:
        # Step 2 (fold in): rank r + P' sends its k pairs to r, which merges them.
        lat, bw = step_cost(msg, 1, pair_levels(p2, fold_flows, setup, "fold"))
        cost = cost + Cost(lat, bw, merge, z)
    for i in range(p2.bit_length() - 1):
        # Step 3 (butterfly round i): every rank r < P' swaps k pairs with r XOR 2^i (send and
        # receive at once, so one message time per round) and both merge 2k -> k. All L ranks of
        # a node cross at once once 2^i >= L.
        lat, bw = step_cost(msg, 1, pair_levels(1 << i, setup.ranks_per_node_used, setup))
        cost = cost + Cost(lat, bw, merge, z)
    if extra:
        # Step 4 (fold out): rank r sends the final k pairs + a k-byte survivor mask to r + P'.
        lat, bw = step_cost(sparse_message_bytes(k, setup, extra_bytes=k), 1,
                        pair_levels(p2, fold_flows, setup, "fold"))
        cost = cost + Cost(lat, bw, z, z)
    return cost + fixed_rounds(n, _rounds_gtopk(p), setup)  # every round's fixed cost


@cost("gtopk_tree", reference=True)
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
        lat, bw = step_cost(k * pair, 2, pair_levels(1 << i, 1, setup, "tree"))
        cost = cost + Cost(lat, bw, merge, np.zeros_like(n)) + fixed_rounds(n, 2, setup)
    return cost


# ------------------------------------------------------------------ message pattern ----------


@dataclasses.dataclass(frozen=True)
class MessagePattern:
    """What the ranks hand to the backend in one exchange, as the simulator costs it."""

    bytes_per_rank: np.ndarray
    """(P,) bytes each rank sends, ranks node-major (rank = node L + local rank): its isend/send
    messages, and its part of a node collective as the cost counts it (a binomial reduce: every
    non-root rank sends the n bytes once; a binomial broadcast: a rank sends one message per child)."""
    rounds: int
    """Message rounds on the critical path: the a terms of the cost."""


def _rounds_gtopk(p: int) -> int:
    """Butterfly rounds of gTop-k among ``p`` ranks: lgP' (+ fold-in and fold-out)."""
    if p == 1:
        return 0
    p2 = 1 << (p.bit_length() - 1)
    return (p2.bit_length() - 1) + (2 if p != p2 else 0)


def _flat(setup: CommSetup, members: int) -> CommSetup:
    """``setup`` for an exchange among ``members`` ranks, one per node (a cross or node group)."""
    return dataclasses.replace(setup, gpus=members, grid=None,
                               cluster=dataclasses.replace(setup.cluster, ranks_per_node=1))


def _binomial_children(local: int, size: int) -> int:
    """Messages rank ``local`` sends in a binomial broadcast from 0 over ``size`` ranks."""
    return sum(1 for i in range(max(size - 1, 0).bit_length()) if local < (1 << i) and local + (1 << i) < size)


def message_pattern(algorithm: str, numel: int, setup: CommSetup) -> MessagePattern:
    """Bytes each rank sends and the rounds of ``algorithm`` (ring, topk, gtopk, hgtopk with
    ``setup.node_split``) over a bucket of ``numel`` elements, from the sizes the cost functions
    use: what a real run must hand to its backend (pinned by ``tests/test_sim_pattern.py``).

    Example::

        >>> from flashsgd.sim.network import CLUSTERS
        >>> p = message_pattern("topk", 4000, CommSetup(gpus=4, cluster=CLUSTERS.get("1gbe"), density=0.01))
        >>> p.bytes_per_rank.tolist(), p.rounds        # 3 messages of 40 int32 indices + 40 fp32 values
        ([960.0, 960.0, 960.0, 960.0], 1)
    """
    p, lr = setup.gpus, setup.ranks_per_node_used
    n = float(numel * setup.value_bytes)
    k = int(_k(np.asarray(n), setup)[1])
    out = np.zeros(p)
    if p == 1:
        return MessagePattern(out, 0)
    if algorithm == "ring":  # 2(P-1) steps of one n/P chunk
        return MessagePattern(np.full(p, 2 * (p - 1) / p * n), 2 * (p - 1))
    if algorithm == "topk":  # one round: the message to each of the P-1 others
        return MessagePattern(np.full(p, (p - 1) * float(sparse_message_bytes(k, setup))), 1)
    if algorithm == "gtopk":
        return MessagePattern(gtopk_bytes_per_rank(k, setup), _rounds_gtopk(p))
    if algorithm == "oktopk":
        return message_pattern_oktopk(numel, setup)
    if algorithm != "hgtopk":
        raise ValueError(f"no message pattern for {algorithm!r}: ring, topk, gtopk, hgtopk or oktopk")
    nodes, split = p // lr, setup.node_split
    w = setup.index_bytes
    steps = math.ceil(math.log2(lr)) if lr > 1 else 0
    if split == "slices":  # (L-1) slices of n/L, gTop-k of k/L among the nodes, the L results
        k_slice = int(_k(np.asarray(n / lr), setup)[1])
        cross = gtopk_bytes_per_rank(k_slice, _flat(setup, nodes))
        result = float(sparse_message_bytes(k_slice, setup)) + w * k_slice
        for r in range(p):
            out[r] = (lr - 1) * (n / lr + result) + cross[r // lr]
        return MessagePattern(out, (2 if lr > 1 else 0) + _rounds_gtopk(nodes))
    cross = gtopk_bytes_per_rank(k, _flat(setup, nodes))
    inner = gtopk_bytes_per_rank(k, _flat(setup, lr)) if split == "sparse" else None
    bcast = float(sparse_message_bytes(k, setup)) + w * k  # k global + k counted indices, k values
    for r in range(p):
        local = r % lr
        node_step = inner[local] if inner is not None else (n if local else 0.0)
        out[r] = node_step + (cross[r // lr] if local == 0 else 0.0) + _binomial_children(local, lr) * bcast
    first = _rounds_gtopk(lr) if split == "sparse" else steps
    return MessagePattern(out, first + _rounds_gtopk(nodes) + steps)


def oktopk_capacities(k, p: int) -> tuple[np.ndarray, np.ndarray]:
    """(c_send, c_keep) of k picks on p ranks, as the hook sizes its messages (at least 1 pair)."""
    k = np.asarray(k, dtype=float)
    return np.maximum(1.0, np.floor(2 * k / p)), np.maximum(1.0, np.floor(k / p))


@cost("oktopk")
def oktopk(n_bytes, setup: CommSetup) -> Cost:
    """Cost of ``oktopk`` as :mod:`flashsgd.comm.sparse.oktopk` runs it (Li & Hoefler 2022, Ok-Topk).

    On P ranks, a message of n bytes = m gradient elements, k = ceil(density m) picks per rank, the
    region capacities of the hook (c_send = 2k / P pairs to each region owner, c_keep = k / P kept
    per region; :func:`flashsgd.comm.sparse.oktopk.capacities`):

    1. Local selection of k of m (+ the residual add, a pass over m) and a sort of the k picks.
    2. Split and reduce: one round of direct exchange, every rank's c_send-pair message to each of
       the P-1 others at once (:func:`~flashsgd.sim.costs_sparse.direct_levels`), and P c_send adds.
    3. Keep: the region's sum zeroed and filled (m / P elements), then the top c_keep among the
       P c_send received positions (the only non-zero entries).
    4. Gather: one round of direct exchange of c_keep-pair messages (NCCL: its all-gather), then the
       k result values written into the bucket.

    Cost: select(m) + 2a + (P-1)(c_send + c_keep) s b + select(P c_send) with one level; across nodes each
    round the slower of its levels, as Top-k's one round (:func:`~flashsgd.sim.costs_sparse.topk`).
    With c_send + c_keep = 3k / P: 2a + 3k (P-1)/P s b, against gTop-k's lgP a + lgP k s b and Top-k's
    a + (P-1) k s b. So Ok-Topk moves less than gTop-k where 3 (P-1)/P < lg P (P >= 8 with one level;
    at P = 4, 2.25 k against 2 k pairs) and pays one more latency than Top-k: it wins where the volume
    dominates (large k, many ranks, slow links) and loses at small P or latency-bound messages.
    """
    n = np.asarray(n_bytes, dtype=float)
    if setup.gpus == 1:
        return zero_cost(n)
    c, p = setup.cluster, setup.gpus
    m, k = _k(n, setup)
    c_send, c_keep = oktopk_capacities(k, p)
    z = np.zeros_like(n)
    # Step 1: select k of m (+ the residual add); sort the k picks by index.
    comp = m * c.select_s_per_elem + n * c.gamma_s_per_byte + k * c.select_s_per_elem
    total = Cost(z, z, comp, np.full_like(n, c.exchange_fixed_s))
    levels = direct_levels(setup)
    # Step 2: one round of c_send-pair messages to every other rank; P c_send adds.
    lat, bw = step_cost(sparse_message_bytes(c_send, setup), 1, levels)
    total = total + Cost(lat, bw, p * c_send * setup.value_bytes * c.gamma_s_per_byte, z)
    # Step 3: the region zeroed (m / P elements) and the top c_keep of P c_send + c_keep candidates.
    total = total + Cost(z, z, m / p * setup.value_bytes * c.gamma_s_per_byte
                         + (p * c_send + c_keep) * c.select_s_per_elem, z)
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
    c_send, c_keep = oktopk_capacities(k, p)
    per_rank = (p - 1) * float(sparse_message_bytes(c_send, setup) + sparse_message_bytes(c_keep, setup))
    return MessagePattern(np.full(p, per_rank), 2)
