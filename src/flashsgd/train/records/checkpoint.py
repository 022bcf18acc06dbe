"""Atomic, resumable checkpoints of a data-parallel run (loaded with ``weights_only=True``).

Layout of ``<out>/checkpoints``::

    step-00000120/shared.pt      rank 0: model, optimizer, step, epoch, sampler position, meta
    step-00000120/rank-00003.pt  every rank: its hook state (error-feedback residuals) and RNG states
    step-00000120/manifest.json  rank 0: every file's size and CRC-32, as written
    latest                       text: the name of the newest complete checkpoint directory

Writing (:func:`save`), collective over the run's group:

1. Every rank writes its file to ``<name>.tmp<pid>`` and renames it (``os.replace`` is atomic on
   POSIX): a reader never sees half a file. The bytes are CRC-32'd as they are written.
2. All-gather of every file's (size, CRC-32): all ranks have written.
3. Rank 0 removes files in the new directory that are not this run's (rank files beyond this
   world size, temp files of a killed writer), writes ``manifest.json`` (the sizes and CRCs), points
   ``latest`` at the directory (temp + rename again) and prunes (:func:`prune`): of the checkpoints at or below this step it keeps the newest ``keep``;
   checkpoints above this step are left alone (they are not this run's: an older run in the same
   directory), so ``latest`` never names a deleted directory. A crash at any point leaves
   ``latest`` at a complete checkpoint.

Intact (:func:`damage`): every file present, of the size and CRC-32 the manifest records (one
read of each file, which is then unpickled from the bytes read: a flipped byte anywhere, padding
included, is found; ``torch.load`` itself checks no record), and loadable with
``weights_only=True`` (a file holding anything but tensors and plain values is refused, never
loaded unsafely). A checkpoint of a flashsgd before the manifest is checked record by record (the
CRC-32 torch's zip writer keeps per record: ``zipfile.testzip``).

Belonging: a run's checkpoints carry its identity (``meta["run"]`` in every file: ``id``, written
at the run's start, ``settings``, the digest of the settings that can change results, and
``config``, the run's config text; :func:`flashsgd.train.records.rundir.identity`). Given the run's id, a
checkpoint of another run (a step directory copied in, a rank file from elsewhere) counts as
damaged: skipped with a note like a corrupt one. Checkpoints without an identity (a flashsgd
before it, or ``save`` called without ``run``) belong to any run.

Resuming (:func:`resume_point`): one rule, the newest intact checkpoint, whatever ``latest``
says (at or below the step it names, when it names one). When ``latest`` is missing, empty or
invalid, or the checkpoint it names is damaged (a file missing, truncated, altered or not a
checkpoint), the
run resumes from that checkpoint and says so in a note for the caller to print: every checkpoint
continues the run exactly, so the only cost is the steps between the two. Only when ``latest``
names a checkpoint and none is intact is it an error. The decision reads
only the files, so every rank (or the launcher, once) reaches the same one. An explicitly named
damaged checkpoint (:func:`load`) is an error that offers the newest older intact one.

The replicated state (model, optimizer) is written once, by rank 0; the per-rank state is small.
Multi-node runs need ``out`` on storage every node sees (or at least each node's ranks' files).

A checkpoint of the built-in ResNets' earlier parameter names (``last_bn``, ``shortcut``, before they
took torchvision's) loads with its keys renamed and one printed note (:func:`legacy_key_map`); the
parameter order is the same, so optimizer and hook state (by parameter position) are unaffected.
The RNG states include the current CUDA device's generator (:func:`rng_state`).

Example::

    >>> save(ckpt_dir, step, shared={"model": ...}, local={"rng": rng_state()}, keep=2)  # doctest: +SKIP
    >>> target, note = resume_point(ckpt_dir)                                            # doctest: +SKIP
    >>> shared, local = load(target, rank, world_size)                                   # doctest: +SKIP
"""

from __future__ import annotations

import io
import json
import os
import random
import re
import shutil
import zipfile
import zlib
from pathlib import Path
from typing import Any, Iterable

import numpy as np
import torch
import torch.distributed as dist

from flashsgd.fmt import plural

FORMAT = 1
MANIFEST = "manifest.json"
STEP_DIR = re.compile(r"step-(\d{8,})")  # f"step-{step:08d}"


