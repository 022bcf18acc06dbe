"""`flashsgd compare`: one plot and one table from several `flashsgd train` run directories.

Reads each run's metrics.jsonl, config.toml and plan.json (nothing is trained or rewritten) and
shows what a user looks at to choose an algorithm: test accuracy and loss against the optimizer
step, the samples seen and the wall time, and a table of final and best accuracy, time to a
target accuracy, throughput and the gradient exchange's share of a step.

Runs whose settings differ only in run.seed (and in keys that cannot change results, such as
run.out) are one setting: the table reports the mean and min..max over its seeds, the plot draws
the mean with a min..max band. Only complete runs are pooled (every planned step trained, the last
one evaluated, summary.json written), and only when their seeds differ: a run that stopped early,
failed or is still running is a row (and a dotted curve) of its own, marked with how far it got;
when two complete runs of a setting have the same seed, none of that setting's runs is pooled
(they are duplicates, not two seeds): each is a row of its own, with a note under the table.
Labels name what differs between the settings ("ring" vs "gtopk density=0.01"); a comm option
the run's algorithm does not use never counts as a difference. --labels replaces them (one per
setting, comma-separated); a row that is one run of a setting adds its directory's name.

The plot goes to --out, else next to --json (same name, .png), else compare.png in the runs'
common parent directory. A torn last line of a metrics.jsonl (a run stopped during an append) is
left out with a note naming it; any other damaged line is bad input naming the file and the line.
Exit codes: 0 done, 2 bad input (one line naming the directory, file or flag).

Examples:
  flashsgd compare runs/ring runs/gtopk
  flashsgd compare runs/dense-s1 runs/dense-s2 runs/dense-s3 runs/gtopk-s1 runs/gtopk-s2 \\
      runs/gtopk-s3 --target 98 --out sparse.png --json sparse.json
  flashsgd compare runs/a runs/b --labels "dense,gTop-k 0.1%"
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import math
import os
import statistics
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from flashsgd.fmt import table
from flashsgd.outputs import add_output, write_json
from flashsgd.train.records import read_metrics
from flashsgd.train.records.report import WARMUP_STEPS, timed_median


@dataclass
class Run:
    """One run directory: its results and the settings that can change them."""

    path: Path
    seed: int
    settings: dict[str, Any]
    """Config keys (flat field names) that can change results, run.seed excluded."""
    algorithm: str
    target_accuracy: float
    steps: list[dict]
    evals: list[dict]
    status: str = "complete"
    """``complete``, or how far the run got in a few words (``stopped 9/14``, ``incomplete 11/14``)."""
    why: str = ""
    """What is missing, in a sentence ("" when complete)."""

    @property
    def complete(self) -> bool:
        return self.status == "complete"


def _read_json(path: Path, required: bool) -> dict | None:
    """A JSON object file; None when it is missing, or (not ``required``) not a JSON object;
    ValueError naming it when ``required`` and damaged."""
    if not path.is_file():
        return None
    try:
        data = json.loads(path.read_text())
    except (ValueError, OSError) as exc:
        if required:
            raise ValueError(f"{path} cannot be read ({exc}); it is written by `flashsgd train`: "
                             "restore it or leave that run out") from None
        return None
    return data if isinstance(data, dict) else None


def _used_comm_keys(plan: dict | None) -> set[str] | None:
    """Comm options the run's hook took (plan.json's hook_options); None when not recorded.

    A length such as ``density_warmup_epochs`` goes with the option it lengthens (``density_warmup``).
    """
    options = (plan or {}).get("hook_options")
    if not isinstance(options, (dict, list)):
        return None
    return {"algorithm", "bucket_mb"} | set(options) | {f"{k}_epochs" for k in options}


def _int(value: Any) -> int | None:
    return value if isinstance(value, int) and not isinstance(value, bool) else None


def run_state(path: Path, plan: dict | None, steps: list[dict], evals: list[dict]) -> tuple[str, str]:
    """(status, why) of a run: ``("complete", "")`` when it trained every planned step (plan.json's
    ``total_steps``), evaluated after the last one and wrote summary.json at that step; else a short
    status (``stopped 9/14``: a run.max_steps stop; ``incomplete 11/14``) and what is missing."""
    summary = _read_json(path / "summary.json", required=False)
    total = _int((plan or {}).get("total_steps")) or _int((summary or {}).get("total_steps"))
    done = steps[-1]["step"] + 1 if steps else 0
    if total is None:
        return f"incomplete {done}/?", f"{done} steps of an unknown total (no plan.json or summary.json)"
    at = _int((summary or {}).get("steps"))
    if done >= total and at is not None and at >= total and evals[-1]["step"] >= total:
        return "complete", ""
    if done >= total and at is not None and at >= total:
        return f"incomplete {done}/{total}", "the evaluation after the last step is missing from metrics.jsonl"
    if at == done:
        return f"stopped {done}/{total}", f"stopped at step {done} of {total} (run.max_steps)"
    return (f"incomplete {done}/{total}", f"ended at step {done} of {total} without a summary.json for it "
            "(failed, killed or still running)")


def load_run(path: str | Path) -> Run:
    """Read one run directory; ValueError naming it when it is not a run or has no evaluation."""
    from flashsgd.train import config as C
    from flashsgd.train.records.rundir import NEUTRAL_KEYS

    path = Path(path)
    for name in ("metrics.jsonl", "config.toml"):
        if not (path / name).is_file():
            raise ValueError(f"{str(path)!r} is not a run directory of `flashsgd train` (no {name})")
    steps, evals = read_metrics(path / "metrics.jsonl", note=_note)
    if not evals:
        raise ValueError(f"{str(path)!r} has no evaluation yet (no eval row in metrics.jsonl); "
                         f"compare runs that finished at least one epoch")
    cfg = C.resolve(path / "config.toml")
    plan = _read_json(path / "plan.json", required=True)
    used = _used_comm_keys(plan)
    settings = {}
    for section, values in dataclasses.asdict(cfg).items():
        for key, value in values.items():
            if key in NEUTRAL_KEYS or key == "seed":
                continue
            if section == "comm" and used is not None and key not in used:
                continue  # e.g. density of a dense all-reduce: not a difference between runs
            settings[key] = value
    status, why = run_state(path, plan, steps, evals)
    return Run(path, cfg.run.seed, settings, cfg.comm.algorithm, cfg.run.target_accuracy, steps, evals,
               status, why)


def _note(text: str) -> None:
    print(f"flashsgd compare: note: {text}", file=sys.stderr, flush=True)


def group_runs(runs: list[Run]) -> list[list[Run]]:
    """Runs with equal settings (any seed) as one group, in the order of their first run."""
    groups: dict[str, list[Run]] = {}
    for run in runs:
        groups.setdefault(json.dumps(run.settings, sort_keys=True, default=str), []).append(run)
    return list(groups.values())


@dataclass
class Part:
    """The runs of one table row and one curve: a setting's complete runs of distinct seeds
    (pooled), or one run shown apart (incomplete, or one of complete runs that repeat a seed)."""

    runs: list[Run]
    label: str
    note: str = ""
    """Why the run is shown apart ("" for a pooled part)."""
    tag: str = ""
    """What the plot's legend adds to the label ("incomplete 11/14", "seed 3, duplicate")."""

    @property
    def legend(self) -> str:
        return f"{self.label} [{self.tag}]" if self.tag else self.label

    @property
    def complete(self) -> bool:
        return all(r.complete for r in self.runs)

    @property
    def status(self) -> str:
        return self.runs[0].status if len(self.runs) == 1 else "complete"


