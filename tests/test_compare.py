"""`flashsgd compare` (flashsgd.train.records.compare): the table agrees with each run's summary.json and
metrics.jsonl, seeds of one setting are grouped, labels name what differs, bad input is one line."""

from __future__ import annotations

import json
import shutil
import statistics
from pathlib import Path

import pytest

from flashsgd.cli import main
from flashsgd.train.records.compare import Run, compare, derive_labels
from flashsgd.train.records.report import read_metrics

TINY = ["--num-samples", "2000", "--epochs", "2", "--global-batch", "256", "--no-progress",
        "--workers", "2"]


@pytest.fixture(scope="module")
def runs(tmp_path_factory) -> dict[str, Path]:
    """Three tiny real runs: ring with seeds 0 and 1, gtopk at density 0.01 (seed 0)."""
    root = tmp_path_factory.mktemp("runs")
    settings = {"ring-s0": ["--comm", "ring"], "ring-s1": ["--comm", "ring", "--seed", "1"],
                "gtopk": ["--comm", "gtopk", "--density", "0.01"]}
    for name, extra in settings.items():
        assert main(["train", *TINY, *extra, "--out", str(root / name)]) == 0
    return {name: root / name for name in settings}


def _summary(run: Path) -> dict:
    return json.loads((run / "summary.json").read_text())


def test_table_matches_summary_and_metrics(runs, tmp_path, capsys):
    out, table = tmp_path / "cmp.png", tmp_path / "cmp.json"
    rows = compare([str(runs["ring-s0"]), str(runs["gtopk"])], out=str(out), json_path=str(table))
    printed = capsys.readouterr().out
    assert [r["label"] for r in rows] == ["ring", "gtopk density=0.01"]  # density of ring: unused
    for row, name in zip(rows, ["ring-s0", "gtopk"]):
        s = _summary(runs[name])
        assert row["algorithm"] == s["algorithm"] and row["seeds"] == [0]
        assert row["steps"]["mean"] == s["steps"]
        assert row["final_test_accuracy"]["mean"] == s["final_test_accuracy"]
        assert row["best_test_accuracy"]["mean"] == s["best_test_accuracy"]
        assert row["images_per_s"]["mean"] == pytest.approx(s["images_per_s"])
        assert row["time_to_target_s"]["values"] == [s["time_to_accuracy_s"]]  # target 97: the run's
        steps, _ = read_metrics(runs[name] / "metrics.jsonl")
        shares = [r["t_comm_s"] / r["t_step_s"] for r in steps if r["step"] >= 2]
        assert row["comm_share"]["mean"] == pytest.approx(statistics.mean(shares))
        assert f"{s['final_test_accuracy']:.2f}" in printed
    assert rows[0]["final_accuracy_diff"] == 0
    assert rows[1]["final_accuracy_diff"] == pytest.approx(
        _summary(runs["gtopk"])["final_test_accuracy"] - _summary(runs["ring-s0"])["final_test_accuracy"])
    assert "not reached" in printed
    assert out.stat().st_size > 10_000
    assert json.loads(table.read_text()) == {"target_accuracy": 97.0, "settings": rows}


def test_time_to_target_is_the_first_evaluation_at_or_above_it(runs, tmp_path, capsys):
    _, evals = read_metrics(runs["gtopk"] / "metrics.jsonl")
    target = evals[0]["test_accuracy"]
    rows = compare([str(runs["gtopk"])], target=target, out=str(tmp_path / "c.png"))
    assert rows[0]["time_to_target_s"]["mean"] == evals[0]["elapsed_s"]
    assert f"time to {target:g}%" in capsys.readouterr().out


def test_seeds_of_one_setting_are_grouped(runs, tmp_path, capsys):
    dirs = [str(runs[n]) for n in ("ring-s0", "gtopk", "ring-s1")]
    rows = compare(dirs, labels="dense,sparse", json_path=str(tmp_path / "c.json"))
    assert (tmp_path / "c.png").is_file()  # next to --json
    assert [r["label"] for r in rows] == ["dense", "sparse"]
    dense = rows[0]
    assert dense["seeds"] == [0, 1] and dense["runs"] == [dirs[0], dirs[2]]
    assert dense["status"] == "complete" and dense["note"] == ""  # complete, distinct seeds: pooled
    finals = [_summary(runs[n])["final_test_accuracy"] for n in ("ring-s0", "ring-s1")]
    assert dense["final_test_accuracy"]["values"] == finals
    assert dense["final_test_accuracy"]["mean"] == pytest.approx(statistics.mean(finals))
    assert (dense["final_test_accuracy"]["min"], dense["final_test_accuracy"]["max"]) == (min(finals), max(finals))
    line = next(x for x in capsys.readouterr().out.splitlines() if x.startswith("dense"))
    if finals[0] != finals[1]:
        assert f"({min(finals):.2f}..{max(finals):.2f})" in line


def _one_line_error(capsys, argv: list[str]) -> str:
    assert main(argv) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1, err
    return err[0]


def test_bad_input_is_one_line_naming_it(runs, tmp_path, capsys):
    empty = tmp_path / "not-a-run"
    empty.mkdir()
    err = _one_line_error(capsys, ["compare", str(runs["ring-s0"]), str(empty)])
    assert str(empty) in err and "metrics.jsonl" in err
    unevaluated = tmp_path / "unevaluated"
    unevaluated.mkdir()
    shutil.copy(runs["gtopk"] / "config.toml", unevaluated)
    lines = (runs["gtopk"] / "metrics.jsonl").read_text().splitlines()
    (unevaluated / "metrics.jsonl").write_text("\n".join(x for x in lines if '"eval"' not in x) + "\n")
    err = _one_line_error(capsys, ["compare", str(unevaluated)])
    assert str(unevaluated) in err and "no evaluation" in err
    err = _one_line_error(capsys, ["compare", str(runs["ring-s0"]), str(runs["ring-s1"]),
                                   str(runs["gtopk"]), "--labels", "a,b,c", "--out", str(tmp_path / "c.png")])
    assert "3 labels for 2 settings" in err
    assert not (tmp_path / "c.png").exists()


def _setting(path: str, **settings) -> list[Run]:
    return [Run(Path(path), 0, settings, settings["algorithm"], 97.0, [], [])]


def test_labels_name_what_differs():
    ring = _setting("r", algorithm="ring", recipe="fujitsu")
    sparse = _setting("s1", algorithm="gtopk", recipe="fujitsu", density=0.001, selection="auto")
    denser = _setting("s2", algorithm="gtopk", recipe="fujitsu", density=0.01, selection="auto")
    # density: differs between the runs that take it; selection: the default everywhere it is used
    assert derive_labels([ring, sparse, denser]) == ["ring", "gtopk density=0.001", "gtopk density=0.01"]
    assert derive_labels([ring, sparse]) == ["ring", "gtopk"]  # 0.001 is the default density
    goyal = _setting("g", algorithm="ring", recipe="goyal")
    assert derive_labels([ring, goyal]) == ["recipe=fujitsu", "recipe=goyal"]
    assert derive_labels([ring]) == ["ring"]
    assert derive_labels([ring, _setting("r2", algorithm="ring", recipe="fujitsu")]) == ["r", "r2"]
