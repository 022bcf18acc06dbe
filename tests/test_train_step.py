"""The one training step (flashsgd.train.step): equal to a hand-written reference step on 2 Gloo
ranks (native all-reduce and a hook), the non-finite policy, and every step user runs it."""

from __future__ import annotations

import ast
import copy
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel as DDP

from ddp_helpers import flat_params, tiny_net
from flashsgd.comm.hooks import register_hook
from flashsgd.train.rank import CommTimer
from flashsgd.train.step import TrainStep

SRC = Path(__file__).resolve().parents[1] / "src" / "flashsgd"
SIZES = [5, 3]  # uneven shards: a global batch of 8 on 2 ranks


def _shard(step: int):
    rank = dist.get_rank()
    g = torch.Generator().manual_seed(100 * step + rank)
    return torch.randn(SIZES[rank], 20, generator=g), torch.randint(0, 5, (SIZES[rank],), generator=g)


def _shared_vs_reference(hook: str):
    """Two steps of TrainStep and of the loop written out by hand, from the same model."""
    base = tiny_net()
    timer = CommTimer()
    ddp = DDP(copy.deepcopy(base))
    register_hook(ddp, hook, wrap=timer.wrap)
    opt = torch.optim.SGD(ddp.parameters(), lr=0.1, momentum=0.9)
    step = TrainStep(ddp, opt, torch.nn.CrossEntropyLoss(reduction="sum"), timer)
    ref = DDP(copy.deepcopy(base))
    register_hook(ref, hook)
    ref_opt = torch.optim.SGD(ref.parameters(), lr=0.1, momentum=0.9)
    losses, ref_losses = [], []
    for s in range(2):
        x, y = _shard(s)
        res = step(lambda: (x, y), sum(SIZES), lr=0.1, step=s)
        losses.append(res.loss)
        assert not res.skipped and res.samples == sum(SIZES) and res.total_s > 0
        # the reference: loss summed over the shard x W / B, backward, agree on the loss, step
        ref_opt.zero_grad()
        loss_sum = torch.nn.functional.cross_entropy(ref(x), y, reduction="sum")
        (loss_sum * (dist.get_world_size() / sum(SIZES))).backward()
        total = loss_sum.detach().double().reshape(1)
        dist.all_reduce(total)
        ref_losses.append(total.item() / sum(SIZES))
        ref_opt.step()
    return losses, ref_losses, flat_params(ddp), flat_params(ref)


@pytest.mark.parametrize("hook", ["native", "ring"])
def test_shared_step_equals_a_hand_written_step(run_ranks, hook):
    for losses, ref_losses, params, ref_params in run_ranks(_shared_vs_reference, 2, hook):
        assert losses == ref_losses
        assert torch.equal(params, ref_params)


def _nonfinite(policy: str):
    ddp = DDP(tiny_net())
    opt = torch.optim.SGD(ddp.parameters(), lr=0.1, momentum=0.9)
    step = TrainStep(ddp, opt, torch.nn.CrossEntropyLoss(reduction="sum"), nonfinite=policy)
    x, y = _shard(0)
    step(lambda: (x, y), sum(SIZES))
    before, state = flat_params(ddp), copy.deepcopy(opt.state_dict())
    # the NaN on rank 1 only: every rank must skip (the flag is all-reduced)
    try:
        res = step(lambda: (x, y), sum(SIZES), step=7, poison=dist.get_rank() == 1)
    except FloatingPointError as exc:
        return str(exc)
    grads_zero = all(torch.count_nonzero(p.grad) == 0 for p in ddp.parameters())
    same_state = all(torch.equal(a["momentum_buffer"], b["momentum_buffer"])
                     for a, b in zip(opt.state_dict()["state"].values(), state["state"].values()))
    return res.skipped, grads_zero, torch.equal(flat_params(ddp), before), same_state


def test_a_skipped_nonfinite_step_zeroes_the_gradients_and_does_not_step(run_ranks):
    assert run_ranks(_nonfinite, 2, "skip") == [(True, True, True, True)] * 2


def test_stop_names_the_step(run_ranks):
    assert all("non-finite loss or gradient at step 7" in m for m in run_ranks(_nonfinite, 2, "stop"))


def test_a_mean_loss_is_refused():
    with pytest.raises(ValueError, match="reduction='sum'"):
        TrainStep(torch.nn.Linear(2, 2), None, torch.nn.CrossEntropyLoss())


