"""`flashsgd bench gpu`: the one-command GPU check. Without a GPU: its one-line answer and exit codes,
its flags, and every check's code path at tiny sizes on the CPU (``--device cpu``); with CUDA,
the real check (skipped cleanly here)."""

from __future__ import annotations

import argparse
import json
import os

import pytest
import torch

from flashsgd.bench import gpu, gpu_hooks, gpu_overhead
from flashsgd.bench.gpu_common import RATIO_TARGET, GpuSettings, cuda_missing
from flashsgd.cli import main
from flashsgd.exchanges import EXCHANGES, NODE_SPLITS, SELECTIONS


def _rows(path) -> list[dict]:
    return json.loads(path.read_text())["results"]


def _failed_consistently(rc: int, rows: list[dict]) -> bool:
    """The exit status is 1 exactly when some row failed its target."""
    return rc == (1 if any(r.get("passed") is False for r in rows) else 0)


# ------------------------------------------------------------------------- without CUDA -------

@pytest.mark.parametrize("flags, rc", [([], 0), (["--require-cuda"], 1), (["--quick", "--json", "x.json"], 0)])
def test_no_cuda_is_one_line_and_exit_0_unless_required(monkeypatch, capsys, tmp_path, flags, rc):
    monkeypatch.chdir(tmp_path)
    monkeypatch.setattr(gpu, "cuda_missing", lambda: "torch 9.9 is built without CUDA")
    assert main(["bench", "gpu", *flags]) == rc
    out = capsys.readouterr()
    assert out.out == "no CUDA device: torch 9.9 is built without CUDA; nothing checked\n" and out.err == ""
    assert not (tmp_path / "x.json").exists()


def test_why_cuda_is_missing(monkeypatch):
    monkeypatch.setattr(torch.version, "cuda", None)
    assert cuda_missing() == f"torch {torch.__version__} is built without CUDA"
    monkeypatch.setattr(torch.version, "cuda", "12.8")
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "")
    assert cuda_missing() == (f"torch.cuda.is_available() is False (torch {torch.__version__} built for CUDA 12.8; "
                              "no NVIDIA driver or no visible GPU, CUDA_VISIBLE_DEVICES='')")
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    assert cuda_missing() is None


@pytest.mark.parametrize("flags, message", [
    (["--checks", "hooks,speed"], "--checks 'hooks,speed': unknown speed; valid: hooks, select, lars, train"),
    (["--precisions", "fp8"], "--precisions 'fp8': unknown fp8; valid: fp32, bf16, fp16"),
    (["--hook-ranks", "2,0"], "--hook-ranks '2,0' must be a comma-separated list of rank counts >= 1"),
    (["--densities", "0.5,2"], "--densities must be a number in (0, 1]"),
    (["--steps", "0"], "--steps must be >= 1, got 0"),
    (["--batch", "0"], "--batch must be >= 1, got 0"),
])
def test_bad_flags_are_refused_with_or_without_a_gpu(capsys, flags, message):
    assert main(["bench", "gpu", *flags]) == 2
    assert message in capsys.readouterr().err


def _args(*argv):
    parser = argparse.ArgumentParser()
    gpu.add_arguments(parser)
    return parser.parse_args(argv)


def test_quick_and_the_device_defaults():
    args = _args
    settings, checks, worlds = gpu.settings_from(args("--quick"), torchvision=True)
    assert (worlds, settings.channels_last, settings.compile, checks) == ((2,), (True,), (False,), gpu.QUICK_CHECKS)
    assert gpu.settings_from(args(), torchvision=True)[1] == gpu.CHECKS == gpu.QUICK_CHECKS + ("overhead",)
    assert gpu.settings_from(args("--quick", "--checks", "overhead"), torchvision=True)[1] == ("overhead",)
    assert (settings.model, settings.batch, settings.numel, settings.torchvision) == ("resnet50", 256, 25_557_032, True)
    settings, _, worlds = gpu.settings_from(args("--device", "cpu", "--compile", "on"), torchvision=True)
    assert (worlds, settings.compile, settings.channels_last) == ((2, 4), (True,), (False, True))
    assert (settings.model, settings.torchvision) == ("resnet20", False)  # torchvision has no ResNet-20
    assert GpuSettings.for_device("cuda").densities == (0.001, 0.01)


