"""Contention in the simulator: which flows share a link, and TCP incast (Link.incast).

Hand-computed costs at small cases, validation errors, the cluster-file keys, and the presets'
nominal predictions unchanged (every preset states incast 0; the TCP presets range it).
"""

import dataclasses
import math

import numpy as np
import pytest

from flashsgd.sim.algorithms import exchange_cost
from flashsgd.sim.cluster_file import load_cluster, load_cluster_text, to_toml
from flashsgd.sim.costs import CommSetup
from flashsgd.sim.costs_sparse import direct_levels
from flashsgd.sim.engine import SimConfig, simulate
from flashsgd.sim.network import CLUSTERS, INCAST_RANGE, INPUTS, ClusterModel, Link, with_input
from flashsgd.sim.uncertainty import assumptions
from flashsgd.sim.workload import resnet50
from sim_helpers import LAB, exchange_only


def _cluster(per_node: int, incast: float, flow_gbps: float | None = None) -> ClusterModel:
    """1 GB/s per node and direction, no latency, free reductions: bandwidth terms by hand."""
    return ClusterModel("hand", per_node, Link(0.0, 100.0), Link(0.0, 1.0, flow_gbps=flow_gbps, incast=incast))


def test_incast_factor_is_one_plus_the_coefficient_per_extra_sender():
    link = Link(0.0, 1.0, incast=0.1)
    assert [link.incast_factor(m) for m in (0, 1, 2, 7, 31)] == pytest.approx([1.0, 1.0, 1.1, 1.6, 4.0])
    assert Link(0.0, 1.0).incast_factor(100) == 1.0  # default: no incast


@pytest.mark.parametrize("bad", [-0.1, float("nan"), float("inf")])
def test_incast_must_be_finite_and_not_negative(bad):
    with pytest.raises(ValueError, match=r"Link.incast must be a finite number >= 0"):
        Link(0.0, 1.0, incast=bad)


def test_topk_direct_exchange_pays_incast_by_hand():
    # 4 nodes x 1 rank, density 0.01 of 1000 fp32 elements: k = 10 pairs of 8 bytes = 80 B per
    # message; 3 messages out of (and into) each node: 3 x 80 B / 1 GB/s = 240 ns, times
    # 1 + 0.1 (3 - 1) = 1.2 with 3 senders converging on each node.
    setup = CommSetup(gpus=4, cluster=_cluster(1, 0.1), density=0.01)
    assert float(exchange_cost("topk", 4000.0, setup).bandwidth_s) == pytest.approx(240e-9 * 1.2)
    none = CommSetup(gpus=4, cluster=_cluster(1, 0.0), density=0.01)
    assert float(exchange_cost("topk", 4000.0, none).bandwidth_s) == pytest.approx(240e-9)
    # 4 nodes x 2 ranks (P = 8, L = 2, N = 4): (P - L) L k s b = 6 x 2 x 80 B / 1 GB/s = 960 ns,
    # times 1 + 0.1 (N - 2) = 1.2; the intra level (1 message of 80 B at 100 GB/s) is faster.
    setup = CommSetup(gpus=8, cluster=_cluster(2, 0.1), density=0.01)
    assert float(exchange_cost("topk", 4000.0, setup).bandwidth_s) == pytest.approx(960e-9 * 1.2)
    # two nodes: one sender into each, no incast whatever the coefficient
    two = CommSetup(gpus=2, cluster=_cluster(1, 5.0), density=0.01)
    assert float(exchange_cost("topk", 4000.0, two).bandwidth_s) == pytest.approx(80e-9)


def test_incast_multiplies_the_flow_capped_rate_too():
    # per-flow cap 0.25 GB/s: 3 flows at most 0.25 each -> 4 ns/B per flow, times 1.2
    setup = CommSetup(gpus=4, cluster=_cluster(1, 0.1, flow_gbps=0.25), density=0.01)
    (_, beta), = direct_levels(setup)
    assert beta == pytest.approx(4e-9 * 1.2)


