"""Closed-form alpha-beta-gamma costs of one gradient exchange, per flashsgd algorithm.

Every function here has the signature ``cost(n_bytes, setup) -> Cost``: the time for all ``P``
ranks to exchange a message of ``n_bytes`` per rank (a scalar or a numpy array of bucket sizes),
split into latency (alpha), bandwidth (beta), compute (gamma: reductions, top-k selection) and fixed
per-call overhead. Algorithm names are the ones used across flashsgd (``comm/dense.py``,
``comm/sparse/__init__.py``); ``recursive_doubling``, ``rabenseifner``, ``binomial`` and ``gtopk_tree`` are
simulator-only.

Placement: ranks ``0..L-1`` are on node 0, ``L..2L-1`` on node 1, ... A message step between two
ranks of one node uses the ``intra`` link; between nodes the ``inter`` link, whose node bandwidth is
shared by the ``flows`` ranks of that node that cross at the same time, each flow at most the
link's per-flow rate f (:meth:`flashsgd.sim.network.Link.flow_beta`: beta_eff = max(beta * flows,
1 / f)). A ring step that has both kinds of hops takes as long as its slowest hop. Flows per NIC:
the flat ring 1 (one hop leaves each node), hierarchical and torus2d with X = L one cross-node ring
per local rank (L), a torus whose rows span nodes 1 in its rows and L in its columns; recursive
doubling, Rabenseifner and the gtopk butterfly L once partners are on other nodes, binomial trees 1,
topk's direct exchange L (P - L). Every such flow comes from one sending node except in topk's
direct exchange, where N - 1 nodes send to each node at once: there, on TCP, incast costs
``1 + incast (N - 2)`` times the bytes' time (:meth:`flashsgd.sim.network.Link.incast_factor`, 0 on
lossless fabrics). Beyond the NICs, flows that leave an edge switch share its uplink where the
cluster states a fabric (:mod:`flashsgd.sim.fabric`: nodes per switch, oversubscription, placement;
:func:`inter_level`; the ``abci`` preset states its racks); without one the fabric is non-blocking.

Costs (a: alpha, b: beta, g: gamma, n bytes per rank, P ranks; Thakur, Rabenseifner & Gropp 2005,
"Optimization of Collective Communication Operations in MPICH"; Patarasuk & Yuan 2009 for the ring;
Mikami et al. 2018, arXiv 1811.05233, for the 2D-Torus):

=================== ==========================================================================
ring / native       2(P-1) a + 2(P-1)/P n b + (P-1)/P n g  (native: what NCCL/Gloo do for
                    large messages, taken to be the ring)
recursive_doubling  lgP a + n lgP b + n lgP g
rabenseifner        2 lgP a + 2(P-1)/P n b + (P-1)/P n g (halving reduce-scatter + doubling gather)
binomial            2 lgP a + 2 n lgP b + n lgP g (binomial reduce then broadcast)
hierarchical        ring reduce-scatter in node (L) + ring all-reduce of n/L across N nodes (L
                    concurrent rings per node) + ring all-gather in node
torus2d (X x Y)     2(X-1) a_x + 2(Y-1) a_y + 2(X-1)/X n b_x + 2(Y-1)/(XY) n b_y + (P-1)/P n g
topk                select(m) + direct exchange, as ``comm/sparse/__init__.py`` runs it: every rank sends
                    its k pairs to each of the P-1 others at once (one round): a + (P-1) k s b
                    (the inter-node part, P-L messages per rank, shares the node link with the
                    node's L ranks, N-1 nodes converge on each: a_x + (P-L) k s L b_x (1 + c (N-2)),
                    c the link's incast) + scatter-add of P k values
hgtopk              node step (``node_split``: leader, slices or sparse; :mod:`.costs_sparse`)
                    + gtopk among the N nodes + the result shared inside the node
gtopk               butterfly as in ``comm/sparse/__init__.py``: select(m) + lgP' rounds, every rank swaps
                    k pairs with rank XOR 2^i (both directions at once) and merges 2k -> k:
                    lgP' a + lgP' k s b; P not a power of two: + fold-in (k pairs) and fold-out
                    (k pairs + k mask bytes) steps, + 2 a + (2 k s + k) b   (P' = 2^floor(lgP))
gtopk_tree          Shi et al.'s reference implementation (simulator-only): select(m) + ceil(lgP)
                    tree rounds of k pairs (merge 2k -> k) + ceil(lgP) broadcast rounds:
                    2 lgP a + 2 k s lgP b   (s = value + index bytes: 4 k lgP b_elem with int32)
=================== ==========================================================================

The sparse exchanges also pay the cluster's fixed costs, ``exchange_fixed_s`` per exchange and
``round_fixed_s`` per message round (:mod:`flashsgd.sim.costs_sparse`); the dense ones pay
``call_overhead_s`` per collective call.

Non-powers of two: recursive doubling and Rabenseifner fold the extra ``P - 2^floor(lgP)`` ranks in
with one step before and one after (MPICH), and so does the gtopk butterfly (``comm/sparse/__init__.py``);
binomial trees and gtopk_tree use ceil(lgP) steps. The sparse exchanges (topk, gtopk, hgtopk,
gtopk_tree) live in :mod:`flashsgd.sim.costs_sparse`, built from the link helpers here; gtopk's
messages are sized as ``comm/sparse/__init__.py`` packs them (k s bytes padded to index-sized words). Both
modules' functions are registered by name in one place, :data:`flashsgd.sim.algorithms.SIMULATED`,
from the catalog :data:`flashsgd.exchanges.EXCHANGES` (each exchange's ``cost``).

Example::

    >>> from flashsgd.sim.network import CLUSTERS
    >>> setup = CommSetup(gpus=64, cluster=CLUSTERS.get("abci"))
    >>> round(float(ring(100e6, setup).total) * 1e3, 2)  # ms for 100 MB
    10.31
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Callable

import numpy as np

from flashsgd.exchanges import DEFAULT_DENSITY, NODE_SPLITS, WIRE_INDEX_BYTES, option_default
from flashsgd.registry import Registry
from flashsgd.sim.fabric import node_flows, uplink_beta_factor, uplink_flows
from flashsgd.sim.network import ClusterModel


@dataclass(frozen=True)
class CommSetup:
    """Who exchanges: how many GPUs on which cluster, with which grid, density, node split and
    element sizes (defaults: the catalog's, :mod:`flashsgd.exchanges`)."""

    gpus: int
    """Number of ranks P (one per GPU)."""
    cluster: ClusterModel
    """Link levels and per-call costs."""
    grid: tuple[int, int] | None = None
    """torus2d grid (X, Y), X horizontal (contiguous ranks); None: :func:`auto_grid`."""
    density: float = DEFAULT_DENSITY
    """Sparse algorithms: fraction of gradient elements sent, k = ceil(density * m)."""
    node_split: str = option_default("node_split")
    """hgtopk: how a node combines its ranks (:data:`flashsgd.exchanges.NODE_SPLITS`; the
    ``node_split`` option of :class:`flashsgd.exchanges.HierSparseOptions`)."""
    value_bytes: int = 4
    """Bytes per gradient element: 4 (fp32) or 2 (fp16)."""
    index_bytes: int = WIRE_INDEX_BYTES
    """Bytes per sparse index: 4 (int32: the papers' format, and what ``comm/sparse/__init__.py`` sends for
    buckets under 2**31 elements) or 8 (int64, its format for larger buckets)."""
    matrices: tuple[tuple[int, int], ...] | None = None
    """PowerSGD: (rows, cols) of every gradient tensor of the message, viewed as torch's hook views
    it (``shape[0] x rest``; 1-D tensors as (n, 1)); None: the message is one square matrix."""
    matrix_approximation_rank: int = 1
    """PowerSGD: rank r of the approximation (torch's ``matrix_approximation_rank``)."""

    def __post_init__(self) -> None:
        p, per_node = self.gpus, self.cluster.ranks_per_node
        if not isinstance(p, int) or p < 1:
            raise ValueError(f"gpus must be an int >= 1, got {p!r}")
        if p > per_node and p % per_node:
            raise ValueError(
                f"gpus={p} must be <= ranks_per_node={per_node} or a multiple of it (full nodes) "
                f"on cluster {self.cluster.name!r}"
            )
        if not 0.0 < self.density <= 1.0:
            raise ValueError(f"density must be in (0, 1], got {self.density!r}")
        if self.value_bytes not in (2, 4, 8) or self.index_bytes not in (4, 8):
            raise ValueError(
                f"value_bytes must be 2, 4 or 8 and index_bytes 4 or 8, got {self.value_bytes}, "
                f"{self.index_bytes}"
            )
        if self.node_split not in NODE_SPLITS:
            raise ValueError(f"node_split must be one of {', '.join(NODE_SPLITS)}, got {self.node_split!r}")
        if self.grid is not None:
            x, y = self.grid
            if x < 1 or y < 1 or x * y != p:
                raise ValueError(f"grid {x}x{y} does not match gpus={p}: need X*Y == gpus")
            lr = self.ranks_per_node_used
            if p > per_node and x % lr and lr % x:
                raise ValueError(
                    f"grid {x}x{y}: X={x} must divide or be a multiple of ranks_per_node={lr} "
                    "so that horizontal rings do not straddle nodes unevenly"
                )

    @property
    def ranks_per_node_used(self) -> int:
        """Ranks per node of this run: L = min(P, the cluster's ranks_per_node)."""
        return min(self.gpus, self.cluster.ranks_per_node)

    @property
    def torus_grid(self) -> tuple[int, int]:
        return self.grid if self.grid is not None else auto_grid(self.gpus, self.ranks_per_node_used)


def auto_grid(gpus: int, ranks_per_node: int) -> tuple[int, int]:
    """Near-square torus grid X x Y with X a multiple of the node size: the fewest latency steps.

    X is the multiple of ``ranks_per_node`` dividing ``gpus`` closest to sqrt(gpus) (X = gpus when
    everything fits in a node). Example: 1024 GPUs, 4 per node -> 32 x 32.
    """
    if gpus <= ranks_per_node:
        return gpus, 1
    cands = [x for x in range(ranks_per_node, gpus + 1, ranks_per_node) if gpus % x == 0]
    x = min(cands, key=lambda c: (abs(math.log(c / math.sqrt(gpus))), c))
    return x, gpus // x


@dataclass(frozen=True)
class Cost:
    """Time of one exchange by component (seconds; arrays shaped like ``n_bytes``)."""

    latency_s: np.ndarray
    bandwidth_s: np.ndarray
    compute_s: np.ndarray
    overhead_s: np.ndarray

    @property
    def total(self) -> np.ndarray:
        return self.latency_s + self.bandwidth_s + self.compute_s + self.overhead_s

    def __add__(self, other: "Cost") -> "Cost":
        return Cost(self.latency_s + other.latency_s, self.bandwidth_s + other.bandwidth_s,
                    self.compute_s + other.compute_s, self.overhead_s + other.overhead_s)


def zero_cost(n: np.ndarray) -> Cost:
    """No time at all, shaped like ``n``."""
    z = np.zeros_like(n)
    return Cost(z, z, z, z)


CostFn = Callable[[object, CommSetup], Cost]
"""``cost(n_bytes, setup) -> Cost``: the signature of every function registered in
:data:`flashsgd.sim.algorithms.SIMULATED`."""

COSTS: Registry[CostFn] = Registry("cost function")
"""Every cost function by its name, registered where it is defined (:func:`cost`): the catalog's
exchanges name theirs (:attr:`flashsgd.exchanges.Exchange.cost`), :mod:`flashsgd.sim.algorithms`
looks them up."""
REFERENCES: list[str] = []
"""The names of :data:`COSTS` no hook runs (``reference=True``): the papers' figures' algorithms."""


def cost(name: str, reference: bool = False) -> Callable[[CostFn], CostFn]:
    """Register the decorated function in :data:`COSTS` as ``name`` (``reference``: simulator-only)."""
    def register(fn: CostFn) -> CostFn:
        COSTS.add(name, fn)
        if reference:
            REFERENCES.append(name)
        return fn
    return register


# ---------------------------------------------------------------- link selection ------------------


def step_cost(chunk: np.ndarray, steps: float, levels: list[tuple[float, float]]) -> tuple:
    """``steps`` steps moving ``chunk`` bytes, each as slow as the slowest of ``levels`` (a, b)."""
    best_lat, best_bw = None, None
    for alpha, beta in levels:
        lat, bw = np.full_like(chunk, steps * alpha), steps * chunk * beta
        if best_lat is None:
            best_lat, best_bw = lat, bw
        else:
            slower = lat + bw > best_lat + best_bw
            best_lat, best_bw = np.where(slower, lat, best_lat), np.where(slower, bw, best_bw)
    return best_lat, best_bw


def ring_levels(members: int, stride: int, setup: CommSetup) -> list[tuple[float, float]]:
    """Links of a ring of ``members`` ranks ``stride`` apart, all such rings running at once."""
    c, lr = setup.cluster, setup.ranks_per_node_used
    intra = (c.intra.alpha_s, c.intra.flow_beta(1))
    if members * stride <= lr:  # the whole ring lives inside one node
        return [intra]
    per_node = max(1, lr // stride)  # ring members on one node (consecutive in the ring)
    flows = lr // per_node  # concurrent rings on a node, one outgoing NIC hop (one flow) each
    levels = [inter_level(setup, flows, uplink_flows(c.fabric, setup.gpus, lr, ("ring", members, stride)))]
    return levels + [intra] if per_node > 1 else levels


def pair_levels(distance: int, flows: int, setup: CommSetup, pattern: str = "butterfly") -> list[tuple[float, float]]:
    """Link between partners ``distance`` ranks apart; ``flows`` ranks per node cross at once.
    ``pattern`` says which ranks send (:data:`flashsgd.sim.fabric.PATTERNS`, for the switches'
    uplinks): ``butterfly`` (every rank below the largest power of two swaps with ``r XOR
    distance``), ``tree`` (a binomial round) or ``fold`` (``distance`` = that power of two). Below
    L ranks apart the partners share a node when L is a multiple of 2 x distance; otherwise some
    pairs straddle two nodes and the round is the network's, with the flows per node that cross
    (:func:`flashsgd.sim.fabric.node_flows`, counted from the round's messages; e.g. L = 3,
    distance 2: all three)."""
    c, lr = setup.cluster, setup.ranks_per_node_used
    p2 = 1 << (setup.gpus.bit_length() - 1)
    shape = (pattern, distance, p2 if pattern == "butterfly" else 0)
    if distance < lr:  # partners on one node, unless L is not a multiple of 2 x distance
        flows = node_flows(setup.gpus, lr, shape)
        if not flows:
            return [(c.intra.alpha_s, c.intra.flow_beta(1))]
    return [inter_level(setup, flows, uplink_flows(c.fabric, setup.gpus, lr, shape))]


def inter_level(setup: CommSetup, flows: int, uplink: float, incast: float = 1.0) -> tuple[float, float]:
    """The inter-node level of a round, (alpha, seconds per byte of one flow): ``flows`` flows
    share each node's link (:meth:`~flashsgd.sim.network.Link.flow_beta`), slowed by ``incast``
    into the receiving port (:meth:`~flashsgd.sim.network.Link.incast_factor`), and ``uplink``
    flows cross the busiest edge switch's uplink (:mod:`flashsgd.sim.fabric`: ``u o / n`` node
    links' worth per byte; 0 within one switch); the slower of the two bounds the round."""
    c = setup.cluster
    beta = c.inter.flow_beta(flows) * incast
    if uplink:
        beta = max(beta, uplink_beta_factor(c.fabric, uplink) * c.inter.beta_s_per_byte)
    return c.inter.alpha_s, beta


# ---------------------------------------------------------------- ring building blocks ------------


def _ring(n: np.ndarray, members: int, stride: int, setup: CommSetup, phases: int, reduce: bool) -> Cost:
    """Ring reduce-scatter (phases=1, reduce), all-gather (1, no reduce) or all-reduce (2, reduce)."""
    if members == 1:
        return zero_cost(n)
    # Each of the (members-1) steps per phase moves one chunk of n/members bytes on every hop.
    lat, bw = step_cost(n / members, phases * (members - 1), ring_levels(members, stride, setup))
    red = (members - 1) / members * n * setup.cluster.gamma_s_per_byte if reduce else np.zeros_like(n)
    return Cost(lat, bw, red, np.full_like(n, setup.cluster.call_overhead_s))


@cost("ring")
def ring(n_bytes, setup: CommSetup) -> Cost:
    """Ring all-reduce over all P ranks: 2(P-1) a + 2(P-1)/P n b + (P-1)/P n g (bandwidth-optimal)."""
    n = np.asarray(n_bytes, dtype=float)
    return _ring(n, setup.gpus, 1, setup, phases=2, reduce=True)


@cost("hierarchical")
def hierarchical(n_bytes, setup: CommSetup) -> Cost:
    """Reduce-scatter in node, all-reduce of n/L across nodes, all-gather in node (3 calls)."""
    n = np.asarray(n_bytes, dtype=float)
    lr = setup.ranks_per_node_used
    nodes = setup.gpus // lr
    # Step 1: ring reduce-scatter among the L ranks of each node -> each holds n/L reduced bytes.
    cost = _ring(n, lr, 1, setup, phases=1, reduce=True)
    # Step 2: L concurrent ring all-reduces of n/L bytes across nodes (ranks L apart).
    cost = cost + _ring(n / lr, nodes, lr, setup, phases=2, reduce=True)
    # Step 3: ring all-gather inside each node.
    return cost + _ring(n, lr, 1, setup, phases=1, reduce=False)


@cost("torus2d")
def torus2d(n_bytes, setup: CommSetup) -> Cost:
    """2D-Torus (Mikami et al. 2018): horizontal RS, vertical all-reduce of n/X, horizontal AG."""
    n = np.asarray(n_bytes, dtype=float)
    x, y = setup.torus_grid
    # Step 1: reduce-scatter along the X contiguous ranks of a row -> n/X bytes each.
    cost = _ring(n, x, 1, setup, phases=1, reduce=True)
    # Step 2: all-reduce the n/X shard along the column (Y ranks, X apart).
    cost = cost + _ring(n / x, y, x, setup, phases=2, reduce=True)
    # Step 3: all-gather along the row.
    return cost + _ring(n, x, 1, setup, phases=1, reduce=False)


# ---------------------------------------------------------------- log-depth algorithms ------------


def _call_overhead(n: np.ndarray, setup: CommSetup, calls: int) -> Cost:
    """The fixed cost of ``calls`` collective calls, shaped like ``n``."""
    z = np.zeros_like(n)
    return Cost(z, z, z, np.full_like(n, calls * setup.cluster.call_overhead_s))


def _fold(n: np.ndarray, setup: CommSetup) -> tuple[int, Cost]:
    """MPICH fold for non-powers of two: P' = 2^floor(lgP); one step in, one step out."""
    p = setup.gpus
    p2 = 1 << (p.bit_length() - 1)
    if p2 == p:
        return p2, zero_cost(n)
    lat, bw = step_cost(n, 2, pair_levels(p2, min(p - p2, setup.ranks_per_node_used), setup, "fold"))  # in, out
    return p2, Cost(lat, bw, n * setup.cluster.gamma_s_per_byte, np.zeros_like(n))


@cost("recursive_doubling", reference=True)
def recursive_doubling(n_bytes, setup: CommSetup) -> Cost:
    """Recursive doubling: lgP steps exchanging the full n with partner rank XOR 2^i."""
    n = np.asarray(n_bytes, dtype=float)
    if setup.gpus == 1:
        return zero_cost(n)
    p2, cost = _fold(n, setup)
    g = setup.cluster.gamma_s_per_byte
    for i in range(p2.bit_length() - 1):
        lat, bw = step_cost(n, 1, pair_levels(1 << i, setup.ranks_per_node_used, setup))  # every rank sends
        cost = cost + Cost(lat, bw, n * g, np.zeros_like(n))
    return cost + _call_overhead(n, setup, calls=1)


@cost("rabenseifner", reference=True)
def rabenseifner(n_bytes, setup: CommSetup) -> Cost:
    """Recursive-halving reduce-scatter then recursive-doubling all-gather (Rabenseifner 2004)."""
    n = np.asarray(n_bytes, dtype=float)
    if setup.gpus == 1:
        return zero_cost(n)
    p2, cost = _fold(n, setup)
    g = setup.cluster.gamma_s_per_byte
    for i in range(p2.bit_length() - 1):
        # Step 1 (halving): partner P'/2^(i+1) away, exchange and reduce n/2^(i+1) bytes.
        # Step 2 (doubling) mirrors it with the same sizes and partners, without the reduction.
        chunk = n / (1 << (i + 1))
        lat, bw = step_cost(chunk, 2, pair_levels(p2 >> (i + 1), setup.ranks_per_node_used, setup))
        cost = cost + Cost(lat, bw, chunk * g, np.zeros_like(n))
    return cost + _call_overhead(n, setup, calls=1)


@cost("binomial", reference=True)
def binomial(n_bytes, setup: CommSetup) -> Cost:
    """Binomial-tree reduce to rank 0 then binomial broadcast: 2 ceil(lgP) full-size steps."""
    n = np.asarray(n_bytes, dtype=float)
    cost = zero_cost(n)
    g = setup.cluster.gamma_s_per_byte
    for i in range(math.ceil(math.log2(setup.gpus))):
        # At round i the senders are ranks = 2^i mod 2^(i+1): L/2^(i+1) per node stay inside the
        # node; once 2^i >= L at most one rank per node crosses.
        lat, bw = step_cost(n, 2, pair_levels(1 << i, 1, setup, "tree"))  # reduce + broadcast round
        cost = cost + Cost(lat, bw, n * g, np.zeros_like(n))
    return cost + _call_overhead(n, setup, calls=2)
