"""Dense all-reduce: every algorithm equals dist.all_reduce on real Gloo ranks, and bad input fails clearly.

Exactness: fp32 data is integer-valued, so every summation order gives the same bits and the
algorithms must match ``dist.all_reduce`` exactly (sum, and avg = the same sum / W). Half precision
reduces in the tensor's dtype with one rounding per ring hop, so fp16 / bf16 results are compared
with the exact float64 sum under |err| <= W * eps * sum_r |x_r| (+ one rounding of the result),
eps = 2^-10 (fp16) or 2^-7 (bf16).
"""

import dataclasses

import pytest
import torch
import torch.distributed as dist

from flashsgd.comm.dense import (DENSE, allreduce, chunk_bounds, duplex_groups, native, nccl_algorithms,
                                  ring, torus2d)
from flashsgd.comm.topology import divisors, get_topology, valid_grids
from flashsgd.exchanges import EXCHANGES

EPS = {torch.float16: 2.0 ** -10, torch.bfloat16: 2.0 ** -7}


def _lengths(world):
    return sorted({0, 1, world - 1, world + 1, 13, 97, 1000})


# Which (op, dtype) runs on which lengths: every length in fp32 sum, the other cases on a few
# lengths each (one spawn per world runs everything; this keeps the file inside its time budget).
AVG_LENGTHS, FP16_LENGTHS, BF16_LENGTHS, CHECKED_LENGTHS = (1, 97), (1000, 13), (1, 97), (0, 13)


def _data(rank, n, dtype, integer):
    g = torch.Generator().manual_seed(1000 * rank + n)
    if integer:
        return torch.randint(-50, 50, (n,), generator=g).to(dtype)
    return torch.randn(n, generator=g).to(dtype)


def layouts(name, world):
    """(ranks_per_node, grid) choices that exercise dense algorithm ``name`` on ``world`` ranks,
    read from its record: every node layout when its NCCL chain runs over nodes, every grid when
    over rows and columns, the defaults otherwise; a Gloo-only record: what its exchange reads."""
    chain = DENSE[name].native
    if chain is not None:
        kinds = {chain.inner, chain.outer}
        by_grid, by_node = bool(kinds & {"row", "col"}), bool(kinds & {"node", "cross"})
    else:
        by_grid = EXCHANGES[name].reads("grid")
        by_node = not by_grid and EXCHANGES[name].reads("ranks_per_node")
    if by_grid:
        return [(None, g) for g in valid_grids(world)]
    return [(L, None) for L in divisors(world)] if by_node else [(None, None)]


def _configs(world):
    """(algorithm, ranks_per_node, grid): every registered algorithm on each layout it reads."""
    return [(name, L, grid) for name in DENSE for L, grid in layouts(name, world)]


def _compare_all(world):
    rank = dist.get_rank()
    checked = 0
    for name, L, grid in _configs(world):
        topo = get_topology(ranks_per_node=L, grid=grid)
        fn = DENSE[name].fn
        for n in _lengths(world):
            # fp32, integer-valued: bit-exact against torch's all_reduce, for sum and avg.
            for op in ("sum", "avg") if n in AVG_LENGTHS else ("sum",):
                t = _data(rank, n, torch.float32, integer=True)
                ref = t.clone()
                if n:
                    dist.all_reduce(ref)
                if op == "avg":
                    ref /= world
                out = fn(t, topo, op=op, check=n in CHECKED_LENGTHS)
                assert out is t, "the reduction must be in place and return the tensor"
                assert torch.equal(t, ref), (name, L, grid, n, op, (t - ref).abs().max())
                checked += 1
            # half precision: within the documented rounding bound of the exact sum.
            for dtype in [d for d, ns in ((torch.float16, FP16_LENGTHS),
                                          (torch.bfloat16, BF16_LENGTHS)) if n in ns]:
                xs = [_data(r, n, dtype, integer=False).double() for r in range(world)]
                exact, mag = sum(xs), sum(x.abs() for x in xs)
                t = _data(rank, n, dtype, integer=False)
                fn(t, topo, op="sum", check=False)
                bound = world * EPS[dtype] * mag + EPS[dtype] * exact.abs() + 1e-12
                err = (t.double() - exact).abs()
                assert bool(torch.all(err <= bound)), (name, L, grid, n, dtype, (err - bound).max())
                checked += 1
    # Every 2-rank group kind, and only those, has a twin group for the second direction.
    topo = get_topology(ranks_per_node=L, grid=grid)
    twins = duplex_groups(topo)
    sizes = {"world": world, "row": topo.grid[0], "col": topo.grid[1], "node": topo.ranks_per_node,
             "cross": topo.num_nodes}
    assert {k: v is not None for k, v in twins.items()} == {k: n == 2 for k, n in sizes.items()}
    # Shapes other than flat are reduced as their flat view.
    t = torch.full((3, 5), float(rank + 1))
    torus2d(t, get_topology(grid=valid_grids(world)[-1]))
    assert torch.all(t == world * (world + 1) / 2)
    return checked


