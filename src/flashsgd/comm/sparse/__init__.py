"""Sparsified gradient exchange: top-k selection, Top-k all-gather, the gTop-k merge tree, residuals.

Paper: Shi et al. 2019, "A Distributed Synchronous SGD Algorithm with Global Top-k Sparsification
for Low Bandwidth Networks" (arXiv 1901.04359).

Each rank keeps only the ``k = ceil(density * m)`` largest-magnitude entries of its (error-fed)
gradient of ``m`` elements and exchanges them as (value, index) pairs:

- ``topk`` (Top-k S-SGD): all-gather every rank's k pairs and scatter-add them; O(kP) volume.
- ``gtopk``: log2(P) butterfly rounds; in round i, rank r swaps its current k pairs with
  ``r XOR 2^i`` and both keep the k largest |sum| of the union (:func:`merge_topk`), so after the
  last round every rank holds the same k pairs, the global top-k of the merge tree; O(k log P).

Error feedback (the invariant every exchange here keeps, tested in tests/test_sparse.py)::

    acc_r      = grad_r + residual_r                      (accumulated local gradient)
    residual_r = acc_r with the entries in counted_r zeroed
    sum_r acc_r == dense(global values) + sum_r residual_r      (exact in exact arithmetic)

where ``counted_r`` are the local indices whose values are included in the global values. For
``topk`` that is every local pick. For ``gtopk`` it is the local picks that survived *every* merge
on the path from rank r to the root: a value dropped in round i is put back into the residual even
if its index re-enters the result from another subtree later (then the global value at that index
holds only the other subtree's mass), which is the precise form of "what was not sent locally plus
local values that did not survive the global selection".

Wire format: one message of words of the index dtype, int32 wherever the bucket fits
(``numel < 2**31``, :func:`wire_index_dtype`; else int64): k indices, then the values bit-cast
into the same words (never converted to float32, which would corrupt indices >= 2^24). fp32 pairs
take 8 bytes (4 + 4). The merges work on int64 indices; only the message is narrower.

Deadline: every wait on a peer (the all-gather's messages, the butterfly's swaps, the size check) lasts at most ``timeout_s`` seconds (``None``:
the default process group's timeout) and then raises :class:`~flashsgd.comm.errors.PeerTimeout`
naming the peer rank. Selection (exact and sampled-threshold top-k) and
the density schedule are in :mod:`flashsgd.comm.sparse.select`, re-exported here.

Example::

    >>> x = torch.tensor([0.1, -3.0, 2.0, 0.5])
    >>> topk_exact(x, 2)
    (tensor([-3.,  2.]), tensor([1, 2]))
"""

from __future__ import annotations

import math
import time
from typing import NamedTuple

import torch
import torch.distributed as dist
from torch.distributed import ProcessGroup

from flashsgd.comm.p2p import exchange, gather_from_peers
from flashsgd.comm.topology import default_timeout_s
from flashsgd.exchanges import INT32_NUMEL, wire_index_bytes  # noqa: F401 (INT32_NUMEL re-exported)
from flashsgd.host_syncs import device_path

# selection and density live in sparse_select; re-exported here (one import site for callers)
from flashsgd.comm.sparse.select import (DEFAULT_DENSITY, SELECTIONS,  # noqa: F401
                                         SelectionWorkspace, density_at,
                                         k_from_density, topk_exact, topk_sampled,
                                         validate_density)


# ------------------------------------------------------------------------------- merge ----------

