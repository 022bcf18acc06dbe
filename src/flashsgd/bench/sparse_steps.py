"""The timed sparse steps of `flashsgd bench sparse`, their time split, wire time and memory floor.

One step is what the sparse DDP hook (:mod:`flashsgd.comm.sparse_hooks`) does for one bucket,
with the phases clocked separately (rank-local clocks, no extra synchronization):

- ``accum``: ``acc = residual + grad`` into a new tensor, as the hook does (the residual a step
  started from stays until the step is kept, :mod:`flashsgd.comm.hook_step`); with the
  ``threshold`` selector also the block maxima (:func:`~flashsgd.comm.sparse_fused.add_block_maxima`,
  fused by ``torch.compile`` in the ``compiled`` variant);
- ``select``: the rest of the selection (threshold, candidates, trim to k);
- ``exchange``: the communication: topk's all-gather with its scatter-add into a zeroed buffer;
  gTop-k's sends and waits; hgtopk's node step (``node_split``: the leader's reduce and broadcast,
  the slices' reduce-scatter and all-gather, or the node's gTop-k; with the copy into the output
  and the scatter of the result) and the gTop-k sends among the nodes;
- ``merge``: gTop-k's pairwise merges and counted-index tracking;
- ``scatter``: the dense average written into the bucket and the residual's counted entries
  zeroed.

Wire time (:func:`wire_bytes_per_node`): the bytes through the busiest node link divided by the
link rate, the least time the network alone needs. Floor (:data:`FLOOR_PASSES`): the memory passes
a design cannot avoid, in units of one ``torch.add`` over the gradient (read 8m, write 4m bytes)
measured in the same run with every rank adding at once, so ranks sharing a core are included.

Example::

    >>> step = make_step("gtopk", grad, k, SparseStepOptions(selector="threshold"))
    >>> step()            # one bucket's step; step.splits holds the phase times of each call
    >>> step_name("hgtopk", "slices")                   # the row of hgtopk with that node split
    'hgtopk node_split=slices'
"""

from __future__ import annotations

import time
from dataclasses import dataclass

import torch
import torch.distributed as dist

from flashsgd.comm.sparse import (SELECTIONS, SelectionWorkspace, gtopk_allreduce, gtopk_bytes_sent,
                                  message_bytes, topk_allgather)
from flashsgd.comm.sparse_fused import add_block_maxima
from flashsgd.comm.sparse_hier import hgtopk_allreduce
from flashsgd.comm.sparse_select import ThresholdReuse, auto_block, topk_threshold
from flashsgd.comm.topology import Topology
from flashsgd.exchanges import NODE_SPLITS, names, option_default

PHASES = ("accum", "select", "exchange", "merge", "scatter")
STEP_ALGORITHMS = tuple(names("sparse"))
"""The catalog's sparse exchanges; hgtopk's node split is an option (:class:`SparseStepOptions`)."""
DEFAULT_NODE_SPLIT = option_default("node_split")


def step_name(algorithm: str, node_split: str | None = None) -> str:
    """Row name of a step: the algorithm, and for hgtopk its node split (``hgtopk node_split=slices``)."""
    if algorithm != "hgtopk":
        return algorithm
    return f"hgtopk node_split={node_split or DEFAULT_NODE_SPLIT}"


FLOOR_PASSES = {
    # 1 (residual += grad) + 2/3 (block maxima: read 4m) + 1/3 (zero fill of the bucket: write 4m)
    ("gtopk", False): 2.0,
    # the add and the maxima fused into one pass (read 8m, write 4m) + the zero fill
    ("gtopk", True): 4 / 3,
    # as gtopk, plus the division of the dense sum by P (read 4m, write 4m) = 2/3
    ("topk", False): 8 / 3,
    ("topk", True): 2.0,
    # per rank: add (1) + copy of acc into the bucket (2/3) + zero fill (1/3); the leader adds the
    # reduce's sum (1 per other rank of the node, counted once) and the block maxima (2/3)
    ("hgtopk node_split=leader", False): 11 / 3,
    ("hgtopk node_split=leader", True): 3.0,
    # per rank, R = 2: add (1) + own slice copied and the other summed in (1/3 + 1/2) + block
    # maxima of the slice (1/2) + zero fill (1/3)
    ("hgtopk node_split=slices", False): 8 / 3,
    ("hgtopk node_split=slices", True): 8 / 3,
    # no dense traffic: as gtopk
    ("hgtopk node_split=sparse", False): 2.0,
    ("hgtopk node_split=sparse", True): 4 / 3,
}
"""Memory passes (units of one torch.add over the gradient) each step cannot avoid; key
(:func:`step_name`, fused with torch.compile)."""