def test_every_exchange_of_the_catalog_is_checked():
    cases = gpu_hooks.hook_cases(4)
    assert {c.hook for c in cases} == set(EXCHANGES)
    labels = [c.label for c in cases]
    assert len(set(labels)) == len(labels)
    for name, exchange in EXCHANGES.items():
        mine = [c for c in cases if c.hook == name]
        if exchange.family == "sparse":  # every variant at density 1.0 (== dense), and error feedback
            assert {c.reference for c in mine if dict(c.options)["density"] == 1.0} == {"dense"}
            mass = [dict(c.options) for c in mine if c.reference == "mass"]
            key, values = ("node_split", NODE_SPLITS) if name == "hgtopk" else ("selection", SELECTIONS)
            assert sorted(o[key] for o in mass) == sorted(values)
        if "threaded" in exchange.option_names():
            assert any("threaded=" in c.label for c in mine), name
    assert dict(next(c for c in cases if c.hook == "hgtopk").options)["ranks_per_node"] == 2


# --------------------------------------------------------- every check on the CPU, tiny -------

def test_cpu_path_hooks_every_case_passes(tmp_path, capfd):
    out = tmp_path / "hooks.json"
    rc = main(["bench", "gpu", "--device", "cpu", "--checks", "hooks", "--hook-ranks", "2", "--json", str(out)])
    rows = _rows(out)
    text = capfd.readouterr().out
    assert rc == 0, text
    for world in (2, 1):  # the Gloo ranks, then the world-1 run that is NCCL's on a GPU
        mine = [r for r in rows if r["world"] == world]
        assert [r["case"] for r in mine] == [c.label for c in gpu_hooks.hook_cases(world)]
        assert all(r["passed"] and r["rel_diff"] <= gpu_hooks.TOLERANCE for r in mine), mine
        assert all(r["compressed"] for r in mine if EXCHANGES[r["hook"]].compresses)
    assert "no figure here describes a GPU" in text and "powersgd" in text
    n = sum(len(gpu_hooks.hook_cases(world)) for world in (2, 1))  # one row with a target per case
    assert f"# {n} rows with a target: {n} pass, 0 FAIL" in text


def _crash_one_case(run_case):
    def run(case, device):
        import torch.distributed as dist

        if case.hook == "ring" and dist.get_rank() == 1:
            os._exit(3)  # a crash in C code looks like this to the launcher
        return run_case(case, device)
    return run


def test_a_hook_that_kills_a_rank_is_one_failed_row(monkeypatch, capfd):
    # ranks are forked on the CPU: they inherit these patches
    cases = [gpu_hooks._case("native", "dense"), gpu_hooks._case("ring", "dense"),
             gpu_hooks._case("nohook", "dense"), gpu_hooks._case("noop", "local")]
    monkeypatch.setattr(gpu_hooks, "hook_cases", lambda world: cases)
    monkeypatch.setattr(gpu_hooks, "_run_case", _crash_one_case(gpu_hooks._run_case))
    rows = gpu_hooks._run_world(2, "gloo", GpuSettings.for_device("cpu"))
    assert [(r["hook"], r["passed"]) for r in rows] == [("native", True), ("ring", False), ("nohook", False),
                                                        ("noop", True)]
    assert "the job failed: rank 1 exited with code 3" in rows[1]["error"]
    assert rows[2]["error"].startswith("rank 0: UnknownNameError: unknown DDP communication hook 'nohook'; known:")
    assert "ring" in capfd.readouterr().out


