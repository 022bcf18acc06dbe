"""The simulator against published scaling measurements: docs/simulator.md, "Validation against
published figures".

Reads ``docs/data/published_scaling.toml`` (one ``[[row]]`` per published number, its setup and
the cluster it ran on), predicts each number the way ``flashsgd simulate`` does (the cluster file
or preset through :func:`flashsgd.sim.cluster_file.load_cluster`, the compute rate and its range by
``plan``'s rules, :func:`flashsgd.sim.engine.simulate` at the stated values and at the corners of
every assumed input, :func:`flashsgd.sim.uncertainty.runs_over_ranges`; a number that is the ratio
of two runs at every setting of the ends of the inputs that move it, since a ratio need not be
extreme where either run is), and prints a markdown
table (published, predicted, the printed range, whether the published value is inside it, the
error, whether the prediction is optimistic) and the summary the issue's targets are about.

Nothing here is fitted: every input is in the data file or the cluster files, fixed before the
comparison. The script has no model of its own, so after a change to the simulator it shows what
the change does to the comparison::

    .venv/bin/python benchmarks/validate_published.py
    .venv/bin/python benchmarks/validate_published.py --json runs/published.json
"""

from __future__ import annotations

import argparse
import itertools
import json
import sys
import time
import tomllib
from dataclasses import replace
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
DATA = ROOT / "docs" / "data" / "published_scaling.toml"

from flashsgd.sim.cluster_file import load_cluster  # noqa: E402
from flashsgd.sim.engine import SimConfig, simulate  # noqa: E402
from flashsgd.sim.plan_cli import compute_range, images_per_s  # noqa: E402
from flashsgd.sim.uncertainty import Corner, at_corner, runs_over_ranges  # noqa: E402
from flashsgd.sim.workload import get_workload  # noqa: E402

KINDS = {
    "efficiency": "scaling efficiency",
    "speedup": "speed-up over one GPU",
    "images_per_s": "images/s of the job",
    "efficiency_relative": "efficiency relative to base_gpus",
    "efficiency_drop": "efficiency at base_gpus / at gpus",
    "efficiency_ratio": "efficiency of algorithm / of baseline_algorithm",
}
"""What each ``kind`` of published number is (module docstring of the data file)."""

REQUIRED = ("id", "source", "hardware", "model", "gpus", "batch_per_gpu", "precision", "algorithm",
            "cluster", "published", "kind")
TARGETS = {"optimistic_max": 0.60, "inside_min": 0.80, "drop_fraction_min": 0.5}
"""Issue 35's targets: optimistic on at most 60% of the numbers, >= 80% inside the printed range,
the gTop-k paper's dense efficiency falling 4 -> 32 nodes at least half as steeply as measured."""
DROP_ROW = "gtopk-dense-4to32"


def load_rows(path: Path = DATA) -> list[dict]:
    """The ``[[row]]`` tables of the data file, each checked for the keys every row needs."""
    rows = tomllib.loads(Path(path).read_text()).get("row", [])
    for r in rows:
        missing = [k for k in REQUIRED if k not in r]
        if missing:
            raise ValueError(f"{path}: row {r.get('id', '?')!r} lacks {', '.join(missing)}")
        if r["kind"] not in KINDS:
            raise ValueError(f"{path}: row {r['id']!r}: kind {r['kind']!r} is not one of {', '.join(KINDS)}")
        if r["kind"] in ("efficiency_relative", "efficiency_drop") and "base_gpus" not in r:
            raise ValueError(f"{path}: row {r['id']!r}: kind {r['kind']} needs base_gpus")
        if r["kind"] == "efficiency_ratio" and "baseline_algorithm" not in r:
            raise ValueError(f"{path}: row {r['id']!r}: kind efficiency_ratio needs baseline_algorithm")
    return rows


def _cluster_spec(spec: str) -> str:
    """A cluster file relative to the repository root (any working directory), or a preset name."""
    return str(ROOT / spec) if spec.endswith(".toml") else spec


def _model_spec(spec: str) -> str:
    return str(ROOT / spec) if spec.endswith(".json") else spec


