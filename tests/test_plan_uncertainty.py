"""Assumed inputs and their ranges: presets, cluster files, the plan over the ranges, `plan`'s output."""

from __future__ import annotations

import dataclasses
import json
import subprocess
import sys

import pytest

from flashsgd.sim import planner
from flashsgd.sim.cluster_file import load_cluster_text, to_toml
from flashsgd.sim.network import (CLUSTERS, DEVICE_INPUTS, SPARSE_RANGES, STEP_RANGES, ClusterModel, Link,
                                   device_ranges, input_value, with_input)
from flashsgd.sim.uncertainty import COMPUTE, assumptions, corners, plan_over_ranges
from flashsgd.sim.workload import resnet50
from sim_helpers import LAB

MEASURED_COSTS = """[costs]
reduce_ns_per_byte = 0.004
call_overhead_us = 20.0
exchange_fixed_us = 800.0
round_fixed_us = 30.0
select_ns_per_elem = 1.5
tflops = 0.2
step_overhead_us = 100.0
jitter_percent = 0.5
bucket_overhead_us = 50.0
overlap_slowdown_percent = 10.0
"""


def flashsgd(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "flashsgd", *args], capture_output=True, text=True,
                          timeout=120)


def test_every_preset_marks_its_assumptions_and_only_them():
    for name in CLUSTERS.names():
        c = CLUSTERS.get(name)
        # the sparse and PowerSGD costs: the preset's device class (flashsgd.sim.device_costs)
        assert {k: c.assumed[k] for k in device_ranges(c.device)} == device_ranges(c.device, c.selection)
        assert c.assumed["round_fixed_s"] == SPARSE_RANGES["round_fixed_s"]
        for precision, rate in c.resnet50_images_per_s.items():
            lo, hi = c.assumed[f"resnet50_images_per_s.{precision}"]
            assert lo < rate < hi
        for key in ("inter.bandwidth_gbps", "inter.alpha_s"):  # what a run achieves of a link: assumed
            lo, hi = c.assumed[key]
            assert lo < input_value(c, key) <= hi, (name, key)
    assert CLUSTERS.get("abci").assumed["resnet50_images_per_s.fp16"] == pytest.approx((1000.0, 1400.0))
    assert CLUSTERS.get("abci").assumed["inter.bandwidth_gbps"] == (18.0, 25.0)  # 75-100% of 2x EDR
    one = CLUSTERS.get("1gbe")
    assert one.assumed["inter.bandwidth_gbps"] == (0.090, 0.1177)  # 111 MB/s in 90 MB/s .. TCP's 941 Mbit/s
    assert not any(k.startswith("intra.") or k.endswith("flow_gbps") for k in one.assumed)  # 1 GPU/node; 1 flow fills 1 GbE
    big = CLUSTERS.get("bigbasin-50gbe")  # TCP: no per-flow limit stated, a limit down to 20 Gbit/s plausible
    assert big.inter.flow_gbps is None and big.assumed["inter.flow_gbps"] == (2.5, 6.2)
    assert "inter.flow_gbps" not in CLUSTERS.get("abci").assumed  # RDMA: one queue pair fills the link


def test_a_per_flow_limit_of_none_ranges_down_to_its_low_end_and_is_none_at_its_fast_end():
    """None (one flow fills the link) vs a number through with_input and the cost functions: the fast
    end (the link's highest rate) predicts what None does; the low end slows the flat ring, which
    sends one flow per NIC, more than the torus, which sends one per local rank."""
    big = CLUSTERS.get("bigbasin-50gbe")
    inputs = assumptions(big, 220.0, None, "fp32")
    flow = next(a for a in inputs if a.key == "inter.flow_gbps")
    assert flow.value is None and flow.describe() == "inter-node per-flow bandwidth no limit (2.5-6.2 GB/s)"
    names = [k.name for k in corners(inputs)]
    assert "inter-node per-flow bandwidth low (2.5 GB/s)" in names
    assert not any(n.startswith("inter-node per-flow bandwidth high") for n in names)  # = the stated values
    kw = dict(gpus=64, batch_per_gpu=32, images_per_s=220.0, steps=1000, algorithms=("ring", "torus2d"),
              buckets_mb=(32,))
    comm = {v: {p.candidate.label(): p.result.comm_s for p in planner.make_plan(resnet50(), with_input(
        big, "inter.flow_gbps", v), **kw).ranked} for v in (None, 6.2, 2.5)}
    assert comm[6.2] == pytest.approx(comm[None], rel=1e-12)
    ring, torus = "ring, 32 MiB buckets", "torus2d 8x8, 32 MiB buckets"  # 8x8: a row is a node
    assert comm[2.5][ring] > 1.5 * comm[None][ring]  # one flow at 2.5 of 5.6 GB/s
    assert comm[2.5][torus] == pytest.approx(comm[None][torus], rel=1e-12)  # 8 flows share the NIC anyway


