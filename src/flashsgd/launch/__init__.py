"""Start the ranks of a data-parallel job: torchrun's environment when present, else local spawn.

flashsgd never writes its own transport or rendezvous. Under ``torchrun`` (any number of nodes) the
process group comes from the environment (``RANK``, ``WORLD_SIZE``, ``MASTER_ADDR``...). On one
machine without torchrun, :func:`spawn` starts W local processes that rendezvous through a
``torch.distributed.TCPStore`` hosted by the parent on an OS-chosen port (no port races), run the
function, and send back its return value (by value: it reaches the launcher even when the rank has
exited first, see :func:`_by_value`).

A spawned job never hangs, never leaves orphans and names the rank at fault:

- Every collective has the run's ``timeout_s`` (``init_process_group(timeout=...)``), and the whole
  run an optional ``deadline_s``.
- When a rank fails, the launcher keeps listening until every rank has reported or exited, or
  nothing new has arrived for ``SETTLE_S``; then the rank that died or stopped
  responding is named first and its peers' errors are summarised as consequences
  (:mod:`flashsgd.launch.failures`): "rank 1 exited with code -9 (SIGKILL); ranks 0,2,3 then
  failed: Connection closed by peer". Ranks of two nodes (the layout the ranks report) that all
  timed out on each other lead with the lost connection between the nodes, and a full disk leads
  with the path and the space left there.
- SIGTERM or SIGINT to the launcher is forwarded to the workers as SIGTERM; after
  ``SIGNAL_GRACE_S`` the stragglers are killed and :class:`Interrupted` is raised (exit code
  128 + signal, as a shell reports it). Workers ignore SIGINT themselves (a terminal's Ctrl-C
  reaches the whole process group; the launcher decides).
- Workers die with the launcher, even one killed by SIGKILL: Linux ``prctl(PR_SET_PDEATHSIG)``,
  elsewhere a thread that watches ``os.getppid()``.

Example::

    >>> def work(scale):
    ...     t = torch.ones(4) * (dist.get_rank() + 1) * scale
    ...     dist.all_reduce(t)
    ...     return t.tolist()
    >>> spawn(work, world_size=4, args=(1.0,))[0]
    [10.0, 10.0, 10.0, 10.0]
"""

from __future__ import annotations

import atexit
import contextlib
import ctypes
import dataclasses
import datetime
import gc
import math
import multiprocessing as mp
import os
import pickle
import queue as queue_module
import signal
import sys
import threading
import time
from pathlib import Path
from typing import Any, Callable, Iterator, Sequence

import torch
import torch.distributed as dist

from flashsgd.fmt import plural
from flashsgd.launch.failures import RankOutcome, WorkerError, attribute, describe_exception

__all__ = ["Interrupted", "WorkerError", "cuda_index", "default_backend", "init_from_env", "local_ranks", "run",
           "shutdown", "spawn", "under_torchrun"]

TORCHRUN_VARS = ("RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT")
SETTLE_S = 5.0        # after a failure: quiet time before the ranks still silent are called hung
SIGNAL_GRACE_S = 5.0  # after a forwarded SIGTERM: time the workers get before SIGKILL
POLL_S = 0.2          # how often the launcher looks at exits, signals and the deadline
PR_SET_PDEATHSIG = 1  # <linux/prctl.h>


class Interrupted(BaseException):
    """The launcher received ``signum`` (SIGTERM / SIGINT) and stopped its workers.

    A ``BaseException`` like ``KeyboardInterrupt``: an ``except Exception`` meant for errors does
    not swallow it. ``exit_code`` is what a shell reports for a process killed by that signal
    (143 for SIGTERM, 130 for SIGINT); a command line exits with it.
    """

    def __init__(self, signum: int):
        self.signum = int(signum)
        self.exit_code = 128 + self.signum
        super().__init__(f"interrupted by {signal.Signals(self.signum).name}; workers stopped")


def under_torchrun() -> bool:
    """True when the environment describes a rendezvous (torchrun, or an equivalent launcher)."""
    return all(v in os.environ for v in TORCHRUN_VARS)


