"""``oktopk`` resumes bit-identically with ``--deterministic``, as every other hook does.

tests/test_exact_resume.py checks the trainer's resume for ring, native and gtopk; this adds oktopk,
whose checkpoint carries more than the other sparse hooks' (the region bounds and each bucket's
sparse steps since they were set, :class:`flashsgd.comm.sparse.oktopk.Regions`). ``region_every``
is 3 so that the bounds are re-balanced before the stop (sparse steps 1 and 3) and after it (6, 9,
12): a resumed run that restarted the bounds or their age would split differently from the
uninterrupted one. The density warm-up (the trainer's default) is still running at the stop.
"""

from __future__ import annotations

import json

import pytest
import torch

from flashsgd.comm.sparse.oktopk import even_bounds


def _tiny(out, **cli):
    """The settings of tests/test_exact_resume.py's trainer resumes (14 steps, seed 3)."""
    from flashsgd.train import config as C

    base = dict(num_samples=2000, epochs=2.0, global_batch=256, progress=False, out=str(out),
                deterministic=True, seed=3)
    return C.resolve(cli={**base, **cli})


def _losses(out):
    rows = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    return [r["loss"] for r in rows if r.get("kind") == "step"]


def _checkpoint(out):
    return out / "checkpoints" / (out / "checkpoints" / "latest").read_text().strip()


@pytest.mark.slow
def test_oktopk_trainer_resume_is_exact_across_region_rebalancing(tmp_path):
    from flashsgd.train.trainer import train

    common = dict(workers=4, algorithm="oktopk", density=0.01, region_every=3, checkpoint_every=100)
    train(_tiny(tmp_path / "a", **common))
    train(_tiny(tmp_path / "b", max_steps=5, **common))  # stopped after step 5 (a checkpoint)
    stopped = _checkpoint(tmp_path / "b")
    hook_files = sorted(stopped.glob("rank-*.pt"))
    assert len(hook_files) == 4, sorted(p.name for p in stopped.iterdir())
    regions = [torch.load(f, weights_only=True)["hook"]["regions"] for f in hook_files]
    assert regions[0] and all(r == regions[0] for r in regions)  # the same bounds on every rank
    for bucket in regions[0].values():  # re-balanced from the results, not the even start
        assert bucket["age"] == 3 and bucket["bounds"] != even_bounds(bucket["bounds"][-1], 4)
    train(_tiny(tmp_path / "b", **common))               # resumed
    a, b = _losses(tmp_path / "a"), _losses(tmp_path / "b")
    assert len(a) == 14 and a == b
    fa = torch.load(_checkpoint(tmp_path / "a") / "shared.pt", weights_only=True)["model"]
    fb = torch.load(_checkpoint(tmp_path / "b") / "shared.pt", weights_only=True)["model"]
    assert all(torch.equal(fa[k], fb[k]) for k in fa)
