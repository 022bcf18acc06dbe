"""The fabric beyond the NICs (flashsgd.sim.fabric): oversubscribed switch uplinks and placement.

Hand-computed bandwidth terms at small cases (1 GB/s node links, no latency), the exact flow
counts, the cluster-file keys and their errors, and the ABCI preset's fabric leaving its rings as
they were.
"""

import dataclasses
import doctest

import pytest

from flashsgd.sim import fabric as fabric_module
from flashsgd.sim.algorithms import exchange_cost
from flashsgd.sim.cluster_file import load_cluster, load_cluster_text, to_toml
from flashsgd.sim.costs import CommSetup
from flashsgd.sim.fabric import Fabric, uplink_flows
from flashsgd.sim.network import CLUSTERS, ClusterModel, Link, with_input
from flashsgd.sim.uncertainty import assumptions

NS_PER_BYTE = 1e-9  # 1 GB/s


def _cluster(per_node: int, fabric: Fabric = Fabric()) -> ClusterModel:
    """1 GB/s per node and direction, no latency, free reductions: bandwidth terms by hand."""
    return ClusterModel("hand", per_node, Link(0.0, 100.0), Link(0.0, 1.0), fabric=fabric)


def _bandwidth(algorithm: str, n_bytes: float, gpus: int, cluster: ClusterModel, density: float = 0.01) -> float:
    return float(exchange_cost(algorithm, n_bytes, CommSetup(gpus=gpus, cluster=cluster, density=density)).bandwidth_s)


def test_doctest():
    assert doctest.testmod(fabric_module).failed == 0


@pytest.mark.parametrize("placement,factor", [("ordered", 1.0), ("interleaved", 2.0)])
def test_flat_ring_on_two_switches_by_hand(placement, factor):
    # 4 nodes x 1 rank, 2 per switch, uplink = one node link (2:1). The ring's bandwidth term is
    # 2 (P-1)/P n b = 1.5 n b at 1 GB/s. Ordered: one hop leaves each switch per direction (u = 1,
    # u o / n = 1: the node link's pace); interleaved: both of a switch's nodes send across (u = 2:
    # each at half a node link).
    n = 1e6
    c = _cluster(1, Fabric(nodes_per_switch=2, oversubscription=2.0, placement=placement))
    assert _bandwidth("native", n, 4, c) == pytest.approx(1.5 * n * NS_PER_BYTE * factor)
    assert _bandwidth("native", n, 4, _cluster(1)) == pytest.approx(1.5 * n * NS_PER_BYTE)


def test_random_placement_is_the_busiest_uplink_over_seeded_shuffles():
    # 4 nodes on 2 switches: the three ways to split them give the ring 1, 2 and 1 flows through the
    # busiest uplink, 4/3 in expectation; 64 seeded draws land near it, the same every time.
    f = Fabric(nodes_per_switch=2, placement="random")
    u = uplink_flows(f, 4, 1, ("ring", 4, 1))
    assert 1.2 <= u <= 1.5 and u == uplink_flows(Fabric(2, 3.0, "random"), 4, 1, ("ring", 4, 1))
    # 64 nodes on 8 switches: the busiest uplink carries more than the mean switch's
    # n (N - n) / (N - 1) = 8 x 56 / 63 = 7.1 flows, and at most the 8 of every hop crossing
    big = uplink_flows(Fabric(nodes_per_switch=8, placement="random"), 64, 1, ("ring", 64, 1))
    assert 8 * 56 / 63 < big <= 8


def test_no_cost_within_one_switch_or_without_oversubscription_for_an_ordered_ring():
    n = 1e6
    one_switch = _cluster(1, Fabric(nodes_per_switch=4, oversubscription=10.0, placement="interleaved"))
    assert _bandwidth("native", n, 4, one_switch) == pytest.approx(1.5 * n * NS_PER_BYTE)
    blocking_but_ordered = _cluster(1, Fabric(nodes_per_switch=2, oversubscription=2.0))
    assert _bandwidth("native", n, 8, blocking_but_ordered) == pytest.approx(2 * 7 / 8 * n * NS_PER_BYTE)
    # an ordered ring only pays once o > n: u = 1 flow, u o / n = 3 / 2 at 3:1 with 2 per switch
    three = _cluster(1, Fabric(nodes_per_switch=2, oversubscription=3.0))
    assert _bandwidth("native", n, 4, three) == pytest.approx(1.5 * n * NS_PER_BYTE * 1.5)


