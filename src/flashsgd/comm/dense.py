"""Dense all-reduce over explicit groups: ``native``, ``ring``, ``hierarchical`` and ``torus2d``.

Every algorithm is a plain function ``fn(tensor, topology, op="sum", check=True) -> tensor`` that
reduces a contiguous floating tensor in place (any shape; it is treated as flat), registered ONCE
with its NCCL path (:func:`dense_algorithm`): one :class:`DenseAlgorithm` record per name in
:data:`DENSE` (its function, and its :class:`~flashsgd.comm.dense_native.NativeChain` or ``None``
for a Gloo-only algorithm), under the name of its :data:`flashsgd.exchanges.EXCHANGES` entry, which
the DDP hooks, the CLI and the simulator share. :data:`ALLREDUCE` is the same registration's
name -> function view. The hooks and ``flashsgd train`` refuse a Gloo-only algorithm for CUDA
buckets on NCCL (:func:`native_path`), before any backward.

All three flashsgd algorithms are built from two ring stages over an explicit list of ranks and its
process group (:func:`reduce_scatter` and :func:`all_gather`), so the hierarchical and 2D-Torus
variants reuse the flat ring on rows, columns and nodes:

* ``ring``: reduce-scatter + all-gather over all P ranks (Patarasuk & Yuan 2009, "Bandwidth optimal
  all-reduce algorithms for clusters of workstations").
* ``hierarchical``: reduce-scatter inside the node (L ranks), all-reduce of the 1/L shard across the
  N nodes (``cross`` group), all-gather inside the node (the three phases of Goyal et al. 2017,
  arXiv 1706.02677, with a ring instead of halving/doubling between nodes).
* ``torus2d``: reduce-scatter along the X direction (row), all-reduce of the 1/X shard along Y
  (column), all-gather along X (Mikami et al. 2018, arXiv 1811.05233), for any X * Y = P.

Chunking: a stage over P ranks splits n elements into P chunks ``[min(i c, n), min((i+1) c, n))``
with ``c = ceil(n / P)``; after the reduce-scatter the rank at position p of the ranks list owns
chunk p. This is exactly the split that NCCL's padded ``reduce_scatter_tensor`` produces, so the
shard a rank owns does not depend on the backend; the largest chunk is ceil(n/P) either way (the
step time of a ring is its largest chunk). Lengths < P leave some chunks empty: empty chunks are
neither sent nor received, and an empty tensor communicates nothing.

Backends: on NCCL (CUDA tensors on an NCCL group, :func:`native_stages`) ``ring``,
``hierarchical`` and ``torus2d`` are one chain of NCCL's own collectives (their records' chains) (reduce-scatter,
all-reduce of the shard, all-gather), issued asynchronously, in place, with the averaging folded
in (:func:`flashsgd.comm.dense_native.native_chain`, which states the copies and the overlap). The DDP hooks return its
Future (:func:`allreduce_future`); the direct calls (``torus2d(t, topo)``) wait for it, which on
CUDA makes the current stream wait and lets the host run on. On Gloo, whose reduce-scatter is an
all-reduce plus a slice (twice the traffic) and gives no Future, the stages are our own rings of
paired sends and receives (every rank posts its send to the right and its receive from the left
as one round, :func:`~flashsgd.comm.p2p.exchange`, before waiting, so no step can deadlock), run
synchronously (the hooks may hand them to a communication thread). A ring of 2 ranks sends and
receives on the same connection, which Gloo serves one direction at a time; so every 2-rank group
gets a twin (:func:`duplex_groups`) and each direction goes over its own connection. The chain
runs on Gloo too (each collective waited for with the deadline; the tests check it on CPU ranks),
but the algorithms do not use it there.

Precision: fp32, fp16 and bf16. Reduction happens in the tensor's dtype, as NCCL does: each ring
hop adds the received chunk into the local one (torch computes the add in fp32 and rounds to the
dtype once per hop), so a half-precision result carries up to P-1 roundings of partial sums, i.e.
a relative error of order (P-1) * eps_dtype * sum|x_i| / |sum x_i| (eps = 2^-11 for fp16, 2^-8 for
bf16). Upcasting chunks to fp32 would need fp32 on the wire (twice the bytes) to help. ``avg``
divides the sum by the world size once at the end (DDP's averaging); on NCCL each reducing stage
averages over its group instead (:func:`native_chain`: 1/X then 1/Y is 1/P).

Deadline: every send and receive of the rings waits at most ``topology.timeout_s`` (see
:func:`~flashsgd.comm.topology.get_topology`; the stage functions take ``timeout_s=``) and then
raises :class:`~flashsgd.comm.errors.PeerTimeout` naming this rank, the peer rank it waited for,
the algorithm and the step, e.g. "rank 0: no data from peer rank 1 within 10 s (ring all-reduce,
reduce-scatter step 2)". In a ring only the neighbour of a stopped rank waits on it directly; the
others time out waiting on a neighbour that is itself stuck, so the blamed peers form a chain
that ends at the stopped rank. On NCCL the native collectives are bounded by the groups' timeout
(the topology creates its subgroups with it) and NCCL's watchdog.

Safety: with ``check=True`` (the default for direct calls) every rank first all-gathers a 4-integer
descriptor (length, dtype, op, algorithm) on the world group, one tiny collective, and every rank
raises the same :class:`ValueError` when they differ, instead of hanging or mis-reducing. The DDP
hooks pass ``check=False``: DDP already guarantees identical buckets on every rank, and the extra
latency would be paid per bucket. Without the check, mismatched inputs are undefined (Gloo may
raise a size error or wait until the process-group timeout).

Example::

    >>> topo = get_topology(ranks_per_node=4, grid="2x4")          # on 8 ranks
    >>> t = torch.full((1000,), float(dist.get_rank() + 1))
    >>> DENSE["torus2d"].fn(t, topo)[0].item()                       # 1 + 2 + ... + 8
    36.0
"""

