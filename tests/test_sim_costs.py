"""Closed-form costs of flashsgd.sim.costs against hand-computed values and invariants."""

import itertools
import math

import numpy as np
import pytest

from flashsgd.sim.algorithms import SIMULATED, exchange_cost
from flashsgd.sim.costs import CommSetup, auto_grid
from flashsgd.sim.network import CLUSTERS, ClusterModel, Link, get_cluster

A, BW, G = 1e-5, 10.0, 1e-11  # alpha 10 us, 10 GB/s (beta 1e-10 s/B), gamma 1e-11 s/B
BETA = 1e-10


def flat(ranks_per_node=8, call=0.0, select=0.0, sparse=0.0):
    link = Link(alpha_s=A, bandwidth_gbps=BW)
    return ClusterModel("flat", ranks_per_node, link, link, gamma_s_per_byte=G, call_overhead_s=call,
                   select_s_per_elem=select, exchange_fixed_s=sparse)


def two_level(call=0.0):
    return ClusterModel("two", 4, Link(2e-6, 40.0), Link(2e-5, 5.0), gamma_s_per_byte=G, call_overhead_s=call)


def total(algo, n, setup):
    return float(exchange_cost(algo, n, setup).total)


# ------------------------------------------------------------------ hand-computed, one link level --

@pytest.mark.parametrize("algo,expected", [
    # 2(P-1) a + 2(P-1)/P n b + (P-1)/P n g, P=4, n=1e6
    ("ring", 6 * A + 1.5 * 1e6 * BETA + 0.75 * 1e6 * G),
    ("native", 6 * A + 1.5 * 1e6 * BETA + 0.75 * 1e6 * G),
    # lgP a + n lgP b + n lgP g
    ("recursive_doubling", 2 * A + 2e6 * BETA + 2e6 * G),
    # 2 lgP a + 2(P-1)/P n b + (P-1)/P n g
    ("rabenseifner", 4 * A + 1.5e6 * BETA + 0.75e6 * G),
    # 2 lgP a + 2 n lgP b + n lgP g
    ("binomial", 4 * A + 4e6 * BETA + 2e6 * G),
])
def test_dense_costs_match_hand_values(algo, expected):
    setup = CommSetup(gpus=4, cluster=flat())
    assert total(algo, 1e6, setup) == pytest.approx(expected, rel=1e-12)


def test_sparse_costs_match_hand_values():
    # m = 1e6 fp32 elements, density 0.01 -> k = 1e4 pairs of 8 bytes; selection and overhead off.
    setup = CommSetup(gpus=4, cluster=flat(), density=0.01)
    n = 4e6
    k, pair = 1e4, 8
    # direct exchange (comm/sparse/__init__.py topk_allgather): one round, (P-1) messages of k pairs at
    # once; + residual add n g + scatter-add P k values.
    topk = A + 3 * k * pair * BETA + n * G + 4 * k * 4 * G
    assert total("topk", n, setup) == pytest.approx(topk, rel=1e-12)
    # gTop-k butterfly (comm/sparse/__init__.py): lgP rounds, each one k-pair message (sent and received at
    # once) and one merge of 2k (k values reduced): 2 a + 2 k pair b + residual add + 2 merges.
    gtopk = 2 * A + 2 * k * pair * BETA + n * G + 2 * k * 4 * G
    assert total("gtopk", n, setup) == pytest.approx(gtopk, rel=1e-12)
    # Shi et al.'s tree + broadcast: 2 lgP a + 4 k lgP b_elem (b_elem: 4-byte element) + 2 merges.
    tree = 4 * A + 4 * k * 2 * 4 * BETA + n * G + 2 * k * 4 * G
    assert total("gtopk_tree", n, setup) == pytest.approx(tree, rel=1e-12)


