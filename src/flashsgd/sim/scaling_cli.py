"""`flashsgd simulate --calibrate FILE.json`: fit the step model to `bench scaling` rows, predict them all.

Steps (:func:`run_calibration`):

1. Load every file (:func:`flashsgd.sim.scaling.load_scaling`); rows of all files are pooled
   (a 1,2,4,8 x 1 run and a 4 x 2 run together; runs with ``--flow-rate`` or ``--grad-accum``
   beside them: each row is matched with the noop row of its own file and setting,
   :func:`flashsgd.sim.scaling.setting`).
2. Calibration shapes: ``--calibrate-on`` (e.g. ``2x1,8x1``), default the smallest and the largest
   multi-rank shape of the first file; every other measured row validates.
3. Fit (:func:`flashsgd.sim.scaling.fit`), print the parameters, predict every row, print each
   row's role, measured and predicted step and error, and the worst error per role. Rows that
   contradict their noop row (:func:`flashsgd.sim.scaling.baseline_contradiction`) are neither
   fitted nor counted in the errors; how many and which is printed and in the report's ``excluded``.

Example::

    flashsgd simulate --calibrate docs/data/scaling_8x1.json --calibrate docs/data/scaling_4x2.json \\
        --calibrate-on 2x1,8x1 --json runs/sim_scaling.json
"""

from __future__ import annotations

import json
from pathlib import Path

from flashsgd.fmt import percent, plural
from flashsgd.sim import scaling as sim


def parse_shapes(text: str | None) -> list[tuple[int, int]] | None:
    """``"2x1,8x1"`` -> [(2, 1), (8, 1)]; ValueError naming the bad item."""
    if not text:
        return None
    out = []
    for item in text.split(","):
        parts = item.strip().lower().split("x")
        if len(parts) != 2 or not all(p.isdigit() and int(p) >= 1 for p in parts):
            raise ValueError(f"--calibrate-on: shapes are NODESxRANKS such as '2x1,8x1', got {item!r}")
        out.append((int(parts[0]), int(parts[1])))
    return out


def print_predictions(preds: list[dict]) -> None:
    """One line per row; a last column with the setting (accumulation, per-flow cap) when any row
    has one."""
    labels = [sim.options_label(p["grad_accum"], p["flow_bps"]) for p in preds]
    extra = f" {'setting':<24}" if any(labels) else ""
    print(f"{'shape':>5} {'comm':>12} {'role':>16} {'measured ms':>11} {'predicted ms':>12} {'error':>7}{extra}")
    for p, label in zip(preds, labels):
        pred = "-" if p["predicted_s"] is None else f"{p['predicted_s'] * 1e3:12.1f}"
        err = "-" if p["error"] is None else f"{p['error']:+7.1%}"
        print(f"{p['nodes']:>3}x{p['ranks_per_node']:<1} {p['comm']:>12} {p['role']:>16} "
              f"{p['measured_s'] * 1e3:11.1f} {pred:>12} {err:>7}" + (f" {label or '-':<24}" if extra else ""))


def run_calibration(files: list[str], shapes_text: str | None, json_path: str | None) -> dict:
    """Steps 1-3; returns the report (also written to ``json_path``)."""
    docs = [sim.load_scaling(f) for f in files]                                     # Step 1
    rows = [r for d in docs for r in d.rows]
    density = docs[0].meta["density"]  # for rows without their own (each file's rows carry theirs)
    shapes = parse_shapes(shapes_text) or sim.default_calibration_shapes(docs[0].rows)  # Step 2
    f = sim.fit(rows, shapes, density)                                               # Step 3
    preds = sim.predict(f, rows)
    print(f"calibrated on {plural(len(f.calibration), 'row')} at shapes "
          f"{', '.join(f'{n}x{r}' for n, r in shapes)} of {', '.join(files)}; parameters:")
    print(f.describe())
    if f.exclusion_note():
        print(f"{f.exclusion_note()}; role 'contradicts noop' below, in neither error")
    print_predictions(preds)
    worst = {role: sim.max_error(preds, role) for role in ("calibration", "validation")}
    none = "none (no modelled row outside the calibration shapes)"
    print(f"max |step error|: calibration rows {percent(worst['calibration'], missing='none')}, "
          f"validation rows {percent(worst['validation'], than=0.25, missing=none)} (target 25%)")
    report = {"files": files, "calibration_shapes": [list(s) for s in shapes], "params": f.params,
              "predictions": preds, "max_error": worst,
              "excluded": [{"comm": c, "nodes": n, "ranks_per_node": r} for c, n, r in f.excluded]}
    if json_path:
        Path(json_path).parent.mkdir(parents=True, exist_ok=True)
        Path(json_path).write_text(json.dumps(report, indent=1))
        print(f"wrote {Path(json_path).resolve()}")
    return report