class CheckpointError(ValueError):
    """A checkpoint is missing, corrupt, or does not match this run."""


class WorldSizeChanged(CheckpointError):
    """The checkpoint was written by another number of workers (``saved_world``)."""

    def __init__(self, message: str, saved_world: int) -> None:
        super().__init__(message)
        self.saved_world = saved_world


class _Damaged(CheckpointError):
    """A checkpoint file is missing, unreadable or not a flashsgd checkpoint (not a mismatch)."""


class _Checksummed:
    """A file being written, its bytes counted and CRC-32'd on the way (what ``torch.save`` writes
    into a file object goes through ``write``)."""

    def __init__(self, f: Any) -> None:
        self.f, self.size, self.crc = f, 0, 0
        self.failed: OSError | None = None  # the OS's refusal (a full disk), which torch.save hides

    def write(self, data: Any) -> int:
        self.crc = zlib.crc32(data, self.crc)
        self.size += memoryview(data).nbytes
        try:
            return self.f.write(data)
        except OSError as exc:
            self.failed = exc
            raise

    def flush(self) -> None:
        self.f.flush()


def _write_atomic(write: Any, path: Path) -> tuple[int, int]:
    """``write(file)`` into ``<path>.tmp<pid>``, then rename it to ``path``; returns the file's
    (size, CRC-32). An OSError (a full disk: ENOSPC) names ``path`` and leaves no temp file; a
    write the OS refused inside ``torch.save`` (which reports it as "[enforce fail at
    inline_container.cc] ... unexpected pos") is raised as that OSError."""
    tmp = path.with_name(path.name + f".tmp{os.getpid()}")
    out = None
    try:
        with open(tmp, "wb") as f:
            out = _Checksummed(f)
            write(out)
        os.replace(tmp, path)
    except Exception as exc:
        tmp.unlink(missing_ok=True)
        # torch.save reports a failed write as "[enforce fail at inline_container.cc] unexpected
        # pos": the OS's error (ENOSPC) is the cause, so it is what is raised, naming the file
        failed = exc if isinstance(exc, OSError) else getattr(out, "failed", None)
        if failed is None:
            raise
        if failed.filename is not None and failed is exc:
            raise
        raise OSError(failed.errno, failed.strerror or str(failed), str(path)) from exc
    return out.size, out.crc


def _atomic_save(obj: Any, path: Path) -> tuple[int, int]:
    return _write_atomic(lambda f: torch.save(obj, f), path)


def _atomic_text(text: str, path: Path) -> None:
    _write_atomic(lambda f: f.write(text.encode()), path)


def rng_state() -> dict[str, Any]:
    """torch (CPU, and CUDA's current device once CUDA is initialised), numpy and Python RNG states
    as tensors / plain values (loadable with weights_only).

    The CUDA generator is saved only when CUDA is initialised (``torch.cuda.is_initialized()``):
    before that nothing has drawn from it, and reading it would create a CUDA context on device 0
    in every rank of a CPU run on a GPU machine. It is the generator of the current device, the one
    a rank bound to its GPU draws from (``torch.cuda.get_rng_state``: a CPU uint8 tensor).
    """
    np_state = np.random.get_state()
    state = {"torch": torch.get_rng_state(),
             "numpy": [np_state[0], torch.from_numpy(np_state[1].astype(np.int64)), *map(
                 lambda v: v.item() if hasattr(v, "item") else v, np_state[2:])],
             "python": random.getstate()}
    if torch.cuda.is_initialized():
        state["cuda"] = torch.cuda.get_rng_state()
    return state


def set_rng_state(state: dict[str, Any]) -> None:
    """Restore :func:`rng_state` (the CUDA part into the current device's generator).

    Across devices it never fails:

    - written with CUDA, restored where CUDA is not available: the CUDA state is ignored (there is
      no CUDA generator); CPU, numpy and Python streams are restored.
    - written without a CUDA state (a CPU run, or CUDA not yet initialised), restored where CUDA is
      available: the CUDA generator keeps what this process's seeding gave it
      (``torch.manual_seed`` seeds every CUDA device), so CUDA random draws after the resume are not
      the uninterrupted run's. CPU, numpy and Python streams are restored.
    - both with CUDA: restored exactly, also before CUDA is initialised (torch queues the call).
    """
    torch.set_rng_state(state["torch"])
    name, keys, *rest = state["numpy"]
    np.random.set_state((name, keys.numpy().astype(np.uint32), *rest))
    py = state["python"]
    random.setstate((py[0], tuple(py[1]), py[2]))
    if state.get("cuda") is not None and torch.cuda.is_available():
        torch.cuda.set_rng_state(state["cuda"])


