"""Pieces every DDP communication hook shares: completed Futures, DDP's annotations, the
communication thread, and the state of hooks with nothing to checkpoint.

DDP calls a hook ``hook(state, bucket) -> Future[Tensor]`` per gradient bucket
(PyTorch ``torch/distributed/algorithms/ddp_comm_hooks/default_hooks.py``); the dense hooks
(:mod:`flashsgd.comm.dense_hooks`) and the sparse hooks (:mod:`flashsgd.comm.sparse.hooks`) both
build on this module, and :mod:`flashsgd.comm.hooks` registers them by name.
"""

from __future__ import annotations

import functools
import queue
import threading
from typing import Any, Callable

import torch
import torch.distributed as dist

HookFactory = Callable[..., tuple[Any, Callable | None]]
"""``make(ddp_model, options) -> (state, hook | None)``: what :data:`flashsgd.comm.hooks.HOOKS` holds."""


def rank_and_world(group: Any = None) -> tuple[int, int] | None:
    """(rank, world size) in ``group`` (None: the default group); None outside a process group."""
    if not dist.is_available() or not dist.is_initialized():
        return None
    return dist.get_rank(group), dist.get_world_size(group)


def check_owner(state: dict, hook: str, group: Any = None) -> None:
    """Refuse a per-rank hook state (error-feedback residuals) saved by another rank or world.

    ``state["rank"]`` / ``state["world"]`` are what :func:`rank_and_world` said when it was saved
    (absent in states of older versions: not checked).
    """
    here = rank_and_world(group)
    saved = (state.get("rank"), state.get("world"))
    if here is None or None in saved or tuple(saved) == here:
        return
    if saved[1] != here[1]:
        raise ValueError(
            f"{hook} hook state was saved by rank {saved[0]} of {saved[1]} workers; this is rank "
            f"{here[0]} of {here[1]}: per-rank state cannot be loaded into another world size "
            f"(flashsgd train regroups it: SparseHookState.regroup / PowerSGDHookState.regroup)")
    raise ValueError(
        f"{hook} hook state was saved by rank {saved[0]} of {saved[1]}; this is rank {here[0]}: "
        f"the hook state (error-feedback residuals) is per rank, so save one file per rank "
        f"(f'rank{{rank}}.pt') and load this rank's own")


def mean_tensors(dicts: list[dict[int, torch.Tensor]]) -> dict[int, torch.Tensor]:
    """Key-wise mean of ``dicts`` (a key missing from a dict counts as zeros): per-rank
    error-feedback memories regrouped onto another world size keep their total contribution
    (the update is sum_r memory_r / W, so each of the W' new ranks gets sum_r memory_r / W)."""
    out: dict[int, torch.Tensor] = {}
    for d in dicts:
        for k, v in d.items():
            out[k] = out[k] + v if k in out else v.clone()
    return {k: v / len(dicts) for k, v in out.items()}


def floating_tensors(state: Any) -> list[torch.Tensor]:
    """Every floating-point tensor in a (nested) state dict: what must be finite before it is
    checkpointed."""
    if isinstance(state, torch.Tensor):
        return [state] if state.is_floating_point() else []
    items = state.values() if isinstance(state, dict) else state if isinstance(state, (list, tuple)) else ()
    return [t for item in items for t in floating_tensors(item)]


def completed_future(value: Any) -> torch.futures.Future:
    """A Future already holding ``value`` (what a synchronous hook returns to DDP)."""
    fut: torch.futures.Future = torch.futures.Future()
    fut.set_result(value)
    return fut


def stages_on_host(buf: torch.Tensor) -> bool:
    """True for a CUDA bucket on a group that is not NCCL: Gloo carrying CUDA tensors (several
    ranks on one GPU, as ``flashsgd bench gpu`` runs them), whose send/recv take CPU tensors only."""
    return buf.is_cuda and "nccl" not in str(dist.get_backend())


class HostBucket:
    """A CUDA gradient bucket seen from the host: ``buffer()`` is a CPU copy; the rest is the
    bucket's. What a hook makes for it (residuals, generators) lives on the host too."""

    __slots__ = ("bucket", "host")

    def __init__(self, bucket: dist.GradBucket) -> None:
        self.bucket, self.host = bucket, bucket.buffer().to("cpu", copy=True)

    def buffer(self) -> torch.Tensor:
        return self.host

    def index(self) -> int:
        return self.bucket.index()

    def is_last(self) -> bool:
        return self.bucket.is_last()

    def parameters(self) -> list[torch.Tensor]:
        return self.bucket.parameters()

    def gradients(self) -> list[torch.Tensor]:
        """Views of the host copy laid out as the bucket's gradients (DDP's bucket is their
        concatenation, in order): a hook that writes through them writes the copy."""
        grads, views, offset = self.bucket.gradients(), [], 0
        for g in grads:
            views.append(self.host[offset:offset + g.numel()].view_as(g))
            offset += g.numel()
        return views


