"""The fabric beyond the NICs: edge switches whose uplinks are oversubscribed, and where ranks sit.

The link levels of :mod:`flashsgd.sim.network` end at a node's NICs; beyond them the fabric was
taken as non-blocking. Real clusters join their nodes through edge switches of ``n`` nodes whose
uplinks to the core carry less than the ``n`` nodes can send: an oversubscription ``o`` (3:1 is
common between racks; cheap Ethernet labs cascade small switches). A flow between two nodes of one
switch never leaves it; a flow to another switch shares that switch's uplink with every other such
flow of the round. With node bandwidth B (``inter.bandwidth_gbps``), an uplink carries ``n B / o``
per direction, so each of the ``u`` flows leaving one switch at once gets at most ``n B / (o u)``:

    beta_uplink = u o beta_node / n          (seconds per byte of one flow; beta_node = 1 / B)

and a round is as slow as its slowest flow: ``beta_inter = max(NIC share (flows x beta_node, at most
the per-flow rate), beta_uplink)`` (:func:`flashsgd.sim.costs.inter_level`). ``u`` is the busiest
switch's count of flows leaving it in one direction, which depends on the pattern and on where the
ranks sit (:class:`Fabric` ``placement``):

* ``ordered``: ranks are numbered switch by switch (nodes ``0..n-1`` on the first switch, as a
  scheduler that fills racks in order and ``torchrun``'s node ranks give): a ring over the nodes
  leaves each switch once per direction, so ``u`` = the concurrent rings (flows per NIC); a
  pairwise round at node distance ``d >= n`` sends every node's flows across.
* ``interleaved``: node ``i`` on switch ``i mod S`` (the worst order for a ring: every hop leaves
  its switch). Used to validate the term on the emulated cluster
  (``flashsgd bench emulate --switches``).
* ``random``: ranks in no relation to switches (a hostfile in arbitrary order): each inter-node flow
  leaves its switch with probability ``(N - n) / (N - 1)``, so ``u`` = (the switch's inter-node
  flows) x that probability, in expectation.

An all-to-all round (Top-k's direct exchange) sends from every node to every other: ``u = n L^2
(N - n)`` whatever the placement. Counts are exact (enumerated over the ranks, cached) for
``ordered`` and ``interleaved``. Cost: O(P) per distinct pattern, once; nothing at all without a
fabric (``nodes_per_switch`` None: one non-blocking switch, every preset).

Example: 4 nodes of 1 rank on 2 switches, uplink = one node link (``o = 2``): an ordered ring
crosses with 1 flow per direction (``u o / n = 1``: as fast as without switches), an interleaved one
with 2 (each hop at half the node's bandwidth)::

    >>> f = Fabric(nodes_per_switch=2, oversubscription=2.0, placement="interleaved")
    >>> ring_uplink_flows(f, gpus=4, ranks_per_node=1, members=4, stride=1)
    2.0
    >>> uplink_beta_factor(f, 2.0)
    2.0
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from functools import lru_cache

PLACEMENTS = ("ordered", "interleaved", "random")
"""Where ranks sit relative to switches (:attr:`Fabric.placement`)."""


@dataclass(frozen=True)
class Fabric:
    """Edge switches of ``nodes_per_switch`` nodes joined through a core; see the module docstring."""

    nodes_per_switch: int | None = None
    """Nodes on one edge switch (None: one non-blocking switch holds every node; the presets)."""
    oversubscription: float = 1.0
    """What a switch's nodes can send over what its uplink carries (>= 1; 1: non-blocking, 3: 3:1)."""
    placement: str = "ordered"
    """``ordered``, ``interleaved`` or ``random`` (:data:`PLACEMENTS`)."""

    def __post_init__(self) -> None:
        n = self.nodes_per_switch
        if n is not None and (not isinstance(n, int) or isinstance(n, bool) or n < 1):
            raise ValueError(f"Fabric.nodes_per_switch must be an int >= 1 or None (one switch), got {n!r}")
        o = self.oversubscription
        if not (isinstance(o, (int, float)) and math.isfinite(o) and o >= 1):
            raise ValueError(f"Fabric.oversubscription must be a number >= 1 (1: non-blocking; 3 for 3:1), got {o!r}")
        if self.placement not in PLACEMENTS:
            raise ValueError(f"Fabric.placement must be one of {', '.join(PLACEMENTS)}, got {self.placement!r}")

    def splits(self, nodes: int) -> bool:
        """Whether ``nodes`` nodes span more than one switch (else the fabric costs nothing)."""
        return self.nodes_per_switch is not None and nodes > self.nodes_per_switch

    def describe(self) -> str:
        if self.nodes_per_switch is None:
            return "one non-blocking switch"
        return (f"{self.nodes_per_switch} nodes per switch, uplinks {self.oversubscription:g}:1 "
                f"oversubscribed, ranks {self.placement}")