@pytest.mark.parametrize("world", range(1, 9))
def test_algorithms_equal_dist_all_reduce(run_ranks, world):
    checked = run_ranks(_compare_all, world, world)
    assert all(c == checked[0] for c in checked) and checked[0] > 0


def test_chunk_bounds_cover_every_element_once():
    for n in (0, 1, 7, 8, 9, 1000):
        for parts in range(1, 9):
            b = chunk_bounds(n, parts)
            assert b[0] == 0 and b[-1] == n and len(b) == parts + 1
            sizes = [hi - lo for lo, hi in zip(b, b[1:])]
            assert min(sizes) >= 0 and max(sizes) == -(-n // parts)


# ------------------------------------------------------------------------------ errors ----------

@pytest.mark.parametrize("tensor, op, message", [
    (torch.zeros(4, dtype=torch.float64), "sum", "dtype torch.float64 is not supported; valid dtypes: "
                                                  "float32, float16, bfloat16"),
    (torch.zeros(4, dtype=torch.int32), "sum", "valid dtypes: float32"),
    (torch.zeros(4), "max", "op must be one of sum, avg, got 'max'"),
    (torch.zeros(4, 4).t(), "sum", "tensor must be contiguous"),
    ([1.0, 2.0], "sum", "tensor must be a torch.Tensor"),
])
def test_bad_input_raises_value_error(tensor, op, message):
    for name in DENSE:
        with pytest.raises(ValueError, match=message):
            DENSE[name].fn(tensor, None, op=op)


def test_unknown_algorithm_lists_known_ones():
    with pytest.raises(ValueError, match=f"unknown all-reduce algorithm 'rign'; known: {', '.join(DENSE)}$"):
        allreduce(torch.zeros(2), "rign")


def test_needs_a_process_group():
    if not dist.is_initialized():
        with pytest.raises(RuntimeError, match="initialized default process group"):
            ring(torch.zeros(2))


def _mismatches():
    rank, world = dist.get_rank(), dist.get_world_size()
    topo = get_topology(grid=f"1x{world}")
    messages = []
    cases = [
        ("length", lambda: ring(torch.ones(10 + (rank == 1)), topo)),
        ("empty vs not", lambda: torus2d(torch.ones(0 if rank == 2 else 5), topo)),
        ("dtype", lambda: native(torch.ones(4, dtype=torch.float16 if rank else torch.float32), topo)),
        ("op", lambda: ring(torch.ones(4), topo, op="avg" if rank else "sum")),
        ("algorithm", lambda: DENSE["ring" if rank else "torus2d"].fn(torch.ones(4), topo)),
    ]
    for what, call in cases:
        try:
            call()
            messages.append(f"{what}: no error")
        except ValueError as exc:
            messages.append(str(exc))
    # the group is still usable after the errors
    t = torch.ones(6)
    ring(t, topo)
    wrong_world = dataclasses.replace(topo, world_size=world + 1)
    try:
        ring(torch.ones(3), wrong_world)
        messages.append("topology: no error")
    except ValueError as exc:
        messages.append(str(exc))
    return messages, t.tolist()


def test_mismatched_inputs_raise_on_every_rank(run_ranks):
    results = run_ranks(_mismatches, 3)
    for messages, reduced in results:
        assert reduced == [3.0] * 6
        length, empty, dtype, op, algo, topo = messages
        assert "inputs differ across ranks" in length and "rank 1: 11 elements" in length
        assert "rank 0: 10 elements" in length
        assert "rank 2: 0 elements" in empty
        assert "rank 0: 4 elements float32" in dtype and "rank 1: 4 elements float16" in dtype
        assert "op=sum" in op and "op=avg" in op
        assert "algorithm=torus2d" in algo and "algorithm=ring" in algo
        assert "topology describes 4 ranks but the world size is 3" in topo
    assert len({tuple(m) for m, _ in results}) == 1  # the same message on every rank


def _padded_subcollective_branch(world):
    """The NCCL code path (the chain of native collectives, padded where the group size does not
    divide the length), forced onto Gloo; more cases in tests/test_dense_native.py."""
    from flashsgd.comm import dense

    dense.native_stages = lambda flat, group=None: True  # this forked rank only
    rank = dist.get_rank()
    configs = [(name, L, grid) for name in nccl_algorithms() for L, grid in layouts(name, world)]
    for name, L, grid in configs:
        topo = get_topology(ranks_per_node=L, grid=grid)
        for n in _lengths(world):
            t = _data(rank, n, torch.float32, integer=True)
            ref = t.clone()
            if n:
                dist.all_reduce(ref)
            DENSE[name].fn(t, topo, check=False)
            assert torch.equal(t, ref), (name, L, grid, n)
    return True


@pytest.mark.parametrize("world", [5, 8])
def test_padded_subcollective_branch_matches(run_ranks, world):
    assert all(run_ranks(_padded_subcollective_branch, world, world))
