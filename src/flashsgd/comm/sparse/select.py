"""Density schedules and top-k selection by magnitude for the sparse exchanges (:mod:`.sparse`).

Paper: Shi et al. 2019 (gTop-k, arXiv 1901.04359): each rank sends the k = ceil(density * m)
largest |entries| of its error-fed gradient, with a denser warm-up in the first epoch(s).

- :func:`topk_exact`: ``torch.topk`` over |x|.
- :func:`topk_sampled`: a threshold from a random sample, one pass over x, an exact trim of the
  ~1.1 k candidates; equals the exact top-k whenever the pass finds >= k candidates (see its
  docstring), ~10x faster than ``torch.topk`` on 25.6M fp32 with one thread (docs/benchmarks.md).
- :func:`topk_threshold`: the exact top-k (ties to the lower index) from block maxima (one
  read-only pass over x) and a threshold kept across iterations (:class:`ThresholdReuse`, after
  Ok-Topk, Li & Hoefler PPoPP'22).
- :func:`density_at` (the catalog's, :mod:`flashsgd.exchanges`): fixed density, or warm-up from a
  denser start.

Example::

    >>> x = torch.tensor([0.1, -3.0, 2.0, 0.5])
    >>> topk_exact(x, 2)
    (tensor([-3.,  2.]), tensor([1, 2]))
    >>> k_from_density(25_557_032, 0.001)
    25558
"""

from __future__ import annotations

import math
from typing import Callable

import torch

# the density's default, its check and its schedule are the catalog's (torch-free)
from flashsgd.exchanges import DEFAULT_DENSITY, check_density as validate_density, density_at  # noqa: F401
from flashsgd.exchanges import resolved_selection

# ----------------------------------------------------------------------------- density ----------


def k_from_density(numel: int, density: float) -> int:
    """k = ceil(density * numel), at least 1: the number of entries each rank sends."""
    if not isinstance(numel, int) or numel < 1:
        raise ValueError(f"numel must be an integer >= 1, got {numel!r}")
    # ceil of a product that is an integer up to rounding (0.001 * 25_557_032 = 25557.032): round
    # to 9 digits first so 0.01 * 1000 gives 10, not 11.
    return max(1, min(numel, math.ceil(round(validate_density(density) * numel, 9))))


# --------------------------------------------------------------------------- selection ----------

def check_selection(x: torch.Tensor, k: int) -> int:
    if x.dim() != 1 or not x.is_floating_point():
        raise ValueError(f"x must be a flat floating-point tensor, got shape {tuple(x.shape)} {x.dtype}")
    if isinstance(k, bool) or not isinstance(k, int) or not 1 <= k <= x.numel():
        raise ValueError(f"k must be an integer in [1, {x.numel()}] (numel of x), got {k!r}")
    return x.numel()


def topk_exact(x: torch.Tensor, k: int) -> tuple[torch.Tensor, torch.Tensor]:
    """The k entries of flat ``x`` with the largest |value|: ``(values, int64 indices)``, by index.

    ``torch.topk`` on |x|; ties at the k-th magnitude are resolved as torch.topk does
    (deterministic for a given input). Output sorted by index (the canonical form used below).
    """
    check_selection(x, k)
    idx = torch.topk(x.abs(), k, sorted=False).indices.sort().values
    return x[idx], idx