def ddp_hook(fn: Callable | None = None, *, host_staged: bool = True) -> Callable:
    """Give a hook the real annotations DDP's ``register_comm_hook`` checks, and run it on a host
    copy of a CUDA bucket when the group is Gloo (:func:`stages_on_host`); ``host_staged=False``
    for a hook whose collectives Gloo runs on CUDA tensors itself (all-reduce only: PowerSGD),
    which then compresses on the bucket's own device (a host copy would move the matrix products
    to the CPU).

    With ``from __future__ import annotations`` annotations are strings, and DDP refuses a hook
    whose ``bucket`` annotation is not ``dist.GradBucket`` (or whose return is not
    ``torch.futures.Future[torch.Tensor]``). Decorate every hook function with this.

    Gloo with CUDA buckets: the one host round trip of the design, and only there (NCCL groups and
    CPU buckets go straight to ``fn``): copy the bucket to the host (:class:`HostBucket`), run the
    exchange there, wait for it, copy the result back, and return a Future on the bucket's device.
    Cost: two copies of the bucket over PCIe per exchange, and no overlap with backward (Gloo
    itself stages CUDA all-reduces through the host the same way).
    """
    if fn is None:
        return functools.partial(ddp_hook, host_staged=host_staged)
    fn.__annotations__["bucket"] = dist.GradBucket
    fn.__annotations__["return"] = torch.futures.Future[torch.Tensor]
    if not host_staged:
        return fn

    @functools.wraps(fn)
    def hook(state: Any, bucket: dist.GradBucket) -> torch.futures.Future:
        buf = bucket.buffer() if hasattr(bucket, "buffer") else None
        if buf is None or not stages_on_host(buf):  # (no bucket: the hook names its own error)
            return fn(state, bucket)
        result = fn(state, HostBucket(bucket)).wait()
        buf.copy_(result)
        fut: torch.futures.Future = torch.futures.Future(devices=[buf.device] if buf.is_cuda else None)
        fut.set_result(buf)
        return fut

    return hook


class CommThread:
    """One daemon thread that runs submitted calls in FIFO order and completes their Futures.

    FIFO on every rank + DDP launching buckets in index order = the same collective order on every
    rank. Started lazily on first use (so it never exists across a fork). Its waits are the
    algorithms' own (each bounded by their deadline, see :mod:`flashsgd.comm.waits`). After a call
    fails, the ranks' collective sequences no longer match, so every later call (queued or
    submitted) fails at once with the same exception instead of waiting out its own deadline.
    """

    __slots__ = ("_queue", "_thread", "_error")

    def __init__(self) -> None:
        self._queue: queue.SimpleQueue = queue.SimpleQueue()
        self._thread: threading.Thread | None = None
        self._error: BaseException | None = None

    def submit(self, fn: Callable[[], Any]) -> torch.futures.Future:
        """Queue ``fn``; return a Future of its result, completed by the thread.

        A failure reaches DDP's C++ side as an error whose text starts with the exception's type
        and message (e.g. "PeerTimeout: rank 0: no data from peer rank 1 ..."): the returned Future
        is a ``.then()`` of the thread's, which re-raises inside the callback (it never blocks:
        the callback runs once the value is there). A bare Python-side exception would reach DDP
        as "Unable to cast <message> to Tensor".
        """
        if self._thread is None or not self._thread.is_alive():
            self._thread = threading.Thread(target=self._loop, name="flashsgd-comm", daemon=True)
            self._thread.start()
        fut: torch.futures.Future = torch.futures.Future()
        self._queue.put((fn, fut))
        return fut.then(_value)

    def _loop(self) -> None:
        while True:
            fn, fut = self._queue.get()
            if self._error is not None:
                fut.set_exception(self._error)
                continue
            try:
                fut.set_result(fn())
            except BaseException as exc:  # noqa: BLE001 - DDP re-raises it from fut.wait()
                self._error = exc
                fut.set_exception(exc)


def _value(fut: torch.futures.Future) -> Any:
    return fut.value()  # completed: returns the value or raises the thread's exception


class StatelessHookState:
    """State of a hook with nothing to checkpoint (``native``, ``noop``): empty state_dict.

    The step protocol of :mod:`flashsgd.comm.hook_step` is a no-op here: such a hook keeps nothing
    across steps, and its output is an average in which one rank's NaN reaches every rank (the
    step's agreed check sees it)."""

    __slots__ = ("name",)

    def __init__(self, name: str) -> None:
        self.name = name

    def use_scaler(self, scaler: Any) -> "StatelessHookState":
        """Nothing kept, so nothing to keep in true units: the scaler is not needed. Returns self."""
        return self

    def begin_step(self, grad_scale: torch.Tensor | None = None) -> None:
        """Nothing kept, nothing to unscale (:mod:`flashsgd.comm.hook_step`, Step 1)."""

    def nonfinite_inputs(self) -> torch.Tensor | None:
        """None: the output shows every rank's non-finite input (Step 3)."""
        return None

    def end_step(self, kept: bool) -> None:
        """Nothing to keep or put back (Step 4)."""

    def state_dict(self) -> dict:
        return {}

    def load_state_dict(self, state: dict) -> None:
        if state:
            raise ValueError(f"hook {self.name!r} has no state; got keys {sorted(state)}")

