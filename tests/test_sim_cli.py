"""`flashsgd simulate`: where the sweep's plot goes, and a command line that never imports torch."""

import argparse
import json
import os
import re
import subprocess
import sys

import pytest

from flashsgd.sim import cli

SWEEP = ("--cluster", "abci", "--sweep-gpus", "8,64", "--comm", "ring")


def run_cli(*argv):
    p = argparse.ArgumentParser()
    cli.add_arguments(p)
    return cli.run(p.parse_args(list(argv)))


def test_plot_goes_next_to_json_or_into_out_never_the_working_directory(tmp_path, monkeypatch, capsys):
    cwd = tmp_path / "cwd"
    cwd.mkdir()
    monkeypatch.chdir(cwd)
    assert run_cli(*SWEEP) == 0
    assert "no plot written: add --plot PATH, --out DIR or --json PATH" in capsys.readouterr().out
    js = tmp_path / "runs" / "eff.json"
    assert run_cli(*SWEEP, "--json", str(js)) == 0
    out = capsys.readouterr().out
    assert js.with_suffix(".png").stat().st_size > 10_000 and json.loads(js.read_text())["results"]
    assert f"wrote {js.with_suffix('.png')}" in out and f"wrote {js}" in out
    assert run_cli(*SWEEP, "--out", str(tmp_path / "figs")) == 0
    assert f"wrote {tmp_path / 'figs' / 'sim_sweep.png'}" in capsys.readouterr().out
    assert (tmp_path / "figs" / "sim_sweep.png").exists()
    assert os.listdir(cwd) == []  # nothing written where the command ran


def test_simulate_with_grid_and_calibration_never_imports_torch(tmp_path):
    bench = {"meta": {"world": 8, "grid": "2x4", "ranks_per_node": 8},
             "results": [{"algorithm": a, "size_bytes": s, "time_us": 10 + s / 1e3}
                         for a in ("ring", "torus2d") for s in (4096, 65536, 2**20, 2**24)]}
    path = tmp_path / "ar.json"
    path.write_text(json.dumps(bench))
    code = ("import sys; from flashsgd.cli import main\n"
            "assert main(['simulate', '--gpus', '1024', '--comm', 'torus2d', '--grid', '32x32']) == 0\n"
            f"assert main(['simulate', '--calibration', {str(path)!r}, '--gpus', '8', '--grid', '2x4',"
            " '--comm', 'torus2d', '--images-per-s', '100']) == 0\n"
            "assert 'torch' not in sys.modules, 'torch was imported'")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr


def test_no_module_under_sim_imports_flashsgd_train():
    """sim/ is below train/: no import statement names flashsgd.train, and importing every sim module
    loads none of it (a training model reaches the planner as ``flashsgd.train.models:NAME``)."""
    import ast
    from pathlib import Path

    sim_dir = Path(cli.__file__).parent
    found = []
    for path in sorted(sim_dir.glob("*.py")):
        for node in ast.walk(ast.parse(path.read_text())):
            mods = ([a.name for a in node.names] if isinstance(node, ast.Import)
                    else [node.module or ""] if isinstance(node, ast.ImportFrom) else [])
            found += [f"{path.name}:{node.lineno} {m}" for m in mods if m.startswith("flashsgd.train")]
    assert found == []
    names = " ".join(f"flashsgd.sim.{p.stem}" for p in sorted(sim_dir.glob("*.py")) if p.stem != "__init__")
    code = (f"import importlib, sys\nfor m in {names.split()!r}: importlib.import_module(m)\n"
            "bad = sorted(m for m in sys.modules if m.startswith('flashsgd.train'))\n"
            "assert not bad, bad")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr


def test_simulate_and_plan_resolve_models_alike(tmp_path, capsys):
    from flashsgd.sim import plan_cli
    from flashsgd.sim.workload import get_workload

    profile = tmp_path / "m.json"
    profile.write_text(json.dumps({"numels": [1000, 2_000_000, 10]}))
    assert get_workload(str(profile)).num_params == 2_001_010
    w = get_workload("flashsgd.train.models:resnet20")  # a flashsgd training model, by factory
    assert w.num_tensors > 50 and w.name == "flashsgd.train.models:resnet20"
    for argv in (["--model", str(profile), "--images-per-s", "100"],
                 ["--model", "flashsgd.train.models:resnet20", "--images-per-s", "900"]):
        assert run_cli("--cluster", "1gbe", "--gpus", "8", "--comm", "gtopk", *argv) == 0
        p = argparse.ArgumentParser()
        plan_cli.add_arguments(p)
        assert plan_cli.run(p.parse_args(["--cluster", "1gbe", "--gpus", "8", *argv])) == 0
    assert "MiB" in capsys.readouterr().out
    defaults = argparse.ArgumentParser()
    cli.add_arguments(defaults)
    args = defaults.parse_args([])
    assert (args.precision, args.density, args.index_bytes, args.node_split) == ("fp32", 0.001, 4, "leader")
    assert "int32" in cli_help("--index-bytes") and "int64" in cli_help("--index-bytes")


