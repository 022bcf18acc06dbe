"""Sparse exchange (flashsgd.comm.sparse): selection, merge tree, Top-k / gTop-k, error feedback.

Multi-rank checks run once per world size (1..8) and loop over their cases inside the ranks.
"""

from __future__ import annotations

import math

import pytest
import torch
import torch.distributed as dist

from flashsgd.comm.sparse import (SelectionWorkspace, _message_len, _pack, _unpack,
                                  density_at, gtopk_allreduce, gtopk_bytes_sent, gtopk_reference,
                                  k_from_density, merge_topk, message_bytes, topk_allgather,
                                  topk_exact, topk_sampled, validate_density, wire_index_dtype)
from flashsgd.exchanges import SparseOptions

# ------------------------------------------------------------------------- single process -------


def test_density_validation_and_k():
    for bad in (0, -0.1, 1.5, float("nan"), "0.1", True):
        with pytest.raises(ValueError, match="density"):
            validate_density(bad)
    assert k_from_density(25_557_032, 0.001) == 25_558  # ceil(25557.032)
    assert k_from_density(1000, 0.01) == 10             # no float round-up to 11
    assert k_from_density(10, 1e-6) == 1 and k_from_density(10, 1.0) == 10
    with pytest.raises(ValueError, match="numel"):
        k_from_density(0, 0.5)


def test_density_schedule_golden():
    s = SparseOptions(density=0.001, density_warmup=0.25, density_warmup_steps=4)
    got = [s.density_at(t) for t in range(6)]
    want = [0.25, 0.25 * 0.004 ** 0.25, 0.25 * 0.004 ** 0.5, 0.25 * 0.004 ** 0.75, 0.001, 0.001]
    assert got == pytest.approx(want, rel=1e-12)
    assert density_at(1, 0.01, 0.21, 2, density_warmup_mode="linear") == pytest.approx(0.11)
    assert SparseOptions(density=0.01).density_at(0) == 0.01
    with pytest.raises(ValueError, match="density_warmup"):
        SparseOptions(density=0.01, density_warmup=2.0)
    with pytest.raises(ValueError, match="density_warmup_steps"):
        SparseOptions(density=0.01, density_warmup=0.2, density_warmup_steps=-1)
    with pytest.raises(ValueError, match="density_warmup_mode must be one of exponential, linear, got 'cosine'"):
        SparseOptions(density=0.01, density_warmup_mode="cosine")


def test_selection_bad_inputs():
    x = torch.randn(10)
    for bad_k in (0, 11, -1, 2.5):
        with pytest.raises(ValueError, match="k must be"):
            topk_exact(x, bad_k)
        with pytest.raises(ValueError, match="k must be"):
            topk_sampled(x, bad_k)
    with pytest.raises(ValueError, match="flat floating-point"):
        topk_exact(torch.ones(2, 5), 1)
    with pytest.raises(ValueError, match="tolerance"):
        topk_sampled(x, 2, tolerance=0)


def test_sampled_selection_matches_exact():
    g = torch.Generator().manual_seed(0)
    ws = SelectionWorkspace()
    for n, k in ((200_000, 200), (200_000, 2_000), (100_000, 7)):
        # heavy-tailed gradients as well as Gaussian ones
        for x in (torch.randn(n, generator=g), torch.randn(n, generator=g) ** 3):
            ve, ie = topk_exact(x, k)
            va, ia = topk_sampled(x, k, workspace=ws)
            assert ia.numel() == k and torch.equal(ia, ie) and torch.equal(va, ve)
            assert bool((ia[1:] > ia[:-1]).all())  # sorted by index
    # all-zero input: every candidate ties; still exactly k distinct indices
    v, i = topk_sampled(torch.zeros(100_000), 10)
    assert i.numel() == 10 and i.unique().numel() == 10 and bool((v == 0).all())


def test_merge_symmetric_ties_by_index():
    va, ia = torch.tensor([1.0, -2.0, 3.0]), torch.tensor([0, 5, 9])
    vb, ib = torch.tensor([2.0, 2.0, -3.0]), torch.tensor([1, 5, 7])
    # union sums: 0:1, 1:2, 5:0, 7:-3, 9:3 -> top-3 |.|: 7 and 9 (3), then 1 (2)
    v, i = merge_topk(va, ia, vb, ib, 3)
    assert i.tolist() == [1, 7, 9] and v.tolist() == [2.0, -3.0, 3.0]
    v2, i2 = merge_topk(vb, ib, va, ia, 3)
    assert torch.equal(v, v2) and torch.equal(i, i2)
    # a tie at the boundary goes to the lower index
    v, i = merge_topk(torch.tensor([1.0]), torch.tensor([8]), torch.tensor([-1.0]), torch.tensor([3]), 1)
    assert i.tolist() == [3]


