"""The run directory: one run per directory, resumed only with the same settings, never mixed.

Layout of ``<out>``: ``config.toml`` (the resolved config), ``plan.json`` (the resolved run),
``metrics.jsonl``, ``tensorboard/``, ``summary.json``, ``report.png``, ``checkpoints/`` and
``.lock`` (held while a run uses the directory).

What a start does (:func:`open_run_dir`), every check before anything is written:

1. Lock: ``flock`` on ``<out>/.lock`` (released by the kernel when the holder dies, so a stale lock
   from a dead process is taken over; the file names the holder's pid and host for the message).
   A second run on the same directory stops at once.
2. Decide, from the saved ``config.toml``, the newest checkpoint and ``summary.json``:

   - nothing there: start fresh;
   - ``run.resume = never``: the previous run's files are moved aside to ``<out>.prev-<time>/``
     and the run starts fresh (runs never share metrics, summaries or checkpoints);
   - the saved config differs from this one in any key that can change results (all keys but
     :data:`NEUTRAL_KEYS` and those neither run reads): stop with one line per differing key
     (old -> new) and the ways out, unless that run never completed a step (a failed start holds
     nothing to protect): its files are moved aside and the run starts fresh;
   - same config, finished (``summary.json`` at the planned step count): "already complete",
     nothing is rewritten;
   - same config, a checkpoint: resume from it (``run.resume = auto``: the newest intact one,
     whatever ``checkpoints/latest`` says, :func:`flashsgd.train.checkpoint.resume_point`; or the
     given directory);
   - same config, no checkpoint (a run that died before its first one): moved aside, fresh start.
3. Write ``config.toml`` (the keys this run reads, :func:`flashsgd.train.config_file.dumps_run_config`)
   and ``plan.json`` (fresh and resumed starts only).

Example::

    >>> with open_run_dir(plan) as start:        # doctest: +SKIP
    ...     if start.kind != "complete":
    ...         train_from(start.checkpoint)
"""

from __future__ import annotations

import contextlib
import dataclasses
import fcntl
import json
import os
import shutil
import socket
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Iterator, Literal

from flashsgd.train import checkpoint as ckpt
from flashsgd.train.config import TrainConfig, resolve
from flashsgd.train.config_file import dumps_run_config, reads

# Config keys that cannot change what a run computes: a resume may change them freely.
# (eval_every: BN statistics are averaged before each evaluation, and averaging commutes with the
# per-worker running averages, so the evaluated model is the same; max_steps: where this
# invocation stops, so that an interrupted run can be continued to the end; workers: an elastic
# resume on another world size, as under torchrun --nnodes MIN:MAX - the global batch and the LR
# are the run's, the per-worker state is regrouped, Worker.regroup; data_workers: each sample's
# augmentation has its own generator, the same in any process, flashsgd.train.images.)
NEUTRAL_KEYS = frozenset({
    "out", "resume", "progress", "eval_every", "target_accuracy", "threads", "timeout_s",
    "checkpoint_every", "keep_checkpoints", "max_steps", "fail_at", "max_skipped", "workers",
    "data_workers",
})
# What a run writes: what "moved aside" moves (nothing else in <out> is touched).
RUN_FILES = ("config.toml", "plan.json", "metrics.jsonl", "tensorboard", "summary.json",
             "report.png", "checkpoints", "error.log", "auto.json", "cluster.toml")


@dataclass(frozen=True)
class Start:
    """How this run starts: ``fresh``, ``resume`` (from ``checkpoint``) or ``complete``."""

    kind: Literal["fresh", "resume", "complete"]
    checkpoint: Path | None = None
    moved_aside: Path | None = None
    summary: dict[str, Any] | None = None
    note: str = ""

    def describe(self) -> str:
        if self.kind == "complete":
            s = self.summary or {}
            acc = s.get("final_test_accuracy")
            acc_text = f"test accuracy {acc:.2f}%" if isinstance(acc, (int, float)) else "not evaluated"
            return f"already complete at step {s.get('steps')}, {acc_text}"
        text = f"resuming from {self.checkpoint}" if self.kind == "resume" else "starting fresh"
        if self.moved_aside:
            text += f" (the previous run's files were moved to {self.moved_aside})"
        return text + (f"; {self.note}" if self.note else "")


