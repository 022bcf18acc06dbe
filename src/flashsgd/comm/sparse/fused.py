"""One bucket's compression with the fewest passes over memory: error feedback + threshold top-k.

Papers: Shi et al. 2019 (gTop-k S-SGD, arXiv 1901.04359) for the error-fed top-k; Li & Hoefler,
PPoPP'22 (Ok-Topk) for keeping the selection threshold across iterations.

Per bucket of m elements, in memory passes (one pass = one ``torch.add`` over the bucket: read
2 x 4m, write 4m bytes):

1. ``acc = residual + grad`` (1 pass): in place for :func:`compress_` (the residual buffer becomes
   acc), into another buffer for the hooks (:func:`add_block_maxima`: the residual a step started
   from stays intact until the step is kept, :mod:`flashsgd.comm.hook_step`).
2. Block maxima of |acc| (two read-only reductions, ~2/3 pass), fused with step 1 into one pass
   when ``compiled=True`` and ``torch.compile`` works.
3. Exact top-k from the block maxima and a kept threshold
   (:func:`~flashsgd.comm.sparse.select.topk_threshold`): O(k * block) entries read.
4. After the exchange, the caller zeroes the counted entries of the residual in place
   (``residual.index_fill_(0, counted, 0)``, O(k)): the buffer is the new residual.
5. The caller scatters the result into a zeroed output (the zero fill: 1/3 pass).

Floor: 2 (eager) or ~1.4 (fused) passes, against ~3.5 for add + |x| + compare + nonzero.

Example::

    >>> reuse = ThresholdReuse(tolerance=0.25)
    >>> values, indices = compress_(residual, bucket_grad, k, reuse=reuse, key=bucket_index)
    >>> ...exchange...; residual.index_fill_(0, counted, 0)
"""

from __future__ import annotations

import warnings
from typing import Callable

import torch

from flashsgd.comm.sparse.select import (ThresholdReuse, check_selection, auto_block,
                                         block_maxima, topk_threshold)

__all__ = ["add_block_maxima_", "add_block_maxima", "compress_", "ThresholdReuse", "compiled_available"]

_COMPILED: dict = {}  # name -> compiled add+maxima (None after a failure); "ran": one succeeded once


def _add_block_maxima_(residual: torch.Tensor, grad: torch.Tensor, block: int) -> torch.Tensor:
    """Steps 1-2: residual += grad in place; return the block maxima of the sum."""
    residual.add_(grad)
    return block_maxima(residual, block)


