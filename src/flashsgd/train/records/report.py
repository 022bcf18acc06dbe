"""Outputs of a training run: metrics.jsonl + TensorBoard, summary.json, report.png.

Everything here runs on rank 0 only (logging on one rank, as torchrun users expect). ``metrics.jsonl`` has one
JSON object per line, its fields described in :mod:`flashsgd.train.records`: ``{"kind": "step", ...}`` per
optimizer step, ``{"kind": "eval", ...}`` per evaluation (``"at_stop": true`` for the one after a
``run.max_steps`` stop), ``{"kind": "resume", "step": N}`` when a run continues from a checkpoint (steps
after N that were logged before the interruption are then logged again; readers keep the last). A torn
last line (an append cut short by a crash or a full disk) is cut off, with a note, before the resumed
run appends (:func:`flashsgd.train.records.drop_torn_tail`), and the summary of a run leaves out a
damaged line with a note naming it: a record never stops a run from finishing.

Example::

    >>> make_report("runs/train/metrics.jsonl", "runs/train/report.png")   # doctest: +SKIP
"""

from __future__ import annotations

import json
import statistics
import sys
from pathlib import Path
from typing import Any

from flashsgd.exchanges import DENSE_ITERATIONS
from flashsgd.fmt import percent, plural
from flashsgd.outputs import write_json
from flashsgd.train.records import (FIELDS, STEP_FIELDS, Progress, drop_torn_tail, read_metrics,
                                    resume_row)

WARMUP_STEPS = DENSE_ITERATIONS
"""Steps left out of a run's throughput and communication share (summary.json, ``flashsgd compare``):
DDP's bucket rebuild after the first, and the dense iterations every compressing exchange starts
with (the catalog's ``start_iter`` default), so every exchange is timed from the same step."""


def timed_median(steps: list[dict], name: str, missing: float | None = float("nan")) -> float | None:
    """The median of field ``name`` over the steps from :data:`WARMUP_STEPS` on (all steps when the
    run is shorter; rows of an older run may lack a field); ``missing`` when there is none."""
    timed = [s for s in steps if s["step"] >= WARMUP_STEPS] or steps
    values = [s[name] for s in timed if name in s]
    return statistics.median(values) if values else missing


class Metrics:
    """metrics.jsonl + TensorBoard writer (no-ops on ranks other than 0)."""

    def __init__(self, out: Path, enabled: bool, resumed_from: int | None = None) -> None:
        self.enabled = enabled
        self.file = self.tb = None
        if not enabled:
            return
        self.path = Path(out) / "metrics.jsonl"
        if self.path.exists() and (torn := drop_torn_tail(self.path)) is not None:
            train_note(torn.describe() + (f"; the run writes the rows after its checkpoint (step "
                                          f"{resumed_from}) again" if resumed_from is not None else ""))
        self.file = self.path.open("a")
        from torch.utils.tensorboard import SummaryWriter

        self.tb = SummaryWriter(log_dir=str(Path(out) / "tensorboard"), purge_step=resumed_from)
        if resumed_from is not None:
            self._write(resume_row(resumed_from))

    def _write(self, row: dict[str, Any]) -> None:
        try:
            self.file.write(json.dumps(row) + "\n")
            self.file.flush()
        except OSError as exc:  # a full disk: name the file
            raise OSError(exc.errno, exc.strerror or str(exc), str(self.path)) from exc

    def add(self, row: dict[str, Any]) -> None:
        """A step's or an evaluation's row (:func:`~flashsgd.train.records.step_row`, ``eval_row``)
        and its TensorBoard scalars (flushed after an evaluation)."""
        if not self.enabled:
            return
        self._write(row)
        for f in FIELDS[row["kind"]]:
            if f.tensorboard:
                self.tb.add_scalar(f.tensorboard, row[f.name], row["step"])
        if row["kind"] == "eval":
            self.tb.flush()

    def close(self) -> None:
        if self.enabled:
            self.file.close()
            self.tb.close()


def train_note(text: str) -> None:
    """A one-line note of `flashsgd train` on stderr."""
    print(f"flashsgd train: note: {text}", file=sys.stderr, flush=True)