def split_settings(groups: list[list[Run]], labels: list[str]) -> list[Part]:
    """The table's rows and the plot's curves: :func:`split_setting` of each setting, in order."""
    return [part for group, label in zip(groups, labels) for part in split_setting(group, label)]


def split_setting(group: list[Run], label: str) -> list[Part]:
    """A setting's rows: its complete runs pooled when their seeds differ, else (a seed repeated:
    duplicates, not seeds) each complete run apart; then each incomplete run apart."""
    done = [r for r in group if r.complete]
    if len({r.seed for r in done}) == len(done):
        parts = [Part(done, label)] if done else []
    else:
        parts = [_complete_apart(r, done, label) for r in done]
    return parts + [Part([r], f"{label} ({r.path.name})", f"{r.path}: {r.why}: shown apart, never pooled",
                         r.status) for r in group if not r.complete]


def _complete_apart(run: Run, done: list[Run], label: str) -> Part:
    """A complete run of a setting whose complete runs repeat a seed (noted when it is a repeat)."""
    name = f"{label} ({run.path.name})"
    twins = [r.path.name for r in done if r.seed == run.seed]
    if len(twins) == 1:
        return Part([run], name)
    return Part([run], name, f"{len(twins)} runs of seed {run.seed} ({', '.join(twins)}): duplicates, not "
                f"{len(twins)} seeds; the complete runs of {label!r} are shown apart, not pooled",
                f"seed {run.seed}, duplicate")


