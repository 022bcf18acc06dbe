"""Simulator cost of hierarchical gTop-k without dense traffic (flashsgd.sim.costs_sparse.hgtopk_sparse)."""

from __future__ import annotations

import dataclasses

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
