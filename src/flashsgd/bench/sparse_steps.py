"""The timed sparse steps of `flashsgd bench sparse`, their time split, wire time and memory floor.

One step is the sparse DDP hook's own step for one bucket
(:func:`flashsgd.comm.sparse.hooks.sparse_hook` with a real
:class:`~flashsgd.comm.sparse.state.SparseHookState` from the hook registry, on the default
process group, past its dense iterations), so that a change to the hook reaches the benchmark.
Its phases are clocked through the state's clock (:class:`PhaseClock`, rank-local clocks, no
extra synchronization; the hook calls ``lap`` after each phase):

- ``accum``: ``acc = residual + grad`` into the state's spare buffer (the residual a step started
  from stays until the step is kept, :mod:`flashsgd.comm.hook_step`); with the ``threshold``
  selector on acc also the block maxima (:func:`~flashsgd.comm.sparse.fused.add_block_maxima`,
  fused by ``torch.compile`` in the ``compiled`` variant);
- ``select``: the rest of the selection (threshold, candidates, trim to k);
- ``exchange``: the communication: topk's all-gather with its scatter-add into the bucket;
  gTop-k's sends and waits; hgtopk's node step (``node_split``: the leader's reduce and broadcast,
  the slices' reduce-scatter and all-gather, or the node's gTop-k; with the copy into the bucket
  and the scatter of the result) and the gTop-k sends among the nodes;
- ``merge``: gTop-k's pairwise merges and counted-index tracking (taken out of ``exchange``);
- ``scatter``: the dense average written into the bucket and the residual's counted entries
  zeroed.

Wire time (:func:`wire_bytes_per_node`): the bytes through the busiest node link divided by the
link rate, the least time the network alone needs. Floor (:data:`FLOOR_PASSES`): the memory passes
a design cannot avoid, in units of one ``torch.add`` over the gradient (read 8m, write 4m bytes)
measured in the same run with every rank adding at once, so ranks sharing a core are included.

Example::

    >>> step = SparseStep("gtopk", bucket_buffer, density=0.001, selection="threshold")
    >>> bucket_buffer.copy_(grad); step()     # one bucket's step (the buffer becomes the average)
    >>> step.phases(skip=1)                   # phase medians (seconds) over the calls after the first
    >>> step_name("hgtopk", "slices")                   # the row of hgtopk with that node split
    'hgtopk node_split=slices'
"""

from __future__ import annotations

import statistics
import time

import torch

from flashsgd.comm.hooks import HOOKS
from flashsgd.comm.sparse import gtopk_bytes_sent, message_bytes
from flashsgd.comm.sparse.oktopk import capacities
from flashsgd.exchanges import EXCHANGES, option_default, reads

PHASES = ("accum", "select", "exchange", "merge", "scatter")
DEFAULT_NODE_SPLIT = option_default("node_split")


def step_name(algorithm: str, node_split: str | None = None) -> str:
    """Row name of a step: the algorithm, and for hgtopk its node split (``hgtopk node_split=slices``)."""
    if not reads(algorithm, "node_split"):
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
    # as topk: the bucket is zeroed, the result written, then divided by P
    ("oktopk", False): 8 / 3,
    ("oktopk", True): 2.0,
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


class PhaseClock:
    """The clock a sparse hook state carries for the benchmark (``state.clock``, the seam of
    :mod:`flashsgd.comm.sparse.hooks`): :meth:`start` opens a call, each ``lap(phase)`` of the
    hook adds the time since the previous lap to ``phase``; ``timings`` collects gTop-k's own
    split (``merge``, part of the ``exchange`` laps)."""

    __slots__ = ("calls", "timings", "last")

    def __init__(self) -> None:
        self.calls: list[tuple[dict[str, float], dict[str, float]]] = []  # (laps, timings) per call
        self.timings: dict[str, float] = {}
        self.last = 0.0

    def start(self) -> None:
        self.timings = {}
        self.calls.append(({}, self.timings))
        self.last = time.perf_counter()

    def lap(self, phase: str) -> None:
        now, laps = time.perf_counter(), self.calls[-1][0]
        laps[phase] = laps.get(phase, 0.0) + now - self.last
        self.last = now


