"""Simulator cost of hierarchical gTop-k without dense traffic (flashsgd.sim.costs_sparse.hgtopk_sparse)."""

from __future__ import annotations

import dataclasses
import math

import pytest

from flashsgd.sim.algorithms import ALGORITHMS, exchange_cost
from flashsgd.sim.costs import CommSetup
from flashsgd.sim.network import CLUSTERS


def test_hgtopk_sparse_cost():
    assert "hgtopk_sparse" in ALGORITHMS
    one = CommSetup(gpus=8, cluster=CLUSTERS.get("1gbe"))  # one rank per node: it is gTop-k
    assert float(exchange_cost("hgtopk_sparse", 4e6, one).total) == pytest.approx(
        float(exchange_cost("gtopk", 4e6, one).total))
    four = CommSetup(gpus=8, cluster=CLUSTERS.get("abci"))  # 2 nodes x 4 ranks
    sparse = exchange_cost("hgtopk_sparse", 102e6, four)
    # no dense traffic: far less link time than the leader split's 102 MB node reduce
    assert float(sparse.bandwidth_s) < float(exchange_cost("hgtopk", 102e6, four).bandwidth_s)
    # one selection per rank, like flat gTop-k (the leaders do not select again)
    assert float(sparse.compute_s) <= float(exchange_cost("gtopk", 102e6, four).compute_s)
    assert float(exchange_cost("hgtopk_sparse", 4e6, dataclasses.replace(four, gpus=1)).total) == 0


def test_hgtopk_slices_cost_is_its_docstring_formula():
    assert "hgtopk_slices" in ALGORITHMS
    abci = CLUSTERS.get("abci")  # 4 ranks per node; 8 GPUs = 2 nodes
    setup = CommSetup(gpus=8, cluster=abci)
    n, lr = 4e6, 4
    m, ks = n / 4, math.ceil(0.001 * 1e6 / lr)  # 250 pairs per slice
    a, b = abci.intra.alpha_s, abci.intra.beta_s_per_byte
    g, sel = abci.gamma_s_per_byte, abci.select_s_per_elem
    msg = 4 * ks + 4 * ks  # int32 indices + fp32 values
    # 1. reduce-scatter (3 slices of 1 MB out) + sums + the residual add over the whole acc
    step1 = a + 3 * (n / lr) * b + (n + 3 * n / lr) * g
    # 2-3. selection over m/L, one butterfly round between the 2 nodes, 4 flows on the inter link
    cross = (abci.inter.alpha_s + msg * 4 * abci.inter.beta_s_per_byte + m / lr * sel
             + 2 * ks * sel + ks * 4 * g + abci.sparse_overhead_s)
    # 4. all-gather of the 4 slice results (indices, counted indices, values)
    step4 = a + 3 * (msg + 4 * ks) * b
    got = exchange_cost("hgtopk_slices", n, setup)
    assert float(got.total) == pytest.approx(step1 + cross + step4, rel=1e-12)
    # one rank per node: gTop-k among the nodes
    one = CommSetup(gpus=8, cluster=CLUSTERS.get("1gbe"))
    assert float(exchange_cost("hgtopk_slices", 4e6, one).total) == pytest.approx(
        float(exchange_cost("gtopk", 4e6, one).total))
    # a node alone: no cross-node exchange, still the node's reduce-scatter and all-gather
    node = dataclasses.replace(setup, gpus=4)
    assert float(exchange_cost("hgtopk_slices", n, node).bandwidth_s) == pytest.approx(
        3 * (n / lr) * b + 3 * (msg + 4 * ks) * b)