def default_backend() -> str:
    """NCCL when CUDA is available, Gloo otherwise (the engine is torch.distributed)."""
    return "nccl" if torch.cuda.is_available() and dist.is_nccl_available() else "gloo"


@contextlib.contextmanager
def one_thread() -> Iterator[None]:
    """Torch work of the launching process before it forks its ranks, on one intra-op thread.

    GNU OpenMP (torch's intra-op pool on Linux) does not survive a fork: a child whose parent has
    run a parallel region hangs in its own first one (seen: a 1-rank run whose parent had decoded
    a batch stopped forever in DDP's first broadcast; ranks of larger worlds run one thread each
    and escaped). Work done here never starts the pool, so the ranks forked afterwards are safe."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        yield
    finally:
        torch.set_num_threads(threads)


CPU_WORKERS = 4
"""Local ranks of a CPU run when ``run.workers`` is unset (emulated 2x2: two nodes of two ranks)."""


def local_ranks(workers: int | None, backend: str = "auto",
                gpus: int | None = None) -> tuple[int, str, str]:
    """(ranks, backend, note) of a run spawned on this machine.

    ``backend="auto"``: with CUDA (and a torch built with NCCL) one rank per visible GPU over NCCL
    (``workers`` unset), or ``workers`` ranks when they fit on the GPUs (NCCL cannot put two ranks
    on one GPU); more workers than GPUs run over Gloo on the CPU, with a note saying so. Without
    CUDA: Gloo, ``workers`` or :data:`CPU_WORKERS` ranks. ``"nccl"``: ``workers`` (default: every
    GPU) must not exceed the GPUs (ValueError otherwise); ``"gloo"``: CPU ranks. ``gpus``: the
    visible GPUs (default: ``torch.cuda.device_count()`` when NCCL is usable, else 0).
    """
    if gpus is None:
        gpus = torch.cuda.device_count() if torch.cuda.is_available() and dist.is_nccl_available() else 0
    if backend not in ("auto", "gloo", "nccl"):
        raise ValueError(f"backend must be auto, gloo or nccl, got {backend!r}")
    if workers is not None and workers < 1:
        raise ValueError(f"workers must be >= 1, got {workers}")
    if backend == "gloo" or (backend == "auto" and not gpus):
        return workers or CPU_WORKERS, "gloo", ""
    if workers is None or workers <= gpus:
        return workers or gpus, "nccl", ""
    if backend == "nccl":
        raise ValueError(f"config key run.workers={workers} with run.backend='nccl' needs one GPU per "
                         f"rank and this machine has {gpus}; valid: run.workers <= {gpus}, or "
                         "run.backend = gloo (CPU ranks)")
    return workers, "gloo", (f"{plural(workers, 'worker')} on {plural(gpus, 'GPU')}: NCCL needs one GPU per "
                             f"rank, so the ranks train on the CPU over Gloo (--workers {gpus} trains on the GPUs)")


def cuda_index(local_rank: int, device_count: int, local_world: int | None = None) -> int:
    """The GPU of local rank ``local_rank`` among the ``device_count`` this process sees.

    ``local_rank % device_count``: one GPU per rank when the process sees all of the node's GPUs
    (rank i -> GPU i), and GPU 0 where a scheduler gives each process one visible GPU
    (``CUDA_VISIBLE_DEVICES`` per process, e.g. Slurm ``--gpus-per-task=1``), where LOCAL_RANK
    itself names no visible device. ``local_world`` (torchrun's LOCAL_WORLD_SIZE): more ranks on
    the node than the several GPUs each sees would put two ranks on one GPU, which NCCL refuses
    (at its first collective, "Duplicate GPU detected"): a RuntimeError here, before it.
    """
    if device_count < 1:
        raise RuntimeError(f"backend 'nccl' needs a visible GPU; this process sees none "
                           f"(local rank {local_rank}; CUDA_VISIBLE_DEVICES="
                           f"{os.environ.get('CUDA_VISIBLE_DEVICES', '<unset>')})")
    if local_world is not None and device_count > 1 and local_world > device_count:
        raise RuntimeError(f"backend 'nccl': {local_world} ranks on this node but {device_count} visible GPUs; "
                           f"NCCL cannot run two ranks on one GPU: start at most {device_count} per node "
                           "(torchrun --nproc-per-node), or give each process its own GPU")
    return local_rank % device_count


def _device_id(backend: str, local_rank: int) -> dict[str, Any]:
    """NCCL: bind this process to its GPU (:func:`cuda_index`) and return ``init_process_group``'s
    ``device_id`` keyword (torch >= 2.3), with which the NCCL communicator is created eagerly (and
    ``new_group`` can split it) instead of lazily inside the first collective, the first backward.
    Gloo: nothing."""
    if backend != "nccl":
        return {}
    index = cuda_index(local_rank, torch.cuda.device_count(), int(os.environ.get("LOCAL_WORLD_SIZE", 0)) or None)
    torch.cuda.set_device(index)
    return {"device_id": torch.device("cuda", index)}


def init_from_env(backend: str | None = None, timeout_s: float = 300.0) -> str:
    """Join torchrun's process group from the environment; returns the backend.

    ``timeout_s`` bounds the rendezvous and every collective of the default group
    (``init_process_group(timeout=...)``). The store is torchrun's (``TORCHELASTIC_USE_AGENT_STORE``)
    or hosted by rank 0, and every elastic attempt gets its own key prefix
    (``TORCHELASTIC_RESTART_COUNT``): with plain ``env://`` the ranks of a group restarted by
    ``--max-restarts`` read the dead attempt's addresses from the reused agent store and fail in
    Gloo's ``connectFullMesh`` ("Connection refused"; seen on torch 2.13).
    """
    backend = backend or default_backend()
    device_id = _device_id(backend, int(os.environ.get("LOCAL_RANK", 0)))  # NCCL: this rank's GPU
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
                            rank=rank, world_size=world, timeout=timeout, **device_id)
    return backend


def shutdown_at_exit() -> None:
    """Run :func:`shutdown` when the interpreter exits (registered once): for process groups that
    flashsgd did not create and their owner never destroys (PyTorch Lightning's and Accelerate's):
    left to interpreter finalization, their subgroups' destruction can abort the process
    ("terminate called without an active exception": :func:`flashsgd.comm.topology.reset`)."""
    if not getattr(shutdown_at_exit, "registered", False):
        atexit.register(shutdown)
        shutdown_at_exit.registered = True  # type: ignore[attr-defined]


def shutdown() -> None:
    """Drop flashsgd's cached subgroups, then destroy every process group (idempotent)."""
    from flashsgd.comm import topology

    topology.reset()
    if dist.is_initialized():
        dist.destroy_process_group()
    gc.collect()


# ------------------------------------------------------------------------ worker side -------------

def _parent_death_signal() -> bool:
    """Ask Linux to SIGKILL this process when its parent dies; False where that is unavailable."""
    if not sys.platform.startswith("linux"):
        return False
    try:
        libc = ctypes.CDLL(None, use_errno=True)
        return libc.prctl(PR_SET_PDEATHSIG, signal.SIGKILL, 0, 0, 0) == 0
    except (OSError, AttributeError):
        return False


def _watch_parent(parent_pid: int, every_s: float = 1.0) -> threading.Thread:
    """The portable fallback: a daemon thread that SIGKILLs this process once ``parent_pid`` is gone
    (the process is re-parented, so ``os.getppid()`` changes)."""
    def watch() -> None:
        while os.getppid() == parent_pid:
            time.sleep(every_s)
        os.kill(os.getpid(), signal.SIGKILL)

    thread = threading.Thread(target=watch, name="flashsgd-parent-watch", daemon=True)
    thread.start()
    return thread


def _exit_with_parent(parent_pid: int) -> None:
    """A worker never outlives the launcher (even one killed by SIGKILL, which runs no cleanup)."""
    if not _parent_death_signal():
        _watch_parent(parent_pid)
    if os.getppid() != parent_pid:  # the parent died before the signal was armed
        os.kill(os.getpid(), signal.SIGKILL)


def _join_group(rank: int, world_size: int, ports: Any, backend: str, env: dict[str, str],
                timeout_s: float) -> None:
    """Rendezvous on the parent's store and create the default process group."""
    try:
        port = ports.get(timeout=timeout_s)
    except queue_module.Empty:
        raise TimeoutError(f"no rendezvous port from the parent within {timeout_s:g} s") from None
    os.environ.update({
        "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(port), "RANK": str(rank),
        "WORLD_SIZE": str(world_size), "LOCAL_RANK": str(rank), "LOCAL_WORLD_SIZE": str(world_size),
        "GROUP_RANK": "0",
    })
    os.environ.setdefault("GLOO_SOCKET_IFNAME", "lo")  # local spawn: stay on loopback
    os.environ.update(env)
    # W ranks share the machine's cores: one intra-op thread each unless there are cores to spare.
    torch.set_num_threads(max(1, (os.cpu_count() or 1) // world_size))
    timeout = datetime.timedelta(seconds=timeout_s)
    store = dist.TCPStore("127.0.0.1", port, world_size, is_master=False, timeout=timeout)
    dist.init_process_group(backend, store=store, rank=rank, world_size=world_size, timeout=timeout,
                            **_device_id(backend, rank))


def _by_value(report: tuple[int, bool, Any]) -> bytes:
    """The report as bytes that hold every tensor's data: it reaches the launcher after this rank
    has exited.

    A queue pickles with torch's multiprocessing reductions, which send a tensor as a file
    descriptor (CUDA: an IPC handle) that the *sending* process hands over when the receiver
    unpickles it; a rank that has exited by then loses its result (``ConnectionResetError`` in the
    launcher, seen in a test run). The standard pickler copies the storage's bytes instead.
    A result that cannot be pickled is reported as this rank's error, naming its type.
    """
    try:
        return pickle.dumps(report, protocol=pickle.HIGHEST_PROTOCOL)
    except Exception as exc:  # noqa: BLE001 - an unpicklable result is the rank's error
        rank, _, value = report
        error = TypeError(f"rank {rank}'s result ({type(value).__name__}) cannot be sent to the launcher: "
                          f"{type(exc).__name__}: {exc}; return picklable values (tensors, numbers, "
                          "lists, dicts)")
        return pickle.dumps((rank, False, describe_exception(error)), protocol=pickle.HIGHEST_PROTOCOL)


def _worker(rank: int, world_size: int, ports: Any, backend: str, fn: Callable, args: Sequence,
            env: dict[str, str], results: Any, timeout_s: float, parent_pid: int) -> None:
    """One rank: die with the parent, join the group, run ``fn``, report its result or error."""
    _exit_with_parent(parent_pid)
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # the launcher decides, and forwards SIGTERM
    try:
        _join_group(rank, world_size, ports, backend, env, timeout_s)
        report = (rank, True, fn(*args))
    except BaseException as exc:  # noqa: BLE001 - everything is reported to the parent
        report = (rank, False, describe_exception(exc))
    # Deliver the report before anything slow (shutdown; a busy core): the launcher judges who is
    # silent by what has arrived, so a sent report must not wait in this process's feeder thread.
    results.put(_by_value(report))
    results.close()
    results.join_thread()
    shutdown()


# ------------------------------------------------------------------------ launcher side -----------

@dataclasses.dataclass
class _Job:
    """What the launcher knows about its ranks: the processes, their reports and exits."""

    procs: list[Any]
    results: Any
    reports: dict[int, tuple[bool, Any]] = dataclasses.field(default_factory=dict)
    exits: dict[int, int] = dataclasses.field(default_factory=dict)  # exited without a report

    def collect(self, wait_s: float) -> None:
        """Take every report that arrives within ``wait_s``; note ranks that exited without one.

        Exits are looked at before the queue is drained: a worker's report is in the pipe before
        its process ends, so a rank seen exited and still without a report has none.
        """
        ended = {r: p.exitcode for r, p in enumerate(self.procs) if p.exitcode is not None}
        try:
            rank, ok, value = pickle.loads(self.results.get(timeout=wait_s))  # _by_value's bytes
            while True:
                self.reports[rank] = (ok, value)
                rank, ok, value = pickle.loads(self.results.get_nowait())
        except queue_module.Empty:
            pass
        self.exits.update({r: c for r, c in ended.items() if r not in self.reports})

    def accounted(self) -> int:
        return len(self.reports) + len(self.exits)

    def done(self) -> bool:
        return len(self.reports) == len(self.procs) and all(ok for ok, _ in self.reports.values())

    def failed(self) -> bool:
        return bool(self.exits) or not all(ok for ok, _ in self.reports.values())

    def outcomes(self) -> list[RankOutcome]:
        out = []
        for r in range(len(self.procs)):
            if r in self.reports:
                ok, value = self.reports[r]
                out.append(RankOutcome(r, "ok") if ok else RankOutcome(r, "raised", **value))
            elif r in self.exits:
                out.append(RankOutcome(r, "exited", exitcode=self.exits[r]))
            else:
                out.append(RankOutcome(r, "silent"))
        return out


@contextlib.contextmanager
def _caught_signals() -> Iterator[list[int]]:
    """SIGTERM / SIGINT numbers received while inside, instead of their usual effect.

    Signal handlers can only be installed from the main thread; elsewhere the signals keep their
    usual effect (and the workers still die with this process).
    """
    caught: list[int] = []
    if threading.current_thread() is not threading.main_thread():
        yield caught
        return
    previous = {s: signal.signal(s, lambda signum, frame: caught.append(signum))
                for s in (signal.SIGTERM, signal.SIGINT)}
    try:
        yield caught
    finally:
        for s, handler in previous.items():
            signal.signal(s, handler if handler is not None else signal.SIG_DFL)


def _settle(job: _Job, settle_s: float, caught: list[int]) -> None:
    """After a failure: listen until every rank is accounted for or nothing new came for ``settle_s``."""
    seen, quiet_since = job.accounted(), time.monotonic()
    while job.accounted() < len(job.procs) and not caught \
            and time.monotonic() - quiet_since < settle_s:
        job.collect(POLL_S)
        if job.accounted() != seen:
            seen, quiet_since = job.accounted(), time.monotonic()


def _interrupt(job: _Job, signum: int, caught: list[int]) -> Interrupted:
    """Forward SIGTERM to the running workers and give them ``SIGNAL_GRACE_S`` (a second signal
    cuts that short); the stragglers are killed on the way out of :func:`spawn`."""
    for p in job.procs:
        if p.exitcode is None:
            with contextlib.suppress(ProcessLookupError):
                os.kill(p.pid, signal.SIGTERM)
    end = time.monotonic() + SIGNAL_GRACE_S
    while len(caught) < 2 and time.monotonic() < end and any(p.exitcode is None for p in job.procs):
        time.sleep(0.05)
    return Interrupted(signum)


STALL_CPU_S = 0.25
"""CPU seconds the ranks together must use within ``stall_s`` to count as making progress: a rank
blocked on a peer, a socket or a sleep uses none; one that runs, however starved by a loaded
machine, uses far more."""


def cpu_seconds(procs: Sequence[Any]) -> float | None:
    """CPU seconds the processes ``procs`` (and their reaped children) have used so far, from
    ``/proc/PID/stat`` (utime + stime + cutime + cstime); None where there is no /proc."""
    if not os.path.isdir("/proc/self"):
        return None
    tick, total = os.sysconf("SC_CLK_TCK"), 0
    for p in procs:
        try:  # the fields after the command name: state is the first, utime the 12th
            fields = Path(f"/proc/{p.pid}/stat").read_text().rsplit(")", 1)[1].split()
            total += sum(int(v) for v in fields[11:15])
        except (OSError, IndexError, ValueError, TypeError):  # exited: its time is no longer counted
            continue
    return total / tick


def runnable(procs: Sequence[Any]) -> bool:
    """Whether one of ``procs`` is running or waiting for a CPU (state ``R`` in ``/proc/PID/stat``):
    on a loaded machine a rank that has work may use little CPU for seconds while it waits for a
    core (and its peers wait for it); it is not hung. False where there is no /proc."""
    for p in procs:
        try:
            if Path(f"/proc/{p.pid}/stat").read_text().rsplit(")", 1)[1].split()[0] == "R":
                return True
        except (OSError, IndexError, TypeError):  # exited
            continue
    return False


def _wait(job: _Job, deadline_s: float | None, caught: list[int],
          stall_s: float | None = None) -> WorkerError | Interrupted | None:
    """Collect the ranks' results; the error to raise when the job failed, was stopped, late, or
    stalled (its ranks used less than :data:`STALL_CPU_S` of CPU in ``stall_s`` seconds)."""
    deadline = time.monotonic() + deadline_s if deadline_s is not None else math.inf
    moved_at, used = time.monotonic(), cpu_seconds(job.procs)
    while not job.done():
        job.collect(POLL_S)
        if caught:
            return _interrupt(job, caught[0], caught)
        if job.failed():
            _settle(job, SETTLE_S, caught)
            return _interrupt(job, caught[0], caught) if caught else attribute(job.outcomes())
        now = time.monotonic()
        if now > deadline and not job.done():
            return attribute([o for o in job.outcomes() if o.state != "ok"],
                             reason=f"the run passed its deadline (deadline_s={deadline_s:g})")
        if stall_s is not None and used is not None and not job.done():
            current = cpu_seconds(job.procs)
            if current is not None and (current - used >= STALL_CPU_S or runnable(job.procs)):
                moved_at, used = now, current
            elif now - moved_at > stall_s:
                return attribute([o for o in job.outcomes() if o.state != "ok"],
                                 reason=f"no rank used the CPU for {stall_s:g} s: every rank was waiting "
                                        f"(a hang; stall_s={stall_s:g})")
    return None


def _reap(procs: list[Any], grace_s: float) -> None:
    """Join every worker within ``grace_s`` in all, then SIGKILL and join what is left."""
    end = time.monotonic() + grace_s
    for p in procs:
        p.join(timeout=max(0.0, end - time.monotonic()))
    for p in procs:
        if p.is_alive():
            p.kill()
            p.join()


def _check_spawn_args(world_size: int, backend: str, timeout_s: float, deadline_s: float | None,
                      start_method: str | None) -> None:
    if not isinstance(world_size, int) or world_size < 1:
        raise ValueError(f"world_size must be an integer >= 1, got {world_size!r}")
    if backend not in ("gloo", "nccl"):
        raise ValueError(f"backend must be 'gloo' or 'nccl', got {backend!r}")
    if not (isinstance(timeout_s, (int, float)) and math.isfinite(timeout_s) and timeout_s > 0):
        raise ValueError(f"timeout_s must be a finite number > 0, got {timeout_s!r}")
    if deadline_s is not None and not (isinstance(deadline_s, (int, float))
                                       and math.isfinite(deadline_s) and deadline_s > 0):
        raise ValueError(f"deadline_s must be None or a finite number > 0, got {deadline_s!r}")
    if start_method not in (None, "fork", "spawn"):
        raise ValueError(f"start_method must be None, 'fork' or 'spawn', got {start_method!r}")


def spawn(fn: Callable[..., Any], world_size: int, args: Sequence = (), *,
          backend: str = "gloo", timeout_s: float = 300.0, deadline_s: float | None = None,
          start_method: str | None = None, env: dict[str, str] | None = None,
          stall_s: float | None = None) -> list[Any]:
    """Run ``fn(*args)`` on ``world_size`` local ranks in a fresh process group; return per-rank results.

    Args:
        fn: the per-rank function; with ``start_method="spawn"`` it must be importable (module level).
        world_size: number of ranks, >= 1.
        args: positional arguments for ``fn`` (picklable under "spawn").
        backend: ``"gloo"`` (CPU) or ``"nccl"`` (one GPU per rank).
        timeout_s: deadline of the rendezvous and of every collective of the default group; a dead
            or hung rank fails its peers' collectives after at most this long.
        deadline_s: deadline of the whole run, or None (default) for none.
        start_method: ``"fork"`` (default for Gloo on Linux: workers inherit imported torch, ~0.2 s
            to start 4 ranks instead of ~5 s; torch work of this process before the call belongs in
            :func:`one_thread`, or a rank may hang in OpenMP) or ``"spawn"`` (default for NCCL:
            CUDA needs it).
        env: extra environment variables for the workers.
        stall_s: deadline of progress, or None (default) for none: the run fails when its ranks
            together use less than :data:`STALL_CPU_S` of CPU in ``stall_s`` seconds (all blocked:
            a hang) and none is runnable (waiting for a core: a loaded machine, not a hang), however
            long a loaded machine makes it otherwise (Linux; elsewhere ignored).

    Raises:
        WorkerError: a rank raised, exited without a result, or stopped responding, or the
            deadline passed, or the ranks stalled; the cause is named first (see
            :mod:`flashsgd.launch.failures`).
        Interrupted: this process received SIGTERM or SIGINT; the workers were stopped.
    """
    _check_spawn_args(world_size, backend, timeout_s, deadline_s, start_method)
    if stall_s is not None and not (isinstance(stall_s, (int, float)) and math.isfinite(stall_s) and stall_s > 0):
        raise ValueError(f"stall_s must be None or a finite number > 0, got {stall_s!r}")
    if start_method is None:
        fork_ok = backend == "gloo" and "fork" in mp.get_all_start_methods()
        start_method = "fork" if fork_ok else "spawn"
    ctx = mp.get_context(start_method)
    results, ports = ctx.Queue(), ctx.Queue()
    # Not daemonic: a rank starts processes of its own (DataLoader workers); the launcher joins or
    # kills every rank itself (_reap below), and a rank dies with the launcher (_exit_with_parent).
    procs = [ctx.Process(target=_worker, daemon=False,
                         args=(r, world_size, ports, backend, fn, tuple(args), dict(env or {}),
                               results, timeout_s, os.getpid()))
             for r in range(world_size)]
    for p in procs:
        p.start()
    job, error, store = _Job(procs, results), None, None
    try:
        with _caught_signals() as caught:  # after the forks: workers keep the default handlers
            # The store's server thread starts only after every fork: a thread alive at fork time
            # can leave a lock held in the child forever (seen as a rare rendezvous hang before).
            store = dist.TCPStore("127.0.0.1", 0, None, is_master=True, wait_for_workers=False,
                                  timeout=datetime.timedelta(seconds=timeout_s))
            for _ in procs:
                ports.put(store.port)
            error = _wait(job, deadline_s, caught, stall_s)
    finally:
        _reap(procs, grace_s=5.0 if job.done() else 0.5)
        results.close()
        ports.close()
        # No thread of this call may live on into the next fork: not the ports' feeder, and not
        # the store's server (the error raised below keeps this frame, and so ``store``, alive).
        ports.join_thread()
        del store
    if error is not None:
        raise error
    return [job.reports[r][1] for r in range(world_size)]


def run(fn: Callable[..., Any], args: Sequence = (), *, world_size: int, backend: str | None = None,
        timeout_s: float = 300.0, deadline_s: float | None = None) -> Any:
    """Run ``fn(*args)`` under torchrun's process group if there is one, else on spawned local ranks.

    Returns rank 0's result in the local case and this rank's result under torchrun. ``timeout_s``
    bounds every collective in both cases; ``deadline_s`` (whole run) applies to spawned ranks
    (under torchrun the job's lifetime, signals and restarts are torchrun's).
    """
    if under_torchrun():
        init_from_env(backend, timeout_s)
        try:
            return fn(*args)
        finally:
            shutdown()
    return spawn(fn, world_size, args, backend=backend or "gloo", timeout_s=timeout_s,
                 deadline_s=deadline_s)[0]
