"""`flashsgd train --comm auto`: measured at start-up, planned, recorded, reused on resume
(flashsgd.train.auto), and its bad input."""

from __future__ import annotations

import json
from dataclasses import replace

import pytest

from flashsgd.cli import main
from flashsgd.sim.cluster_file import load_cluster
from flashsgd.sim.network import INCAST_RANGE, STEP_RANGES, STEP_STATED, ClusterModel, Link
from flashsgd.train.auto import Compute, fit_ring, measured_cluster_assumptions, with_measured_compute

TINY = ["--num-samples", "2000", "--epochs", "2", "--global-batch", "256", "--no-progress",
        "--workers", "4", "--comm", "auto"]


def _train(out, *extra):
    return main(["train", *TINY, "--out", str(out), *extra])


def test_fit_ring_recovers_alpha_and_bandwidth():
    alpha, beta, gamma, p = 50e-6, 1 / 125e6, 0.2e-9, 4  # 1 Gbit/s
    sizes = (32 * 1024, 4 * 1024 * 1024)
    times = tuple(2 * (p - 1) * alpha + 2 * (p - 1) / p * n * (beta + gamma / 2) for n in sizes)
    link = fit_ring(times, sizes, p, gamma)
    assert link.alpha_s == pytest.approx(alpha) and link.bandwidth_gbps == pytest.approx(0.125)
    flat = fit_ring((1e-3, 0.9e-3), sizes, p, gamma)  # noise hides the bytes: bandwidth from the big one
    assert 0 < flat.bandwidth_gbps < float("inf") and flat.alpha_s >= 0


def test_a_measured_cluster_assumes_the_step_costs_and_incast():
    """The probe measures links, devices, the sparse fixed costs, the compute's jitter and DDP's
    step overhead; the per-bucket overhead, the slowdown under overlap and incast (it never runs a
    many-to-one round) keep the presets' ranges."""
    assumed = measured_cluster_assumptions()
    measured = ("jitter_cv", "step_overhead_s")
    assert assumed == {**{k: v for k, v in STEP_RANGES.items() if k not in measured}, "inter.incast": INCAST_RANGE}
    assert {"bucket_overhead_s", "overlap_slowdown"} <= set(assumed)
    assert not set(measured) & set(assumed)


def _sleep_by_rank():
    import time

    import torch.distributed as dist

    from flashsgd.timing import rank_times
    return rank_times(lambda: time.sleep(0.01 * (dist.get_rank() + 1)), iters=4, warmup=1).tolist()


def test_rank_times_keeps_every_ranks_own_time(run_ranks):
    """Not the slowest rank's (time_ops): rank 1 sleeps twice as long as rank 0, and both are seen,
    the same table on every rank."""
    tables = run_ranks(_sleep_by_rank, 2)
    assert tables[0] == tables[1] and len(tables[0]) == 2 and all(len(row) == 4 for row in tables[0])
    assert all(0.01 <= t < 0.51 for t in tables[0][0]) and all(0.02 <= t < 0.52 for t in tables[0][1])


