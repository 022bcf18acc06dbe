"""DDP hook ``powersgd`` (flashsgd.comm.powersgd_hooks): PowerSGD by name, its options, checkpoints
through state_dict()/load_state_dict(), and flashsgd's batched PowerSGD (flashsgd.comm.lowrank)
against torch's own ``powerSGD_hook``: the same gradients and memories step by step, a checkpoint
of torch's hook state continued, and whole DDP runs."""

from __future__ import annotations

import copy
import io
import math

import pytest
import torch
import torch.distributed as dist
from torch import nn
from torch.nn.parallel import DistributedDataParallel as DDP

from flashsgd.comm.hooks import HOOKS, hook_options, register_hook
from flashsgd.exchanges import LowRankOptions


from ddp_helpers import flat_params as _params  # noqa: E402
from ddp_helpers import tiny_net as _net  # noqa: E402
from ddp_helpers import train_steps as _train  # noqa: E402


def test_registered_options_and_bad_input():
    assert "powersgd" in HOOKS
    assert hook_options("powersgd", matrix_approximation_rank=2, density=0.01, seed=3, timeout_s=9.0) == \
        LowRankOptions(matrix_approximation_rank=2, seed=3, timeout_s=9.0)
    net = nn.Linear(2, 2)
    for opts, word in (({"matrix_approximation_rank": 0}, "matrix_approximation_rank must be an integer >= 1"),
                       ({"start_iter": 1}, "start_iter must be an integer >= 2"),
                       ({"timeout_s": 0}, "timeout_s"), ({"density": 0.1}, "unknown option")):
        with pytest.raises(ValueError, match=word):
            register_hook(net, "powersgd", **opts)


def _body():
    # 1. it compresses (differs from dense after start_iter) and trains
    ref = DDP(_net())
    _train(ref, torch.optim.SGD(ref.parameters(), lr=0.1, momentum=0.9), 6)
    model = DDP(_net())
    state = register_hook(model, "powersgd", matrix_approximation_rank=2)
    opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    _train(model, opt, 3)
    assert state.powersgd.iter == 3, state.powersgd.iter
    assert state.powersgd.q_memory_dict, "nothing compressed"
    # 2. checkpoint round trip (torch.save, weights only) gives the same trajectory
    buf = io.BytesIO()
    torch.save({"hook": state.state_dict(), "model": model.module.state_dict(),
                "opt": opt.state_dict()}, buf)
    _train(model, opt, 3, first=3)
    buf.seek(0)
    ck = torch.load(buf, weights_only=True)
    fresh = _net(seed=5)
    fresh.load_state_dict(ck["model"])
    model_b = DDP(fresh)
    state_b = register_hook(model_b, "powersgd", matrix_approximation_rank=2)
    state_b.load_state_dict(ck["hook"])
    opt_b = torch.optim.SGD(model_b.parameters(), lr=0.1, momentum=0.9)
    opt_b.load_state_dict(copy.deepcopy(ck["opt"]))
    _train(model_b, opt_b, 3, first=3)
    assert torch.equal(_params(model), _params(model_b)), (_params(model) - _params(model_b)).abs().max()
    assert not torch.allclose(_params(model), _params(ref))
    return True


def test_powersgd_ddp_checkpoint(run_ranks):
    assert all(run_ranks(_body, 2))


def _many_buckets(steps: int):
    """PowerSGD over several DDP buckets on Gloo: every rank must issue the buckets' P and Q
    all-reduces in the same order (the communication thread runs one bucket's chain at a time;
    torch's hook, run before, chained them in Future callbacks on Gloo's threads)."""
    torch.manual_seed(0)
    net = nn.Sequential(*[m for _ in range(6) for m in (nn.Linear(64, 64), nn.ReLU())], nn.Linear(64, 5))
    model = DDP(net, bucket_cap_mb=0.02)  # ~5 buckets of 64 x 64 weights
    register_hook(model, "powersgd", matrix_approximation_rank=2)
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    for s in range(steps):
        g = torch.Generator().manual_seed(s)  # the same batch on every rank: the same update
        x, y = torch.randn(8, 64, generator=g), torch.randint(0, 5, (8,), generator=g)
        opt.zero_grad()
        nn.functional.cross_entropy(model(x), y).backward()
        opt.step()
    return _params(model).tolist()  # plain floats: no tensor crosses the process boundary


