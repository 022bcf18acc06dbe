"""The figure of `flashsgd compare`: test accuracy (top) and loss (bottom) of several settings
against the optimizer step, the samples seen and the wall time; a setting run with several seeds
is drawn as the mean with a min..max band. A run that is not complete (stopped early, failed or still
running: :func:`flashsgd.train.records.compare.run_state`) is never pooled: it is drawn alone, dotted and
fainter, ending in an ``x`` (its label, from compare, says how far it got: ``[incomplete 11/14]``).

Seeds of one setting are aligned by optimizer step (they have the same batch schedule) and cut to
the steps every seed reached. Samples seen before step ``s`` are the sum of ``global_batch`` over
steps ``< s`` (batch-size control makes this differ from ``s * batch``). Wall time is the
evaluation's ``elapsed_s``; a training step's time, which metrics.jsonl does not log, is
interpolated linearly between evaluations (evaluation time included, as in ``elapsed_s``).

Example::

    >>> plot_comparison(split_settings([[load_run("runs/a")], [load_run("runs/b")]], ["a", "b"]), "c.png", 97)  # doctest: +SKIP
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import numpy as np

AXES = (("step", "optimizer step"), ("samples", "samples seen"), ("time_s", "wall time (s)"))
"""Columns of the figure: key of a curve's x values, axis label."""


def _common(rows_per_run: list[list[dict]]) -> list[int]:
    """Steps present in every run's rows, ascending."""
    steps = set.intersection(*({r["step"] for r in rows} for rows in rows_per_run))
    return sorted(steps)


def _run_axes(run: Any, train_steps: list[int], eval_steps: list[int]) -> dict[str, np.ndarray]:
    """One run's x values (samples, time) at the given train and eval steps."""
    step_no = np.array([s["step"] for s in run.steps])
    samples_before = np.concatenate([[0], np.cumsum([s["global_batch"] for s in run.steps])])
    # samples seen before step s: the batches of the rows with step < s
    before = lambda steps: samples_before[np.searchsorted(step_no, steps)]  # noqa: E731
    by_step = {e["step"]: e for e in run.evals}
    at_eval = [0.0] + [e["elapsed_s"] for e in run.evals]
    eval_at = [0] + [e["step"] for e in run.evals]
    return {
        "train_samples": before(train_steps), "eval_samples": before(eval_steps),
        # training step s ends when s + 1 steps are done
        "train_time_s": np.interp(np.array(train_steps) + 1, eval_at, at_eval),
        "eval_time_s": np.array([by_step[s]["elapsed_s"] for s in eval_steps]),
    }


def group_curves(group: list[Any]) -> dict[str, Any]:
    """Curves of one setting: x per column and (runs, points) arrays of train loss, test loss
    and test accuracy, aligned by step over the group's seeds."""
    train_steps = _common([r.steps for r in group])
    eval_steps = _common([r.evals for r in group])
    kept = set(train_steps)
    loss = np.array([[s["loss"] for s in r.steps if s["step"] in kept] for r in group])
    evals = [{e["step"]: e for e in r.evals} for r in group]
    acc = np.array([[e[s]["test_accuracy"] for s in eval_steps] for e in evals])
    test_loss = np.array([[e[s]["test_loss"] for s in eval_steps] for e in evals])
    xs = [_run_axes(r, train_steps, eval_steps) for r in group]
    mean = lambda key: np.mean([x[key] for x in xs], axis=0)  # noqa: E731
    return {
        "train_x": {"step": np.array(train_steps), "samples": mean("train_samples"), "time_s": mean("train_time_s")},
        "eval_x": {"step": np.array(eval_steps), "samples": mean("eval_samples"), "time_s": mean("eval_time_s")},
        "train_loss": loss, "test_loss": test_loss, "test_accuracy": acc,
    }


INCOMPLETE = dict(ls=":", alpha=0.6, markevery=[-1], marker="x", ms=7)
"""How a run that is not complete is drawn (dotted, fainter, an ``x`` where it ended)."""


def _line(ax: Any, x: np.ndarray, ys: np.ndarray, color: str, **style: Any) -> None:
    """Mean over the rows of ``ys`` (one per seed), with a min..max band when there are several."""
    ax.plot(x, ys.mean(axis=0), color=color, **style)
    if len(ys) > 1:
        ax.fill_between(x, ys.min(axis=0), ys.max(axis=0), color=color, alpha=0.2, lw=0)


def plot_comparison(parts: list[Any], png_path: str | Path, target: float) -> None:
    """Write the 2x3 figure (accuracy, loss) x (step, samples, wall time) to ``png_path``: a curve
    per part of each setting (``parts``: :func:`flashsgd.train.records.compare.split_settings` of
    the settings and their labels), a run that is not complete as :data:`INCOMPLETE`."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(2, 3, figsize=(15, 8), constrained_layout=True, sharey="row")
    colors = plt.rcParams["axes.prop_cycle"].by_key()["color"]
    lowest = 100.0
    for i, part in enumerate(parts):
        group, label, done = part.runs, part.legend, part.complete
        c, color = group_curves(group), colors[i % len(colors)]
        seeds = f" ({len(group)} seeds: mean, min..max)" if len(group) > 1 else ""
        lowest = min(lowest, float(c["test_accuracy"].min()))
        for col, (key, _) in enumerate(AXES):
            tx, ex = c["train_x"][key], c["eval_x"][key]
            _line(axes[0, col], ex, c["test_accuracy"], color, label=label + seeds,
                  **(dict(marker="o", ms=3) if done else INCOMPLETE))
            _line(axes[1, col], tx, c["train_loss"], color, lw=0.8, alpha=0.7, ls="-" if done else ":")
            _line(axes[1, col], ex, c["test_loss"], color, ls="--", marker="o" if done else "x", ms=3)
    for col, (_, xlabel) in enumerate(AXES):
        axes[0, col].axhline(target, color="gray", lw=0.8, ls=":")
        axes[0, col].set(title=f"Test accuracy vs {xlabel.split(' (')[0]}", xlabel=xlabel)
        axes[1, col].set(title=f"Loss vs {xlabel.split(' (')[0]}: train (line), test (dashed)",
                         xlabel=xlabel)
        for ax in axes[:, col]:
            ax.grid(alpha=0.3)
    axes[0, 0].set(ylabel=f"test accuracy (%), target {target:g}% dotted",
                   ylim=(max(0.0, min(lowest, target) - 5), 100.5))
    axes[1, 0].set(ylabel="cross-entropy")
    axes[1, 0].set_ylim(bottom=0)
    axes[0, 0].legend(loc="lower right", fontsize=8)
    Path(png_path).parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(png_path, dpi=100)
    plt.close(fig)
