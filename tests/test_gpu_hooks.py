"""The GPU suite's hook checks (``pytest -m gpu``; skipped without CUDA): every hook of the catalog
on CUDA buckets, and a checkpoint of every stateful hook saved and resumed on CUDA.

Two CUDA layouts (marked ``gpu``: their ranks start with ``spawn``, conftest.py):

- ``cuda-nccl-1``: one rank on NCCL (NCCL cannot put two ranks on one GPU): the hooks' native CUDA
  path, hook state on the GPU;
- ``cuda-gloo-2``: two ranks on one GPU over Gloo, which carries CUDA tensors: the host staging
  path (:func:`flashsgd.comm.hook_common.ddp_hook`);
- ``cuda-nccl-2``: two GPUs, one NCCL rank each (skipped on one GPU): the multi-GPU NCCL paths.

The same checks on two CPU ranks (``cpu-gloo-2``) run in the default suite, so an expectation of
this file that stops holding shows on CPU first, not only on a GPU machine. (Not one forked CPU
rank: it runs every core's thread and hangs where this process ran a parallel region before,
GNU OpenMP after fork; the CUDA tests' ranks, the one-rank CPU reference included, are spawned.)

The reference is dense training: a hook whose exchange is exact (the all-reduces; Top-k and its
variants at density 1.0) trains like DDP's own all-reduce on the same device (tolerance as
tests/test_hooks.py: rtol 1e-5, atol 1e-6), ``noop`` like local SGD; a compressing exchange
(density 0.1, exact selection; PowerSGD rank 1) trains on CUDA as the same exchange does on CPU
ranks of the same layout (whose semantics the CPU suite checks against dense training; rtol 1e-4,
atol 1e-5: another summation order in the matmuls). The model has several DDP buckets, and the
sparse exchanges compress from ``start_iter`` = 2 on (two dense steps first).

A checkpoint (state_dict -> torch.save -> torch.load(map_location="cpu") -> load_state_dict, then
``rebuild_buckets``) of every stateful hook resumes on CUDA bit for bit: the hook state, loaded
on the CPU, must follow the device of the bucket it serves.

Also here, the premise of the whole GPU suite: the availability check that conftest.py makes
before it forks does not poison fork; and the overlap of the dense hooks on NCCL (issue 31): the
chain of collectives they return is issued without a host synchronization, and neither the host
nor the calling (backward) stream waits for it (its numerics are checked on CPU ranks by
tests/test_dense_native.py, where the same chain runs on Gloo).
"""

from __future__ import annotations

import io
import os
import subprocess
import sys
import textwrap
import time

import pytest
import torch
import torch.distributed as dist
from torch import nn
from torch.nn.parallel import DistributedDataParallel as DDP

from ddp_helpers import flat_params, tiny_net
from flashsgd.comm.dense_native import native_chain
from flashsgd.comm.dense_hooks import DENSE_HOOKS, DenseHookState, dense_hook
from flashsgd.comm.hooks import HOOKS, rebuild_buckets, register_hook
from flashsgd.exchanges import EXCHANGES

STEPS, STOP = 6, 4  # the sparse exchanges and PowerSGD compress from step 2 (start_iter) on
# (device, backend, world); the CPU layout runs in the default suite: the control that every
# expectation below holds where it can be checked (about 1 s)
LAYOUTS = [pytest.param(("cpu", "gloo", 2), id="cpu-gloo-2"),
           pytest.param(("cuda", "nccl", 1), id="cuda-nccl-1", marks=pytest.mark.gpu),
           pytest.param(("cuda", "gloo", 2), id="cuda-gloo-2", marks=pytest.mark.gpu),
           # two GPUs, one NCCL rank each: the grouped point-to-point rounds and NCCL subgroups
           # (never run here: no machine with 2+ GPUs was lent; docs/gpu.md)
           pytest.param(("cuda", "nccl", 2), id="cuda-nccl-2",
                        marks=[pytest.mark.gpu, pytest.mark.skipif(torch.cuda.device_count() < 2,
                                                                   reason="needs 2 GPUs")])]
