"""The run records (flashsgd.train.records): one schema of a metrics.jsonl row that the worker
writes, TensorBoard and summary.json read; the progress a checkpoint carries; old files load."""

from __future__ import annotations

import json
import shutil
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch

from flashsgd.train import config as C
from flashsgd.train.records import (EVAL_FIELDS, STEP_FIELDS, Eval, Progress, eval_row, read_metrics,
                                    resume_row, step_row)

REQUIRED = [f.name for f in STEP_FIELDS if not f.optional]
OWN = dict(step=3, epoch=0.5, lr=0.2, global_batch=256, scheduled_batch=256, local_batch=64)


def _result(scale=None, **kw) -> SimpleNamespace:
    """A StepResult's values (the properties the schema reads)."""
    values = dict(loss=2.25, samples=256, total_s=0.5, data_s=0.01, forward_s=0.1, backward_s=0.2,
                  comm_s=0.05, sync_s=0.02, optimizer_s=0.03, skipped=False, overflow=False,
                  loss_scale=None if scale is None else float(scale), scale=scale)
    return SimpleNamespace(**{**values, **kw})


@pytest.fixture(scope="module")
def run(tmp_path_factory) -> Path:
    """A tiny 1-worker run stopped by run.max_steps (so its last evaluation is ``at_stop``)."""
    from flashsgd.train.trainer import train

    out = tmp_path_factory.mktemp("records") / "run"
    train(C.resolve(cli=dict(num_samples=2000, epochs=2.0, global_batch=256, progress=False,
                             out=str(out), workers=1, max_steps=9)))
    return out


def test_a_step_row_round_trips_in_schema_order(tmp_path):
    row = step_row(_result(), **OWN)
    assert list(row) == ["kind", *REQUIRED]
    assert row["images_per_s"] == 256 / 0.5 and row["t_comm_s"] == 0.05 and row["loss"] == 2.25
    fp16 = step_row(_result(scale=torch.tensor(1024.0), overflow=True), **OWN)
    assert list(fp16) == ["kind", *[f.name for f in STEP_FIELDS]]
    assert (fp16["loss_scale"], fp16["overflow"]) == (1024.0, True)
    stop = eval_row(epoch=1.5, step=9, test_accuracy=50.0, test_loss=1.5, elapsed_s=2.0, at_stop=True)
    plain = eval_row(epoch=1, step=7, test_accuracy=40.0, test_loss=1.7, elapsed_s=1.0, at_stop=None)
    assert "at_stop" not in plain and list(stop) == ["kind", *[f.name for f in EVAL_FIELDS]]
    path = tmp_path / "metrics.jsonl"
    path.write_text("".join(json.dumps(r) + "\n" for r in (row, fp16, plain)))
    steps, evals = read_metrics(path)
    assert steps == [fp16] and evals == [plain]  # the last row of step 3 is kept


def test_a_row_outside_the_schema_is_refused():
    with pytest.raises(KeyError, match="t_new_s"):
        step_row(_result(), **OWN, t_new_s=1.0)
    with pytest.raises(KeyError, match="lr"):
        step_row(_result(), **{k: v for k, v in OWN.items() if k != "lr"})


def test_progress_round_trips_as_the_dict_checkpoints_stored():
    old = {"step": 14, "epoch": 2, "elapsed_s": 3.5, "skipped": 1, "tta_s": None,
           "evals": [[1, 7, 61.25, 1.5], [2, 14, 70.0, 3.5]]}  # written by earlier versions
    p = Progress.from_json(old)
    assert p.evals[-1] == Eval(epoch=2, step=14, accuracy=70.0, elapsed_s=3.5) and p.evals[-1].step == 14
    assert p.overflow_skipped is None
    assert p.to_json() == old and list(p.to_json()) == list(old)
    p.overflow_skipped = 2
    assert Progress.from_json(json.loads(json.dumps(p.to_json()))) == p
    assert Progress().to_json() == {"step": 0, "epoch": 0, "elapsed_s": 0.0, "skipped": 0, "tta_s": None,
                                    "evals": []}


