"""Each rank's hook state in its own file, beside a trainer's checkpoint.

A sparse hook's error-feedback residuals (Shi et al. 2019; Lin et al. 2018), PowerSGD's error
memories (Vogels et al. 2019) and the sampled selection's RNG stream differ on every rank, and a
resumed run is exact only when each rank gets its own back (``rebuild_buckets`` then gives DDP the
final buckets before the first step: :func:`flashsgd.comm.hooks.rebuild_buckets`). A trainer's
checkpoint is rank 0's (Lightning writes one file; Accelerate's ``register_for_checkpointing``
saves the main process's copy). Gathering every rank's state into that file would grow it by one
model-sized residual per rank (ResNet-50 at 1,000 ranks: ~100 GB, written by one process), so each
rank writes and reads its own file in a directory beside the checkpoint::

    <dir>/rank0.pt, rank1.pt, ...     # {"hook", "rank", "world", "state": state.state_dict()}

Every rank must see ``<dir>`` at resume: a shared filesystem (as the trainer's own checkpoint
needs), or the same node for the same rank. A resume on another number of ranks regroups the
states where the hook can (:meth:`flashsgd.comm.sparse.state.SparseHookState.regroup`: residuals
averaged; not bit-identical, as for ``flashsgd train``).

Example::

    >>> save_rank_state(state, "ckpt/hook", "gtopk")                       # doctest: +SKIP
    >>> load_rank_state(state, "ckpt/hook", "gtopk")  # this rank's own     # doctest: +SKIP
"""

from __future__ import annotations

import os
import warnings
from pathlib import Path
from typing import Any

import torch

from flashsgd.comm.hook_common import rank_and_world


def rank_file(directory: str | os.PathLike, rank: int) -> Path:
    """The file of ``rank`` in ``directory``."""
    return Path(directory) / f"rank{rank}.pt"


def save_rank_state(state: Any, directory: str | os.PathLike, hook: str) -> Path:
    """Write this rank's ``state.state_dict()`` to ``directory/rank{r}.pt`` (atomically: a reader
    never sees half a file); returns the path. Every rank calls it (no collective)."""
    rank, world = rank_and_world() or (0, 1)
    path = rank_file(directory, rank)
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f".{path.name}.tmp{os.getpid()}")
    torch.save({"hook": hook, "rank": rank, "world": world, "state": state.state_dict()}, tmp)
    os.replace(tmp, path)
    return path


def _read(path: Path, hook: str) -> dict:
    doc = torch.load(path, map_location="cpu", weights_only=True)
    if doc.get("hook") != hook:
        raise ValueError(f"{path}: the state of hook {doc.get('hook')!r}, but this run registers {hook!r}; "
                         f"resume with the hook the checkpoint was written with")
    return doc


def load_rank_state(state: Any, directory: str | os.PathLike, hook: str, where: str = "") -> None:
    """Load this rank's own file of ``directory`` into ``state`` (``where``: what wrote it, for the
    messages). On another number of ranks than the one that saved it, every rank reads all the old
    files and the hook's ``regroup`` maps them (a warning: not bit-identical); a hook without one
    is a ValueError.

    Raises FileNotFoundError naming the missing file and what to do."""
    rank, world = rank_and_world() or (0, 1)
    path = rank_file(directory, rank)
    saved = sorted(Path(directory).glob("rank*.pt")) if Path(directory).is_dir() else []
    if not saved:
        raise FileNotFoundError(
            f"flashsgd hook state {path} not found{where}: the per-rank states are written beside the "
            f"checkpoint, one file per rank; copy that directory with the checkpoint, on a filesystem "
            f"every rank can read (docs/integrations.md)")
    if len(saved) == world and path.exists():
        doc = _read(path, hook)
        if doc["world"] == world:
            state.load_state_dict(doc["state"])
            return
    old = [_read(rank_file(directory, r), hook) for r in range(len(saved))]
    old_world = old[0]["world"]
    regroup = getattr(type(state), "regroup", None)
    if len(saved) != old_world or regroup is None:
        raise ValueError(
            f"{directory}{where}: {len(saved)} rank state file(s) of a {old_world}-rank run, this run has "
            f"{world} rank(s)" + ("" if regroup else f"; hook {hook!r} cannot regroup its state onto "
                                  f"another number of ranks: resume on {old_world} ranks"))
    if rank == 0:
        warnings.warn(f"flashsgd hook {hook!r}: the state of {old_world} ranks regrouped onto {world} "
                      f"(residuals averaged): the resumed run continues, not bit for bit", UserWarning)
    state.load_state_dict(regroup([d["state"] for d in old], rank, world))