def derive_labels(groups: list[list[Run]]) -> list[str]:
    """What differs between the groups' settings: the algorithm bare, other keys as key=value.

    Example: ``["ring", "gtopk density=0.01"]``. A key that only some groups have (a comm option
    of some algorithms) is shown where its values differ between those groups or it is not the
    default. Falls back to directory names when two labels would be equal.
    """
    from flashsgd.train.config import TrainConfig

    defaults = {k: v for sec in dataclasses.asdict(TrainConfig()).values() for k, v in sec.items()}
    settings = [g[0].settings for g in groups]
    shown = []
    for key in dict.fromkeys(k for s in settings for k in s):  # config order
        values = {repr(s[key]) for s in settings if key in s}
        partial = any(key not in s for s in settings)
        if len(values) > 1 or (partial and values != {repr(defaults.get(key))}):
            shown.append(key)
    labels = []
    for s, group in zip(settings, groups):
        parts = [str(s["algorithm"])] if "algorithm" in shown else []
        parts += [f"{k}={s[k]:g}" if isinstance(s[k], float) else f"{k}={s[k]}"
                  for k in shown if k != "algorithm" and k in s]
        labels.append(" ".join(parts) or group[0].algorithm)
    if len(set(labels)) < len(labels):
        labels = [",".join(r.path.name for r in g) for g in groups]
    return labels


def time_to_target(evals: list[dict], target: float) -> float | None:
    """Wall time (elapsed_s) of the first evaluation with test accuracy >= ``target`` (%), or None."""
    return next((e["elapsed_s"] for e in evals if e["test_accuracy"] >= target), None)


def run_numbers(run: Run, target: float) -> dict[str, float | None]:
    """One run's table numbers (throughput and comm share: median / mean over steps >= WARMUP_STEPS,
    the throughput as summary.json's)."""
    timed = [s for s in run.steps if s["step"] >= WARMUP_STEPS] or run.steps
    shares = [s["t_comm_s"] / s["t_step_s"] for s in timed if s["t_step_s"] > 0]
    return {
        "steps": run.steps[-1]["step"] + 1 if run.steps else 0,
        "final_test_accuracy": run.evals[-1]["test_accuracy"],
        "best_test_accuracy": max(e["test_accuracy"] for e in run.evals),
        "time_to_target_s": time_to_target(run.evals, target),
        "images_per_s": timed_median(run.steps, "images_per_s", missing=None),
        "comm_share": statistics.mean(shares) if shares else None,
    }


def _spread(values: list[float | None]) -> dict[str, Any]:
    """mean, min, max of the values that are not None, and all values (None: not reached)."""
    present = [v for v in values if v is not None]
    if not present:
        return {"mean": None, "min": None, "max": None, "values": values}
    return {"mean": statistics.mean(present), "min": min(present), "max": max(present), "values": values}


def table_rows(groups: list[list[Run]], labels: list[str], target: float) -> list[dict[str, Any]]:
    """Per part of a setting (:func:`split_settings`: complete runs of distinct seeds pooled, other
    runs apart): label, algorithm, status, complete, runs, seeds, note, and every number of
    :func:`run_numbers` as {mean, min, max, values}; plus ``final_accuracy_diff`` (mean final
    accuracy minus the first complete row's, percentage points)."""
    rows = []
    for part in split_settings(groups, labels):
        numbers = [run_numbers(r, target) for r in part.runs]
        row: dict[str, Any] = {"label": part.label, "algorithm": part.runs[0].algorithm,
                               "status": part.status, "complete": part.complete,
                               "runs": [str(r.path) for r in part.runs], "seeds": [r.seed for r in part.runs],
                               "note": part.note}
        for key in numbers[0]:
            row[key] = _spread([n[key] for n in numbers])
        rows.append(row)
    first = next((r for r in rows if r["complete"]), rows[0])["final_test_accuracy"]["mean"]
    for row in rows:
        row["final_accuracy_diff"] = row["final_test_accuracy"]["mean"] - first
    return rows


def _cell(spread: dict[str, Any], fmt: str, unit: str = "") -> str:
    """``mean`` or ``mean (min..max)``; time to target: ``not reached`` or ``k/n reached``."""
    n, values = len(spread["values"]), spread["values"]
    if spread["mean"] is None:
        return "not reached"
    text = f"{spread['mean']:{fmt}}{unit}"
    if spread["min"] != spread["max"]:
        text += f" ({spread['min']:{fmt}}..{spread['max']:{fmt}})"
    reached = sum(v is not None for v in values)
    return text + (f" [{reached}/{n} reached]" if reached < n else "")