def cli_help(flag: str) -> str:
    p = argparse.ArgumentParser()
    cli.add_arguments(p)
    return next(a.help for a in p._actions if flag in a.option_strings)


SIX = """name = "six"
ranks_per_node = 6
[intra]
bandwidth_gbit = 1200.0
latency_us = 3.4
[inter]
bandwidth_gbit = 192.0
latency_us = 14.0
"""


def test_simulate_prints_the_torus_grid_and_warns_when_the_automatic_one_straddles_nodes(tmp_path, capsys):
    from flashsgd.sim.cluster_file import load_cluster
    from flashsgd.sim.engine import SimConfig, simulate, straddling_alternative
    from flashsgd.sim.workload import resnet50

    path = tmp_path / "six.toml"
    path.write_text(SIX)
    argv = ("--cluster", str(path), "--gpus", "192", "--comm", "torus2d", "--precision", "fp16",
            "--images-per-s", "1200", "--bucket-mb", "100")
    assert run_cli(*argv, "--json", str(tmp_path / "r.json")) == 0
    out = capsys.readouterr().out
    cluster, cfg = load_cluster(str(path)), SimConfig("torus2d", 192, 1200.0, precision="fp16", bucket_mb=100)
    auto = simulate(resnet50(), cluster, cfg)  # 32 nodes x 6: automatic 12x16, rows of 2 nodes
    aligned = simulate(resnet50(), cluster, SimConfig("torus2d", 192, 1200.0, precision="fp16",
                                                      bucket_mb=100, grid=(6, 32)))
    assert auto.grid == (12, 16) and aligned.iteration_s < auto.iteration_s
    assert straddling_alternative(resnet50(), cluster, cfg, auto) == aligned
    assert "grid 12x16 (automatic: near-square, X a multiple of 6 GPUs/node; rows span 2 nodes)" in out
    assert (f"the node-aligned grid 6x32 is faster: {aligned.iteration_s * 1e3:.2f} ms "
            f"({aligned.efficiency:.1%}) vs {auto.iteration_s * 1e3:.2f} ms ({auto.efficiency:.1%}); "
            "pass --grid 6x32") in out
    assert json.loads((tmp_path / "r.json").read_text())["results"][0]["grid"] == [12, 16]
    # a grid given on the command line is what runs, and is not second-guessed
    assert run_cli(*argv, "--grid", "12x16") == 0
    out = capsys.readouterr().out
    assert "grid 12x16 (given by --grid; rows span 2 nodes)" in out and "warning" not in out
    # ABCI, 1024 GPUs: the automatic 32x32 beats the node-aligned 4x256 (latency): no warning
    assert run_cli("--cluster", "abci", "--sweep-gpus", "8,1024", "--comm", "torus2d,ring") == 0
    out = capsys.readouterr().out
    assert "torus2d on 8 GPUs: grid 4x2 (automatic: near-square, X a multiple of 4 GPUs/node; a row is a node)" in out
    assert "torus2d on 1024 GPUs: grid 32x32" in out and "warning" not in out


def test_simulate_schedule_and_grad_accum_flags(capsys):
    import pytest

    assert run_cli("--cluster", "1gbe", "--gpus", "8", "--comm", "torus2d,gtopk", "--schedule", "trainer",
                   "--grad-accum", "4") == 0
    out = capsys.readouterr().out
    assert "algorithm torus2d, 8 GPUs, 4 buckets (largest 28.9 MiB) exchanged overlapping backward, " \
           "4 micro-batches per exchange" in out
    assert "algorithm gtopk, 8 GPUs, 4 buckets (largest 28.9 MiB) exchanged after backward, 4 micro-batches" in out
    with pytest.raises(ValueError, match="'gtopk_tree' is simulator-only"):
        run_cli("--cluster", "1gbe", "--gpus", "8", "--comm", "gtopk_tree", "--schedule", "trainer")
    with pytest.raises(ValueError, match=r"grad_accum must be an int in \[1, batch_per_gpu=32\]"):
        run_cli("--cluster", "1gbe", "--gpus", "8", "--grad-accum", "64")


