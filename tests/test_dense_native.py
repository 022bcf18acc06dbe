"""The native chain (what ring / hierarchical / torus2d run on NCCL, :func:`flashsgd.comm.dense_native.native_chain`)
equals ``dist.all_reduce``, checked on real Gloo ranks, where the same chain runs with each collective
waited for (a completed Future per stage).

Data: fp32 values are integers distinct per rank and per element (element i of rank r is
16 i + r + 1), so every summation order gives the same bits, and a copy back from the wrong place,
padding that leaks into the result, a stage dropped or a chunk reduced twice changes the answer. A
shard at the wrong offset still sums right on Gloo (its collectives copy through buffers of their
own) but is no longer NCCL's in-place form (output = input + x c): :func:`_in_place` checks the
pointers the collectives get, and the chunk size ceil(n / X) of the module's chunking. Half precision is
compared with the exact float64 sum within the documented rounding bound (tests/test_dense.py), plus
one rounding per averaging stage for ``avg``.
"""

from __future__ import annotations

import pytest
import torch
import torch._dynamo  # noqa: F401  DDP imports it: once here, not in every forked rank
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel as DDP

from ddp_helpers import flat_params, tiny_net, train_steps
from flashsgd.comm import dense, dense_hooks, dense_native
from flashsgd.comm.dense import ALLREDUCE, allreduce_future
from flashsgd.comm.hooks import register_hook
from flashsgd.comm.topology import get_topology

WORLD = 4
# (algorithm, ranks_per_node, grid): inner group sizes 4, 2, 2, 1 (no inner stage), 4
CONFIGS = [("ring", None, None), ("hierarchical", 2, None), ("torus2d", None, "2x2"),
           ("torus2d", None, "1x4"), ("torus2d", None, "4x1")]
LENGTHS = (0, 1, 3, 4, 8, 5, 13, 97, 1000)  # empty; < P; multiples of P (and of 2); not multiples
EPS = {torch.bfloat16: 2.0 ** -7}


def _values(rank: int, n: int, dtype: torch.dtype) -> torch.Tensor:
    if dtype == torch.float32:  # distinct integers: exact in any order
        return (torch.arange(n, dtype=torch.float64) * 16 + rank + 1).to(dtype)
    return torch.randn(n, generator=torch.Generator().manual_seed(100 * rank + n)).to(dtype)


def _wrong(t: torch.Tensor, n: int, dtype: torch.dtype, op: str) -> str | None:
    """None when ``t`` (this rank's result) is right, else the largest error in words."""
    world, rank = dist.get_world_size(), dist.get_rank()
    if dtype == torch.float32:
        ref = _values(rank, n, dtype)
        if n:
            dist.all_reduce(ref)
        if op == "avg":
            ref /= world
        if torch.equal(t, ref):  # sum: must be exact; avg: exact too here (division by 2^k)
            return None
        return f"max |err| {(t - ref).abs().max().item() if n else 'shape'}"
    xs = [_values(r, n, dtype).double() for r in range(world)]
    exact, mag = sum(xs), sum(x.abs() for x in xs)
    scale = 1.0 / world if op == "avg" else 1.0
    # W roundings of partial sums, + one per averaging stage (two at most), + one of the result
    bound = scale * (world + 2) * EPS[dtype] * mag + EPS[dtype] * scale * exact.abs() + 1e-12
    err = (t.double() - exact * scale).abs()
    return None if bool(torch.all(err <= bound)) else f"max excess {(err - bound).max().item():.3g}"


def _chain_cases() -> list[str]:
    """Every config x length x op x dtype through :func:`allreduce_future` (the hooks' NCCL call)."""
    rank, wrong = dist.get_rank(), []
    for name, L, grid in CONFIGS:
        topo = get_topology(ranks_per_node=L, grid=grid)
        for n in LENGTHS:
            for op in ("sum", "avg"):
                for dtype in (torch.float32, torch.bfloat16):
                    t = _values(rank, n, dtype)
                    fut = allreduce_future(t, name, topo, op)
                    if not fut.done() or fut.wait() is not t:
                        wrong.append(f"{name} {L} {grid} n={n}: the Future's value is not the tensor")
                    why = _wrong(t, n, dtype, op)
                    wrong += [f"{name} L={L} grid={grid} n={n} {op} {dtype}: {why}"] if why else []
    return wrong


def test_native_chain_equals_all_reduce_on_gloo(run_ranks):
    assert run_ranks(_chain_cases, WORLD) == [[]] * WORLD


