"""The fast sparse path: threshold selection with reuse, fused compression, hierarchical gTop-k.

(flashsgd.comm.sparse.select.topk_threshold, flashsgd.comm.sparse.fused, flashsgd.comm.sparse.hier,
and the ``hgtopk`` / ``threshold`` options of the sparse hook.)
"""

from __future__ import annotations

import pickle

import pytest
import torch
import torch.distributed as dist
from torch import nn
from torch.nn.parallel import DistributedDataParallel as DDP

from flashsgd.comm.hooks import HOOKS, register_hook
from flashsgd.comm.sparse import topk_exact
from flashsgd.comm.sparse.fused import compress_
from flashsgd.comm.sparse.hier import check_node_layout, hgtopk_allreduce
from flashsgd.comm.sparse.select import ThresholdReuse, block_maxima, topk_threshold
from flashsgd.comm.topology import get_topology

from ddp_helpers import flat_params as _params  # noqa: E402
from ddp_helpers import tiny_net as _net  # noqa: E402
from ddp_helpers import train_steps  # noqa: E402

# ------------------------------------------------------------------------- single process -------


def _inputs(seed):
    g = torch.Generator().manual_seed(seed)
    for n, k in ((200_000, 200), (200_000, 2_000), (100_003, 7), (1000, 300), (65, 64)):
        yield torch.randn(n, generator=g), k
        yield torch.randn(n, generator=g) ** 3, k  # heavy tails


def test_threshold_selection_is_the_exact_topk():
    for x, k in _inputs(0):
        ve, ie = topk_exact(x, k)
        v, i = topk_threshold(x, k)
        assert torch.equal(i, ie) and torch.equal(v, ve), (x.numel(), k)
    # ties at the k-th magnitude go to the lower index, whatever the threshold
    x = torch.zeros(10_000)
    x[[50, 7000, 9999]] = torch.tensor([1.0, -1.0, 1.0])
    assert topk_threshold(x, 2)[1].tolist() == [50, 7000]
    assert topk_threshold(torch.zeros(100_000), 10)[1].tolist() == list(range(10))


def test_block_maxima():
    x = torch.tensor([1.0, -5.0, 2.0, 0.5, -0.25, 3.0, -7.0])
    assert block_maxima(x, 2).tolist() == [5.0, 2.0, 3.0, 7.0]  # last entry: a tail of one


def test_threshold_reuse_same_result_and_cost_counted():
    """Reuse changes the cost only: identical selections with and without it, at tolerance 0 and not."""
    g = torch.Generator().manual_seed(3)
    x = torch.randn(300_000, generator=g)
    for tol in (0.0, 0.25):
        reuse = ThresholdReuse(tolerance=tol, every=4)
        y = x.clone()
        for _ in range(10):
            y += 0.05 * torch.randn(300_000, generator=g)
            kept = topk_threshold(y, 300, reuse=reuse, key="b0")
            fresh = topk_threshold(y, 300)
            assert torch.equal(kept[1], fresh[1]) and torch.equal(kept[0], fresh[0])
        assert reuse.estimates + reuse.reuses == 10
        if tol > 0:
            assert reuse.reuses >= 5 and reuse.estimates >= 10 // 5  # every=4 forces re-estimates
    state = reuse.state_dict()
    other = ThresholdReuse()
    other.load_state_dict(pickle.loads(pickle.dumps(state)))
    assert other.state_dict() == state


def test_threshold_bad_inputs():
    for bad in (-0.1, float("nan"), "0.1", True):
        with pytest.raises(ValueError, match="tolerance must be a number >= 0"):
            ThresholdReuse(tolerance=bad)
    with pytest.raises(ValueError, match="interval must be an integer >= 1"):
        ThresholdReuse(every=0)
    with pytest.raises(ValueError, match="k must be"):
        topk_threshold(torch.randn(10), 11)
    with pytest.raises(ValueError, match="block must be"):
        topk_threshold(torch.randn(10), 1, block=1)


