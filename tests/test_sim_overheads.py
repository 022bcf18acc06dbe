"""The costs beside the exchange (flashsgd.sim.engine, Steps 3-4): the non-overlappable tail, a
per-bucket overhead on the communication stream and the slowdown of compute under overlapped
exchanges; their inputs, ranges, cluster-file keys and corners."""

from __future__ import annotations

import random
from dataclasses import replace

import numpy as np
import pytest

from flashsgd.sim.algorithms import exchange_cost
from flashsgd.sim.cluster_file import load_cluster_text, to_toml
from flashsgd.sim.costs import CommSetup
from flashsgd.sim.engine import SimConfig, comm_timeline, expected_max_normal, simulate
from flashsgd.sim.network import CLUSTERS, STEP_RANGES, STEP_STATED, ClusterModel, Link, with_input
from flashsgd.sim.uncertainty import COMPUTE, assumed_lines, assumptions, at_corner, range_corners
from flashsgd.sim.workload import Workload, resnet50
from sim_helpers import LAB, exchange_only

TWO = Workload("two", np.array([1000, 1000]), np.array([1.0, 1.0]))
"""Two tensors of 1000 fp32, one bucket each, backward shares 1:1."""
SLOW = ClusterModel("slow", 1, Link(0.1, 1.0), Link(0.1, 1.0))
"""A 0.1 s-alpha ring: a 2-rank exchange of one bucket takes d ~ 0.2 s."""
CFG = SimConfig("ring", 2, 4.0, batch_per_gpu=4, bucket_mb=1e-6)
"""T1 = 1 s, forward 1/3: the buckets are ready after 2/3 and 1 s of compute."""
D = float(exchange_cost("ring", 4000.0, CommSetup(2, SLOW)).total)


def test_the_timeline_by_hand():
    """Two 1 s exchanges ready after 1 and 2 s of a 3 s compute. s = 0.5: the first runs 1-2 (compute
    reaches 1.5 by 2), compute reaches 2 at 2.5, the second runs 2.5-3.5 (compute 2.5), compute ends
    at 4. s = 0: the plain max(ready, end) + d."""
    assert comm_timeline([1.0, 2.0], [1.0, 1.0], 3.0, 0.5) == pytest.approx((3.5, 4.0))
    assert comm_timeline([1.0, 2.0], [1.0, 1.0], 3.0, 0.0) == (3.0, 3.0)
    # after backward: nothing overlaps, nothing slows
    assert comm_timeline([3.0, 3.0], [1.0, 1.0], 3.0, 0.5) == pytest.approx((5.0, 3.0))
    # an exchange longer than what is left of compute: compute runs at half speed to its end
    assert comm_timeline([1.0], [10.0], 2.0, 0.5) == pytest.approx((11.0, 3.0))


def test_the_tail_is_what_runs_after_backward():
    """Without the new terms the last bucket (ready when backward ends) is the exposed tail: the
    step is max(1, 2/3 + d) + d, the exposed part its last d (d < 1/3)."""
    r = simulate(TWO, SLOW, CFG)
    assert 0.2 < D < 0.21
    assert r.iteration_s == pytest.approx(1.0 + D, rel=1e-12) and r.exposed_comm_s == pytest.approx(D, rel=1e-12)
    assert r.slowdown_s == 0.0 and r.overhead_s == 0.0


def test_a_bucket_overhead_lengthens_every_bucket_on_the_stream():
    """b = 0.05 s per bucket: each takes D = d + b; the step max(1, 2/3 + D) + D = 1 + D."""
    b = 0.05
    r = simulate(TWO, replace(SLOW, bucket_overhead_s=b), CFG)
    assert r.iteration_s == pytest.approx(1.0 + D + b, rel=1e-12)
    assert r.comm_s == pytest.approx(2 * (D + b), rel=1e-12) and r.overhead_s == pytest.approx(2 * b, rel=1e-12)
    assert r.exposed_comm_s == pytest.approx(D + b, rel=1e-12)
    # after backward: both buckets after the end of backward, 1 + 2 (d + b)
    after = simulate(TWO, replace(SLOW, bucket_overhead_s=b), replace(CFG, schedule="after_backward"))
    assert after.iteration_s == pytest.approx(1.0 + 2 * (D + b), rel=1e-12)