def test_a_cluster_model_refuses_bad_ranges():
    link = Link(1e-5, 1.0)
    with pytest.raises(ValueError, match="unknown input 'speed'; valid: inter.bandwidth_gbps"):
        ClusterModel("x", 1, link, link, assumed={"speed": (1.0, 2.0)})
    with pytest.raises(ValueError, match=r"low 2.0 > high 1.0"):
        ClusterModel("x", 1, link, link, assumed={"inter.alpha_s": (2.0, 1.0)})
    with pytest.raises(ValueError, match="has no value for resnet50_images_per_s.fp16"):
        ClusterModel("x", 1, link, link, assumed={"resnet50_images_per_s.fp16": (1.0, 2.0)})
    # no per-flow limit stated: a range is the limit a flow may meet; its fast end must be no limit
    assert ClusterModel("x", 1, link, link, assumed={"inter.flow_gbps": (0.5, 1.0)}).inter.flow_gbps is None
    with pytest.raises(ValueError, match=r"high end must be no limit either: >= the link's highest bandwidth "
                                         r"2 GB/s, got 1.5"):
        ClusterModel("x", 1, link, link, assumed={"inter.flow_gbps": (0.5, 1.5),
                                                  "inter.bandwidth_gbps": (0.5, 2.0)})


def test_a_cluster_file_marks_ranged_values_assumed_and_defaults_take_the_presets_ranges():
    measured = load_cluster_text(LAB + MEASURED_COSTS, "lab")
    assert measured.assumed == {}  # every cost given, no range: measured (what `train --comm auto` writes)
    c = load_cluster_text(LAB.replace("latency_us = 50.0", "latency_us = 50.0\nlatency_us_range = [20.0, 400.0]\n"
                                      "bandwidth_gbit_range = [0.5, 1.0]")
                          + "[costs]\nexchange_fixed_us = 2000.0\nexchange_fixed_us_range = [1000, 3000]\n"
                            "tflops_range = [10.0, 20.0]\n", "lab")
    assert c.assumed["inter.alpha_s"] == pytest.approx((20e-6, 400e-6))
    assert c.assumed["inter.bandwidth_gbps"] == pytest.approx((0.0625, 0.125))
    assert c.assumed["exchange_fixed_s"] == pytest.approx((1e-3, 3e-3))
    assert c.assumed["flop_s"] == pytest.approx((1 / 20e12, 1 / 10e12))
    # left out: the default and the presets' range; call_overhead_us etc. have none
    assert c.assumed["round_fixed_s"] == SPARSE_RANGES["round_fixed_s"]
    assert c.assumed["select_s_per_elem"] == SPARSE_RANGES["select_s_per_elem"]
    assert "call_overhead_s" not in c.assumed and "intra.alpha_s" not in c.assumed
    back = load_cluster_text(to_toml(c), "back")
    assert back.assumed.keys() == c.assumed.keys()
    for k, (lo, hi) in c.assumed.items():
        assert back.assumed[k] == pytest.approx((lo, hi), rel=1e-12), k
    assert "latency_us_range = [20.0, 400.0]" in to_toml(c)