ENV = {"CUBLAS_WORKSPACE_CONFIG": ":4096:8"}  # one cuBLAS workspace: run-to-run identical matmuls
TIMEOUT_S = 200.0  # a spawned rank imports torch and starts CUDA and NCCL (subgroups per hook) first

# hook -> option sets under which its update IS the dense average (several layouts where it has any)
EXACT = {
    "native": [{}],
    "ring": [{}, {"threaded": False}],
    "hierarchical": [{}, {"ranks_per_node": 1}],
    "torus2d": [{}, {"ranks_per_node": 1}],
    "topk": [{"density": 1.0}],
    "gtopk": [{"density": 1.0}],
    "hgtopk": [{"density": 1.0, "node_split": s, "ranks_per_node": r}
               for s in ("leader", "slices", "sparse") for r in (None, 1)],
}
# hook -> option sets that compress (compared with the same exchange on CPU ranks), trained in
# float64: CUDA's and the CPU's matmuls sum in other orders (~1e-7 relative in fp32), enough to swap
# two entries tied near the k-th magnitude and send another one; in float64 (~1e-16) no such swap
COMPRESSED_DTYPE = torch.float64
COMPRESSING = {
    "topk": [{"density": 0.1, "selection": "exact"}],
    "gtopk": [{"density": 0.1, "selection": "exact"}],
    "hgtopk": [{"density": 0.1, "selection": "exact", "node_split": s, "ranks_per_node": 1}
               for s in ("leader", "slices", "sparse")],
    "oktopk": [{"density": 0.1, "selection": "exact"}],
    "powersgd": [{}],
}
# stateful hooks -> options of the resume check (sampled selection: its generator is state too)
STATEFUL = {"topk": {"density": 0.1}, "gtopk": {"density": 0.1}, "hgtopk": {"density": 0.1, "ranks_per_node": 1},
            "oktopk": {"density": 0.1}, "powersgd": {}}

def test_the_tables_cover_the_catalog():
    """Every hook of the catalog is checked on CUDA: a new exchange must be added here."""
    assert set(HOOKS) == set(EXCHANGES) == set(EXACT) | set(COMPRESSING) | {"noop"}
    stateful = {n for n, e in EXCHANGES.items() if e.family in ("sparse", "lowrank")}
    assert set(STATEFUL) == stateful


# ------------------------------------------------------------------------------ inside the ranks -----

def _device(device: str) -> torch.device:
    """The rank's device: on Gloo every rank shares GPU 0 (NCCL's launcher has bound it already)."""
    if device == "cuda" and "nccl" not in str(dist.get_backend()):
        torch.cuda.set_device(0)
    return torch.device(device, torch.cuda.current_device()) if device == "cuda" else torch.device("cpu")


def _loss(model: nn.Module, step: int, device: torch.device) -> torch.Tensor:
    g = torch.Generator().manual_seed(1000 * step + dist.get_rank())  # made on the CPU: the same data
    x, y = torch.randn(16, 20, generator=g), torch.randint(0, 5, (16,), generator=g)
    dtype = next(model.parameters()).dtype
    return nn.functional.cross_entropy(model(x.to(device, dtype)), y.to(device))


def _build(name: str | None, options: dict, device: torch.device, seed: int = 0,
           dtype: torch.dtype = torch.float32):
    """tiny_net on ``device``; in DDP with small buckets (several) and the hook unless ``name`` is None."""
    model = tiny_net(seed).to(device, dtype)
    wrapped = DDP(model, bucket_cap_mb=0.01) if name else model
    state = register_hook(wrapped, name, **options) if name else None
    return model, wrapped, state, torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)


def _steps(wrapped: nn.Module, opt: torch.optim.Optimizer, first: int, last: int, device: torch.device) -> None:
    for s in range(first, last):
        opt.zero_grad()
        _loss(wrapped, s, device).backward()
        opt.step()


def _trained(name: str | None, options: dict, device: torch.device,
             dtype: torch.dtype = torch.float32) -> torch.Tensor:
    model, wrapped, _, opt = _build(name, options, device, dtype=dtype)
    _steps(wrapped, opt, 0, STEPS, device)
    return flat_params(model).cpu()


