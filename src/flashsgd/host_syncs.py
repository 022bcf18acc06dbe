"""Counting host synchronizations: the calls that make the CPU wait for the GPU.

A training step that reads a device value on the host (``.item()``, ``float(t)``, ``if t:``, a
boolean mask, ``nonzero``, a blocking copy) stops the CPU until the GPU has run everything queued
before it; the CPU then cannot queue the next kernels ahead, and the GPU idles while Python runs.
flashsgd's step promises one such wait (:mod:`flashsgd.train.step`); this module counts them, on
both kinds of machine, with one context manager:

* CUDA: torch reports every synchronizing call itself (``torch.cuda.set_sync_debug_mode("warn")``:
  ``item``, ``nonzero``, blocking copies between host and device, ``synchronize``, ...);
  :func:`count_host_syncs` counts those warnings.
* CPU: nothing waits, so the same promise is checked on the calls that *would* wait were the
  tensors on CUDA, seen by a ``TorchFunctionMode``: :data:`READS` (a device value read on the
  host), ``nonzero``-like calls whose output size depends on the data (:data:`DATA_SIZED`),
  indexing with a boolean mask, ``repeat_interleave`` without ``output_size``, and
  ``torch.tensor``/``as_tensor`` with an explicit ``device`` (a blocking host-to-device copy on
  CUDA). Limits: a mode sees Python-level calls of the calling thread only, and not the DDP hook,
  which autograd's engine calls outside it: :func:`watched` wraps a hook so that its calls count
  too (torch's C++ kernels never read a CUDA value on the host unless documented as
  synchronizing).

Example::

    with count_host_syncs(device) as syncs:
        step(batch, global_batch=256)
    print(syncs.count, syncs.calls)      # 1 ['tolist']
"""

from __future__ import annotations

import contextlib
import os
import sys
import warnings
from dataclasses import dataclass, field
from typing import Iterator

import torch
from torch.overrides import TorchFunctionMode

READS = frozenset({"item", "tolist", "__bool__", "__float__", "__int__", "__index__", "numpy"})
"""Tensor methods that return a device value to Python: a host sync on CUDA."""

DATA_SIZED = frozenset({"nonzero", "argwhere", "masked_select", "unique", "unique_consecutive"})
"""Calls whose output size depends on the values: the host must read them first (a sync on CUDA)."""


CUDA_SYNC_WARNING = "called a synchronizing CUDA operation"
"""The warning torch gives at each synchronizing call under ``set_sync_debug_mode("warn")``
(c10/cuda ``warn_or_error_on_sync``). Torch's first ``set_sync_debug_mode`` of a process also warns,
once, that the mode "is a prototype feature and does not yet detect all synchronizing operations":
not a synchronization (counted as one on an H100 before this filter)."""


@dataclass
class SyncCount:
    """The synchronizing calls seen: how many, which (names in call order) and where (the calling
    line outside torch, on CPU)."""

    calls: list[str] = field(default_factory=list)
    sites: list[str] = field(default_factory=list)

    @property
    def count(self) -> int:
        return len(self.calls)


_AS_IF_CUDA = [False]


def device_path(t: torch.Tensor) -> bool:
    """Whether code serving ``t`` must take its path that never reads a device value on the host:
    ``t`` is on CUDA, or the caller is inside :func:`as_if_cuda` (how a CPU test checks that path).
    On the CPU path a read costs nothing and may save work (a branch on a flag)."""
    return t.is_cuda or _AS_IF_CUDA[0]


def path_device_type(t: torch.Tensor) -> str:
    """The device type whose code path serves ``t``: ``"cuda"`` where :func:`device_path` is True
    (so a choice made by device, such as the hooks' ``selection="auto"``, follows the path a CPU
    test runs), else ``t``'s own."""
    return "cuda" if device_path(t) else t.device.type


@contextlib.contextmanager
def as_if_cuda() -> Iterator[None]:
    """Inside: :func:`device_path` is True for CPU tensors too, so the CUDA code path runs on a CPU
    and :func:`count_host_syncs` counts what it would wait for on a GPU."""
    before, _AS_IF_CUDA[0] = _AS_IF_CUDA[0], True
    try:
        yield
    finally:
        _AS_IF_CUDA[0] = before


def _would_sync(name: str, args: tuple, kwargs: dict) -> bool:
    """Whether the call ``name(*args, **kwargs)`` synchronizes when its tensors are on CUDA."""
    if name in READS or name in DATA_SIZED:
        return True
    if name == "__getitem__" and len(args) > 1:
        index = args[1] if isinstance(args[1], tuple) else (args[1],)
        return any(isinstance(i, torch.Tensor) and i.dtype == torch.bool for i in index)
    if name == "repeat_interleave":
        return kwargs.get("output_size") is None and isinstance(args[1] if len(args) > 1 else
                                                                kwargs.get("repeats"), torch.Tensor)
    if name in ("tensor", "as_tensor"):
        return kwargs.get("device") is not None
    return False


_ACTIVE: list[SyncCount] = []  # the counts open on CPU (watched hooks add to the innermost)


def _caller() -> str:
    """``file:line`` of the innermost frame outside torch (the line that asked for the value)."""
    frame = sys._getframe(2)
    while frame is not None and (f"{os.sep}torch{os.sep}" in frame.f_code.co_filename
                                 or frame.f_code.co_filename == __file__):
        frame = frame.f_back
    if frame is None:
        return "?"
    return f"{os.path.basename(frame.f_code.co_filename)}:{frame.f_lineno}"


class _CountingMode(TorchFunctionMode):
    def __init__(self, seen: SyncCount) -> None:
        super().__init__()
        self.seen = seen

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        name = getattr(func, "__name__", "")
        if _would_sync(name, args, kwargs):
            self.seen.calls.append(name)
            self.seen.sites.append(_caller())
        return func(*args, **kwargs)


@contextlib.contextmanager
def count_host_syncs(device: torch.device | str = "cpu") -> Iterator[SyncCount]:
    """Count the host synchronizations inside the ``with`` block (module docstring): torch's own
    sync debug warnings on a CUDA ``device``, the calls that would synchronize on CUDA elsewhere."""
    seen = SyncCount()
    if torch.device(device).type == "cuda":
        previous = torch.cuda.get_sync_debug_mode()
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            torch.cuda.set_sync_debug_mode("warn")
            try:
                yield seen
            finally:
                torch.cuda.set_sync_debug_mode(previous)
        for w in caught:
            if str(w.message).startswith(CUDA_SYNC_WARNING):  # not the mode's own "prototype" notice
                seen.calls.append(str(w.message).splitlines()[0])
                # the Python line that called into torch (a backward's warnings: the backward call)
                seen.sites.append(f"{os.path.basename(w.filename)}:{w.lineno}")
        return
    _ACTIVE.append(seen)
    try:
        with _CountingMode(seen):
            yield seen
    finally:
        _ACTIVE.remove(seen)


def watched(hook):
    """``hook`` (a DDP communication hook), its calls counted by the innermost open CPU
    :func:`count_host_syncs` (on any thread); unchanged behaviour otherwise."""
    def call(state, bucket):
        if not _ACTIVE:
            return hook(state, bucket)
        with _CountingMode(_ACTIVE[-1]):
            return hook(state, bucket)
    return call