def summarize(plan, progress: Progress, topo, metrics, timer_total: float) -> dict[str, Any]:
    """Write summary.json and report.png; print the final summary; return the summary dict."""
    cfg, world = plan.config, plan.world
    out = Path(cfg.run.out)
    steps, evals = read_metrics(out / "metrics.jsonl", skip_damaged=True, note=train_note)
    ips = timed_median(steps, "images_per_s")
    medians = {f.summary: timed_median(steps, f.name) for f in STEP_FIELDS if f.summary}
    t_step, t_comm = timed_median(steps, "t_step_s"), timed_median(steps, "t_comm_s")
    final = evals[-1]["test_accuracy"] if evals else None
    summary = {
        "final_test_accuracy": final,
        "best_test_accuracy": max((e["test_accuracy"] for e in evals), default=None),
        "target_accuracy": cfg.run.target_accuracy,
        "time_to_accuracy_s": progress.tta_s,
        "train_time_s": progress.elapsed_s,
        "steps": progress.step, "total_steps": plan.total_steps, "epochs": progress.epoch,
        "skipped_steps": progress.skipped,
        **({"overflow_skipped_steps": progress.overflow_skipped}  # fp16: the loss scaler's, of those
           if progress.overflow_skipped is not None else {}),
        "images_per_s": ips,
        "scaling": {
            "world_size": world, "nodes": topo.num_nodes, "ranks_per_node": topo.ranks_per_node,
            "grid": f"{topo.grid[0]}x{topo.grid[1]}",
            "images_per_s_per_worker": ips / world, **medians,
            "hook_fraction_of_step": t_comm / t_step if t_step else float("nan"),
        },
        "algorithm": cfg.comm.algorithm, "recipe": plan.recipe.name,  # resolved: fujitsu-mnist1d
        "global_batch": plan.table.final_batch, "model": cfg.model.model, "dataset": cfg.data.dataset,
    }
    write_json(out / "summary.json", summary)
    make_report(out / "metrics.jsonl", out / "report.png", title=(
        f"{cfg.model.model} on {cfg.data.dataset}: {plan.recipe.name} recipe, {cfg.comm.algorithm}, "
        f"{plural(world, 'worker')}, global batch {plan.table.final_batch}"),
        label_smoothing=plan.recipe.label_smoothing, rows=(steps, evals))
    tta = f"{progress.tta_s:.1f} s" if progress.tta_s is not None else "not reached"
    accuracy = (f"test accuracy {final:.2f}% (best {summary['best_test_accuracy']:.2f}%)"
                if final is not None else "not evaluated")
    print(f"\nflashsgd train: done in {progress.elapsed_s:.1f} s, {plural(progress.step, 'step')} "
          f"({progress.skipped} skipped) | {accuracy} | time to {cfg.run.target_accuracy:g}%: {tta} | "
          f"{ips:,.0f} images/s ({ips / world:,.0f} per worker), gradient exchange "
          f"{percent(summary['scaling']['hook_fraction_of_step'], 0, missing='not timed')} of a step "
          f"(in flight, hooks only)\n"
          f"  outputs: {out}/{{config.toml, plan.json, metrics.jsonl, tensorboard/, summary.json, "
          f"report.png, checkpoints/}}", flush=True)
    return summary


def make_report(metrics_path: str | Path, png_path: str | Path, title: str = "",
                label_smoothing: float = 0.0, rows: tuple[list[dict], list[dict]] | None = None) -> None:
    """report.png: loss, test accuracy, LR and global batch against the optimizer step.

    ``label_smoothing``: the run's (the resolved recipe's); the train loss is labelled with it only
    when it is > 0 (the loss is then the smoothed cross-entropy, not comparable with the test loss).
    ``rows``: (step rows, eval rows) already read from ``metrics_path``
    (:func:`~flashsgd.train.records.read_metrics`: a damaged line is a RecordError naming it)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    steps, evals = rows if rows is not None else read_metrics(metrics_path)
    x = [s["step"] for s in steps]
    fig, axes = plt.subplots(2, 2, figsize=(11, 7.5), constrained_layout=True)
    ax = axes[0, 0]
    ax.plot(x, [s["loss"] for s in steps], lw=1.2, label=train_loss_label(label_smoothing))
    if evals:
        ax.plot([e["step"] for e in evals], [e["test_loss"] for e in evals], "o-", ms=4,
                label="test loss")
    ax.set(title="Loss", xlabel="optimizer step", ylabel="cross-entropy")
    ax.set_ylim(bottom=0)
    ax.grid(alpha=0.3)
    ax.legend()
    ax = axes[0, 1]
    if evals:
        acc = [e["test_accuracy"] for e in evals]
        ax.plot([e["step"] for e in evals], acc, "o-", ms=4, color="tab:green")
        ax.annotate(f"{acc[-1]:.2f}%", ((evals[-1]["step"]), acc[-1]), textcoords="offset points",
                    xytext=(-10, -16), ha="right")
        ax.set_ylim(max(0.0, min(acc) - 5), 100)
    ax.set(title="Test accuracy (per epoch)", xlabel="optimizer step", ylabel="accuracy (%)")
    ax.grid(alpha=0.3)
    ax = axes[1, 0]
    ax.plot(x, [s["lr"] for s in steps], color="tab:orange")
    ax.set(title="Learning rate (warmup, decay, linear scaling)", xlabel="optimizer step",
           ylabel="LR")
    ax.grid(alpha=0.3)
    ax = axes[1, 1]
    sched = [s.get("scheduled_batch", s["global_batch"]) for s in steps]
    ax.step(x, sched, where="post", color="tab:purple", label="scheduled (batch-size control)")
    ax.plot(x, [s["global_batch"] for s in steps], ".", ms=3, color="tab:gray",
            label="actual (last step of an epoch takes the remainder)")
    ax.legend(loc="lower right", fontsize=8)
    ax.set(title="Global batch", xlabel="optimizer step", ylabel="samples")
    ax.set_ylim(0, max([s["global_batch"] for s in steps] or [1]) * 1.15)
    ax.grid(alpha=0.3)
    if title:
        fig.suptitle(title)
    fig.savefig(png_path, dpi=110)
    plt.close(fig)


def train_loss_label(label_smoothing: float) -> str:
    """The legend of the train loss: ``train loss`` or ``train loss (label smoothing 0.1)``."""
    return f"train loss (label smoothing {label_smoothing:g})" if label_smoothing > 0 else "train loss"
