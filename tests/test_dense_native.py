"""The native chain (what a dense algorithm's record runs on NCCL, :func:`flashsgd.comm.dense_native.native_chain`)
equals ``dist.all_reduce``, checked on real Gloo ranks, where the same chain runs with each collective
waited for (a completed Future per stage); a Gloo-only record is refused on NCCL at registration.

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

import dataclasses

import pytest
import torch
import torch._dynamo  # noqa: F401  DDP imports it: once here, not in every forked rank
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel as DDP

from ddp_helpers import flat_params, tiny_net, train_steps
from flashsgd.comm import dense, dense_hooks, dense_native
from flashsgd.comm.dense import DENSE, allreduce_future, nccl_algorithms
from flashsgd.comm.dense_hooks import DENSE_HOOKS
from flashsgd.comm.dense_native import NativeChain
from flashsgd.comm.hooks import register_hook
from flashsgd.comm.topology import get_topology
from test_dense import layouts

WORLD = 4
# (algorithm, ranks_per_node, grid): every algorithm with an NCCL chain on every layout it reads
# (inner group sizes 4, 2, 1 (no inner stage) on the node and grid layouts of 4 ranks)
CONFIGS = [(name, L, grid) for name in nccl_algorithms() for L, grid in layouts(name, WORLD)]
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
        chain = DENSE[name].native
        for n in (1, 5, 8, 97):
            for op in ("sum", "avg"):
                t = _values(rank, n, torch.float32)
                assert DENSE[name].fn(t, topo, op=op, check=False) is t
                out[f"{name} {L} {grid} {n} {op}"] = _wrong(t, n, torch.float32, op)
            if chain.inner and chain.outer:  # two levels: the per-stage functions (benchmarks/allreduce_stages.py)
                t = _values(rank, n, torch.float32)
                dense._two_level(t.view(-1), topo, name)
                out[f"{name} {L} {grid} {n} stages"] = _wrong(t, n, torch.float32, "sum")
    for name, L, grid in CONFIGS:
        if name not in DENSE_HOOKS:  # native: DDP's own all-reduce, the reference itself
            continue
        options = {k: v for k, v in (("ranks_per_node", L), ("grid", grid)) if v is not None}
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


# ------------------------------------------------------------------ Gloo-only records on NCCL ----

GLOO_ONLY = DENSE_HOOKS[0]
"""The algorithm a forked rank re-registers as Gloo-only (``native=None``) to check the refusal."""
ON_NCCL = ", ".join(n for n in nccl_algorithms() if n != GLOO_ONLY)


def _gloo_only() -> dict:
    """``GLOO_ONLY``'s record without its NCCL chain (this forked rank only): on Gloo it registers
    and trains as before; with the NCCL branch forced (what CUDA buckets on an NCCL group take)
    ``register_hook`` refuses it before any backward, and so does the chain itself."""
    dense.DENSE._items[GLOO_ONLY] = dataclasses.replace(DENSE[GLOO_ONLY], native=None)  # forked rank only
    out = {"gloo": torch.allclose(_trained(GLOO_ONLY, {}), _trained("native", {}), rtol=1e-5, atol=1e-6)}
    dense.native_stages = dense_hooks.native_stages = lambda flat, group=None: True
    wrapped = DDP(tiny_net(), bucket_cap_mb=0.01)
    for what, call in (("register_hook", lambda: register_hook(wrapped, GLOO_ONLY)),
                       ("chain", lambda: allreduce_future(torch.ones(8), GLOO_ONLY, get_topology(), "avg"))):
        try:
            call()
            out[what] = "no error"
        except ValueError as exc:
            out[what] = str(exc)
    other = next(n for n in DENSE_HOOKS if n != GLOO_ONLY)  # DDP takes one hook: none was registered
    out["then"] = type(register_hook(wrapped, other)).__name__
    return out


def test_a_gloo_only_algorithm_is_refused_on_nccl_at_registration(run_ranks):
    why = (f"dense all-reduce {GLOO_ONLY!r} is Gloo-only (its record in flashsgd.comm.dense.DENSE has "
           f"native=None: no NCCL chain), so it cannot reduce CUDA buckets on an NCCL group; algorithms "
           f"that run on NCCL: {ON_NCCL}; or run {GLOO_ONLY!r} on Gloo (CPU ranks, --backend gloo)")
    for result in run_ranks(_gloo_only, 2):
        assert result["gloo"], "a Gloo-only algorithm still trains on Gloo"
        assert result["register_hook"] == f"hook {GLOO_ONLY!r}: {why}"
        assert result["chain"] == f"{GLOO_ONLY} all-reduce of a CUDA tensor on NCCL: {why}"
        assert result["then"] == "DenseHookState"


def test_the_train_plan_refuses_a_gloo_only_algorithm_on_nccl(monkeypatch):
    from flashsgd.train.config import resolve
    from flashsgd.train.plan import build_plan

    monkeypatch.setitem(DENSE._items, GLOO_ONLY, dataclasses.replace(DENSE[GLOO_ONLY], native=None))
    cfg = resolve(cli={"workers": 2, "algorithm": GLOO_ONLY})
    assert build_plan(cfg, world=2, num_train=32000, local_spawn=True, backend="gloo").backend == "gloo"
    with pytest.raises(ValueError, match=f"^config key comm.algorithm={GLOO_ONLY!r} on backend nccl: dense "
                                         f"all-reduce {GLOO_ONLY!r} is Gloo-only .* that run on NCCL: {ON_NCCL};"):
        build_plan(cfg, world=2, num_train=32000, local_spawn=True, backend="nccl")


def test_a_record_states_its_nccl_path():
    with pytest.raises(TypeError, match="native"):
        dense.dense_algorithm("toy")  # Gloo-only must be said: native=None
    with pytest.raises(TypeError, match="dense algorithm 'toy': native must be a NativeChain or None"):
        dense.dense_algorithm("toy", native=("world", None))(lambda tensor: tensor)
    with pytest.raises(ValueError, match="NativeChain inner='rows' is not a group kind; valid: world, row, "
                                         "col, node, cross or None"):
        NativeChain("rows", None)
    with pytest.raises(ValueError, match="NativeChain needs an inner or an outer group kind"):
        NativeChain(None, None)
    assert "toy" not in DENSE
