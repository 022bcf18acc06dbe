"""Every resume is exact, for every hook and layout; per-rank hook state; elastic world changes.

DDP puts every parameter in one bucket for its first iteration and rebuilds its buckets before
the second: a restarted run's first step used the first-iteration layout while the uninterrupted
run used the rebuilt one (another summation order with more than two ranks per reduction, other
Top-k selections). ``rebuild_buckets`` gives the restarted run the rebuilt layout at once.
"""

from __future__ import annotations

import io
import json

import pytest
import torch
import torch.distributed as dist
from torch import nn
from torch.nn.parallel import DistributedDataParallel as DDP

from ddp_helpers import flat_params, tiny_net
from ports import free_port
from flashsgd.comm.hooks import rebuild_buckets, register_hook
from flashsgd.comm.sparse.state import SparseHookState
from flashsgd.exchanges import SparseOptions
from flashsgd.train.data import ShardedSampler

HOOK_OPTIONS = {"ring": {}, "gtopk": {"density": 0.1}, "topk": {"density": 0.1}}


def _batch(step):
    g = torch.Generator().manual_seed(1000 * step + dist.get_rank())
    return torch.randn(16, 20, generator=g), torch.randint(0, 5, (16,), generator=g)


def _loss(ddp, step):
    x, y = _batch(step)
    return nn.functional.cross_entropy(ddp(x), y)


def _build(hook, seed=0):
    """A user's own setup: model, DDP (small buckets: several of them), the hook, SGD."""
    model = tiny_net(seed)
    ddp = DDP(model, bucket_cap_mb=0.01)
    state = register_hook(ddp, hook, **HOOK_OPTIONS[hook])
    opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    return model, ddp, state, opt


def _steps(ddp, opt, first, last):
    for s in range(first, last):
        opt.zero_grad()
        _loss(ddp, s).backward()
        opt.step()


def _user_loop_resume(hook, stop, total):
    """Whether the restarted run (with rebuild_buckets, without) ends with the uninterrupted
    run's parameters, bit for bit."""
    model, ddp, _, opt = _build(hook)
    _steps(ddp, opt, 0, total)
    reference = flat_params(model)

    model, ddp, state, opt = _build(hook)
    _steps(ddp, opt, 0, stop)
    buf = io.BytesIO()  # this rank's own file, as a training script saves it
    torch.save({"model": model.state_dict(), "optimizer": opt.state_dict(), "hook": state.state_dict()}, buf)

    results = []
    for rebuild in (True, False):  # the "restarted process": fresh objects, another init
        buf.seek(0)
        ckpt = torch.load(buf, weights_only=True)
        model, ddp, state, opt = _build(hook, seed=123)
        model.load_state_dict(ckpt["model"])
        opt.load_state_dict(ckpt["optimizer"])
        state.load_state_dict(ckpt["hook"])
        if rebuild:
            assert rebuild_buckets(ddp, lambda: _loss(ddp, 999))
            assert not rebuild_buckets(ddp, lambda: _loss(ddp, 999))  # once
        _steps(ddp, opt, stop, total)
        results.append(torch.equal(flat_params(model), reference))
    return results


@pytest.mark.parametrize("hook", ["ring", "gtopk"])
def test_user_loop_resume_is_exact_with_four_ranks_in_one_group(run_ranks, hook):
    for rebuilt, plain in run_ranks(_user_loop_resume, 4, hook, 4, 8):
        assert rebuilt
        assert not plain  # the control: DDP's first-iteration layout


def _rebuild_changes_nothing():
    model, ddp, state, opt = _build("gtopk")
    before = [t.clone() for t in model.state_dict().values()]
    rng = torch.get_rng_state()
    rebuild_buckets(ddp, lambda: _loss(ddp, 0))
    assert all(torch.equal(a, b) for a, b in zip(before, model.state_dict().values()))
    assert torch.equal(rng, torch.get_rng_state())
    assert all(p.grad is None for p in model.parameters())
    assert state.iter == 0 and not state.residuals and state.bytes_sent == 0  # the hook never ran
    return True


def test_rebuild_buckets_changes_nothing_but_the_buckets(run_ranks):
    assert run_ranks(_rebuild_changes_nothing, 2) == [True, True]


def _load_other_ranks_state():
    _, ddp, state, _ = _build("gtopk")
    _steps(ddp, torch.optim.SGD(ddp.parameters(), lr=0.1), 0, 3)
    saved = state.state_dict()
    assert (saved["rank"], saved["world"]) == (dist.get_rank(), 2)
    box = [saved]
    dist.broadcast_object_list(box, src=1)  # every rank gets rank 1's state ("one file")
    errors = []
    for candidate in (box[0], {**saved, "world": 4}):
        try:
            state.load_state_dict(candidate)
            errors.append(None)
        except ValueError as exc:
            errors.append(str(exc))
    return errors


