"""`flashsgd bench data`: the pipeline table (in-process vs workers) and the training rows, tiny."""

from __future__ import annotations

import json

import pytest

from flashsgd.cli import main


def test_bench_data_compares_workers_with_in_process_decode(tmp_path, capsys):
    out = tmp_path / "data.json"
    assert main(["bench", "data", "--images", "16", "--photo-size", "60x45", "--image-size", "32",
                 "--batch", "4", "--reps", "1", "--data-workers", "0,2", "--json", str(out)]) == 0
    text = capsys.readouterr().out
    assert "vs in-process" in text and "1.00x" in text
    res = json.loads(out.read_text())
    rows = {r["data_workers"]: r for r in res["pipeline"]}
    assert set(rows) == {0, 2} and rows[0]["images"] == 16
    assert rows[0]["ratio_to_in_process"] == 1.0 and rows[2]["images_per_s"] > 0


def test_bench_data_training_rows_show_the_data_wait(tmp_path, capsys):
    assert main(["bench", "data", "--images", "24", "--photo-size", "60x45", "--image-size", "32",
                 "--batch", "4", "--reps", "1", "--data-workers", "0,1", "--train-steps", "4",
                 "--model", "resnet20"]) == 0
    text = capsys.readouterr().out
    assert "data wait s" in text and "training resnet20" in text


@pytest.mark.parametrize("flags,match", [(["--data-workers", "a"], "comma-separated integers"),
                                         (["--data-workers", "-1"], "comma-separated integers"),
                                         (["--photo-size", "500"], "WIDTHxHEIGHT"),
                                         (["--batch", "0"], "--batch must be >= 1")])
def test_bench_data_bad_flags_are_named(flags, match, capsys):
    assert main(["bench", "data", "--images", "4", "--photo-size", "20x20", *flags]) == 2
    assert match in capsys.readouterr().err