def test_pack_keeps_large_indices_and_values_exact():
    # int32 words below 2**31 elements (8 bytes per fp32 pair), int64 words from there on
    for numel, top, word in ((2**31 - 1, 2**31 - 2, torch.int32), (2**41, 2**40 + 3, torch.int64)):
        idx = torch.tensor([0, 2**24 + 1, 2**30 + 7, top], dtype=torch.int64)
        for dtype in (torch.float32, torch.float16, torch.bfloat16):
            vals = torch.tensor([1.5, -2.25, 3e-3, 7.0]).to(dtype)
            msg = _pack(vals, idx, numel, extra=torch.tensor([1, 0, 1], dtype=torch.uint8))
            assert msg.dtype == word and msg.numel() == _message_len(4, dtype, numel, 3)
            v, i, extra = _unpack(msg, 4, dtype, 3)
            assert i.dtype == torch.int64 and torch.equal(i, idx) and torch.equal(v, vals)
            assert extra.tolist() == [1, 0, 1]
    assert wire_index_dtype(2**31 - 1) == torch.int32 and wire_index_dtype(2**31) == torch.int64
    assert message_bytes(1000) == 8_000  # 4 B index + 4 B value per pair
    assert message_bytes(1000, numel=2**31) == 12_000  # 8 B index past 2**31 elements
    assert message_bytes(1001, torch.float16) == 4 * 1001 + 2004  # values padded to whole words


def test_gtopk_reference_single_rank_and_bad_inputs():
    v, i = torch.tensor([1.0, 2.0]), torch.tensor([3, 1])
    res, counted = gtopk_reference([v], [i], 2, 4)
    assert res.indices.tolist() == [1, 3] and res.values.tolist() == [2.0, 1.0]
    with pytest.raises(ValueError, match="expected k=3"):
        gtopk_allreduce(v, i, 3, 4)
    with pytest.raises(ValueError, match="k must be"):
        gtopk_allreduce(v[:0], i[:0], 0, 4)
    with pytest.raises(ValueError, match="distinct"):
        gtopk_allreduce(v, torch.tensor([1, 1]), 2, 4)
    with pytest.raises(ValueError, match=r"\[0, numel=4\)"):
        gtopk_allreduce(v, torch.tensor([1, 4]), 2, 4)
    with pytest.raises(ValueError, match="equal length"):
        topk_allgather(v, torch.tensor([1]), 4)


# --------------------------------------------------------------------------- multi-rank ---------

def _inputs(world, n, k, seed, integer=False):
    """Every rank's k pairs (the same on every rank: each rank builds them all)."""
    out = []
    for r in range(world):
        g = torch.Generator().manual_seed(seed * 100 + r)
        x = torch.randint(-50, 51, (n,), generator=g).float() if integer else torch.randn(n, generator=g)
        out.append(topk_exact(x, k))
    return out