def test_gtopk_non_power_of_two_hand_value():
    # P=6 on one node: P'=4, E=2. Fold-in (k pairs), 2 butterfly rounds, fold-out (k pairs + k mask
    # bytes); 3 merges (fold-in + 2 rounds). k = 1001 (odd): fp32 values pad to 4008 bytes.
    setup = CommSetup(gpus=6, cluster=flat(), density=1.0, index_bytes=8)
    k = 1001
    n = 4.0 * k
    msg = 8 * k + 4008  # int64 indices + values padded to whole 8-byte words
    mask = 1008  # k bytes padded to 8
    expected = 4 * A + (3 * msg + msg + mask) * BETA + n * G + 3 * k * 4 * G
    assert total("gtopk", n, setup) == pytest.approx(expected, rel=1e-12)


@pytest.mark.parametrize("world", [2, 3, 4, 5, 6, 7, 8, 12, 13, 16, 24])
def test_gtopk_bytes_match_the_implementation(world):
    import torch

    from flashsgd.comm.sparse import gtopk_bytes_sent, message_bytes
    from flashsgd.sim.costs_sparse import gtopk_bytes_per_rank, sparse_message_bytes

    # int32 indices below 2**31 elements, int64 from there on (comm/sparse/__init__.py wire_index_dtype)
    for (value_bytes, dtype), (index_bytes, numel) in itertools.product(
            ((4, torch.float32), (2, torch.float16)), ((4, 10**6), (8, 2**31))):
        cluster = flat(ranks_per_node=max(world, 2))
        for k in (1, 7, 1000, 1001):
            setup = CommSetup(gpus=world, cluster=cluster, index_bytes=index_bytes,
                              value_bytes=value_bytes, density=1.0)
            sim = gtopk_bytes_per_rank(k, setup)
            impl = [gtopk_bytes_sent(k, world, r, dtype, numel) for r in range(world)]
            assert sim.tolist() == impl, (world, k, dtype, numel)
            assert float(sparse_message_bytes(k, setup)) == message_bytes(k, dtype, numel)
            # The cost's bandwidth term is rank 0's critical path: what it sends, plus the fold-in
            # message it receives before the butterfly when P is not a power of two.
            p2 = 1 << (world.bit_length() - 1)
            path = impl[0] + (message_bytes(k, dtype, numel) if world > p2 else 0)
            bw = exchange_cost("gtopk", float(k * value_bytes), setup).bandwidth_s
            assert float(bw) == pytest.approx(path * BETA, rel=1e-12)


def test_gtopk_butterfly_halves_the_tree_at_powers_of_two():
    for p in (2, 8, 64, 1024):
        setup = CommSetup(gpus=p, cluster=get_cluster("1gbe"), density=0.001)
        bfly, tree = exchange_cost("gtopk", 1e8, setup), exchange_cost("gtopk_tree", 1e8, setup)
        assert float(tree.latency_s) == pytest.approx(2 * float(bfly.latency_s))
        assert float(tree.bandwidth_s) == pytest.approx(2 * float(bfly.bandwidth_s))
        assert float(tree.compute_s) == pytest.approx(float(bfly.compute_s))


def test_sparse_overhead_and_selection_are_charged_once_per_call():
    base = CommSetup(gpus=8, cluster=flat(), density=0.001)
    extra = CommSetup(gpus=8, cluster=flat(select=1e-9, sparse=1e-3), density=0.001)
    n = 4e6  # 1e6 elements -> selection 1 ms on the local gradient
    d = total("topk", n, extra) - total("topk", n, base)
    assert d == pytest.approx(1e-3 + 1e6 * 1e-9, rel=1e-9)
    for algo in ("gtopk", "gtopk_tree"):
        d = total(algo, n, extra) - total(algo, n, base)
        assert d == pytest.approx(1e-3 + 1e6 * 1e-9 + 3 * 2 * 1000 * 1e-9, rel=1e-9)  # + 3 merges of 2k


