"""The input pipeline (flashsgd.sim.engine, Step 6): a node's host prepares the images of all its
GPUs ahead of them, so a step of P > 1 GPUs lasts at least batch x L x c; its input, cluster-file
key, range and corners."""

from __future__ import annotations

import subprocess
import sys
from dataclasses import replace

import numpy as np
import pytest

from flashsgd.sim.cluster_file import load_cluster_text, to_toml
from flashsgd.sim.engine import SimConfig, simulate
from flashsgd.sim.network import CLUSTERS, ClusterModel, Link
from flashsgd.sim.uncertainty import assumptions, runs_over_ranges
from flashsgd.sim.workload import Workload, resnet50
from sim_helpers import LAB

TWO = Workload("two", np.array([1000, 1000]), np.array([1.0, 1.0]))
NODE = ClusterModel("node", 4, Link(1e-6, 100.0), Link(1e-6, 100.0))
"""4 GPUs per node on fast links: the exchange of TWO takes microseconds."""
CFG = SimConfig("ring", 4, 4.0, batch_per_gpu=4)
"""T1 = 1 s (4 images at 4 images/s)."""


def test_a_slow_host_sets_the_step_by_hand():
    """c = 0.1 s per image: the node's host prepares 4 GPUs x 4 images = 16 images in 1.6 s > T1 + d."""
    fed = simulate(TWO, NODE, CFG)
    r = simulate(TWO, replace(NODE, input_s_per_image=0.1), CFG)
    assert fed.input_wait_s == 0.0 and fed.iteration_s < 1.001
    assert r.iteration_s == pytest.approx(1.6, rel=1e-12)
    assert r.input_wait_s == pytest.approx(1.6 - fed.iteration_s, rel=1e-9)
    assert r.efficiency == pytest.approx(1.0 / 1.6, rel=1e-12)
    # a host that keeps up (16 images in 0.8 s) costs nothing: the loader works ahead
    assert simulate(TWO, replace(NODE, input_s_per_image=0.05), CFG).iteration_s == fed.iteration_s


def test_the_host_is_shared_by_the_gpus_of_its_node_only():
    slow = replace(NODE, input_s_per_image=0.1)
    assert simulate(TWO, slow, replace(CFG, gpus=2)).input_wait_s == 0.0  # 8 images in 0.8 s: keeps up
    assert simulate(TWO, slow, replace(CFG, gpus=3)).iteration_s == pytest.approx(1.2, rel=1e-12)
    # 8 GPUs on 2 nodes: each host still feeds 4 GPUs
    assert simulate(TWO, slow, replace(CFG, gpus=8)).iteration_s == pytest.approx(1.6, rel=1e-9)
    # one GPU had the whole host when its rate was measured: never limited, nor with one GPU per node
    one = simulate(TWO, slow, replace(CFG, gpus=1))
    assert (one.iteration_s, one.input_wait_s, one.efficiency) == (1.0, 0.0, 1.0)
    alone = replace(slow, ranks_per_node=1, input_s_per_image=0.5)  # 4 images in 2 s > T1
    assert simulate(TWO, alone, replace(CFG, gpus=4)).input_wait_s == 0.0


def test_a_faster_gpu_meets_the_same_host_sooner():
    """The mixed-precision rows of single-node benchmarks: the same host, a GPU 3x faster, the node's
    efficiency falls where the slower GPU's does not."""
    host = replace(NODE, input_s_per_image=0.07)  # 16 images in 1.12 s
    slow_gpu = simulate(TWO, host, CFG)
    fast_gpu = simulate(TWO, host, replace(CFG, images_per_s=12.0))
    assert slow_gpu.input_wait_s > 0 and fast_gpu.efficiency < slow_gpu.efficiency
    assert fast_gpu.iteration_s == pytest.approx(1.12, rel=1e-12)


def test_the_input_is_checked():
    with pytest.raises(ValueError, match="ClusterModel.input_s_per_image must be a finite number >= 0"):
        replace(NODE, input_s_per_image=-1e-6)


@pytest.mark.parametrize("costs, message", [
    ("input_us_per_image = -1.0\n", "costs.input_us_per_image must be a finite number >= 0"),
    ("input_us_per_image = 2e6\n", r"costs.input_us_per_image must be a finite number >= 0 and <= 1e\+06"),
    ("input_us_per_image_range = [50.0, 250.0]\n",
     r"costs.input_us_per_image_range = \[50, 250\] must hold costs.input_us_per_image = 0"),
])
def test_a_cluster_file_refuses_bad_values(costs, message):
    with pytest.raises(ValueError, match=message):
        load_cluster_text(LAB + "[costs]\n" + costs, "lab.toml")