@pytest.mark.parametrize("extra, message", [
    ("[costs]\nexchange_fixed_us = 500.0\nexchange_fixed_us_range = [600, 900]\n",
     "costs.exchange_fixed_us_range = [600, 900] must hold costs.exchange_fixed_us = 500"),
    ("[costs]\nselect_ns_per_elem_range = [1.0]\n", "costs.select_ns_per_elem_range must be [low, high]"),
    ("[costs]\nround_fixed_us_range = [-1, 5]\n", "costs.round_fixed_us_range must be a finite number >= 0"),
    ("[costs]\nexchange_fixed_range = [1, 5]\n", "unknown key(s) costs.exchange_fixed_range"),
])
def test_bad_ranges_in_a_cluster_file_are_named(extra, message):
    with pytest.raises(ValueError) as e:
        load_cluster_text(LAB + extra, "lab.toml")
    assert message in str(e.value) and "lab.toml" in str(e.value)


def test_a_per_flow_range_without_a_limit_must_reach_the_link_and_round_trips():
    text = LAB.replace("[inter]", "[inter]\nflow_bandwidth_gbit_range = [0.1, 0.5]")
    with pytest.raises(ValueError, match=r"lab: inter.flow_bandwidth_gbit_range = \[0.1, 0.5\] without "
                                         r"inter.flow_bandwidth_gbit \(no limit stated\) must reach no limit: "
                                         r"high >= inter.bandwidth_gbit's highest, 1"):
        load_cluster_text(text, "lab")
    c = load_cluster_text(LAB.replace("[inter]", "[inter]\nflow_bandwidth_gbit_range = [0.25, 1.0]"), "lab")
    assert c.inter.flow_gbps is None and c.assumed["inter.flow_gbps"] == pytest.approx((0.03125, 0.125))
    for name in CLUSTERS.names():  # the presets' ranges, links and the per-flow limit included, written back
        preset = CLUSTERS.get(name)
        back = load_cluster_text(to_toml(preset), name)
        assert back.inter.flow_gbps == preset.inter.flow_gbps
        for key, bounds in preset.assumed.items():
            if not key.startswith("resnet50_images_per_s."):  # compute rates are not in cluster files
                assert back.assumed[key] == pytest.approx(bounds, rel=1e-12), (name, key)


def test_corners_all_fast_all_slow_efficiency_corners_and_one_at_a_time():
    c = CLUSTERS.get("1gbe")
    inputs = assumptions(c, 200.0, (164.0, 236.0), "fp32")
    assert [a.key for a in inputs] == [*device_ranges(c.device), *STEP_RANGES, "inter.bandwidth_gbps",
                                       "inter.alpha_s", "inter.incast", COMPUTE]
    assert set(DEVICE_INPUTS) < set(device_ranges(c.device))
    names = [k.name for k in corners(inputs)]
    assert names[:4] == ["all fast", "all slow", "compute slow, all else fast", "compute fast, all else slow"]
    assert len(names) == 4 + 2 * len(inputs)
    assert "top-k selection high (6.03 ns/elem)" in names and "compute (fp32) low (164 images/s)" in names
    assert "inter-node latency high (1000 us)" in names  # 1 ms, not 1e+03
    fast = corners(inputs)[0].fast
    assert all(fast.values())
    sel = next(a for a in inputs if a.key == "select_s_per_elem")
    assert (sel.end(True), sel.end(False)) == device_ranges(c.device)["select_s_per_elem"]  # less time is faster
    assert sel.end(False) == pytest.approx(6.03e-9, rel=1e-3)  # the gTop-k paper's, on that GPU class