def test_simulate_prints_each_number_with_its_range_and_what_it_assumed(tmp_path, capsys):
    """Independent check: the iteration range's ends are the runs of clusters written with every
    assumption at its fast and at its slow end (1gbe: sparse costs, the link, the compute rate)."""
    from dataclasses import replace

    import pytest

    from flashsgd.sim.engine import SimConfig, simulate
    from flashsgd.sim.network import CLUSTERS, Link, device_ranges
    from flashsgd.sim.uncertainty import assumed_lines, assumptions
    from flashsgd.sim.workload import resnet50

    js = tmp_path / "r.json"
    assert run_cli("--cluster", "1gbe", "--gpus", "32", "--comm", "gtopk", "--schedule", "after_backward",
                   "--json", str(js)) == 0
    out = capsys.readouterr().out
    one = CLUSTERS.get("1gbe")
    dev = device_ranges(one.device)  # the sparse and PowerSGD costs' ranges: the preset's device class
    ends = {fast: simulate(resnet50(), replace(
        one, exchange_fixed_s=dev["exchange_fixed_s"][0 if fast else 1], round_fixed_s=0.0 if fast else 0.13e-3,
        select_s_per_elem=dev["select_s_per_elem"][0 if fast else 1],
        flop_s=dev["flop_s"][0 if fast else 1], lowrank_s_per_elem=dev["lowrank_s_per_elem"][0 if fast else 1],
        step_overhead_s=0.0 if fast else 2e-3,
        jitter_cv=0.0 if fast else 0.037, bucket_overhead_s=0.0 if fast else 5e-3,
        overlap_slowdown=0.0 if fast else 0.79,
        inter=Link(0.2e-3, 0.1177) if fast else Link(1e-3, 0.090, incast=9 / 31)),
        SimConfig("gtopk", 32, 236.0 if fast else 164.0, schedule="after_backward")) for fast in (True, False)}
    nominal = simulate(resnet50(), one, SimConfig("gtopk", 32, 200.0, schedule="after_backward"))
    lo, hi = ends[True].iteration_s * 1e3, ends[False].iteration_s * 1e3
    assert lo < nominal.iteration_s * 1e3 < hi
    assert f"  iteration        {nominal.iteration_s * 1e3:9.2f} ms [{lo:.2f}-{hi:.2f}]" in out
    assert f"  compute             160.00 ms [{1e3 * 32 / 236:.2f}-{1e3 * 32 / 164:.2f}]" in out
    assert "  efficiency       " in out and "%  [" not in out
    # the same `assumed:` line as plan, and how the ranges were taken
    line = assumed_lines(assumptions(one, 200.0, (164.0, 236.0), "fp32"))[0]
    assert line in out and "inter-node bandwidth 0.111 GB/s (0.09-0.118)" in line
    assert "[low-high]: each number's lowest and highest at all fast | all slow | " in out
    doc = json.loads(js.read_text())
    r = doc["results"][0]
    assert r["ranges"]["iteration_s"] == pytest.approx([lo / 1e3, hi / 1e3], rel=1e-12)
    assert r["ranges"]["efficiency"][0] < r["efficiency"] < r["ranges"]["efficiency"][1]
    assert {a["input"] for a in doc["assumed"]} >= {"inter.bandwidth_gbps", "compute"}
    # the sweep's table: every cell with its ranges
    assert run_cli("--cluster", "1gbe", "--sweep-gpus", "8,32", "--comm", "gtopk,ring") == 0
    out = capsys.readouterr().out
    assert "scaling efficiency [range], iteration ms [range]:" in out
    row = next(x for x in out.splitlines() if x.strip().startswith("32 "))
    assert row.count("[") == 4 and "simulated 4 configurations at 7 settings of the assumptions" in out