def _runs(row: dict) -> list[tuple[str, int, int, int]]:
    """The (algorithm, GPUs, batch per GPU, micro-batches per exchange) the row's number needs: first
    its own, then its reference, if any (``base_batch_per_gpu`` / ``base_grad_accum``: the reference's
    own, as in a strong-scaling table where the accumulation shrinks as the GPUs grow)."""
    batch, accum = row["batch_per_gpu"], row.get("grad_accum", 1)
    own = (row["algorithm"], row["gpus"], batch, accum)
    if row["kind"] in ("efficiency_relative", "efficiency_drop"):
        return [own, (row["algorithm"], row["base_gpus"], row.get("base_batch_per_gpu", batch),
                      row.get("base_grad_accum", accum))]
    if row["kind"] == "efficiency_ratio":
        return [own, (row["baseline_algorithm"], row["gpus"], batch, accum)]
    return [own]


def _value(row: dict, results: list) -> float:
    """The row's published quantity from the simulated runs (:func:`_runs`' order)."""
    r = results[0]
    kind = row["kind"]
    if kind == "efficiency":
        return r.efficiency
    if kind == "speedup":
        return r.efficiency * r.gpus
    if kind == "images_per_s":
        return r.images_per_s
    if kind == "efficiency_relative":
        return r.efficiency / results[1].efficiency
    if kind == "efficiency_drop":
        return results[1].efficiency / r.efficiency
    return r.efficiency / results[1].efficiency  # efficiency_ratio


def predict(row: dict) -> dict:
    """The row's prediction at the stated values and its range over the assumed inputs' corners."""
    cluster = load_cluster(_cluster_spec(row["cluster"]))
    workload = get_workload(_model_spec(row["model"]))
    rate_range = row.get("images_per_s_range")
    args = argparse.Namespace(images_per_s=row.get("images_per_s"), precision=row["precision"],
                              images_per_s_range=tuple(rate_range) if rate_range else None)
    ips = images_per_s(args, cluster, workload)  # plan's and simulate's rules: same defaults, ranges
    ips_range = compute_range(args, cluster, workload)
    base = SimConfig(algorithm=row["algorithm"], gpus=row["gpus"], images_per_s=ips,
                     batch_per_gpu=row["batch_per_gpu"], precision=row["precision"],
                     bucket_mb=float(row.get("bucket_mb", 25.0)),
                     groups=tuple(row["groups"]) if row.get("groups") else None,
                     schedule=row.get("schedule", "overlap"), grad_accum=row.get("grad_accum", 1),
                     grid=tuple(row["grid"]) if row.get("grid") else None,
                     **({"index_bytes": row["index_bytes"]} if "index_bytes" in row else {}))
    plan = _runs(row)
    for _, gpus, _, _ in plan:
        cluster.check_gpus(gpus)

    def run(c, rate):
        return [simulate(workload, c, replace(base, algorithm=a, gpus=g, batch_per_gpu=b, grad_accum=n,
                                              images_per_s=rate)) for a, g, b, n in plan]

    ranged = runs_over_ranges(run, cluster, ips, ips_range, row["precision"], workload.unit)
    value = _value(row, ranged.runs)
    if len(plan) == 1:  # one run's number moves one way with each input: the corners hold it
        at = [_value(row, runs) for _, runs in ranged.at]
    else:  # a ratio of two runs need not: every setting of the ends of the inputs that move it
        keys = _moving(row, run, cluster, ips, ranged.inputs, value)
        at = [_value(row, run(*at_corner(cluster, ips, ranged.inputs, Corner("any", dict(zip(keys, ends))))))
              for ends in itertools.product((True, False), repeat=len(keys))]
    lo, hi = min([value, *at]), max([value, *at])
    return {"predicted": value, "range": [lo, hi], "assumed": [a.key for a in ranged.inputs],
            "corners": [c.name for c, _ in ranged.at], "images_per_s_per_gpu": ips,
            "images_per_s_range": list(ips_range) if ips_range else None,
            "cluster": cluster.name, "workload": workload.name}