def _key(name: str, options: dict) -> str:
    return f"{name} {options}"


def _catalog(device: str) -> dict:
    """Every catalog case trained for STEPS steps: {case: flat parameters}, plus the dense
    reference ("dense": DDP's all-reduce) and local SGD ("local"); as lists of floats (no tensor
    crosses the process boundary)."""
    dev = _device(device)
    out = {"dense": _trained("native", {}, dev), "local": _trained(None, {}, dev),
           _key("noop", {}): _trained("noop", {}, dev)}
    for table, dtype in ((EXACT, torch.float32), (COMPRESSING, COMPRESSED_DTYPE)):
        for name, option_sets in table.items():
            for options in option_sets:
                out[_key(name, options)] = _trained(name, options, dev, dtype)
    return {case: params.tolist() for case, params in out.items()}


def _resume(device: str) -> dict:
    """For every stateful hook: whether a run resumed from a checkpoint at STOP (loaded on the CPU)
    ends with the uninterrupted run's parameters, bit for bit, and the parameters' difference."""
    dev = _device(device)
    out = {}
    for name, options in STATEFUL.items():
        reference = _trained(name, options, dev)
        model, wrapped, state, opt = _build(name, options, dev)
        _steps(wrapped, opt, 0, STOP, dev)
        buf = io.BytesIO()
        torch.save({"model": model.state_dict(), "optimizer": opt.state_dict(), "hook": state.state_dict()}, buf)
        buf.seek(0)
        ckpt = torch.load(buf, map_location="cpu", weights_only=True)
        model, wrapped, state, opt = _build(name, options, dev, seed=123)  # the restarted process
        model.load_state_dict(ckpt["model"])
        opt.load_state_dict(ckpt["optimizer"])
        state.load_state_dict(ckpt["hook"])
        rebuild_buckets(wrapped, lambda: _loss(wrapped, 999, dev))
        _steps(wrapped, opt, STOP, STEPS, dev)
        got = flat_params(model).cpu()
        out[name] = (torch.equal(got, reference), (got - reference).abs().max().item())
    return out


# ------------------------------------------------------------------------------ the tests -----------

def _close(a: list[float], b: list[float], rtol: float, atol: float) -> str | None:
    """None when close, else the largest difference in words."""
    a, b = torch.tensor(a), torch.tensor(b)
    return None if torch.allclose(a, b, rtol=rtol, atol=atol) else f"max |diff| {(a - b).abs().max().item():.3g}"


@pytest.mark.parametrize("layout", LAYOUTS)
def test_every_hook_on_cuda_buckets_trains_like_the_dense_reference(run_ranks, layout):
    device, backend, world = layout
    results = run_ranks(_catalog, world, device, backend=backend, env=ENV, timeout_s=TIMEOUT_S)
    # the compressing exchanges' reference: the same exchange on CPU ranks of the same layout
    cpu = results if device == "cpu" else run_ranks(_catalog, world, "cpu", env=ENV)
    wrong = []
    for rank, (got, host) in enumerate(zip(results, cpu)):
        for name, option_sets in EXACT.items():
            for options in option_sets:
                why = _close(got[_key(name, options)], got["dense"], 1e-5, 1e-6)
                wrong += [f"rank {rank} {_key(name, options)} vs dense: {why}"] if why else []
        why = _close(got[_key("noop", {})], got["local"], 1e-6, 1e-7)
        wrong += [f"rank {rank} noop vs local SGD: {why}"] if why else []
        for name, option_sets in COMPRESSING.items():
            for options in option_sets:
                why = _close(got[_key(name, options)], host[_key(name, options)], 1e-4, 1e-5)
                wrong += [f"rank {rank} {_key(name, options)} on CUDA vs CPU: {why}"] if why else []
        assert _close(got[_key("gtopk", COMPRESSING["gtopk"][0])], got["dense"], 1e-5, 1e-6)  # it compressed
    assert wrong == []