def _compress_body(compiled):
    torch.set_num_threads(1)  # no OpenMP pool in a rank forked from a process that used one
    g = torch.Generator().manual_seed(1)
    residual = torch.randn(100_000, generator=g)
    grad = torch.randn(100_000, generator=g)
    acc = residual + grad
    v, i = compress_(residual, grad, 100, compiled=compiled, reuse=ThresholdReuse())
    assert torch.equal(residual, acc)  # Step 1 in place (compiled or its eager fallback)
    ve, ie = topk_exact(acc, 100)
    assert torch.equal(i, ie) and torch.equal(v, ve)
    try:
        compress_(residual, grad[:10], 5)
    except ValueError as exc:
        return str(exc)
    return None


@pytest.mark.parametrize("compiled", [False, True])
def test_compress_accumulates_in_place_and_selects(run_ranks, compiled):
    # in a forked rank: torch.compile's worker threads must not live in the pytest process,
    # which forks the ranks of later tests
    assert "grad must match residual" in run_ranks(_compress_body, 1, compiled)[0]


def test_hgtopk_bad_split():
    with pytest.raises(ValueError, match="split must be one of leader, slices, sparse, got 'x'"):
        hgtopk_allreduce(torch.ones(4), 1, None, out=torch.ones(4), split="x")


def test_node_layout_checked_before_groups():
    assert check_node_layout(2, 6) == 2
    for bad in (4, 0, -2, 2.0, True):
        with pytest.raises(ValueError, match=r"ranks_per_node must divide the world size 6; .*valid: 1, 2, 3, 6"):
            check_node_layout(bad, 6)
    with pytest.raises(ValueError, match="node_split must be one of leader, slices, sparse, got 'x'"):
        register_hook(nn.Linear(2, 2), "hgtopk", node_split="x")
    with pytest.raises(ValueError, match="threshold_tolerance must be >= 0, got -1"):
        register_hook(nn.Linear(2, 2), "gtopk", threshold_tolerance=-1)
    assert "hgtopk" in HOOKS


# --------------------------------------------------------------------------- multi-rank ---------

def _split_body(ranks_per_node, split):
    """hgtopk with ``split``: density 1 == all-reduce, error feedback exact, identical everywhere."""
    torch.set_num_threads(1)  # see _compress_body
    rank = dist.get_rank()
    topo = get_topology(ranks_per_node)
    # 1. density 1.0 == all-reduce (integer data: exact)
    n = 301
    x = torch.randint(-1000, 1001, (n,), generator=torch.Generator().manual_seed(rank)).float()
    dense = x.clone()
    dist.all_reduce(dense)
    out = torch.empty(n)
    res = hgtopk_allreduce(x, n, topo, out=out, split=split)
    assert torch.equal(out, dense) and torch.equal(res.counted, torch.arange(n))
    # 2. error feedback exact over 5 steps: sum of grads == sum of applied + sum of residuals
    n, k = 3001, 30
    residual, grads_sum, applied_sum = torch.zeros(n), torch.zeros(n), torch.zeros(n)
    gen = torch.Generator().manual_seed(1000 + rank)
    out, results = torch.empty(n), []
    for _ in range(5):
        grad = torch.randint(-100, 101, (n,), generator=gen).float()
        grads_sum += grad
        acc = grad + residual
        res = hgtopk_allreduce(acc, k, topo, out=out, select=topk_threshold, split=split)
        assert bool((res.indices[1:] > res.indices[:-1]).all())
        if split == "leader":  # one global selection of exactly k (the others select per slice / node)
            assert res.indices.numel() == k and torch.count_nonzero(out) <= k
        applied_sum += out
        residual = acc.index_fill_(0, res.counted, 0)
        results.append(out.tolist())
    total_grads, total_res = grads_sum.clone(), residual.clone()
    dist.all_reduce(total_grads)
    dist.all_reduce(total_res)
    assert torch.equal(applied_sum + total_res, total_grads)
    return results