def _check_keep(keep: int) -> None:
    if not isinstance(keep, int) or keep < 1:
        raise ValueError(f"keep must be an integer >= 1 (the checkpoint just written stays), "
                         f"got {keep!r}")


def save(ckpt_dir: str | Path, step: int, shared: dict[str, Any] | None, local: dict[str, Any],
         keep: int = 2, group: Any = None, run: dict[str, str] | None = None) -> Path:
    """Steps 1-3 (collective): write this rank's part; rank 0 also ``shared`` and ``latest``.

    ``keep`` (>= 1): checkpoints at or below ``step`` kept, this one included (:func:`prune`).
    ``run``: the run's identity (module docstring, "Belonging"), recorded in every file.
    """
    _check_keep(keep)
    rank, world = dist.get_rank(), dist.get_world_size()
    root = Path(ckpt_dir)
    target = root / f"step-{step:08d}"
    target.mkdir(parents=True, exist_ok=True)
    # Step 1
    meta = {"format": FORMAT, "step": step, "world_size": world}
    if run is not None:
        meta["run"] = dict(run)
    written = {}  # file name -> [size, CRC-32]
    if rank == 0:
        if shared is None:
            raise ValueError("rank 0 must pass the shared state")
        written["shared.pt"] = _atomic_save({"meta": meta, **shared}, target / "shared.pt")
    name = f"rank-{rank:05d}.pt"
    written[name] = _atomic_save({"meta": meta, **local}, target / name)
    # Step 2
    every: list[Any] = [None] * world
    dist.all_gather_object(every, written, group=group)
    # Step 3
    if rank == 0:
        _remove_strays(target, world)
        files = {n: {"bytes": size, "crc32": crc} for part in every for n, (size, crc) in part.items()}
        _atomic_text(json.dumps({"format": FORMAT, "step": step, "files": files}, indent=1) + "\n",
                     target / MANIFEST)
        _atomic_text(target.name + "\n", root / "latest")
        prune(root, step, keep)
    return target


def _remove_strays(target: Path, world_size: int) -> None:
    """Files in ``target`` that this run did not write: another world size's rank files (an older
    run's checkpoint of the same step), temp files of a writer killed before its rename."""
    for path in target.iterdir():
        rank_file = re.fullmatch(r"rank-(\d+)\.pt", path.name)
        if ".tmp" in path.name or (rank_file and int(rank_file.group(1)) >= world_size):
            path.unlink(missing_ok=True)


def step_dirs(ckpt_dir: str | Path) -> list[tuple[int, Path]]:
    """``(step, directory)`` of every ``step-NNNNNNNN`` directory, by step."""
    found = []
    for path in Path(ckpt_dir).glob("step-*"):
        match = STEP_DIR.fullmatch(path.name)
        if match and path.is_dir():
            found.append((int(match.group(1)), path))
    return sorted(found)


def prune(ckpt_dir: str | Path, step: int, keep: int) -> list[Path]:
    """Delete the checkpoints at or below ``step`` beyond the newest ``keep`` (>= 1); return them.

    Checkpoints above ``step`` are never touched: they are not this run's, and ``step`` itself
    (the one ``latest`` names) is always among those kept.
    """
    _check_keep(keep)
    mine = [path for s, path in step_dirs(ckpt_dir) if s <= step]
    old = mine[:-keep]
    for path in old:
        shutil.rmtree(path, ignore_errors=True)
    return old


def _read_pointer(ckpt_dir: Path) -> tuple[Path | None, int | None, str | None]:
    """What ``latest`` says: ``(directory, step, None)`` when it names a checkpoint directory, else
    ``(None, step it names or None, what is wrong)``; ``(None, None, None)`` without ``latest``."""
    pointer = ckpt_dir / "latest"
    if not pointer.is_file():
        return None, None, None
    name = pointer.read_text().strip()
    if not name:
        return None, None, f"{pointer} is empty (it should name the newest checkpoint directory, step-NNNNNNNN)"
    match = STEP_DIR.fullmatch(name)
    target = ckpt_dir / name
    if not match:
        problem = "which is not a checkpoint name (step-NNNNNNNN)"
    elif not target.is_dir():
        problem = "which does not exist"
    elif not (target / "shared.pt").is_file():
        problem = "which is not a checkpoint (no shared.pt)"
    else:
        return target, int(match.group(1)), None
    return None, int(match.group(1)) if match else None, f"{pointer} names {name!r}, {problem}"