def uplink_beta_factor(fabric: Fabric, flows: float) -> float:
    """``beta_uplink / beta_node`` for ``flows`` flows leaving one switch at once: ``u o / n``."""
    return flows * fabric.oversubscription / fabric.nodes_per_switch


def _switch_of(node: int, nodes: int, fabric: Fabric) -> int:
    n = fabric.nodes_per_switch
    if fabric.placement == "ordered":
        return node // n
    return node % math.ceil(nodes / n)  # interleaved


def _busiest(edges: list[tuple[int, int]], nodes: int, fabric: Fabric) -> float:
    """The most (source node, destination node) edges leaving any one switch."""
    out: dict[int, int] = {}
    for a, b in edges:
        sa, sb = _switch_of(a, nodes, fabric), _switch_of(b, nodes, fabric)
        if sa != sb:
            out[sa] = out.get(sa, 0) + 1
    return float(max(out.values(), default=0))


def _random(fabric: Fabric, nodes: int, node_flows: float) -> float:
    """Expected flows leaving a full switch when each of its nodes sends ``node_flows`` inter-node
    flows to partners placed at random: ``n f (N - n) / (N - 1)``."""
    n = fabric.nodes_per_switch
    return n * node_flows * (nodes - n) / (nodes - 1)


@lru_cache(maxsize=4096)
def ring_uplink_flows(fabric: Fabric, gpus: int, ranks_per_node: int, members: int, stride: int) -> float:
    """Flows leaving the busiest switch in one step of the rings of ``members`` ranks ``stride``
    apart that run at once over ``gpus`` ranks (:func:`flashsgd.sim.costs._ring_levels`: rank r at
    position ``(r // stride) % members`` of its ring sends to ``r + stride``, the last back to the
    first). Every inter-node hop is a flow. 0 when the ranks span one switch."""
    nodes = gpus // ranks_per_node
    if not fabric.splits(nodes):
        return 0.0
    edges = []
    for r in range(gpus):
        nxt = r + stride if (r // stride) % members < members - 1 else r - (members - 1) * stride
        a, b = r // ranks_per_node, nxt // ranks_per_node
        if a != b:
            edges.append((a, b))
    if fabric.placement == "random":
        return _random(fabric, nodes, len(edges) / nodes)
    return _busiest(edges, nodes, fabric)


@lru_cache(maxsize=4096)
def pair_uplink_flows(fabric: Fabric, gpus: int, ranks_per_node: int, distance: int, flows: int,
                      both_ways: bool = True) -> float:
    """Flows leaving the busiest switch in a round where node ``i`` sends ``flows`` flows to node
    ``i XOR d`` (``d = distance // ranks_per_node``, partners ``distance`` ranks apart: the
    butterflies and the folds of :mod:`flashsgd.sim.costs` and :mod:`flashsgd.sim.costs_sparse`);
    ``both_ways`` False: only the nodes with bit ``d`` set send (a tree's round, one direction)."""
    nodes = gpus // ranks_per_node
    d = distance // ranks_per_node
    if not fabric.splits(nodes) or d == 0:
        return 0.0
    senders = [i for i in range(nodes) if (i ^ d) < nodes and (both_ways or i & d)]
    if fabric.placement == "random":
        return _random(fabric, nodes, flows * len(senders) / nodes)
    return flows * _busiest([(i, i ^ d) for i in senders], nodes, fabric)


def all_to_all_uplink_flows(fabric: Fabric, gpus: int, ranks_per_node: int) -> float:
    """Flows leaving a full switch when every rank sends one message to every other rank at once
    (Top-k's direct exchange): each of its ``n`` nodes' ``L`` ranks to the ``L (N - n)`` ranks on
    other switches, ``n L^2 (N - n)``, whatever the placement."""
    nodes = gpus // ranks_per_node
    if not fabric.splits(nodes):
        return 0.0
    n = fabric.nodes_per_switch
    return float(n * ranks_per_node ** 2 * (nodes - n))