@pytest.mark.parametrize("algorithm", ["ring", "native", "hierarchical", "torus2d", "recursive_doubling",
                                       "rabenseifner", "binomial", "gtopk", "gtopk_tree", "hgtopk"])
def test_one_sender_per_receiver_pays_no_incast(algorithm):
    """Rings, pairwise rounds and trees: every receiver hears from one node per round."""
    sizes = np.array([1e5, 4e6, 1e8])
    for per_node, gpus in ((1, 8), (2, 8), (4, 32)):
        plain = CommSetup(gpus=gpus, cluster=_cluster(per_node, 0.0))
        lossy = CommSetup(gpus=gpus, cluster=_cluster(per_node, 3.0))
        assert np.array_equal(exchange_cost(algorithm, sizes, plain).total,
                              exchange_cost(algorithm, sizes, lossy).total), (algorithm, per_node)


def test_flows_that_share_a_node_link_by_hand():
    """Which flows already share the NIC (the contention the costs had before incast), by hand on
    4 nodes x 2 ranks at 1 GB/s per node, 100 GB/s inside: n = 8 MB."""
    c = _cluster(2, 0.0)
    n = 8e6
    # torus2d 2x4: rows in a node, 4-rank columns stride 2: 2 column rings cross each NIC at once:
    # 2 (Y-1)/(XY) n b_y with b_y = 2 flows x 1 ns/B = 2 x 3/8 x 8e6 x 2e-9 = 12 ms (+ the rows' 2 steps)
    t = exchange_cost("torus2d", n, CommSetup(gpus=8, cluster=c, grid=(2, 4)))
    rows = 2 * (1 / 2) * n * 1e-11  # RS + AG along rows of 2: (X-1)/X n each, at 100 GB/s
    assert float(t.bandwidth_s) == pytest.approx(12e-3 + rows)
    # hierarchical = the same shape (L = X = 2 concurrent cross-node rings per NIC)
    assert float(exchange_cost("hierarchical", n, CommSetup(gpus=8, cluster=c)).bandwidth_s) == pytest.approx(
        float(t.bandwidth_s))
    # flat ring of 8: 14 steps of n/8, each step as slow as its NIC hop (1 flow): 14 x 1e6 x 1e-9
    assert float(exchange_cost("ring", n, CommSetup(gpus=8, cluster=c)).bandwidth_s) == pytest.approx(14e-3)
    # gtopk butterfly: round 0 in the node, rounds 1-2 across with both ranks of a node crossing at once
    k = math.ceil(0.001 * n / 4)
    g = exchange_cost("gtopk", n, CommSetup(gpus=8, cluster=c, density=0.001))
    assert float(g.bandwidth_s) == pytest.approx(8 * k * 1e-11 + 2 * 8 * k * 2e-9)


def test_cluster_file_incast_key_round_trip_and_ranges():
    text = LAB.replace("latency_us = 50.0\n", "latency_us = 50.0\nincast = 0.05\nincast_range = [0.0, 0.3]\n")
    c = load_cluster_text(text, "lab")
    assert c.inter.incast == 0.05 and c.intra.incast == 0.0
    assert c.assumed["inter.incast"] == (0.0, 0.3)
    back = load_cluster_text(to_toml(c), "round trip")
    assert back.inter.incast == 0.05 and back.assumed["inter.incast"] == (0.0, 0.3)
    assert "incast = 0.05" in to_toml(c) and "incast" not in to_toml(load_cluster_text(LAB, "lab"))
    # a range without the value ranges the stated 0
    c = load_cluster_text(LAB.replace("latency_us = 50.0\n", "latency_us = 50.0\nincast_range = [0.0, 0.2]\n"), "lab")
    assert c.inter.incast == 0.0 and c.assumed["inter.incast"] == (0.0, 0.2)
    assert "incast per extra sender" not in c.describe()
    assert "(incast 0.05 per extra sender)" in load_cluster_text(text, "lab").describe()


