"""World -> nodes x local ranks, and a 2D grid X x Y, with every subgroup created once on every rank.

Layout (row-major, matching how torchrun numbers ranks: node-major, local rank minor)::

    rank r  ->  node r // L, local rank r % L          (L = ranks per node, N = W / L nodes)
    rank r  ->  grid column x = r % X, grid row y = r // X   (X * Y = W)

A *row* is X consecutive ranks (the "horizontal" direction of Sony's 2D-Torus); with the default
X = L a row is a node, so torus2d's reduce-scatter and all-gather stay inside the node and only the
1/X shard crosses the network. A *column* is the Y ranks sharing x. ``cross`` groups join the ranks
that share a local rank across nodes (the inter-node stage of hierarchical all-reduce).

torch.distributed requires every rank to call ``new_group`` for every group, in the same order,
even for groups it is not in. :func:`get_topology` does that once per
(world, L, grid, timeout) and caches the result. Groups of one rank are ``None`` (nothing to communicate), a
group equal to the whole world is the default group, and groups with the same members are shared.

Deadline: ``Topology.timeout_s`` bounds every wait of the algorithms that run over it (each
send/receive of :mod:`flashsgd.comm.dense`'s rings) and is the timeout of its subgroups
(``new_group(timeout=...)``; without it a subgroup gets torch's 30 min default, not the world's).
``None`` takes the default process group's timeout (``init_process_group(timeout=...)``).

Example::

    >>> topo = get_topology(ranks_per_node=4, grid="4x2")   # on 8 ranks: 2 nodes of 4
    >>> topo.row_ranks, topo.col_ranks                        # on rank 5
    ((4, 5, 6, 7), (1, 5))
"""

from __future__ import annotations

import atexit
import datetime
import math
import os
import socket
from dataclasses import dataclass
from typing import TYPE_CHECKING

from flashsgd.exchanges import check_timeout_s  # noqa: F401 (one check, the catalog's)
from flashsgd.fmt import plural

if TYPE_CHECKING:  # torch is imported inside the functions that need it: parse_grid stays torch-free
    from torch.distributed import ProcessGroup

_CACHE: dict[tuple, "Topology"] = {}
_RESET_HOOKS: list = []  # other caches of process groups (e.g. dense's duplex groups) register here


def reset() -> None:
    """Forget every cached topology and subgroup; call before ``destroy_process_group``.

    Process-group objects still referenced from module caches outlive the group they belong to and
    are destructed at interpreter exit, after torch.distributed's own teardown, which can abort the
    process ("terminate called without an active exception", seen about 1 exit in 3 under torchrun).
    """
    _CACHE.clear()
    for hook in _RESET_HOOKS:
        hook()


# A script that ends with torch's own ``dist.destroy_process_group()`` (not :func:`flashsgd.launch.
# shutdown`) would leave the cached subgroups to interpreter finalization: drop them at exit, while
# the interpreter is still whole (atexit runs before module teardown).
atexit.register(reset)


@dataclass(frozen=True, eq=False)
class Topology:
    """This rank's place in the world, the node layout and the 2D grid, with their process groups."""

    world_size: int
    rank: int
    ranks_per_node: int          # L
    grid: tuple[int, int]        # (X, Y): X ranks per row, Y rows
    timeout_s: float             # deadline of every wait on a peer, and of the subgroups, seconds
    node_ranks: tuple[int, ...]  # the L ranks of this rank's node
    cross_ranks: tuple[int, ...]  # the N ranks with this rank's local rank, one per node
    row_ranks: tuple[int, ...]   # the X ranks of this rank's grid row
    col_ranks: tuple[int, ...]   # the Y ranks of this rank's grid column
    node_group: ProcessGroup | None
    cross_group: ProcessGroup | None
    row_group: ProcessGroup | None
    col_group: ProcessGroup | None

    @property
    def num_nodes(self) -> int:
        return self.world_size // self.ranks_per_node

    @property
    def local_rank(self) -> int:
        return self.rank % self.ranks_per_node

    @property
    def node(self) -> int:
        return self.rank // self.ranks_per_node

    def describe(self) -> str:
        x, y = self.grid
        return (f"world {self.world_size} = {plural(self.num_nodes, 'node')} x "
                f"{plural(self.ranks_per_node, 'rank')}/node, grid {x}x{y}, timeout {self.timeout_s:g} s")


