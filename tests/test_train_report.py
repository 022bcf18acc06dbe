"""The training run's summary.json, final line and report.png say what the run did."""

from __future__ import annotations

import json
from types import SimpleNamespace

import pytest

from flashsgd.train import config as C
from flashsgd.train.records import report
from flashsgd.train.plan import build_plan
from flashsgd.train.records import Progress


def _metrics(out, steps: int) -> None:
    rows = [{"kind": "step", "step": s, "loss": 2.0 / s, "lr": 0.1, "global_batch": 256,
             "images_per_s": 1000.0, "t_step_s": 0.1, "t_comm_s": 0.01, "t_forward_s": 0.03,
             "t_backward_s": 0.05} for s in range(1, steps + 1)]
    rows.append({"kind": "eval", "epoch": 1, "step": steps, "test_accuracy": 50.0, "test_loss": 1.5})
    (out / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))


def _summarize(tmp_path, monkeypatch, cli: dict, steps: int, edit=None):
    """summarize() of a made-up metrics.jsonl (then ``edit(path)``) under the plan of ``cli``;
    returns (summary, printed text, legend labels of the loss panel)."""
    import matplotlib.pyplot as plt

    legends = []
    close = plt.close

    def keep_legend(fig=None):
        if fig is not None:
            legends.append([t.get_text() for t in fig.axes[0].get_legend().get_texts()])
        close(fig)

    monkeypatch.setattr(plt, "close", keep_legend)
    cfg = C.resolve(cli={"out": str(tmp_path), **cli})
    plan = build_plan(cfg, 2, 32000, local_spawn=True, backend="gloo")
    _metrics(tmp_path, steps)
    if edit is not None:
        edit(tmp_path / "metrics.jsonl")
    topo = SimpleNamespace(num_nodes=1, ranks_per_node=2, grid=(2, 1))
    progress = Progress.from_json({"tta_s": None, "elapsed_s": 1.0, "step": steps, "epoch": 1, "skipped": 0})
    summary = report.summarize(plan, progress, topo, None, 1.0)
    return plan, summary, legends[0]


def test_summary_names_the_resolved_recipe_and_the_legend_its_smoothing(tmp_path, monkeypatch, capsys):
    plan, summary, legend = _summarize(tmp_path, monkeypatch, {}, steps=1)
    assert plan.recipe.name == "fujitsu-mnist1d" and plan.recipe.label_smoothing == 0
    assert summary["recipe"] == "fujitsu-mnist1d"  # not the requested "fujitsu"
    assert json.loads((tmp_path / "summary.json").read_text())["recipe"] == "fujitsu-mnist1d"
    assert legend[0] == "train loss"  # no "(with label smoothing)" on a run without it
    text = capsys.readouterr().out
    assert "done in 1.0 s, 1 step (0 skipped)" in text  # not "1 steps"
    assert "nan" not in text


def test_legend_names_the_smoothing_the_run_used(tmp_path, monkeypatch, capsys):
    plan, summary, legend = _summarize(tmp_path, monkeypatch, {"proxy_tuning": False}, steps=3)
    assert summary["recipe"] == "fujitsu" and plan.recipe.label_smoothing == pytest.approx(0.1)
    assert legend[0] == "train loss (label smoothing 0.1)"
    assert "3 steps" in capsys.readouterr().out
    _, _, legend = _summarize(tmp_path, monkeypatch, {"label_smoothing": 0.05}, steps=3)
    assert legend[0] == "train loss (label smoothing 0.05)"  # the override, not the recipe's


def test_loss_label():
    assert report.train_loss_label(0.0) == "train loss"
    assert report.train_loss_label(0.1) == "train loss (label smoothing 0.1)"


def test_a_damaged_row_never_stops_a_run_from_finishing(tmp_path, monkeypatch, capsys):
    """The run's own summary leaves a damaged line out, with a note naming the file and the line
    (it used to end the finished run with a bare JSONDecodeError, on every rerun)."""
    def cut_row_2(path):
        lines = path.read_text().splitlines()
        lines[1] = lines[1][:40]
        path.write_text("".join(x + "\n" for x in lines))

    _, summary, _ = _summarize(tmp_path, monkeypatch, {}, steps=4, edit=cut_row_2)
    assert summary["steps"] == 4 and summary["final_test_accuracy"] == 50.0
    err = capsys.readouterr().err
    assert f"flashsgd train: note: {tmp_path / 'metrics.jsonl'} line 2: damaged: not JSON" in err
    assert "left out" in err and (tmp_path / "report.png").is_file()
