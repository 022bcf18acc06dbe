"""Pieces every DDP communication hook shares: completed Futures, DDP's annotations, the
communication thread, and the state of hooks with nothing to checkpoint.

DDP calls a hook ``hook(state, bucket) -> Future[Tensor]`` per gradient bucket
(PyTorch ``torch/distributed/algorithms/ddp_comm_hooks/default_hooks.py``); the dense hooks
(:mod:`flashsgd.comm.dense_hooks`) and the sparse hooks (:mod:`flashsgd.comm.sparse_hooks`) both
build on this module, and :mod:`flashsgd.comm.hooks` registers them by name.
"""

from __future__ import annotations

import queue
import threading
from typing import Any, Callable

import torch
import torch.distributed as dist

HookFactory = Callable[..., tuple[Any, Callable | None]]
"""``make(ddp_model, **options) -> (state, hook | None)``: what :data:`flashsgd.comm.hooks.HOOKS` holds."""


def completed_future(value: Any) -> torch.futures.Future:
    """A Future already holding ``value`` (what a synchronous hook returns to DDP)."""
    fut: torch.futures.Future = torch.futures.Future()
    fut.set_result(value)
    return fut


def ddp_hook(fn: Callable) -> Callable:
    """Give a hook the real annotations DDP's ``register_comm_hook`` checks.

    With ``from __future__ import annotations`` annotations are strings, and DDP refuses a hook
    whose ``bucket`` annotation is not ``dist.GradBucket`` (or whose return is not
    ``torch.futures.Future[torch.Tensor]``). Decorate every hook function with this.
    """
    fn.__annotations__["bucket"] = dist.GradBucket
    fn.__annotations__["return"] = torch.futures.Future[torch.Tensor]
    return fn


class CommThread:
    """One daemon thread that runs submitted calls in FIFO order and completes their Futures.

    FIFO on every rank + DDP launching buckets in index order = the same collective order on every
    rank. Started lazily on first use (so it never exists across a fork).
    """

    __slots__ = ("_queue", "_thread")

    def __init__(self) -> None:
        self._queue: queue.SimpleQueue = queue.SimpleQueue()
        self._thread: threading.Thread | None = None

    def submit(self, fn: Callable[[], Any]) -> torch.futures.Future:
        if self._thread is None or not self._thread.is_alive():
            self._thread = threading.Thread(target=self._loop, name="flashsgd-comm", daemon=True)
            self._thread.start()
        fut: torch.futures.Future = torch.futures.Future()
        self._queue.put((fn, fut))
        return fut

    def _loop(self) -> None:
        while True:
            fn, fut = self._queue.get()
            try:
                fut.set_result(fn())
            except BaseException as exc:  # noqa: BLE001 - DDP re-raises it from fut.wait()
                fut.set_exception(exc)


class StatelessHookState:
    """State of a hook with nothing to checkpoint (``native``, ``noop``): empty state_dict."""

    __slots__ = ("name",)

    def __init__(self, name: str) -> None:
        self.name = name

    def state_dict(self) -> dict:
        return {}

    def load_state_dict(self, state: dict) -> None:
        if state:
            raise ValueError(f"hook {self.name!r} has no state; got keys {sorted(state)}")