@pytest.mark.slow  # 29 s; the GPU check's code paths, run by pytest -m gpu on a GPU
def test_cpu_path_select_lars_and_train(tmp_path, capfd):
    out = tmp_path / "gpu.json"
    rc = main(["bench", "gpu", "--device", "cpu", "--checks", "select,lars,train", "--precisions", "fp16",
               "--channels-last", "on", "--compile", "off", "--json", str(out)])
    rows, text = _rows(out), capfd.readouterr().out
    assert _failed_consistently(rc, rows), text
    select = [r for r in rows if r["check"] == "select"]
    assert {r["method"] for r in select} == {"add (1 pass)", "torch.topk", "exact", "sampled", "threshold",
                                            "threshold+reuse"}
    assert {r["density"] for r in select} == {0.001, 0.01} and {r["numel"] for r in select} == {2 ** 18}
    for r in select:
        assert r["reps"] == 2 and r["min_ms"] <= r["ms"] <= r["max_ms"]
        if r["method"] not in ("add (1 pass)", "torch.topk"):  # the exact top-k, up to ties
            assert r["same_magnitudes"] and r["index_share"] == 1.0 and r["passed"], r
    lars, sgd = [r for r in rows if r["check"] == "lars"]
    assert lars["passed"] and lars["rel_diff_vs_loop"] <= 1e-5 and sgd["step"] == "sgd (foreach)"
    assert lars["ratio_to_sgd"] == pytest.approx(lars["ms"] / sgd["ms"])
    assert lars["tensors"] == 59 and lars["params"] == 269_722  # ResNet-20
    (train,) = [r for r in rows if r["check"] == "train"]
    assert train["error"] is None and (train["precision"], train["channels_last"], train["compile"]) == \
        ("fp16", True, False)
    for loop in ("flashsgd", "plain"):
        assert train[loop]["reps"] == 2 and train[loop]["images_per_s"] == pytest.approx(8e3 / train[loop]["ms"])
    assert train["ratio_to_plain"] == pytest.approx(train["flashsgd"]["images_per_s"] / train["plain"]["images_per_s"])
    assert train["passed"] == (train["ratio_to_plain"] >= RATIO_TARGET) and train["ratio_to_torchvision"] is None
    assert 0 <= train["flashsgd"]["skipped"] <= 2
    assert "flashsgd ms (min..max)" in text and "x plain" in text


def _measure_failing(settings, device, batch, precision, channels_last, compiled):
    if precision == "fp32":
        raise RuntimeError("CUDA out of memory. Tried to allocate 2.00 GiB")
    os._exit(9)  # bf16: the process dies (as on an illegal memory access)


def test_a_failed_training_configuration_is_a_row_and_a_dead_job_keeps_the_rows_before(
        monkeypatch, tmp_path, capfd):
    from flashsgd.bench import gpu_train

    monkeypatch.setattr(gpu_train, "measure", _measure_failing)  # inherited by the forked rank
    out = tmp_path / "train.json"
    assert main(["bench", "gpu", "--device", "cpu", "--checks", "train", "--channels-last", "off",
                 "--compile", "off", "--json", str(out)]) == 1
    first, dead = _rows(out)
    assert (first["precision"], first["passed"], first["error"]) == \
        ("fp32", False, "RuntimeError: CUDA out of memory. Tried to allocate 2.00 GiB")
    assert dead == {"check": "train", "passed": False, "error": "the job failed: rank 0 exited with code 9"}
    text = capfd.readouterr().out
    assert "fp32      off     off | FAIL: RuntimeError: CUDA out of memory" in text
    assert "# 2 rows with a target: 0 pass, 2 FAIL (train fp32 ch_last off compile off, train job)" in text


@pytest.mark.slow
def test_cpu_path_every_training_configuration_with_compile(tmp_path, capfd):
    out = tmp_path / "train.json"
    rc = main(["bench", "gpu", "--device", "cpu", "--checks", "train", "--json", str(out)])
    rows = _rows(out)
    assert _failed_consistently(rc, rows), capfd.readouterr().out
    assert [(r["precision"], r["channels_last"], r["compile"]) for r in rows] == \
        [(p, cl, c) for c in (False, True) for p in ("fp32", "bf16", "fp16") for cl in (False, True)]
    assert all(r["error"] is None for r in rows), [r["error"] for r in rows]
    assert all(r["flashsgd"]["compiled"] in (True, False) for r in rows if r["compile"])


