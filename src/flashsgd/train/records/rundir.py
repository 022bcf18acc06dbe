"""The run directory: one run per directory, resumed only with the same settings, never mixed.

Layout of ``<out>``: ``config.toml`` (the resolved config), ``plan.json`` (the resolved run),
``metrics.jsonl``, ``tensorboard/``, ``summary.json``, ``report.png``, ``checkpoints/`` and
``.lock`` (held while a run uses the directory).

What a start does (:func:`open_run_dir`), every check before anything is written:

1. Lock: ``flock`` on ``<out>/.lock``, held for the run's life (released by the kernel when the
   holder dies, so a stale lock from a dead process is taken over; the file names the holder's pid
   and host for the message). A second run on the same directory stops at once. Only the holder
   ever removes ``.lock`` (and a directory it made that holds nothing else), and a process that
   locked a ``.lock`` removed meanwhile locks the new one instead (:func:`lock`).
2. Decide, from the run's settings, the newest checkpoint and ``summary.json``. The run's settings
   are those its checkpoint was trained with (every checkpoint records the run's identity: its id,
   the settings' digest and the config text, :func:`identity`); the records (``config.toml``,
   ``plan.json``'s ``config_file``) are for people and editable: one that differs from the
   checkpoint is named as edited, and a run started with its edited settings is refused (an edit
   of ``epochs 2 -> 3`` must not stretch the LR schedule mid-run, whatever happened to plan.json).
   Without a checkpoint that records them (a flashsgd before it), the records are all there is:
   ``plan.json``'s ``config_file`` over ``config.toml``. The checkpoints considered are the run's
   own (the run id in ``plan.json``): one copied from another run is passed over with a note.

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
     whatever ``checkpoints/latest`` says, :func:`flashsgd.train.records.checkpoint.resume_point`; or the
     given directory);
   - same config, no checkpoint (a run that died before its first one): moved aside, fresh start.
3. Write ``config.toml`` (the keys this run reads, :func:`flashsgd.train.config.file.dumps_run_config`)
   and ``plan.json`` with the run id (fresh and resumed starts only: a fresh start's id is new, a
   resumed one keeps the checkpoint's).

Example::

    >>> with open_run_dir(plan) as start:        # doctest: +SKIP
    ...     if start.kind != "complete":
    ...         train_from(start.checkpoint)
"""

from __future__ import annotations

import contextlib
import dataclasses
import fcntl
import hashlib
import json
import os
import shutil
import socket
import time
import uuid
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Iterator, Literal

from flashsgd.train.records import checkpoint as ckpt
from flashsgd.train.config import TrainConfig, resolve
from flashsgd.train.config.file import dumps_run_config, reads

# Config keys that cannot change what a run computes: a resume may change them freely.
# (eval_every: BN statistics are averaged before each evaluation, and averaging commutes with the
# per-worker running averages, so the evaluated model is the same; max_steps: where this
# invocation stops, so that an interrupted run can be continued to the end; workers: an elastic
# resume on another world size, as under torchrun --nnodes MIN:MAX - the global batch and the LR
# are the run's, the per-worker state is regrouped, Worker.regroup; data_workers: each sample's
# augmentation has its own generator, the same in any process, flashsgd.train.data.images.)
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
    """How this run starts: ``fresh``, ``resume`` (from ``checkpoint``, whose files hold ``step``)
    or ``complete``; ``run``: the identity every checkpoint of this start records (:func:`identity`:
    a resume keeps the checkpoint's run id, :func:`open_run_dir` gives a fresh start a new one)."""

    kind: Literal["fresh", "resume", "complete"]
    checkpoint: Path | None = None
    moved_aside: Path | None = None
    summary: dict[str, Any] | None = None
    note: str = ""
    step: int | None = None
    run: dict[str, str] | None = None

    def describe(self) -> str:
        if self.kind == "complete":
            s = self.summary or {}
            acc = s.get("final_test_accuracy")
            acc_text = f"test accuracy {acc:.2f}%" if isinstance(acc, (int, float)) else "not evaluated"
            return f"already complete at step {s.get('steps')}, {acc_text}" + (
                f"; {self.note}" if self.note else "")
        text = self._resumed() if self.kind == "resume" else "starting fresh"
        if self.moved_aside:
            text += f" (the previous run's files were moved to {self.moved_aside})"
        return text + (f"; {self.note}" if self.note else "")

    def _resumed(self) -> str:
        """What is resumed: the step its files record (a directory renamed or filled by hand says
        another step in its name)."""
        if self.step is None:
            return f"resuming from {self.checkpoint}"
        text = f"resuming from step {self.step} ({self.checkpoint}"
        named = ckpt.STEP_DIR.fullmatch(self.checkpoint.name) if self.checkpoint else None
        if named and int(named.group(1)) != self.step:
            text += f": its files are step {self.step}'s, its name says step {int(named.group(1))}"
        return text + ")"