def find_latest(ckpt_dir: str | Path) -> Path | None:
    """The checkpoint a resume continues from (:func:`resume_point`), or None when there is none."""
    return resume_point(ckpt_dir)[0]


def _manifest(target: Path) -> dict[str, dict[str, int]] | None:
    """``{file: {"bytes", "crc32"}}`` of ``target``'s manifest; None when it has none (a checkpoint
    of a flashsgd before the manifest, or hand-made); _Damaged when it is unreadable."""
    path = target / MANIFEST
    if not path.is_file():
        return None
    try:
        files = json.loads(path.read_text())["files"]
        return {str(n): {"bytes": int(f["bytes"]), "crc32": int(f["crc32"])} for n, f in files.items()}
    except (OSError, ValueError, KeyError, TypeError, AttributeError) as exc:
        raise _Damaged(f"checkpoint manifest {path} is corrupt ({type(exc).__name__}: {exc})") from None


UNSAFE = "Weights only load failed"  # torch's message when weights_only refuses a file's contents


def _load(path: Path, manifest: dict[str, dict[str, int]] | None = None) -> dict[str, Any]:
    """The checkpoint file ``path``, read once: checked against its ``manifest`` entry (size and
    CRC-32) or, without a manifest, record by record (the zip's own CRC-32s), then unpickled with
    ``weights_only=True`` from the bytes read. _Damaged names the file and what is wrong."""
    if not path.is_file():
        raise _Damaged(f"checkpoint file {path} is missing")
    try:
        data = path.read_bytes()
    except OSError as exc:
        raise _Damaged(f"checkpoint file {path} cannot be read ({exc.strerror or exc})") from None
    if manifest is not None:
        want = manifest.get(path.name)
        if want is None:
            raise _Damaged(f"checkpoint file {path} is not in its manifest ({path.parent / MANIFEST})")
        if len(data) != want["bytes"]:
            raise _Damaged(f"checkpoint file {path} is {len(data):,} bytes, {want['bytes']:,} were written "
                           "(truncated or overwritten)")
        if zlib.crc32(data) != want["crc32"]:
            raise _Damaged(f"checkpoint file {path} is corrupt: its CRC-32 differs from the one "
                           f"written ({path.parent / MANIFEST}); a byte changed on disk")
    else:
        try:
            with zipfile.ZipFile(io.BytesIO(data)) as archive:
                bad = archive.testzip()
        except (zipfile.BadZipFile, OSError, ValueError, EOFError, zlib.error) as exc:
            raise _Damaged(f"checkpoint file {path} is corrupt or not a flashsgd checkpoint "
                           f"({type(exc).__name__}: {exc})") from None
        if bad is not None:
            raise _Damaged(f"checkpoint file {path} is corrupt: its record {bad} fails its CRC-32 check")
    try:
        obj = torch.load(io.BytesIO(data), map_location="cpu", weights_only=True)
    except Exception as exc:  # noqa: BLE001 - any unpickling failure means a corrupt file
        if UNSAFE in str(exc):  # never repeat torch's advice to load it unsafely
            raise _Damaged(f"checkpoint file {path} holds objects other than tensors and plain values, "
                           "which a flashsgd checkpoint never does; refused (loading it could run "
                           "arbitrary code)") from None
        reason = (str(exc).splitlines() or [""])[0][:200]  # an empty file gives an empty message
        detail = f"{type(exc).__name__}: {reason}" if reason else type(exc).__name__
        raise _Damaged(f"checkpoint file {path} is corrupt or not a flashsgd checkpoint "
                       f"({detail})") from None
    if not isinstance(obj, dict) or obj.get("meta", {}).get("format") != FORMAT:
        raise _Damaged(f"checkpoint file {path} is not a flashsgd checkpoint of format {FORMAT}")
    return obj


