"""The records of a training run, described once: the rows of ``metrics.jsonl`` (one per optimizer
step, one per evaluation) and the progress a checkpoint carries (torch-free).

A step row's keys are :data:`STEP_FIELDS`, in that order; each :class:`Field` says its unit, what it
means, where its value comes from (a value the worker passes, or a function of the step's
:class:`~flashsgd.train.step.StepResult`), its TensorBoard tag, and the key of its median in
summary.json. The worker (:func:`step_row`), the TensorBoard writer and summary.json
(:mod:`flashsgd.train.records.report`) take them from here, so a new metric is its computation (a
StepResult property) and one field below, e.g.::

    Field("t_unscale_s", "s", "fp16: unscaling the gradients", attrgetter("unscale_s"),
          tensorboard="train/t_unscale_s", summary="median_unscale_s"),

Rows stay the JSON objects (dicts) earlier runs wrote, with the same keys, so old run directories
load (:func:`read_metrics`); a field an older run did not write is missing from its rows.

A row is one line, written with its newline in one append; a crash or a full disk during the append
leaves a *torn* last line (bytes after the last newline). The writer cuts it off before it appends
again (:func:`drop_torn_tail`: a resumed run writes the rows after its checkpoint again), and readers
leave it out with a note; any other line that is not a row is a :class:`RecordError` naming the file
and the line (:func:`read_rows`).

:class:`Progress` is stored in a checkpoint as the plain dict :meth:`Progress.to_json` writes
(evaluations as ``[epoch, step, accuracy, elapsed_s]`` lists, as before): old checkpoints resume.
"""

from __future__ import annotations

import json
import sys
from dataclasses import dataclass, field
from operator import attrgetter
from pathlib import Path
from typing import Any, Callable, NamedTuple


@dataclass(frozen=True)
class Field:
    """One key of a metrics.jsonl row."""

    name: str
    unit: str
    doc: str
    of: Callable[[Any], Any] | None = None
    """Its value from the step's StepResult; None: a value the worker passes (:func:`step_row`)."""
    tensorboard: str = ""
    """Its TensorBoard tag ("": not logged there)."""
    summary: str = ""
    """Its median over the timed steps in summary.json, under ``scaling`` ("": none)."""
    optional: bool = False
    """Left out of the row when its value is None."""


def _fp16(attr: str) -> Callable[[Any], Any]:
    """A loss scaler's value: None (not written) on a step without one."""
    return lambda r: None if r.scale is None else getattr(r, attr)


STEP_FIELDS = (
    Field("step", "", "optimizer step, from 0 (a resumed run logs the steps after its checkpoint "
          "again; readers keep the last)"),
    Field("epoch", "epochs", "fractional epoch at the end of the step"),
    Field("loss", "", "global mean training loss (smoothed when the recipe smooths labels)",
          attrgetter("loss"), "train/loss"),
    Field("lr", "", "learning rate of the step (warmup, decay, linear scaling)", tensorboard="train/lr"),
    Field("global_batch", "samples", "samples of the step on all workers (an epoch's last step "
          "takes the remainder)", tensorboard="train/global_batch"),
    Field("scheduled_batch", "samples", "the batch-size schedule's global batch"),
    Field("local_batch", "samples", "rank 0's shard of the step"),
    Field("images_per_s", "images/s", "the step's samples over its time",
          lambda r: r.samples / r.total_s, "train/images_per_s"),
    Field("t_step_s", "s", "the whole step", attrgetter("total_s"), "train/t_step_s", "median_step_s"),
    Field("t_data_s", "s", "waiting for the batch, on the device", attrgetter("data_s")),
    Field("t_forward_s", "s", "forward and loss", attrgetter("forward_s"), summary="median_forward_s"),
    Field("t_backward_s", "s", "backward (with a synchronous hook's exchange)", attrgetter("backward_s"),
          summary="median_backward_s"),
    Field("t_comm_s", "s", "the hook's own time (overlaps backward when asynchronous)",
          attrgetter("comm_s"), "train/t_comm_s", "median_hook_s"),
    Field("t_sync_s", "s", "the all-reduce of loss, samples and non-finite flags", attrgetter("sync_s")),
    Field("t_optimizer_s", "s", "the optimizer step", attrgetter("optimizer_s")),
    Field("skipped", "", "skipped: a non-finite loss or gradient (fp16: also an overflow)",
          attrgetter("skipped")),
    Field("loss_scale", "", "fp16: the loss scaler's scale after the step", _fp16("loss_scale"),
          optional=True),
    Field("overflow", "", "fp16: skipped for the loss scaler's overflow", _fp16("overflow"),
          optional=True),
)
"""A ``{"kind": "step"}`` row, one per optimizer step."""