def test_cpu_path_overhead_every_hook_and_no_host_sync_on_its_cuda_path(tmp_path, capfd):
    """Every hook of the catalog in a plain DDP loop: a row each, timed beside the plain loop, and
    its CUDA code path (counted on this CPU) adds no host synchronization to the plain loop's."""
    out = tmp_path / "overhead.json"
    rc = main(["bench", "gpu", "--device", "cpu", "--checks", "overhead", "--json", str(out)])
    rows, text = _rows(out), capfd.readouterr().out
    assert rc == 0, text
    assert [r["hook"] for r in rows] == list(EXCHANGES) and {r["batch"] for r in rows} == {8}
    for r in rows:
        assert r["host_syncs"] == r["plain_host_syncs"] == 0, r
        assert r["passed"] and r["target"] is None and r["reps"] == 2  # no time target on a CPU
        assert r["ratio_to_plain"] == pytest.approx(r["plain_ms"] / r["ms"])
        assert r["min_ms"] <= r["ms"] <= r["max_ms"]
    assert gpu_overhead.target("powersgd") == 0.90 and gpu_overhead.target("gtopk") == RATIO_TARGET
    assert f"# {len(EXCHANGES)} rows with a target: {len(EXCHANGES)} pass, 0 FAIL" in text


def _selection_that_reads_its_count(select):
    def run(state, x, k, idx, rank, bmax=None):
        int(x.abs().max() > 0)  # a host read, as a data-dependent size would be
        return select(state, x, k, idx, rank, bmax)
    return run


def test_overhead_a_hook_that_waits_for_the_device_fails_its_row(monkeypatch, capfd):
    from flashsgd.comm.sparse import hooks as sparse_hooks

    monkeypatch.setattr(sparse_hooks, "select", _selection_that_reads_its_count(sparse_hooks.select))
    monkeypatch.setattr(gpu_overhead, "hooks", lambda: ["ring", "gtopk"])  # inherited by the forked rank
    assert main(["bench", "gpu", "--device", "cpu", "--checks", "overhead"]) == 1
    text = capfd.readouterr().out
    assert "# 2 rows with a target: 1 pass, 1 FAIL (overhead gtopk batch 8)" in text
    assert "__int__ hooks.py" in text or "__int__ test_bench_gpu.py" in text, text


# ---------------------------------------------------------------------------- with CUDA -------

@pytest.mark.gpu
def test_the_gpu_check_on_cuda(tmp_path, capfd):
    out = tmp_path / "gpu.json"
    rc = main(["bench", "gpu", "--quick", "--precisions", "bf16", "--batch", "32", "--steps", "3",
               "--warmup", "2", "--json", str(out)])
    rows, text = _rows(out), capfd.readouterr().out
    assert _failed_consistently(rc, rows), text
    correctness = [r for r in rows if r["check"] in ("hooks", "select", "lars") and r.get("passed") is not None]
    assert correctness and all(r["passed"] for r in correctness), [r for r in correctness if not r["passed"]]
    assert {r["backend"] for r in rows if r["check"] == "hooks"} == {"gloo", "nccl"}
    assert [r["error"] for r in rows if r["check"] == "train"] == [None]


@pytest.mark.gpu
def test_the_overhead_check_on_cuda(tmp_path, capfd):
    """On a GPU: every hook's row, and no hook adds a host synchronization to the plain loop's
    (the time ratios are the check's own targets, at batch 256: see docs/gpu.md)."""
    out = tmp_path / "overhead.json"
    main(["bench", "gpu", "--checks", "overhead", "--batch", "32", "--steps", "3", "--warmup", "3",
          "--json", str(out)])
    rows, text = _rows(out), capfd.readouterr().out
    assert [(r["hook"], r["batch"]) for r in rows] == [(h, b) for b in (32, 8) for h in EXCHANGES], text
    assert all(r["host_syncs"] <= r["plain_host_syncs"] for r in rows), \
        [(r["hook"], r["sync_sites"]) for r in rows if r["host_syncs"] > r["plain_host_syncs"]]
