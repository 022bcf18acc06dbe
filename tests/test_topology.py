"""Topology: node layout, grid validation and subgroup creation on real Gloo process groups."""

import subprocess
import sys

import pytest
import torch
import torch.distributed as dist

from flashsgd.comm.topology import get_topology, parse_grid, valid_grids


def test_parse_grid_valid_and_degenerate():
    assert parse_grid("2x4", 8) == (2, 4)
    assert parse_grid((8, 1), 8) == (8, 1)
    assert parse_grid(None, 8, default_x=4) == (4, 2)
    assert parse_grid(None, 7, default_x=7) == (7, 1)  # prime: degenerate grid
    assert parse_grid(None, 1) == (1, 1)
    assert valid_grids(6) == ["1x6", "2x3", "3x2", "6x1"]


@pytest.mark.parametrize("grid, world, fragment", [
    ("3x2", 8, "grid 3x2 has 6 ranks but the world size is 8; valid grids: 1x8, 2x4, 4x2, 8x1"),
    ("2by4", 8, "grid must look like 'XxY'"),
    ((0, 8), 8, "grid 0x8 has 0 ranks"),
])
def test_parse_grid_errors_name_valid_grids(grid, world, fragment):
    with pytest.raises(ValueError, match=fragment.replace("(", r"\(")):
        parse_grid(grid, world)


def test_parse_grid_imports_without_torch():
    # `flashsgd simulate` parses grids and must stay torch-free.
    code = "import flashsgd.comm.topology, sys; assert 'torch' not in sys.modules, 'torch imported'"
    subprocess.run([sys.executable, "-c", code], check=True)


def _topology_facts(ranks_per_node, grid):
    topo = get_topology(ranks_per_node=ranks_per_node, grid=grid)
    assert get_topology(ranks_per_node=ranks_per_node, grid=grid) is topo  # cached, not rebuilt
    facts = {}
    for name in ("row", "col", "node", "cross"):
        members, group = getattr(topo, f"{name}_ranks"), getattr(topo, f"{name}_group")
        t = torch.tensor([float(dist.get_rank() + 1)])
        if group is not None:
            dist.all_reduce(t, group=group)
        facts[name] = (members, t.item())
    return topo.grid, topo.num_nodes, facts


@pytest.mark.parametrize("world, ranks_per_node, grid", [
    (8, 4, "4x2"), (6, 3, "2x3"), (6, 2, None), (5, None, None), (1, None, None),
])
def test_groups_reduce_over_their_members(run_ranks, world, ranks_per_node, grid):
    results = run_ranks(_topology_facts, world, ranks_per_node, grid)
    for rank, (xy, num_nodes, facts) in enumerate(results):
        X, Y = xy
        L = ranks_per_node or world
        assert X * Y == world and num_nodes == world // L
        assert facts["row"][0] == tuple(range(rank // X * X, rank // X * X + X))
        assert facts["col"][0] == tuple(range(rank % X, world, X))
        assert facts["node"][0] == tuple(range(rank // L * L, rank // L * L + L))
        assert facts["cross"][0] == tuple(range(rank % L, world, L))
        for members, reduced in facts.values():
            assert reduced == sum(m + 1 for m in members)  # the group reduced exactly its members


def _bad_ranks_per_node():
    get_topology(ranks_per_node=3)


def test_ranks_per_node_must_divide_world(run_ranks):
    with pytest.raises(Exception, match=r"ranks_per_node=3 \(from argument\) must divide the world size 4; valid: 1, 2, 4"):
        run_ranks(_bad_ranks_per_node, 4)


def _shutdown_forgets_groups():
    from flashsgd import launch
    from flashsgd.comm import dense, topology

    topo = get_topology(ranks_per_node=2)
    dense.torus2d(torch.ones(5), topo)  # builds the duplex twin groups too
    assert topology._CACHE and dense._DUPLEX
    launch.shutdown()
    return len(topology._CACHE), len(dense._DUPLEX), dist.is_initialized()


def test_shutdown_drops_cached_groups_before_destroying(run_ranks):
    # Cached subgroups outliving their process group aborted ~1 exit in 3 under torchrun.
    assert run_ranks(_shutdown_forgets_groups, 4) == [(0, 0, False)] * 4


def _timeouts():
    world_default = get_topology(ranks_per_node=2).timeout_s
    topo = get_topology(ranks_per_node=2, timeout_s=7)
    backend = topo.node_group._get_backend(torch.device("cpu"))  # no public getter in torch 2.13
    try:
        get_topology(ranks_per_node=2, timeout_s=float("inf"))
        bad = "no error"
    except ValueError as exc:
        bad = str(exc)
    return world_default, topo.timeout_s, backend.options._timeout.total_seconds(), bad


def test_timeout_defaults_to_the_world_and_reaches_subgroups(run_ranks):
    # new_group() without timeout= gives a subgroup torch's 30 min default, not the world's.
    for default, chosen, subgroup, bad in run_ranks(_timeouts, 4, timeout_s=50):
        assert (default, chosen, subgroup) == (50.0, 7.0, 7.0)
        assert bad == "timeout_s must be a finite number of seconds > 0, got inf"
