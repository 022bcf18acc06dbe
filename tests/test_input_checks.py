"""Bad input is one line and exit 2 before any work (issue 23, items 5-8): settings the run cannot
honour, unwritable outputs of every subcommand (flashsgd.outputs), a deleted ``latest``, and a
directory whose failed start never completed a step."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from flashsgd.cli import main
from flashsgd.outputs import check_output
from flashsgd.train import config as C
from flashsgd.train.plan import build_plan

TINY = ["--num-samples", "2000", "--epochs", "2", "--global-batch", "256", "--no-progress",
        "--workers", "2", "--comm", "ring"]


def _train(out, *extra):
    return main(["train", *TINY, "--out", str(out), *extra])


def _one_line(capfd) -> str:
    err = capfd.readouterr().err.strip().splitlines()
    assert len(err) == 1, err
    return err[0]


def _torchvision_imports() -> bool:
    try:
        import torchvision  # noqa: F401
    except Exception:  # noqa: BLE001
        return False
    return True


# ------------------------------------------------------------- item 5: settings it cannot run ---

@pytest.mark.parametrize("flags, needle", [
    (["--global-batch", "4096"], "optim.global_batch=4096 is larger than the 1600 training samples"
                                 " (the LR would be scaled for a batch no step takes); valid: "
                                 "optim.global_batch <= 1600"),
    (["--global-batch", "99999999999"], "valid: optim.global_batch <= 1600"),
    (["--fail-at", "9:3:exit"], "run.fail_at='9:3:exit' names rank 9, but the run has 2 ranks; "
                                "valid ranks: 0-1"),
    (["--fail-at", "1:14:exit"], "names step 14, but the run has 14 steps; valid steps: 0-13"),
    pytest.param(["--backend", "nccl"], "run.backend='nccl' needs CUDA and NCCL",
                 marks=pytest.mark.skipif(torch.cuda.is_available(), reason="CUDA is here")),
    pytest.param(["--model", "torchvision:resnet18"], "model.model='torchvision:resnet18' needs "
                 "torchvision, which does not import here",
                 marks=pytest.mark.skipif(_torchvision_imports(), reason="torchvision imports here")),
    (["--out", ""], "config key run.out (--out) is empty; name a directory"),
    (["--out", "/proc/x"], "config key run.out (--out) /proc/x: cannot create files in /proc"),
])
def test_what_the_run_cannot_honour_is_refused_before_any_process(tmp_path, capfd, flags, needle):
    out = tmp_path / "run"
    assert _train(out, *flags) == 2
    line = _one_line(capfd)
    assert needle in line, line
    assert not out.exists()


def test_out_naming_a_file_is_refused(tmp_path, capfd):
    afile = tmp_path / "afile"
    afile.write_text("mine")
    assert _train(afile) == 2
    assert "is a file, not a directory; name a directory" in _one_line(capfd)
    assert afile.read_text() == "mine"


def test_lr_is_not_taken_as_lr_per_ref(tmp_path, capsys):
    with pytest.raises(SystemExit) as exit_info:
        main(["train", "--lr", "0.1", "--out", str(tmp_path / "run")])
    assert exit_info.value.code == 2 and "unrecognized arguments: --lr" in capsys.readouterr().err


def test_a_billion_epochs_are_planned_at_once():
    """The step count is closed-form per batch-table row, not one epoch at a time."""
    cfg = C.resolve(cli={"epochs": "1e9", "workers": 4})
    code = ("from flashsgd.train import config as C; from flashsgd.train.plan import build_plan; "
            "p = build_plan(C.resolve(cli={'epochs': '1e9'}), 4, 32000, True); print(p.total_steps)")
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    assert done.returncode == 0, done.stderr
    plan = build_plan(C.resolve(cli={"epochs": "2", "workers": 4}), 4, 32000, True)
    per_epoch = plan.total_steps // 2
    assert int(done.stdout) == 10 ** 9 * per_epoch and cfg.optim.epochs == 1e9


def test_out_dot_with_resume_never_moves_the_old_run_next_to_it(tmp_path, monkeypatch, capfd):
    run = tmp_path / "run"
    run.mkdir()
    monkeypatch.chdir(run)
    assert _train(".", "--max-steps", "1") == 0
    assert _train(".", "--max-steps", "1", "--resume", "never") == 0
    asides = list(tmp_path.glob("run.prev-*"))
    assert len(asides) == 1 and (asides[0] / "config.toml").is_file()
    assert f"moved to {asides[0]}" in capfd.readouterr().out


# ---------------------------------------------------------- item 6: outputs of every command ----

@pytest.mark.parametrize("argv, flag", [
    (["bench", "allreduce", "--workers", "2", "--json", "/proc/x/y.json"], "--json"),
    (["bench", "sparse", "--workers", "2", "--json", "/proc/x/y.json"], "--json"),
    (["bench", "lars", "--json", "/proc/x/y.json"], "--json"),
    (["bench", "recipe", "--out", "/proc/x"], "--out"),
    (["bench", "recipe", "--json", "/proc/x/y.json"], "--json"),
    (["bench", "train", "--workers", "2", "--json", "/proc/x/y.json"], "--json"),
    (["bench", "emulate", "--json", "/proc/x/y.json"], "--json"),
    (["bench", "scaling", "--json", "/proc/x/y.json"], "--json"),
    (["bench", "scaling", "--plot", "/proc/x/y.png"], "--plot"),
    (["simulate", "--cluster", "1gbe", "--gpus", "8", "--json", "/proc/x/y.json"], "--json"),
    (["simulate", "--cluster", "1gbe", "--gpus", "8", "--out", "/proc/x"], "--out"),
    (["simulate", "--cluster", "1gbe", "--gpus", "8", "--plot", "/proc/x/y.png"], "--plot"),
    (["plan", "--cluster", "1gbe", "--gpus", "8", "--json", "/proc/x/y.json"], "--json"),
    (["compare", "runs/a", "--json", "/proc/x/y.json"], "--json"),
    (["compare", "runs/a", "--out", "/proc/x/y.png"], "--out"),
])
def test_every_output_is_checked_before_any_work(argv, flag, capfd):
    assert main(argv) == 2
    line = _one_line(capfd)
    assert f"error: {flag} /proc/x" in line and "cannot create files in /proc" in line, line


def test_the_output_rule(tmp_path):
    afile = tmp_path / "afile"
    afile.write_text("")
    check_output(tmp_path / "new" / "deeper" / "r.json", "--json")  # created later by the writer
    check_output(tmp_path / "new", "--out", "dir")
    for path, kind, needle in ((tmp_path, "file", "is a directory; name a file"),
                               (afile, "dir", "is a file, not a directory"),
                               (afile / "r.json", "file", f"{afile} is not a directory"),
                               ("", "file", "--x is empty; name a file")):
        with pytest.raises(ValueError, match=needle):
            check_output(path, "--x", kind)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["afile"]  # the probe leaves nothing


# ------------------------------------------------- items 7-8: what a rerun finds in the directory

def test_a_deleted_latest_resumes_from_the_newest_intact_checkpoint(tmp_path, capfd):
    out = tmp_path / "run"
    assert _train(out, "--max-steps", "9", "--checkpoint-every", "4") == 0
    (out / "checkpoints" / "latest").unlink()
    capfd.readouterr()
    assert _train(out, "--checkpoint-every", "4") == 0
    printed = capfd.readouterr().out
    assert "latest is missing; resuming from the newest intact checkpoint step-00000009" in printed
    assert "no checkpoint" not in printed and not list(tmp_path.glob("run.prev-*"))
    rows = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in rows if r["kind"] == "resume"] == [9]
    assert json.loads((out / "summary.json").read_text())["steps"] == 14


def test_a_failed_start_does_not_block_the_corrected_command(tmp_path, capfd):
    """A start that never completed a step (here: what such a start leaves behind, config.toml,
    plan.json, error.log) holds nothing to protect: the corrected command starts, moving it aside."""
    out = tmp_path / "run"
    out.mkdir()
    failed = C.resolve(cli={"num_samples": "2000", "epochs": "2", "global_batch": "256", "workers": "2",
                            "algorithm": "ring", "lr_per_ref": "50", "out": str(out)})
    (out / "config.toml").write_text(C.dumps(failed))
    (out / "plan.json").write_text("{}")
    (out / "error.log").write_text("rank 1 failed at start-up\n")
    (out / "metrics.jsonl").write_text("")
    assert _train(out, "--max-steps", "1") == 0
    printed = capfd.readouterr().out
    assert "never completed a step" in printed and "moved to" in printed
    aside = list(tmp_path.glob("run.prev-*"))
    assert len(aside) == 1 and (aside[0] / "error.log").is_file()
    # a run that did complete a step is still protected
    assert _train(out, "--max-steps", "1", "--lr-per-ref", "0.5") == 2
    assert "holds a run with other settings" in _one_line(capfd)
