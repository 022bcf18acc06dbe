"""Start the ranks of a data-parallel job: torchrun's environment when present, else local spawn.

flashsgd never writes its own transport or rendezvous. Under ``torchrun`` (any number of nodes) the
process group comes from the environment (``RANK``, ``WORLD_SIZE``, ``MASTER_ADDR``...). On one
machine without torchrun, :func:`spawn` starts W local processes that rendezvous through a
``torch.distributed.TCPStore`` hosted by the parent on an OS-chosen port (no port races), run the
function, and send back its return value. Every wait has a deadline: a rank that raises, dies or
hangs makes :func:`spawn` fail with a message naming the rank, never an endless hang.

Example::

    >>> def work(scale):
    ...     t = torch.ones(4) * (dist.get_rank() + 1) * scale
    ...     dist.all_reduce(t)
    ...     return t.tolist()
    >>> spawn(work, world_size=4, args=(1.0,))[0]
    [10.0, 10.0, 10.0, 10.0]
"""

from __future__ import annotations

import datetime
import gc
import multiprocessing as mp
import os
import queue as queue_module
import time
import traceback
from typing import Any, Callable, Sequence

import torch
import torch.distributed as dist

TORCHRUN_VARS = ("RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT")


class WorkerError(RuntimeError):
    """A rank raised, died or timed out; the message names the rank and carries its traceback."""


def under_torchrun() -> bool:
    """True when the environment describes a rendezvous (torchrun, or an equivalent launcher)."""
    return all(v in os.environ for v in TORCHRUN_VARS)


def default_backend() -> str:
    """NCCL when CUDA is available, Gloo otherwise (DESIGN.md: the engine is torch.distributed)."""
    return "nccl" if torch.cuda.is_available() and dist.is_nccl_available() else "gloo"


def init_from_env(backend: str | None = None, timeout_s: float = 300.0) -> str:
    """Join torchrun's process group from the environment; returns the backend.

    The store is torchrun's (``TORCHELASTIC_USE_AGENT_STORE``) or hosted by rank 0, and every
    elastic attempt gets its own key prefix (``TORCHELASTIC_RESTART_COUNT``): with plain
    ``env://`` the ranks of a group restarted by ``--max-restarts`` read the dead attempt's
    addresses from the reused agent store and fail in Gloo's ``connectFullMesh`` ("Connection
    refused"; seen on torch 2.13).
    """
    backend = backend or default_backend()
    if backend == "nccl":
        torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", 0)))
    if dist.is_initialized():
        return backend
    rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    agent_store = os.environ.get("TORCHELASTIC_USE_AGENT_STORE") == "True"
    timeout = datetime.timedelta(seconds=timeout_s)
    store = dist.TCPStore(os.environ["MASTER_ADDR"], int(os.environ["MASTER_PORT"]), world,
                          is_master=not agent_store and rank == 0, timeout=timeout,
                          multi_tenant=not agent_store)
    attempt = os.environ.get("TORCHELASTIC_RESTART_COUNT", "0")
    dist.init_process_group(backend, store=dist.PrefixStore(f"flashsgd/attempt-{attempt}", store),
                            rank=rank, world_size=world, timeout=timeout)
    return backend


def shutdown() -> None:
    """Drop flashsgd's cached subgroups, then destroy every process group (idempotent)."""
    from flashsgd.comm import topology

    topology.reset()
    if dist.is_initialized():
        dist.destroy_process_group()
    gc.collect()


