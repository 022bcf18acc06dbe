"""``native`` as its backend runs it (flashsgd.sim.costs_nccl): hand values of NCCL's ring and tree
from its tuning model, the choice between them, and Gloo's ring."""

import math
from dataclasses import replace

import numpy as np
import pytest

from flashsgd.sim.algorithms import exchange_cost
from flashsgd.sim.costs import CommSetup
from flashsgd.sim.costs_nccl import TREE_BUS_FACTOR, nccl_ring, nccl_tree, tree_correction
from flashsgd.sim.network import ClusterModel, Link

A_INTRA, A_INTER = 2e-6, 2e-5  # step latencies (s)
BW_INTRA, BW_INTER = 40.0, 5.0  # GB/s
G = 1e-11


def two_level(per_node=4, backend="nccl"):
    return ClusterModel("two", per_node, Link(A_INTRA, BW_INTRA), Link(A_INTER, BW_INTER), gamma_s_per_byte=G,
                        call_overhead_s=1e-5, backend=backend)


def parts(c):
    return [float(x) for x in (c.latency_s, c.bandwidth_s, c.compute_s, c.overhead_s)]


def test_ring_latency_is_the_sum_of_the_hops_on_a_chunks_path():
    # 16 ranks on 4 nodes: 2(P-1) = 30 steps, 2(N-1) = 6 of them leave a node (NCCL's nInterSteps)
    setup, n = CommSetup(gpus=16, cluster=two_level()), 8e6
    lat, bw, red, call = parts(nccl_ring(n, setup))
    assert lat == pytest.approx(24 * A_INTRA + 6 * A_INTER)
    assert bw == pytest.approx(30 / 16 * n / (BW_INTER * 1e9))  # the ring's one flow per node link
    assert red == pytest.approx(15 / 16 * n * G) and call == pytest.approx(1e-5)
    # flashsgd's own ring charges all 30 steps the slowest hop's latency; same bandwidth
    ours = exchange_cost("ring", n, setup)
    assert float(ours.latency_s) == pytest.approx(30 * A_INTER) and float(ours.bandwidth_s) == pytest.approx(bw)


def test_tree_latency_grows_with_the_log_of_the_nodes():
    setup, n = CommSetup(gpus=64, cluster=two_level()), 1e6  # 16 nodes of 4
    lat, bw, red, _ = parts(nccl_tree(n, setup))
    assert lat == pytest.approx(2 * (3 * A_INTRA + 4 * A_INTER))
    # 1e6 B = 64 x 15625 -> floor(lg 15625) = 13 -> NCCL's Simple correction .5
    assert tree_correction(np.asarray(n)) == pytest.approx(0.5)
    assert bw == pytest.approx(2 * n / (BW_INTER * 1e9) / (TREE_BUS_FACTOR * 0.5))
    assert red == pytest.approx(63 / 64 * n * G)


@pytest.mark.parametrize("n,factor", [(32, 1.0), (64, 0.9), (25 * 2**20, 0.7), (2**29 - 1, 0.9), (2**29, 1.0)])
def test_tree_correction_is_nccls_table(n, factor):
    assert float(tree_correction(np.asarray(float(n)))) == pytest.approx(factor)


def test_native_on_nccl_takes_the_tree_when_latency_bound_and_the_ring_when_bandwidth_bound():
    setup = CommSetup(gpus=256, cluster=two_level())  # 64 nodes
    small, large = 64e3, 2e9
    for n, pick in ((small, nccl_tree), (large, nccl_ring)):
        native = exchange_cost("native", n, setup)
        assert parts(native) == pytest.approx(parts(pick(n, setup)))
        assert float(native.total) == pytest.approx(min(float(nccl_ring(n, setup).total),
                                                        float(nccl_tree(n, setup).total)))
    # an array of sizes picks per size
    both = exchange_cost("native", np.array([small, large]), setup).total
    assert both[0] == pytest.approx(float(nccl_tree(small, setup).total))
    assert both[1] == pytest.approx(float(nccl_ring(large, setup).total))


def test_native_on_gloo_is_the_ring():
    setup = CommSetup(gpus=16, cluster=two_level(backend="gloo"))
    for n in (1e3, 8e6):
        assert parts(exchange_cost("native", n, setup)) == pytest.approx(parts(exchange_cost("ring", n, setup)))


@pytest.mark.parametrize("gpus,per_node", [(8, 8), (8, 1)])
def test_one_node_or_one_rank_per_node_the_two_rings_agree(gpus, per_node):
    setup = CommSetup(gpus=gpus, cluster=two_level(per_node))
    assert parts(nccl_ring(4e6, setup)) == pytest.approx(parts(exchange_cost("ring", 4e6, setup)))


def test_a_latency_bound_run_on_many_nodes_is_no_longer_priced_as_a_flat_ring():
    # the dgx-h100 BERT-large case of docs/simulator.md: 64 GPUs, 25 MiB buckets
    from flashsgd.sim.network import CLUSTERS
    c = CLUSTERS.get("dgx-h100")
    setup, n = CommSetup(gpus=64, cluster=c), 25 * 2**20
    native, ours = exchange_cost("native", n, setup), exchange_cost("ring", n, setup)
    nodes, steps = 8, 126
    assert float(ours.latency_s) == pytest.approx(steps * c.inter.alpha_s)
    assert float(native.latency_s) <= (steps - 2 * (nodes - 1)) * c.intra.alpha_s + 2 * (nodes - 1) * c.inter.alpha_s
    assert float(native.total) < 0.5 * float(ours.total)
    assert math.floor(math.log2(nodes)) == 3


def test_backend_is_checked():
    with pytest.raises(ValueError, match="backend must be one of nccl, gloo, got 'mpi'"):
        replace(two_level(), backend="mpi")


def test_a_gloo_calibration_fits_native_as_the_ring():
    from flashsgd.sim.calibrate import BenchFile, bench_backend, design_row
    gloo = BenchFile(world=8, ranks_per_node=4, grid=None, meta={"backend": "gloo"}, measurements=[])
    nccl = replace(gloo, meta={"backend": "nccl"})
    assert bench_backend(gloo) == "gloo" and bench_backend(replace(gloo, meta={})) == "gloo"
    assert bench_backend(nccl) == "nccl"
    assert np.allclose(design_row("native", 8e6, gloo), design_row("ring", 8e6, gloo))
    # on NCCL the tree's fewer latency steps win on the unit cluster of the alpha column
    assert not np.allclose(design_row("native", 8e6, nccl), design_row("ring", 8e6, nccl))
