"""Atomic, resumable checkpoints of a data-parallel run (loaded with ``weights_only=True``).

Layout of ``<out>/checkpoints``::

    step-00000120/shared.pt      rank 0: model, optimizer, step, epoch, sampler position, meta
    step-00000120/rank-00003.pt  every rank: its hook state (error-feedback residuals) and RNG states
    latest                       text: the name of the newest complete checkpoint directory

Writing (:func:`save`), collective over the run's group:

1. Every rank writes its file to ``<name>.tmp`` and renames it (``os.replace`` is atomic on POSIX):
   a reader never sees half a file.
2. Barrier: all ranks have written.
3. Rank 0 points ``latest`` at the new directory (temp + rename again) and deletes directories
   beyond the newest ``keep``. A crash at any point leaves ``latest`` at a complete checkpoint.

The replicated state (model, optimizer) is written once, by rank 0; the per-rank state is small.
Multi-node runs need ``out`` on storage every node sees (or at least each node's ranks' files).

Example::

    >>> save(ckpt_dir, step, shared={"model": ...}, local={"rng": rng_state()}, keep=2)  # doctest: +SKIP
    >>> shared, local = load(find_latest(ckpt_dir), rank, world_size)                    # doctest: +SKIP
"""

from __future__ import annotations

import os
import random
import shutil
from pathlib import Path
from typing import Any

import numpy as np
import torch
import torch.distributed as dist

FORMAT = 1


class CheckpointError(ValueError):
    """A checkpoint is missing, corrupt, or does not match this run."""


def _atomic_save(obj: Any, path: Path) -> None:
    tmp = path.with_name(path.name + f".tmp{os.getpid()}")
    torch.save(obj, tmp)
    os.replace(tmp, path)


def _atomic_text(text: str, path: Path) -> None:
    tmp = path.with_name(path.name + f".tmp{os.getpid()}")
    tmp.write_text(text)
    os.replace(tmp, path)


def rng_state() -> dict[str, Any]:
    """torch, numpy and Python RNG states as tensors / plain values (loadable with weights_only)."""
    np_state = np.random.get_state()
    return {"torch": torch.get_rng_state(),
            "numpy": [np_state[0], torch.from_numpy(np_state[1].astype(np.int64)), *map(
                lambda v: v.item() if hasattr(v, "item") else v, np_state[2:])],
            "python": random.getstate()}


def set_rng_state(state: dict[str, Any]) -> None:
    torch.set_rng_state(state["torch"])
    name, keys, *rest = state["numpy"]
    np.random.set_state((name, keys.numpy().astype(np.uint32), *rest))
    py = state["python"]
    random.setstate((py[0], tuple(py[1]), py[2]))


def save(ckpt_dir: str | Path, step: int, shared: dict[str, Any] | None, local: dict[str, Any],
         keep: int = 2, group: Any = None) -> Path:
    """Steps 1-3 (collective): write this rank's part; rank 0 also ``shared`` and ``latest``."""
    rank, world = dist.get_rank(), dist.get_world_size()
    root = Path(ckpt_dir)
    target = root / f"step-{step:08d}"
    target.mkdir(parents=True, exist_ok=True)
    # Step 1
    meta = {"format": FORMAT, "step": step, "world_size": world}
    if rank == 0:
        if shared is None:
            raise ValueError("rank 0 must pass the shared state")
        _atomic_save({"meta": meta, **shared}, target / "shared.pt")
    _atomic_save({"meta": meta, **local}, target / f"rank-{rank:05d}.pt")
    # Step 2
    dist.barrier(group=group)
    # Step 3
    if rank == 0:
        _atomic_text(target.name + "\n", root / "latest")
        done = sorted(p for p in root.glob("step-*") if p.is_dir())
        for old in done[:-max(1, keep)]:
            shutil.rmtree(old, ignore_errors=True)
    return target


def find_latest(ckpt_dir: str | Path) -> Path | None:
    """The directory ``latest`` points at, or None when there is no checkpoint yet."""
    pointer = Path(ckpt_dir) / "latest"
    if not pointer.is_file():
        return None
    target = Path(ckpt_dir) / pointer.read_text().strip()
    if not target.is_dir():
        raise CheckpointError(f"{pointer} points at {target.name!r}, which does not exist")
    return target


def _load(path: Path) -> dict[str, Any]:
    if not path.is_file():
        raise CheckpointError(f"checkpoint file {path} is missing")
    try:
        obj = torch.load(path, map_location="cpu", weights_only=True)
    except Exception as exc:  # noqa: BLE001 - any unpickling failure means a corrupt file
        raise CheckpointError(f"checkpoint file {path} is corrupt or not a flashsgd checkpoint "
                              f"({type(exc).__name__}: {str(exc).splitlines()[0][:200]})") from None
    if not isinstance(obj, dict) or obj.get("meta", {}).get("format") != FORMAT:
        raise CheckpointError(f"checkpoint file {path} is not a flashsgd checkpoint of format {FORMAT}")
    return obj


def load(target: str | Path, rank: int, world_size: int) -> tuple[dict[str, Any], dict[str, Any]]:
    """(shared, this rank's local state) of the checkpoint directory ``target``."""
    target = Path(target)
    if not target.is_dir():
        raise CheckpointError(f"checkpoint {target} is not a directory")
    shared = _load(target / "shared.pt")
    if shared["meta"]["world_size"] != world_size:
        raise CheckpointError(f"checkpoint {target} was written by {shared['meta']['world_size']} "
                              f"workers, this run has {world_size}; per-worker state (hook "
                              "residuals, sampler shards) cannot be remapped")
    local = _load(target / f"rank-{rank:05d}.pt")
    if local["meta"]["step"] != shared["meta"]["step"]:
        raise CheckpointError(f"checkpoint {target}: rank {rank}'s file is from step "
                              f"{local['meta']['step']}, shared.pt from {shared['meta']['step']}")
    return shared, local


def load_model_state(model: torch.nn.Module, state: dict[str, torch.Tensor], source: str) -> None:
    """``load_state_dict`` with a message naming the checkpoint and the mismatched keys/shapes."""
    own = model.state_dict()
    missing = sorted(set(own) - set(state))
    extra = sorted(set(state) - set(own))
    shapes = [k for k in own.keys() & state.keys() if own[k].shape != state[k].shape]
    if missing or extra or shapes:
        raise CheckpointError(
            f"checkpoint {source} does not match the model: missing {missing[:5]}, unexpected "
            f"{extra[:5]}, shape mismatch {[(k, tuple(state[k].shape), tuple(own[k].shape)) for k in shapes[:5]]}")
    model.load_state_dict(state)