def _in_place() -> dict:
    """What the chain hands to the collectives: no padding copy when the inner group divides n
    (the shard is a view of the tensor: reduce-scatter output = input + x c, all-gather input =
    output + x c), one padded buffer for the whole chain otherwise; op=avg is ReduceOp.AVG."""
    seen = []
    rs, ag = dense_native._reduce_scatter_single, dense_native.all_gather_single

    def record_rs(out, inp, op=dist.ReduceOp.SUM, group=None, async_op=False):
        seen.append(("rs", out.data_ptr(), inp.data_ptr(), out.numel(), inp.numel(), op))
        return rs(out, inp, op=op, group=group, async_op=async_op)

    def record_ag(out, inp, group=None, async_op=False):
        seen.append(("ag", inp.data_ptr(), out.data_ptr(), inp.numel(), out.numel(), None))
        return ag(out, inp, group=group, async_op=async_op)

    dense_native._reduce_scatter_single, dense_native.all_gather_single = record_rs, record_ag  # this forked rank only
    out = {}
    try:
        topo = get_topology(grid="2x2")
        x = dist.get_rank(topo.row_group)  # position in the row, X = 2
        for n in (8, 5):
            seen.clear()
            t = _values(dist.get_rank(), n, torch.float32)
            allreduce_future(t, "torus2d", topo, "avg").wait()
            (_, rs_out, rs_in, c, total, op), (_, ag_in, ag_out, c2, total2, _) = seen
            out[n] = {"rs input is the tensor": rs_in == t.data_ptr(),
                      "one buffer": rs_in == ag_out and total == total2 == 2 * c and c == c2 == -(-n // 2),
                      "rs in place": rs_out == rs_in + x * c * 4,
                      "ag in place": ag_in == ag_out + x * c * 4,
                      "avg": op == dist.ReduceOp.AVG}
    finally:
        dense_native._reduce_scatter_single, dense_native.all_gather_single = rs, ag
    return out


def test_the_chain_runs_in_place_and_pads_once(run_ranks):
    for result in run_ranks(_in_place, WORLD):
        assert result[8] == {"rs input is the tensor": True, "one buffer": True, "rs in place": True,
                             "ag in place": True, "avg": True}
        assert result[5] == {"rs input is the tensor": False, "one buffer": True, "rs in place": True,
                             "ag in place": True, "avg": True}


def _dispatch_and_hooks() -> dict:
    """With ``native_stages`` forced true (what a CUDA tensor on NCCL gets): the algorithms, their
    stage functions (``_two_level``'s reduce_scatter / ring_allreduce / all_gather natively) and
    the DDP hooks take the NCCL code path on Gloo, and still equal all_reduce / DDP's average."""
    rank, out = dist.get_rank(), {}
    reference = _trained("native", {})
    dense.native_stages = dense_hooks.native_stages = lambda flat, group=None: True  # forked rank only
    for name, L, grid in CONFIGS:
        topo = get_topology(ranks_per_node=L, grid=grid)
        for n in (1, 5, 8, 97):
            for op in ("sum", "avg"):
                t = _values(rank, n, torch.float32)
                assert ALLREDUCE.get(name)(t, topo, op=op, check=False) is t
                out[f"{name} {L} {grid} {n} {op}"] = _wrong(t, n, torch.float32, op)
            if name != "ring":  # the per-stage functions (benchmarks/allreduce_stages.py)
                t = _values(rank, n, torch.float32)
                dense._two_level(t.view(-1), topo, name)
                out[f"{name} {L} {grid} {n} stages"] = _wrong(t, n, torch.float32, "sum")
    for name, options in (("ring", {}), ("hierarchical", {"ranks_per_node": 2}), ("torus2d", {"grid": "2x2"}),
                          ("torus2d", {"grid": "1x4"})):
        got = _trained(name, options)
        ok = torch.allclose(got, reference, rtol=1e-5, atol=1e-6)
        out[f"hook {name} {options}"] = None if ok else f"max |diff| {(got - reference).abs().max().item()}"
    return out


def _trained(name: str, options: dict) -> torch.Tensor:
    model = tiny_net()
    wrapped = DDP(model, bucket_cap_mb=0.01)  # several buckets, of lengths not all multiples of 4
    register_hook(wrapped, name, **options)
    train_steps(wrapped, torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9), 3)
    return flat_params(model)


def test_nccl_dispatch_and_hooks_on_gloo(run_ranks):
    for result in run_ranks(_dispatch_and_hooks, WORLD):
        assert {k: v for k, v in result.items() if v is not None} == {}


@pytest.mark.parametrize("op", ["sum", "avg"])
def test_gloo_reduce_op_avg_averages(run_ranks, op):
    """The premise of the CPU check of ``op="avg"``: torch 2.13's Gloo accepts ReduceOp.AVG in
    reduce_scatter_tensor and all_reduce, and it divides the sum by the group size."""
    assert run_ranks(_avg_premise, 2, op) == [[2.0 if op == "avg" else 4.0, 1.0 if op == "avg" else 2.0]] * 2


def _avg_premise(op: str) -> list[float]:
    reduce = dist.ReduceOp.AVG if op == "avg" else dist.ReduceOp.SUM
    work = torch.full((2,), 2.0 * (dist.get_rank() + 1) - 1)  # 1 and 3: average 2
    dist.reduce_scatter_tensor(work[dist.get_rank():dist.get_rank() + 1], work, op=reduce)
    one = torch.ones(1)
    dist.all_reduce(one, op=reduce)
    return [work[dist.get_rank()].item(), one.item()]
