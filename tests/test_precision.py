"""How the one training step executes (issue 22): autocast precision (bf16, fp16 with a loss scaler
that agrees with the step's non-finite all-reduce), gradient accumulation (no exchange on the
inner micro-batches, the update of the whole global batch), channels_last and torch.compile's
fallback; all on 2 Gloo ranks on CPU, the CUDA variant where a GPU is present."""

from __future__ import annotations

import copy
import json

import pytest
import torch
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel as DDP

from ddp_helpers import flat_params, tiny_net
from flashsgd.comm.hooks import register_hook
from flashsgd.train import config as C
from flashsgd.train.step import TrainStep

SIZES = [5, 3]  # uneven shards: a global batch of 8 on 2 ranks


def _shard(step: int, device="cpu"):
    rank = dist.get_rank()
    g = torch.Generator().manual_seed(100 * step + rank)
    x, y = torch.randn(SIZES[rank], 20, generator=g), torch.randint(0, 5, (SIZES[rank],), generator=g)
    return x.to(device), y.to(device)


def _train(hook: str, steps: int, device: str = "cpu", calls: list | None = None, **options):
    """``steps`` TrainSteps of tiny_net with ``hook``; (losses, flat parameters, step)."""
    def count(h):
        def counted(state, bucket):
            calls.append(1)
            return h(state, bucket)
        return counted

    ddp = DDP(tiny_net().to(device))
    register_hook(ddp, hook, wrap=count if calls is not None else None)
    opt = torch.optim.SGD(ddp.parameters(), lr=0.1, momentum=0.9)
    step = TrainStep(ddp, opt, torch.nn.CrossEntropyLoss(reduction="sum"), device=torch.device(device),
                     **options)
    losses = []
    for s in range(steps):
        x, y = _shard(s, device)
        res = step(lambda: (x, y), sum(SIZES), step=s)
        assert not res.skipped
        losses.append(res.loss)
    return losses, flat_params(ddp).cpu(), step


def _precisions(hook: str, device: str = "cpu"):
    out = {}
    for precision in ("fp32", "bf16", "fp16"):
        losses, params, step = _train(hook, 4, device, precision=precision)
        out[precision] = (losses, params, step.scaler.get_scale() if step.scaler else None)
    return out


@pytest.mark.parametrize("hook", ["ring", "gtopk"])
def test_bf16_and_fp16_autocast_train_close_to_fp32(run_ranks, hook):
    for res in run_ranks(_precisions, 2, hook):
        ref, _, _ = res["fp32"]
        for precision in ("bf16", "fp16"):
            losses, params, _ = res[precision]
            assert all(torch.isfinite(torch.tensor(losses)))
            assert losses == pytest.approx(ref, rel=2e-2), precision
            assert torch.isfinite(params).all()
    scales = [r["fp16"][2] for r in run_ranks(_precisions, 2, "ring")]
    assert scales[0] == scales[1] == 65536.0  # no overflow on this net: the scale is untouched


def _overflow_on_one_rank(init_scale: float, max_skipped: int):
    """Rank 1's gradients overflow in step 0 (the loss stays finite); the noop hook leaves them on
    rank 1 only, so only the agreed flag can make rank 0 skip too."""
    ddp = DDP(tiny_net())
    register_hook(ddp, "noop")
    opt = torch.optim.SGD(ddp.parameters(), lr=0.1)
    step = TrainStep(ddp, opt, torch.nn.CrossEntropyLoss(reduction="sum"), precision="fp16",
                     max_skipped=max_skipped)
    step.scaler = torch.amp.GradScaler("cpu", init_scale=init_scale)
    poison = {"on": dist.get_rank() == 1}
    next(ddp.parameters()).register_hook(lambda g: g * float("inf") if poison["on"] else g)
    before = flat_params(ddp)
    x, y = _shard(0)
    try:
        first = step(lambda: (x, y), sum(SIZES), step=0)
    except FloatingPointError as exc:
        return str(exc)
    unchanged = torch.equal(flat_params(ddp), before)
    poison["on"] = False
    second = step(lambda: (x, y), sum(SIZES), step=1)
    return (first.skipped, first.overflow, first.loss_scale, unchanged, step.skipped_in_row,
            second.skipped, second.loss_scale)


def test_fp16_overflow_on_one_rank_is_skipped_everywhere_with_one_scale(run_ranks):
    # the scaler's overflow skip: every rank skips, the scale halves on every rank, and it does not
    # count in run.max_skipped's streak (max_skipped=1 would stop at the first counted skip)
    for r in run_ranks(_overflow_on_one_rank, 2, 1024.0, 1):
        assert r == (True, True, 512.0, True, 0, False, 512.0)