def merge_topk(va: torch.Tensor, ia: torch.Tensor, vb: torch.Tensor, ib: torch.Tensor,
               k: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Sum two sparse vectors and keep the k entries of largest |sum|; ties go to the lower index.

    Inputs: values and int64 indices, each side sorted by index with distinct indices (the
    canonical form). Output in the same form, always k pairs (the union of two k-sets has at
    least k indices). Algorithm:
        1. Merge positions by binary search: a_i goes to slot i + #{b < a_i}, b_j to
           j + #{a < b_j}; an index present on both sides lands in one slot (i + j), where the two
           values are added; the slots left empty (one per common index) are the last ones and
           are marked with index -1 and magnitude -1.
        2. Keep the k slots first in (|sum| descending, slot ascending): a stable descending sort
           of the 2k magnitudes; the slots are in index order, so ties go to the lower index.
    Every size is k or 2k, fixed before any value is known: no host synchronization on CUDA
    (a data-dependent size, a boolean mask or ``nonzero`` would read the device). The result does
    not depend on the order of the two sides (a common index's sum has exactly two terms, and
    IEEE addition is commutative), so the two ranks of a butterfly pair get bit-identical results.
    Cost: one O(k log k) binary search and one O(k log k) sort of 2k magnitudes, then O(k) passes.
    """
    val, idx, _, _, keep = _merge_slots(va, ia, vb, ib, k)
    return val[keep], idx[keep]


def _slots_of_b(ia: torch.Tensor, ib: torch.Tensor, below: torch.Tensor) -> torch.Tensor:
    """Slot j + #{a < b_j} of every b_j, from ``below`` = #{b < a_i} (one binary search, not two):
    a_i <= b_j iff below_i <= j, so #{a <= b_j} = cumsum of the counts of ``below`` at j, minus
    one when b_j is also in a (then a_i == b_{below_i}). Fixed sizes only (scatter-adds, no
    ``bincount``, whose output size is read from the data)."""
    nb = ib.numel()
    ones = torch.ones_like(below)
    at_or_below = torch.zeros(nb + 1, dtype=torch.int64, device=ib.device).scatter_add_(0, below, ones)
    at_or_below = at_or_below[:nb].cumsum(0)                                # #{a <= b_j}
    at = below.clamp(max=nb - 1)
    same = (below < nb) & (ib[at] == ia)                                    # a_i == b_{below_i}
    common = torch.zeros(nb, dtype=torch.int64, device=ib.device).index_put_((at,), same.long(),
                                                                              accumulate=True)
    return torch.arange(nb, device=ib.device) + at_or_below - common


def _merge_slots(va: torch.Tensor, ia: torch.Tensor, vb: torch.Tensor, ib: torch.Tensor, k: int):
    """:func:`merge_topk`'s steps on the slots: ``(slot values, slot indices, slots of a, slots
    of b, kept slots)``, the kept slots ascending (k of them); the result is
    ``values[kept], indices[kept]``."""
    na, nb = ia.numel(), ib.numel()
    # Step 1
    below = torch.searchsorted(ib, ia)   # #{b < a_i}
    pa = torch.arange(na, device=ia.device) + below
    pb = _slots_of_b(ia, ib, below)
    slots = na + nb
    idx = torch.full((slots,), -1, dtype=torch.int64, device=ia.device)
    idx[pa] = ia
    idx[pb] = ib
    val = torch.zeros(slots, dtype=va.dtype, device=va.device)
    val.index_put_((pa,), va)
    val.index_put_((pb,), vb, accumulate=True)
    # Step 2: empty slots (index -1) below every filled one; stable: equal magnitudes by slot
    mag = val.abs().masked_fill_(idx < 0, -1)
    order = torch.sort(mag, descending=True, stable=True).indices[:k]
    return val, idx, pa, pb, order.sort().values


def _carry(mask: torch.Tensor, slots_of_side: torch.Tensor, keep: torch.Tensor) -> torch.Tensor:
    """A mask over one side's pairs, moved onto the merge result (False where the other side's
    pair alone sits); ``keep``: the kept slots. O(k), no search, fixed size."""
    out = torch.zeros(2 * slots_of_side.numel(), dtype=torch.bool, device=keep.device)
    out[slots_of_side] = mask
    return out[keep]


def _counted(mine: torch.Tensor, kept: torch.Tensor) -> torch.Tensor:
    """The entries of sorted ``mine`` that are also in sorted ``kept`` (binary search, O(k log k))."""
    if mine.numel() == 0 or kept.numel() == 0:
        return mine[:0]
    return mine[found_in(mine, kept)]


def found_in(x: torch.Tensor, sorted_keys: torch.Tensor, alive: torch.Tensor | None = None) -> torch.Tensor:
    """(len(x),) bool: which entries of ``x`` are in the ascending, distinct ``sorted_keys`` (and
    ``alive`` there, when given); binary search, fixed size (``torch.isin`` reads sizes on CUDA)."""
    if x.numel() == 0 or sorted_keys.numel() == 0:
        return torch.zeros(x.numel(), dtype=torch.bool, device=x.device)
    pos = torch.searchsorted(sorted_keys, x).clamp_(max=sorted_keys.numel() - 1)
    hit = sorted_keys[pos] == x
    return hit & alive[pos] if alive is not None else hit


class Counted(NamedTuple):
    """This rank's local entries that an exchange's result includes (the error-feedback set), in a
    size fixed before the exchange: ``positions[survived]``. Zeroing them with :meth:`zero_` never
    reads how many there are (no host synchronization on CUDA); :meth:`indices` does."""

    positions: torch.Tensor  # (k,) int64 indices into the bucket (a position not survived may repeat)
    survived: torch.Tensor   # (k,) bool

    @staticmethod
    def every(indices: torch.Tensor) -> "Counted":
        """All of ``indices`` counted (Top-k's local picks, a single rank's result)."""
        return Counted(indices, torch.ones(indices.numel(), dtype=torch.bool, device=indices.device))

    def indices(self) -> torch.Tensor:
        """The counted indices, ascending when ``positions`` is (a data-dependent size: a host sync on CUDA)."""
        return self.positions[self.survived]

    def zero_(self, t: torch.Tensor) -> torch.Tensor:
        """``t`` with the counted entries set to 0, in place (an accumulating scatter of ``-t`` at the
        survived positions and ``-0`` elsewhere: exact, and right where a not-survived position
        repeats a survived one). ``t`` must be finite there (a hook's acc is). Returns ``t``."""
        if self.positions.numel():
            t.index_put_((self.positions,), -t[self.positions] * self.survived, accumulate=True)
        return t


def _canonical(values: torch.Tensor, indices: torch.Tensor, k: int, numel: int, check: bool = True
               ) -> tuple[torch.Tensor, torch.Tensor]:
    """Validate one rank's k pairs and sort them by index. ``check=False`` (the hooks, whose own
    selection gives distinct indices in range): the shapes only, and on CUDA the pairs are sorted
    without first reading whether they already are (each read of a device value is a host sync)."""
    if values.dim() != 1 or indices.dim() != 1 or values.numel() != indices.numel():
        raise ValueError(f"values and indices must be flat and of equal length, got "
                         f"{tuple(values.shape)} and {tuple(indices.shape)}")
    if not values.is_floating_point():
        raise ValueError(f"values must be floating point, got {values.dtype}")
    if isinstance(k, bool) or not isinstance(k, int) or not 1 <= k <= numel:
        raise ValueError(f"k must be an integer in [1, numel={numel}], got {k!r}")
    if values.numel() != k:
        raise ValueError(f"expected k={k} (value, index) pairs, got {values.numel()}")
    indices = indices.to(torch.int64)
    unread = device_path(indices) and not check  # sort blind: an ascending input keeps its order
    if k > 1 and (unread or not bool((indices[1:] > indices[:-1]).all())):  # sort, O(k log k)
        order = indices.argsort()
        indices, values = indices[order], values[order]
        if check and bool((indices[1:] == indices[:-1]).any()):
            raise ValueError("indices must be distinct")
    if check and (indices[0] < 0 or indices[-1] >= numel):
        raise ValueError(f"indices must lie in [0, numel={numel}), got range "
                         f"[{int(indices[0])}, {int(indices[-1])}]")
    return values, indices


class GTopk(NamedTuple):
    """Result of :func:`gtopk_allreduce` / :func:`gtopk_reference` (identical on every rank but
    ``mine``)."""

    values: torch.Tensor   # (k,) summed values of the global top-k
    indices: torch.Tensor  # (k,) int64 indices, ascending
    mine: Counted          # this rank's local indices whose values are inside ``values``

    @property
    def counted(self) -> torch.Tensor:
        """``mine`` as a tensor of indices (a data-dependent size: a host sync on CUDA)."""
        return self.mine.indices()


def gtopk_reference(values: list[torch.Tensor], indices: list[torch.Tensor], k: int, numel: int
                    ) -> tuple[GTopk, list[torch.Tensor]]:
    """Single-process gTop-k over P ranks' pairs with the merge tree of :func:`gtopk_allreduce`.

    Returns ``(result, counted)``: the global result (``result.counted`` is rank 0's) and each
    rank's counted local indices, for testing the distributed version bit for bit.
    """
    world = len(values)
    pairs = [_canonical(v, i, k, numel) for v, i in zip(values, indices)]
    # nodes: (values, indices, {rank: that rank's local indices still counted in this node})
    nodes = [(v, i, {r: i}) for r, (v, i) in enumerate(pairs)]
    p2 = 1 << (world.bit_length() - 1)

    def join(a, b):
        v, i = merge_topk(a[0], a[1], b[0], b[1], k)
        alive = {r: _counted(c, i) for r, c in (a[2] | b[2]).items()}
        return v, i, alive

    # fold-in: node r takes rank r + p2; then pairs of consecutive nodes, level by level
    level = [join(nodes[r], nodes[r + p2]) if r + p2 < world else nodes[r] for r in range(p2)]
    while len(level) > 1:
        level = [join(level[j], level[j + 1]) for j in range(0, len(level), 2)]
    v, i, alive = level[0]
    counted = [alive[r] for r in range(world)]
    return GTopk(v, i, Counted.every(counted[0])), counted


# ------------------------------------------------------------------------- messages -------------

def wire_index_dtype(numel: int) -> torch.dtype:
    """The dtype of indices (and words) on the wire for a bucket of ``numel`` elements: int32 when
    ``numel < 2**31`` (4 bytes per index instead of 8), else int64
    (:func:`flashsgd.exchanges.wire_index_bytes`, the catalog's wire format)."""
    return {4: torch.int32, 8: torch.int64}[wire_index_bytes(numel)]


def _pack(values: torch.Tensor, indices: torch.Tensor, numel: int,
          extra: torch.Tensor | None = None) -> torch.Tensor:
    """One message in words of :func:`wire_index_dtype` (numel): k indices, then the values' bytes
    bit-cast (and optional uint8 bytes), each part padded to whole words."""
    word = wire_index_dtype(numel)
    parts = [indices.to(word), bytes_as_words(values.contiguous().view(torch.uint8), word)]
    if extra is not None:
        parts.append(bytes_as_words(extra, word))
    return torch.cat(parts)


def bytes_as_words(b: torch.Tensor, word: torch.dtype) -> torch.Tensor:
    """uint8 bytes viewed as words of ``word`` (int32 or int64), zero-padded to a whole word."""
    size = word.itemsize
    pad = (-b.numel()) % size
    if pad:
        b = torch.cat([b, b.new_zeros(pad)])
    return b.view(word)


def _message_len(k: int, dtype: torch.dtype, numel: int, extra_bytes: int = 0) -> int:
    """Words of a message: k indices + ceil(k * itemsize / w) + ceil(extra / w), w = word bytes."""
    item = dtype.itemsize
    w = wire_index_dtype(numel).itemsize
    return k + math.ceil(k * item / w) + math.ceil(extra_bytes / w)


def _unpack(msg: torch.Tensor, k: int, dtype: torch.dtype, extra_bytes: int = 0):
    """(values, int64 indices[, extra bytes]) of a :func:`_pack` message (views where possible)."""
    item, w = dtype.itemsize, msg.element_size()
    nv = math.ceil(k * item / w)
    indices = msg[:k].to(torch.int64)
    raw = msg[k:k + nv].view(torch.uint8)[:k * item]
    # a value wider than a word (float64 after int32 indices) may start off its alignment
    values = (raw if raw.storage_offset() % item == 0 else raw.clone()).view(dtype)
    if not extra_bytes:
        return values, indices
    return values, indices, msg[k + nv:].view(torch.uint8)[:extra_bytes]


def message_bytes(k: int, dtype: torch.dtype = torch.float32, numel: int = 1) -> int:
    """Bytes of one rank's k (value, index) pairs on the wire for a bucket of ``numel`` elements
    (the default: any bucket under 2**31): w k + itemsize k padded to words of w = 4 (int32
    indices) or 8 bytes; 8 k for fp32 under 2**31 elements."""
    w = wire_index_dtype(numel).itemsize
    return w * _message_len(k, dtype, numel)


# --------------------------------------------------------------------------- exchanges ----------

def group_info(group: ProcessGroup | None) -> tuple[int, int]:
    if not dist.is_initialized():
        return 0, 1
    return dist.get_rank(group), dist.get_world_size(group)


def _timeout(timeout_s: float | None) -> float:
    return default_timeout_s() if timeout_s is None else timeout_s


def check_sizes(k: int, numel: int, n_pairs: int, group: ProcessGroup | None, what: str,
                timeout_s: float | None = None, device: torch.device | None = None) -> None:
    """Raise the same ValueError on every rank unless all ranks pass the same k, numel and #pairs.

    One exchange of 3 int64 per rank (:func:`~flashsgd.comm.p2p.gather_from_peers`, one alpha):
    mismatched sizes would otherwise make the send/recv of the exchange hang or fail with an
    opaque transport error. Each wait lasts at most ``timeout_s`` (``None``: the group's default);
    the header is made on ``device`` (the data's: NCCL needs it on the GPU).
    """
    rank, world = group_info(group)
    if world == 1:
        return
    header = torch.tensor([k, numel, n_pairs], dtype=torch.int64, device=device)
    rows = gather_from_peers(header, group, _timeout(timeout_s), f"{what}, size check").tolist()
    if any(row != rows[0] for row in rows):
        desc = ", ".join(f"rank {r}: k={a}, numel={b}, pairs={c}" for r, (a, b, c) in enumerate(rows))
        raise ValueError(f"{what}: mismatched lengths across ranks ({desc}); every rank must pass "
                         "the same k and numel")


def topk_allgather(values: torch.Tensor, indices: torch.Tensor, numel: int,
                   group: ProcessGroup | None = None, check: bool = True,
                   out: torch.Tensor | None = None, *, timeout_s: float | None = None) -> torch.Tensor:
    """Top-k S-SGD exchange: all-gather every rank's k pairs and sum them into a dense vector.

    Algorithm:
        1. Pack the k indices and the bit-cast values into one message (int32 words when
           ``numel < 2**31``, :func:`wire_index_dtype`).
        2. All-gather the P messages by direct exchange (every rank sends its message to each of
           the P-1 others in one round; NCCL's all-gather on NCCL:
           :func:`~flashsgd.comm.p2p.gather_from_peers`).
        3. Scatter-add the P k values into a zero vector of ``numel``, in rank order (the same
           order on every rank, so the result is identical everywhere).

    Cost: a + (P-1) k s b with s = 8 bytes per fp32 pair (12 past 2**31 elements) (the bytes of a ring all-gather, P-1
    messages, sent concurrently: one latency instead of P-1), plus O(Pk) adds and an O(numel)
    zero fill; bytes sent per rank: (P-1) * :func:`message_bytes`.

    Args:
        values, indices: this rank's k pairs (the same k on every rank).
        numel: length of the dense gradient.
        group: process group (None: the default group).
        check: verify equal k and numel on all ranks first (one tiny all-gather).
        out: flat tensor of ``numel`` to write the sum into (overwritten; saves an allocation).
        timeout_s: deadline of each wait on a peer, seconds (``None``: the group's default).

    Returns:
        The dense sum over ranks (not averaged), dtype of ``values`` (``out`` if given).

    Raises:
        PeerTimeout: a peer's message did not arrive within ``timeout_s`` (names that rank).

    Example::

        >>> v, i = topk_exact(grad, k)
        >>> total = topk_allgather(v, i, grad.numel())   # identical on every rank
    """
    k = values.numel()
    values, indices = _canonical(values, indices, k, numel, check)
    rank, world = group_info(group)
    timeout_s = _timeout(timeout_s) if world > 1 else 0.0
    if check:
        check_sizes(k, numel, k, group, "topk_allgather", timeout_s, values.device)
    # Step 1
    msg = _pack(values, indices, numel)
    # Step 2
    gathered = gather_from_peers(msg, group, timeout_s, "topk all-gather") if world > 1 else msg
    # Step 3
    if out is None:
        out = torch.zeros(numel, dtype=values.dtype, device=values.device)
    elif out.dim() != 1 or out.numel() != numel:
        raise ValueError(f"out must be a flat tensor of numel={numel}, got shape {tuple(out.shape)}")
    else:
        out.zero_()
    for part in gathered.view(world, msg.numel()):
        v, i = _unpack(part, k, values.dtype)
        out.index_add_(0, i, v)
    return out


def _swap(send: torch.Tensor | None, recv: torch.Tensor | None, peer: int,
          group: ProcessGroup | None, timeout_s: float, where: str) -> None:
    """Send ``send`` to and receive ``recv`` from group rank ``peer`` as one round (either may be
    None: a one-way step; :func:`~flashsgd.comm.p2p.exchange`); each wait lasts at most
    ``timeout_s``. Cost: a + m b for an m-byte message."""
    exchange([(send, peer)] if send is not None else [], [(recv, peer)] if recv is not None else [],
             group, timeout_s, where)


def _extra_rank(values: torch.Tensor, indices: torch.Tensor, k: int, numel: int, partner: int,
                group: ProcessGroup | None, timeout_s: float) -> GTopk:
    """gTop-k on an extra rank r >= P2: Step 1, send my k pairs to ``partner`` = r - P2; Step 3,
    receive the final pairs and the mask of my local indices that survived."""
    msg = torch.empty(_message_len(k, values.dtype, numel, k), dtype=wire_index_dtype(numel), device=values.device)
    _swap(_pack(values, indices, numel), msg, partner, group, timeout_s, "gtopk all-reduce, fold-in")
    gv, gi, mask = _unpack(msg, k, values.dtype, k)
    return GTopk(gv.clone(), gi.clone(), Counted(indices, mask.bool()))


def _fold_in(values: torch.Tensor, indices: torch.Tensor, k: int, numel: int, guest: int,
             group: ProcessGroup | None, timeout_s: float
             ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """gTop-k Step 1 on rank r < E: receive the k pairs of extra rank ``guest`` = r + P2 and merge
    them into mine; returns (the guest's indices, merged values, merged indices, masks over the
    merged pairs: which hold my value, which hold the guest's)."""
    msg = torch.empty(_message_len(k, values.dtype, numel), dtype=wire_index_dtype(numel), device=values.device)
    _swap(None, msg, guest, group, timeout_s, "gtopk all-reduce, fold-in")
    ov, oi = _unpack(msg, k, values.dtype)
    val, idx, pa, pb, keep = _merge_slots(values, indices, ov, oi, k)
    everything = torch.ones(k, dtype=torch.bool, device=values.device)
    return oi.clone(), val[keep], idx[keep], _carry(everything, pa, keep), _carry(everything, pb, keep)


def gtopk_allreduce(values: torch.Tensor, indices: torch.Tensor, k: int, numel: int,
                    group: ProcessGroup | None = None, check: bool = True, *,
                    timeout_s: float | None = None, timings: dict | None = None) -> GTopk:
    """Global Top-k of the sum over ranks by a butterfly of pairwise merges (gTop-k, Shi et al. 2019).

    Algorithm (P ranks, P2 = largest power of two <= P, E = P - P2 extra ranks):
        1. Fold in: extra rank r >= P2 sends its k pairs to r - P2, which merges them into its own.
        2. Butterfly: for i in 0..log2(P2)-1, rank r < P2 swaps its k pairs with r XOR 2^i and both
           keep :func:`merge_topk` of the two (bit-identical on both sides). After round i, the
           2^(i+1) ranks of a block hold the same pairs, so after the last round all P2 do.
        3. Fold out: rank r < E sends the final k pairs to r + P2, with a k-byte mask of which of
           that rank's local indices survived (r tracked them for it).
        Each rank carries a mask of which pairs hold its own (and its guest's) local values
        through every merge it does (no extra traffic, O(k) per merge) to know which of its values
        were counted (error feedback, module docstring).

    Cost (s = bytes per pair, 8 for fp32 values + int32 indices, 12 with int64 ones past 2**31
    elements; m_k = s k):
        power of two:   log2(P) a + log2(P) m_k b + log2(P) merges of 2k (one O(k log k) search + O(k) each);
        otherwise:      (log2(P2) + 2) a + (log2(P2) + 2) m_k b on the critical path (the fold-in
                        and fold-out steps; the E folded ranks send one message and wait).
        Bytes sent per rank: log2(P2) m_k; ranks r < E send m_k + k more (fold-out with mask);
        the E extra ranks send m_k once (:func:`gtopk_bytes_sent`).
        Compared with tree-reduce + broadcast (2 log2 P rounds) the butterfly halves rounds and
        bytes. Gloo has no futures for send/recv, so the exchange runs synchronously.

    Args:
        values, indices: this rank's k pairs (e.g. from :func:`topk_exact`), distinct indices.
        k: pairs per rank and in the result, the same on every rank.
        numel: length of the dense gradient (indices in [0, numel)).
        group: process group (None: the default group).
        check: verify equal k and numel on all ranks first (one tiny all-gather).
        timeout_s: deadline of each wait on a peer, seconds (``None``: the group's default).
        timings: if given, seconds spent are added to ``timings["exchange"]`` (the butterfly's
            sends and waits) and ``timings["merge"]`` (merges and counted-index tracking).

    Returns:
        :class:`GTopk` ``(values, indices, counted)``: the k summed values and their indices,
        identical on every rank, and this rank's local indices whose values are in the sum.

    Raises:
        PeerTimeout: the partner of a round sent nothing within ``timeout_s`` (names that rank).

    Example::

        >>> v, i = topk_exact(acc, k)
        >>> res = gtopk_allreduce(v, i, k, acc.numel())
        >>> update = torch.zeros_like(acc).index_put_((res.indices,), res.values / world)
        >>> residual = acc.index_fill_(0, res.counted, 0)
    """
    values, indices = _canonical(values, indices, k, numel, check)
    rank, world = group_info(group)
    timeout_s = _timeout(timeout_s) if world > 1 else 0.0
    if check:
        check_sizes(k, numel, values.numel(), group, "gtopk_allreduce", timeout_s, values.device)
    if world == 1:
        return GTopk(values, indices, Counted.every(indices))
    p2 = 1 << (world.bit_length() - 1)
    if rank >= p2:  # Steps 1 and 3 as an extra rank
        return _extra_rank(values, indices, k, numel, rank - p2, group, timeout_s)
    # masks over the current pairs: which hold my local value / the folded-in rank's, still counted
    mine, guest = torch.ones(k, dtype=torch.bool, device=values.device), None
    if rank + p2 < world:  # Step 1: fold in
        guest_all, values, indices, mine, guest = _fold_in(values, indices, k, numel, rank + p2,
                                                           group, timeout_s)
    # Step 2: butterfly
    values, indices, mine, guest = _butterfly(values, indices, mine, guest, k, numel, p2, group,
                                              timeout_s, timings)
    # Step 3: fold out
    if guest is not None:
        mask = found_in(guest_all, indices, guest).to(torch.uint8)  # (k,) 1 = that value counted
        _swap(_pack(values, indices, numel, mask), None, rank + p2, group, timeout_s,
              "gtopk all-reduce, fold-out")
    return GTopk(values, indices, Counted(indices, mine))


def _butterfly(values, indices, mine, guest, k: int, numel: int, p2: int, group, timeout_s: float,
               timings: dict | None):
    """gTop-k Step 2 on rank r < P2: log2(P2) swaps with r XOR 2^i, each followed by a merge;
    ``mine`` / ``guest`` (masks over the current pairs of the values still counted) follow the
    pairs through every merge (:func:`_carry`: a value dropped once stays dropped)."""
    rank = dist.get_rank(group)
    recv = torch.empty(_message_len(k, values.dtype, numel), dtype=wire_index_dtype(numel), device=values.device)
    clock = {"exchange": 0.0, "merge": 0.0}
    for i in range(p2.bit_length() - 1):
        t0 = time.perf_counter()
        _swap(_pack(values, indices, numel), recv, rank ^ (1 << i), group, timeout_s,
              f"gtopk all-reduce, butterfly round {i}")
        t1 = time.perf_counter()
        ov, oi = _unpack(recv, k, values.dtype)
        val, idx, pa, _, keep = _merge_slots(values, indices, ov, oi, k)
        values, indices = val[keep], idx[keep]
        mine = _carry(mine, pa, keep)
        if guest is not None:
            guest = _carry(guest, pa, keep)
        clock["exchange"] += t1 - t0
        clock["merge"] += time.perf_counter() - t1
    if timings is not None:
        for key, seconds in clock.items():
            timings[key] = timings.get(key, 0.0) + seconds
    return values, indices, mine, guest


def gtopk_bytes_sent(k: int, world: int, rank: int, dtype: torch.dtype = torch.float32,
                     numel: int = 1) -> int:
    """Bytes :func:`gtopk_allreduce` hands to :func:`~flashsgd.comm.p2p.exchange` on ``rank`` (the
    size check excluded), for a bucket of ``numel`` elements (the default: any under 2**31, int32
    indices)."""
    if world == 1:
        return 0
    p2 = 1 << (world.bit_length() - 1)
    msg = message_bytes(k, dtype, numel)
    if rank >= p2:
        return msg
    rounds = p2.bit_length() - 1
    if rank + p2 < world:
        word = wire_index_dtype(numel).itemsize
        return rounds * msg + word * _message_len(k, dtype, numel, k)
    return rounds * msg


def topk_bytes_sent(k: int, world: int, dtype: torch.dtype = torch.float32, numel: int = 1) -> int:
    """Bytes one rank sends in :func:`topk_allgather` with a ring all-gather: (P-1) messages."""
    return (world - 1) * message_bytes(k, dtype, numel)