def test_the_worker_writes_exactly_the_schema(run):
    rows = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
    steps = [r for r in rows if r["kind"] == "step"]
    evals = [r for r in rows if r["kind"] == "eval"]
    assert len(steps) == 9 and all(list(r) == ["kind", *REQUIRED] for r in steps)
    assert [list(r) for r in evals] == [["kind", *[f.name for f in EVAL_FIELDS if not f.optional]],
                                        ["kind", *[f.name for f in EVAL_FIELDS]]]  # 7 steps, then the stop
    assert evals[-1]["at_stop"] is True
    for r in steps:  # images/s is the global batch over the step's time (StepResult.samples)
        assert r["images_per_s"] * r["t_step_s"] == pytest.approx(r["global_batch"])
    summary = json.loads((run / "summary.json").read_text())
    assert {f.summary for f in STEP_FIELDS if f.summary} <= set(summary["scaling"])
    latest = (run / "checkpoints" / "latest").read_text().strip()
    shared = torch.load(run / "checkpoints" / latest / "shared.pt", weights_only=True)
    progress = Progress.from_json(shared["progress"])
    assert list(shared["progress"]) == ["step", "epoch", "elapsed_s", "skipped", "tta_s", "evals"]
    assert progress.step == 9 and [e.step for e in progress.evals] == [7]  # saved before the stop's eval


def test_tensorboard_tags_come_from_the_schema(run):
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    events = EventAccumulator(str(run / "tensorboard"))
    events.Reload()
    tags = [f.tensorboard for f in STEP_FIELDS + EVAL_FIELDS if f.tensorboard]
    assert sorted(events.Tags()["scalars"]) == sorted(tags)
    assert "train/loss" in tags and "test/accuracy" in tags
    loss = [e.value for e in events.Scalars("train/loss")]
    steps, _ = read_metrics(run / "metrics.jsonl")
    assert loss == pytest.approx([s["loss"] for s in steps])


def test_an_old_run_directory_still_compares(run, tmp_path, capsys):
    """Rows of an older version (no scheduled / local batch, data, sync and optimizer times, skipped)
    and a resume row: read, summarized and compared as before."""
    from flashsgd.train.records.compare import compare
    from flashsgd.train.records.report import timed_median

    old = tmp_path / "old"
    shutil.copytree(run, old)
    dropped = {"scheduled_batch", "local_batch", "t_data_s", "t_sync_s", "t_optimizer_s", "skipped"}
    rows = [{k: v for k, v in json.loads(line).items() if k not in dropped}
            for line in (run / "metrics.jsonl").read_text().splitlines()]
    rows += [resume_row(3)] + [r for r in rows if r["kind"] == "eval" or r["step"] >= 3]  # logged again
    (old / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    steps, evals = read_metrics(old / "metrics.jsonl")
    assert [s["step"] for s in steps] == list(range(9)) and len(evals) == 2
    assert timed_median(steps, "t_sync_s") != timed_median(steps, "t_sync_s")  # missing: nan
    assert timed_median(steps, "t_comm_s") == timed_median(read_metrics(run / "metrics.jsonl")[0], "t_comm_s")
    rows = compare([str(run), str(old)], labels=None, out=str(tmp_path / "c.png"))
    assert rows[0]["images_per_s"]["values"] == rows[1]["images_per_s"]["values"]
    # both stopped at run.max_steps: each a row of its own, never pooled (nor one seed twice)
    assert [(r["status"], r["runs"]) for r in rows] == [("stopped 9/14", [str(run)]), ("stopped 9/14", [str(old)])]
    printed = capsys.readouterr().out
    assert "not reached" in printed and f"{old}: stopped at step 9 of 14 (run.max_steps)" in printed
