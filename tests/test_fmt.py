"""Numbers in messages (flashsgd.fmt) and the messages that use them."""

from __future__ import annotations

import doctest
import math

import pytest

from flashsgd import fmt
from flashsgd.fmt import number, percent, plural, share, size


def test_doctest():
    assert doctest.testmod(fmt).failed == 0


def test_value_next_to_its_threshold_never_rounds_onto_it():
    assert number(19.998, than=20) == "19.998"          # was "20.00 (< 20)"
    assert float(number(19.99999999, than=20)) < 20
    assert number(20.0004, than=20) == "20.0004"        # just above stays above
    assert number(20.0, than=20) == "20"
    assert number(0.024) == "0.024"                      # was "0.0"
    assert number(1.0) == "1" and number(1.25) == "1.25" and number(2001.4) == "2001"
    assert number(0.99999, than=1) == "0.99999"
    assert number(float("nan")) == "nan" and number(0) == "0"


def test_plural():
    assert plural(1, "step") == "1 step"                 # was "1 steps"
    assert plural(0, "step") == "0 steps" and plural(2, "step") == "2 steps"
    assert plural(1.0, "time") == "1 time" and plural(0.024, "time") == "0.024 times"
    assert plural(19.998, "time", than=20) == "19.998 times"
    assert plural(3, "matrix", "matrices") == "3 matrices"


def test_sizes_are_binary():
    assert size(2 ** 20) == "1 MiB"                       # was "1.05 MB"
    assert size(25 * 2 ** 20) == "25 MiB"
    assert size(1.5 * 2 ** 30) == "1.5 GiB" and size(4096) == "4 KiB" and size(512) == "512 B"
    assert size(33.6e6) == "32 MiB"                       # 8.4M fp32 parameters
    assert fmt.mib(2 ** 20) == 1.0


def test_percent_of_nothing():
    assert percent(float("nan")) == "-"                   # was "nan%"
    assert percent(None, missing="none") == "none"
    assert percent(0.25) == "25.0%" and percent(0.0) == "0.0%"
    assert percent(0.2504, than=0.25) == "25.04%"        # not "25.0% (target 25%)" for a miss
    assert share(0, 0) == "n/a (0 of 0)" and share(1, 4) == "25.0%"
    assert share(0, 0, missing="-") == "-"


# --------------------------------------------------------------- the call sites -----------------

def test_planner_rule_never_contradicts_itself():
    from flashsgd.exchanges import MIN_COVERAGE, SparseOptions, coverage
    from flashsgd.sim.planner import Candidate, accuracy_rule, coverage_note

    # 19.998 = (steps - 2 dense) x density: 9,999 sparse steps at 0.002
    steps = 10_001
    assert coverage(steps, SparseOptions(density=0.002)) == pytest.approx(19.998)
    why = accuracy_rule(Candidate("gtopk", 4.0, density=0.002), steps, "low")
    assert f"sent only 19.998 times over 10001 steps (< {MIN_COVERAGE:g}" in why
    why = accuracy_rule(Candidate("gtopk", 4.0, density=0.001), 26, "low")  # 24 sparse steps
    assert "sent only 0.024 times over 26 steps" in why
    note = coverage_note(Candidate("gtopk", 4.0, density=0.002), 10_003)  # 20.002
    assert "can be sent 20.002 times over 10003 steps" in note


def test_sparse_run_warning_and_error():
    from flashsgd.comm.sparse.checks import check_sparse_run
    from flashsgd.exchanges import SparseOptions

    (warning,) = check_sparse_run("gtopk", SparseOptions(density=0.001), 26)
    assert "at most 0.024 times" in warning                 # was "at most 0.0 times"
    (warning,) = check_sparse_run("gtopk", SparseOptions(density=0.002), 10_001)
    assert "at most 19.998 times" in warning
    (warning,) = check_sparse_run("gtopk", SparseOptions(density=0.5), 3)
    assert "over 3 steps" in warning and "at most 0.5 times" in warning
    with pytest.raises(ValueError, match=r"lasts 2 steps, longer than the run \(1 step\)"):
        check_sparse_run("gtopk", SparseOptions(density=0.01, density_warmup=0.25,
                                                density_warmup_steps=2), total_steps=1)


