"""The run directory: resume only with the same settings, never mix runs, one run at a time,
checks before any process starts, one-line errors (flashsgd.train.records.rundir, flashsgd.train.cli)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from flashsgd.cli import main
from flashsgd.train.records import rundir

TINY = ["--num-samples", "2000", "--epochs", "2", "--global-batch", "256", "--no-progress",
        "--workers", "2", "--comm", "ring"]


def _train(out, *extra):
    return main(["train", *TINY, "--out", str(out), *extra])


def _snapshot(out: Path) -> dict[str, float]:
    return {str(p.relative_to(out)): p.stat().st_mtime_ns for p in out.rglob("*") if p.name != ".lock"}


def test_rerun_resumes_only_with_the_same_settings(tmp_path, capfd):
    out = tmp_path / "run"
    assert _train(out) == 0
    config = (out / "config.toml").read_text()
    before = _snapshot(out)
    capfd.readouterr()
    # other settings: refused before any work, naming the key, old -> new, and the ways out
    assert _train(out, "--lr-per-ref", "0.5", "--seed", "9") == 2
    err = capfd.readouterr().err.strip().splitlines()
    assert len(err) == 1, err
    assert "optim.lr_per_ref: None -> 0.5" in err[0] and "run.seed: 0 -> 9" in err[0]
    assert "--out NEW" in err[0] and "--resume never" in err[0]
    assert (out / "config.toml").read_text() == config and _snapshot(out) == before
    # same settings (a neutral key changed): already complete, nothing rewritten
    assert _train(out, "--eval-every", "2") == 0
    printed = capfd.readouterr().out
    summary = json.loads((out / "summary.json").read_text())
    assert f"already complete at step 14, test accuracy {summary['final_test_accuracy']:.2f}%" in printed
    assert _snapshot(out) == before


def test_resume_never_moves_the_old_run_aside(tmp_path, capfd):
    out = tmp_path / "run"
    assert _train(out, "--max-steps", "9") == 0
    old_summary = json.loads((out / "summary.json").read_text())
    capfd.readouterr()
    assert _train(out, "--resume", "never", "--max-steps", "4", "--seed", "7") == 0
    assert "moved to" in capfd.readouterr().out
    asides = list(tmp_path.glob("run.prev-*"))
    assert len(asides) == 1
    assert json.loads((asides[0] / "summary.json").read_text()) == old_summary
    rows = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in rows if r["kind"] == "step"] == [0, 1, 2, 3]   # only this run
    summary = json.loads((out / "summary.json").read_text())
    assert summary["steps"] == 4 and summary["final_test_accuracy"] is not None  # evaluated at the stop
    latest = (out / "checkpoints" / "latest").read_text().strip()
    assert latest == "step-00000004" and (out / "checkpoints" / latest / "shared.pt").is_file()


def test_a_second_run_on_a_locked_directory_stops_at_once(tmp_path, capfd):
    out = tmp_path / "run"
    with rundir.lock(out):
        assert _train(out) == 2
    err = capfd.readouterr().err
    assert "is in use by pid" in err and "choose another --out" in err
    assert not (out / "config.toml").exists()
    with rundir.lock(out):  # released: a stale holder is no obstacle
        pass


@pytest.mark.parametrize("flags, needle", [
    (["--grid", "3x3"], "comm.grid: grid 3x3 has 9 ranks but the world size is 2"),
    (["--grid", "banana"], "comm.grid: grid must look like 'XxY'"),
    (["--global-batch", "1"], "every worker needs >= 1 sample per step"),
    (["--resume", "/nonexistent"], "run.resume: '/nonexistent' is not a checkpoint directory"),
    (["--timeout-s", "nan"], "'run.timeout_s': expected a finite number"),
    # issue 33 item 4: found only after the workers started (SIGSEGV, an overflow) or accepted
    (["--threads", "100000"], "run.threads must be at most this machine's"),
    (["--seed", str(2 ** 70)], "run.seed must be in [0, 2**30 - 1]"),
    (["--target-accuracy", "101"], "run.target_accuracy is a test accuracy in percent: valid 0-100"),
    (["--resume", "EMPTY"], "holds no checkpoint (no shared.pt); a checkpoint is a step-NNNNNNNN directory"),
    (["--config", "BINARY"], "binary.toml': not a readable TOML text file (UnicodeDecodeError"),
])
def test_bad_input_is_one_line_before_any_process(tmp_path, capfd, flags, needle):
    out = tmp_path / "run"
    (tmp_path / "empty").mkdir()
    (tmp_path / "binary.toml").write_bytes(bytes(range(256)))
    flags = [{"EMPTY": str(tmp_path / "empty"), "BINARY": str(tmp_path / "binary.toml")}.get(f, f) for f in flags]
    assert _train(out, *flags) == 2
    err = capfd.readouterr().err.strip().splitlines()
    assert len(err) == 1 and needle in err[0], err
    assert not out.exists() or not any(out.iterdir())


def test_a_failed_run_is_one_line_per_rank_and_a_log(tmp_path, capfd):
    out = tmp_path / "run"
    assert _train(out, "--fail-at", "1:2:exit", "--timeout-s", "10") == 1
    err = capfd.readouterr().err.strip().splitlines()
    assert len(err) <= 4, err
    assert "rank 1" in err[0] and "error.log" in err[-1]
    assert "Traceback" not in "\n".join(err)
    assert (out / "error.log").is_file()


def test_a_damaged_newest_checkpoint_falls_back_and_an_empty_latest_is_named(tmp_path, capfd):
    """Both resume from the newest intact checkpoint, saying why (one rule, issue 23 item 7)."""
    out = tmp_path / "run"
    assert _train(out, "--max-steps", "9", "--checkpoint-every", "4") == 0
    ckpts = out / "checkpoints"
    assert (ckpts / "latest").read_text().strip() == "step-00000009"
    (ckpts / "step-00000009" / "shared.pt").write_bytes(b"torn write")
    capfd.readouterr()
    assert _train(out, "--checkpoint-every", "4") == 0
    printed = capfd.readouterr().out
    assert "resuming from the older intact checkpoint step-00000008" in printed
    assert json.loads((out / "summary.json").read_text())["steps"] == 14
    (out / "summary.json").unlink()
    (ckpts / "latest").write_text("")
    assert _train(out, "--checkpoint-every", "4", "--max-steps", "14") == 0
    printed = capfd.readouterr().out
    assert "latest is empty" in printed and "resuming from the newest intact checkpoint step-00000014" in printed


def test_an_edited_config_toml_does_not_pass_the_changed_settings_guard(tmp_path, capfd):
    """Issue 33 item 3: editing the run's own config.toml (epochs 2 -> 3) and training with it
    used to extend the run with a stretched LR schedule, reported as done."""
    out = tmp_path / "run"
    assert _train(out, "--max-steps", "5") == 0  # stopped early: a checkpoint to resume from
    path = out / "config.toml"
    path.write_text(path.read_text().replace("epochs = 2.0", "epochs = 3.0"))
    assert "epochs = 3.0" in path.read_text()
    capfd.readouterr()
    assert main(["train", "--config", str(path), "--out", str(out), "--no-progress", "--workers", "2"]) == 2
    err = capfd.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "config.toml was edited after the run started" in err[0], err
    assert "optim.epochs: 2.0 -> 3.0" in err[0], err
    # the settings it started with still resume it, and the edited file is named and rewritten
    assert _train(out) == 0
    assert f"{path} was edited after the run started (optim.epochs differs" in capfd.readouterr().out
    assert "epochs = 2.0" in path.read_text()
    assert json.loads((out / "summary.json").read_text())["steps"] == 14
