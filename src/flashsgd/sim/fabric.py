"""The fabric beyond the NICs: edge switches whose uplinks are oversubscribed, and where ranks sit.

The link levels of :mod:`flashsgd.sim.network` end at a node's NICs; beyond them the fabric was
taken as non-blocking. Real clusters join their nodes through edge switches of ``n`` nodes whose
uplinks to the core carry less than the ``n`` nodes can send: an oversubscription ``o`` (3:1 is
common between racks; cheap Ethernet labs cascade small switches). A flow between two nodes of one
switch never leaves it; a flow to another switch shares that switch's uplink with every other such
flow of the round. With node bandwidth B (``inter.bandwidth_gbps``), an uplink carries ``n B / o``
per direction, so each of the ``u`` flows crossing one uplink in one direction gets at most
``n B / (o u)``:

    beta_uplink = u o beta_node / n          (seconds per byte of one flow; beta_node = 1 / B)

and a round is as slow as its slowest flow: ``beta_inter = max(NIC share (flows x beta_node, at most
the per-flow rate), beta_uplink)`` (:func:`flashsgd.sim.costs.inter_level`). ``u`` is the most
flows crossing any one uplink in either direction in one round, counted over the round's rank-level
messages (a message between ranks of two nodes is a flow) for the pattern the exchange runs
(:data:`PATTERNS`), given where the ranks sit (:class:`Fabric` ``placement``; rank r on node
``r // L``):

* ``ordered``: nodes numbered switch by switch (nodes ``0..n-1`` on the first switch, as a
  scheduler that fills racks in order and ``torchrun``'s node ranks give). A ring whose hops move to
  the next node leaves each switch once per direction (u = the concurrent rings); a ring whose hops
  jump ``s`` nodes (a torus column, ``X = s L`` ranks apart) crosses on up to ``s L`` of a switch's
  hops; a pairwise round at node distance ``>= n`` sends every node's flows across.
* ``interleaved``: node ``i`` on switch ``i mod S``, ``S = ceil(N / n)`` (every hop of a node ring
  crosses). Used to validate the term on the emulated cluster (``flashsgd bench emulate
  --switches``).
* ``random``: nodes in no relation to switches (a hostfile in arbitrary order): ``u`` is the busiest
  uplink's count averaged over :data:`RANDOM_PLACEMENTS` shuffles of the nodes over the switches
  (seeded: the same every run). The mean switch alone would carry about ``n x (the pattern's
  inter-node flows per node) x (N - n) / (N - 1)``; the round waits for the busiest.

An all-to-all round (Top-k's direct exchange) sends from every node to every other: ``u = n L^2
(N - n)`` whatever the placement. Cost: O(P) per distinct pattern and layout (64 vectorized
shuffles for ``random``), once (cached on the layout, not on ``o``); nothing at all without a
fabric (``nodes_per_switch`` None: one non-blocking switch) or within one switch.

Example: 4 nodes of 1 rank on 2 switches, uplink = one node link (``o = 2``): an ordered ring
crosses with 1 flow per direction (``u o / n = 1``: as fast as without switches), an interleaved one
with 2 (each hop at half the node's bandwidth)::

    >>> f = Fabric(nodes_per_switch=2, oversubscription=2.0, placement="interleaved")
    >>> uplink_flows(f, gpus=4, ranks_per_node=1, pattern=("ring", 4, 1))
    2.0
    >>> uplink_beta_factor(f, 2.0)
    2.0
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from functools import lru_cache

import numpy as np

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
        uplinks = ("non-blocking uplinks" if self.oversubscription == 1
                   else f"uplinks {self.oversubscription:g}:1 oversubscribed")
        return f"{self.nodes_per_switch} nodes per switch, {uplinks}, ranks {self.placement}"


def uplink_beta_factor(fabric: Fabric, flows: float) -> float:
    """``beta_uplink / beta_node`` for ``flows`` flows crossing one uplink at once: ``u o / n``."""
    return flows * fabric.oversubscription / fabric.nodes_per_switch


PATTERNS = ("ring", "butterfly", "tree", "fold")
"""The message patterns of one round, as ``(kind, a, b)``: ``("ring", members, stride)``: rings of
``members`` ranks ``stride`` apart, rank r at position ``(r // stride) % members`` sends to ``r +
stride`` and the last back to the first (:func:`flashsgd.sim.costs.ring_levels`);
``("butterfly", distance, p2)``: every rank r < p2 swaps with ``r XOR distance``; ``("tree",
distance, 0)``: the ranks with ``r mod 2 distance == distance`` send to ``r - distance`` (a
binomial round; the broadcast runs it back); ``("fold", p2, 0)``: the ranks ``r >= p2`` send to ``r -
p2`` (the fold of a non-power of two; the fold-out runs it back). One-way patterns are counted in
both directions: the same step cost covers the round and its reverse."""


def uplink_flows(fabric: Fabric, gpus: int, ranks_per_node: int, pattern: tuple[str, int, int]) -> float:
    """The most flows crossing one uplink in one direction in a round of ``pattern``
    (:data:`PATTERNS`) over ``gpus`` ranks, ``ranks_per_node`` per node; 0 within one switch."""
    if not fabric.splits(gpus // ranks_per_node):
        return 0.0
    return _counted(fabric.nodes_per_switch, fabric.placement, gpus, ranks_per_node, pattern)


def node_flows(gpus: int, ranks_per_node: int, pattern: tuple[str, int, int]) -> int:
    """The most messages of one round of ``pattern`` (:data:`PATTERNS`) that leave or enter one
    node, over ``gpus`` ranks of ``ranks_per_node`` per node; 0: the round stays inside the nodes
    (a butterfly or tree round at a distance below L does, unless L is not a multiple of twice the
    distance: then the blocks of 2 x distance ranks that pair up straddle node boundaries). The
    uplinks' count with every node its own switch."""
    return int(_counted(1, "ordered", gpus, ranks_per_node, pattern))


def all_to_all_uplink_flows(fabric: Fabric, gpus: int, ranks_per_node: int) -> float:
    """Flows leaving a full switch when every rank sends one message to every other rank at once
    (Top-k's direct exchange): each of its ``n`` nodes' ``L`` ranks to the ``L (N - n)`` ranks on
    other switches, ``n L^2 (N - n)``, whatever the placement."""
    nodes = gpus // ranks_per_node
    if not fabric.splits(nodes):
        return 0.0
    n = fabric.nodes_per_switch
    return float(n * ranks_per_node ** 2 * (nodes - n))


def _edges(gpus: int, pattern: tuple[str, int, int]):
    """The (sender, receiver) rank pairs of one round of ``pattern``."""
    kind, a, b = pattern
    if kind == "ring":
        members, stride = a, b
        for r in range(gpus):
            last = (r // stride) % members == members - 1
            yield r, r - (members - 1) * stride if last else r + stride
    elif kind == "butterfly":
        for r in range(min(b, gpus)):
            if (r ^ a) < gpus:
                yield r, r ^ a
    elif kind == "tree":
        for r in range(a, gpus, 2 * a):
            yield r, r - a
    elif kind == "fold":
        for r in range(a, gpus):
            yield r, r - a
    else:
        raise ValueError(f"pattern kind must be one of {', '.join(PATTERNS)}, got {kind!r}")


RANDOM_PLACEMENTS = 64
"""Placements drawn (seeded: the same every run) for ``random``'s expected busiest uplink."""


def node_switches(nodes: int, per_switch: int, placement: str, rng: np.random.Generator | None = None) -> np.ndarray:
    """The edge switch of every node: ``ordered`` node // n, ``interleaved`` node mod ceil(N / n),
    ``random`` node i at position ``perm[i]`` of a shuffle drawn from ``rng``, // n (one placement;
    the emulator builds this layout too, :func:`flashsgd.emulate.netns.switch_of`)."""
    node = np.arange(nodes)
    if placement == "ordered":
        return node // per_switch
    if placement == "interleaved":
        return node % math.ceil(nodes / per_switch)
    if placement == "random":
        if rng is None:
            raise ValueError("random placement needs a numpy Generator to draw the shuffle from")
        return rng.permutation(nodes) // per_switch
    raise ValueError(f"placement must be one of {', '.join(PLACEMENTS)}, got {placement!r}")


@lru_cache(maxsize=4096)
def _counted(per_switch: int, placement: str, gpus: int, ranks_per_node: int, pattern: tuple[str, int, int]) -> float:
    """:func:`uplink_flows` for one layout (no oversubscription: the count does not depend on it)."""
    nodes = gpus // ranks_per_node
    switches = math.ceil(nodes / per_switch)
    pairs = np.array([(a // ranks_per_node, b // ranks_per_node) for a, b in _edges(gpus, pattern)], dtype=np.int64)
    pairs = pairs[pairs[:, 0] != pairs[:, 1]] if len(pairs) else pairs.reshape(0, 2)  # inter-node messages
    rng = np.random.default_rng(0)  # random: the busiest uplink's mean over seeded draws
    layouts = [node_switches(nodes, per_switch, placement, rng)
               for _ in range(RANDOM_PLACEMENTS if placement == "random" else 1)]
    busiest = []
    for switch in layouts:
        a, b = switch[pairs[:, 0]], switch[pairs[:, 1]]
        crossing = a != b
        out, into = np.bincount(a[crossing], minlength=switches), np.bincount(b[crossing], minlength=switches)
        busiest.append(max(out.max(initial=0), into.max(initial=0)))
    return float(np.mean(busiest))