@pytest.mark.parametrize("layout", LAYOUTS)
def test_every_stateful_hook_resumes_exactly_from_a_checkpoint_on_cuda(run_ranks, layout):
    device, backend, world = layout
    for rank, result in enumerate(run_ranks(_resume, world, device, backend=backend, env=ENV, timeout_s=TIMEOUT_S)):
        assert {name: ok for name, (ok, _) in result.items()} == {name: True for name in STATEFUL}, (rank, result)


FORK_AFTER_CHECK = textwrap.dedent("""
    import multiprocessing as mp, sys
    import torch

    def child(q):
        try:
            q.put(float(torch.ones(2, device="cuda").sum()))
        except Exception as exc:
            q.put(str(exc))

    if __name__ == "__main__":
        assert torch.cuda.is_available()
        assert not torch.cuda.is_initialized()
        ctx = mp.get_context("fork")
        q = ctx.Queue()
        p = ctx.Process(target=child, args=(q,))
        p.start()
        print(q.get(timeout=120))
        p.join()
""")


def _fork_after_check(nvml: bool) -> str:
    env = {k: v for k, v in os.environ.items() if k != "PYTORCH_NVML_BASED_CUDA_CHECK"}
    if nvml:
        env["PYTORCH_NVML_BASED_CUDA_CHECK"] = "1"
    run = subprocess.run([sys.executable, "-c", FORK_AFTER_CHECK], env=env, capture_output=True, text=True,
                         timeout=180)
    assert run.returncode == 0, run.stderr
    return run.stdout.strip()


def test_conftest_makes_the_cuda_check_fork_safe():
    """Set before any test module asked torch.cuda (skip marks, parameter lists at collection)."""
    assert os.environ.get("PYTORCH_NVML_BASED_CUDA_CHECK") == "1"


@pytest.mark.gpu
def test_a_process_forked_after_the_nvml_check_can_use_cuda():
    """What conftest.py relies on: with PYTORCH_NVML_BASED_CUDA_CHECK=1 the availability check
    leaves a forked child free to use CUDA; torch's default check does not (the control)."""
    assert _fork_after_check(nvml=True) == "2.0"
    assert "Cannot re-initialize CUDA in forked subprocess" in _fork_after_check(nvml=False)


# ------------------------------------------------------------------------------ overlap on NCCL ------

HOLD_CYCLES = 2 ** 31  # GPU clock cycles of torch.cuda._sleep: about 0.7-1.2 s at 1.8-3 GHz
POLL_S = 0.3           # well inside the hold: what completed by then did not wait for the held exchange


class _Bucket:
    """What the dense hook reads of a ``dist.GradBucket``: its flat buffer."""

    def __init__(self, buf: torch.Tensor) -> None:
        self.buf = buf

    def buffer(self) -> torch.Tensor:
        return self.buf


def _held(issue, strict: bool = True) -> dict:
    """Run ``issue()`` (it queues an exchange on the default group and returns its Future, or None)
    while the default group's NCCL stream is held: a side stream sleeps HOLD_CYCLES, then queues an
    all-reduce there, so every later collective of the group waits for the sleep on the GPU.

    Returns ``issue_s`` (host seconds of the call, under ``set_sync_debug_mode("error")`` when
    ``strict``: a host synchronization inside raises), ``caller_free`` (an event recorded on the
    calling stream right after the call completed within POLL_S: that stream, backward's in a hook,
    did not wait for the exchange) and ``pending`` (the exchange had not completed by then: the
    call returned before its work did).
    """
    hold, x = torch.cuda.Stream(), torch.ones(1, device="cuda")
    torch.cuda.synchronize()
    hold.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(hold):
        torch.cuda._sleep(HOLD_CYCLES)
        dist.all_reduce(x, async_op=True)
    t0 = time.perf_counter()
    torch.cuda.set_sync_debug_mode("error" if strict else "default")
    try:
        fut = issue()
    finally:
        torch.cuda.set_sync_debug_mode("default")
    issue_s = time.perf_counter() - t0
    after = torch.cuda.current_stream().record_event()  # the next backward kernel, in a hook
    done = after
    if fut is not None:
        finished = torch.cuda.Stream()
        with torch.cuda.stream(finished):
            fut.wait()  # this stream waits for the chain's last stage (the host does not)
            done = finished.record_event()
    deadline = time.perf_counter() + POLL_S
    while not after.query() and time.perf_counter() < deadline:
        time.sleep(0.005)
    out = {"issue_s": issue_s, "caller_free": after.query(), "pending": not done.query()}
    torch.cuda.synchronize()
    return out


