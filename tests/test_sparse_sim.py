"""Simulator costs of the sparse exchanges: Top-k's direct exchange and hgtopk's node splits
(flashsgd.sim.costs_sparse, flashsgd.sim.costs_hier)."""

from __future__ import annotations

import dataclasses
import math

import pytest

from flashsgd.sim.algorithms import SIMULATED, exchange_cost
from flashsgd.sim.costs import CommSetup
from flashsgd.sim.network import CLUSTERS


def test_node_splits_are_an_option_of_hgtopk_not_names():
    from flashsgd.exchanges import EXCHANGES, NODE_SPLITS
    from flashsgd.sim.algorithms import COSTS, REFERENCES
    from flashsgd.sim.costs_hier import NODE_SPLIT_COSTS

    assert not any(n.startswith("hgtopk_") for n in SIMULATED)
    assert tuple(NODE_SPLIT_COSTS) == NODE_SPLITS
    # the registry is the catalog's exchanges (with a cost) and the listed references
    assert SIMULATED.names() == [n for n, e in EXCHANGES.items() if e.cost] + list(REFERENCES)
    assert all(SIMULATED.get(n) is COSTS[e.cost] for n, e in EXCHANGES.items() if e.cost)
    four = CommSetup(gpus=8, cluster=CLUSTERS.get("abci"))
    assert CommSetup(gpus=8, cluster=CLUSTERS.get("abci")).node_split == "leader"
    for split in NODE_SPLITS:
        s = dataclasses.replace(four, node_split=split)
        assert exchange_cost("hgtopk", 4e6, s) == NODE_SPLIT_COSTS[split](4e6, s)
    with pytest.raises(ValueError, match="node_split must be one of leader, slices, sparse"):
        CommSetup(gpus=8, cluster=CLUSTERS.get("abci"), node_split="ring")


def test_topk_is_one_round_of_direct_exchange_sharing_the_node_link():
    abci = CLUSTERS.get("abci")  # 4 ranks per node
    n, k = 4e6, 1000  # 1e6 fp32 elements at density 0.001
    msg = 8 * k  # int32 indices + fp32 values
    sel = 1e6 * abci.select_s_per_elem + n * abci.gamma_s_per_byte + abci.exchange_fixed_s
    add = 8 * k * 4 * abci.gamma_s_per_byte  # P k values scatter-added (8 ranks)
    got = exchange_cost("topk", n, CommSetup(gpus=8, cluster=abci))
    intra = abci.intra.alpha_s + 3 * msg * abci.intra.beta_s_per_byte
    inter = abci.inter.alpha_s + 4 * msg * 4 * abci.inter.beta_s_per_byte  # 4 other-node peers x 4 ranks
    assert float(got.latency_s + got.bandwidth_s) == pytest.approx(max(intra, inter), rel=1e-12)
    assert float(got.total) == pytest.approx(max(intra, inter) + sel + add, rel=1e-12)
    # one node: the L-1 messages on the intra link, one latency
    node = exchange_cost("topk", n, CommSetup(gpus=4, cluster=abci))
    assert float(node.latency_s) == pytest.approx(abci.intra.alpha_s)
    assert float(node.bandwidth_s) == pytest.approx(3 * msg * abci.intra.beta_s_per_byte)
    # one rank per node (1gbe): one latency for any P, the bytes of (P-1) messages
    gbe = CLUSTERS.get("1gbe")
    flat = exchange_cost("topk", n, CommSetup(gpus=32, cluster=gbe))
    assert float(flat.latency_s) == pytest.approx(gbe.inter.alpha_s)
    assert float(flat.bandwidth_s) == pytest.approx(31 * msg * gbe.inter.beta_s_per_byte)


def test_hgtopk_sparse_cost():
    one = CommSetup(gpus=8, cluster=CLUSTERS.get("1gbe"), node_split="sparse")  # one rank per node: gTop-k
    assert float(exchange_cost("hgtopk", 4e6, one).total) == pytest.approx(
        float(exchange_cost("gtopk", 4e6, one).total))
    leader = CommSetup(gpus=8, cluster=CLUSTERS.get("abci"))  # 2 nodes x 4 ranks
    four = dataclasses.replace(leader, node_split="sparse")
    sparse = exchange_cost("hgtopk", 102e6, four)
    # no dense traffic: far less link time than the leader split's 102 MB node reduce
    assert float(sparse.bandwidth_s) < float(exchange_cost("hgtopk", 102e6, leader).bandwidth_s)
    # one selection per rank, like flat gTop-k (the leaders do not select again)
    assert float(sparse.compute_s) <= float(exchange_cost("gtopk", 102e6, four).compute_s)
    assert float(exchange_cost("hgtopk", 4e6, dataclasses.replace(four, gpus=1)).total) == 0


def test_hgtopk_slices_cost_is_its_docstring_formula():
    abci = CLUSTERS.get("abci")  # 4 ranks per node; 8 GPUs = 2 nodes
    setup = CommSetup(gpus=8, cluster=abci, node_split="slices")
    n, lr = 4e6, 4
    m, ks = n / 4, math.ceil(0.001 * 1e6 / lr)  # 250 pairs per slice
    a, b = abci.intra.alpha_s, abci.intra.beta_s_per_byte
    g, sel = abci.gamma_s_per_byte, abci.select_s_per_elem
    msg = 4 * ks + 4 * ks  # int32 indices + fp32 values
    # 1. reduce-scatter (3 slices of 1 MB out) + sums + the residual add over the whole acc
    step1 = a + 3 * (n / lr) * b + (n + 3 * n / lr) * g
    # 2-3. selection over m/L, one butterfly round between the 2 nodes, 4 flows on the inter link
    cross = (abci.inter.alpha_s + msg * 4 * abci.inter.beta_s_per_byte + m / lr * sel
             + 2 * ks * sel + ks * 4 * g + abci.exchange_fixed_s)
    # 4. all-gather of the 4 slice results (indices, counted indices, values)
    step4 = a + 3 * (msg + 4 * ks) * b
    got = exchange_cost("hgtopk", n, setup)
    assert float(got.total) == pytest.approx(step1 + cross + step4, rel=1e-12)
    # one rank per node: gTop-k among the nodes
    one = CommSetup(gpus=8, cluster=CLUSTERS.get("1gbe"), node_split="slices")
    assert float(exchange_cost("hgtopk", 4e6, one).total) == pytest.approx(
        float(exchange_cost("gtopk", 4e6, one).total))
    # a node alone: no cross-node exchange, still the node's reduce-scatter and all-gather
    node = dataclasses.replace(setup, gpus=4)
    assert float(exchange_cost("hgtopk", n, node).bandwidth_s) == pytest.approx(
        3 * (n / lr) * b + 3 * (msg + 4 * ks) * b)