def test_topk_all_to_all_shares_the_uplink_by_hand():
    # 4 nodes x 1 rank, density 0.01 of 1000 fp32: 3 messages of 80 B out of each node (NIC: 3
    # flows, 3 ns/B each). Uplink: u = n L^2 (N - n) = 4 flows at 2:1 with n = 2: u o / n = 4 ns/B.
    c = _cluster(1, Fabric(nodes_per_switch=2, oversubscription=2.0))
    assert _bandwidth("topk", 4000.0, 4, c) == pytest.approx(80 * 4 * NS_PER_BYTE)
    assert _bandwidth("topk", 4000.0, 4, _cluster(1)) == pytest.approx(80 * 3 * NS_PER_BYTE)
    interleaved = _cluster(1, Fabric(nodes_per_switch=2, oversubscription=2.0, placement="interleaved"))
    assert _bandwidth("topk", 4000.0, 4, interleaved) == pytest.approx(80 * 4 * NS_PER_BYTE)


@pytest.mark.parametrize("placement", ["ordered", "interleaved"])
def test_gtopk_butterfly_pays_in_the_round_that_crosses(placement):
    # 4 nodes x 1 rank: rounds at XOR distance 1 and 2, one message of k pairs each (80 B at
    # density 0.01 of 1000). Ordered: distance 1 stays in the switch, distance 2 sends both nodes
    # across (u = 2, 2 ns/B); interleaved: the reverse. Either way 1 + 2 message times.
    c = _cluster(1, Fabric(nodes_per_switch=2, oversubscription=2.0, placement=placement))
    assert _bandwidth("gtopk", 4000.0, 4, c) == pytest.approx(80 * 3 * NS_PER_BYTE)
    assert _bandwidth("gtopk", 4000.0, 4, _cluster(1)) == pytest.approx(80 * 2 * NS_PER_BYTE)


def test_flow_counts_by_hand():
    ordered = Fabric(nodes_per_switch=2, oversubscription=2.0)
    interleaved = dataclasses.replace(ordered, placement="interleaved")
    # 8 nodes x 2 ranks, hierarchical's cross-node rings (members 8, stride 2): 2 rings, each
    # leaving every switch once when ordered; every hop crosses when interleaved (4 switches of 2).
    assert uplink_flows(ordered, 16, 2, ("ring", 8, 2)) == 2.0
    assert uplink_flows(interleaved, 16, 2, ("ring", 8, 2)) == 4.0
    assert uplink_flows(ordered, 16, 2, ("ring", 2, 1)) == 0.0  # the ring within a node never leaves it
    # a torus column jumping 2 nodes (X = 4 ranks): every hop of the switch's 4 ranks crosses
    assert uplink_flows(ordered, 16, 2, ("ring", 4, 4)) == 4.0
    # a butterfly round 4 ranks apart: node distance 2, both nodes of a switch send 2 flows each
    assert uplink_flows(ordered, 16, 2, ("butterfly", 4, 16)) == 4.0
    assert uplink_flows(ordered, 16, 2, ("butterfly", 2, 16)) == 0.0  # node distance 1: within the switch
    # a binomial round 4 ranks apart: only ranks 4 and 12 send (to 0 and 8), one flow per uplink
    assert uplink_flows(ordered, 16, 2, ("tree", 4, 0)) == 1.0
    # 7 nodes x 1 rank, 3 per switch: the fold sends nodes 4, 5, 6 to 0, 1, 2, all into switch 0
    three = Fabric(nodes_per_switch=3)
    assert uplink_flows(three, 7, 1, ("fold", 4, 0)) == 3.0
    # the butterfly over the 4 ranks below P' = 4: only 1 <-> 3 crosses (nodes 4-6 sit it out)
    assert uplink_flows(three, 7, 1, ("butterfly", 2, 4)) == 1.0