def _sum_block_maxima(residual: torch.Tensor, grad: torch.Tensor,
                      block: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Steps 1-2 into a new tensor: (residual + grad, the block maxima of the sum)."""
    acc = residual + grad
    return acc, block_maxima(acc, block)


_EAGER = {"in_place": _add_block_maxima_, "new": _sum_block_maxima}


def _compiled_fn(kind: str = "in_place") -> Callable | None:
    """``torch.compile`` of :data:`_EAGER` [kind], or None when compiling is unavailable."""
    if kind not in _COMPILED:
        try:
            _COMPILED[kind] = torch.compile(_EAGER[kind], dynamic=False)
        except Exception as exc:  # noqa: BLE001 - any compile failure falls back to eager
            warnings.warn(f"torch.compile unavailable ({type(exc).__name__}: {exc}); eager passes",
                          RuntimeWarning, stacklevel=3)
            _COMPILED[kind] = None
    return _COMPILED[kind]


def compiled_available() -> bool:
    """Whether the fused (compiled) steps 1-2 can be used in this process."""
    return _compiled_fn() is not None


def compress_(residual: torch.Tensor, grad: torch.Tensor, k: int, *,
              reuse: ThresholdReuse | None = None, key=0, compiled: bool = False,
              block: int | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """Error feedback and exact top-k of one bucket: ``residual += grad``, then select k of it.

    Steps 1-3 of the module docstring; steps 4-5 belong to the caller (they need the exchange's
    result). ``residual`` holds the accumulated gradient afterwards.

    Args:
        residual: flat floating-point residual of the bucket (updated in place).
        grad: the bucket's gradient, same shape and dtype.
        k: entries to select, 1 <= k <= numel.
        reuse: thresholds kept across iterations (None: estimate each call).
        key: which kept threshold (the bucket index).
        compiled: fuse steps 1-2 with ``torch.compile``; a compile or run failure warns once
            and falls back to the eager passes (same result: the maxima are exact).
        block: entries per block maximum (None: ``auto_block``).

    Returns:
        ``(values, indices)``: the k selected values of the accumulated gradient, int64 indices
        ascending (ties at the k-th magnitude to the lower index).
    """
    check_selection(residual, k)
    if grad.shape != residual.shape or grad.dtype != residual.dtype:
        raise ValueError(f"grad must match residual: got {tuple(grad.shape)} {grad.dtype}, "
                         f"residual {tuple(residual.shape)} {residual.dtype}")
    block = auto_block(residual.numel(), k) if block is None else block
    if block is None or 2 * k * block > residual.numel():  # no block maxima used
        residual.add_(grad)
        return topk_threshold(residual, k, reuse=reuse, key=key, block=block)
    bmax = add_block_maxima_(residual, grad, block, compiled)
    return topk_threshold(residual, k, reuse=reuse, key=key, block=block, bmax=bmax)


def add_block_maxima_(residual: torch.Tensor, grad: torch.Tensor, block: int,
                      compiled: bool = False) -> torch.Tensor:
    """Steps 1-2 of the module docstring: ``residual += grad`` in place, then the block maxima of
    the sum (:func:`~flashsgd.comm.sparse.select.block_maxima`); one fused pass with
    ``compiled=True`` (falls back to the eager passes, with a warning, if compiling fails)."""
    bmax = None
    fn = _compiled_fn("in_place") if compiled else None
    if fn is not None:
        # compiling happens in the first call: keep a copy until one call has succeeded, so a
        # failure there cannot leave a half-done update
        before = None if _COMPILED.get("ran") else residual.clone()
        try:
            bmax = fn(residual, grad, block)
            _COMPILED["ran"] = True
        except Exception as exc:  # noqa: BLE001 - fall back to eager
            warnings.warn(f"compiled compression failed ({type(exc).__name__}: {exc}); eager passes",
                          RuntimeWarning, stacklevel=2)
            _COMPILED["in_place"] = None
            if before is not None:
                residual.copy_(before)
            bmax = None
    if bmax is None:
        bmax = _add_block_maxima_(residual, grad, block)
    return bmax


def add_block_maxima(residual: torch.Tensor, grad: torch.Tensor, block: int,
                     compiled: bool = False, out: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """Steps 1-2 into a new tensor: ``(acc, bmax)`` with ``acc = residual + grad`` (``residual``
    is left as it was: the hooks keep a step's starting memory until the step is kept) and the
    block maxima of acc; one fused pass with ``compiled=True`` (eager, with a warning, if
    compiling fails: nothing was written, so there is nothing to undo). Same memory traffic as
    the in-place :func:`add_block_maxima_` (read 2, write 1 bucket). ``out``: the eager path
    writes acc there (a buffer of the caller's: no fresh allocation); the compiled one returns
    its own."""
    fn = _compiled_fn("new") if compiled else None
    if fn is not None:
        try:
            return fn(residual, grad, block)
        except Exception as exc:  # noqa: BLE001 - fall back to eager
            warnings.warn(f"compiled compression failed ({type(exc).__name__}: {exc}); eager passes",
                          RuntimeWarning, stacklevel=2)
            _COMPILED["new"] = None
    if out is None:
        return _sum_block_maxima(residual, grad, block)
    acc = torch.add(residual, grad, out=out)
    return acc, block_maxima(acc, block)