@pytest.mark.parametrize("world,ranks_per_node", [(1, 1), (2, 2), (4, 2), (6, 2), (6, 3), (3, 1), (8, 4)])
def test_hgtopk_exact_any_layout(run_ranks, world, ranks_per_node):
    reports = run_ranks(_split_body, world, ranks_per_node, "leader")
    assert all(rep == reports[0] for rep in reports)  # identical on all ranks


def _train(model, steps, first=0, **options):
    state = register_hook(model, **options) if options else None
    opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    train_steps(model, opt, steps, first)
    return state, opt


def _hook_body():
    torch.set_num_threads(1)  # see _compress_body
    # 1. hgtopk at density 1.0 == DDP's all-reduce, through the bucket rebuild
    ref = DDP(_net(), bucket_cap_mb=0.01)
    _train(ref, 5)
    model = DDP(_net(), bucket_cap_mb=0.01)
    state, _ = _train(model, 5, name="hgtopk", density=1.0, ranks_per_node=2)
    assert state.sparse_buckets > 0
    torch.testing.assert_close(_params(model), _params(ref), rtol=1e-5, atol=1e-6)
    # 2. threshold selection == exact selection (gtopk and hgtopk's splits), tolerance 0 or not
    for name, extra in (("gtopk", {}), ("hgtopk", {"ranks_per_node": 2}),
                        ("hgtopk", {"ranks_per_node": 2, "node_split": "slices"}),
                        ("hgtopk", {"ranks_per_node": 2, "node_split": "sparse"})):
        runs = []
        for opts in ({"selection": "exact"}, {"selection": "threshold", "threshold_tolerance": 0.0},
                     {"selection": "threshold", "threshold_tolerance": 0.5}):
            model = DDP(_net(), bucket_cap_mb=0.01)
            _train(model, 6, name=name, density=0.01, **extra, **opts)
            runs.append(_params(model))
        assert torch.equal(runs[0], runs[1]) and torch.equal(runs[0], runs[2]), (name, extra)
    # 3. checkpoint/resume (residuals and thresholds) == uninterrupted run (one bucket before and
    #    after DDP's rebuild: the same selection per bucket)
    straight = DDP(_net())
    _train(straight, 8, name="hgtopk", density=0.01, ranks_per_node=2, selection="threshold")
    first = DDP(_net())
    state, opt = _train(first, 4, name="hgtopk", density=0.01, ranks_per_node=2, selection="threshold")
    ckpt = pickle.loads(pickle.dumps({"model": first.module.state_dict(), "opt": opt.state_dict(),
                                      "hook": state.state_dict()}))
    selections = ckpt["hook"]["thresholds"]["estimates"] + ckpt["hook"]["thresholds"]["reuses"]
    assert (selections > 0) == (dist.get_rank() % 2 == 0)  # only the node leaders select
    resumed_net = _net()
    resumed_net.load_state_dict(ckpt["model"])
    resumed = DDP(resumed_net)
    state2 = register_hook(resumed, "hgtopk", density=0.01, ranks_per_node=2, selection="threshold")
    state2.load_state_dict(ckpt["hook"])
    opt2 = torch.optim.SGD(resumed.parameters(), lr=0.1, momentum=0.9)
    opt2.load_state_dict(ckpt["opt"])
    for s in range(4, 8):
        g = torch.Generator().manual_seed(1000 * s + dist.get_rank())
        x, y = torch.randn(16, 20, generator=g), torch.randint(0, 5, (16,), generator=g)
        opt2.zero_grad()
        nn.functional.cross_entropy(resumed(x), y).backward()
        opt2.step()
    assert torch.equal(_params(resumed), _params(straight))
    return True


def test_hgtopk_and_threshold_hooks(run_ranks):
    assert all(run_ranks(_hook_body, 4))


@pytest.mark.parametrize("split", ["slices", "sparse"])
@pytest.mark.parametrize("world,ranks_per_node", [(1, 1), (4, 2), (6, 3), (6, 2), (8, 4)])
def test_hgtopk_split_exact_any_layout(run_ranks, world, ranks_per_node, split):
    reports = run_ranks(_split_body, world, ranks_per_node, split)
    assert all(rep == reports[0] for rep in reports)
