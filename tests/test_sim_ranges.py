"""simulate's [low-high] (flashsgd.sim.uncertainty.runs_over_ranges) holds every printed number's
extremes: compared with every combination of the assumed inputs' ends (each number moves one way
with each input, so its extremes are among those 2^k settings)."""

from __future__ import annotations

import itertools
from dataclasses import replace

import pytest

from flashsgd.sim.cli import RANGED
from flashsgd.sim.cluster_file import load_cluster_text
from flashsgd.sim.engine import SimConfig, simulate
from flashsgd.sim.uncertainty import Corner, at_corner, runs_over_ranges
from flashsgd.sim.workload import resnet50
from sim_helpers import LAB

RANGED_LAB = LAB.replace("bandwidth_gbit = 1.0", "bandwidth_gbit = 1.0\nbandwidth_gbit_range = [0.5, 1.0]") + """
[costs]
jitter_percent_range = [0.0, 3.0]
overlap_slowdown_percent_range = [0.0, 79.0]
input_us_per_image_range = [0.0, 900.0]
step_overhead_us_range = [0.0, 2000.0]
bucket_overhead_us_range = [0.0, 5000.0]
"""
"""4 nodes x 2 ranks, six assumed inputs beside the compute rate and the three sparse costs."""


@pytest.mark.parametrize("algorithm, gpus", [("native", 8), ("torus2d", 8), ("topk", 8), ("gtopk", 4)])
def test_every_range_is_the_extremes_over_every_setting(algorithm, gpus):
    cluster = load_cluster_text(RANGED_LAB, "lab.toml")
    w = resnet50()
    cfg = SimConfig(algorithm, gpus, 200.0, batch_per_gpu=64)

    def run(c, rate):
        return [simulate(w, c, replace(cfg, images_per_s=rate))]

    ranged = runs_over_ranges(run, cluster, 200.0, (150.0, 250.0))
    keys = [a.key for a in ranged.inputs]
    assert len(keys) == 10  # and the sparse costs a file leaves out (their preset ranges): 1024 settings
    every = [run(*at_corner(cluster, 200.0, ranged.inputs, Corner("any", dict(zip(keys, ends)))))[0]
             for ends in itertools.product((True, False), repeat=len(keys))]
    every.append(ranged.runs[0])
    for field in RANGED:
        values = [getattr(r, field) for r in every]
        assert ranged.range(0, field) == pytest.approx((min(values), max(values)), rel=1e-12, abs=1e-15), field