def test_loading_another_ranks_sparse_state_is_an_error_naming_both(run_ranks):
    (other0, world0), (other1, world1) = run_ranks(_load_other_ranks_state, 2)
    assert "saved by rank 1 of 2; this is rank 0" in other0 and "one file per rank" in other0
    assert other1 is None  # rank 1 loads its own
    assert "saved by rank 0 of 4 workers; this is rank 0 of 2" in world0
    assert "saved by rank 1 of 4 workers; this is rank 1 of 2" in world1


# ------------------------------------------------------------------ elastic: world changes -------
def test_sampler_continues_at_the_global_sample_on_another_world():
    old = ShardedSampler(1000, rank=0, world_size=2, seed=5)
    old.set_epoch(1, 128)
    seen = [old.shard(0, 128), old.shard(128, 256), old.shard(256, 384)]
    for _ in range(3):
        next(iter(old))
    state = old.state_dict()
    new = [ShardedSampler(1000, rank=r, world_size=4, seed=5) for r in range(4)]
    for s in new:
        s.load_state_dict(state)
    assert [s.position for s in new] == [3] * 4 and new[0].epoch == 1 and new[0].global_batch == 128
    nxt = torch.cat([next(iter(s)) for s in new])  # the 4 shards of the next global batch
    ref = ShardedSampler(1000, rank=0, world_size=1, seed=5)
    ref.set_epoch(1, 128)
    assert torch.equal(nxt, ref.shard(384, 512)) and not any(
        bool(torch.isin(nxt, s).any()) for s in seen)


def test_sampler_refuses_a_position_no_batch_of_the_new_world_ends_at():
    old = ShardedSampler(10, rank=0, world_size=1, seed=0)
    old.set_epoch(0, 4)          # ends [4, 8, 10]; with 3 workers: [4, 10]
    old.position = 2
    with pytest.raises(ValueError, match="stopped after sample 8 of 10 .* resume with 1 worker$"):
        ShardedSampler(10, rank=0, world_size=3, seed=0).load_state_dict(old.state_dict())


def test_sparse_state_regroup_keeps_the_error_feedback_mass():
    states = []
    for r in range(2):
        st = SparseHookState("gtopk", SparseOptions(density=0.1))
        st.iter = 7
        st.residuals = {0: torch.full((3,), float(r + 1)), 1: torch.full((2,), 10.0 * (r + 1))}
        st.layouts = {0: ((2, 3),), 1: ((0, 2),)}
        sd = st.state_dict()
        sd.update(rank=r, world=2)
        states.append(sd)
    new = [SparseHookState.regroup(states, r, 4) for r in range(4)]
    # the update is sum_r residual_r / world: 2-rank sum / 2 == 4-rank sum / 4
    for k in (0, 1):
        old_mass = sum(s["residuals"][k] for s in states) / 2
        assert torch.allclose(sum(n["residuals"][k] for n in new) / 4, old_mass)
    assert [(n["rank"], n["world"], n["iter"]) for n in new] == [(r, 4, 7) for r in range(4)]
    fresh = SparseHookState("gtopk", SparseOptions(density=0.1))
    fresh.load_state_dict(new[3])  # outside a process group: not checked
    assert torch.equal(fresh.residuals[0], torch.full((3,), 1.5))


# ------------------------------------------------------------------ through the trainer ---------
def _metrics(out):
    rows = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    return [r for r in rows if r.get("kind") == "step"]


def _final(out):
    latest = (out / "checkpoints" / "latest").read_text().strip()
    return torch.load(out / "checkpoints" / latest / "shared.pt", weights_only=True)["model"]


def _tiny(out, **cli):
    from flashsgd.train import config as C

    base = dict(num_samples=2000, epochs=2.0, global_batch=256, progress=False, out=str(out),
                deterministic=True, seed=3)
    return C.resolve(cli={**base, **cli})


@pytest.mark.slow
@pytest.mark.parametrize("algorithm,extra", [("ring", {}), ("native", {"ranks_per_node": 4}),
                                             ("gtopk", {"density": 0.05})])
