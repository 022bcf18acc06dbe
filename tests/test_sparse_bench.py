"""`flashsgd bench sparse` (flashsgd.bench.sparse, flashsgd.bench.sparse_steps): rows, phases,
wire bytes, option errors, and that its steps are the hook's own."""

from __future__ import annotations

import argparse
import ast
from pathlib import Path

import pytest
import torch

from flashsgd.bench.sparse import SparseBenchConfig, add_arguments, config_from_args, measure
from flashsgd.bench.sparse_hook import measure_hook
from flashsgd.bench.sparse_steps import PHASES, SparseStep, wire_bytes_per_node
from flashsgd.comm.sparse import message_bytes


def _args(*argv):
    parser = argparse.ArgumentParser()
    add_arguments(parser)
    return parser.parse_args(list(argv))


def test_wire_bytes_per_node():
    k, m = 1000, 10**6
    msg = message_bytes(k)
    assert wire_bytes_per_node("gtopk", k, m, 8, 1) == 3 * msg        # 3 butterfly rounds
    assert wire_bytes_per_node("topk", k, m, 8, 1) == 7 * msg         # P - 1 messages
    assert wire_bytes_per_node("gtopk", k, m, 8, 2) == 2 * 2 * msg    # rounds 1, 2 leave the node, x2 ranks
    assert wire_bytes_per_node("hgtopk", k, m, 8, 2) == 2 * msg       # leaders only, 2 rounds
    assert wire_bytes_per_node("hgtopk", k, m, 8, 2, "sparse") == 2 * msg
    assert wire_bytes_per_node("hgtopk", k, m, 8, 2, "slices") == 2 * 2 * message_bytes(k // 2)  # 2 slices
    assert wire_bytes_per_node("dense", k, m, 8, 2) == 2 * 3 / 4 * 4 * m
    assert wire_bytes_per_node("gtopk", k, m, 4, 4) == 0.0            # one node: no link


def test_options_errors():
    for argv, word in ((["--densities", "0"], "--densities"), (["--comm", "gtopk,x"], "--comm 'gtopk,x': unknown x"),
                       (["--comm", "hgtopk_slices"], "unknown"), (["--node-splits", "ring"], "--node-splits"),
                       (["--workers", "6", "--ranks-per-node", "4"], "ranks_per_node must divide"),
                       (["--link", "fast"], "link rate"),
                       (["--fuse", "compiled", "--selection", "exact"], "--selection threshold"),
                       (["--hook", "--selection-speed"], "two different modes")):
        with pytest.raises(ValueError, match=word):
            config_from_args(_args(*argv))
    cfg, world = config_from_args(_args("--workers", "4", "--comm", "hgtopk", "--fuse", "both",
                                        "--link", "1gbit", "--ranks-per-node", "2"))
    assert (cfg.fuse, cfg.link_bps, cfg.ranks_per_node, world) == ([False, True], 10**9, 2, 4)
    assert cfg.node_splits == ["leader"] and cfg.selection == "threshold"  # the bench's own default
    cfg, _ = config_from_args(_args("--comm", "hgtopk", "--node-splits", "slices,sparse", "--selection", "exact"))
    assert cfg.node_splits == ["slices", "sparse"] and cfg.selection == "exact"
    assert config_from_args(_args())[0].algorithms == ["topk", "gtopk"]
    with pytest.raises(SystemExit):  # the mode switch is --selection-speed; --selection takes a choice
        _args("--selection")
    assert _args("--selection-speed").selection_speed


def _bench_body():
    torch.manual_seed(0)
    cfg = SparseBenchConfig(numel=20_000, densities=[0.01], algorithms=["topk", "gtopk", "hgtopk"],
                            node_splits=["leader", "slices", "sparse"], link_bps=10**9, ranks_per_node=2,
                            iters=2, warmup=1, verbose=False)
    return measure(cfg)


def test_measure_rows(run_ranks):
    rows = run_ranks(_bench_body, 4)[0]
    names = [r["algorithm"] for r in rows]
    assert names == ["add (1 pass)", "dense", "topk", "gtopk", "hgtopk node_split=leader",
                     "hgtopk node_split=slices", "hgtopk node_split=sparse"]
    assert [r.get("node_split") for r in rows[4:]] == ["leader", "slices", "sparse"]
    for row in rows[2:]:
        for key in ("accum_ms", "select_ms", "exchange_ms", "merge_ms", "scatter_ms", "passes",
                    "wire_ms", "floor_ms", "ratio_to_dense", "e2e_ms"):
            assert row[key] is not None and row[key] >= 0, (row["algorithm"], key)
        assert row["k"] == 200
    # gtopk on 2 nodes x 2: round 0 stays in the node, round 1 crosses it from both ranks
    assert rows[3]["wire_ms"] == pytest.approx(2 * message_bytes(200) * 8 / 1e9 * 1e3)


def _hook_bench_body():
    torch.set_num_threads(1)
    return measure_hook([0.05], ["gtopk"], "threshold", layers=2, width=64, bucket_mb=0.01, batch=4,
                        iters=2, warmup=1, verbose=False)


def test_hook_rows(run_ranks):
    rows = run_ranks(_hook_bench_body, 2)[0]
    assert [r["hook"] for r in rows] == ["noop", "native", "gtopk threaded=False", "gtopk threaded=True"]
    assert rows[2]["buckets"] == rows[3]["buckets"] >= 2 and rows[2]["ratio_to_sync"] == 1.0
    assert all(r["step_ms"] > 0 and r["ratio_to_native"] > 0 for r in rows)
    with pytest.raises(ValueError, match="--bucket-mb must be > 0"):
        config_from_args(_args("--hook", "--bucket-mb", "0"))


def _hook_step_body():
    rank = torch.distributed.get_rank()
    bucket = torch.empty(1000)
    step = SparseStep("gtopk", bucket, 1.0, selection="threshold")
    for _ in range(2):
        bucket.fill_(rank + 1.0)
        step()
    return bucket.clone(), step.state.sparse_buckets, step.phases(skip=1)


def test_the_step_is_the_hooks_own(run_ranks):
    # density 1.0: gTop-k == all-reduce, the bucket becomes the average of the ranks' gradients
    for bucket, sparse_buckets, phases in run_ranks(_hook_step_body, 2):
        assert torch.equal(bucket, torch.full((1000,), 1.5)) and sparse_buckets == 2
        assert set(phases) == set(PHASES) and all(t >= 0 for t in phases.values())
    # no exchange, selection or accumulation of its own: a change to the hook reaches the bench
    tree = ast.parse((Path(__file__).parents[1] / "src/flashsgd/bench/sparse_steps.py").read_text())
    called = {getattr(n.func, "id", getattr(n.func, "attr", ""))
              for n in ast.walk(tree) if isinstance(n, ast.Call)}
    assert not called & {"gtopk_allreduce", "topk_allgather", "hgtopk_allreduce", "add_block_maxima",
                         "topk_threshold", "prepare_sparse", "select"}