def test_auto_measures_plans_records_and_a_resume_reuses_the_choice(tmp_path, capfd):
    out = tmp_path / "run"
    assert _train(out, "--max-steps", "3") == 0
    printed = capfd.readouterr().out
    record = json.loads((out / "auto.json").read_text())
    choice = record["choice"]
    assert f"auto        chose {record['explain']}" in printed and "measured in" in printed
    summary = json.loads((out / "summary.json").read_text())
    assert summary["steps"] == 3
    # the plan the workers ran is the choice (its algorithm in the banner, not "auto")
    assert f"algorithm   {choice['algorithm']} " in printed
    cluster = load_cluster(str(out / "cluster.toml"))  # the measured cluster, reusable
    assert cluster.ranks_per_node == 2 and cluster.nodes == 2
    # what the probe cannot measure stays assumed, with the presets' ranges: the slowdown under
    # overlap and TCP incast (no round of many senders into one node); the per-bucket overhead is
    # measured (the model has several tensors), without a range
    expected = {k: v for k, v in measured_cluster_assumptions().items() if k != "bucket_overhead_s"}
    assert set(cluster.assumed) == set(expected) == {"overlap_slowdown", "inter.incast"}
    assert "bucket_overhead_us = " in (out / "cluster.toml").read_text()
    assert "bucket_overhead_us_range" not in (out / "cluster.toml").read_text()  # measured: no range
    assert " ms/bucket (1 vs " in record["measured"] and " buckets); inter " in record["measured"]
    # the compute's jitter (12 steps x 4 ranks) and DDP's step overhead are measured, without a range
    assert 0 <= cluster.jitter_cv < 1 and "jitter_percent = " in (out / "cluster.toml").read_text()
    assert cluster.step_overhead_s >= 0 and "step_overhead_us = " in (out / "cluster.toml").read_text()
    assert "(48 rank-steps), DDP " in record["measured"] and " ms/step + " in record["measured"]
    assert all(cluster.assumed[k] == pytest.approx(v) for k, v in expected.items())
    assert cluster.assumed["inter.incast"] == pytest.approx(INCAST_RANGE) and cluster.inter.incast == 0.0
    assert cluster.overlap_slowdown == STEP_STATED["overlap_slowdown"]  # not measured: the presets' stated value
    toml = (out / "cluster.toml").read_text()  # the sparse exchange's measured fixed costs
    assert "exchange_fixed_us = " in toml and "round_fixed_us = " in toml
    assert cluster.exchange_fixed_s >= 0 and cluster.round_fixed_s >= 0
    assert "ms fixed + " in record["measured"] and " ms per round" in record["measured"]
    ranked = [r["step_s"] for r in record["ranked"]]
    assert ranked == sorted(ranked) and record["compute_s"] > 0
    # resume: the checkpoints hold the chosen hook's state, so the recorded choice is reused
    assert _train(out, "--max-steps", "5") == 0
    printed = capfd.readouterr().out
    assert "reusing the choice recorded in" in printed and f"algorithm   {choice['algorithm']} " in printed
    assert json.loads((out / "auto.json").read_text())["choice"] == choice
    # a cluster file instead of the network measurement
    other = tmp_path / "other"
    assert _train(other, "--max-steps", "2", "--cluster", str(out / "cluster.toml")) == 0
    given = json.loads((other / "auto.json").read_text())
    assert given["measured"].startswith(f"network and devices from {out / 'cluster.toml'}")
    assert "cluster_toml" not in given and not (other / "cluster.toml").exists()  # nothing measured
    # plan.json holds what ran, not "auto"
    assert json.loads((out / "plan.json").read_text())["algorithm"] == choice["algorithm"]


def test_an_auto_resume_without_its_record_stops_naming_it(tmp_path, capfd):
    out = tmp_path / "run"
    assert _train(out, "--max-steps", "2") == 0
    (out / "auto.json").unlink()
    capfd.readouterr()
    assert _train(out, "--max-steps", "3") == 1
    err = capfd.readouterr().err
    assert "--comm auto cannot resume: found no auto.json at" in err


@pytest.mark.parametrize("extra, message", [
    (["--comm", "ring", "--cluster", "1gbe"], "config key comm.cluster is read only with comm.algorithm = auto"),
    (["--cluster", "nope"], "config key comm.cluster: unknown cluster preset 'nope'"),
    (["--cluster", "missing.toml"], "config key comm.cluster: cluster file 'missing.toml' does not exist"),
    (["--momentum-correction"], "--comm auto chooses the algorithm itself"),
    (["--accuracy-risk", "high"], "accuracy_risk"),
    (["--cluster", "1gbe"], "config key comm.cluster='1gbe': '1gbe' has 1 rank per node, this run 2"),
])
def test_auto_bad_input_is_one_line_before_any_process(tmp_path, capfd, extra, message):
    assert _train(tmp_path / "run", *extra) == 2
    err = capfd.readouterr().err.strip().splitlines()
    assert len(err) == 1 and message in err[0], err
    assert not (tmp_path / "run").exists()  # refused before the run directory is claimed