def _moving(row: dict, run, cluster, ips: float, inputs: list, value: float) -> list[str]:
    """The inputs that move the row's number when set alone to either end (the others, such as a
    dense exchange's sparse costs or a ring's incast, are never read by its runs)."""
    out = []
    for a in inputs:
        for fast in (True, False):
            if _value(row, run(*at_corner(cluster, ips, inputs, Corner(a.key, {a.key: fast})))) != value:
                out.append(a.key)
                break
    return out


def _interval(published) -> tuple[float, float]:
    if isinstance(published, list):
        return float(published[0]), float(published[1])
    return float(published), float(published)


def judge(row: dict, p: dict) -> dict:
    """Inside the range, the error and whether the prediction is optimistic (promises more than
    was published: a higher efficiency, speed-up, throughput or gain; a smaller drop)."""
    lo, hi = _interval(row["published"])
    pred = p["predicted"]
    rlo, rhi = p["range"]
    inside = rlo <= hi and lo <= rhi  # the published value (or its range) meets the printed range
    spread = float(row.get("measurement_spread", 0.0))  # the source's own repeats of one setup differ so
    within_spread = rlo <= hi * (1 + spread) and lo * (1 - spread) <= rhi
    if lo <= pred <= hi:
        error = 0.0
    else:
        ref = hi if pred > hi else lo
        error = (pred - ref) / ref
    optimistic = (pred < lo) if row["kind"] == "efficiency_drop" else (pred > hi)
    return {"inside": inside, "within_spread": within_spread, "error": error, "optimistic": optimistic}


def _fmt(kind: str, v: float) -> str:
    if kind in ("efficiency", "efficiency_relative"):
        return f"{v:.1%}"
    if kind == "images_per_s":
        return f"{v / 1e6:.2f}M" if v >= 1e5 else f"{v:.0f}"
    return f"{v:.2f}x" if kind in ("efficiency_drop", "efficiency_ratio") else f"{v:.1f}x"


def _fmt_published(row: dict) -> str:
    lo, hi = _interval(row["published"])
    text = _fmt(row["kind"], lo) if lo == hi else f"{_fmt(row['kind'], lo)}-{_fmt(row['kind'], hi)}"
    if row["kind"] == "efficiency_relative":
        text += f" (vs {row['base_gpus']})"
    elif row["kind"] == "efficiency_drop":
        text += f" ({row['base_gpus']}->{row['gpus']})"
    elif row["kind"] == "efficiency_ratio":
        text += f" (vs {row['baseline_algorithm']})"
    elif row["kind"] == "images_per_s":
        text = "> " + text
    marks = ("~" if row.get("approximate") else "") + ("\u2020" if row.get("secondary") else "")
    return text + (f" {marks}" if marks else "")


def setup_text(row: dict) -> str:
    accum = f" in {row['grad_accum']} micro-batches" if row.get("grad_accum", 1) > 1 else ""
    sched = "" if row.get("schedule", "overlap") == "overlap" else f", {row['schedule']}"
    return (f"{row['hardware']}; {row['model'].rsplit('/', 1)[-1].removesuffix('.json')}, "
            f"{row['gpus']} GPUs, batch {row['batch_per_gpu']}/GPU{accum}, {row['precision']} on the wire, "
            f"`{row['algorithm']}`{sched}")


def evaluate(rows: list[dict]) -> list[dict]:
    out = []
    for row in rows:
        p = predict(row)
        out.append({"id": row["id"], "new": row.get("new", True), "group": row.get("group"), "kind": row["kind"],
                    "published": row["published"], "source": row["source"], "setup": setup_text(row),
                    **p, **judge(row, p)})
    return out