def _brute(nodes_per_switch, placement, gpus, per_node, pairs):
    """Flows across the busiest uplink, by brute force over explicit (sender, receiver) rank pairs."""
    nodes = gpus // per_node
    switches = -(-nodes // nodes_per_switch)
    where = [(r // per_node) // nodes_per_switch if placement == "ordered" else (r // per_node) % switches
             for r in range(gpus)]
    count = {}
    for a, b in pairs:
        if a // per_node != b // per_node and where[a] != where[b]:
            count[("out", where[a])] = count.get(("out", where[a]), 0) + 1
            count[("in", where[b])] = count.get(("in", where[b]), 0) + 1
    return float(max(count.values(), default=0))


@pytest.mark.parametrize("placement", ["ordered", "interleaved"])
@pytest.mark.parametrize("gpus,per_node,per_switch", [(8, 1, 2), (12, 2, 2), (14, 2, 3), (24, 4, 2), (20, 1, 3)])
def test_flow_counts_match_brute_force_for_every_pattern(placement, gpus, per_node, per_switch):
    fabric = Fabric(nodes_per_switch=per_switch, placement=placement)
    p2 = 1 << (gpus.bit_length() - 1)
    cases = {}
    for members in (d for d in range(2, gpus + 1) if gpus % d == 0):
        for stride in (s for s in range(1, gpus // members + 1) if gpus % (members * s) == 0):
            # rings of `members` ranks `stride` apart: block b holds ranks with (r // stride) // members = b
            pairs = []
            for base in range(gpus):
                if (base // stride) % members == 0:
                    ring = [base + k * stride for k in range(members)]
                    pairs += list(zip(ring, ring[1:] + ring[:1]))
            cases[("ring", members, stride)] = pairs
    d = 1
    while d < p2:
        cases[("butterfly", d, p2)] = [(r, r ^ d) for r in range(p2)]
        cases[("tree", d, 0)] = [(r, r - d) for r in range(gpus) if r % (2 * d) == d]
        d *= 2
    if p2 < gpus:
        cases[("fold", p2, 0)] = [(r, r - p2) for r in range(p2, gpus)]
    for pattern, pairs in cases.items():
        assert uplink_flows(fabric, gpus, per_node, pattern) == _brute(per_switch, placement, gpus, per_node, pairs), \
            pattern


def test_abci_fabric_spares_its_node_rings_and_trees_at_every_size():
    abci = CLUSTERS.get("abci")
    flat = dataclasses.replace(abci, fabric=Fabric())
    for gpus in (1088, 2048, 4096):
        for algorithm in ("native", "hierarchical", "binomial", "gtopk_tree"):
            a = exchange_cost(algorithm, 100e6, CommSetup(gpus=gpus, cluster=abci, density=0.01))
            b = exchange_cost(algorithm, 100e6, CommSetup(gpus=gpus, cluster=flat, density=0.01))
            assert float(a.total) == pytest.approx(float(b.total)), (algorithm, gpus)
    # a 64 x 64 torus at 4096: its columns jump 16 nodes, so every hop of a rack's 64 columns
    # crosses to another rack: u o / n = 64 x 3 / 34 = 5.6 node links against the NIC's 4 flows
    grid = CommSetup(gpus=4096, cluster=abci, grid=(64, 64))
    assert float(exchange_cost("torus2d", 100e6, grid).total) > \
        float(exchange_cost("torus2d", 100e6, CommSetup(gpus=4096, cluster=flat, grid=(64, 64))).total)


def test_fabric_validation_names_the_valid_values():
    with pytest.raises(ValueError, match=r"nodes_per_switch must be an int >= 1 or None"):
        Fabric(nodes_per_switch=0)
    with pytest.raises(ValueError, match=r"oversubscription must be a number >= 1 \(1: non-blocking; 3 for 3:1\)"):
        Fabric(nodes_per_switch=4, oversubscription=0.5)
    with pytest.raises(ValueError, match=r"placement must be one of ordered, interleaved, random, got 'rack'"):
        Fabric(nodes_per_switch=4, placement="rack")


FABRIC = """
[fabric]
nodes_per_switch = 8
oversubscription = 2.0
oversubscription_range = [1.0, 4.0]
placement = "random"
"""


def _file(extra: str) -> str:
    return to_toml(load_cluster("1gbe")) + extra


def test_cluster_file_fabric_round_trip_and_range():
    c = load_cluster_text(_file(FABRIC), "lab.toml")
    assert c.fabric == Fabric(nodes_per_switch=8, oversubscription=2.0, placement="random")
    assert c.assumed["fabric.oversubscription"] == (1.0, 4.0)
    back = load_cluster_text(to_toml(c), "round trip")
    assert back.fabric == c.fabric and back.assumed["fabric.oversubscription"] == (1.0, 4.0)
    assert "fabric: 8 nodes per switch, uplinks 2:1 oversubscribed, ranks random" in c.describe()
    lines = [a.describe() for a in assumptions(c, 100.0, None, "fp32")]
    assert "switch uplink oversubscription 2 to 1 (1-4)" in lines
    # without [fabric]: one non-blocking switch, nothing written
    plain = load_cluster_text(_file(""), "plain.toml")
    assert plain.fabric == Fabric() and "[fabric]" not in to_toml(plain)


@pytest.mark.parametrize("table,message", [
    ("[fabric]\noversubscription = 2.0\n", r"\[fabric\] needs fabric.nodes_per_switch"),
    ("[fabric]\nnodes_per_switch = 4\nplacement = \"rack\"\n",
     r"fabric.placement must be one of ordered, interleaved, random, got 'rack'"),
    ("[fabric]\nnodes_per_switch = 4\noversubscription = 0.5\n",
     r"fabric.oversubscription must be in \[1, 10000\] \(1: non-blocking, 3 for 3:1\), got 0.5"),
    ("[fabric]\nnodes_per_switch = 4\noversubscription = 2.0\noversubscription_range = [0.5, 3.0]\n",
     r"fabric.oversubscription_range must be in \[1, 10000\] \(1: non-blocking, 3 for 3:1\), got 0.5"),
    ("[fabric]\nnodes_per_switch = 4\noversubscription = 2.0\noversubscription_range = [3.0, 4.0]\n",
     r"fabric.oversubscription_range = \[3, 4\] must hold fabric.oversubscription = 2"),
    ("[fabric]\nnodes_per_switch = 0\n", r"fabric.nodes_per_switch must be an integer in \[1, 1,000,000\], got 0"),
    ("[fabric]\n", r"\[fabric\] needs fabric.nodes_per_switch"),
    ("[fabric]\nnodes_per_switch = 4\nuplink_gbit = 10.0\n", r"unknown key\(s\) fabric.uplink_gbit; valid: "),
])
def test_cluster_file_fabric_errors(table, message):
    with pytest.raises(ValueError, match=message):
        load_cluster_text(_file("\n" + table), "lab.toml")


def test_abci_fabric_leaves_its_rings_and_slows_its_all_to_all():
    abci = CLUSTERS.get("abci")
    assert abci.fabric == Fabric(nodes_per_switch=34, oversubscription=3.0, placement="ordered")
    flat = dataclasses.replace(abci, fabric=Fabric())
    for algorithm in ("native", "hierarchical", "torus2d"):
        with_fabric = CommSetup(gpus=1088, cluster=abci)
        without = CommSetup(gpus=1088, cluster=flat)
        assert float(exchange_cost(algorithm, 100e6, with_fabric).total) == \
            pytest.approx(float(exchange_cost(algorithm, 100e6, without).total))
    # Top-k's direct exchange at 1088 GPUs: u = n L^2 (N - n) = 34 x 16 x 238 flows through an uplink
    # of 34 node links / 3, i.e. 16 x 238 x 3 = 11,424 node links' worth against the NIC's (P - L) L
    # = 4,336 flows: the inter level 11,424 / 4,336 = 2.63x slower.
    slow = float(exchange_cost("topk", 100e6, CommSetup(gpus=1088, cluster=abci)).bandwidth_s)
    fast = float(exchange_cost("topk", 100e6, CommSetup(gpus=1088, cluster=flat)).bandwidth_s)
    assert slow / fast == pytest.approx(16 * 238 * 3 / (1084 * 4), rel=1e-6)


def test_oversubscription_is_an_input_the_ranges_can_vary():
    c = load_cluster_text(_file(FABRIC), "lab.toml")
    assert with_input(c, "fabric.oversubscription", 4.0).fabric.oversubscription == 4.0
    # the ends of its range move an interleaved ring across the two switches of 16 nodes: o / n x u
    ring = [float(exchange_cost("native", 1e6, CommSetup(gpus=16, cluster=with_input(c, "fabric.oversubscription", o))).total)
            for o in (1.0, 4.0)]
    assert ring[1] > ring[0]


def test_a_model_ranges_oversubscription_only_with_a_fabric_and_from_1():
    link = Link(0.0, 1.0)
    with pytest.raises(ValueError, match=r"assumed\['fabric.oversubscription'\]: the cluster has no fabric"):
        ClusterModel("x", 1, link, link, assumed={"fabric.oversubscription": (1.0, 3.0)})
    with pytest.raises(ValueError, match=r"assumed\['fabric.oversubscription'\] low must be >= 1"):
        ClusterModel("x", 1, link, link, fabric=Fabric(4), assumed={"fabric.oversubscription": (0.5, 3.0)})


def test_rounds_below_l_apart_cross_nodes_when_l_is_not_a_multiple_of_twice_the_distance():
    """Recursive doubling over 12 ranks, 3 per node (1 GB/s node links, 100 GB/s inside, by hand):
    the fold (8 -> 0 .. 11 -> 3) sends 3 flows per node twice, 3 ns/B x 2; below L the XOR pairs
    straddle nodes: distance 1 only 2 <-> 3 (one flow, 1 ns/B), distance 2 all three of node 1's
    ranks (3 <-> 1, 4 <-> 6, 5 <-> 7: 3 ns/B); distance 4 is across nodes (3 ns/B). With 4 ranks per
    node (a multiple of 2 and 4) distances 1 and 2 stay inside the node."""
    assert fabric_module.node_flows(12, 3, ("butterfly", 1, 8)) == 1
    assert fabric_module.node_flows(12, 3, ("butterfly", 2, 8)) == 3
    assert fabric_module.node_flows(16, 4, ("butterfly", 2, 16)) == 0
    assert fabric_module.node_flows(6, 6, ("butterfly", 2, 4)) == 0  # one node holds them all
    n = 1e6
    assert _bandwidth("recursive_doubling", n, 12, _cluster(3)) == pytest.approx(n * (6 + 1 + 3 + 3) * NS_PER_BYTE)
    inside = 2 * n * 0.01 * NS_PER_BYTE  # distances 1 and 2 at 100 GB/s
    assert _bandwidth("recursive_doubling", n, 16, _cluster(4)) == pytest.approx(inside + n * 4 * 2 * NS_PER_BYTE)


def test_a_binomial_round_below_l_apart_crosses_once_per_node():
    """Binomial over 12 ranks, 3 per node: at distance 1 the senders 1, 3, 5, ... go to 0, 2, 4, ...;
    3 -> 2 and 9 -> 8 leave their nodes (one sender per node at most), so the round is the
    network's; at distance 2 the senders 2, 6, 10 cross to 0, 4, 8, one per node as well."""
    assert fabric_module.node_flows(12, 3, ("tree", 1, 0)) == 1
    assert fabric_module.node_flows(12, 3, ("tree", 2, 0)) == 1
    assert fabric_module.node_flows(16, 4, ("tree", 2, 0)) == 0  # a multiple of 2 x 2: inside the nodes
    n = 1e6  # each round reduces then broadcasts: 2 steps of n bytes, 1 ns/B across nodes
    assert _bandwidth("binomial", n, 12, _cluster(3)) == pytest.approx(4 * 2 * n * NS_PER_BYTE)
    assert _bandwidth("binomial", n, 16, _cluster(4)) == pytest.approx(2 * 2 * n * (1 + 0.01) * NS_PER_BYTE)