def test_fp16_overflow_at_scale_one_counts_as_a_nonfinite_step(run_ranks):
    # at a scale <= 1 the gradient is non-finite without any scaling: the divergence guard applies
    for message in run_ranks(_overflow_on_one_rank, 2, 1.0, 1):
        assert "1 step in a row was skipped" in message and "step 0" in message


def _accumulated(n: int):
    calls: list = []
    _, params, _ = _train("ring", 3, calls=calls, grad_accum=n)
    return params, len(calls)


def test_grad_accum_gives_the_update_of_the_whole_global_batch_and_exchanges_once(run_ranks):
    one = run_ranks(_accumulated, 2, 1)
    two = run_ranks(_accumulated, 2, 2)
    three = run_ranks(_accumulated, 2, 3)
    for (p1, c1), (p2, c2), (p3, c3) in zip(one, two, three):
        assert torch.allclose(p1, p2, rtol=0, atol=1e-6) and torch.allclose(p1, p3, rtol=0, atol=1e-6)
        assert c1 == c2 == c3 == 3  # one bucket, one exchange per optimizer step: none on no_sync


def _accum_too_many():
    ddp = DDP(tiny_net())
    step = TrainStep(ddp, torch.optim.SGD(ddp.parameters(), lr=0.1), torch.nn.CrossEntropyLoss(reduction="sum"),
                     grad_accum=5)
    x, y = _shard(0)
    try:
        step(lambda: (x, y), sum(SIZES))
    except ValueError as exc:
        return str(exc)


def test_grad_accum_larger_than_a_shard_is_refused(run_ranks):
    # the smallest shard of a global batch of 8 on 2 ranks is 4: both ranks refuse (no rank waits)
    assert all("shard of 3 samples cannot be split into grad_accum = 5" in m or
               "shard of 4 samples cannot be split into grad_accum = 5" in m for m in run_ranks(_accum_too_many, 2))


def test_the_plan_records_precision_accumulation_memory_format_and_compile():
    from flashsgd.train.plan import build_plan

    cfg = C.resolve(cli={"precision": "bf16", "grad_accum": "2", "channels_last": True, "compile": True})
    plan = build_plan(cfg, 4, 32000, local_spawn=True, backend="gloo")
    e = plan.to_dict()["execution"]
    assert e == {"precision": "bf16", "autocast": "bfloat16", "loss_scaler": False, "grad_accum": 2,
                 "micro_batch_per_worker": [512], "channels_last": False, "compile": True, "data_workers": 0,
                 "cudnn_benchmark": True, "notes": ["channels_last ignored: mnist1d inputs are not 4-D images"]}
    line = next(x for x in plan.describe().splitlines() if x.lstrip().startswith("step"))
    assert "bf16 autocast" in line and "grad accum 2" in line and "torch.compile" in line \
        and "channels_last ignored" in line
    images = C.resolve(cli={"dataset": "synthetic", "image_shape": "cifar", "model": "resnet20",
                            "num_samples": 4096, "channels_last": True, "precision": "fp16"})
    e = build_plan(images, 4, 4096, local_spawn=True, backend="gloo").execution
    assert e["channels_last"] and e["loss_scaler"] and not e["notes"]
    assert build_plan(C.resolve(), 4, 32000, local_spawn=True, backend="gloo").execution["precision"] == "fp32"
    # cuDNN's autotuner (PyTorch's ImageNet example sets it): on, except for a deterministic run
    deterministic = C.resolve(cli={"deterministic": True})
    assert not build_plan(deterministic, 4, 32000, local_spawn=True, backend="gloo").execution["cudnn_benchmark"]
    with pytest.raises(ValueError, match="optim.grad_accum=2000.*valid: optim.grad_accum <= 1024"):
        build_plan(C.resolve(cli={"grad_accum": 2000}), 4, 32000, local_spawn=True, backend="gloo")
    with pytest.raises(ValueError, match="run.precision"):
        C.resolve(cli={"precision": "fp8"})


def test_flags_are_generated_from_the_config():
    import argparse

    from flashsgd.train.cli import add_arguments

    parser = argparse.ArgumentParser()
    add_arguments(parser)
    args = parser.parse_args(["--precision", "fp16", "--grad-accum", "4", "--channels-last", "--no-compile"])
    assert (args.precision, args.grad_accum, args.channels_last, args.compile) == ("fp16", "4", True, False)


def test_channels_last_model_and_inputs_train(run_ranks):
    assert run_ranks(_channels_last, 2) == [True, True]