class SelectionWorkspace:
    """Reusable |x| and mask buffers for :func:`topk_sampled`.

    A fresh 100 MB buffer per call costs more in page faults than the pass itself (~70 ms vs
    ~15 ms for 25.6M fp32 here), so callers that select every step keep one of these.
    """

    __slots__ = ("_mag", "_mask", "_words")

    def __init__(self) -> None:
        # placeholders; buffers() allocates on the data's device and dtype at first use
        self._mag = self._mask = self._words = torch.empty(0)

    def buffers(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """(|x| buffer (n,), mask (n rounded up to 8, tail False), word mask (n8 / 8,))."""
        n = x.numel()
        n8 = -(-n // 8) * 8
        if self._mag.numel() < n or self._mag.dtype != x.dtype or self._mag.device != x.device:
            self._mag = torch.empty(n, dtype=x.dtype, device=x.device)
            self._mask = torch.empty(n8, dtype=torch.bool, device=x.device)
            self._words = torch.empty(n8 // 8, dtype=torch.bool, device=x.device)
        mask = self._mask[:n8]
        mask[n:] = False
        return self._mag[:n], mask, self._words[:n8 // 8]


def _nonzero_sparse(mask: torch.Tensor, words: torch.Tensor) -> torch.Tensor:
    """Ascending positions of the True entries of a sparse bool mask (length a multiple of 8).

    torch.nonzero over 25.6M bools costs two passes over them; reading the mask as int64 words
    first (8 bools per word) shrinks that scan 8x, then only the non-zero words are expanded.
    """
    torch.ne(mask.view(torch.int64), 0, out=words)
    w = words.nonzero().squeeze(1)                                           # candidate words
    pos = (w.unsqueeze(1) * 8 + torch.arange(8, dtype=torch.int64, device=w.device)).view(-1)  # (8 w,) ascending
    return pos[mask[pos]]


def topk_sampled(x: torch.Tensor, k: int, *, tolerance: float = 0.25, sample_hits: int = 256,
                max_passes: int = 3, generator: torch.Generator | None = None,
                workspace: SelectionWorkspace | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """Top-k by |value| through a threshold estimated from a random sample (one pass over x).

    Algorithm:
        1. Draw ``s = ceil(sample_hits * m / k)`` positions uniformly (with replacement), so that
           about ``sample_hits`` sampled magnitudes lie above the k-th largest one.
        2. Threshold t = the h-th largest sampled magnitude, h chosen so that the expected number
           of candidates ``|x| >= t`` is ``(1 + tolerance/2) k``, the middle of the target window
           ``[k, (1 + tolerance) k]`` (relative spread of the count ~ 1/sqrt(h) ~ 6%).
        3. One pass over x: candidates = positions with |x| >= t.
        4. Refine: if fewer than k candidates, t was too high: double h and repeat step 3 (at most
           ``max_passes`` passes, then fall back to :func:`topk_exact`).
        5. Trim the candidates to exactly k with torch.topk over them (O(candidates)).

    Whenever step 3 finds >= k candidates they contain every entry of the exact top-k (all have
    |x| >= k-th magnitude >= t), so the result equals the exact top-k up to ties; the saving is
    that torch.topk runs over ~1.1k candidates instead of m entries.

    Cost: one sample of s entries + per pass: |x| (read 4m, write 4m bytes), compare (read 4m,
    write m), and a scan of the mask as m/8 int64 words; then O(candidates).

    Args:
        x: flat floating-point tensor of m entries.
        k: entries to keep, 1 <= k <= m.
        tolerance: candidate-count window above k (see step 2), > 0.
        sample_hits: expected sampled entries above the threshold (accuracy of step 2), >= 16.
        max_passes: passes over x before falling back to exact selection, >= 1.
        generator: RNG of the sample (default: a fixed seed, so calls are deterministic).
        workspace: reusable buffers (see :class:`SelectionWorkspace`).

    Returns:
        ``(values, indices)``: k values of x and their int64 indices, sorted by index.

    Example::

        >>> v, i = topk_sampled(torch.randn(1_000_000), 1000)
        >>> i.numel()
        1000
    """
    m = check_selection(x, k)
    if not tolerance > 0:
        raise ValueError(f"tolerance must be > 0, got {tolerance!r}")
    if sample_hits < 16 or max_passes < 1:
        raise ValueError(f"sample_hits must be >= 16 and max_passes >= 1, got {sample_hits}, {max_passes}")
    s = math.ceil(sample_hits * m / k)
    if s >= m // 4:  # the sample would cost about as much as the exact selection
        return topk_exact(x, k)
    # Step 1: uniform sample of magnitudes.
    if generator is None:
        generator = torch.Generator(device=x.device).manual_seed(0)
    sample = x.index_select(0, torch.randint(0, m, (s,), generator=generator, device=x.device)).abs_()
    mag, mask, words = (workspace or SelectionWorkspace()).buffers(x)
    torch.abs(x, out=mag)
    # Step 2: h-th largest sample magnitude; expected count above it = h * m / s.
    h = max(1, round(s * k * (1 + tolerance / 2) / m))
    for _ in range(max_passes):
        if h >= s:
            break
        t = torch.topk(sample, h, sorted=False).values.min()
        # Step 3: candidates |x| >= t.
        torch.ge(mag, t, out=mask[:m])
        cand = _nonzero_sparse(mask, words)
        if cand.numel() >= k:
            # Step 5: exactly k; a mask over the (ascending) candidates keeps index order, O(c).
            keep = torch.zeros(cand.numel(), dtype=torch.bool, device=x.device)
            keep[torch.topk(mag[cand], k, sorted=False).indices] = True
            idx = cand[keep]
            return x[idx], idx
        # Step 4: threshold too high: aim at twice as many sampled hits.
        h *= 2
    return topk_exact(x, k)


# ----------------------------------------------------------- threshold selection with reuse ----

SELECTION_BLOCKS = (64, 32, 16, 8, 4, 2)
"""Block sizes of :func:`topk_threshold`'s block maxima, largest first: the reductions over
(m/64, 64) cost ~1 pass, over (m/32, 32) ~1.3 (measured, docs/benchmarks.md)."""


def auto_block(numel: int, k: int) -> int | None:
    """The largest block of :data:`SELECTION_BLOCKS` with 2 k block <= numel (the blocks holding
    the top k then cover at most half of x), or None (dense selections: block maxima do not pay)."""
    return next((b for b in SELECTION_BLOCKS if 2 * k * b <= numel), None)


class ThresholdReuse:
    """Thresholds of :func:`topk_threshold` kept across iterations, one per key (e.g. DDP bucket).

    Ok-Topk (Li & Hoefler, PPoPP'22) re-estimates its selection threshold only every few steps:
    gradients change slowly, so last step's threshold still selects about k entries. Here a kept
    threshold is used while the number of entries it selects stays in ``[k, (1 + tolerance) k]``
    and it is younger than ``every`` uses; otherwise it is re-estimated at once (same call, no
    extra pass over the gradient). The selection itself is exact either way (see
    :func:`topk_threshold`), so reuse changes only the cost, never the result.

    Args:
        tolerance: allowed excess of candidates over k, as a fraction of k, >= 0 (0: reuse only a
            threshold that selects exactly k entries).
        every: re-estimate after this many uses of one threshold, >= 1.
    """

    __slots__ = ("tolerance", "every", "thresholds", "ages", "estimates", "reuses", "workspace")

    def __init__(self, tolerance: float = 0.25, every: int = 8) -> None:
        if isinstance(tolerance, bool) or not isinstance(tolerance, (int, float)) or not tolerance >= 0:
            raise ValueError(f"threshold tolerance must be a number >= 0 (allowed excess of "
                             f"candidates over k, as a fraction of k), got {tolerance!r}")
        if isinstance(every, bool) or not isinstance(every, int) or every < 1:
            raise ValueError(f"threshold re-estimation interval must be an integer >= 1, got {every!r}")
        self.tolerance, self.every = float(tolerance), every
        self.thresholds: dict = {}  # key -> threshold (float)
        self.ages: dict = {}        # key -> uses since the last estimate
        self.estimates = 0          # stats: thresholds estimated / reused
        self.reuses = 0
        self.workspace = SelectionWorkspace()  # buffers of the dense-candidates case (not saved)

    def state_dict(self) -> dict:
        """Thresholds, their ages and the counters (plain Python values)."""
        return {"thresholds": dict(self.thresholds), "ages": dict(self.ages),
                "estimates": self.estimates, "reuses": self.reuses}

    def load_state_dict(self, state: dict) -> None:
        """Restore :meth:`state_dict`."""
        self.thresholds = dict(state["thresholds"])
        self.ages = dict(state["ages"])
        self.estimates, self.reuses = int(state["estimates"]), int(state["reuses"])


def block_maxima(x: torch.Tensor, block: int) -> torch.Tensor:
    """max |x| over consecutive blocks of ``block`` entries (the tail shorter than a block: one
    entry each): ``(ceil-ish m / block,)``. Two read-only reductions (amax, amin) instead of
    materializing |x| (a write of 4 m bytes) and a bool mask."""
    nb = x.numel() // block
    head = x[:nb * block].view(nb, block)
    bmax = torch.maximum(head.amax(1), head.amin(1).neg_())
    return torch.cat([bmax, x[nb * block:].abs()])


def _candidates(x: torch.Tensor, bmax: torch.Tensor, t: torch.Tensor, block: int,
                workspace: SelectionWorkspace, limit: float = math.inf) -> torch.Tensor | None:
    """Ascending positions p with |x[p]| >= t, reading only the blocks whose maximum is >= t
    (or all of x, |x| then a compare, when those blocks hold more than a quarter of it).
    None when more than ``limit`` blocks are hit (then more than ``limit`` entries are >= t)."""
    nb = x.numel() // block
    hits = (bmax >= t).nonzero().squeeze(1)
    if hits.numel() > limit:
        return None
    if hits.numel() * block > x.numel() // 4:  # gathering the blocks would cost more than a pass
        mag, mask, words = workspace.buffers(x)
        torch.abs(x, out=mag)
        torch.ge(mag, t, out=mask[:x.numel()])
        return _nonzero_sparse(mask, words)
    blocks, tail = hits[hits < nb], hits[hits >= nb]  # tail entries are their own "blocks"
    rows = x[:nb * block].view(nb, block).index_select(0, blocks)       # (blocks, block)
    r, c = (rows.abs() >= t).nonzero().unbind(1)                        # row-major: ascending
    return torch.cat([blocks[r] * block + c, nb * block + (tail - nb)])


def _kth_magnitude(mag: torch.Tensor, k: int) -> torch.Tensor:
    """The k-th largest entry of ``mag`` (quickselect, O(n); torch.topk is slow for k ~ n)."""
    return torch.kthvalue(mag, mag.numel() - k + 1).values


ESTIMATE_STRIDE = 8
"""Step 2 estimates from every 8th block maximum (quickselect over m / 256 entries)."""


def _estimate_candidates(x: torch.Tensor, bmax: torch.Tensor, k: int, block: int,
                         workspace: SelectionWorkspace) -> torch.Tensor:
    """Step 2-3 without a kept threshold: t from every ``ESTIMATE_STRIDE``-th block maximum, aimed
    at ~1.1 k blocks above it; if fewer than k blocks reach t (too high: maybe fewer than k
    entries), the k-th largest of all block maxima, which always admits >= k entries."""
    sub = bmax[::ESTIMATE_STRIDE]
    rank = math.ceil(1.1 * k * sub.numel() / bmax.numel())
    if rank < sub.numel() and 4 * k * ESTIMATE_STRIDE < bmax.numel():
        t = _kth_magnitude(sub, rank)
        if int((bmax >= t).sum()) >= k:  # >= k blocks, each with an entry >= t
            return _candidates(x, bmax, t, block, workspace)
    return _candidates(x, bmax, _kth_magnitude(bmax, k), block, workspace)


def _trim(x: torch.Tensor, pos: torch.Tensor, k: int) -> torch.Tensor:
    """The k positions of the largest |x[pos]|, ties at the k-th magnitude to the lower index."""
    mag = x[pos].abs()
    if pos.numel() == k:
        return pos
    kth = _kth_magnitude(mag, k)
    keep = mag > kth
    need = k - int(keep.sum())
    keep[(mag == kth).nonzero().squeeze(1)[:need]] = True
    return pos[keep]


def topk_threshold(x: torch.Tensor, k: int, *, reuse: ThresholdReuse | None = None, key=0,
                   block: int | None = None, bmax: torch.Tensor | None = None
                   ) -> tuple[torch.Tensor, torch.Tensor]:
    """Exact top-k by |value| through block maxima and a threshold kept across calls (Ok-Topk).

    Algorithm:
        1. Block maxima b_j = max |x| over blocks of ``block`` entries (:func:`block_maxima`:
           two read-only reductions, ~1 ``torch.add`` pass over x at block 64).
        2. Threshold t: the one kept in ``reuse[key]`` if any and fresh; else an estimate from
           every 8th b_j (aimed at 1.1 k blocks above it), checked to leave >= k blocks above it,
           else the k-th largest b_j, which always admits >= k entries (the top k blocks each
           hold one entry >= it).
        3. Candidates |x_p| >= t, read only inside blocks with b_j >= t (O(k block) entries; when
           those blocks hold over a quarter of x, one |x| and compare pass instead).
           A kept t whose count leaves ``[k, (1 + tolerance) k]`` is replaced by step 2's estimate
           and step 3 repeats (on the block maxima; no further pass over x); one that hits more
           than (1 + tolerance) k blocks is rejected before any block is read.
        4. Trim to exactly k: everything above the k-th candidate magnitude, then the lowest
           indices at it. Every entry of the exact top-k is a candidate (its magnitude is >= the
           k-th, >= t), so the result is the exact top-k with ties to the lower index whatever t
           was: with and without reuse, and at any tolerance, the selection is identical.
        5. Keep, for the next call, the magnitude of the ceil((1 + tolerance/2) k)-th candidate
           (the middle of the window), age 0.

    Cost: reads x once (step 1), then O(k block) for steps 3-4 and O(m / block) for step 2 when
    estimating; the block is the largest of 64 .. 2 with 2 k block <= m (:func:`auto_block`);
    with k > m / 4 it falls back to a torch.topk over |x| with the same tie rule.

    Args:
        x: flat floating-point tensor of m entries.
        k: entries to keep, 1 <= k <= m.
        reuse: thresholds kept across calls (None: estimate every call).
        key: which threshold of ``reuse`` (e.g. the DDP bucket index).
        block: entries per block maximum, >= 2 (None: :func:`auto_block`).
        bmax: step 1's result (with the same ``block``) if the caller computed it (e.g. fused with the residual update,
            :func:`flashsgd.comm.sparse.fused.compress_`).

    Returns:
        ``(values, indices)``: the k values of x and their int64 indices, ascending.

    Example::

        >>> reuse = ThresholdReuse(tolerance=0.25)
        >>> v, i = topk_threshold(torch.randn(1_000_000), 1000, reuse=reuse, key=0)
        >>> i.numel(), reuse.estimates
        (1000, 1)
    """
    m = check_selection(x, k)
    if block is None:
        block = auto_block(m, k)
    elif isinstance(block, bool) or not isinstance(block, int) or block < 2:
        raise ValueError(f"block must be an integer >= 2, got {block!r}")
    if block is None or 2 * k * block > m:  # few blocks per selected entry: maxima do not pay
        return _topk_ties_low(x, k)
    # Step 1
    if bmax is None:
        bmax = block_maxima(x, block)
    # Steps 2-3 with a kept threshold, if fresh and in the window
    tol = reuse.tolerance if reuse is not None else 0.0
    workspace = reuse.workspace if reuse is not None else SelectionWorkspace()
    pos = _kept_candidates(x, bmax, k, block, reuse, key) if reuse is not None else None
    if pos is None:  # Steps 2-3 with an estimate
        pos = _estimate_candidates(x, bmax, k, block, workspace)
        if reuse is not None:
            reuse.estimates += 1
            reuse.ages[key] = 0
    if pos.numel() < k:  # only a NaN in x escapes every comparison: the trainer skips this step
        return _topk_ties_low(x, k)
    # Step 5: the threshold for next time
    if reuse is not None:
        rank = min(pos.numel(), math.ceil((1 + tol / 2) * k))
        reuse.thresholds[key] = float(_kth_magnitude(x[pos].abs(), rank))
    # Step 4
    idx = _trim(x, pos, k)
    if idx.numel() != k:  # a NaN among the candidates defeats the comparisons (a skipped step)
        return _topk_ties_low(x, k)
    return x[idx], idx


def _kept_candidates(x: torch.Tensor, bmax: torch.Tensor, k: int, block: int,
                     reuse: ThresholdReuse, key) -> torch.Tensor | None:
    """Step 3 with ``reuse``'s threshold for ``key``: the candidates if it is fresh and selects
    k .. (1 + tolerance) k entries (counted as a reuse), else None. One that hits more than
    (1 + tolerance) k blocks selects too many and is rejected before any block is read."""
    kept = reuse.thresholds.get(key)
    if kept is None or reuse.ages.get(key, 0) >= reuse.every:
        return None
    most = (1 + reuse.tolerance) * k
    pos = _candidates(x, bmax, torch.tensor(kept, dtype=x.dtype, device=x.device), block, reuse.workspace,
                      limit=most)
    if pos is None or not k <= pos.numel() <= most:
        return None
    reuse.ages[key] += 1
    reuse.reuses += 1
    return pos


def _topk_ties_low(x: torch.Tensor, k: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Exact top-k of |x| by torch.topk, ties at the k-th magnitude to the lower index."""
    idx = _trim(x, torch.arange(x.numel(), device=x.device), k)
    return x[idx], idx


SELECTIONS = {"exact": topk_exact, "sampled": topk_sampled, "threshold": topk_threshold}


def selection_for(name: str | None, device: torch.device | str) -> Callable:
    """The selection function of option ``name`` for a tensor on ``device`` (None and ``auto``:
    :data:`flashsgd.exchanges.SELECTION_BY_DEVICE`)."""
    return SELECTIONS[resolved_selection(name or "auto", torch.device(device).type)]
"""Selection by name: ``exact`` (torch.topk over |x|), ``sampled`` (threshold from a sample) and
``threshold`` (block maxima and a threshold kept across iterations; exact)."""
