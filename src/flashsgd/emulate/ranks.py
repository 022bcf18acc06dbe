"""Start a command as the ranks of a job on an emulated cluster, one process per rank.

Each rank runs ``ip netns exec <node namespace> <command>`` with torchrun's environment (``RANK``,
``WORLD_SIZE``, ``MASTER_ADDR`` = node 0's address, ``MASTER_PORT``, ``LOCAL_RANK``,
``LOCAL_WORLD_SIZE``, ``GROUP_RANK``) and ``GLOO_SOCKET_IFNAME`` = the node's veth, so
:func:`flashsgd.launch.run` inside the command joins the job exactly as under torchrun. Ranks are
numbered node-major (rank = node * L + local rank), as torchrun numbers them.

Algorithm (:func:`run_ranks`):

1. Start the rendezvous store in node 0's namespace (:mod:`flashsgd.emulate.store`), then W
   processes, each in its node's namespace and its own session (so it can be killed with
   everything it started), output to ``<log_dir>/rank<r>.log``.
2. Poll: all exit 0 -> done. One exits non-zero -> give the others a short grace, kill them, raise
   naming the rank with the tail of its log. Deadline passed -> kill all, raise naming the ranks.

Example::

    >>> with emulated_cluster(spec) as cluster:                      # doctest: +SKIP
    ...     run_ranks(cluster, [sys.executable, "-m", "flashsgd", "bench", "allreduce"], log_dir)
"""

from __future__ import annotations

import os
import re
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import Callable

from flashsgd.emulate.netns import EmulatedCluster
from flashsgd.launch_failures import lost_connections

MASTER_PORT = 29500  # a fresh namespace has every port free
FLOW_ENV = "FLASHSGD_EMULATED_FLOW_BPS"
GRACE_S = 3.0


class RankError(RuntimeError):
    """A rank of the emulated job failed or timed out; the message names it and shows its log."""


def rank_env(cluster: EmulatedCluster, rank: int, port: int = MASTER_PORT) -> dict[str, str]:
    """Environment of ``rank`` (torchrun's variables plus the node's Gloo interface)."""
    spec = cluster.spec
    node, local = divmod(rank, spec.ranks_per_node)
    return {
        "RANK": str(rank), "WORLD_SIZE": str(spec.world_size),
        "MASTER_ADDR": cluster.node_ip[0], "MASTER_PORT": str(port),
        "LOCAL_RANK": str(local), "LOCAL_WORLD_SIZE": str(spec.ranks_per_node),
        "GROUP_RANK": str(node), "NODE_RANK": str(node),
        "GLOO_SOCKET_IFNAME": cluster.ifname,
        # the store is hosted by flashsgd.emulate.store (as torchrun's agent would), not by rank 0
        "TORCHELASTIC_USE_AGENT_STORE": "True",
        # W ranks share this machine's cores: one intra-op thread each.
        "OMP_NUM_THREADS": "1",
        "PYTHONFAULTHANDLER": "1",  # a native abort in a rank prints its Python stack to the log
        "FLASHSGD_EMULATED": f"{spec.nodes}x{spec.ranks_per_node}@{spec.rate_bps}bit",
        # the per-flow cap, if any: the probe then counts the flows each node sent on
        **({FLOW_ENV: str(spec.flow_rate_bps)} if spec.flow_rate_bps is not None else {}),
    }


def _tail(path: Path, chars: int = 3000) -> str:
    try:
        return path.read_text(errors="replace")[-chars:]
    except OSError:
        return "(no log)"


def _kill(procs: list[subprocess.Popen]) -> None:
    for p in procs:
        if p.poll() is None:
            try:
                os.killpg(p.pid, signal.SIGKILL)  # the rank's own session: it and its children
            except ProcessLookupError:
                pass
    for p in procs:
        try:
            p.wait(timeout=10)
        except subprocess.TimeoutExpired:
            pass


PEER_TIMEOUT = re.compile(r"rank \d+: (?:no data from peer rank (\d+)|peer rank (\d+) did not receive)")
"""The wait a rank timed out on, as :class:`flashsgd.comm.errors.PeerTimeout` words it."""


