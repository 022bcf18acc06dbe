"""A run's identity lives in its checkpoints (issue 49 items 2 and 3): the settings it was trained
with and the run it belongs to. Edited or missing records (config.toml, plan.json) do not change
what the run is; a checkpoint copied from another run is passed over like a damaged one.

Three small runs are shared by the module: the run itself (14 steps), one with another LR
(the same seed) and one with another seed. Each test works on a copy.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import torch

from flashsgd.cli import main
from flashsgd.train.records import checkpoint as ckpt
from flashsgd.train import config as C
from flashsgd.train.records import rundir

TINY = ["--num-samples", "2000", "--epochs", "2", "--global-batch", "256", "--no-progress",
        "--workers", "2", "--comm", "ring", "--deterministic", "--checkpoint-every", "4"]
STEPS = 14  # 7 per epoch; checkpoints kept: step-00000012 and step-00000014


def _train(out: Path, *extra: str) -> int:
    return main(["train", *TINY, "--out", str(out), *extra])


@pytest.fixture(scope="module")
def runs(tmp_path_factory) -> dict[str, Path]:
    """``run``: the run; ``lr``: --lr-per-ref 0.5, same seed; ``seed``: --seed 9, stopped at step 4."""
    root = tmp_path_factory.mktemp("identity")
    made = {"run": [], "lr": ["--lr-per-ref", "0.5"], "seed": ["--seed", "9", "--max-steps", "4"]}
    for name, extra in made.items():
        assert _train(root / name, *extra) == 0, name
    return {name: root / name for name in made}


def _copy(runs, tmp_path, name: str = "run") -> Path:
    out = tmp_path / name
    shutil.copytree(runs[name], out)
    return out


def _cfg(out: Path, **cli) -> C.TrainConfig:
    """The settings the CLI gives ``_train(out)`` (with ``cli`` changed)."""
    flags = {"num_samples": 2000, "epochs": 2.0, "global_batch": 256, "progress": False, "workers": 2,
             "algorithm": "ring", "deterministic": True, "checkpoint_every": 4, "out": str(out)}
    return C.resolve(cli={**flags, **cli})


def _one_line(capfd) -> str:
    err = capfd.readouterr().err.strip().splitlines()
    assert len(err) == 1, err
    return err[0]


def _snapshot(out: Path) -> dict[str, int]:
    return {str(p.relative_to(out)): p.stat().st_mtime_ns for p in out.rglob("*") if p.name != ".lock"}


def _meta(step_dir: Path) -> dict:
    return torch.load(step_dir / "shared.pt", weights_only=True)["meta"]


def test_every_checkpoint_records_the_run_and_its_settings(runs):
    out = runs["run"]
    plan = json.loads((out / "plan.json").read_text())
    for _, step_dir in ckpt.step_dirs(out / "checkpoints"):
        run = _meta(step_dir)["run"]
        assert run["id"] == plan["run_id"] and len(run["id"]) == 16
        assert run["config"] == (out / "config.toml").read_text() == plan["config_file"]
        assert run["settings"] == rundir.settings_digest(_cfg(out))
        for rank in (0, 1):
            local = torch.load(step_dir / f"rank-{rank:05d}.pt", weights_only=True)["meta"]
            assert local["run"]["id"] == run["id"]
    other = _meta(runs["lr"] / "checkpoints" / "step-00000014")["run"]
    assert other["id"] != plan["run_id"] and other["settings"] != rundir.settings_digest(_cfg(out))
    # neutral keys (where this invocation stops, the world) are not the run's settings
    assert rundir.settings_digest(_cfg(out, max_steps=3, workers=4)) == rundir.settings_digest(_cfg(out))


# ------------------------------------------------------------------------ item 2: edited records ---
@pytest.mark.parametrize("plan_json", ["deleted", "not JSON", "config_file null"])
def test_an_edited_config_toml_is_refused_whatever_happened_to_plan_json(runs, tmp_path, capfd, plan_json):
    """epochs 2 -> 3 in the finished run's config.toml, plan.json deleted or damaged: training with
    that file used to extend the 14-step run to 21 steps, the LR jumping back up."""
    out = _copy(runs, tmp_path)
    path = out / "config.toml"
    path.write_text(path.read_text().replace("epochs = 2.0", "epochs = 3.0"))
    if plan_json == "deleted":
        (out / "plan.json").unlink()
    elif plan_json == "not JSON":
        (out / "plan.json").write_text('{"config_file": "[optim]\\nepochs = 3.0')
    else:
        plan = json.loads((out / "plan.json").read_text())
        (out / "plan.json").write_text(json.dumps({**plan, "config_file": None}))
    before = _snapshot(out)
    capfd.readouterr()
    assert main(["train", "--config", str(path), "--out", str(out)]) == 2
    err = _one_line(capfd)
    assert f"{path} was edited after the run started (optim.epochs differs from the settings the " \
           f"checkpoint {out / 'checkpoints' / 'step-00000014'} was trained with)" in err, err
    assert "optim.epochs: 2.0 -> 3.0" in err and "--out NEW" in err, err
    assert _snapshot(out) == before
    # the settings it was trained with: complete, the edited file named and left as it is
    assert _train(out) == 0
    printed = capfd.readouterr().out
    assert f"already complete at step {STEPS}" in printed and f"{path} was edited" in printed
    assert _snapshot(out) == before


def test_only_an_edited_plan_json_is_named(runs, tmp_path, capfd):
    """config_file in plan.json edited (epochs 2 -> 3), config.toml as the run wrote it: the
    run's own config.toml used to be refused, blaming config.toml, and settings matching the edited
    plan.json used to extend the run."""
    out = _copy(runs, tmp_path)
    plan = json.loads((out / "plan.json").read_text())
    plan["config_file"] = plan["config_file"].replace("epochs = 2.0", "epochs = 3.0")
    (out / "plan.json").write_text(json.dumps(plan))
    before = _snapshot(out)
    capfd.readouterr()
    assert main(["train", "--config", str(out / "config.toml"), "--out", str(out)]) == 0
    printed = capfd.readouterr().out
    assert f"already complete at step {STEPS}" in printed
    assert f"{out / 'plan.json'} (config_file) was edited after the run started" in printed
    assert _train(out, "--epochs", "3") == 2
    err = _one_line(capfd)
    assert f"{out / 'plan.json'} (config_file) was edited after the run started" in err, err
    assert "config.toml was edited" not in err and "optim.epochs: 2.0 -> 3.0" in err, err
    assert _snapshot(out) == before


def test_the_checkpoint_holds_the_settings_when_the_records_are_gone(runs, tmp_path):
    """config.toml and plan.json both deleted: the run is still the checkpoint's (it used to be
    moved aside and started over, whatever the settings)."""
    out = _copy(runs, tmp_path)
    (out / "config.toml").unlink()
    (out / "plan.json").unlink()
    assert rundir.decide(_cfg(out), STEPS).kind == "complete"
    with pytest.raises(rundir.RunDirError, match=r"holds a run with other settings \(optim.epochs: 2.0 -> 3.0\)"):
        rundir.decide(_cfg(out, epochs=3.0), 21)
    (out / "summary.json").unlink()  # as if stopped before the summary: resumed, the run id kept
    start = rundir.decide(_cfg(out), STEPS)
    assert (start.kind, start.step) == ("resume", STEPS)
    assert start.run["id"] == _meta(out / "checkpoints" / "step-00000014")["run"]["id"]


# ------------------------------------------------------------------------ item 3: copied checkpoints
def _losses(out: Path) -> list[float]:
    """By step: a step run again after the resume supersedes its first row."""
    rows = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    by_step = {r["step"]: r["loss"] for r in rows if r.get("kind") == "step"}
    return [by_step[s] for s in sorted(by_step)]


def test_a_step_directory_of_another_run_is_passed_over_and_the_run_ends_exactly(runs, tmp_path, capfd):
    """The newest step directory replaced by the same step of a run with another LR (same seed):
    it used to be resumed silently. Now it is named and the older own checkpoint resumed, and the
    run ends bit-identical to the uninterrupted one."""
    out = _copy(runs, tmp_path)
    (out / "summary.json").unlink()  # stopped before its summary: a rerun resumes
    newest = out / "checkpoints" / "step-00000014"
    shutil.rmtree(newest)
    shutil.copytree(runs["lr"] / "checkpoints" / "step-00000014", newest)
    capfd.readouterr()
    assert _train(out) == 0
    printed = capfd.readouterr().out
    assert f"checkpoint {newest} belongs to another run" in printed, printed
    assert "resuming from the older intact checkpoint step-00000012 instead" in printed, printed
    assert f"resuming from step 12 ({out / 'checkpoints' / 'step-00000012'})" in printed, printed
    assert _losses(out) == _losses(runs["run"]) and len(_losses(out)) == STEPS
    final = [torch.load(r / "checkpoints" / "step-00000014" / "shared.pt", weights_only=True)
             for r in (out, runs["run"])]
    assert all(torch.equal(final[0]["model"][k], final[1]["model"][k]) for k in final[1]["model"])
    run_id = _meta(runs["run"] / "checkpoints" / "step-00000014")["run"]["id"]  # kept by the resume
    assert final[0]["meta"]["run"]["id"] == run_id == json.loads((out / "plan.json").read_text())["run_id"]


def test_another_seeds_checkpoint_is_passed_over_before_any_worker_starts(runs, tmp_path):
    """A step directory of a run with another seed: resumed, it failed in the workers ("sampler
    state mismatch"); now the choice passes over it, with the same note as a corrupt one."""
    out = _copy(runs, tmp_path)
    (out / "summary.json").unlink()
    newest = out / "checkpoints" / "step-00000014"
    shutil.rmtree(newest)
    shutil.copytree(runs["seed"] / "checkpoints" / "step-00000004", newest)
    start = rundir.decide(_cfg(out), STEPS)
    assert (start.kind, start.checkpoint.name) == ("resume", "step-00000012")
    assert f"checkpoint {newest} belongs to another run" in start.note and start.step == 12
    assert start.note.endswith("resuming from the older intact checkpoint step-00000012 instead")
    # the whole checkpoints directory from elsewhere: nothing of this run to resume, said before start
    shutil.rmtree(out / "checkpoints")
    shutil.copytree(runs["seed"] / "checkpoints", out / "checkpoints")
    with pytest.raises(ckpt.CheckpointError, match="belongs to another run .* no older intact checkpoint"):
        rundir.decide(_cfg(out), STEPS)


def test_a_renamed_checkpoint_says_the_step_its_files_hold(runs, tmp_path):
    """Step 12's files copied into step-00000014/: the resume is from step 12, and says so (it
    used to say "resuming from .../step-00000014")."""
    out = _copy(runs, tmp_path)
    (out / "summary.json").unlink()
    ckpts = out / "checkpoints"
    shutil.rmtree(ckpts / "step-00000014")
    shutil.copytree(ckpts / "step-00000012", ckpts / "step-00000014")
    start = rundir.decide(_cfg(out), STEPS)
    assert start.describe() == (f"resuming from step 12 ({ckpts / 'step-00000014'}: its files are "
                                "step 12's, its name says step 14)")
    assert (start.checkpoint.name, start.step) == ("step-00000014", 12)