def run_id(meta: dict[str, Any]) -> str | None:
    """The run id a checkpoint file's ``meta`` records (None: a checkpoint without identity)."""
    run = meta.get("run")
    return run.get("id") if isinstance(run, dict) else None


def _load_checked(target: Path, rank: int, world_size: int | None = None,
                  shared: dict[str, Any] | None = None) -> tuple[dict[str, Any], dict[str, Any] | None]:
    """(shared, rank ``rank``'s file or None when ``world_size`` differs from the writer's),
    each checked (:func:`_load`) and of the same step; ``shared``: already loaded."""
    manifest = _manifest(target)
    if shared is None:
        shared = _load(target / "shared.pt", manifest)
    if world_size is not None and shared["meta"]["world_size"] != world_size:
        return shared, None
    local = _load(target / f"rank-{rank:05d}.pt", manifest)
    if local["meta"]["step"] != shared["meta"]["step"]:
        raise _Damaged(f"checkpoint {target}: rank {rank}'s file is from step "
                       f"{local['meta']['step']}, shared.pt from {shared['meta']['step']}")
    if run_id(local["meta"]) != run_id(shared["meta"]):
        raise _Damaged(f"checkpoint {target}: rank {rank}'s file is from another run (run id "
                       f"{run_id(local['meta'])}, shared.pt's {run_id(shared['meta'])})")
    return shared, local


def _inspect(target: Path, run: str | None = None) -> tuple[str | None, dict[str, Any] | None]:
    """(what is wrong with checkpoint directory ``target`` or None, shared.pt's ``meta`` when
    intact): :func:`damage`, which also returns the meta the files record."""
    try:
        shared, _ = _load_checked(target, 0)
        for r in range(1, shared["meta"]["world_size"]):
            _load_checked(target, r, shared=shared)
    except _Damaged as exc:
        return str(exc), None
    theirs = run_id(shared["meta"])
    if run is not None and theirs is not None and theirs != run:
        return (f"checkpoint {target} belongs to another run (its run id {theirs}, this run's "
                f"{run}): copied from elsewhere"), None
    return None, shared["meta"]


def damage(target: str | Path, run: str | None = None) -> str | None:
    """What is wrong with the files of checkpoint directory ``target``, or None when it is intact:
    every file of it read once and checked (module docstring, "Intact"), the writer's every rank
    file present, of the same step and the same run; ``run``: this run's id, which a checkpoint
    with an identity must record ("Belonging")."""
    return _inspect(Path(target), run)[0]


def _newest_intact(ckpt_dir: Path, below: int | None,
                   run: str | None = None) -> tuple[Path | None, dict[str, Any] | None]:
    """(the newest intact checkpoint of run ``run`` (below step ``below``, when given), its meta)."""
    for s, path in reversed(step_dirs(ckpt_dir)):
        if below is None or s < below:
            problem, meta = _inspect(path, run)
            if problem is None:
                return path, meta
    return None, None


def _intact_hint(ckpt_dir: Path, below: int | None) -> str:
    older = _newest_intact(ckpt_dir, below)[0]
    return (f"; the newest intact checkpoint{' before it' if below is not None else ''} is "
            f"{older}: resume from it explicitly, or start over in a new directory" if older else "")


def verify(target: str | Path) -> dict[str, Any]:
    """shared.pt's ``meta`` (step, world size, the run's identity) when checkpoint directory
    ``target`` is intact (:func:`damage`); else CheckpointError naming the file, what is wrong and
    the newest older intact checkpoint: what a launcher asks of an explicitly named checkpoint
    before any worker starts."""
    target = Path(target)
    problem, meta = _inspect(target)
    if problem is None:
        return meta
    step = STEP_DIR.fullmatch(target.name)
    if step:
        raise CheckpointError(f"{problem}{_intact_hint(target.parent, int(step.group(1)))}")
    if not (target / "shared.pt").exists():  # not a step directory: perhaps a checkpoints root
        inner = _newest_intact(target, None)[0]
        problem = (f"{target} holds no checkpoint (no shared.pt); a checkpoint is a step-NNNNNNNN "
                   "directory" + (f": the newest intact one in it is {inner}" if inner else
                                  " such as <out>/checkpoints/step-00000050"))
    raise CheckpointError(problem)