def _channels_last():
    torch.manual_seed(0)
    net = torch.nn.Sequential(torch.nn.Conv2d(3, 8, 3), torch.nn.BatchNorm2d(8), torch.nn.ReLU(),
                              torch.nn.AdaptiveAvgPool2d(1), torch.nn.Flatten(), torch.nn.Linear(8, 5))
    net = net.to(memory_format=torch.channels_last)
    ddp = DDP(net)
    seen = []
    net[0].register_forward_pre_hook(lambda m, a: seen.append(a[0].is_contiguous(memory_format=torch.channels_last)))
    step = TrainStep(ddp, torch.optim.SGD(ddp.parameters(), lr=0.1), torch.nn.CrossEntropyLoss(reduction="sum"),
                     precision="bf16", channels_last=True)
    g = torch.Generator().manual_seed(dist.get_rank())
    x, y = torch.randn(4, 3, 8, 8, generator=g), torch.randint(0, 5, (4,), generator=g)
    res = step(lambda: (x, y), 8)
    return all(seen) and not res.skipped and bool(torch.isfinite(torch.tensor(res.loss)))


def test_compile_falls_back_with_one_line(monkeypatch, capsys):
    from flashsgd.train import rank

    def broken(*args, **kwargs):
        raise RuntimeError("no C++ compiler\nmore detail")

    model = torch.nn.Linear(3, 2)
    monkeypatch.setattr(torch, "compile", broken)
    assert rank.compile_model(model) is model
    out = capsys.readouterr().out.strip().splitlines()
    assert out == ["[flashsgd] torch.compile failed (RuntimeError: no C++ compiler); training the model "
                   "eagerly (run.compile = false)"]
    # compiling lazily (at the first forward) falls back the same way, once
    monkeypatch.setattr(torch, "compile", lambda m: (lambda x: broken()))
    fn = rank.compile_model(model)
    x = torch.randn(2, 3)
    assert torch.equal(fn(x), model(x)) and torch.equal(fn(x), model(x))
    assert len(capsys.readouterr().out.strip().splitlines()) == 1


def test_fp16_and_grad_accum_train_end_to_end_and_resume_exactly(tmp_path):
    from flashsgd.train.records.report import read_metrics
    from flashsgd.train.trainer import train

    def tiny(out, **cli):
        base = dict(num_samples=2000, epochs=2.0, global_batch=256, progress=False, out=str(out), workers=2,
                    algorithm="ring", precision="fp16", grad_accum=2, deterministic=True, checkpoint_every=4)
        return C.resolve(cli={**base, **cli})

    s = train(tiny(tmp_path / "a"))
    assert s["steps"] == 14 and s["skipped_steps"] == s.get("overflow_skipped_steps", 0)
    steps, _ = read_metrics(tmp_path / "a" / "metrics.jsonl")
    assert all("loss_scale" in r for r in steps)
    plan = json.loads((tmp_path / "a" / "plan.json").read_text())
    assert plan["execution"]["grad_accum"] == 2 and plan["execution"]["loss_scaler"]
    train(tiny(tmp_path / "b", max_steps=6))                              # interrupted after step 6
    train(tiny(tmp_path / "b"))                                           # resumes, the scale too
    final = {}
    for run in ("a", "b"):
        latest = (tmp_path / run / "checkpoints" / "latest").read_text().strip()
        final[run] = torch.load(tmp_path / run / "checkpoints" / latest / "shared.pt", weights_only=True)
    assert final["a"]["scaler"] == final["b"]["scaler"]
    for k, v in final["a"]["model"].items():
        assert torch.equal(v, final["b"]["model"][k]), k


def _cuda_precisions():
    torch.cuda.set_device(0)
    return _precisions("ring", "cuda")


@pytest.mark.gpu
def test_autocast_and_scaler_on_cuda(run_ranks):
    for res in run_ranks(_cuda_precisions, 2, cuda=True):  # two ranks on one GPU (Gloo carries CUDA tensors)
        ref = res["fp32"][0]
        for precision in ("bf16", "fp16"):
            assert res[precision][0] == pytest.approx(ref, rel=2e-2), precision


def _bench_train_bf16():
    from flashsgd.bench.train import _bench

    opts = {"model": "mnist1d_cnn", "image_shape": "mnist1d", "batch": 8, "comm": ["native"], "grid": None,
            "ranks_per_node": None, "density": 0.01, "selection": "sampled", "bucket_mb": 25.0, "iters": 2,
            "warmup": 1, "recipe": "fujitsu", "precision": "bf16", "plain_loop": True}
    return _bench(opts, True)


def test_bench_train_times_bf16_beside_a_plain_ddp_loop(run_ranks):
    res = run_ranks(_bench_train_bf16, 2)[0]
    assert res["plain"]["loop"] == "plain" and res["plain"]["images_per_s"] > 0
    assert res["rows"][0]["ratio_to_plain"] > 0