def _worker(rank: int, world_size: int, ports: Any, backend: str, fn: Callable, args: Sequence,
            env: dict[str, str], results: Any, timeout_s: float) -> None:
    try:
        port = ports.get(timeout=timeout_s)
    except queue_module.Empty:
        results.put((rank, False, f"no rendezvous port from the parent within {timeout_s:.0f} s"))
        return
    os.environ.update({
        "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(port), "RANK": str(rank),
        "WORLD_SIZE": str(world_size), "LOCAL_RANK": str(rank), "LOCAL_WORLD_SIZE": str(world_size),
        "GROUP_RANK": "0",
    })
    os.environ.setdefault("GLOO_SOCKET_IFNAME", "lo")  # local spawn: stay on loopback
    os.environ.update(env)
    # W ranks share the machine's cores: one intra-op thread each unless there are cores to spare.
    torch.set_num_threads(max(1, (os.cpu_count() or 1) // world_size))
    try:
        store = dist.TCPStore("127.0.0.1", port, world_size, is_master=False,
                              timeout=datetime.timedelta(seconds=timeout_s))
        if backend == "nccl":
            torch.cuda.set_device(rank % torch.cuda.device_count())
        dist.init_process_group(backend, store=store, rank=rank, world_size=world_size,
                                timeout=datetime.timedelta(seconds=timeout_s))
        result = fn(*args)
        results.put((rank, True, result))
    except BaseException:  # noqa: BLE001 - everything is reported to the parent
        results.put((rank, False, traceback.format_exc()))
    finally:
        shutdown()


def spawn(fn: Callable[..., Any], world_size: int, args: Sequence = (), *,
          backend: str = "gloo", timeout_s: float = 300.0, start_method: str | None = None,
          env: dict[str, str] | None = None) -> list[Any]:
    """Run ``fn(*args)`` on ``world_size`` local ranks in a fresh process group; return per-rank results.

    Args:
        fn: the per-rank function; with ``start_method="spawn"`` it must be importable (module level).
        world_size: number of ranks, >= 1.
        args: positional arguments for ``fn`` (picklable under "spawn").
        backend: ``"gloo"`` (CPU) or ``"nccl"`` (one GPU per rank).
        timeout_s: deadline for the whole run and for every collective inside it.
        start_method: ``"fork"`` (default for Gloo on Linux: workers inherit imported torch, ~0.2 s
            to start 4 ranks instead of ~5 s) or ``"spawn"`` (default for NCCL: CUDA needs it).
        env: extra environment variables for the workers.

    Raises:
        WorkerError: a rank raised (its traceback is included), exited without a result, or the
            deadline passed (the ranks still running are named and killed).
    """
    if not isinstance(world_size, int) or world_size < 1:
        raise ValueError(f"world_size must be an integer >= 1, got {world_size!r}")
    if backend not in ("gloo", "nccl"):
        raise ValueError(f"backend must be 'gloo' or 'nccl', got {backend!r}")
    if start_method is None:
        fork_ok = backend == "gloo" and "fork" in mp.get_all_start_methods()
        start_method = "fork" if fork_ok else "spawn"
    ctx = mp.get_context(start_method)
    results, ports = ctx.Queue(), ctx.Queue()
    procs = [ctx.Process(target=_worker, daemon=True,
                         args=(r, world_size, ports, backend, fn, tuple(args), dict(env or {}),
                               results, timeout_s))
             for r in range(world_size)]
    for p in procs:
        p.start()
    # The store's server thread starts only after every fork: a thread alive at fork time can leave
    # a lock held in the child forever (seen as a rare rendezvous hang before this ordering).
    store = dist.TCPStore("127.0.0.1", 0, None, is_master=True, wait_for_workers=False,
                          timeout=datetime.timedelta(seconds=timeout_s))
    for _ in procs:
        ports.put(store.port)
    out: dict[int, Any] = {}
    deadline = time.monotonic() + timeout_s
    try:
        while len(out) < world_size:
            try:
                rank, ok, value = results.get(timeout=0.2)
            except queue_module.Empty:
                dead = [r for r, p in enumerate(procs)
                        if r not in out and p.exitcode is not None and p.exitcode != 0]
                if dead:
                    # give a crashing rank's own report a moment to arrive before blaming the exit
                    try:
                        rank, ok, value = results.get(timeout=1.0)
                    except queue_module.Empty:
                        raise WorkerError(
                            f"rank {dead[0]} exited with code {procs[dead[0]].exitcode} "
                            "without a result") from None
                elif time.monotonic() > deadline:
                    missing = sorted(set(range(world_size)) - set(out))
                    raise WorkerError(f"timed out after {timeout_s:.0f} s waiting for ranks {missing}")
                else:
                    continue
            if not ok:
                raise WorkerError(f"rank {rank} failed:\n{value}")
            out[rank] = value
    finally:
        for p in procs:
            p.join(timeout=5.0 if len(out) == world_size else 0.5)
        for p in procs:
            if p.is_alive():
                p.kill()
                p.join()
        results.close()
        ports.close()
        ports.join_thread()  # no feeder thread may outlive this call into the next fork
        del store
    return [out[r] for r in range(world_size)]


def run(fn: Callable[..., Any], args: Sequence = (), *, world_size: int, backend: str | None = None,
        timeout_s: float = 300.0) -> Any:
    """Run ``fn(*args)`` under torchrun's process group if there is one, else on spawned local ranks.

    Returns rank 0's result in the local case and this rank's result under torchrun.
    """
    if under_torchrun():
        init_from_env(backend, timeout_s)
        try:
            return fn(*args)
        finally:
            shutdown()
    return spawn(fn, world_size, args, backend=backend or "gloo", timeout_s=timeout_s)[0]
