"""The sparse exchanges make every tensor on the device of the data they serve (issue 22: CUDA
buckets must not meet CPU helpers). On CPU the check is strict anyway: the default device is set
to ``meta`` around the calls, so a tensor made without ``device=`` lands on ``meta`` and the first
op that mixes it with the CPU data fails. With CUDA present the same calls run on CUDA tensors
(one NCCL rank: the direct calls refuse CUDA tensors on Gloo, whose sends and receives take host
memory; a hook stages them through the host instead, tests/test_host_staging.py)."""

from __future__ import annotations

import contextlib

import pytest
import torch
import torch.distributed as dist

DEVICES = ["cpu", pytest.param("cuda", marks=pytest.mark.gpu)]  # cuda: skipped without CUDA (conftest.py)


@contextlib.contextmanager
def _strict(device: str):
    """On CPU: tensors made without an explicit device go to ``meta`` (and fail when mixed)."""
    if device != "cpu":
        yield
        return
    torch.set_default_device("meta")
    try:
        yield
    finally:
        torch.set_default_device(None)


def _exchanges(device: str):
    from flashsgd.comm.sparse import gtopk_allreduce, merge_topk, topk_allgather
    from flashsgd.comm.sparse.hier import hgtopk_allreduce
    from flashsgd.comm.sparse.select import (SelectionWorkspace, ThresholdReuse, topk_exact, topk_sampled,
                                             topk_threshold)
    from flashsgd.comm.topology import get_topology

    rank = dist.get_rank()
    topo = get_topology(ranks_per_node=1)  # groups are built before the strict region
    g = torch.Generator().manual_seed(rank)
    x = torch.randn(200_000, generator=g).to(device)
    n, k = x.numel(), 2000  # k / n large enough for the sampled path (not its exact fallback)
    seen = {}
    with _strict(device):
        want = topk_exact(x, k)
        for name, (v, i) in {
            "sampled": topk_sampled(x, k, generator=torch.Generator(device=x.device).manual_seed(1),
                                    workspace=SelectionWorkspace()),
            "threshold": topk_threshold(x, k, reuse=ThresholdReuse(0.25, 8)),
        }.items():
            seen[name] = torch.equal(torch.sort(i).values, torch.sort(want[1]).values) and v.device == x.device
        va, ia = topk_exact(x, k)
        ia, order = torch.sort(ia)
        merged = merge_topk(va[order], ia, va[order] * 2, ia, k)
        seen["merge"] = merged[1].device == x.device
        dense = topk_allgather(want[0], want[1], n)
        seen["topk"] = dense.device == x.device and int((dense != 0).sum()) >= k
        res = gtopk_allreduce(want[0], want[1], k, n)
        seen["gtopk"] = res.values.device == x.device and res.indices.numel() == k
        out = torch.empty_like(x)
        for split in ("leader", "slices", "sparse"):
            res = hgtopk_allreduce(x.clone(), k, topo, out=out, split=split)
            seen[split] = res.counted.device == x.device and out.device == x.device
    return seen


@pytest.mark.parametrize("device", DEVICES)
def test_sparse_exchanges_make_tensors_on_the_datas_device(run_ranks, device):
    ranks = run_ranks(_exchanges, 2, device) if device == "cpu" else run_ranks(_exchanges, 1, device, backend="nccl")
    for seen in ranks:
        assert all(seen.values()), seen


@pytest.mark.parametrize("device", DEVICES)
def test_sampled_selection_stream_survives_a_checkpoint_on_the_buckets_device(device, tmp_path):
    """The sampled selection's generator lives on the bucket's device (made at its first use, the
    one place: SparseHookState.sampling_generator); a state_dict round trip (through torch.save,
    weights_only) continues the stream on that device: the same selections and the same generator
    state as the uninterrupted hook, unlike a freshly seeded one (the control)."""
    from flashsgd.comm.sparse.hooks import select
    from flashsgd.comm.sparse.state import SparseHookState
    from flashsgd.exchanges import SparseOptions

    g = torch.Generator().manual_seed(0)
    xs = [torch.randn(200_000, generator=g).to(device) for _ in range(4)]

    def new_state():
        return SparseHookState("topk", SparseOptions(density=0.01, selection="sampled", seed=5))

    def run(state, batch):
        with _strict(device):
            return [select(state, x, 2000, idx=0, rank=1) for x in batch]

    state = new_state()
    run(state, xs[:2])
    assert state.generator.device.type == device
    torch.save(state.state_dict(), tmp_path / "hook.pt")
    reference = run(state, xs[2:])

    restored, control = new_state(), new_state()
    restored.load_state_dict(torch.load(tmp_path / "hook.pt", weights_only=True))
    assert restored.generator is None  # re-created on the device of the bucket it serves next
    saved = torch.load(tmp_path / "hook.pt", weights_only=True)
    assert saved["generator_device"] == device
    assert torch.equal(restored.state_dict()["generator"], saved["generator"])  # saved again before use
    got, other = run(restored, xs[2:]), run(control, xs[2:])
    assert restored.generator.device.type == device
    assert all(torch.equal(a[1], b[1]) and torch.equal(a[0], b[0]) for a, b in zip(got, reference))
    assert torch.equal(restored.generator.get_state(), state.generator.get_state())
    assert not torch.equal(control.generator.get_state(), state.generator.get_state())


def test_a_sampled_stream_of_another_device_type_restarts_from_its_seed_with_a_warning():
    """A CUDA run's checkpoint resumed on CPU buckets (or the reverse): the generator states have
    different formats, so the stream restarts from its seed and says so; nothing fails."""
    from flashsgd.comm.sparse.hooks import select
    from flashsgd.comm.sparse.state import SparseHookState
    from flashsgd.exchanges import SparseOptions

    options = SparseOptions(density=0.01, selection="sampled", seed=5)
    state, seeded = SparseHookState("topk", options), SparseHookState("topk", options)
    saved = {**state.state_dict(), "generator": torch.zeros(16, dtype=torch.uint8), "generator_device": "cuda"}
    state.load_state_dict(saved)
    x = torch.randn(200_000, generator=torch.Generator().manual_seed(0))
    with pytest.warns(UserWarning, match="saved by a cuda generator and cannot continue on cpu; it restarts"):
        select(state, x, 2000, idx=0, rank=1)
    select(seeded, x, 2000, idx=0, rank=1)
    assert torch.equal(state.generator.get_state(), seeded.generator.get_state())
    # a checkpoint that did not record the device (older versions) continues when the format fits
    old = SparseHookState("topk", options)
    old.load_state_dict({**seeded.state_dict(), "generator_device": None})
    select(old, x, 2000, idx=0, rank=1)
    select(seeded, x, 2000, idx=0, rank=1)
    assert torch.equal(old.generator.get_state(), seeded.generator.get_state())