def test_a_step_range_is_the_step_at_each_end_of_every_assumption():
    """Independent check: the range's ends are the plans of clusters written with the ends' values."""
    step = ("step_overhead_us = 0.0\njitter_percent = 0.0\nbucket_overhead_us = 0.0\n"
            "overlap_slowdown_percent = 0.0\n")  # given: measured, no range
    ranged = LAB + "[costs]\nexchange_fixed_us = 500.0\nexchange_fixed_us_range = [100.0, 9100.0]\n" \
                   "round_fixed_us = 0.0\nround_fixed_us_range = [0.0, 130.0]\nselect_ns_per_elem = 0.5\n" + step
    kw = dict(gpus=8, batch_per_gpu=32, images_per_s=300.0, steps=100_000)
    r = plan_over_ranges(resnet50(), load_cluster_text(ranged, "lab"), **kw)
    fast = planner.make_plan(resnet50(), load_cluster_text(
        LAB + "[costs]\nexchange_fixed_us = 100.0\nround_fixed_us = 0.0\nselect_ns_per_elem = 0.5\n" + step, "f"), **kw)
    slow = planner.make_plan(resnet50(), load_cluster_text(
        LAB + "[costs]\nexchange_fixed_us = 9100.0\nround_fixed_us = 130.0\nselect_ns_per_elem = 0.5\n" + step, "s"),
        **kw)
    for p in r.plan.ranked:
        label = p.candidate.label()
        lo = next(q for q in fast.ranked if q.candidate.label() == label).step_s
        hi = next(q for q in slow.ranked if q.candidate.label() == label).step_s
        assert r.step_range(p) == pytest.approx((lo, hi), rel=1e-12), label
        if p.candidate.algorithm in planner.DENSE:
            assert lo == pytest.approx(hi, rel=1e-12)  # the sparse fixed costs do not touch a dense step
        if p.candidate.algorithm in planner.SPARSE:
            assert hi > lo


def test_the_choice_changes_within_the_1gbe_presets_assumptions_and_says_where():
    r = plan_over_ranges(resnet50(), CLUSTERS.get("1gbe"), gpus=32, batch_per_gpu=32, images_per_s=200.0,
                         compute_range=(164.0, 236.0), steps=50_000)
    choice = r.plan.choice.candidate
    assert choice.algorithm in planner.SPARSE and choice.density == 0.001  # a sparse exchange (the catalog's)
    changes = r.choice_changes()
    assert "top-k selection high (6.03 ns/elem)" in changes["powersgd rank 2"]
    # the same flip, from a cluster written with that selection cost
    slow_select = dataclasses.replace(CLUSTERS.get("1gbe"), select_s_per_elem=6.03e-9)
    alone = planner.make_plan(resnet50(), slow_select, gpus=32, batch_per_gpu=32, images_per_s=200.0, steps=50_000)
    assert alone.choice.candidate.setting() == "powersgd rank 2"
    text = "\n".join(r.summary())
    assert f"the choice changes within the assumptions: {choice.setting()} at the stated values, but\n" in text
    assert "  powersgd rank 2 at: " in text and "top-k selection high (6.03 ns/elem)" in text
    assert "flashsgd train --comm auto" in text and "flashsgd bench emulate" in text


def test_a_measured_cluster_has_no_range():
    c = load_cluster_text(LAB + MEASURED_COSTS, "lab")
    r = plan_over_ranges(resnet50(), c, gpus=8, batch_per_gpu=32, images_per_s=300.0, steps=100_000)
    assert r.inputs == [] and r.at == []
    assert all(r.step_range(p) == (p.step_s, p.step_s) for p in r.plan.ranked)
    assert r.summary() == ["assumed: nothing (every input measured or given): each number is a single value, "
                           "without a range"]