def test_powersgd_many_buckets_keeps_the_collective_order(run_ranks):
    a, b = run_ranks(_many_buckets, 2, 12, timeout_s=60)
    assert a == b


def _cpu_buckets_where_cuda_is_available():
    """CPU ranks on a machine with a GPU (made to look like one): torch's PowerSGD hook called
    ``torch.cuda.synchronize(cpu)`` after each decompression (a ValueError on a GPU machine; on
    this CPU build an AssertionError); flashsgd's PowerSGD never synchronizes."""
    torch.cuda.is_available = lambda: True  # this rank's process only
    model = DDP(_net())
    state = register_hook(model, "powersgd", matrix_approximation_rank=2)
    _train(model, torch.optim.SGD(model.parameters(), lr=0.1), 4)
    return state.powersgd.iter, bool(state.powersgd.q_memory_dict)


def test_cpu_buckets_train_where_cuda_is_available(run_ranks):
    """Found by the GPU check (H100): every powersgd run of CPU ranks on a GPU machine failed."""
    assert run_ranks(_cpu_buckets_where_cuda_is_available, 2) == [(4, True)] * 2


# ------------------------------------------------------------- flashsgd's PowerSGD == torch's hook -----

class _Bucket:
    """What a DDP hook reads of a ``dist.GradBucket`` (torch's hook and flashsgd's alike): one flat
    buffer, the parameters in buffer order, their gradients as views of it, index and last flag."""

    def __init__(self, index: int, params: list[torch.Tensor], flat: torch.Tensor, last: bool) -> None:
        self._index, self._params, self._flat, self._last = index, params, flat, last

    def buffer(self) -> torch.Tensor:
        return self._flat

    def parameters(self) -> list[torch.Tensor]:
        return self._params

    def gradients(self) -> list[torch.Tensor]:
        views, at = [], 0
        for p in self._params:
            views.append(self._flat[at:at + p.numel()].view_as(p))
            at += p.numel()
        return views

    def index(self) -> int:
        return self._index

    def is_last(self) -> bool:
        return self._last


# buckets of a model, in DDP's call order: shapes interleaved, several matrices of one shape
# (batched together), conv-like 4-D tensors (n x rest), 1-D tensors, a matrix too small to compress,
# a bucket with nothing to compress, and ranks above 2 (QR) where the matrices allow
BUCKET_SHAPES = [[(16, 8), (16,), (24, 4, 3, 3), (16, 8), (24,), (16, 8), (3, 3), (24, 4, 3, 3)],
                 [(32, 3, 3, 3), (32,), (32, 3, 3, 3), (10, 32), (10,)],
                 [(7,), (5,)],
                 [(40, 40)]]


def _buckets(dtype: torch.dtype = torch.float32) -> list[list[torch.Tensor]]:
    """Stand-in parameters per bucket (only their shapes and identities are read)."""
    return [[torch.empty(s, dtype=dtype) for s in shapes] for shapes in BUCKET_SHAPES]


