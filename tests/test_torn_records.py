"""A torn record never blocks a run, and `flashsgd compare` never pools a run that did not finish.

One real crash: a run killed at step 11 (after its checkpoint of step 8), whose last metrics row is
then torn the way a full disk tears it (``truncate -s -60``), is rerun with the same command: it
must finish, with the same rows as an uninterrupted run (timings aside). Readers name the file and
the line of a damaged row. `compare` marks the crashed run and keeps it apart from complete runs,
and two complete runs of one seed are duplicates, not two seeds.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from flashsgd.cli import main
from flashsgd.train.records.compare import compare
from flashsgd.train.records import read_metrics, resume_row

TINY = ["--num-samples", "2000", "--epochs", "2", "--global-batch", "256", "--no-progress",
        "--workers", "1", "--checkpoint-every", "4"]  # 14 steps, checkpoints at 4, 7 (epoch), 8
TIMING = {"images_per_s", "t_step_s", "t_data_s", "t_forward_s", "t_backward_s", "t_comm_s", "t_sync_s",
          "t_optimizer_s", "elapsed_s"}


def _train(*args: str) -> subprocess.CompletedProcess:
    """`flashsgd train` as a user runs it (the workers' notes are on its stderr)."""
    return subprocess.run([sys.executable, "-m", "flashsgd", "train", *TINY, *args],
                          capture_output=True, text=True, timeout=600)


@pytest.fixture(scope="module")
def runs(tmp_path_factory) -> dict:
    """full: uninterrupted; crashed: rank 0 exits at step 11; torn: a copy of crashed with its last
    row (step 10, after the checkpoint of step 8) and its TensorBoard file torn, rerun."""
    root = tmp_path_factory.mktemp("torn")
    full, crashed, torn = root / "full", root / "crashed", root / "torn"
    assert _train("--out", str(full)).returncode == 0  # one after the other: they share the data cache
    assert _train("--fail-at", "0:11:exit", "--out", str(crashed)).returncode == 1
    shutil.copytree(crashed, torn)
    metrics = torn / "metrics.jsonl"
    os.truncate(metrics, metrics.stat().st_size - 60)  # a full disk while appending the row of step 10
    (events,) = (torn / "tensorboard").iterdir()
    os.truncate(events, events.stat().st_size - 30)
    rerun = _train("--out", str(torn))
    return {"full": full, "crashed": crashed, "torn": torn, "rerun": rerun}


def _untimed(rows: list[dict]) -> list[dict]:
    return [{k: v for k, v in r.items() if k not in TIMING} for r in rows]


def _lines(path: Path) -> list[str]:
    return path.read_text().splitlines()


def test_the_rerun_of_a_torn_run_finishes_like_an_uninterrupted_run(runs):
    rerun, torn = runs["rerun"], runs["torn"]
    assert rerun.returncode == 0, rerun.stderr[-2000:]
    from flashsgd.train.records import read_rows

    notes = [x for x in rerun.stderr.splitlines() if "torn last row" in x]
    assert len(notes) == 1 and f"{torn / 'metrics.jsonl'} line 12: torn last row" in notes[0]
    assert "dropped" in notes[0] and "(step 8)" in notes[0]
    assert read_rows(torn / "metrics.jsonl")[1] == []  # nothing damaged is left
    crashed = _lines(runs["crashed"] / "metrics.jsonl")
    lines = _lines(torn / "metrics.jsonl")
    assert lines[:11] == crashed[:11]  # the rows before the torn one, untouched
    assert json.loads(lines[11]) == resume_row(8)  # then the run goes on from its checkpoint
    torn_row = json.loads(crashed[11])
    assert torn_row["step"] == 10
    steps, evals = read_metrics(torn / "metrics.jsonl")
    assert _untimed([s for s in steps if s["step"] == 10]) == _untimed([torn_row])  # rewritten
    full_steps, full_evals = read_metrics(runs["full"] / "metrics.jsonl")
    assert [s["step"] for s in steps] == list(range(14))
    assert _untimed(steps) == _untimed(full_steps) and _untimed(evals) == _untimed(full_evals)
    assert json.loads((torn / "summary.json").read_text())["steps"] == 14
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    board = EventAccumulator(str(torn / "tensorboard"))
    board.Reload()
    loss = {e.step: e.value for e in board.Scalars("train/loss")}  # the crash's file is read up to the tear
    assert set(range(8, 14)) <= set(loss) <= set(range(14))  # (how much of it reached the disk: not asserted)
    assert list(loss.values()) == pytest.approx([full_steps[step]["loss"] for step in loss])


def test_readers_name_the_file_and_the_line(runs, tmp_path, capsys):
    rows = _lines(runs["crashed"] / "metrics.jsonl")  # 11 steps, an evaluation
    path = tmp_path / "metrics.jsonl"
    path.write_text("".join(r + "\n" for r in rows)[:-60])
    capsys.readouterr()
    steps, evals = read_metrics(path)  # a note on stderr
    assert [s["step"] for s in steps] == list(range(10)) and len(evals) == 1
    torn = len(rows[11]) + 1 - 60
    assert capsys.readouterr().err == (f"note: {path} line 12: torn last row ({torn} bytes without a newline: "
                                       "an append cut short by a crash or a full disk), left out\n")
    notes: list[str] = []
    # a row cut in the middle of the file: not what an interrupted append leaves
    path.write_text("".join(r + "\n" for r in rows[:2] + [rows[2][:50]] + rows[3:]))
    from flashsgd.train.records import RecordError

    with pytest.raises(RecordError, match=f"{path} line 3: damaged: not JSON"):
        read_metrics(path)
    notes.clear()
    steps, _ = read_metrics(path, skip_damaged=True, note=notes.append)
    assert 2 not in [s["step"] for s in steps] and len(notes) == 1 and f"{path} line 3" in notes[0]
    # what an earlier version left: the resume row appended to the torn row
    path.write_text("".join(r + "\n" for r in rows[:11]) + rows[11][:-60] + json.dumps(resume_row(8)) + "\n")
    notes.clear()
    steps, _ = read_metrics(path, note=notes.append)
    assert [s["step"] for s in steps] == list(range(8)) and "line 12: a torn row, then a whole row" in notes[0]
    # compare: one line naming the file and the line
    bad = tmp_path / "bad"
    shutil.copytree(runs["crashed"], bad)
    (bad / "metrics.jsonl").write_text("".join(r + "\n" for r in rows[:2] + ["{garbage"] + rows[3:]))
    capsys.readouterr()
    assert main(["compare", str(runs["full"]), str(bad), "--out", str(tmp_path / "c.png")]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and f"{bad / 'metrics.jsonl'} line 3: damaged" in err[0], err


def _compare(dirs: list[Path], tmp_path: Path, monkeypatch) -> tuple[list[dict], list]:
    """compare()'s rows and the accuracy panel's (legend label, line style) pairs."""
    import matplotlib.pyplot as plt

    lines = []
    close = plt.close

    def keep(fig=None):
        if fig is not None:
            lines.extend((ln.get_label(), ln.get_linestyle()) for ln in fig.axes[0].get_lines()
                         if not ln.get_label().startswith("_"))
        close(fig)

    monkeypatch.setattr(plt, "close", keep)
    return compare([str(d) for d in dirs], out=str(tmp_path / "c.png")), lines


def test_compare_never_pools_a_crashed_run_with_a_complete_one(runs, tmp_path, monkeypatch, capsys):
    rows, lines = _compare([runs["full"], runs["crashed"]], tmp_path, monkeypatch)
    out = capsys.readouterr().out
    assert [r["runs"] for r in rows] == [[str(runs["full"])], [str(runs["crashed"])]]  # not "2 seeds"
    assert [r["status"] for r in rows] == ["complete", "incomplete 11/14"]
    assert [r["complete"] for r in rows] == [True, False]
    assert rows[0]["steps"]["values"] == [14] and rows[1]["steps"]["values"] == [11]
    assert rows[1]["label"] == "torus2d (crashed)" and "incomplete 11/14" in out
    assert f"note: {runs['crashed']}: ended at step 11 of 14 without a summary.json" in out
    assert lines == [("torus2d", "-"), ("torus2d (crashed) [incomplete 11/14]", ":")]


def test_two_complete_runs_of_one_seed_are_duplicates_not_two_seeds(runs, tmp_path, monkeypatch, capsys):
    rows, lines = _compare([runs["full"], runs["torn"], runs["crashed"]], tmp_path, monkeypatch)
    out = capsys.readouterr().out
    assert [r["runs"] for r in rows] == [[str(runs[n])] for n in ("full", "torn", "crashed")]
    assert [r["status"] for r in rows] == ["complete", "complete", "incomplete 11/14"]
    assert [r["seeds"] for r in rows] == [[0], [0], [0]]
    assert "note: 2 runs of seed 0 (full, torn): duplicates, not 2 seeds" in out
    assert [label for label, _ in lines] == ["torus2d (full) [seed 0, duplicate]",
                                             "torus2d (torn) [seed 0, duplicate]",
                                             "torus2d (crashed) [incomplete 11/14]"]