class RunDirError(ValueError):
    """The run directory cannot be used for this run (locked, or holds a run with other settings)."""


def _flat(cfg: TrainConfig) -> dict[str, Any]:
    return {f"{s}.{k}": v for s, sec in dataclasses.asdict(cfg).items() for k, v in sec.items()}


def config_changes(old: TrainConfig, new: TrainConfig) -> list[str]:
    """``"section.key: old -> new"`` for every key that differs and can change results: not a
    neutral key, and read by one of the two runs (:func:`flashsgd.train.config.file.applies`: the
    image size of an MNIST-1D run, left out of its config.toml, changes nothing)."""
    a, b = _flat(old), _flat(new)
    return [f"{k}: {a[k]!r} -> {b[k]!r}" for k in sorted(a) if a[k] != b[k]
            and k.split(".", 1)[1] not in NEUTRAL_KEYS and (reads(old, k) or reads(new, k))]


def settings_digest(cfg: TrainConfig) -> str:
    """SHA-256 (16 hex digits) of the settings that can change what the run of ``cfg`` computes:
    every key it reads but :data:`NEUTRAL_KEYS`, with its value."""
    kept = {k: v for k, v in _flat(cfg).items()
            if k.split(".", 1)[1] not in NEUTRAL_KEYS and reads(cfg, k)}
    return hashlib.sha256(json.dumps(kept, sort_keys=True, default=str).encode()).hexdigest()[:16]


def identity(cfg: TrainConfig, run_id: str) -> dict[str, str]:
    """What every checkpoint of a run records about it: ``id`` (written at the run's start, kept by
    every resume), ``settings`` (:func:`settings_digest`) and ``config`` (the text of its
    ``config.toml``, :func:`flashsgd.train.config.file.dumps_run_config`)."""
    return {"id": run_id, "settings": settings_digest(cfg), "config": dumps_run_config(cfg)}


def new_run_id() -> str:
    return uuid.uuid4().hex[:16]


@contextlib.contextmanager
def lock(out: Path) -> Iterator[None]:
    """Step 1: hold ``<out>/.lock`` (flock) for the block; RunDirError if another process holds it.

    Only the holder removes anything: a directory it made (``mkdir`` succeeded here, so exactly
    one process made it) that holds nothing but the lock when the block ends (a start refused
    before it wrote anything) is removed again, the lock file first, while the lock is held. A
    refused process removes nothing. A process that opened ``.lock`` before its holder removed it
    would lock the removed file: the lock taken is checked to be on the file at ``<out>/.lock``
    (same inode), else taken again on the new one (:func:`_take_lock`)."""
    created, fd = _take_lock(out)
    path = out / ".lock"
    try:
        try:
            os.ftruncate(fd, 0)
            os.write(fd, f"pid {os.getpid()} on host {socket.gethostname()} since "
                         f"{time.strftime('%Y-%m-%d %H:%M:%S')}\n".encode())
        except OSError as exc:  # a full disk: name the file (os.write does not)
            raise OSError(exc.errno, exc.strerror, str(path)) from None
        yield
    finally:
        try:
            if created and [p.name for p in out.iterdir()] == [".lock"]:
                path.unlink(missing_ok=True)  # still holding the lock: nobody else removes it
                with contextlib.suppress(OSError):  # a waiting process made a new .lock: its dir now
                    out.rmdir()
        finally:
            os.close(fd)  # releases the lock (forked workers that inherited it close theirs on exit)


LOCK_TRIES = 100  # each retry needs another holder to have removed the directory meanwhile


def _take_lock(out: Path) -> tuple[bool, int]:
    """(whether this process made ``out``, the descriptor of ``<out>/.lock`` it holds the flock of).

    RunDirError when another process holds it. A ``.lock`` (or ``out``) removed by its holder
    between this process's ``open`` and ``flock`` is opened again: the flock must be on the file
    that is at the path, or two processes would both believe they hold the directory."""
    path = out / ".lock"
    for _ in range(LOCK_TRIES):
        try:
            out.mkdir(parents=True)
            created = True
        except FileExistsError:
            created = False
        try:
            fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o644)
        except FileNotFoundError:  # its holder removed the directory since: make it again
            continue
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            holder = os.pread(fd, 512, 0).decode(errors="replace").strip() or "another process"
            os.close(fd)
            raise RunDirError(f"run directory {out} is in use by {holder}; wait for it to finish or "
                              "choose another --out") from None
        if _is_at(fd, path):
            return created, fd
        os.close(fd)  # the file locked was removed by its holder meanwhile: not the directory's lock
    raise RunDirError(f"run directory {out}: its lock file {path} was removed {LOCK_TRIES} times while "
                      "this process took it (runs starting and stopping on it); try again")