from __future__ import annotations

import datetime
from dataclasses import dataclass
from typing import Callable, Sequence

import torch
import torch.distributed as dist
from torch.distributed import ProcessGroup

from flashsgd.comm import topology as topology_module
from flashsgd.comm.topology import Topology, default_timeout_s, get_topology
from flashsgd.comm.dense_native import (NativeChain, all_gather_single, issue_collective, padded,
                                        stage_group)
from flashsgd.comm.p2p import exchange, gather_from_peers, grouped
from flashsgd.registry import Registry

AllReduceFn = Callable[..., torch.Tensor]


@dataclass(frozen=True)
class DenseAlgorithm:
    """One dense all-reduce algorithm: its function and its NCCL path, registered together
    (:func:`dense_algorithm`)."""

    name: str
    """Its :data:`flashsgd.exchanges.EXCHANGES` name (``--comm``, ``register_hook``)."""
    fn: AllReduceFn
    """``fn(tensor, topology, op="sum", check=True) -> tensor``, in place: what runs on Gloo (its
    own send/recv rings) and what a direct call runs on any backend."""
    native: NativeChain | None
    """What the DDP hook returns for CUDA buckets on NCCL (:func:`allreduce_future`); ``None``:
    Gloo-only, refused there at ``register_hook`` (:func:`native_path`)."""


DENSE: Registry[DenseAlgorithm] = Registry("all-reduce algorithm")
"""Every dense algorithm, one record each: everything that runs a dense algorithm by name reads it."""
ALLREDUCE: Registry[AllReduceFn] = Registry("all-reduce algorithm")
"""name -> ``DENSE[name].fn``, filled by the same registration (the benches' and probes' view)."""


def dense_algorithm(name: str, *, native: NativeChain | None) -> Callable[[AllReduceFn], AllReduceFn]:
    """Register the decorated function as dense algorithm ``name`` with its NCCL path, in
    :data:`DENSE` (and :data:`ALLREDUCE`). ``native`` must be stated: the chain its CUDA buckets
    run on NCCL, or ``None`` for a Gloo-only algorithm (refused on NCCL by :func:`native_path`).
    The name also needs its :data:`flashsgd.exchanges.EXCHANGES` entry (family ``dense``).

    Example::

        >>> @dense_algorithm("ring", native=NativeChain("world", None))
        ... def ring(tensor, topology=None, op="sum", check=True): ...
    """
    def register(fn: AllReduceFn) -> AllReduceFn:
        if native is not None and not isinstance(native, NativeChain):
            raise TypeError(f"dense algorithm {name!r}: native must be a NativeChain or None "
                            f"(Gloo-only), got {type(native).__name__}")
        DENSE.add(name, DenseAlgorithm(name, fn, native))
        ALLREDUCE.add(name, fn)
        return fn

    return register