def test_cluster_file_round_trip_and_no_default_range():
    given = load_cluster_text(LAB + "[costs]\ninput_us_per_image = 0.0\ninput_us_per_image_range = [0.0, 250.0]\n",
                              "lab.toml")
    assert given.input_s_per_image == 0.0 and given.assumed["input_s_per_image"] == pytest.approx((0.0, 250e-6))
    back = load_cluster_text(to_toml(given), "back")
    assert back.assumed["input_s_per_image"] == pytest.approx((0.0, 250e-6))
    measured = load_cluster_text(LAB + "[costs]\ninput_us_per_image = 125.0\n", "lab.toml")
    assert measured.input_s_per_image == pytest.approx(125e-6) and "input_s_per_image" not in measured.assumed
    assert "input pipeline 8000 images/s per node" in measured.describe()
    # not given: the pipeline keeps up, not ranged (it depends on the host, which no default knows)
    assert "input_s_per_image" not in load_cluster_text(LAB, "lab.toml").assumed
    for name in CLUSTERS.names():
        assert CLUSTERS.get(name).input_s_per_image == 0.0


def test_the_range_reaches_the_slow_end_at_the_corners():
    """A file ranging the host's time per image: the simulated range's low efficiency is the host's
    bound with the GPU at its fast end (ResNet-50 at 1200 images/s, 8 GPUs a node, 40 cores at
    100 images/s: 4000 images/s for 9600 wanted)."""
    c = load_cluster_text(LAB.replace("ranks_per_node = 2", "ranks_per_node = 8") +
                          "[costs]\ninput_us_per_image_range = [0.0, 250.0]\n", "lab.toml")
    w = resnet50()
    cfg = SimConfig("native", 8, 1200.0, batch_per_gpu=256, precision="fp16")
    ranged = runs_over_ranges(lambda cl, rate: [simulate(w, cl, replace(cfg, images_per_s=rate))], c, 1200.0,
                              (1000.0, 1400.0), "fp16")
    lo, hi = ranged.range(0, "efficiency")
    assert lo == pytest.approx((256 / 1400.0) / (256 * 8 * 250e-6), rel=1e-9)
    assert hi > 0.95 and ranged.runs[0].input_wait_s == 0.0
    assert any(a.key == "input_s_per_image" for a in assumptions(c, 1200.0, None, "fp16"))


def test_simulate_prints_the_input_wait_with_its_range(tmp_path):
    path = tmp_path / "host.toml"
    path.write_text(LAB.replace("ranks_per_node = 2", "ranks_per_node = 8")
                    + "[costs]\ninput_us_per_image_range = [0.0, 250.0]\n")
    out = subprocess.run([sys.executable, "-m", "flashsgd", "simulate", "--cluster", str(path), "--gpus", "8",
                          "--model", "resnet50", "--images-per-s", "1200", "--batch-per-gpu", "256"],
                         capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    line = next(l for l in out.stdout.splitlines() if l.strip().startswith("input wait"))
    assert "0.00 ms [0.00-" in line and "host input time per image and node 0 us (0-250)" in out.stdout


@pytest.mark.parametrize("text, message", [
    ("[costs]\noverlap_slowdown_percent_range = [0.0, 100.0]\n",
     r"costs.overlap_slowdown_percent_range must be a finite number >= 0 and <= 99, got 100"),
    ("[costs]\njitter_percent_range = [0.0, 150.0]\n", r"costs.jitter_percent_range must be a finite number >= 0 and <= 99"),
    ("[costs]\njitter_percent = 150.0\n", r"costs.jitter_percent must be a finite number >= 0 and <= 99"),
    ("[costs]\ninput_us_per_image_range = [0.0, 1e9]\n",
     r"costs.input_us_per_image_range must be a finite number >= 0 and <= 1e\+06"),
])
def test_a_range_is_held_to_its_keys_limit(text, message):
    """A range beyond what its key may be was loaded and failed later, inside the model, without
    the file's name or key."""
    with pytest.raises(ValueError, match=message):
        load_cluster_text(LAB + text, "lab.toml")


@pytest.mark.parametrize("key", ["incast = 0.1", "incast_range = [0.0, 0.2]"])
def test_incast_belongs_to_the_network_between_nodes(key):
    """Under [intra] no cost read it: refused, naming where it goes."""
    text = LAB.replace("latency_us = 5.0", f"latency_us = 5.0\n{key}")
    with pytest.raises(ValueError, match=r"lab.toml: intra.incast: .* give incast and incast_range under \[inter\]"):
        load_cluster_text(text, "lab.toml")