class RunDirError(ValueError):
    """The run directory cannot be used for this run (locked, or holds a run with other settings)."""


def _flat(cfg: TrainConfig) -> dict[str, Any]:
    return {f"{s}.{k}": v for s, sec in dataclasses.asdict(cfg).items() for k, v in sec.items()}


def config_changes(old: TrainConfig, new: TrainConfig) -> list[str]:
    """``"section.key: old -> new"`` for every key that differs and can change results: not a
    neutral key, and read by one of the two runs (:func:`flashsgd.train.config_file.applies`: the
    image size of an MNIST-1D run, left out of its config.toml, changes nothing)."""
    a, b = _flat(old), _flat(new)
    return [f"{k}: {a[k]!r} -> {b[k]!r}" for k in sorted(a) if a[k] != b[k]
            and k.split(".", 1)[1] not in NEUTRAL_KEYS and (reads(old, k) or reads(new, k))]


@contextlib.contextmanager
def lock(out: Path) -> Iterator[None]:
    """Step 1: hold ``<out>/.lock`` (flock) for the block; RunDirError if another process holds it.
    A directory made here that holds nothing but the lock afterwards (a start refused before it
    wrote anything) is removed again: a refused start leaves no run directory."""
    created = not out.exists()
    out.mkdir(parents=True, exist_ok=True)
    path = out / ".lock"
    fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o644)
    try:
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            holder = path.read_text().strip() or "another process"
            raise RunDirError(f"run directory {out} is in use by {holder}; wait for it to finish or "
                              "choose another --out") from None
        try:
            os.ftruncate(fd, 0)
            os.write(fd, f"pid {os.getpid()} on host {socket.gethostname()} since "
                         f"{time.strftime('%Y-%m-%d %H:%M:%S')}\n".encode())
        except OSError as exc:  # a full disk: name the file (os.write does not)
            raise OSError(exc.errno, exc.strerror, str(path)) from None
        yield
    finally:
        os.close(fd)  # releases the lock (forked workers that inherited it close theirs on exit)
        if created and [p.name for p in out.iterdir()] == [".lock"]:
            path.unlink(missing_ok=True)
            out.rmdir()


def _saved_config(out: Path) -> tuple[TrainConfig | None, bool]:
    """(the config the run in ``out`` started with, whether its ``config.toml`` was edited since).

    The file is the run's record for people, and editable; what the run ran with is also in
    ``plan.json`` (``config_file``: the text written at its last start). When the two differ the
    file was edited, and the recorded text is the run's config: an edit must not pass the
    changed-settings guard (``epochs 2 -> 3`` in the file would stretch the LR schedule mid-run)."""
    path = out / "config.toml"
    if not path.is_file():
        return None, False
    text, source = path.read_text(), str(path)
    try:
        recorded = json.loads((out / "plan.json").read_text()).get("config_file")
    except (OSError, ValueError, AttributeError):
        recorded = None  # a run of a flashsgd before the record, or no plan: the file is all there is
    edited = isinstance(recorded, str) and recorded != text
    if edited:
        text, source = recorded, f"{out / 'plan.json'} (config_file)"
    try:
        return resolve(toml_text=text), edited
    except ValueError as exc:
        raise RunDirError(f"{source} holds a run whose config cannot be read ({exc}); use another "
                          "--out, or --resume never to move that run aside") from None


def _move_aside(out: Path) -> Path | None:
    present = [out / n for n in RUN_FILES if (out / n).exists()]
    if not present:
        return None
    out = out.resolve()  # `--out .` has no name to derive the sibling's from
    aside = out.with_name(f"{out.name}.prev-{time.strftime('%Y%m%d-%H%M%S')}")
    n = 1
    while aside.exists():
        aside, n = aside.with_name(f"{out.name}.prev-{time.strftime('%Y%m%d-%H%M%S')}-{n}"), n + 1
    aside.mkdir(parents=True)
    for p in present:
        shutil.move(str(p), str(aside / p.name))
    return aside