def _is_at(fd: int, path: Path) -> bool:
    """Whether the open file ``fd`` is the file now at ``path`` (not one removed since)."""
    try:
        now = os.stat(path)
    except FileNotFoundError:
        return False
    mine = os.fstat(fd)
    return (mine.st_dev, mine.st_ino) == (now.st_dev, now.st_ino)


PLAN_KEPT = ("config_file", "run_id")
"""What a rewrite of ``plan.json`` within one start keeps (:func:`write_plan`)."""


@dataclass(frozen=True)
class Records:
    """What the run directory ``home`` says about its run, each read as it is (missing, damaged or
    edited by hand): ``config.toml``'s text, and ``plan.json``'s ``config_file`` (the text of
    ``config.toml`` written at the last start) and ``run_id``."""

    home: Path
    config_toml: str | None
    plan_config: str | None
    run_id: str | None

    def texts(self) -> list[tuple[str, str]]:
        """(the record's name in a message, its config text) of each record present."""
        named = ((str(self.home / "config.toml"), self.config_toml),
                 (f"{self.home / 'plan.json'} (config_file)", self.plan_config))
        return [(name, text) for name, text in named if text is not None]


def _plan_fields(home: Path) -> dict[str, Any]:
    """``plan.json`` of ``home`` as a dict ({} when missing or not a JSON object)."""
    try:
        plan = json.loads((home / "plan.json").read_text())
    except (OSError, ValueError):
        return {}
    return plan if isinstance(plan, dict) else {}


def read_records(home: Path) -> Records:
    path = home / "config.toml"
    plan = _plan_fields(home)
    text, run_id = plan.get("config_file"), plan.get("run_id")
    return Records(home, path.read_text(errors="replace") if path.is_file() else None,
                   text if isinstance(text, str) else None,
                   run_id if isinstance(run_id, str) and run_id else None)


def _read_config(text: str, source: str) -> TrainConfig:
    try:
        return resolve(toml_text=text)
    except ValueError as exc:
        raise RunDirError(f"{source} holds a run whose config cannot be read ({exc}); use another "
                          "--out, or --resume never to move that run aside") from None


def _saved_config(out: Path, records: Records | None = None) -> tuple[TrainConfig | None, bool]:
    """(the config the records of the run in ``out`` say it started with, whether they disagree):
    what decides when no checkpoint records the run's settings (a flashsgd before it).

    ``plan.json``'s ``config_file`` (the text written at the last start) over ``config.toml``:
    when the two differ one was edited, and an edit of the file must not pass the
    changed-settings guard."""
    records = records or read_records(out)
    if records.config_toml is None:
        return None, False
    differ = records.plan_config is not None and records.plan_config != records.config_toml
    if differ:
        return _read_config(records.plan_config, f"{out / 'plan.json'} (config_file)"), True
    return _read_config(records.config_toml, str(out / "config.toml")), False


def _trained_with(target: Path, meta: dict[str, Any] | None) -> TrainConfig | None:
    """The settings checkpoint ``target`` records it was trained with (:func:`identity`); None for a
    checkpoint without them (a flashsgd before the record)."""
    run = (meta or {}).get("run")
    text = run.get("config") if isinstance(run, dict) else None
    if not isinstance(text, str):
        return None
    try:
        return resolve(toml_text=text)
    except ValueError as exc:
        raise RunDirError(f"checkpoint {target} records settings this flashsgd cannot read ({exc}); "
                          "use another --out, or --resume never to move that run aside") from None


def _edited(records: Records, trained: TrainConfig, target: Path) -> list[str]:
    """One clause per record that differs from the settings checkpoint ``target`` was trained
    with (neutral keys and keys neither reads aside: :func:`config_changes`), naming both."""
    clauses = []
    for name, text in records.texts():
        try:
            keys = [c.split(":", 1)[0] for c in config_changes(trained, resolve(toml_text=text))]
            how = (f"{', '.join(keys)} {'differs' if len(keys) == 1 else 'differ'} from the settings "
                   f"the checkpoint {target} was trained with" if keys else "")
        except ValueError as exc:
            how = f"it cannot be read ({exc}); the checkpoint {target} holds the run's settings"
        if how:
            clauses.append(f"{name} was edited after the run started ({how})")
    return clauses