def _overlap() -> dict:
    """Inside an NCCL rank (one per GPU): the dense exchanges under :func:`_held`, and a control
    (an all-reduce waited for, which must hold the calling stream: else the check proves nothing).

    Cases: :func:`native_chain` with the default group as inner group (and, at world 1, as outer
    group too: one rank, so all three stages run; at world 2 inner x outer must partition the
    ranks, so no outer group: the ring), lengths 1000 (in place) and 1001 (padded when the world
    is 2); at world 2 also each dense hook on a bucket of those lengths (default topology: its
    groups of 2 ranks are the default group, the one held). Values: element i of rank r is
    16 i + r + 1; the average over W ranks is 16 i + (W + 1) / 2.
    """
    dev = torch.device("cuda", torch.cuda.current_device())
    rank, world = dist.get_rank(), dist.get_world_size()
    inner, outer = dist.group.WORLD, dist.group.WORLD if world == 1 else None

    def chain(b: torch.Tensor) -> torch.futures.Future:
        return native_chain(b, inner, outer, "avg", timeout_s=60.0, where="overlap check")

    cases = {f"chain n={n}": (n, chain) for n in (1000, 1001)}
    if world > 1:
        for name in DENSE_HOOKS:
            state = DenseHookState(name)
            for n in (1000, 1001):
                cases[f"hook {name} n={n}"] = (n, lambda b, state=state: dense_hook(state, _Bucket(b)))
    def values(n: int, offset: float) -> torch.Tensor:
        return torch.arange(n, device=dev, dtype=torch.float32) * 16 + offset

    out = {}
    for key, (n, call) in cases.items():
        call(values(n, rank + 1)).wait()  # warm-up: communicators created, allocations cached
        torch.cuda.synchronize()
        buf = values(n, rank + 1)
        result = _held(lambda: call(buf))
        expected = values(n, (world + 1) / 2)
        result["value"] = bool(torch.equal(buf, expected))
        out[key] = result
    y = torch.ones(4, device=dev)
    dist.all_reduce(y)
    # the control: an exchange waited for (what a hook returning a completed Future does). Not
    # ``dist.all_reduce(y)``: on an H100 (torch 2.11, NCCL 2.28, one rank) it left the calling stream
    # free, as if it ran there and not behind the held collective (not a premise to build on)
    def control() -> None:  # ``Work.wait()`` returns True, not a Future: nothing more for _held to wait on
        dist.all_reduce(y, async_op=True).wait()

    out["control: all_reduce waited for"] = _held(control, strict=False)
    return out


@pytest.mark.gpu
@pytest.mark.parametrize("world", [pytest.param(1, id="cuda-nccl-1"),
                                   pytest.param(2, id="cuda-nccl-2", marks=pytest.mark.skipif(
                                       torch.cuda.device_count() < 2, reason="needs 2 GPUs"))])
def test_dense_hooks_overlap_backward_on_nccl(run_ranks, world):
    """Issue 31: the dense hooks' NCCL chain returns before its work completes, without a host
    synchronization, and leaves the calling (backward) stream free; a collective waited for (the
    control) does hold that stream."""
    for rank, result in enumerate(run_ranks(_overlap, world, backend="nccl", timeout_s=TIMEOUT_S)):
        control = result.pop("control: all_reduce waited for")
        assert not control["caller_free"], (rank, control)  # the premise: a waited exchange holds the stream
        for key, r in result.items():
            assert r["caller_free"] and r["pending"] and r["value"], (rank, key, r)
            assert r["issue_s"] < POLL_S, (rank, key, r)
