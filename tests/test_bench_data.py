"""`flashsgd bench data`: the pipeline table (in-process vs workers) and the training rows, tiny."""

from __future__ import annotations

import json

import pytest
import torch

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
    assert {r["decode"] for r in rows.values()} == {"host"}
    if not torch.cuda.is_available():  # the GPU row says why it is absent, and the run succeeds
        why = "no CUDA device (torch.cuda.is_available() is False)"
        assert res["gpu_decode"] == {"decode": "device", "absent": why}
        assert "gpu (nvjpeg)             -  absent: no CUDA device" in text


def test_bench_data_gpu_decode_rows_their_ratios_and_the_default(tmp_path, capsys, monkeypatch):
    """The device-decode pipelines' rows (one per worker count), their ratios to CPU decode with the
    same workers and the trainer's default pick, run on the CPU (decode="device" there decodes in
    the receiving process: the plumbing, not nvJPEG)."""
    from flashsgd.train.data import images

    monkeypatch.setattr(images, "device_decode_unavailable", lambda device: None)
    out = tmp_path / "data.json"
    assert main(["bench", "data", "--images", "16", "--photo-size", "60x45", "--image-size", "32",
                 "--batch", "4", "--reps", "1", "--data-workers", "0,1", "--json", str(out)]) == 0
    text = capsys.readouterr().out
    gpu = json.loads(out.read_text())["gpu_decode"]
    assert [(r["decode"], r["data_workers"], r["images"]) for r in gpu] == [("device", 0, 16), ("device", 1, 16)]
    assert all(r["images_per_s"] > 0 and r["ratio_to_cpu_decode"] > 0 for r in gpu)
    assert [r["default"] for r in gpu] == ["device", "device"]  # below HOST_DECODE_FROM_WORKERS
    assert "gpu (nvjpeg)" in text
    assert "gpu decode vs cpu decode with the same data workers: 0 workers" in text and "1 worker " in text


@pytest.mark.slow  # 22 s
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