def divisors(n: int) -> list[int]:
    return [d for d in range(1, n + 1) if n % d == 0]


def valid_grids(world_size: int) -> list[str]:
    """All ``XxY`` strings with X * Y == world_size."""
    return [f"{x}x{world_size // x}" for x in divisors(world_size)]


def parse_grid(grid: str | tuple[int, int] | None, world_size: int,
               default_x: int | None = None) -> tuple[int, int]:
    """Parse and validate a grid ``"XxY"`` (or a tuple) against the world size.

    ``None`` gives ``(default_x, W / default_x)``; a world size with no non-trivial factorization
    (a prime, or 1) still has the degenerate grids ``Wx1`` and ``1xW``.
    """
    if grid is None:
        x = default_x or world_size
        return parse_grid((x, world_size // x) if world_size % x == 0 else (world_size, 1),
                          world_size)
    if isinstance(grid, str):
        parts = grid.lower().split("x")
        if len(parts) != 2 or not all(p.strip().isdigit() for p in parts):
            raise ValueError(f"grid must look like 'XxY' (e.g. '2x4'), got {grid!r}; "
                             f"valid grids for world size {world_size}: {', '.join(valid_grids(world_size))}")
        grid = (int(parts[0]), int(parts[1]))
    x, y = (int(v) for v in grid)
    if x < 1 or y < 1 or x * y != world_size:
        raise ValueError(f"grid {x}x{y} has {x * y} ranks but the world size is {world_size}; "
                         f"valid grids: {', '.join(valid_grids(world_size))}")
    return x, y


def default_timeout_s() -> float:
    """The default process group's timeout in seconds (``init_process_group(timeout=...)``).

    torch 2.13 has no public getter for a group's timeout: ``init_process_group`` stores it only in
    the backend's options (``ProcessGroupGloo.Options._timeout``, likewise for NCCL), so it is read
    from there; if a future torch moves it, torch's documented default
    (``torch.distributed.default_pg_timeout``, 30 min) is returned instead.
    """
    import torch
    import torch.distributed as dist

    device = torch.device("cuda" if "nccl" in str(dist.get_backend()) else "cpu")
    try:
        timeout = dist.group.WORLD._get_backend(device).options._timeout
    except (AttributeError, RuntimeError):
        timeout = dist.default_pg_timeout
    return timeout.total_seconds()


def _check_ranks_per_node(ranks_per_node: int, world_size: int, source: str) -> int:
    if not isinstance(ranks_per_node, int) or ranks_per_node < 1 or world_size % ranks_per_node:
        raise ValueError(f"ranks_per_node={ranks_per_node!r} (from {source}) must divide the world "
                         f"size {world_size}; valid: {', '.join(map(str, divisors(world_size)))}")
    return ranks_per_node


def detect_ranks_per_node(world_size: int) -> tuple[int, str]:
    """Ranks per node from ``FLASHSGD_RANKS_PER_NODE``, torchrun's ``LOCAL_WORLD_SIZE``, or hostnames.

    Returns ``(L, source)``. The hostname fallback all-gathers each rank's hostname and requires
    the node-major layout torchrun produces (equal, contiguous blocks of ranks per host).
    """
    for var in ("FLASHSGD_RANKS_PER_NODE", "LOCAL_WORLD_SIZE"):
        if os.environ.get(var, "").strip():
            value = os.environ[var]
            if not value.isdigit():
                raise ValueError(f"{var}={value!r} must be a positive integer")
            return _check_ranks_per_node(int(value), world_size, var), var
    import torch.distributed as dist

    hosts: list[str] = [""] * world_size
    dist.all_gather_object(hosts, socket.gethostname())
    per_host = hosts.count(hosts[0])
    blocks = [hosts[i:i + per_host] for i in range(0, world_size, per_host)]
    if world_size % per_host or any(len(set(b)) != 1 for b in blocks) or \
            len({b[0] for b in blocks}) != len(blocks):
        raise ValueError(f"ranks are not laid out in equal contiguous blocks per host ({hosts}); "
                         "pass ranks_per_node explicitly or set FLASHSGD_RANKS_PER_NODE")
    return per_host, "hostnames"


def _make_groups(member_lists: list[tuple[int, ...]], made: dict,
                 timeout_s: float) -> list[ProcessGroup | None]:
    import torch.distributed as dist

    groups = []
    for members in member_lists:
        if len(members) == 1:
            groups.append(None)
        elif len(members) == dist.get_world_size():
            groups.append(dist.group.WORLD)
        else:
            if members not in made:
                made[members] = dist.new_group(list(members),
                                               timeout=datetime.timedelta(seconds=timeout_s))
            groups.append(made[members])
    return groups


def get_topology(ranks_per_node: int | None = None, grid: str | tuple[int, int] | None = None,
                 timeout_s: float | None = None) -> Topology:
    """Build (once) and return this rank's :class:`Topology` over the default process group.

    Args:
        ranks_per_node: L, ranks per node; ``None`` detects it (see :func:`detect_ranks_per_node`).
            Set it to emulate a multi-node layout on one machine.
        grid: ``"XxY"`` or ``(X, Y)`` with X * Y = W; ``None`` gives X = L.
        timeout_s: deadline of every wait on a peer in the algorithms, and timeout of the
            subgroups, in seconds; ``None``: the default process group's timeout.

    Must be called by every rank with the same arguments (it creates process groups).
    """
    import torch.distributed as dist

    if not dist.is_initialized():
        raise RuntimeError("get_topology() needs an initialized default process group "
                           "(torch.distributed.init_process_group, torchrun, or flashsgd.launch)")
    timeout_s = default_timeout_s() if timeout_s is None else check_timeout_s(timeout_s)
    world, rank = dist.get_world_size(), dist.get_rank()
    if ranks_per_node is None:
        ranks_per_node, _ = detect_ranks_per_node(world)
    else:
        _check_ranks_per_node(ranks_per_node, world, "argument")
    xy = parse_grid(grid, world, default_x=ranks_per_node)
    key = (dist.group.WORLD, ranks_per_node, xy, timeout_s)
    if key in _CACHE:
        return _CACHE[key]
    L, (X, Y) = ranks_per_node, xy
    N = world // L
    nodes = [tuple(range(n * L, (n + 1) * L)) for n in range(N)]
    crosses = [tuple(range(l, world, L)) for l in range(L)]
    rows = [tuple(range(y * X, (y + 1) * X)) for y in range(Y)]
    cols = [tuple(range(x, world, X)) for x in range(X)]
    made: dict = {}
    # Same order on every rank: rows, columns, nodes, cross-node.
    row_groups = _make_groups(rows, made, timeout_s)
    col_groups = _make_groups(cols, made, timeout_s)
    node_groups = _make_groups(nodes, made, timeout_s)
    cross_groups = _make_groups(crosses, made, timeout_s)
    topo = Topology(
        world_size=world, rank=rank, ranks_per_node=L, grid=(X, Y), timeout_s=timeout_s,
        node_ranks=nodes[rank // L], cross_ranks=crosses[rank % L],
        row_ranks=rows[rank // X], col_ranks=cols[rank % X],
        node_group=node_groups[rank // L], cross_group=cross_groups[rank % L],
        row_group=row_groups[rank // X], col_group=col_groups[rank % X],
    )
    _CACHE[key] = topo
    return topo