def _bench_train_rows():
    from flashsgd.bench.train import _bench

    opts = {"model": "mnist1d_cnn", "image_shape": "mnist1d", "batch": 8, "comm": ["native", "noop", "ring"],
            "grid": None, "ranks_per_node": None, "density": 0.01, "selection": "sampled", "bucket_mb": 25.0,
            "iters": 2, "warmup": 2, "recipe": "fujitsu"}
    return _bench(opts, True)


def test_bench_train_times_the_trainers_step(run_ranks):
    res = run_ranks(_bench_train_rows, 2)[0]
    assert [r["hook"] for r in res["rows"]] == ["native", "noop", "ring"]
    assert all(r["step_ms"] > 0 for r in res["rows"]) and "LARS" in res["recipe"]


def _calls(path: Path) -> set[str]:
    names = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Call):
            f = node.func
            names.add(f.attr if isinstance(f, ast.Attribute) else getattr(f, "id", ""))
    return names


def test_the_worker_and_the_benchmarks_build_the_one_step_and_call_no_backward_of_their_own():
    assert "TrainStep" in _calls(SRC / "train/rank.py")  # build_rank: the rank every user trains with
    for rel in ["train/worker.py", "bench/scaling_rank.py"]:
        calls = _calls(SRC / rel)
        assert "build_rank" in calls and "TrainStep" not in calls and "backward" not in calls, rel
    for rel in ["bench/sparse_hook.py"]:
        calls = _calls(SRC / rel)
        assert "TrainStep" in calls and "backward" not in calls, rel
    train_bench = _calls(SRC / "bench/train.py")  # through scaling_rank's Trainer
    assert "build" in train_bench and "backward" not in train_bench


def _scaling_rank(out: str):
    from flashsgd.bench.scaling_rank import rank_main

    spec = {"comms": ["noop", "ring"], "warmup": 2, "iters": 3, "batch": 7, "model": "mnist1d_cnn",
            "dataset": "mnist1d", "image_shape": "cifar", "channels": 8, "recipe": "fujitsu",
            "density": 0.01, "selection": "exact", "bucket_mb": 25.0, "threads": 1, "timeout_s": 60.0,
            "ranks_per_node": 1, "out_dir": str(Path(out).parent)}
    rank_main(spec, out)


def test_bench_scaling_rank_times_the_trainers_step(run_ranks, tmp_path):
    import json

    out = tmp_path / "rows.json"
    run_ranks(_scaling_rank, 2, str(out))
    rows = {r["comm"]: r for r in json.loads(out.read_text())["rows"]}
    for r in rows.values():
        assert len(r["step_s"]) == 3 and all(t > 0 for t in r["step_s"])
        assert set(r["split_s"]) == {"data", "forward", "backward", "hook", "sync", "optimizer"}
    progress = (tmp_path / "rows.json.progress").read_text().split()
    assert progress.count("noop") == progress.count("ring") == 5


def _rank_parts(algorithm: str, extra: dict):
    """build_rank on a small MNIST-1D plan: what the worker and bench scaling both train with."""
    from flashsgd.train.config import resolve
    from flashsgd.train.plan import build_plan
    from flashsgd.train.rank import build_rank, load_data

    cfg = resolve(cli={"num_samples": 2000, "epochs": 2, "global_batch": 256, "algorithm": algorithm,
                       "recipe": "fujitsu", **extra})
    data = load_data(cfg)
    plan = build_plan(cfg, dist.get_world_size(), len(data.train), local_spawn=True, backend="gloo")
    parts = build_rank(plan, data, torch.device("cpu"))
    return (type(parts.optimizer).__name__, parts.optimizer.__dict__.get("grad_norm_source") is not None,
            parts.model_tweaks, parts.step.nonfinite)


def test_build_rank_wires_the_sparse_hooks_into_the_optimizer(run_ranks):
    # layer_trust: LARS takes its trust ratios from the hook's dense norms (the worker and the
    # benches share build_rank, so neither can forget it)
    opt, wired, tweaks, nonfinite = run_ranks(_rank_parts, 2, "gtopk", {"layer_trust": True, "density": 0.1})[0]
    assert opt == "LARS" and wired and tweaks and nonfinite == "skip"
    assert run_ranks(_rank_parts, 2, "torus2d", {})[0][:2] == ("LARS", False)