@pytest.mark.parametrize("algo, split, gpus, per_node, rounds, exchanges", [
    ("topk", "leader", 8, 4, 1, 1),               # one round of direct exchange
    ("gtopk", "leader", 8, 8, 3, 1),              # lg 8 butterfly rounds
    ("gtopk", "leader", 13, 1, 5, 1),             # lg 8 + fold-in + fold-out
    ("gtopk_tree", "leader", 13, 1, 8, 1),        # 2 ceil(lg 13): up the tree and back down
    ("hgtopk", "leader", 16, 4, 2 + 2 + 2, 1),    # reduce lg 4, leaders' lg 4, broadcast lg 4
    ("hgtopk", "slices", 16, 4, 1 + 2 + 1, 1),    # node reduce-scatter, lg 4 across, all-gather
    ("hgtopk", "sparse", 16, 4, 2 + 2 + 2, 2),    # node butterfly, leaders' butterfly, broadcast
    ("hgtopk", "sparse", 12, 4, 2 + 3 + 2, 2),    # 3 leaders: lg 2 + fold-in + fold-out
])
def test_fixed_costs_per_exchange_and_per_round(algo, split, gpus, per_node, rounds, exchanges):
    """exchange_fixed_s once per exchange (twice for hgtopk's sparse split: two butterflies),
    round_fixed_s once per message round, the rounds the message pattern counts."""
    from flashsgd.sim.costs_sparse import message_pattern

    def cluster(fixed, per_round):
        return ClusterModel("c", per_node, Link(A, BW), Link(4 * A, BW / 4), gamma_s_per_byte=G,
                            exchange_fixed_s=fixed, round_fixed_s=per_round)

    n = 4e6
    setups = [CommSetup(gpus=gpus, cluster=cluster(f, r), node_split=split, density=0.01)
              for f, r in ((0.0, 0.0), (1e-3, 0.0), (0.0, 1e-4))]
    base, fixed, per_round = (exchange_cost(algo, n, s) for s in setups)
    assert float(fixed.total - base.total) == pytest.approx(exchanges * 1e-3, rel=1e-12)
    assert float(per_round.total - base.total) == pytest.approx(rounds * 1e-4, rel=1e-12)
    assert float(per_round.overhead_s - base.overhead_s) == pytest.approx(rounds * 1e-4, rel=1e-12)
    assert float(per_round.latency_s) == float(base.latency_s)  # the link's alpha stays apart
    if algo != "gtopk_tree":
        assert message_pattern(algo, int(n) // 4, setups[0]).rounds == rounds


def test_dense_exchanges_pay_no_sparse_fixed_cost():
    plain = two_level()
    fixed = ClusterModel("f", 4, plain.intra, plain.inter, gamma_s_per_byte=G, exchange_fixed_s=1e-3,
                         round_fixed_s=1e-4)
    for algo in ("ring", "hierarchical", "torus2d", "rabenseifner", "powersgd"):
        assert total(algo, 1e7, CommSetup(16, fixed)) == total(algo, 1e7, CommSetup(16, plain))


def test_hierarchical_two_levels_hand_value():
    # P=8, L=4, N=2: RS in node 3 a_i + 3/4 n b_i; 4 concurrent inter rings of n/4 over 2 nodes:
    # 2 (a_e + n/8 * 4 b_e); AG in node 3 a_i + 3/4 n b_i; reductions 7/8 n g; 3 calls.
    c = two_level(call=1e-5)
    n = 1e7
    bi, be = 1 / 40e9, 1 / 5e9
    expected = 6 * 2e-6 + 1.5 * n * bi + 2 * (2e-5 + n / 8 * 4 * be) + 7 / 8 * n * G + 3e-5
    assert total("hierarchical", n, CommSetup(gpus=8, cluster=c)) == pytest.approx(expected, rel=1e-12)


# ------------------------------------------------------------------ invariants ---------------------

@pytest.mark.parametrize("p", [2, 3, 8, 64, 1000])
def test_ring_bandwidth_term_attains_lower_bound(p):
    # Any point-to-point all-reduce moves >= 2(P-1)/P n bytes through each rank's link.
    c = flat(ranks_per_node=p)
    n = np.array([1e3, 1e6, 1e9])
    cost = exchange_cost("ring", n, CommSetup(gpus=p, cluster=c))
    np.testing.assert_allclose(cost.bandwidth_s, n * BETA * 2 * (p - 1) / p, rtol=1e-12)


def test_ring_across_nodes_bandwidth_is_bounded_by_node_link():
    c = two_level()
    cost = exchange_cost("ring", 1e8, CommSetup(gpus=64, cluster=c))
    assert float(cost.bandwidth_s) == pytest.approx(1e8 / 5e9 * 2 * 63 / 64, rel=1e-12)


@pytest.mark.parametrize("gpus", [4, 16, 64, 256])
def test_torus2d_degenerate_grids_reduce_to_ring(gpus):
    c = two_level(call=0.0)
    n = np.array([1e4, 3e6, 1e8])
    ring = exchange_cost("ring", n, CommSetup(gpus=gpus, cluster=c)).total
    for grid in ((1, gpus), (gpus, 1)):
        torus = exchange_cost("torus2d", n, CommSetup(gpus=gpus, cluster=c, grid=grid)).total
        np.testing.assert_allclose(torus, ring, rtol=1e-12)


def test_torus2d_with_node_rows_equals_hierarchical():
    c = two_level(call=1e-5)
    for gpus in (8, 64, 1024):
        h = total("hierarchical", 5e7, CommSetup(gpus=gpus, cluster=c))
        t = total("torus2d", 5e7, CommSetup(gpus=gpus, cluster=c, grid=(4, gpus // 4)))
        assert t == pytest.approx(h, rel=1e-12)


def test_torus2d_cuts_latency_steps_at_scale():
    c = CLUSTERS.get("abci")
    setup = CommSetup(gpus=1024, cluster=c, grid=(32, 32))
    t, r = exchange_cost("torus2d", 1e5, setup), exchange_cost("ring", 1e5, setup)
    # 2(X-1) + 2(Y-1) = 124 steps instead of 2(P-1) = 2046.
    assert float(t.latency_s) < float(r.latency_s) / 10


def test_one_gpu_costs_nothing_and_costs_grow_with_size():
    for algo in SIMULATED.names():
        assert total(algo, 1e8, CommSetup(gpus=1, cluster=flat())) == 0.0
        t = exchange_cost(algo, np.array([1e5, 1e6, 1e7, 1e8]), CommSetup(gpus=16, cluster=two_level())).total
        assert np.all(np.diff(t) > 0), algo


def test_non_power_of_two_adds_fold_steps():
    c = flat(ranks_per_node=16)
    t6, t4 = total("recursive_doubling", 1e6, CommSetup(gpus=6, cluster=c)), \
        total("recursive_doubling", 1e6, CommSetup(gpus=4, cluster=c))
    assert t6 == pytest.approx(t4 + 2 * (A + 1e6 * BETA) + 1e6 * G, rel=1e-12)


def test_auto_grid_is_near_square_and_node_aligned():
    assert auto_grid(1024, 4) == (32, 32)
    assert auto_grid(1088, 4) == (32, 34)
    assert auto_grid(4, 8) == (4, 1)
    x, y = auto_grid(96, 8)
    assert x * y == 96 and x % 8 == 0


# ------------------------------------------------------------------ bad inputs ---------------------

def test_bad_inputs_raise_clear_errors():
    c = CLUSTERS.get("abci")
    with pytest.raises(ValueError, match="grid 4x200 does not match gpus=1024"):
        CommSetup(gpus=1024, cluster=c, grid=(4, 200))
    with pytest.raises(ValueError, match="multiple of it"):
        CommSetup(gpus=10, cluster=c)
    with pytest.raises(ValueError, match="X=3 must divide"):
        CommSetup(gpus=12, cluster=c, grid=(3, 4))
    with pytest.raises(ValueError, match="density"):
        CommSetup(gpus=8, cluster=c, density=0.0)
    with pytest.raises(ValueError, match="bandwidth_gbps"):
        Link(alpha_s=1e-6, bandwidth_gbps=-1.0)
    with pytest.raises(ValueError, match="alpha_s"):
        Link(alpha_s=-1e-6, bandwidth_gbps=1.0)
    with pytest.raises(ValueError, match="unknown cluster preset 'abcd'.*abci"):
        get_cluster("abcd")
    with pytest.raises(ValueError, match="--calibration"):
        get_cluster("local")
    with pytest.raises(ValueError, match="unknown simulated exchange 'rign'"):
        exchange_cost("rign", 1e6, CommSetup(gpus=8, cluster=c))
    with pytest.raises(ValueError, match="n_bytes"):
        exchange_cost("ring", -1.0, CommSetup(gpus=8, cluster=c))


def test_presets_are_physical():
    for name in CLUSTERS:
        c = CLUSTERS.get(name)
        assert c.inter.bandwidth_gbps <= c.intra.bandwidth_gbps or c.ranks_per_node == 1
        assert 0 < c.inter.alpha_s < 1e-3 and math.isfinite(c.gamma_s_per_byte)
        assert c.source


def test_hgtopk_with_one_rank_per_node_is_gtopk_and_pays_the_node_levels_otherwise():
    one = CLUSTERS.get("1gbe")  # 1 GPU per node
    setup = CommSetup(gpus=8, cluster=one)
    assert float(exchange_cost("hgtopk", 4e6, setup).total) == pytest.approx(
        float(exchange_cost("gtopk", 4e6, setup).total))
    abci = CLUSTERS.get("abci")  # 4 per node: 2 nodes' leaders run a 1-round gTop-k
    h = exchange_cost("hgtopk", 4e6, CommSetup(gpus=8, cluster=abci))
    leaders = exchange_cost("gtopk", 4e6, CommSetup(gpus=2, cluster=ClusterModel(
        **{**abci.__dict__, "ranks_per_node": 1})))
    intra = abci.intra
    k = math.ceil(0.001 * 1e6)
    # + 2 rounds of the full 4 MB reduce + 2 rounds of k (4 + 4 B) pairs + 4 k counted-index bytes
    # (int32, as comm/sparse/hier.py broadcasts them)
    extra = 2 * (intra.alpha_s + 4e6 * intra.beta_s_per_byte) + 2 * 4e6 * abci.gamma_s_per_byte \
        + 2 * (intra.alpha_s + (4 * k + 4 * k + 4 * k) * intra.beta_s_per_byte)
    assert float(h.total) == pytest.approx(float(leaders.total) + extra)


def test_powersgd_is_three_rings_of_the_compressed_sizes_plus_the_products():
    from flashsgd.sim.costs import ring
    from flashsgd.sim.costs_lowrank import split

    c = ClusterModel(**{**CLUSTERS.get("1gbe").__dict__, "flop_s": 1e-10})
    mats = ((64, 576), (64, 1), (10, 64))
    u, ps, qs, flops, nm = split(mats, 2)
    # (64, 1) stays dense (64 < 65 * 1 * 2); (64, 576) and (10, 64) send P: n r and Q: m r
    assert (u, ps, qs) == (64, 128 + 20, 1152 + 128)
    setup = CommSetup(gpus=8, cluster=c, matrices=mats, matrix_approximation_rank=2)
    want = sum(float(ring(4.0 * v, setup).total) for v in (u, ps, qs)) + flops * 1e-10 \
        + nm * (4 * c.gamma_s_per_byte + c.lowrank_s_per_elem)  # + the hook's measured work per element
    assert c.lowrank_s_per_elem > 0  # the preset's device class charges it
    assert float(exchange_cost("powersgd", 0.0, setup).total) == pytest.approx(want)
    assert float(exchange_cost("powersgd", 4e6, CommSetup(gpus=8, cluster=c)).bandwidth_s) < \
        float(exchange_cost("ring", 4e6, CommSetup(gpus=8, cluster=c)).bandwidth_s) / 100


# ------------------------------------------------------------------ per-flow limit -----------------

AI, BI, AE, BE = 1e-6, 1e-11, 5e-5, 8e-9  # intra 100 GB/s; inter 125 MB/s (1 Gbit/s) per node


def capped(flow_fraction=None, ranks_per_node=2):
    """4 nodes x 2 ranks; one flow carries at most ``flow_fraction`` of the node's link."""
    flow = None if flow_fraction is None else flow_fraction / BE / 1e9
    return ClusterModel("capped", ranks_per_node, Link(AI, 1 / BI / 1e9), Link(AE, 1 / BE / 1e9, flow),
                        gamma_s_per_byte=G)


def test_per_flow_limit_hand_values_ring_torus_hierarchical():
    """P = 8 on 4 nodes of 2, n bytes, one flow at most a quarter of the link (4 BE per byte).
    Flat ring: 1 flow per NIC, every one of its 14 steps sends n/8 at 4 BE:
        14 AE + 14 n/8 4 BE + 7/8 n G.
    torus2d 2x4 = hierarchical: in-node reduce-scatter and all-gather (n/2 each), 2 cross-node rings
    per node (one per local rank), each flow capped: max(2 BE, 4 BE) = 4 BE:
        2 AI + n BI + 6 AE + 6 n/8 4 BE + (1/2 + 3/8) n G.
    Without the cap the rings share the link: 1.75 n BE (ring) vs 6 n/8 2 BE = 1.5 n BE (torus)."""
    n = 64 * 2 ** 20
    quarter, free = CommSetup(8, capped(0.25), grid=(2, 4)), CommSetup(8, capped(None), grid=(2, 4))
    ring_q = 14 * AE + 14 * n / 8 * 4 * BE + 7 / 8 * n * G
    torus_q = 2 * AI + n * BI + 6 * AE + 6 * n / 8 * 4 * BE + (1 / 2 + 3 / 8) * n * G
    assert total("ring", n, quarter) == pytest.approx(ring_q, rel=1e-12)
    assert total("torus2d", n, quarter) == pytest.approx(torus_q, rel=1e-12)
    assert total("hierarchical", n, quarter) == pytest.approx(torus_q, rel=1e-12)
    assert total("ring", n, free) == pytest.approx(14 * AE + 1.75 * n * BE + 7 / 8 * n * G, rel=1e-12)
    assert total("torus2d", n, free) == pytest.approx(2 * AI + n * BI + 6 * AE + 1.5 * n * BE
                                                      + 7 / 8 * n * G, rel=1e-12)
    # the torus beats the ring by 3/7 of its bandwidth term with the cap, 6/7 without
    assert total("torus2d", n, quarter) / total("ring", n, quarter) == pytest.approx(0.43, abs=0.01)
    assert total("torus2d", n, free) / total("ring", n, free) == pytest.approx(0.86, abs=0.01)
    # a cap at or above the link's rate changes nothing
    assert total("torus2d", n, CommSetup(8, capped(1.0), grid=(2, 4))) == total("torus2d", n, free)


def test_per_flow_limit_sparse_flows():
    """gtopk's cross-node rounds: L = 2 flows per NIC, max(2 BE, 4 BE); topk's direct exchange:
    (P - L) L = 12 flows per NIC, max(12 BE, 4 BE) = 12 BE (the cap does not bind) until the cap
    is 1/16 of the link: max(12 BE, 16 BE) = 16 BE."""
    n = 4e6  # 1e6 fp32, density 0.01: k = 10,000 pairs, 80,000 bytes with int32 indices
    msg = 80_000.0
    for algo, fraction, beta in (("gtopk", 0.25, 4 * BE), ("gtopk", 1.0, 2 * BE),
                                 ("topk", 0.25, 12 * BE), ("topk", 1 / 16, 16 * BE)):
        base = exchange_cost(algo, n, CommSetup(8, capped(None), density=0.01))
        cap = exchange_cost(algo, n, CommSetup(8, capped(fraction), density=0.01))
        crossing = 2 if algo == "gtopk" else 1  # gtopk: rounds at distance 2 and 4 cross nodes
        unshared = (2 if algo == "gtopk" else 12) * BE
        assert float(cap.bandwidth_s - base.bandwidth_s) == pytest.approx(crossing * msg * (beta - unshared),
                                                                          rel=1e-9, abs=1e-15)