@pytest.mark.parametrize("line, message", [
    ("incast = -0.1", r"lab: inter.incast must be a finite number >= 0 and <= 100, got -0.1"),
    ("incast = 1000.0", r"lab: inter.incast must be a finite number >= 0 and <= 100, got 1000.0"),
    ("incast = \"high\"", r"lab: inter.incast must be a finite number"),
    ("incast = 0.5\nincast_range = [0.0, 0.3]", r"lab: inter.incast_range = \[0, 0.3\] must hold inter.incast = 0.5"),
    ("incast_range = [0.1, 0.3]", r"lab: inter.incast_range = \[0.1, 0.3\] must hold inter.incast = 0"),
    ("incast_per_sender = 0.1", r"lab: unknown key\(s\) inter.incast_per_sender; valid: .*inter.incast,"),
])
def test_cluster_file_incast_errors(line, message):
    with pytest.raises(ValueError, match=message):
        load_cluster_text(LAB.replace("latency_us = 50.0\n", f"latency_us = 50.0\n{line}\n"), "lab")


def test_presets_state_no_incast_and_range_it_on_tcp_only():
    for name in ("1gbe", "bigbasin-50gbe"):
        c = CLUSTERS.get(name)
        assert c.inter.incast == 0.0 and c.assumed["inter.incast"] == INCAST_RANGE
        back = load_cluster(name)  # the presets through the file reader's door: the same
        assert back.assumed["inter.incast"] == INCAST_RANGE
    abci = CLUSTERS.get("abci")
    assert abci.inter.incast == 0.0 and "inter.incast" not in abci.assumed  # RDMA: lossless
    assert INCAST_RANGE[1] == pytest.approx(9 / 31)  # goodput down to 10% at 32 senders
    assert Link(0.0, 1.0, incast=INCAST_RANGE[1]).incast_factor(32) == pytest.approx(10.0)
    assert INPUTS["inter.incast"][3] is False  # a higher coefficient is slower


def test_presets_nominal_results_unchanged():
    """The numbers the 1gbe sweep printed before incast existed (docs/simulator.md's command)."""
    before = {("native", 4): 1544.63, ("native", 32): 1972.34, ("topk", 4): 179.89, ("topk", 32): 231.48,
              ("gtopk_tree", 32): 196.87}
    # with the sparse costs of then (0.5 ms per exchange, 0.5 ns per element; now the preset's device
    # class, flashsgd.sim.device_costs)
    c = dataclasses.replace(exchange_only(CLUSTERS.get("1gbe")), exchange_fixed_s=0.5e-3, select_s_per_elem=0.5e-9)
    for (algorithm, gpus), ms in before.items():
        cfg = SimConfig(algorithm=algorithm, gpus=gpus, images_per_s=200.0, schedule="after_backward",
                        bucket_mb=1000.0)
        assert simulate(resnet50(), c, cfg).iteration_s * 1e3 == pytest.approx(ms, abs=0.006), (algorithm, gpus)


def test_the_range_of_topk_on_1gbe_holds_the_incast_high_end():
    c = CLUSTERS.get("1gbe")
    cfg = SimConfig(algorithm="topk", gpus=32, images_per_s=200.0, schedule="after_backward", bucket_mb=1000.0)
    nominal = simulate(resnet50(), c, cfg)
    lossy = simulate(resnet50(), with_input(c, "inter.incast", INCAST_RANGE[1]), cfg)
    # the direct exchange's bytes: 31 messages of 25,558 pairs x 8 B at 111 MB/s = 57.1 ms, x (1 + 0.29 x 30)
    wire = 31 * 25558 * 8 / 0.111e9
    assert lossy.iteration_s - nominal.iteration_s == pytest.approx(wire * INCAST_RANGE[1] * 30, rel=1e-6)
    incast = next(a for a in assumptions(c, 200.0, None, "fp32") if a.key == "inter.incast")
    assert (incast.end(True), incast.end(False)) == INCAST_RANGE
    assert incast.describe() == "inter-node incast loss 0 per extra sender (0-0.29)"
    # native (the dense ring) is not touched by it
    dense = dataclasses.replace(cfg, algorithm="native")
    assert simulate(resnet50(), with_input(c, "inter.incast", 0.29), dense).iteration_s == \
        simulate(resnet50(), c, dense).iteration_s