class _Bucket:
    """One DDP gradient bucket as a hook sees it (torch's ``GradBucket`` interface, as
    :class:`~flashsgd.comm.hook_common.HostBucket` has it): ``buf``, the gradient of one parameter."""

    __slots__ = ("buf", "param")

    def __init__(self, buf: torch.Tensor, param: torch.nn.Parameter) -> None:
        self.buf, self.param = buf, param

    def buffer(self) -> torch.Tensor:
        return self.buf

    def index(self) -> int:
        return 0

    def is_last(self) -> bool:
        return True

    def parameters(self) -> list[torch.Tensor]:
        return [self.param]

    def gradients(self) -> list[torch.Tensor]:
        return [self.buf]


class SparseStep:
    """The hook ``algorithm`` (in :data:`~flashsgd.comm.sparse.hooks.SPARSE_EXCHANGES`) on the bucket ``buf`` with the given
    options (:class:`flashsgd.exchanges.SparseOptions`; hgtopk: ``ranks_per_node``, ``node_split``),
    a callable: each call overwrites ``buf`` with the average. ``state`` is the hook's, ``clock``
    its phases per call. Collective to build (hgtopk builds its node groups)."""

    __slots__ = ("state", "hook", "bucket", "clock")

    def __init__(self, algorithm: str, buf: torch.Tensor, density: float, *, selection: str,
                 compiled: bool = False, ranks_per_node: int | None = None,
                 node_split: str = DEFAULT_NODE_SPLIT) -> None:
        options = EXCHANGES[algorithm].options_from(density=density, selection=selection,
                                                    compiled=compiled, ranks_per_node=ranks_per_node,
                                                    node_split=node_split)
        param = torch.nn.Parameter(torch.empty(buf.numel(), dtype=buf.dtype), requires_grad=False)
        self.bucket = _Bucket(buf, param)
        # the state and hook as register_hook makes them (here for a module of one parameter)
        self.state, self.hook = HOOKS.get(algorithm)(torch.nn.ParameterList([param]), options)
        self.state.iter = options.start_iter  # past the dense iterations (there is no DDP rebuild)
        self.clock = self.state.clock = PhaseClock()

    def __call__(self) -> None:
        self.clock.start()
        self.hook(self.state, self.bucket)  # synchronous: returns a completed Future

    def phases(self, skip: int) -> dict[str, float]:
        """Median seconds of each phase in :data:`PHASES` over the calls after the first ``skip``."""
        calls = self.clock.calls[skip:] or self.clock.calls
        rows = [{**laps, "merge": t.get("merge", 0.0),
                 "exchange": laps.get("exchange", 0.0) - t.get("merge", 0.0)} for laps, t in calls]
        return {p: statistics.median(r.get(p, 0.0) for r in rows) for p in PHASES}


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
    if algorithm == "oktopk":  # (P-1) messages of c_send and of c_keep pairs; P-R of each leave the node
        c_send, c_keep = capacities(k, world)
        msgs = message_bytes(c_send, torch.float32, numel) + message_bytes(c_keep, torch.float32, numel)
        return float(ranks_per_node * (world - ranks_per_node) * msgs)
    if algorithm == "hgtopk" and node_split in ("leader", "sparse"):
        return float(max(gtopk_bytes_sent(k, nodes, n, torch.float32, numel) for n in range(nodes)))
    if algorithm == "hgtopk" and node_split == "slices":  # R gTop-k of ~k/R pairs leave each node at once
        k_slice = -(-k // ranks_per_node)
        m_slice = -(-numel // ranks_per_node)
        return float(ranks_per_node * max(gtopk_bytes_sent(k_slice, nodes, n, torch.float32, m_slice)
                                          for n in range(nodes)))
    raise ValueError(f"unknown algorithm {algorithm!r}")