def test_simulate_prediction_of_small_messages_only_says_none(tmp_path, capsys):
    """``simulate --predict`` of a file with no message >= 1 MiB: the worst error of no rows."""
    import json

    from flashsgd.sim import cli
    from flashsgd.sim.calibrate import calibrate, load_bench

    rows = [{"algorithm": "ring", "size_bytes": s, "dtype": "float32", "time_us": 10.0 + s / 1e3}
            for s in (1024, 4096, 16384, 65536)]
    path = tmp_path / "small.json"
    path.write_text(json.dumps({"meta": {"world": 4, "ranks_per_node": 2}, "results": rows}))
    out = cli._predict_file(str(path), calibrate(path).params, "time_us", load_bench(path))
    assert math.isnan(out["max_error_ge_1MB"])
    text = capsys.readouterr().out
    assert "max |error| for messages >= 1 MiB: none (no message that large) (target 25%)" in text
    assert "nan" not in text


def test_simulate_help_reads_the_wire_format_from_the_catalog():
    import argparse

    from flashsgd.exchanges import INT32_NUMEL, WIRE_INDEX_BYTES
    from flashsgd.sim import cli

    parser = argparse.ArgumentParser()
    cli.add_arguments(parser)
    text = " ".join(parser.format_help().split())
    assert f"(default {WIRE_INDEX_BYTES}:" in text and f"{INT32_NUMEL:,} elements" in text
    assert "4: int32" in text and "8: int64" in text and "int64, the default" not in text


def test_simulate_and_plan_say_one_bucket_one_gpu(capsys):
    from flashsgd.cli import main

    assert main(["simulate", "--cluster", "abci", "--gpus", "8", "--model", "resnet50", "--batch-per-gpu", "32",
                 "--bucket-mb", "1000", "--comm", "ring"]) == 0
    out = capsys.readouterr().out
    assert "algorithm ring, 8 GPUs, 1 bucket (largest 97.5 MiB)" in out  # 25,557,032 fp32 = 97.49 MiB
    assert "97.5 MiB of fp32 gradients" in out and "4 GPUs/node" in out
    assert main(["plan", "--cluster", "1gbe", "--gpus", "1", "--model", "resnet50", "--steps", "1000"]) == 0
    out = capsys.readouterr().out
    assert "cluster 1gbe: 1 GPU/node" in out and "; 1 GPU x 32 samples;" in out


def _skip_once(max_skipped: int, grad_accum: int):
    """One poisoned step on rank 1 with run.max_skipped = 1, or a shard of 1 sample split in two."""
    import torch
    import torch.distributed as dist
    from torch.nn.parallel import DistributedDataParallel as DDP

    from ddp_helpers import tiny_net
    from flashsgd.train.step import TrainStep

    ddp = DDP(tiny_net())
    opt = torch.optim.SGD(ddp.parameters(), lr=0.1)
    step = TrainStep(ddp, opt, torch.nn.CrossEntropyLoss(reduction="sum"), max_skipped=max_skipped,
                     grad_accum=grad_accum)
    x, y = torch.randn(1, 20), torch.randint(0, 5, (1,))
    try:
        step(lambda: (x, y), 2, step=0, epoch=0, poison=dist.get_rank() == 1)
    except (FloatingPointError, ValueError) as exc:
        return str(exc)
    return None


def test_train_step_messages_count_one_step_and_one_sample(run_ranks):
    for error in run_ranks(_skip_once, 2, 1, 1):
        assert "training diverged: 1 step in a row was skipped" in error, error
    for error in run_ranks(_skip_once, 2, 0, 2):
        assert "a shard of 1 sample cannot be split into grad_accum = 2" in error, error


def test_run_banner_and_run_errors_count_one_of_each():
    """RunPlan.describe, the topology line and the plan's errors say "1 step", "1 epoch", "1 rank"."""
    from types import SimpleNamespace

    from flashsgd.comm.topology import Topology
    from flashsgd.train.config import resolve
    from flashsgd.train.plan import build_plan

    one = {"workers": 2, "global_batch": 256, "epochs": 1, "algorithm": "ring", "ranks_per_node": 1}
    banner = build_plan(resolve(cli=one), world=2, num_train=256, local_spawn=True, backend="gloo").describe()
    assert "1 step in 1 epoch" in banner and "1 rank/node" in banner, banner
    assert "(s)" not in banner and "1 steps" not in banner and "1 epochs" not in banner, banner
    layout = SimpleNamespace(grid=(2, 1), world_size=2, num_nodes=2, ranks_per_node=1, timeout_s=300.0)
    assert Topology.describe(layout) == "world 2 = 2 nodes x 1 rank/node, grid 2x1, timeout 300 s"
    with pytest.raises(ValueError, match=r"but the run has 1 step; valid steps: 0-0"):
        build_plan(resolve(cli={**one, "fail_at": "0:3:exit"}), world=2, num_train=256, local_spawn=True, backend="gloo")