def waited_for(log: Path) -> int | None:
    """The peer rank whose data a failed rank's log says it timed out waiting for (None: none named:
    it died, or failed on its own, or in a collective that names no peer)."""
    try:
        found = PEER_TIMEOUT.search(log.read_text(errors="replace"))
    except OSError:
        return None
    return int(found.group(1) or found.group(2)) if found else None


def run_ranks(cluster: EmulatedCluster, command: list[str], log_dir: str | Path, *,
              timeout_s: float = 600.0, port: int = MASTER_PORT,
              env: dict[str, str] | None = None, poll: Callable[[], None] | None = None) -> float:
    """Run ``command`` as every rank of ``cluster``; returns the wall time in seconds.

    Args:
        cluster: a built cluster (:func:`flashsgd.emulate.netns.build`).
        command: argv run by each rank (e.g. ``[python, "-m", "flashsgd", "bench", ...]``).
        log_dir: where ``rank<r>.log`` files go.
        timeout_s: deadline for the whole job.
        env: extra variables for every rank.
        poll: called about every 50 ms while the ranks run (e.g. to advance a progress bar).

    Raises:
        RankError: a rank exited non-zero (its log tail is included) or the deadline passed.
    """
    if timeout_s <= 0:
        raise ValueError(f"timeout_s must be > 0, got {timeout_s!r}")
    log_dir = Path(log_dir)
    log_dir.mkdir(parents=True, exist_ok=True)
    spec = cluster.spec
    procs: list[subprocess.Popen] = []
    logs: list[Path] = []
    start = time.monotonic()
    store = None
    try:
        # Step 1: the store (kept apart from the ranks), then one process per rank in its node
        with open(log_dir / "store.log", "wb") as log:
            store = subprocess.Popen(
                ["ip", "netns", "exec", cluster.node_ns[0], sys.executable, "-m", "flashsgd.emulate.store",
                 cluster.node_ip[0], str(port)], stdout=log, stderr=subprocess.STDOUT,
                stdin=subprocess.DEVNULL, start_new_session=True)
        for rank in range(spec.world_size):
            ns = cluster.node_ns[rank // spec.ranks_per_node]
            logs.append(log_dir / f"rank{rank}.log")
            with open(logs[-1], "wb") as log:
                procs.append(subprocess.Popen(
                    ["ip", "netns", "exec", ns, *command], stdout=log, stderr=subprocess.STDOUT,
                    stdin=subprocess.DEVNULL, env={**os.environ, **(env or {}), **rank_env(cluster, rank, port)},
                    start_new_session=True))
        # Step 2: wait for all, fail fast on the first failure, never past the deadline
        deadline = start + timeout_s
        while True:
            if store.poll() is not None:
                raise RankError(f"the rendezvous store exited with code {store.returncode}: "
                                f"{_tail(log_dir / 'store.log')}")
            codes = [p.poll() for p in procs]
            failed = [r for r, c in enumerate(codes) if c not in (None, 0)]
            if failed:
                grace = time.monotonic() + GRACE_S
                while time.monotonic() < grace and any(p.poll() is None for p in procs):
                    time.sleep(0.05)
                codes = [p.poll() for p in procs]
                failed = [r for r, c in enumerate(codes) if c not in (None, 0)]
                r = failed[0]
                cut = lost_connections({f: waited_for(logs[f]) for f in failed}, spec.ranks_per_node)
                raise RankError((f"{cut}; " if cut else "")
                                + f"rank {r} (node {r // spec.ranks_per_node}) exited with code "
                                f"{codes[r]}; its log {logs[r]} ends with:\n{_tail(logs[r])}")
            if all(c == 0 for c in codes):
                return time.monotonic() - start
            if time.monotonic() > deadline:
                waiting = [r for r, c in enumerate(codes) if c is None]
                raise RankError(f"timed out after {timeout_s:.0f} s waiting for ranks {waiting}; "
                                f"rank {waiting[0]}'s log ends with:\n{_tail(logs[waiting[0]])}")
            if poll is not None:
                poll()
            time.sleep(0.05)
    finally:
        _kill(procs + ([store] if store is not None else []))