def test_overlap_slows_backward_while_an_exchange_runs():
    """s = 0.5: the first exchange runs 2/3 -> 2/3 + d; compute gains d/2 meanwhile and reaches 1 at
    1 + d/2, where the second starts: slowdown d/2, exposed d, step 1 + 3d/2."""
    r = simulate(TWO, replace(SLOW, overlap_slowdown=0.5), CFG)
    assert r.slowdown_s == pytest.approx(D / 2, rel=1e-12) and r.exposed_comm_s == pytest.approx(D, rel=1e-12)
    assert r.iteration_s == pytest.approx(1.0 + 1.5 * D, rel=1e-12)
    assert r.iteration_s == pytest.approx(r.compute_s + r.straggler_s + r.slowdown_s + r.exposed_comm_s
                                          + r.step_overhead_s, rel=1e-12)
    # nothing overlaps after backward: no slowdown
    after = simulate(TWO, replace(SLOW, overlap_slowdown=0.5), replace(CFG, schedule="after_backward"))
    assert after.slowdown_s == 0.0 and after.iteration_s == pytest.approx(1.0 + 2 * D, rel=1e-12)


def test_one_gpu_pays_neither():
    c = replace(SLOW, bucket_overhead_s=0.05, overlap_slowdown=0.5)
    one = simulate(TWO, c, replace(CFG, gpus=1))
    assert one.iteration_s == pytest.approx(1.0) and one.slowdown_s == one.overhead_s == 0.0


@pytest.mark.parametrize("field, value, message", [
    ("overlap_slowdown", 1.0, "ClusterModel.overlap_slowdown must be < 1"),
    ("overlap_slowdown", -0.1, "ClusterModel.overlap_slowdown must be a finite number >= 0"),
    ("bucket_overhead_s", -1e-3, "ClusterModel.bucket_overhead_s must be a finite number >= 0"),
    ("bucket_overhead_s", float("nan"), "ClusterModel.bucket_overhead_s must be a finite number >= 0"),
])
def test_the_inputs_are_checked(field, value, message):
    with pytest.raises(ValueError, match=message):
        replace(SLOW, **{field: value})


@pytest.mark.parametrize("costs, message", [
    ("overlap_slowdown_percent = 100.0\n", "costs.overlap_slowdown_percent must be a finite number >= 0 and <= 99"),
    ("bucket_overhead_us = -5.0\n", "costs.bucket_overhead_us must be a finite number >= 0"),
    ("bucket_overhead_us = 50.0\nbucket_overhead_us_range = [100.0, 200.0]\n",
     r"costs.bucket_overhead_us_range = \[100, 200\] must hold costs.bucket_overhead_us = 50"),
])
def test_a_cluster_file_refuses_bad_values(costs, message):
    with pytest.raises(ValueError, match=message):
        load_cluster_text(LAB + "[costs]\n" + costs, "lab.toml")


def test_cluster_file_round_trip_and_defaults():
    given = load_cluster_text(LAB + "[costs]\nbucket_overhead_us = 250.0\noverlap_slowdown_percent = 20.0\n"
                                    "overlap_slowdown_percent_range = [0.0, 50.0]\n", "lab.toml")
    assert (given.bucket_overhead_s, given.overlap_slowdown) == (pytest.approx(250e-6), pytest.approx(0.2))
    assert "bucket_overhead_s" not in given.assumed  # given without a range: measured
    assert given.assumed["overlap_slowdown"] == pytest.approx((0.0, 0.5))
    back = load_cluster_text(to_toml(given), "back")
    assert (back.bucket_overhead_s, back.overlap_slowdown) == (pytest.approx(250e-6), pytest.approx(0.2))
    assert back.assumed["overlap_slowdown"] == pytest.approx((0.0, 0.5)) and "bucket_overhead_s" not in back.assumed
    default = load_cluster_text(LAB, "lab.toml")  # not given: the presets' stated values and ranges
    assert (default.bucket_overhead_s, default.overlap_slowdown) == (0.0, pytest.approx(0.159))
    for key in STEP_STATED:
        assert getattr(default, key) == pytest.approx(STEP_STATED[key])
        assert default.assumed[key] == STEP_RANGES[key]