def _ranks_body(world):
    rank = dist.get_rank()
    report = {"gtopk": [], "errors": []}
    # 1. gtopk == single-process reference of the same tree, bit for bit, for random inputs
    for case, (n, k) in enumerate(((1000, 1), (1000, 37), (5000, 500), (64, 64))):
        pairs = _inputs(world, n, k, seed=case)
        ref, counted = gtopk_reference([p[0] for p in pairs], [p[1] for p in pairs], k, n)
        res = gtopk_allreduce(pairs[rank][0], pairs[rank][1], k, n)
        assert torch.equal(res.values, ref.values), (case, world)
        assert torch.equal(res.indices, ref.indices), (case, world)
        assert torch.equal(res.counted, counted[rank]), (case, world)
        report["gtopk"].append((res.values.tolist(), res.indices.tolist()))  # plain lists: tensors
        # do not survive the queue once the worker exits
    # 2. indices beyond 2^24 stay exact (numel 2^26: int32 words; 2^33: int64 words; no dense vector)
    for n_big in (2**26, 2**33):
        g = torch.Generator().manual_seed(7 + rank)
        idx = (2**24 + 1 + torch.randperm(5000, generator=g)[:16] * 9973).to(torch.int64)
        idx[0] = n_big - 1 - rank  # the top end, distinct per rank, with the largest value: survives
        vals = torch.randn(16, generator=g)
        vals[0] = 100.0 + rank
        res = gtopk_allreduce(vals, idx, 16, n_big)
        allv = [torch.empty(16) for _ in range(world)]
        alli = [torch.empty(16, dtype=torch.int64) for _ in range(world)]
        dist.all_gather(allv, vals)
        dist.all_gather(alli, idx)
        ref, _ = gtopk_reference(allv, alli, 16, n_big)
        assert torch.equal(res.indices, ref.indices) and torch.equal(res.values, ref.values)
        assert set(res.indices.tolist()) <= set(torch.cat(alli).tolist())
        report[f"big{n_big}"] = res.indices.tolist()
    # 3. density 1.0 (k = numel): topk and gtopk give the dense all-reduce (integer data: exact)
    n = 300
    x = torch.randint(-1000, 1001, (n,), generator=torch.Generator().manual_seed(rank)).float()
    dense = x.clone()
    dist.all_reduce(dense)
    v, i = topk_exact(x, n)
    res = gtopk_allreduce(v, i, n, n)
    assert torch.equal(res.indices, torch.arange(n))
    assert torch.equal(res.values, dense)
    assert torch.equal(topk_allgather(v, i, n), dense)
    # 4. error feedback: sum of gradients == sum of applied updates + residuals, over 5 steps
    for algo in ("topk", "gtopk"):
        n, k = 2000, 20
        residual, grads_sum, applied_sum = torch.zeros(n), torch.zeros(n), torch.zeros(n)
        gen = torch.Generator().manual_seed(1000 + rank)
        for _ in range(5):
            grad = torch.randint(-100, 101, (n,), generator=gen).float()
            grads_sum += grad
            acc = grad + residual
            v, i = topk_exact(acc, k)
            if algo == "topk":
                applied = topk_allgather(v, i, n)
                counted = i
            else:
                res = gtopk_allreduce(v, i, k, n)
                applied = torch.zeros(n).index_put_((res.indices,), res.values)
                counted = res.counted
            residual = acc.index_fill_(0, counted, 0)
            applied_sum += applied
        total_grads, total_res = grads_sum.clone(), residual.clone()
        dist.all_reduce(total_grads)
        dist.all_reduce(total_res)
        assert torch.equal(applied_sum + total_res, total_grads), algo  # integers: exact
    # 5. mismatched lengths across ranks: a clear error on every rank, no hang
    if world > 1:
        k = 5 if rank == 0 else 6
        x = torch.randn(100)
        v, i = topk_exact(x, k)
        for fn in (lambda: gtopk_allreduce(v, i, k, 100), lambda: topk_allgather(v, i, 100)):
            try:
                fn()
                report["errors"].append(None)
            except ValueError as exc:
                report["errors"].append(str(exc))
    return report


@pytest.mark.parametrize("world", [1, 2, 3, 4, 5, 6, 7, 8])
def test_distributed_exchanges(run_ranks, world):
    reports = run_ranks(_ranks_body, world, world)
    for case in range(len(reports[0]["gtopk"])):  # identical on every rank
        assert all(rep["gtopk"][case] == reports[0]["gtopk"][case] for rep in reports[1:])
    for n_big in (2**26, 2**33):  # identical everywhere; the top-end indices survived exactly
        assert all(rep[f"big{n_big}"] == reports[0][f"big{n_big}"] for rep in reports)
        assert set(range(n_big - world, n_big)) <= set(reports[0][f"big{n_big}"])
    if world > 1:
        for rep in reports:
            assert len(rep["errors"]) == 2
            for msg in rep["errors"]:
                assert msg is not None and "mismatched lengths across ranks" in msg and "k=5" in msg


def test_bytes_sent_formulas():
    k = 25_558
    msg = message_bytes(k)  # 8 bytes per pair
    assert gtopk_bytes_sent(k, 8, 3) == 3 * msg
    assert gtopk_bytes_sent(k, 6, 1) == 2 * msg + 4 * _message_len(k, torch.float32, 1, k)  # folds out
    assert gtopk_bytes_sent(k, 6, 5) == msg                                              # folded in
    # issue target at W=8: <= 2.5 x 2k*8*log2(W), and less than topk's (P-1) messages
    assert gtopk_bytes_sent(k, 8, 0) <= 2.5 * 2 * k * 8 * math.log2(8)
