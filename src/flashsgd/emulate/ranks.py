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
2. Poll: all exit 0 -> done. One exits non-zero -> let the others finish failing (until all have
   exited, or none has for ``GRACE_S``), kill the rest, and raise naming the cause as
   :func:`flashsgd.launch.failures.attribute` finds it from every rank's exit and log
   (:func:`rank_outcome`): the rank that died or stopped, or the connection between nodes whose
   ranks all timed out on each other; then the tail of the blamed rank's log. Deadline passed ->
   kill all, raise naming the ranks.

Example::

    >>> with emulated_cluster(spec) as cluster:                      # doctest: +SKIP
    ...     run_ranks(cluster, [sys.executable, "-m", "flashsgd", "bench", "allreduce"], log_dir)
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import Callable

from flashsgd.emulate.netns import EmulatedCluster
from flashsgd.launch.failures import RankOutcome, attribute, describe_log

MASTER_PORT = 29500  # a fresh namespace has every port free
FLOW_ENV = "FLASHSGD_EMULATED_FLOW_BPS"
GRACE_S = 3.0  # after a rank failed: quiet time before the ranks still running are called stopped


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


def rank_outcome(rank: int, code: int | None, log: Path) -> RankOutcome:
    """How ``rank`` ended, from its exit code (None: still running) and its log: ``ok`` (exit 0);
    ``raised`` (its log ends in a traceback, :func:`flashsgd.launch.failures.describe_log`; also a
    rank still running after printing it); ``silent`` (still running); else ``exited``."""
    if code == 0:
        return RankOutcome(rank, "ok")
    try:
        text = log.read_text(errors="replace")
    except OSError:
        text = ""
    report = describe_log(text)
    last = next((line for line in reversed(text.splitlines()) if line.strip()), "")
    if report is not None and (code is not None or describe_log(last) is not None):  # it reported
        return RankOutcome(rank, "raised", **report)
    return RankOutcome(rank, "silent") if code is None else RankOutcome(rank, "exited", exitcode=code)


def _settle(procs: list[subprocess.Popen], quiet_s: float, deadline: float) -> None:
    """Wait until every rank has exited, or none has for ``quiet_s`` (or the deadline passed)."""
    running, since = sum(p.poll() is None for p in procs), time.monotonic()
    while running and time.monotonic() - since < quiet_s and time.monotonic() < deadline:
        time.sleep(0.05)
        now_running = sum(p.poll() is None for p in procs)
        if now_running != running:
            running, since = now_running, time.monotonic()


def _failure(spec, procs: list[subprocess.Popen], logs: list[Path]) -> RankError:
    """The error of a failed job: the cause as :func:`attribute` names it, then the log of the
    rank blamed (or of the first that failed, when no rank is: a lost connection)."""
    codes = [p.poll() for p in procs]
    outcomes = [rank_outcome(r, codes[r], logs[r]) for r in range(len(procs))]
    err = attribute(outcomes, ranks_per_node=spec.ranks_per_node)
    failed = [r for r, c in enumerate(codes) if c not in (None, 0)]
    r = err.causes[0] if err.causes else failed[0]
    how = f"exited with code {codes[r]}" if codes[r] is not None else "was still running (killed)"
    return RankError(f"{err.summary}\nrank {r} (node {r // spec.ranks_per_node}) {how}; its log {logs[r]} "
                     f"ends with:\n{_tail(logs[r])}")


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
                _settle(procs, GRACE_S, start + timeout_s)
                raise _failure(spec, procs, logs)
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
