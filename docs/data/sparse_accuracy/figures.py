"""Tables and plots of docs/sparse_accuracy.md from the run directories under runs/sa/.

`flashsgd compare`'s own loading, grouping, table and plot (flashsgd.train.records.compare), with one
addition: the hook options run.py passes outside the config (momentum_correction, local_clip, ...,
recorded in each run's plan.json) count as settings, so runs that differ only there stay apart.

Usage::

    python docs/data/sparse_accuracy/figures.py NAME TARGET LABEL=RUN[,RUN...] ...

writes docs/img/sparse_accuracy_NAME.png and docs/data/sparse_accuracy/NAME.json and prints the table.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

from flashsgd.train.records.compare import format_table, load_run, table_rows
from flashsgd.train.records.compare_plot import plot_comparison

EXTRA = ("momentum_correction", "nesterov", "momentum_masking", "local_clip", "matrix_approximation_rank")


def main(argv: list[str]) -> None:
    name, target, *specs = argv
    groups, labels = [], []
    for spec in specs:
        label, dirs = spec.split("=", 1)
        runs = []
        for d in dirs.split(","):
            run = load_run(Path("runs/sa") / d)
            options = json.loads((run.path / "plan.json").read_text())["hook_options"]
            run.settings.update({k: options[k] for k in EXTRA if k in options})
            runs.append(run)
        groups.append(runs)
        labels.append(label)
    rows = table_rows(groups, labels, float(target))
    plot_comparison(groups, labels, Path(f"docs/img/sparse_accuracy_{name}.png"), float(target))
    Path(f"docs/data/sparse_accuracy/{name}.json").write_text(
        json.dumps({"target_accuracy": float(target), "settings": rows}, indent=2, default=str) + "\n")
    print(format_table(rows, float(target)))


if __name__ == "__main__":
    main(sys.argv[1:])