def _complete_summary(out: Path, target_steps: int) -> dict[str, Any] | None:
    path = out / "summary.json"
    if not path.is_file():
        return None
    try:
        summary = json.loads(path.read_text())
    except ValueError:
        return None
    return summary if summary.get("steps", -1) >= target_steps else None


def _completed_a_step(out: Path) -> bool:
    """Whether the run in ``out`` got past an optimizer step: a summary, a checkpoint directory or
    a step row in ``metrics.jsonl`` (a start that failed before step 1 leaves none of them)."""
    if (out / "summary.json").exists() or ckpt.step_dirs(out / "checkpoints"):
        return True
    try:
        with open(out / "metrics.jsonl") as f:
            for line in f:
                try:
                    if json.loads(line).get("kind") == "step":
                        return True
                except (ValueError, AttributeError):  # a torn last line
                    continue
    except FileNotFoundError:
        pass
    return False


def decide(cfg: TrainConfig, target_steps: int) -> Start:
    """Step 2 (reads only; the caller holds the lock)."""
    out = Path(cfg.run.out)
    if cfg.run.resume == "never":
        return Start("fresh")
    explicit = None if cfg.run.resume == "auto" else Path(cfg.run.resume)
    home = explicit.parent.parent if explicit is not None else out
    saved, edited = _saved_config(home)
    if saved is not None:
        changes = config_changes(saved, cfg)
        if changes and explicit is None and not _completed_a_step(out):
            # a start that failed before step 1 (a bad flag, a crash at start-up): nothing to keep
            return Start("fresh", note="the previous attempt, with other settings, never completed a step")
        if changes:
            why = (f"{home / 'config.toml'} was edited after the run started, and the run continues "
                   "only with the settings it started with (recorded in plan.json); "
                   if edited else "")
            raise RunDirError(
                f"{why}{home} holds a run with other settings ({'; '.join(changes)}); to keep it, "
                "train into a new directory (--out NEW); to start over here, --resume never "
                "(moves the old run aside)")
    if explicit is not None:  # every file of it checked here, before any worker starts
        try:
            ckpt.verify(explicit)
        except ckpt.CheckpointError as exc:
            raise RunDirError(f"config key run.resume: {exc}") from None
        return Start("resume", checkpoint=explicit)
    if saved is None:
        return Start("fresh")
    summary = _complete_summary(out, target_steps)
    if summary is not None:
        return Start("complete", summary=summary)
    latest, note = ckpt.resume_point(out / "checkpoints")
    if latest is None:
        return Start("fresh", note=f"the previous attempt left {note or 'no checkpoint'}")
    return Start("resume", checkpoint=latest, note=note or "")


def write_plan(out: Path, plan: Any, **extra: Any) -> None:
    """``<out>/plan.json``: the resolved run (rewritten once ``--comm auto`` has chosen), with
    ``config_file``, the text of ``config.toml`` as this start wrote it (kept by a rewrite)."""
    path = out / "plan.json"
    if "config_file" not in extra and path.is_file():
        try:
            extra["config_file"] = json.loads(path.read_text())["config_file"]
        except (OSError, ValueError, KeyError, TypeError):
            pass
    path.write_text(json.dumps({**plan.to_dict(), **extra}, indent=2, default=str) + "\n")


@contextlib.contextmanager
def open_run_dir(plan: Any) -> Iterator[Start]:
    """Steps 1-3 for ``plan`` (a :class:`~flashsgd.train.plan.RunPlan`); the lock is held inside."""
    cfg: TrainConfig = plan.config
    out = Path(cfg.run.out)
    with lock(out):
        start = decide(cfg, plan.target_steps)
        if start.kind == "fresh":
            start = dataclasses.replace(start, moved_aside=_move_aside(out))
        if start.kind != "complete":
            text = dumps_run_config(cfg)
            (out / "config.toml").write_text(text)
            write_plan(out, plan, config_file=text)
        yield start