def test_presets_state_the_central_values_and_range_them():
    for name in CLUSTERS.names():
        c = CLUSTERS.get(name)
        assert {key: getattr(c, key) for key in STEP_STATED} == STEP_STATED
        assert c.assumed["bucket_overhead_s"] == (0.0, 5e-3) and c.assumed["overlap_slowdown"] == (0.0, 0.79)
        for key, (low, high) in STEP_RANGES.items():
            assert low <= STEP_STATED[key] <= high, key  # a best estimate inside its range, not an end of it
    assert 0 < STEP_STATED["jitter_cv"] < STEP_RANGES["jitter_cv"][1]
    assert 0 < STEP_STATED["overlap_slowdown"] < STEP_RANGES["overlap_slowdown"][1]
    line = assumed_lines(assumptions(CLUSTERS.get("abci"), 370.0, None, "fp32"))[0]
    assert "per-bucket overhead 0 ms (0-5)" in line and "compute slowdown under overlap 15.9 % (0-79)" in line
    assert "compute jitter (CV) 1.5 % (0-3.7)" in line


@pytest.mark.parametrize("name, algo, gpus, expected_ms", [
    # printed before these terms existed (docs/simulator.md's examples)
    ("1gbe", "torus2d", 32, 1881.18), ("bigbasin-50gbe", "ring", 8, 147.09),
    ("bigbasin-50gbe", "ring", 64, 155.41), ("bigbasin-50gbe", "hierarchical", 256, 154.98),
])
def test_presets_exchange_results_are_unchanged(name, algo, gpus, expected_ms):
    c = exchange_only(CLUSTERS.get(name))
    r = simulate(resnet50(), c, SimConfig(algo, gpus, c.resnet50_images_per_s["fp32"]))
    assert round(r.iteration_s * 1e3, 2) == expected_ms and r.slowdown_s == 0.0


def test_the_stated_step_costs_add_stragglers_and_slowdown_to_the_exchange():
    """The nominal step of a preset is the exchange's plus what STEP_STATED adds: the timeline
    stretched by the slowest of P ranks (1 + cv e(P)) and backward slowed while exchanges overlap it."""
    c = CLUSTERS.get("bigbasin-50gbe")
    cfg = SimConfig("hierarchical", 256, c.resnet50_images_per_s["fp32"])
    bare, full = simulate(resnet50(), exchange_only(c), cfg), simulate(resnet50(), c, cfg)
    assert bare.straggler_s == 0.0 and bare.slowdown_s == 0.0
    assert full.straggler_s == pytest.approx(full.compute_s * 0.015 * expected_max_normal(256), rel=1e-9)
    assert full.slowdown_s > 0.0
    assert full.iteration_s > bare.iteration_s + full.straggler_s


@pytest.mark.parametrize("algo, gpus", [("native", 64), ("torus2d", 1024), ("hierarchical", 256), ("gtopk", 64)])
def test_every_new_input_moves_the_step_one_way_and_the_corners_hold_it(algo, gpus):
    """Larger per-bucket overhead or slowdown never shortens a step; the all fast / all slow corners
    bracket the step at random settings inside the ranges (abci, ResNet-50 fp16)."""
    abci, w = CLUSTERS.get("abci"), resnet50()
    cfg = SimConfig(algo, gpus, 1200.0, precision="fp16")
    for field, values in (("bucket_overhead_s", (0.0, 1e-4, 1e-3, 5e-3)), ("overlap_slowdown", (0.0, 0.2, 0.5, 0.79))):
        steps = [simulate(w, replace(abci, **{field: v}), cfg).iteration_s for v in values]
        assert steps == sorted(steps)
    inputs = assumptions(abci, 1200.0, (1000.0, 1400.0), "fp16")
    ends = {}
    for corner in range_corners(inputs)[:2]:
        c, ips = at_corner(abci, 1200.0, inputs, corner)
        ends[corner.name] = simulate(w, c, replace(cfg, images_per_s=ips)).iteration_s
    rng = random.Random(0)
    for _ in range(10):
        c, ips = abci, rng.uniform(1000.0, 1400.0)
        for a in inputs:
            if a.key != COMPUTE:
                c = with_input(c, a.key, rng.uniform(a.low, a.high))
        step = simulate(w, c, replace(cfg, images_per_s=ips)).iteration_s
        assert ends["all fast"] <= step <= ends["all slow"]