def resume_point(ckpt_dir: str | Path, run: str | None = None) -> tuple[Path | None, str | None]:
    """The checkpoint to resume from and, when it is not the one ``latest`` names, why.

    One rule: the newest intact checkpoint, whatever ``latest`` says; when ``latest`` names a step,
    the newest intact one at or below it (checkpoints above it are not this run's: an older run in
    the same directory, see :func:`prune`). ``latest`` only says where to look first. ``run``: this
    run's id; a checkpoint of another run is passed over like a damaged one ("Belonging").

    Returns ``(None, None)`` when there is no checkpoint directory at all; ``(latest, None)`` when
    the checkpoint ``latest`` names is intact; ``(other, note)`` when ``latest`` is missing, empty,
    invalid or names a damaged checkpoint and ``other`` is intact, ``note`` being one line for the
    caller to print ("... is corrupt ...; resuming from the older intact checkpoint step-00000016
    instead"); ``(None, note)`` when there is no ``latest`` and no step directory is intact (a run
    killed while writing its first checkpoint).

    Raises:
        CheckpointError: ``latest`` names a checkpoint (or is empty or invalid) and no intact one
            is left to resume from.
    """
    target, _, note = resume_checkpoint(ckpt_dir, run)
    return target, note


def resume_checkpoint(ckpt_dir: str | Path, run: str | None = None
                      ) -> tuple[Path | None, dict[str, Any] | None, str | None]:
    """:func:`resume_point` with the chosen checkpoint's ``meta`` (the step its files record,
    which a directory renamed by hand does not change; the run's identity): ``(target, meta, note)``."""
    root = Path(ckpt_dir)
    target, named_step, problem = _read_pointer(root)
    if target is not None:
        problem, meta = _inspect(target, run)
        if problem is None:
            return target, meta, None
    below = None if named_step is None else named_step + 1
    found, meta = _newest_intact(root, below, run)
    if found is not None:
        if problem is None:
            problem = f"{root / 'latest'} is missing"
        kind = "older intact" if target is not None else "newest intact"
        return found, meta, f"{problem}; resuming from the {kind} checkpoint {found.name} instead"
    if problem is None:
        damaged = [path.name for _, path in step_dirs(root)]
        return None, None, (f"no intact checkpoint (damaged or unfinished: {', '.join(damaged)})"
                            if damaged else None)
    where = "older intact checkpoint" if target is not None else "intact checkpoint"
    raise CheckpointError(f"{problem}; no {where} in {root} to resume from")


def load(target: str | Path, rank: int, world_size: int) -> tuple[dict[str, Any], dict[str, Any]]:
    """(shared, this rank's local state) of the checkpoint directory ``target``.

    Raises:
        CheckpointError: a file is missing or corrupt (the message offers the newest older intact
            checkpoint of the same directory).
        WorldSizeChanged: the checkpoint is from another world size (:func:`load_all_ranks`).
    """
    target = Path(target)
    if not target.is_dir():
        raise CheckpointError(f"checkpoint {target} is not a directory")
    step = STEP_DIR.fullmatch(target.name)
    try:
        shared, local = _load_checked(target, rank, world_size)
        if local is None:
            raise WorldSizeChanged(
                f"checkpoint {target} was written by {plural(shared['meta']['world_size'], 'worker')}, this "
                f"run has {world_size}; its per-worker state must be regrouped "
                "(load_all_ranks; flashsgd train does it)", shared["meta"]["world_size"])
    except _Damaged as exc:
        hint = _intact_hint(target.parent, int(step.group(1))) if step else ""
        raise CheckpointError(f"{exc}{hint}") from None
    _upgrade_names(str(target), shared, [local])
    return shared, local


def load_all_ranks(target: str | Path) -> tuple[dict[str, Any], list[dict[str, Any]]]:
    """(shared, [local state of every rank of the world that wrote it]) of ``target``: what a
    resume on another world size (elastic) regroups.

    Raises:
        CheckpointError: a file is missing or corrupt, or from another step.
    """
    target = Path(target)
    try:
        shared, first = _load_checked(target, 0)
        ranks = [first] + [_load_checked(target, r, shared=shared)[1]
                           for r in range(1, shared["meta"]["world_size"])]
    except _Damaged as exc:
        step = STEP_DIR.fullmatch(target.name)
        hint = _intact_hint(target.parent, int(step.group(1))) if step else ""
        raise CheckpointError(f"{exc}{hint}") from None
    _upgrade_names(str(target), shared, ranks)
    return shared, ranks