@dataclass(frozen=True)
class SparseStepOptions:
    """How the step selects and where it runs."""

    selector: str = "threshold"
    """A name in SELECTIONS."""
    compiled: bool = False
    """Fuse the add and the block maxima with torch.compile (``threshold`` selector only)."""
    topology: Topology | None = None
    """hgtopk's node layout (required for hgtopk)."""
    node_split: str = DEFAULT_NODE_SPLIT
    """hgtopk: how a node combines its ranks (:data:`flashsgd.exchanges.NODE_SPLITS`)."""

    def __post_init__(self) -> None:
        if self.node_split not in NODE_SPLITS:
            raise ValueError(f"node_split must be one of {', '.join(NODE_SPLITS)}, got {self.node_split!r}")


class SparseStep:
    """A callable running one bucket's sparse step; ``splits`` lists each call's phase seconds."""

    __slots__ = ("algorithm", "grad", "k", "options", "residual", "out", "reuse", "workspace",
                 "splits")

    def __init__(self, algorithm: str, grad: torch.Tensor, k: int, options: SparseStepOptions) -> None:
        if algorithm == "hgtopk" and options.topology is None:
            raise ValueError("hgtopk needs options.topology (ranks per node)")
        self.algorithm, self.grad, self.k, self.options = algorithm, grad, k, options
        self.residual = torch.zeros_like(grad)
        self.out = torch.empty_like(grad)
        self.reuse = ThresholdReuse()
        self.workspace = SelectionWorkspace()
        self.splits: list[dict[str, float]] = []

    def _select(self, x: torch.Tensor, k: int, bmax: torch.Tensor | None = None):
        if self.options.selector == "threshold":
            return topk_threshold(x, k, reuse=self.reuse, bmax=bmax)
        if self.options.selector == "sampled":
            return SELECTIONS["sampled"](x, k, workspace=self.workspace)
        return SELECTIONS[self.options.selector](x, k)

    def _accumulate(self) -> torch.Tensor | None:
        """residual <- residual + grad, a new tensor as in the hook (with the block maxima when they
        will be used)."""
        block = auto_block(self.grad.numel(), self.k)
        dense_in_node = self.algorithm == "hgtopk" and self.options.node_split in ("leader", "slices")
        # (they select over the node sum, not over this rank's residual)
        if self.options.selector == "threshold" and block and not dense_in_node:
            self.residual, bmax = add_block_maxima(self.residual, self.grad, block, compiled=self.options.compiled)
            return bmax
        self.residual = self.residual + self.grad
        return None

    def __call__(self) -> None:
        world, m = dist.get_world_size(), self.grad.numel()
        tm: dict[str, float] = {"merge": 0.0}
        t0 = time.perf_counter()
        bmax = self._accumulate()
        t1 = time.perf_counter()
        if self.algorithm == "hgtopk":
            sel = {"s": 0.0}

            def timed_select(x, k):
                s0 = time.perf_counter()
                picked = self._select(x, k, bmax if x is self.residual else None)
                sel["s"] += time.perf_counter() - s0
                return picked

            res = hgtopk_allreduce(self.residual, self.k, self.options.topology, out=self.out,
                                   select=timed_select, check=False, timings=tm,
                                   split=self.options.node_split)
            t3 = time.perf_counter()
            t2 = t1 + sel["s"]
            self.out.div_(world)
            counted = res.counted
        else:
            values, indices = self._select(self.residual, self.k, bmax)
            t2 = time.perf_counter()
            if self.algorithm == "topk":
                topk_allgather(values, indices, m, check=False, out=self.out)
                t3 = time.perf_counter()
                self.out.div_(world)
                counted = indices
            else:
                res = gtopk_allreduce(values, indices, self.k, m, check=False, timings=tm)
                t3 = time.perf_counter()
                self.out.zero_()
                self.out[res.indices] = res.values.div(world)
                counted = res.counted
        self.residual.index_fill_(0, counted, 0)
        t4 = time.perf_counter()
        self.splits.append({"accum": t1 - t0, "select": t2 - t1,
                            "exchange": t3 - t2 - tm["merge"], "merge": tm["merge"],
                            "scatter": t4 - t3})