EVAL_FIELDS = (
    Field("epoch", "epochs", "epochs done (fractional after a run.max_steps stop)"),
    Field("step", "", "optimizer steps done"),
    Field("test_accuracy", "%", "accuracy on the test split", tensorboard="test/accuracy"),
    Field("test_loss", "", "cross-entropy on the test split", tensorboard="test/loss"),
    Field("elapsed_s", "s", "training time so far, evaluations included"),
    Field("at_stop", "", "true: the evaluation after a run.max_steps stop", optional=True),
)
"""A ``{"kind": "eval"}`` row, one per evaluation."""

FIELDS = {"step": STEP_FIELDS, "eval": EVAL_FIELDS}
"""The fields of each kind of row (a ``{"kind": "resume", "step": N}`` row has only its step)."""


def _row(kind: str, fields: tuple[Field, ...], values: dict[str, Any]) -> dict[str, Any]:
    """``{"kind": kind, ...}`` in the order of ``fields``; KeyError naming a value not in the
    schema or a field without a value (an optional field's None is left out)."""
    unknown = values.keys() - {f.name for f in fields}
    missing = [f.name for f in fields if not f.optional and f.name not in values]
    if unknown or missing:
        raise KeyError(f"a {kind} row: not in flashsgd.train.records {sorted(unknown)}, missing {missing}")
    return {"kind": kind, **{f.name: values[f.name] for f in fields
                             if not f.optional or values.get(f.name) is not None}}


def step_row(result: Any, **own: Any) -> dict[str, Any]:
    """A step's row: ``own`` (the worker's values of the fields without ``of``: step, epoch, lr,
    global_batch, scheduled_batch, local_batch) and the StepResult ``result``'s."""
    return _row("step", STEP_FIELDS, {**own, **{f.name: f.of(result) for f in STEP_FIELDS if f.of}})


def eval_row(**values: Any) -> dict[str, Any]:
    """An evaluation's row (:data:`EVAL_FIELDS`)."""
    return _row("eval", EVAL_FIELDS, values)


def resume_row(step: int) -> dict[str, Any]:
    """A run continues from the checkpoint of ``step`` (:func:`read_metrics` drops the rows after it)."""
    return {"kind": "resume", "step": step}


class RecordError(ValueError):
    """A line of a record file that is not a row: the message names the file and the line."""


ROW_KEYS = {"step": ("step",), "eval": ("epoch", "step"), "resume": ("step",)}
"""The keys a reader needs in each kind of row (a kind not listed here is skipped: a newer version's)."""


@dataclass(frozen=True)
class Damage:
    """A line of a record file that is not a row."""

    path: Path
    line: int
    """1-based."""
    size: int
    """Bytes of the line."""
    why: str
    torn: bool = False
    """The last line, without its newline: an append cut short (a crash, a full disk)."""
    recovered: bool = False
    """A torn row with a whole row appended after it (a version before torn tails were cut off):
    the whole row is kept."""

    def describe(self) -> str:
        return f"{self.path} line {self.line}: {self.why}"


def _parse(raw: bytes) -> tuple[dict | None, str]:
    """(the row of one line, "") or (None, what is wrong with it)."""
    try:
        row = json.loads(raw)
    except json.JSONDecodeError as exc:  # its own line number is 1: the column says where
        return None, f"not JSON ({exc.msg} at column {exc.colno})"
    except ValueError as exc:  # invalid UTF-8
        return None, f"not JSON ({exc})"
    if not isinstance(row, dict) or "kind" not in row:
        return None, "not a row (a JSON object with a \"kind\")"
    missing = [k for k in ROW_KEYS.get(row["kind"], ()) if k not in row]
    if missing:
        return None, f"a {row['kind']} row without {', '.join(missing)}"
    return row, ""


def _torn_then_row(raw: bytes) -> dict | None:
    """The whole row appended after a torn one on the same line, or None."""
    at = raw.rfind(b'{"kind": ')
    return _parse(raw[at:])[0] if at > 0 else None