def test_comm_changes_pass_the_node_split_and_the_rank():
    from flashsgd.train.auto import comm_changes

    hier = comm_changes({"algorithm": "hgtopk", "bucket_mb": 4.0, "density": 0.01, "node_split": "slices",
                         "density_warmup": 0.25, "density_warmup_fraction": 0.4}, 2, 10)
    assert (hier["node_split"], hier["density"], hier["density_warmup_epochs"]) == ("slices", 0.01, 4.0)  # older record
    new = comm_changes({"algorithm": "gtopk", "bucket_mb": 4.0, "density": 0.01, "density_warmup": 0.25}, 2, 10)
    assert new["density_warmup"] == 0.25 and "density_warmup_epochs" not in new  # the default rule
    low = {"algorithm": "powersgd", "bucket_mb": 4.0}
    assert comm_changes({**low, "matrix_approximation_rank": 2}, 1, 10)["matrix_approximation_rank"] == 2
    assert comm_changes({**low, "rank": 4}, 1, 10)["matrix_approximation_rank"] == 4  # an older record
    assert "node_split" not in comm_changes({"algorithm": "ring", "bucket_mb": 4.0}, 1, 10)


def _probe_fixed_costs(alpha_s: float) -> tuple[float, dict]:
    import torch

    from flashsgd.sim.network import ClusterModel, Link
    from flashsgd.train.auto import round_seconds, sparse_fixed_costs

    link = Link(alpha_s=alpha_s, bandwidth_gbps=1e6)  # the bytes cost next to nothing
    cluster = ClusterModel("probe", 1, link, link)
    cpu = torch.device("cpu")
    return round_seconds(cpu, 30.0), sparse_fixed_costs(cluster, 4096, "exact", 30.0, cpu)


def test_the_probe_measures_a_round_and_splits_the_fixed_costs(run_ranks):
    """3 ranks: rank 2 has no partner (2 XOR 1 = 3) and only takes part in the barriers. With a free
    link the whole round is its fixed cost; with an alpha of 10 s (the model longer than anything
    measured here) both are 0: a fixed cost is never negative."""
    rounds = run_ranks(_probe_fixed_costs, 3, 0.0)
    for t, costs in rounds:
        assert 0 < t < 1 and costs["exchange_fixed_s"] >= 0
        assert 0 < costs["round_fixed_s"] < 1
    slow = run_ranks(_probe_fixed_costs, 2, 10.0)
    assert all(c["round_fixed_s"] == 0.0 and c["exchange_fixed_s"] == 0.0 for _, c in slow)


def test_a_given_cluster_with_assumptions_is_planned_over_their_ranges():
    """plan_choice on a preset (its links and sparse costs assumed, the compute measured): auto.json
    records every candidate's step range, what was assumed and where the choice changes, and the
    printed choice says so and what to measure; a measured cluster file behaves as before."""
    from flashsgd.sim.cluster_file import load_cluster_text
    from flashsgd.sim.network import CLUSTERS
    from flashsgd.sim.uncertainty import plan_over_ranges
    from flashsgd.sim.workload import from_module
    from flashsgd.train.auto import Measured, plan_choice
    from flashsgd.train.models import resnet20
    from sim_helpers import LAB

    model = resnet20(10)
    one = CLUSTERS.get("1gbe")
    record = plan_choice(Measured(one, Compute(0.1, 0.0, 0, 0.0), 1.0, given="1gbe"), model, 8, 32, 20_000, "low")
    ranged = plan_over_ranges(from_module(model), one, 8, 32, 320.0, steps=20_000)  # 32 samples / 0.1 s
    assert ranged.choice_changes() and record["choice_changes"] == ranged.choice_changes()
    costs = [k for k in one.assumed if not k.startswith(("inter.", "resnet50_images_per_s."))]  # device, step
    assert [a["input"] for a in record["assumed"]] == costs + ["inter.bandwidth_gbps", "inter.alpha_s", "inter.incast"]
    assert "compute" not in {a["input"] for a in record["assumed"]}  # measured by the probe
    lo, hi = record["choice"]["step_s_range"]
    assert lo < record["choice"]["step_s"] < hi and all("step_s_range" in p for p in record["ranked"])
    assert (f"; step {lo * 1e3:.1f}-{hi * 1e3:.1f} ms over the ranges of {len(record['assumed'])} assumed inputs "
            "(auto.json: assumed); "
            "the choice could change within them: ") in record["explain"]
    setting, where = next(iter(ranged.choice_changes().items()))
    assert f"{setting} at {' | '.join(where)}" in record["explain"]
    assert record["explain"].endswith("to decide, run --comm auto without --cluster: it measures the links, "
                                      "the devices and the sparse fixed costs here")
    # a measured cluster (a file without ranges, as auto writes it): no range, the choice as before
    measured = load_cluster_text(LAB + "[costs]\nexchange_fixed_us = 800.0\nround_fixed_us = 30.0\n"
                                       "select_ns_per_elem = 1.5\nstep_overhead_us = 0.0\njitter_percent = 0.0\n"
                                       "bucket_overhead_us = 0.0\noverlap_slowdown_percent = 0.0\n",
                                 "lab.toml")
    plain = plan_choice(Measured(measured, Compute(0.1, 0.0, 0, 0.0), 1.0, given="lab.toml"), model, 8, 32, 20_000, "low")
    assert plain["assumed"] == [] and plain["choice_changes"] == {}
    assert plain["choice"]["step_s_range"] == [plain["choice"]["step_s"]] * 2
    assert "assumed" not in plain["explain"]