def test_plan_cli_prints_ranges_what_it_assumed_and_the_flip(tmp_path):
    out = tmp_path / "plan.json"
    r = flashsgd("plan", "--cluster", "1gbe", "--gpus", "32", "--model", "resnet50", "--steps", "50000",
                 "--json", str(out))
    assert r.returncode == 0, r.stderr
    row = next(line for line in r.stdout.splitlines() if line.startswith("* "))
    assert row.split()[1] in planner.SPARSE  # a sparse exchange is chosen
    assert row.split()[-1].endswith("%") and "-" in row.split()[-1]  # the efficiency range
    assert "assumed: sparse exchange fixed cost 0.25 ms (0.12-" in r.stdout  # the device class's
    assert "compute (fp32) 200 images/s (164-236)" in r.stdout
    assert "the choice changes within the assumptions" in r.stdout
    doc = json.loads(out.read_text())
    lo, hi = doc["choice"]["step_s_range"]
    choice = next(line for line in r.stdout.splitlines() if line.startswith("choice: "))
    assert f"(over the assumptions: step {lo * 1e3:.1f}-{hi * 1e3:.1f} ms, efficiency " in choice
    # the compressed choice's speed-up over the best dense, each setting with its own best dense
    slo, shi = ranged_plan_1gbe().speedup_range()
    nominal = float(choice.split("x faster than the best dense choice")[0].rsplit(" ", 1)[1])
    assert slo < nominal < shi and f"{slo:.2f}-{shi:.2f}x faster than the best dense)" in choice
    assert lo < doc["choice"]["step_s"] < hi and "powersgd rank 2" in doc["choice_changes"]
    assert all(len(p["efficiency_range"]) == 2 for p in doc["ranked"])
    # a given --images-per-s is not ranged unless --images-per-s-range says so
    given = flashsgd("plan", "--cluster", "abci", "--gpus", "64", "--images-per-s", "370", "--steps", "1000")
    # (the choice is still native at the stated values; at all slow, 5 ms per bucket and compute
    # 79% slower under overlap, fewer buckets win)
    assert "compute (" not in given.stdout and "choice: native, 25 MiB buckets" in given.stdout
    ranged = flashsgd("plan", "--cluster", "abci", "--gpus", "64", "--images-per-s", "370", "--steps", "1000",
                      "--images-per-s-range", "300", "400")
    assert "compute (fp32) 370 images/s (300-400)" in ranged.stdout
    # a range that misses the rate it ranges is refused, as a cluster file's KEY_range is (not widened)
    for cmd, rate in (("simulate", ["--comm", "gtopk", "--images-per-s", "900"]), ("plan", [])):
        bad = flashsgd(cmd, "--cluster", "1gbe", "--gpus", "32", *rate, "--images-per-s-range", "100", "150")
        assert bad.returncode == 2 and "--samples-per-s-range 100 150 must hold the compute rate used" in bad.stderr


def test_plan_cli_bad_compute_range_is_one_line_exit_2():
    r = flashsgd("plan", "--cluster", "abci", "--gpus", "8", "--images-per-s-range", "400", "300")
    assert r.returncode == 2 and "--samples-per-s-range must be 0 < LOW <= HIGH (images/s), got 400 300" in r.stderr
    assert r.stderr.count("\n") == 1, r.stderr


@pytest.mark.parametrize("name", CLUSTERS.names())
def test_every_assumed_input_of_a_preset_moves_each_step_one_way(name):
    """The corners rest on it: each assumed input, alone at its fast end, never lengthens any
    exchange's step, and at its slow end never shortens it (every algorithm, 2 and 8 nodes)."""
    from flashsgd.sim.engine import SimConfig, simulate

    c = CLUSTERS.get(name)
    inputs = assumptions(c, 200.0, None, "fp32")
    assert inputs and all(a.key in c.assumed for a in inputs)
    for gpus in (2 * c.ranks_per_node, 8 * c.ranks_per_node):
        for algo in ("ring", "hierarchical", "torus2d", "topk", "gtopk", "hgtopk", "powersgd"):
            cfg = SimConfig(algo, gpus, 200.0, schedule="after_backward")
            base = simulate(resnet50(), c, cfg).iteration_s
            for a in inputs:
                fast = simulate(resnet50(), with_input(c, a.key, a.end(True)), cfg).iteration_s
                slow = simulate(resnet50(), with_input(c, a.key, a.end(False)), cfg).iteration_s
                assert fast <= base * (1 + 1e-12) and slow >= base * (1 - 1e-12), (name, gpus, algo, a.key)


def ranged_plan_1gbe():
    """`plan --cluster 1gbe --gpus 32 --model resnet50 --steps 50000`, as a RangedPlan."""
    from flashsgd.sim.workload import resnet50

    c = CLUSTERS.get("1gbe")
    return plan_over_ranges(resnet50(), c, 32, 32, c.resnet50_images_per_s["fp32"],
                            c.assumed["resnet50_images_per_s.fp32"], steps=50_000)


def test_a_dense_choice_has_no_speedup_range():
    from flashsgd.sim.workload import resnet50

    c = CLUSTERS.get("abci")
    r = plan_over_ranges(resnet50(), c, 64, 32, 370.0, steps=1000)
    assert not r.plan.choice.candidate.compresses and r.speedup_range() is None