def read_rows(path: str | Path) -> tuple[list[dict], list[Damage]]:
    """Every row of a record file (one JSON object per line) and every line that is not one.

    A torn last line (:class:`Damage` ``torn``) and a torn row with a whole one after it on one
    line (``recovered``: the whole one is in the rows) are what an interrupted append leaves; any
    other damage is a line that something else changed."""
    path = Path(path)
    lines = path.read_bytes().split(b"\n")
    tail = lines.pop()  # after the last newline: b"" when the last append completed
    rows, damage = [], []
    for number, raw in enumerate(lines, 1):
        row, why = _parse(raw)
        if row is None and (row := _torn_then_row(raw)) is not None:
            damage.append(Damage(path, number, len(raw), "a torn row, then a whole row appended after it by a "
                                 "version that did not cut torn rows off: the torn part left out", recovered=True))
        elif row is None:
            damage.append(Damage(path, number, len(raw), f"damaged: {why}"))
        if row is not None:
            rows.append(row)
    if tail:
        damage.append(Damage(path, len(lines) + 1, len(tail), f"torn last row ({len(tail)} bytes without "
                             "a newline: an append cut short by a crash or a full disk)", torn=True))
    return rows, damage


def drop_torn_tail(path: str | Path) -> Damage | None:
    """Cut a torn last line (the bytes after the last newline) off a record file before appending
    to it, so that the next row starts a line of its own; the torn line, or None."""
    path = Path(path)
    with open(path, "r+b") as f:
        data = f.read()
        intact = data.rfind(b"\n") + 1  # 0: not one whole line
        if intact == len(data):
            return None
        f.truncate(intact)
    torn = len(data) - intact
    return Damage(path, data.count(b"\n") + 1, torn, f"torn last row ({torn} bytes without a newline: "
                  "an append cut short by a crash or a full disk) dropped", torn=True)


def note_to_stderr(text: str) -> None:
    """The default ``note`` of :func:`read_metrics`: one line on stderr."""
    print(f"note: {text}", file=sys.stderr, flush=True)


def read_metrics(path: str | Path, *, skip_damaged: bool = False,
                 note: Callable[[str], None] = note_to_stderr) -> tuple[list[dict], list[dict]]:
    """(step rows, eval rows) of a metrics.jsonl, keeping the last row logged for each step.

    A torn last line (a run that stopped during an append) is left out with a ``note``; so is any
    other damaged line with ``skip_damaged`` (a run's own summary: a record never blocks a run),
    else it is a :class:`RecordError` naming the file and the line."""
    rows, damage = read_rows(path)
    for d in damage:
        if not (d.torn or d.recovered or skip_damaged):
            raise RecordError(f"{d.describe()}; not as a run writes it (edited, or damaged on disk): "
                              "repair or remove that line")
        note(d.describe() if d.recovered else f"{d.describe()}, left out")
    steps: dict[int, dict] = {}
    evals: dict[float, dict] = {}
    for row in rows:
        if row["kind"] == "step":
            steps[row["step"]] = row
        elif row["kind"] == "eval":
            evals[row["epoch"]] = row
        elif row["kind"] == "resume":  # drop what was logged after the checkpoint (and the
            steps = {k: v for k, v in steps.items() if k < row["step"]}  # evaluation at a stop)
            evals = {k: v for k, v in evals.items() if v["step"] <= row["step"] and not v.get("at_stop")}
    return [steps[k] for k in sorted(steps)], [evals[k] for k in sorted(evals)]


class Eval(NamedTuple):
    """One evaluation in :class:`Progress`."""

    epoch: float
    step: int
    accuracy: float
    """Test accuracy, %."""
    elapsed_s: float


@dataclass
class Progress:
    """Where a run is (rank 0's copy is checkpointed; summary.json reports it)."""

    step: int = 0
    """Optimizer steps done."""
    epoch: int = 0
    """Epochs completed."""
    elapsed_s: float = 0.0
    """Training seconds, over resumes."""
    skipped: int = 0
    tta_s: float | None = None
    """Time to the target accuracy (None: not reached)."""
    evals: list[Eval] = field(default_factory=list)
    overflow_skipped: int | None = None
    """fp16: the skipped steps that were the loss scaler's overflows (None: none yet)."""

    def to_json(self) -> dict[str, Any]:
        """The plain dict a checkpoint stores (the keys and lists of earlier runs)."""
        data = {"step": self.step, "epoch": self.epoch, "elapsed_s": self.elapsed_s,
                "skipped": self.skipped, "tta_s": self.tta_s, "evals": [list(e) for e in self.evals]}
        if self.overflow_skipped is not None:
            data["overflow_skipped"] = self.overflow_skipped
        return data

    @classmethod
    def from_json(cls, data: dict[str, Any]) -> Progress:
        """The inverse of :meth:`to_json`."""
        return cls(**{k: v for k, v in data.items() if k != "evals"},
                   evals=[Eval(*e) for e in data.get("evals", [])])