def nccl_algorithms() -> list[str]:
    """The dense algorithms that run on NCCL (a native path in their record), in registration order."""
    return [name for name, algorithm in DENSE.items() if algorithm.native is not None]


def native_path(name: str, where: str) -> NativeChain:
    """The NCCL chain of dense algorithm ``name``, for a caller whose buckets are CUDA tensors on
    an NCCL group (``register_hook``, the plan of ``flashsgd train``, :func:`allreduce_future`).

    Raises:
        ValueError: ``name`` is Gloo-only (its record has ``native=None``); the message, prefixed
            with ``where``, names it and the algorithms that do run on NCCL.
    """
    native = DENSE.get(name).native
    if native is not None:
        return native
    raise ValueError(f"{where}: dense all-reduce {name!r} is Gloo-only (its record in "
                     f"flashsgd.comm.dense.DENSE has native=None: no NCCL chain), so it cannot reduce "
                     f"CUDA buckets on an NCCL group; algorithms that run on NCCL: "
                     f"{', '.join(nccl_algorithms())}; or run {name!r} on Gloo (CPU ranks, --backend gloo)")


DTYPES = {torch.float32: "float32", torch.float16: "float16", torch.bfloat16: "bfloat16"}
OPS = ("sum", "avg")


# ------------------------------------------------------------------------------ validation ------

def validate(tensor: torch.Tensor, op: str) -> torch.Tensor:
    """Check dtype, op and layout; return the flat view that the algorithms reduce in place."""
    if not isinstance(tensor, torch.Tensor):
        raise ValueError(f"tensor must be a torch.Tensor, got {type(tensor).__name__}")
    if tensor.dtype not in DTYPES:
        raise ValueError(f"tensor dtype {tensor.dtype} is not supported; valid dtypes: "
                         f"{', '.join(DTYPES.values())}")
    if op not in OPS:
        raise ValueError(f"op must be one of {', '.join(OPS)}, got {op!r}")
    if not tensor.is_contiguous():
        raise ValueError("tensor must be contiguous (the reduction is in place on its storage); "
                         "call .contiguous() and copy the result back")
    return tensor.view(-1)


def check_consistent(flat: torch.Tensor, op: str, algorithm: str,
                     timeout_s: float | None = None) -> None:
    """Raise the same ValueError on every rank if ranks disagree on length, dtype, op or algorithm.

    One all-gather of 4 int64 per rank on the world group: cost a * lgP-ish, negligible next to any
    real message, but paid per call, hence opt-out (``check=False``) on the hook hot path. On CPU
    it is a direct exchange (:func:`~flashsgd.comm.p2p.gather_from_peers`) whose waits last at
    most ``timeout_s`` (``None``: the default group's timeout) and name a missing rank.
    """
    world = dist.get_world_size()
    if world == 1:
        return
    names = DENSE.names()
    mine = torch.tensor([flat.numel(), list(DTYPES).index(flat.dtype), OPS.index(op),
                         names.index(algorithm) if algorithm in names else -1],
                        dtype=torch.int64, device=flat.device)
    if native_stages(flat):  # NCCL: its collective, bounded by the group's timeout
        every = torch.empty(world * 4, dtype=torch.int64, device=flat.device)
        all_gather_single(every, mine)
    else:
        timeout_s = default_timeout_s() if timeout_s is None else timeout_s
        every = gather_from_peers(mine, None, timeout_s, f"{algorithm} all-reduce, input check")
    rows = every.view(world, 4).tolist()  # (W, 4)
    if all(r == rows[0] for r in rows):
        return
    dtypes = list(DTYPES.values())
    described = "; ".join(
        f"rank {r}: {n} elements {dtypes[d]} op={OPS[o]} algorithm={names[a] if a >= 0 else '?'}"
        for r, (n, d, o, a) in enumerate(rows))
    raise ValueError("all-reduce inputs differ across ranks (every rank must pass the same length, "
                     f"dtype, op and algorithm): {described}")