def test_trainer_resume_is_exact_with_four_ranks_in_one_group(tmp_path, algorithm, extra):
    from flashsgd.train.trainer import train

    common = dict(workers=4, algorithm=algorithm, checkpoint_every=100, **extra)
    train(_tiny(tmp_path / "a", **common))
    train(_tiny(tmp_path / "b", max_steps=5, **common))  # stopped after step 5 (a checkpoint)
    train(_tiny(tmp_path / "b", **common))               # resumed
    a, b = _metrics(tmp_path / "a"), _metrics(tmp_path / "b")
    assert [r["loss"] for r in a] == [r["loss"] for r in b] and len(a) == 14
    fa, fb = _final(tmp_path / "a"), _final(tmp_path / "b")
    assert all(torch.equal(fa[k], fb[k]) for k in fa)


@pytest.mark.slow
def test_elastic_resume_grows_and_shrinks_the_world(tmp_path, capfd):
    """Local spawn with another --workers on resume (what torchrun --nnodes MIN:MAX does to a
    restarted group): 2 workers -> 4 -> 2, gtopk (per-worker residuals regrouped)."""
    from flashsgd.train.trainer import train

    common = dict(algorithm="gtopk", density=0.05, checkpoint_every=100)
    train(_tiny(tmp_path / "ref", workers=2, **common))
    run = tmp_path / "el"
    train(_tiny(run, workers=2, max_steps=5, **common))
    train(_tiny(run, workers=4, max_steps=10, **common))    # grows
    summary = train(_tiny(run, workers=2, **common))         # shrinks
    printed = capfd.readouterr().out
    assert "resuming a checkpoint of 2 workers on 4" in printed
    assert "resuming a checkpoint of 4 workers on 2" in printed
    ref, el = _metrics(tmp_path / "ref"), _metrics(run)
    assert [r["step"] for r in el] == list(range(14))
    # the run's global batch and LR schedule, whatever the world; local batches follow the world
    assert [(r["global_batch"], r["lr"]) for r in el] == [(r["global_batch"], r["lr"]) for r in ref]
    assert [r["local_batch"] for r in el[5:10]] == [r["global_batch"] // 4 for r in el[5:10]]
    assert [r["loss"] for r in el[:5]] == [r["loss"] for r in ref[:5]]  # same until the change
    # (step 5's loss differs already: BN normalizes over each worker's shard, now half as large)
    assert abs(el[-1]["loss"] - ref[-1]["loss"]) < 0.1 * ref[-1]["loss"]
    assert summary["steps"] == 14


@pytest.mark.slow
def test_torchrun_elastic_range_resumes_on_another_world(tmp_path):
    """Under torchrun with an elastic node range (--nnodes 1:2): the run checkpointed by one agent
    (2 workers) resumes when two agents join (4 workers), then on one again (2 workers). The
    membership changes here happen between launches (each launch ends at --max-steps); a live
    join/leave restarts the workers through the same resume path."""
    import os
    import subprocess
    import sys
    from pathlib import Path

    repo = Path(__file__).resolve().parents[1]
    env = {**os.environ, "GLOO_SOCKET_IFNAME": "lo", "PYTHONPATH": str(repo / "src"), "OMP_NUM_THREADS": "1"}

    def launch(agents: int, *extra: str) -> None:
        port = free_port()
        cmd = [sys.executable, "-m", "torch.distributed.run", "--nnodes", "1:2", "--nproc-per-node", "2",
               "--rdzv-backend", "c10d", "--rdzv-endpoint", f"127.0.0.1:{port}", "--rdzv-id", "elastic",
               "--rdzv-conf", "last_call_timeout=3", "-m", "flashsgd", "train", "--num-samples", "2000",
               "--epochs", "2", "--global-batch", "256", "--no-progress", "--comm", "gtopk",
               "--density", "0.05", "--out", str(tmp_path), *extra]
        procs = [subprocess.Popen(cmd, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
                 for _ in range(agents)]
        logs = [p.communicate(timeout=300)[0] for p in procs]
        assert [p.returncode for p in procs] == [0] * agents, "\n".join(logs)[-4000:]

    launch(1, "--max-steps", "5")
    launch(2, "--max-steps", "10")   # grows: 2 -> 4 workers
    launch(1)                        # shrinks: 4 -> 2 workers, to the end
    rows = [json.loads(line) for line in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    steps = [r for r in rows if r.get("kind") == "step"]
    assert [r["step"] for r in steps] == list(range(14))
    assert [r["local_batch"] for r in steps[5:10]] == [r["global_batch"] // 4 for r in steps[5:10]]
    assert [r["local_batch"] for r in steps[10:]] == [r["global_batch"] // 2 for r in steps[10:]]
    summary = json.loads((tmp_path / "summary.json").read_text())
    assert summary["steps"] == 14