def _percent(spread: dict[str, Any]) -> dict[str, Any]:
    """A spread of fractions as percent (mean, min and max)."""
    return {**spread, **{k: 100 * spread[k] for k in ("mean", "min", "max")}}


def format_table(rows: list[dict[str, Any]], target: float) -> str:
    """The stdout table, one line per row of :func:`table_rows` (seeds: mean (min..max)), then a
    note per run shown apart."""
    head = ["setting", "status", "algorithm", "seeds", "steps", "final acc %", "best acc %",
            f"time to {target:g}%", "images/s", "comm share", "final vs 1st complete"]
    text = table(([r["label"], r["status"], r["algorithm"], ",".join(map(str, r["seeds"])),
                   _cell(r["steps"], ".0f"), _cell(r["final_test_accuracy"], ".2f"),
                   _cell(r["best_test_accuracy"], ".2f"), _cell(r["time_to_target_s"], ".1f", " s"),
                   _cell(r["images_per_s"], ",.0f"),
                   _cell(_percent(r["comm_share"]), ".0f", "%") if r["comm_share"]["mean"] is not None else "-",
                   f"{r['final_accuracy_diff']:+.2f} pt"] for r in rows), head)
    notes = dict.fromkeys(r["note"] for r in rows if r["note"])
    return text + "".join(f"\nnote: {n}" for n in notes)


def default_plot_path(dirs: list[str], json_path: str | None) -> Path:
    """Next to --json, else compare.png in the run directories' common parent."""
    if json_path:
        return Path(json_path).with_suffix(".png")
    parent = os.path.commonpath([str(Path(d).resolve().parent) for d in dirs])
    return Path(parent) / "compare.png"


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("dirs", nargs="+", metavar="RUN_DIR", help="run directories of `flashsgd train`")
    parser.add_argument("--labels", default=None,
                        help="comma-separated names, one per setting (seeds of one setting share one; a run "
                             "shown apart adds its directory's name); default: what differs between the settings")
    parser.add_argument("--target", type=float, default=None,
                        help="test accuracy (%%) for the time-to-target column "
                             "(default: the first run's run.target_accuracy)")
    add_output(parser, "--out", "file", default=None, metavar="FILE.png",
                        help="the plot (default: next to --json, else compare.png in the runs' parent)")
    add_output(parser, "--json", default=None, metavar="FILE", help="also write the table as JSON")


def compare(dirs: list[str], labels: str | None = None, target: float | None = None,
            out: str | None = None, json_path: str | None = None) -> list[dict[str, Any]]:
    """Load, group, label; print the table; write the plot (and JSON); return the table rows.

    Raises ValueError (one line naming the directory or flag) on bad input.
    """
    from flashsgd.train.records.compare_plot import plot_comparison
    from flashsgd.train.config import check_accuracy_percent

    if target is not None:  # run.target_accuracy's rule
        check_accuracy_percent(target, "--target")
    named: dict[Path, str] = {}
    for d in dirs:  # one directory named twice is one run, not two seeds
        if Path(d).resolve() in named:
            raise ValueError(f"run directory {d!r} is named twice (also as {named[Path(d).resolve()]!r}); "
                             "name each run once")
        named[Path(d).resolve()] = d
    runs = [load_run(d) for d in dirs]
    groups = group_runs(runs)
    if labels is None:
        names = derive_labels(groups)
    else:
        names = [s.strip() for s in labels.split(",")]
        if len(names) != len(groups):
            raise ValueError(f"--labels has {len(names)} labels for {len(groups)} settings "
                             f"(runs that differ only in run.seed are one setting: "
                             f"{' | '.join(', '.join(r.path.name for r in g) for g in groups)})")
    target = runs[0].target_accuracy if target is None else target
    if not math.isfinite(target):
        raise ValueError(f"--target {target}: must be a finite accuracy in percent")
    rows = table_rows(groups, names, target)
    png = Path(out) if out else default_plot_path(dirs, json_path)
    plot_comparison(split_settings(groups, names), png, target)
    print(format_table(rows, target))
    if json_path:
        write_json(json_path, {"target_accuracy": target, "settings": rows})
    print(f"\nplot: {png.resolve()}" + (f"\ntable: {Path(json_path).resolve()}" if json_path else ""))
    return rows


def run(args: argparse.Namespace) -> int:
    try:
        compare(args.dirs, args.labels, args.target, args.out, args.json)
    except (ValueError, OSError) as exc:
        print(f"flashsgd compare: error: {exc}", file=sys.stderr)
        return 2
    return 0