def test_simulate_on_measured_inputs_says_there_is_no_range(tmp_path, capsys):
    from sim_helpers import LAB

    path = tmp_path / "lab.toml"
    path.write_text(LAB + "[costs]\nexchange_fixed_us = 800.0\nround_fixed_us = 30.0\nselect_ns_per_elem = 1.5\n"
                    "step_overhead_us = 0.0\njitter_percent = 0.0\nbucket_overhead_us = 0.0\n"
                    "overlap_slowdown_percent = 0.0\n")
    js = tmp_path / "r.json"
    assert run_cli("--cluster", str(path), "--gpus", "8", "--comm", "ring", "--images-per-s", "300",
                   "--json", str(js)) == 0
    out = capsys.readouterr().out
    assert "assumed: nothing (every input measured or given): each number is a single value, without a range" in out
    assert "[" not in out.split("workload", 1)[1]  # no range anywhere in the breakdown
    r = json.loads(js.read_text())["results"][0]
    assert r["ranges"]["iteration_s"] == [r["iteration_s"]] * 2 and json.loads(js.read_text())["assumed"] == []
    # a given --images-per-s gets a range only from --images-per-s-range
    assert run_cli("--cluster", str(path), "--gpus", "8", "--comm", "ring", "--images-per-s", "300",
                   "--images-per-s-range", "250", "350") == 0
    out = capsys.readouterr().out
    assert "assumed: compute (fp32) 300 images/s (250-350)" in out and "  compute          " in out
    assert f"  compute             106.67 ms [{32e3 / 350:.2f}-{32e3 / 250:.2f}]" in out


# ------------------------------------------- issue 49 item 7: one check of simulate's and plan's inputs

def _error_line(capfd) -> str:
    captured = capfd.readouterr()
    assert captured.out == "", captured.out  # refused before any output
    lines = captured.err.strip().splitlines()
    assert len(lines) == 1, lines
    return lines[0]


def test_simulate_and_plan_refuse_the_same_gpu_counts_in_the_same_words(tmp_path, capfd):
    """--gpus beyond MAX_GPUS (1e9 ran over 100 s, 1e12 over 240 s) and more GPUs than a cluster
    file holds (plan refused 64 on an 8-GPU file, simulate predicted it) are the cluster's one rule."""
    from flashsgd.cli import main
    from sim_helpers import LAB

    lab = tmp_path / "lab.toml"
    lab.write_text(LAB)
    over = 2 ** 18 + 4  # whole nodes of abci (4 GPUs each): only the bound refuses it
    for cluster, gpus, needle in (("abci", over, "262,148 GPUs is more than flashsgd simulates or plans: "
                                                 "at most 262,144 (2**18)"),
                                  (str(lab), 64, "64 GPUs exceed cluster 'lab': 4 nodes x 2 = 8 GPUs at most")):
        lines = []
        for argv in (["simulate", "--sweep-gpus", f"8,{gpus}"], ["simulate", "--gpus", str(gpus)],
                     ["plan", "--gpus", str(gpus), "--images-per-s", "300"]):
            assert main([argv[0], "--cluster", cluster, *argv[1:]]) == 2
            lines.append(_error_line(capfd))
        messages = {line.split(": error: ", 1)[1] for line in lines}
        assert len(messages) == 1 and needle in messages.pop(), lines
    assert main(["simulate", "--gpus", str(10 ** 12)]) == 2  # at once
    assert "at most 262,144" in _error_line(capfd)


@pytest.mark.parametrize("argv, needle", [
    (["--comm", "powersgd", "--matrix-approximation-rank", "0"],
     "matrix_approximation_rank must be an integer >= 1, got 0"),
    (["--comm", "powersgd", "--matrix-approximation-rank", "-3"],
     "matrix_approximation_rank must be an integer >= 1, got -3"),
    (["--comm", "gtopk", "--density", "0"], "density must be a number in (0, 1] (fraction of entries sent), got 0.0"),
])
def test_simulate_refuses_exchange_options_as_train_does(argv, needle, capfd):
    """The catalog's rule (flashsgd.sim.inputs.check_option), read by train's [comm] keys too."""
    from flashsgd.cli import main
    from flashsgd.train import config as C

    assert main(["simulate", "--gpus", "64", *argv]) == 2
    assert _error_line(capfd) == f"flashsgd simulate: error: {needle}"
    key, value = argv[-2].lstrip("-").replace("-", "_"), argv[-1]
    with pytest.raises(ValueError, match=re.escape(f"config key comm.{needle}")):
        C.resolve(cli={key: value})


def test_simulate_checks_the_groups_before_any_output(capfd):
    from flashsgd.cli import main

    assert main(["simulate", "--gpus", "64", "--groups", "1,2"]) == 2
    assert _error_line(capfd) == ("flashsgd simulate: error: groups (1, 2) sum to 3, need 161 (the "
                                  "workload's tensors)")