def legacy_key_map(keys: Iterable[str]) -> dict[str, str]:
    """``{old: new}`` for state_dict keys in flashsgd's earlier ResNet names, renamed to
    torchvision's (``torchvision/models/resnet.py``, which the built-in ResNets now follow).

    1. A block's ``last_bn`` becomes ``bn3`` when the block has a ``conv3`` (Bottleneck), else
       ``bn2`` (BasicBlock, the CIFAR block).
    2. ``shortcut.0`` / ``shortcut.1`` (the projection's conv and BN) become ``downsample.0`` /
       ``downsample.1``.

    Only keys of a state with a ``last_bn`` key are renamed (every earlier built-in ResNet had one;
    torchvision's models and other names never do), so any other state gives ``{}``.

    Example::

        >>> legacy_key_map(["layer1.0.conv3.weight", "layer1.0.last_bn.bias", "layer1.0.shortcut.1.bias"])
        {'layer1.0.last_bn.bias': 'layer1.0.bn3.bias', 'layer1.0.shortcut.1.bias': 'layer1.0.downsample.1.bias'}
    """
    keys = list(keys)
    if not any("last_bn" in key.split(".") for key in keys):
        return {}
    present, mapping = set(keys), {}
    for key in keys:
        parts = key.split(".")
        for i, part in enumerate(parts):
            if part == "last_bn":  # Step 1
                parts[i] = "bn3" if ".".join(parts[:i] + ["conv3", "weight"]) in present else "bn2"
            elif part == "shortcut" and parts[i + 1:i + 2] in (["0"], ["1"]):  # Step 2
                parts[i] = "downsample"
        if parts != key.split("."):
            mapping[key] = ".".join(parts)
    return mapping


def _renamed(state: dict[str, Any], mapping: dict[str, str]) -> dict[str, Any]:
    return {mapping.get(k, k): v for k, v in state.items()}


def _note_legacy(source: str, count: int) -> None:
    """The one line saying that a checkpoint's names were renamed (rank 0, or a single process)."""
    if not dist.is_initialized() or dist.get_rank() == 0:
        print(f"[flashsgd] checkpoint {source} has flashsgd's earlier ResNet names: {count} keys "
              "renamed to torchvision's (last_bn -> bn2/bn3, shortcut -> downsample)", flush=True)


def _upgrade_names(source: str, shared: dict[str, Any], ranks: list[dict[str, Any]]) -> None:
    """In place: the model of ``shared`` and the BN statistics (``buffers``) of each rank's state in
    torchvision's names (:func:`legacy_key_map`), with one printed note when anything was renamed."""
    mapping = legacy_key_map(shared.get("model", {}))
    if mapping:
        shared["model"] = _renamed(shared["model"], mapping)
        for local in ranks:
            if isinstance(local.get("buffers"), dict):
                local["buffers"] = _renamed(local["buffers"], mapping)
        _note_legacy(source, len(mapping))


def load_model_state(model: torch.nn.Module, state: dict[str, torch.Tensor], source: str) -> None:
    """``load_state_dict`` with a message naming the checkpoint and the mismatched keys/shapes.

    A state in flashsgd's earlier ResNet names (``last_bn``, ``shortcut``) is renamed to the
    model's torchvision names (:func:`legacy_key_map`) with one printed note, unless the model
    itself has those names. (:func:`load` and :func:`load_all_ranks` rename already, the rank
    files' BN statistics included.)
    """
    own = model.state_dict()
    mapping = {old: new for old, new in legacy_key_map(state).items() if old not in own}
    if mapping:
        state = _renamed(state, mapping)
        _note_legacy(source, len(mapping))
    missing = sorted(set(own) - set(state))
    extra = sorted(set(state) - set(own))
    shapes = [k for k in own.keys() & state.keys() if own[k].shape != state[k].shape]
    if missing or extra or shapes:
        raise CheckpointError(
            f"checkpoint {source} does not match the model: missing {missing[:5]}, unexpected "
            f"{extra[:5]}, shape mismatch {[(k, tuple(state[k].shape), tuple(own[k].shape)) for k in shapes[:5]]}")
    model.load_state_dict(state)