def summary(results: list[dict]) -> dict:
    def shares(rs: list[dict]) -> dict:
        n = len(rs)
        return {"rows": n, "optimistic": sum(r["optimistic"] for r in rs),
                "inside": sum(r["inside"] for r in rs),
                "optimistic_share": sum(r["optimistic"] for r in rs) / n if n else float("nan"),
                "inside_share": sum(r["inside"] for r in rs) / n if n else float("nan"),
                "within_spread": sum(r["within_spread"] for r in rs)}

    out = {"all": shares(results), "new": shares([r for r in results if r["new"]]), "targets": TARGETS,
           "groups": {g: shares([r for r in results if r["group"] == g])
                      for g in dict.fromkeys(r["group"] for r in results if r["group"])}}
    drop = next((r for r in results if r["id"] == DROP_ROW), None)
    if drop is not None:
        measured = _interval(drop["published"])[0]
        frac = (drop["predicted"] - 1) / (measured - 1)
        out["gtopk_dense_drop"] = {"measured": measured, "predicted": drop["predicted"],
                                   "range": drop["range"], "fraction_of_measured": frac,
                                   "met": frac >= TARGETS["drop_fraction_min"]}
    return out


def print_table(results: list[dict], rows: list[dict]) -> None:
    """The markdown table: one line per row of the data file, in its order."""
    by_id = {r["id"]: r for r in rows}
    print("| id | setup | published | predicted | range | inside? | error | optimistic? |")
    print("|---|---|---|---|---|---|---|---|")
    for r in results:
        kind, (lo, hi) = r["kind"], r["range"]
        print(f"| {r['id']}{'' if r['new'] else ' (earlier)'} | {r['setup']} | {_fmt_published(by_id[r['id']])} | "
              f"{_fmt(kind, r['predicted'])} | {_fmt(kind, lo)}-{_fmt(kind, hi)} | "
              f"{'yes' if r['inside'] else 'no'} | {r['error']:+.1%} | {'yes' if r['optimistic'] else 'no'} |")


def print_summary(s: dict) -> None:
    t = s["targets"]
    lines = [("all rows", s["all"]), ("rows new to this table", s["new"])]
    lines += [(f"rows of group {g!r}", v) for g, v in s.get("groups", {}).items()]
    for label, v in lines:
        spread = v["within_spread"] - v["inside"]
        print(f"{label}: {v['rows']}; optimistic on {v['optimistic']} ({v['optimistic_share']:.0%}; target "
              f"<= {t['optimistic_max']:.0%}: {'met' if v['optimistic_share'] <= t['optimistic_max'] else 'not met'}); "
              f"published value inside the printed range on {v['inside']} ({v['inside_share']:.0%}; target >= "
              f"{t['inside_min']:.0%}: {'met' if v['inside_share'] >= t['inside_min'] else 'not met'})"
              + (f"; within the source's measurement spread of it on {v['within_spread']} "
                 f"({v['within_spread'] / v['rows']:.0%})" if spread else ""))
    d = s.get("gtopk_dense_drop")
    if d:
        print(f"gTop-k paper, dense efficiency 4 -> 32 nodes: falls {d['measured']:.2f}x measured, "
              f"{d['predicted']:.2f}x predicted [{d['range'][0]:.2f}-{d['range'][1]:.2f}]: "
              f"{d['fraction_of_measured']:.0%} of the measured fall (fall - 1; target >= "
              f"{t['drop_fraction_min']:.0%}: {'met' if d['met'] else 'not met'})")


def main(argv: list[str] | None = None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--data", default=str(DATA), help="the data file (default docs/data/published_scaling.toml)")
    ap.add_argument("--json", metavar="PATH", help="also write every row's prediction and the summary as JSON")
    args = ap.parse_args(argv)
    t0 = time.perf_counter()
    rows = load_rows(Path(args.data))
    results = evaluate(rows)
    s = summary(results)
    print_table(results, rows)
    print()
    print("~: approximate (\"~\" in the source, or read off a figure); \u2020: not read in the primary source. "
          "range: the lowest and highest prediction over the assumed inputs' ranges (flashsgd simulate's "
          "[low-high]); error: against the published value (its nearest end for a published range).")
    print_summary(s)
    elapsed = time.perf_counter() - t0
    print(f"({len(rows)} rows in {elapsed:.2f} s)")
    report = {"data": str(args.data), "rows": results, "summary": s, "seconds": elapsed}
    if args.json:
        Path(args.json).parent.mkdir(parents=True, exist_ok=True)
        Path(args.json).write_text(json.dumps(report, indent=2, default=str))
        print(f"wrote {Path(args.json).resolve()}")
    return report


if __name__ == "__main__":
    main(sys.argv[1:])