def _probe_then_train(bucket_mb):
    """Two identical models; one goes through the auto probe (plain and DDP-noop steps) first;
    then both train 3 steps in DDP with gradient all-reduce: the probe must leave no trace (the
    model, the optimizer, the RNG, and no autograd hook of its DDP left to fire)."""
    import torch
    import torch.distributed as dist
    from torch.nn.parallel import DistributedDataParallel

    from flashsgd.train.auto import compute_seconds

    def make():
        torch.manual_seed(0)
        model = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.ReLU(), torch.nn.Linear(16, 3))
        return model, torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)

    g = torch.Generator().manual_seed(dist.get_rank())
    x, y = torch.randn(32, 8, generator=g), torch.randint(0, 3, (32,), generator=g)
    loss_fn = torch.nn.CrossEntropyLoss()
    runs = []
    for probe in (False, True):
        model, opt = make()
        compute = compute_seconds(model, opt, (x, y), loss_fn, bucket_mb) if probe else None
        ddp = DistributedDataParallel(model)
        losses = []
        for _ in range(3):
            opt.zero_grad(set_to_none=True)
            loss = loss_fn(ddp(x), y)
            loss.backward()
            opt.step()
            losses.append(loss.item())
        runs.append((losses, [p.detach().clone() for p in model.parameters()]))
        ddp._remove_autograd_hooks()
    (plain_losses, plain_params), (probed_losses, probed_params) = runs
    assert plain_losses == probed_losses
    assert all(torch.equal(a, b) for a, b in zip(plain_params, probed_params))
    return compute


def test_the_compute_probe_leaves_no_trace_and_measures_ddp(run_ranks):
    for compute in run_ranks(_probe_then_train, 2, 25.0):
        assert compute.samples == 24 and 0 <= compute.jitter_cv < 1 and compute.ddp_overhead_s >= 0
        # 4 tensors: one bucket at the run's cap, one each at the fine cap (counted in the hook)
        assert compute.buckets == (1, 4) and compute.bucket_overhead_s is not None
        assert compute.bucket_overhead_s >= 0


def test_a_per_bucket_overhead_measured_leaves_the_assumptions_else_it_stays_assumed():
    """Step 1's per-bucket overhead replaces the assumed one; a one-tensor model (None) leaves the
    cluster's as it was: assumed over the presets' range on a measured cluster, a file's stated
    value on a given one."""
    base = ClusterModel(name="m", ranks_per_node=2, nodes=2, intra=Link(1e-5, 1.0), inter=Link(1e-5, 0.1),
                        assumed=measured_cluster_assumptions())
    measured = with_measured_compute(base, Compute(0.01, 0.05, 24, 2e-4, 3e-5, (1, 4)))
    assert measured.bucket_overhead_s == 3e-5 and "bucket_overhead_s" not in measured.assumed
    assert (measured.step_overhead_s, measured.jitter_cv) == (2e-4, 0.05)
    unmeasured = with_measured_compute(base, Compute(0.01, 0.05, 24, 2e-4, None, (1, 1)))
    assert unmeasured.assumed["bucket_overhead_s"] == STEP_RANGES["bucket_overhead_s"]
    stated = with_measured_compute(replace(base, bucket_overhead_s=1e-4, assumed={}),
                                   Compute(0.01, 0.05, 24, 2e-4, None, (1, 1)))
    assert stated.bucket_overhead_s == 1e-4 and stated.assumed == {}