def _grads(step: int, dtype: torch.dtype) -> list[torch.Tensor]:
    """This rank's flat gradient of each bucket at ``step`` (low-rank-ish plus noise, so that the
    power iteration has a direction to find)."""
    g = torch.Generator().manual_seed(100 * step + dist.get_rank())
    out = []
    for shapes in BUCKET_SHAPES:
        parts = []
        for s in shapes:
            n, m = s[0], max(1, math.prod(s) // s[0])
            parts.append((torch.randn(n, 2, generator=g) @ torch.randn(2, m, generator=g)
                          + 0.1 * torch.randn(n, m, generator=g)).flatten())
        out.append(torch.cat(parts).to(dtype))
    return out


def _torch_state(rank: int, **settings):
    """torch's state as ``make_powersgd`` builds it (start_iter 2, rate 2, seed 7 unless given)."""
    from torch.distributed.algorithms.ddp_comm_hooks.powerSGD_hook import PowerSGDState

    settings = {"random_seed": 7, **settings}
    return PowerSGDState(dist.group.WORLD, matrix_approximation_rank=rank, start_powerSGD_iter=2,
                         min_compression_rate=2.0, compression_stats_logging_frequency=10 ** 9, **settings)


def _ours(rank: int, params: list[list[torch.Tensor]], **settings):
    from flashsgd.comm.powersgd_hooks import PowerSGDHookState, powersgd_hook

    positions = {id(p): i for i, p in enumerate(p for bucket in params for p in bucket)}
    return PowerSGDHookState(_torch_state(rank, **settings), positions), powersgd_hook


def _run_step(hook, state, params, flats) -> None:
    for i, flat in enumerate(flats):
        out = hook(state, _Bucket(i, params[i], flat, i == len(flats) - 1)).wait()
        out = out[0] if isinstance(out, list) else out
        assert out.data_ptr() == flat.data_ptr()  # the bucket itself, averaged in place


def _rel(a: torch.Tensor, b: torch.Tensor) -> float:
    """max |a - b| / max |b| (0 for two empty tensors)."""
    a, b = a.double(), b.double()
    return 0.0 if b.numel() == 0 else ((a - b).abs().max() / b.abs().max().clamp_min(1e-30)).item()


def _memories_rel(ours, theirs) -> float:
    worst = 0.0
    for name in ("error_dict", "p_memory_dict", "q_memory_dict"):
        mine, ref = getattr(ours, name), getattr(theirs, name)
        assert sorted(mine) == sorted(ref), (name, sorted(mine), sorted(ref))
        for k in ref:
            assert mine[k].shape == ref[k].shape and mine[k].dtype == ref[k].dtype, (name, k)
            worst = max(worst, _rel(mine[k], ref[k]))
    return worst


def _equal_to_torch(rank: int, steps: int, dtype_name: str = "float32", settings: dict | None = None,
                    batched: bool = False):
    """flashsgd's hook and torch's ``powerSGD_hook`` on the same gradients of every bucket, step by
    step (2 dense steps, then compressed: the first draws Q, the next warm-start from it and add
    the error): the largest relative difference of the averaged gradients and of the memories,
    and torch's counters and RNG state against ours. ``batched``: flashsgd's CUDA path (one
    ``bmm`` per group of matrices of one shape, forced on the CPU), else its CPU path."""
    import contextlib

    from torch.distributed.algorithms.ddp_comm_hooks.powerSGD_hook import powerSGD_hook

    from flashsgd.host_syncs import as_if_cuda

    dtype = getattr(torch, dtype_name)
    settings = settings or {}
    params = _buckets(dtype)
    ours, hook = _ours(rank, params, **settings)
    theirs = _torch_state(rank, **settings)
    worst_grad = worst_memory = 0.0
    for step in range(steps):
        flats = _grads(step, dtype)
        mine = [f.clone() for f in flats]
        with as_if_cuda() if batched else contextlib.nullcontext():
            _run_step(hook, ours, params, mine)
        for i, flat in enumerate(flats):  # torch's hook, one bucket at a time (its chain waited for)
            powerSGD_hook(theirs, _Bucket(i, params[i], flat, i == len(flats) - 1)).wait()
        worst_grad = max(worst_grad, *(_rel(a, b) for a, b in zip(mine, flats)))
        worst_memory = max(worst_memory, _memories_rel(ours.powersgd, theirs))
    s = ours.powersgd
    same = all(getattr(s, k) == getattr(theirs, k) for k in
               ("iter", "total_numel_before_compression", "total_numel_after_compression", "next_stats_report"))
    rng_same = s.rng.randint(10 ** 9) == theirs.rng.randint(10 ** 9)
    return worst_grad, worst_memory, same, rng_same, len(s.q_memory_dict)


@pytest.mark.parametrize("batched", [True, False], ids=["cuda-path", "cpu-path"])
@pytest.mark.parametrize("rank", [1, 2, 4])
def test_the_batched_powersgd_equals_torchs_hook(run_ranks, rank, batched):
    """Gradients and memories (error, P, Q) after each of 6 steps, 4 buckets, at 2 Gloo ranks:
    equal to torch's per-matrix hook to 1e-5 relative (Gram-Schmidt for r <= 2, QR for r = 4) on
    the CUDA path (batched products: torch's CPU ``bmm`` of a batch sums in another order), and
    bit for bit on the CPU path (each matrix's products as torch's hook runs them)."""
    for grad, memory, counters, rng, buckets in run_ranks(_equal_to_torch, 2, rank, 6, "float32", None, batched):
        assert grad <= 1e-5 and memory <= 1e-5, (grad, memory)
        assert batched or grad == memory == 0.0, (grad, memory)
        assert counters and rng and buckets == 4


def test_the_batched_powersgd_equals_torchs_hook_without_warm_start_and_in_half_precision(run_ranks):
    """Q drawn afresh every step (torch's ``warm_start=False``: one RNG draw per bucket and step),
    without error feedback; and bf16 buckets (Gram-Schmidt in bf16, as torch)."""
    for batched in (True, False):
        for grad, memory, counters, rng, _ in run_ranks(_equal_to_torch, 2, 2, 5, "float32",
                                                        {"warm_start": False, "use_error_feedback": False}, batched):
            assert grad <= 1e-5 and memory <= 1e-5 and counters and rng, (grad, memory)
        for grad, memory, counters, rng, _ in run_ranks(_equal_to_torch, 2, 2, 5, "bfloat16", None, batched):
            assert grad <= 2e-2 and memory <= 2e-2 and counters and rng, (grad, memory)  # bf16: 8 bits


def _resume_from_torchs_checkpoint(rank: int):
    """A checkpoint in the format written while torch's own hook ran inside (torch's
    ``PowerSGDState`` memories, layouts, the NumPy RNG), taken after 4 steps of torch's hook, loaded
    into flashsgd's hook: the next 3 steps equal torch's hook continuing (gradients, memories)."""
    from torch.distributed.algorithms.ddp_comm_hooks.powerSGD_hook import powerSGD_hook

    from flashsgd.comm.powersgd_hooks import PowerSGDHookState

    params = _buckets()
    theirs = _torch_state(rank)
    for step in range(4):
        for i, flat in enumerate(_grads(step, torch.float32)):
            powerSGD_hook(theirs, _Bucket(i, params[i], flat, i == len(params) - 1)).wait()
    positions = {id(p): i for i, p in enumerate(p for bucket in params for p in bucket)}
    old = PowerSGDHookState(theirs, positions)  # the old module's container: state_dict of torch's state
    for i, bucket in enumerate(params):
        old.layouts[i] = tuple((positions[id(p)], tuple(p.shape)) for p in bucket)
    buf = io.BytesIO()
    torch.save(old.state_dict(), buf)
    buf.seek(0)
    saved = torch.load(buf, weights_only=True)
    keys = sorted(saved)
    ours, hook = _ours(rank, params)
    ours.load_state_dict(saved)
    worst = 0.0
    for step in range(4, 7):
        flats = _grads(step, torch.float32)
        mine = [f.clone() for f in flats]
        _run_step(hook, ours, params, mine)
        for i, flat in enumerate(flats):
            powerSGD_hook(theirs, _Bucket(i, params[i], flat, i == len(flats) - 1)).wait()
        worst = max(worst, *(_rel(a, b) for a, b in zip(mine, flats)), _memories_rel(ours.powersgd, theirs))
    return worst, keys


def test_a_checkpoint_of_torchs_hook_state_loads_and_continues_identically(run_ranks):
    for worst, keys in run_ranks(_resume_from_torchs_checkpoint, 2, 2):
        assert worst <= 1e-5, worst
        assert keys == ["algorithm", "error_dict", "iter", "layouts", "next_stats_report", "p_memory_dict",
                        "pending", "q_memory_dict", "rank", "rng", "total_numel_after_compression",
                        "total_numel_before_compression", "world"]


def test_memories_follow_each_parameter_when_the_layout_changes():
    """DDP's rebuild reverses a bucket's parameters: the error, P and Q of each parameter move with
    it, P and Q in the new bucket's order of shapes (groups of one shape, first occurrence first),
    so that the interleaved shapes of a bucket do not hand one matrix's P to another."""
    from flashsgd.comm import lowrank

    params = _buckets()[0]
    ours, _ = _ours(2, [params])
    s = ours.powersgd
    layout = tuple((i, tuple(p.shape)) for i, p in enumerate(params))
    plan = ours.plan(layout)
    s.error_dict[0] = torch.arange(sum(plan.numels), dtype=torch.float32)
    s.p_memory_dict[0] = torch.arange(plan.p_numel, dtype=torch.float32) + 1e4
    s.q_memory_dict[0] = torch.arange(plan.q_numel, dtype=torch.float32) + 2e4
    before = {name: dict(zip(range(len(params)), ours._cut(name, getattr(s, name)[0], layout)))
              for name in ("error_dict", "p_memory_dict", "q_memory_dict")}
    ours.layouts[0] = layout
    reversed_params = params[::-1]
    ours.follow_layout(_Bucket(0, reversed_params, torch.zeros(sum(plan.numels)), True))
    new_layout = ours.layouts[0]
    assert [pos for pos, _ in new_layout] == list(range(len(params)))[::-1]
    for name in before:
        pieces = ours._cut(name, getattr(s, name)[0], new_layout)
        for (pos, _), piece in zip(new_layout, pieces):
            assert torch.equal(piece, before[name][pos]), (name, pos)
    # the new P order: shapes by first occurrence in the reversed bucket
    new_plan = lowrank.plan_bucket([sh for _, sh in new_layout], 2, 2.0)
    assert [(g.n, g.m) for g in new_plan.groups] == [(24, 36), (16, 8)]


def _ddp_equal_to_torch(rank: int, steps: int, path: str):
    """Whole DDP runs (several buckets): flashsgd's hook and torch's (one bucket's chain waited for
    at a time, as the old module ran it on Gloo), the same data: the parameters after ``steps``.
    ``path``: flashsgd's ``cpu`` path; its CUDA path (batched, forced on the CPU) on a Gloo group
    (``cuda-gloo``: the communication thread); or on NCCL (``cuda-nccl``: the hook's NCCL branch
    forced in this forked rank, so the chain of Futures and the agreement before it run, with
    Gloo's all-reduces waited for inline)."""
    import contextlib

    from torch.distributed.algorithms.ddp_comm_hooks.powerSGD_hook import powerSGD_hook

    from flashsgd.comm import powersgd_hooks
    from flashsgd.comm.hook_common import completed_future
    from flashsgd.host_syncs import as_if_cuda

    batched = path != "cpu"
    if path == "cuda-nccl":
        powersgd_hooks.native_stages = lambda flat, group=None: True  # this forked rank only

    def net():
        torch.manual_seed(0)
        return nn.Sequential(nn.Conv2d(3, 8, 3), nn.ReLU(), nn.Conv2d(8, 8, 3), nn.ReLU(), nn.Conv2d(8, 8, 3),
                             nn.Flatten(), nn.Linear(8 * 4 * 4, 32), nn.ReLU(), nn.Linear(32, 32), nn.ReLU(),
                             nn.Linear(32, 5))

    def torch_hook(state, bucket):
        return completed_future(powerSGD_hook(state, bucket).wait())

    out = []
    for which in ("ours", "torch"):
        model = DDP(net(), bucket_cap_mb=0.01)
        if which == "ours":
            register_hook(model, "powersgd", matrix_approximation_rank=rank, seed=3)
        else:
            model.register_comm_hook(_torch_state(rank, random_seed=3), torch_hook)
        opt = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)
        for s in range(steps):
            g = torch.Generator().manual_seed(1000 * s + dist.get_rank())
            x, y = torch.randn(8, 3, 10, 10, generator=g), torch.randint(0, 5, (8,), generator=g)
            opt.zero_grad()
            with as_if_cuda() if batched and which == "ours" else contextlib.nullcontext():
                nn.functional.cross_entropy(model(x), y).backward()
            opt.step()
        out.append(_params(model))
    return _rel(out[0], out[1]), (out[0] - out[1]).abs().max().item()


@pytest.mark.parametrize("path", ["cpu", "cuda-gloo", "cuda-nccl"])
def test_ddp_training_with_the_batched_powersgd_equals_torchs_hook(run_ranks, path):
    for rel, diff in run_ranks(_ddp_equal_to_torch, 2, 2, 8, path):
        assert rel <= 1e-5, (rel, diff)
        assert path != "cpu" or diff == 0.0, diff
