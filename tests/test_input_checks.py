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


# ------------------------------------------- issue 49 item 7: the bad inputs left, and their order

STARTED = "flashsgd train: "  # the start line ("flashsgd train: loading MNIST-1D ... for 2 workers")


@pytest.mark.parametrize("flags, needle", [
    # the plan's checks: they need the sample count, which the config gives before the data exist
    (["--global-batch", "4096"], "optim.global_batch=4096 is larger than the 1600 training samples"),
    (["--num-samples", "10"], "larger than the 8 training samples"),
    (["--workers", "5000"], "every worker needs >= 1 sample per step"),
    (["--global-batch", "1"], "every worker needs >= 1 sample per step"),
    (["--fail-at", "9:3:exit"], "names rank 9, but the run has 2 ranks"),
    (["--fail-at", "1:14:exit"], "names step 14, but the run has 14 steps"),
    (["--grid", "3x3"], "comm.grid: grid 3x3 has 9 ranks but the world size is 2"),
    (["--grid", "banana"], "comm.grid: grid must look like 'XxY'"),
    (["--ranks-per-node", "3"], "comm.ranks_per_node=3 must divide the world size 2"),
    (["--grad-accum", "1000"], "optim.grad_accum=1000: the smallest per-worker shard is 128 samples"),
    (["--comm", "auto", "--cluster", "1gbe"], "'1gbe' has 1 rank per node, this run 2"),
    (["--comm", "auto", "--momentum-correction"], "--comm auto chooses the algorithm itself"),
    # the model against two samples of the dataset's shape
    (["--model", "resnet20"], "model 'resnet20' does not accept dataset 'mnist1d': its samples have shape (40,)"),
    (["--dataset", "synthetic", "--image-shape", "cifar", "--num-samples", "512", "--model", "mnist1d_cnn"],
     "model 'mnist1d_cnn' does not accept dataset 'synthetic': its samples have shape (3, 32, 32)"),
    # where the data live, and a checkpoint named to resume from
    (["--data-dir", "/proc/x"], "the MNIST-1D cache folder (config key data.data_dir) /proc/x: cannot create "
                                "files in /proc"),
    (["--data-dir", "AFILE"], "the MNIST-1D cache folder (config key data.data_dir) AFILE: is a file, not a "
                              "directory"),
    (["--dataset", "imagefolder", "--data-dir", "/nonexistent"],
     "config key data.data_dir='/nonexistent' is not a directory here"),
    (["--resume", "EMPTY"], "config key run.resume: EMPTY holds no checkpoint (no shared.pt)"),
])
def test_bad_input_is_refused_before_the_start_line(tmp_path, capfd, flags, needle):
    """These printed "flashsgd train: loading MNIST-1D ..." (work announced) before their error."""
    places = {"AFILE": tmp_path / "afile", "EMPTY": tmp_path / "empty"}
    places["AFILE"].write_text("")
    places["EMPTY"].mkdir()
    flags = [str(places.get(f, f)) for f in flags]
    needle = needle.replace("AFILE", str(places["AFILE"])).replace("EMPTY", str(places["EMPTY"]))
    assert _train(tmp_path / "run", *flags) == 2
    captured = capfd.readouterr()
    assert STARTED not in captured.out, captured.out  # nothing announced
    err = captured.err.strip().splitlines()
    assert len(err) == 1 and needle in err[0], err
    assert not (tmp_path / "run").exists()


@pytest.mark.parametrize("flags, needle", [
    (["--channels", "99999999"], "config key model.channels must be in [1, 4096]"),  # was a traceback
    (["--epochs", "1e300"], "config key optim.epochs must be in (0, 2**30] = (0, 1073741824]"),
    (["--config", "/etc"], "--config '/etc' is a directory; expected a TOML file"),
])
def test_the_last_unchecked_values_are_one_line(tmp_path, capfd, flags, needle):
    # --max-steps 1: where a value used to be accepted, the run stops after one step
    assert _train(tmp_path / "run", "--max-steps", "1", *flags) == 2
    captured = capfd.readouterr()
    assert STARTED not in captured.out and needle in _one_line_of(captured.err), captured


def _one_line_of(err: str) -> str:
    lines = err.strip().splitlines()
    assert len(lines) == 1, lines
    return lines[0]


def test_the_bounds_hold_their_ends_and_a_run_directory_is_named():
    assert C.resolve(cli={"channels": "4096"}).model.channels == 4096
    assert C.resolve(cli={"epochs": str(2 ** 30)}).optim.epochs == 2 ** 30
    with pytest.raises(ValueError, match="model.channels must be in"):
        C.resolve(cli={"channels": "4097"})
    with pytest.raises(ValueError, match="optim.epochs must be in"):
        C.resolve(cli={"epochs": str(2 ** 30 + 1)})


def test_config_naming_a_run_directory_points_at_its_config_toml(tmp_path):
    (tmp_path / "config.toml").write_text("[optim]\nepochs = 3\n")
    with pytest.raises(ValueError, match=f"is a directory; expected a TOML file; the run directory's "
                                         f"own is {tmp_path / 'config.toml'}"):
        C.resolve(tmp_path)
    assert C.resolve(tmp_path / "config.toml").optim.epochs == 3


@pytest.mark.parametrize("extra, needle", [
    (["--target", "150"], "--target is a test accuracy in percent: valid 0-100, got 150"),
    (["--target", "-1"], "--target is a test accuracy in percent: valid 0-100, got -1"),
    (["--target", "nan"], "--target is a test accuracy in percent: valid 0-100, got nan"),
    (["SAME/"], "run directory 'SAME/' is named twice (also as 'SAME'); name each run once"),
    (["./SAME"], "run directory './SAME' is named twice (also as 'SAME'); name each run once"),
])
def test_compare_refuses_a_bad_target_and_one_directory_twice(tmp_path, monkeypatch, capfd, extra, needle):
    """Checked before any run is read (the names need not be run directories for this)."""
    monkeypatch.chdir(tmp_path)
    (tmp_path / "SAME").mkdir()
    assert main(["compare", "SAME", *extra]) == 2
    assert f"flashsgd compare: error: {needle}" == _one_line(capfd)