def _prepare(tensor: torch.Tensor, op: str, check: bool, algorithm: str,
             topology: Topology | None) -> tuple[torch.Tensor, Topology]:
    flat = validate(tensor, op)
    if not dist.is_initialized():
        raise RuntimeError("all-reduce needs an initialized default process group "
                           "(torch.distributed.init_process_group, torchrun, or flashsgd.launch)")
    topo = topology if topology is not None else get_topology()
    if topo.world_size != dist.get_world_size():
        raise ValueError(f"topology describes {topo.world_size} ranks but the world size is "
                         f"{dist.get_world_size()}; build it with get_topology() in this process group")
    if check:
        check_consistent(flat, op, algorithm, topo.timeout_s)
    return flat, topo


def _finish(tensor: torch.Tensor, op: str, world: int) -> torch.Tensor:
    if op == "avg" and world > 1 and tensor.numel():
        tensor.div_(world)
    return tensor


# ------------------------------------------------------------------------------ ring stages -----

def chunk_bounds(n: int, parts: int) -> list[int]:
    """Boundaries of ``parts`` chunks of ``n`` elements: chunk i is ``[b[i], b[i+1])``.

    c = ceil(n / parts) elements per chunk, the last ones shorter or empty: the split of NCCL's
    reduce-scatter on an input padded to parts * c.
    """
    c = -(-n // parts)
    return [min(i * c, n) for i in range(parts + 1)]


def native_stages(flat: torch.Tensor, group: ProcessGroup | None = None) -> bool:
    """True for CUDA tensors on an NCCL group (also "cpu:gloo,cuda:nccl"): use NCCL's collectives
    (asynchronous on the stream, futures for every collective). Gloo carrying CUDA tensors (several
    ranks on one GPU) takes the Gloo path: its send/recv rings and the communication thread."""
    return grouped(flat, group)


def _exchange(send: torch.Tensor, dst: int, recv: torch.Tensor, src: int,
              groups: tuple[ProcessGroup, ProcessGroup], timeout_s: float, where: str) -> None:
    """One ring step: send ``send`` to ``dst`` and receive ``recv`` from ``src`` as one round
    (:func:`~flashsgd.comm.p2p.exchange`: issued together, then both waited for).

    ``groups`` = (send group, receive group), see :func:`_directions`; ``src``/``dst`` are
    positions in the ring, i.e. ranks of those groups (their global ranks are named if a wait
    passes ``timeout_s``). Cost: a + m b for an m-byte chunk.
    """
    exchange([(send, dst)], [(recv, src)], groups, timeout_s, where)


SEGMENT_BYTES = 1 << 20
"""Ring reduce steps move their chunk in segments of at most this many bytes, so that the add of
a received segment overlaps the transfer of the next ones (the pipelining of Gloo's and NCCL's own
rings); chunks up to this size go as one message (no extra latency for small messages)."""


def _exchange_add(send: torch.Tensor, dst: int, into: torch.Tensor, tmp: torch.Tensor, src: int,
                  groups: tuple[ProcessGroup, ProcessGroup], timeout_s: float, where: str) -> None:
    """One reduce step: send ``send`` to ``dst``; receive ``into.numel()`` values from ``src`` and
    add them into ``into``, segment by segment as they arrive (each wait at most ``timeout_s``).
    All segments of both directions are one round (:func:`~flashsgd.comm.p2p.exchange`)."""
    seg = max(1, SEGMENT_BYTES // max(1, into.element_size()))
    tmp = tmp[:into.numel()]
    starts = range(0, into.numel(), seg)

    def add(i: int) -> None:
        lo = starts[i]
        into[lo:lo + seg].add_(tmp[lo:lo + seg])  # reduction in the tensor's dtype

    exchange([(send[lo:lo + seg], dst) for lo in range(0, send.numel(), seg)],
             [(tmp[lo:lo + seg], src) for lo in starts], groups, timeout_s, where, on_recv=add)


def _directions(p: int, P: int, group: ProcessGroup, duplex: ProcessGroup | None
                ) -> tuple[ProcessGroup, ProcessGroup]:
    """(send group, receive group) of position p in a ring of P.

    With P = 2 both neighbours are the same peer, and Gloo moves the two directions of one
    connection one after the other (measured: a 32 MB exchange takes 2.1x a one-way send on one
    connection, 1.25x with the directions on two groups). Given a ``duplex`` group (same members,
    its own connections, :func:`duplex_groups`), position 0 sends on ``group`` and receives on
    ``duplex`` and position 1 the opposite, so each connection carries one direction.
    """
    if P != 2 or duplex is None:
        return group, group
    return (group, duplex) if p == 0 else (duplex, group)


_DUPLEX: dict[Topology, dict[str, ProcessGroup | None]] = {}
topology_module._RESET_HOOKS.append(_DUPLEX.clear)


def duplex_groups(topo: Topology) -> dict[str, ProcessGroup | None]:
    """A second process group for every 2-rank world/row/column/node/cross group (see
    :func:`_directions`), created once per topology, on every rank, in the same order; ``None``
    for kinds whose groups are not of 2 ranks, or on NCCL (its collectives need none).

    Collective on first call: every rank must reach it (the algorithms call it before any data
    moves; the hooks call it at registration).
    """
    if topo in _DUPLEX:
        return _DUPLEX[topo]
    W, L, (X, _) = topo.world_size, topo.ranks_per_node, topo.grid
    layouts = {  # kind -> every group of that kind (the layout of flashsgd.comm.topology)
        "world": [tuple(range(W))],
        "row": [tuple(range(y, y + X)) for y in range(0, W, X)],
        "col": [tuple(range(x, W, X)) for x in range(X)],
        "node": [tuple(range(n, n + L)) for n in range(0, W, L)],
        "cross": [tuple(range(l, W, L)) for l in range(L)],
    }
    mine = {"world": tuple(range(W)), "row": topo.row_ranks, "col": topo.col_ranks,
            "node": topo.node_ranks, "cross": topo.cross_ranks}
    made: dict[tuple[int, ...], ProcessGroup] = {}
    out: dict[str, ProcessGroup | None] = {}
    nccl = "nccl" in str(dist.get_backend())
    for kind, groups in layouts.items():
        out[kind] = None
        if len(groups[0]) != 2 or nccl:
            continue
        for members in groups:
            if members not in made:
                made[members] = dist.new_group(list(members),
                                               timeout=datetime.timedelta(seconds=topo.timeout_s))
        out[kind] = made[tuple(mine[kind])]
    _DUPLEX[topo] = out
    return out


def reduce_scatter(flat: torch.Tensor, ranks: Sequence[int], group: ProcessGroup | None,
                   duplex: ProcessGroup | None = None, *, timeout_s: float | None = None,
                   where: str = "ring") -> tuple[int, int]:
    """Ring reduce-scatter of ``flat`` over ``ranks``; returns the ``[lo, hi)`` shard this rank owns.

    Patarasuk & Yuan 2009. After the call ``flat[lo:hi]`` holds the sum over ``ranks``; the rest of
    ``flat`` holds partial sums (overwritten by :func:`all_gather`). Cost over P ranks:
    (P-1) a + (P-1)/P n b + (P-1)/P n g.

    1. Split ``flat`` into P chunks (:func:`chunk_bounds`); position p will own chunk p.
    2. For s = 0 .. P-2: send chunk (p-s-1) mod P to the right neighbour, receive chunk (p-s-2) mod
       P from the left one and add it into the local copy (it is sent on at step s+1).

    Each wait on a neighbour lasts at most ``timeout_s`` seconds (``None``: the default process
    group's timeout), then raises :class:`~flashsgd.comm.errors.PeerTimeout` naming it and
    ``where`` (the caller's description, e.g. ``"torus2d all-reduce, row"``) with the step.
    """
    P = len(ranks)
    if P == 1 or group is None:
        return 0, flat.numel()
    p = ranks.index(dist.get_rank())
    n = flat.numel()
    # Step 1
    b = chunk_bounds(n, P)
    if n == 0:
        return 0, 0
    timeout_s = default_timeout_s() if timeout_s is None else timeout_s
    if native_stages(flat, group):  # NCCL's, in place (a copy in and out only if P does not divide n)
        work, c = padded(flat, P)
        issue_collective("reduce-scatter", work[p * c:(p + 1) * c], work, group, "sum", timeout_s, where).wait()
        if work is not flat:
            flat[b[p]:b[p + 1]].copy_(work[b[p]:b[p + 1]])
        return b[p], b[p + 1]
    # Step 2: (P-1) steps, each moving one chunk of <= n/P elements per rank.
    right, left = (p + 1) % P, (p - 1) % P
    groups = _directions(p, P, group, duplex)
    tmp = flat.new_empty(b[1])
    for s in range(P - 1):
        k_send, k_recv = (p - s - 1) % P, (p - s - 2) % P
        _exchange_add(flat[b[k_send]:b[k_send + 1]], right, flat[b[k_recv]:b[k_recv + 1]], tmp, left,
                      groups, timeout_s, f"{where}, reduce-scatter step {s}")
    return b[p], b[p + 1]


def all_gather(flat: torch.Tensor, ranks: Sequence[int], group: ProcessGroup | None,
               duplex: ProcessGroup | None = None, *, timeout_s: float | None = None,
               where: str = "ring") -> None:
    """Ring all-gather: position p contributes chunk p of ``flat``; afterwards all of ``flat`` is filled.

    The inverse stage of :func:`reduce_scatter`. Cost over P ranks: (P-1) a + (P-1)/P n b.

    1. Split ``flat`` into the same P chunks as :func:`reduce_scatter`.
    2. For s = 0 .. P-2: send chunk (p-s) mod P to the right neighbour and receive chunk (p-s-1)
       mod P from the left one directly into place.

    Deadline and ``where`` as in :func:`reduce_scatter`.
    """
    P = len(ranks)
    n = flat.numel()
    if P == 1 or group is None or n == 0:
        return
    p = ranks.index(dist.get_rank())
    # Step 1
    b = chunk_bounds(n, P)
    timeout_s = default_timeout_s() if timeout_s is None else timeout_s
    if native_stages(flat, group):  # NCCL's, in place (through one padded copy if P does not divide n)
        work, c = padded(flat, P)
        issue_collective("all-gather", work[p * c:(p + 1) * c], work, group, "sum", timeout_s, where).wait()
        if work is not flat:
            flat.copy_(work[:n])
        return
    # Step 2
    right, left = (p + 1) % P, (p - 1) % P
    groups = _directions(p, P, group, duplex)
    for s in range(P - 1):
        k_send, k_recv = (p - s) % P, (p - s - 1) % P
        _exchange(flat[b[k_send]:b[k_send + 1]], right, flat[b[k_recv]:b[k_recv + 1]], left, groups,
                  timeout_s, f"{where}, all-gather step {s}")


def ring_allreduce(flat: torch.Tensor, ranks: Sequence[int], group: ProcessGroup | None,
                   duplex: ProcessGroup | None = None, *, timeout_s: float | None = None,
                   where: str = "ring") -> None:
    """Sum ``flat`` over ``ranks`` in place: :func:`reduce_scatter` then :func:`all_gather`.

    Cost: 2(P-1) a + 2(P-1)/P n b + (P-1)/P n g (bandwidth-optimal). On NCCL a single native
    ``all_reduce`` on the group. Deadline and ``where`` as in :func:`reduce_scatter`.
    """
    if len(ranks) == 1 or group is None or flat.numel() == 0:
        return
    if native_stages(flat, group):
        timeout_s = default_timeout_s() if timeout_s is None else timeout_s
        issue_collective("all-reduce", flat, flat, group, "sum", timeout_s, where).wait()
        return
    reduce_scatter(flat, ranks, group, duplex, timeout_s=timeout_s, where=where)
    all_gather(flat, ranks, group, duplex, timeout_s=timeout_s, where=where)


def allreduce_future(tensor: torch.Tensor, algorithm: str, topology: Topology,
                     op: str = "sum") -> torch.futures.Future:
    """``algorithm``'s NCCL chain (``DENSE[algorithm].native``,
    :func:`~flashsgd.comm.dense_native.native_chain`) over ``topology``'s groups: a Future of
    ``tensor`` reduced in place. ValueError for a Gloo-only algorithm (:func:`native_path`).

    What the DDP hooks return on NCCL, and what the algorithms wait for there. No input check
    (``check=False``: the caller guarantees identical inputs on every rank).

    Example::

        >>> fut = allreduce_future(bucket, "torus2d", get_topology(grid="2x4"), op="avg")
    """
    validate(tensor, op)
    chain = native_path(algorithm, f"{algorithm} all-reduce of a CUDA tensor on NCCL")
    return chain.future(tensor, topology, op, where=f"{algorithm} all-reduce")


# ------------------------------------------------------------------------------ algorithms ------

@dense_algorithm("native", native=NativeChain(None, "world"))
def native(tensor: torch.Tensor, topology: Topology | None = None, op: str = "sum",
           check: bool = True) -> torch.Tensor:
    """``torch.distributed.all_reduce`` on the world group: the baseline (NCCL's or Gloo's own choice).

    Args:
        tensor: contiguous fp32/fp16/bf16 tensor, reduced in place.
        topology: unused except for validation (``None`` is fine).
        op: ``"sum"`` or ``"avg"`` (sum, then divide by the world size).
        check: verify that all ranks pass the same length/dtype/op first (one tiny all-gather).

    Example::

        >>> native(torch.ones(3), op="avg")  # tensor([1., 1., 1.]) on every rank
    """
    flat, _ = _prepare(tensor, op, check, "native", topology)
    if flat.numel():  # Gloo rejects 0-element all-reduce
        dist.all_reduce(flat)
    return _finish(tensor, op, dist.get_world_size())


@dense_algorithm("ring", native=NativeChain("world", None))
def ring(tensor: torch.Tensor, topology: Topology | None = None, op: str = "sum",
         check: bool = True) -> torch.Tensor:
    """Flat ring all-reduce over all P ranks (Patarasuk & Yuan 2009).

    Cost: 2(P-1) a + 2(P-1)/P n b + (P-1)/P n g: the bandwidth term is optimal, the 2(P-1) latency
    steps are what hierarchical and torus2d cut.

    1. Ring reduce-scatter over the world: rank p ends with the sum of chunk p.
    2. Ring all-gather over the world.

    Args:
        tensor: contiguous fp32/fp16/bf16 tensor, reduced in place.
        topology: the :class:`Topology` (``None``: :func:`get_topology` defaults).
        op: ``"sum"`` or ``"avg"``.
        check: verify identical length/dtype/op on all ranks first.

    Example::

        >>> ring(torch.full((5,), float(dist.get_rank() + 1)), topo)  # 4 ranks: all 10.0
    """
    flat, topo = _prepare(tensor, op, check, "ring", topology)
    if native_stages(flat):  # NCCL: Steps 1-2 as one chain of native collectives
        return allreduce_future(tensor, "ring", topo, op).wait()
    world = list(range(topo.world_size))
    group = stage_group(topo, "world")
    # Step 1
    duplex = duplex_groups(topo)["world"]
    reduce_scatter(flat, world, group, duplex, timeout_s=topo.timeout_s, where="ring all-reduce")
    # Step 2
    all_gather(flat, world, group, duplex, timeout_s=topo.timeout_s, where="ring all-reduce")
    return _finish(tensor, op, topo.world_size)


@dense_algorithm("hierarchical", native=NativeChain("node", "cross"))
def hierarchical(tensor: torch.Tensor, topology: Topology | None = None, op: str = "sum",
                 check: bool = True) -> torch.Tensor:
    """Three-phase all-reduce: inside the node, across nodes on a 1/L shard, inside the node.

    Goyal et al. 2017 (arXiv 1706.02677, section 4: intra-server reduce, inter-server all-reduce,
    intra-server broadcast), here with bandwidth-optimal rings in every phase. L ranks per node,
    N = P / L nodes; only n/L bytes per rank cross the node boundary.
    Cost: 2(L-1) a_intra + 2(L-1)/L n b_intra + 2(N-1) a_inter + 2(N-1)/(N L) n b_inter + (P-1)/P n g.

    1. Reduce-scatter inside the node: local rank l owns the node's sum of shard l (n/L elements).
    2. All-reduce shard l across the N nodes (the ``cross`` group of ranks with local rank l);
       the L cross groups run concurrently.
    3. All-gather inside the node.

    Args:
        tensor: contiguous fp32/fp16/bf16 tensor, reduced in place.
        topology: the :class:`Topology`; ``ranks_per_node`` sets L.
        op: ``"sum"`` or ``"avg"``.
        check: verify identical length/dtype/op on all ranks first.

    Example::

        >>> hierarchical(t, get_topology(ranks_per_node=4))  # 8 ranks = 2 nodes x 4
    """
    flat, topo = _prepare(tensor, op, check, "hierarchical", topology)
    if native_stages(flat):  # NCCL: Steps 1-3 as one chain of native collectives
        return allreduce_future(tensor, "hierarchical", topo, op).wait()
    _two_level(flat, topo, "hierarchical")  # Steps 1-3
    return _finish(tensor, op, topo.world_size)


@dense_algorithm("torus2d", native=NativeChain("row", "col"))
def torus2d(tensor: torch.Tensor, topology: Topology | None = None, op: str = "sum",
            check: bool = True) -> torch.Tensor:
    """Sony's 2D-Torus all-reduce on an X x Y grid (Mikami et al. 2018, arXiv 1811.05233).

    Rows are X consecutive ranks (the horizontal direction), columns the Y ranks sharing a
    position in their row. Latency steps 2(X-1) + 2(Y-1) instead of the ring's 2(XY-1); the same
    bandwidth term as the ring when the links are equal.
    Cost: 2(X-1) a_x + 2(Y-1) a_y + 2(X-1)/X n b_x + 2(Y-1)/(XY) n b_y + (P-1)/P n g.

    1. Reduce-scatter along the row: position x owns the row's sum of shard x (n/X elements).
    2. All-reduce shard x along the column (Y ranks); the X columns run concurrently.
    3. All-gather along the row.

    Args:
        tensor: contiguous fp32/fp16/bf16 tensor, reduced in place.
        topology: the :class:`Topology`; its ``grid`` (X, Y) is used (any X * Y = P, incl. 1xP, Px1).
        op: ``"sum"`` or ``"avg"``.
        check: verify identical length/dtype/op on all ranks first.

    Example::

        >>> torus2d(t, get_topology(grid="2x4"))  # 8 ranks: rows of 2, columns of 4
    """
    flat, topo = _prepare(tensor, op, check, "torus2d", topology)
    if native_stages(flat):  # NCCL: Steps 1-3 as one chain of native collectives
        return allreduce_future(tensor, "torus2d", topo, op).wait()
    _two_level(flat, topo, "torus2d")  # Steps 1-3
    return _finish(tensor, op, topo.world_size)


def _two_level(flat: torch.Tensor, topo: Topology, algorithm: str) -> None:
    """The three stages shared by hierarchical (node/cross) and torus2d (row/col), in place
    (the group kinds: the algorithm's NCCL chain in :data:`DENSE`, the same stages natively).

    Step 1: ring reduce-scatter over the ``inner`` group: this rank owns its group's sum of one
    1/|inner| shard. Step 2: ring all-reduce of that shard over the ``outer`` group (the |inner|
    outer groups run concurrently). Step 3: ring all-gather over the ``inner`` group.
    """
    duplex, timeout_s = duplex_groups(topo), topo.timeout_s
    chain = DENSE.get(algorithm).native
    inner, outer = chain.inner, chain.outer
    inner_ranks, inner_group = getattr(topo, f"{inner}_ranks"), getattr(topo, f"{inner}_group")
    outer_ranks, outer_group = getattr(topo, f"{outer}_ranks"), getattr(topo, f"{outer}_group")
    # Step 1
    lo, hi = reduce_scatter(flat, inner_ranks, inner_group, duplex[inner], timeout_s=timeout_s,
                            where=f"{algorithm} all-reduce, {inner} stage")
    # Step 2
    ring_allreduce(flat[lo:hi], outer_ranks, outer_group, duplex[outer], timeout_s=timeout_s,
                   where=f"{algorithm} all-reduce, {outer} stage")
    # Step 3
    all_gather(flat, inner_ranks, inner_group, duplex[inner], timeout_s=timeout_s,
               where=f"{algorithm} all-reduce, {inner} stage")


def allreduce(tensor: torch.Tensor, algorithm: str = "ring", topology: Topology | None = None,
              op: str = "sum", check: bool = True) -> torch.Tensor:
    """Reduce ``tensor`` in place with the algorithm registered as ``algorithm`` (see DENSE)."""
    return DENSE.get(algorithm).fn(tensor, topology, op=op, check=check)