@dataclass(frozen=True)
class _Point:
    """The checkpoint a resume would continue from, its files' meta, why it is not the one
    ``latest`` names, or why there is none (raised only when the run must resume)."""

    target: Path | None = None
    meta: dict[str, Any] | None = None
    note: str | None = None
    error: ckpt.CheckpointError | None = None


def _resume_point(out: Path, explicit: Path | None, run_id: str | None) -> _Point:
    if explicit is not None:  # every file of it checked here, before any worker starts
        try:
            return _Point(explicit, ckpt.verify(explicit))
        except ckpt.CheckpointError as exc:
            raise RunDirError(f"config key run.resume: {exc}") from None
    try:  # this run's own checkpoints only: one of another run is passed over with a note
        return _Point(*ckpt.resume_checkpoint(out / "checkpoints", run_id))
    except ckpt.CheckpointError as exc:
        return _Point(error=exc)


def _run_settings(records: Records, point: _Point) -> tuple[TrainConfig | None, list[str], str]:
    """(the settings of the run in ``records.home``, one clause per record edited away from them,
    what a refusal says first): those its checkpoint was trained with, else what the records say."""
    trained = _trained_with(point.target, point.meta) if point.target is not None else None
    if trained is not None:  # the checkpoint says what the run is; the records may have been edited
        edited = _edited(records, trained, point.target)
        return trained, edited, ("; ".join(edited) + "; the run continues only with the settings its "
                                 "checkpoint was trained with; " if edited else "")
    saved, differ = _saved_config(records.home, records)
    home = records.home
    return saved, [], (f"{home / 'config.toml'} and {home / 'plan.json'} (config_file) differ, so one "
                       "of them was edited after the run started; the run continues only with the "
                       "settings plan.json records; " if differ else "")


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
    records = read_records(home)
    point = _resume_point(out, explicit, records.run_id)
    saved, edited, why = _run_settings(records, point)
    if saved is not None:
        changes = config_changes(saved, cfg)
        if changes and explicit is None and not _completed_a_step(out):
            # a start that failed before step 1 (a bad flag, a crash at start-up): nothing to keep
            return Start("fresh", note="the previous attempt, with other settings, never completed a step")
        if changes:
            raise RunDirError(
                f"{why}{home} holds a run with other settings ({'; '.join(changes)}); to keep it, "
                "train into a new directory (--out NEW); to start over here, --resume never "
                "(moves the old run aside)")
    resumed = dict(step=(point.meta or {}).get("step"), run=identity(
        cfg, ckpt.run_id(point.meta or {}) or records.run_id or new_run_id()))
    rewritten = "; ".join(edited) + ": rewritten with the run's settings" if edited else ""
    if explicit is not None:
        return Start("resume", checkpoint=explicit, note=rewritten, **resumed)
    if saved is None:
        return Start("fresh")
    summary = _complete_summary(out, target_steps)
    if summary is not None:
        return Start("complete", summary=summary,
                     note="; ".join(edited) + ": left as it is" if edited else "")
    if point.error is not None:
        raise point.error
    if point.target is None:
        return Start("fresh", note=f"the previous attempt left {point.note or 'no checkpoint'}")
    return Start("resume", checkpoint=point.target, note="; ".join(filter(None, (point.note, rewritten))),
                 **resumed)


def write_plan(out: Path, plan: Any, **extra: Any) -> None:
    """``<out>/plan.json``: the resolved run (rewritten once ``--comm auto`` has chosen), with
    ``config_file``, the text of ``config.toml`` as this start wrote it, and ``run_id``, the run's
    id (:func:`identity`), both kept by a rewrite (:data:`PLAN_KEPT`)."""
    path = out / "plan.json"
    kept = [k for k in PLAN_KEPT if k not in extra]
    if kept and path.is_file():
        old = _plan_fields(out)
        extra.update({k: old[k] for k in kept if k in old})
    path.write_text(json.dumps({**plan.to_dict(), **extra}, indent=2, default=str) + "\n")


@contextlib.contextmanager
def open_run_dir(plan: Any) -> Iterator[Start]:
    """Steps 1-3 for ``plan`` (a :class:`~flashsgd.train.plan.RunPlan`); the lock is held inside."""
    cfg: TrainConfig = plan.config
    out = Path(cfg.run.out)
    with lock(out):
        start = decide(cfg, plan.target_steps)
        if start.kind == "fresh":  # a new run: a new id
            start = dataclasses.replace(start, moved_aside=_move_aside(out), run=identity(cfg, new_run_id()))
        if start.kind != "complete":
            text = start.run["config"]  # dumps_run_config(cfg)
            (out / "config.toml").write_text(text)
            write_plan(out, plan, config_file=text, run_id=start.run["id"])
        yield start