def make_step(algorithm: str, grad: torch.Tensor, k: int, options: SparseStepOptions) -> SparseStep:
    """A :class:`SparseStep` for ``algorithm`` in :data:`STEP_ALGORITHMS`."""
    if algorithm not in STEP_ALGORITHMS:
        raise ValueError(f"algorithm must be one of {', '.join(STEP_ALGORITHMS)}, got {algorithm!r}")
    return SparseStep(algorithm, grad, k, options)


# --------------------------------------------------------------------------------- wire ---------

def _gtopk_cross_bytes(k: int, world: int, ranks_per_node: int, numel: int) -> list[int]:
    """Per node: bytes flat gTop-k over ``world`` ranks (node-major) sends to
    other nodes (butterfly partners r XOR 2^i, fold-in r -> r - P2, fold-out r -> r + P2)."""
    p2 = 1 << (world.bit_length() - 1)
    msg = message_bytes(k, torch.float32, numel)
    rounds = p2.bit_length() - 1
    # the fold-out message (pairs + survivor mask): what the rank sends beyond its rounds
    fold_out = gtopk_bytes_sent(k, world, 0, torch.float32, numel) - rounds * msg
    out = [0] * (world // ranks_per_node)
    for r in range(world):
        sends = []
        if r >= p2:
            sends.append((r - p2, msg))
        else:
            sends += [(r ^ (1 << i), msg) for i in range(rounds)]
            if r + p2 < world:
                sends.append((r + p2, fold_out))
        out[r // ranks_per_node] += sum(b for peer, b in sends if peer // ranks_per_node != r // ranks_per_node)
    return out


def wire_bytes_per_node(algorithm: str, k: int, numel: int, world: int, ranks_per_node: int,
                        node_split: str = DEFAULT_NODE_SPLIT) -> float:
    """Bytes through the busiest node's link (one direction) for one step of ``algorithm``.

    dense: 2(N-1)/N * 4m (the bound of any all-reduce); topk: each rank's message to the P - R
    ranks of other nodes, R ranks per node; gtopk: the cross-node sends of the butterfly;
    hgtopk: the node leader's gTop-k among the N leaders (``node_split`` leader or sparse), or R
    gTop-k of k/R pairs leaving the node at once (slices). N = world / R nodes.
    """
    nodes = world // ranks_per_node
    if nodes <= 1:
        return 0.0
    if algorithm == "dense":
        return 2 * (nodes - 1) / nodes * 4 * numel
    if algorithm == "topk":
        return ranks_per_node * (world - ranks_per_node) * message_bytes(k, torch.float32, numel)
    if algorithm == "gtopk":
        return float(max(_gtopk_cross_bytes(k, world, ranks_per_node, numel)))
    if algorithm == "hgtopk" and node_split in ("leader", "sparse"):
        return float(max(gtopk_bytes_sent(k, nodes, n, torch.float32, numel) for n in range(nodes)))
    if algorithm == "hgtopk" and node_split == "slices":  # R gTop-k of ~k/R pairs leave each node at once
        k_slice = -(-k // ranks_per_node)
        m_slice = -(-numel // ranks_per_node)
        return float(ranks_per_node * max(gtopk_bytes_sent(k_slice, nodes, n, torch.float32, m_slice)
                                          for n in range(nodes)))
    raise ValueError(f"unknown algorithm {algorithm!r}")
