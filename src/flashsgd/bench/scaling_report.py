"""Rows, table, JSON and plot of `flashsgd bench scaling` (the gTop-k paper's efficiency figure).

Per measured row (:func:`summarize`): step time median and min..max over the timed steps (each the
slowest rank's), samples/s = global batch / median step (the global batch: ``batch`` x W x
``grad_accum`` micro-batches), compute = the noop step at the same node
count, exposed communication = step - compute, compression = the sparse hooks' selection (timed
apart), scaling efficiency = noop step / step at the same node count (the fair ceiling: W ranks
share this machine's cores, so compute per rank changes with N) and efficiency vs one node =
samples/s / (N x samples/s of the noop row at the smallest node count). A row whose every step was
faster than every step of its noop row contradicts its baseline (the noop was slowed by load more
than the row; rule and derivation: :func:`flashsgd.sim.scaling.baseline_contradiction`): it carries
``contradicts_baseline: true`` and the evidence (``contradiction``), is marked ``!`` in the table
with a footnote, drawn apart in the plot and kept out of the simulator's fit. Rows within the
spread (efficiency a little over 100%) are noise, kept as measured.

The simulator (:mod:`flashsgd.sim.scaling`) is fitted on the calibration shapes (the smallest and
the largest multi-rank shape) and predicts every row; the plot draws each measured line solid and
its prediction dashed in the same colour (Shi et al. 2019, arXiv 1901.04359, Fig. 6 layout).
"""

from __future__ import annotations

import os
import platform
import statistics
import sys
import time
from pathlib import Path

from flashsgd.exchanges import COMPUTE_ONLY
from flashsgd.fmt import number, percent, plural, size
from flashsgd.sim.scaling import baseline_contradiction

AUTO_TARGET = 1.10
"""``train --comm auto``'s target: its measured step <= this x the best measured hook's."""


def summarize(rows: list[dict], batch: int) -> list[dict]:
    """Add the derived columns to every measured row (in place); returns ``rows``.

    Every row with a noop row at its shape gets ``contradicts_baseline`` (bool) and, when true,
    ``contradiction``: :func:`~flashsgd.sim.scaling.baseline_contradiction`'s evidence."""
    noop_steps = {(r["nodes"], r["ranks_per_node"]): r["step_s"]
                  for r in rows if r["comm"] == COMPUTE_ONLY and "step_s" in r}
    noop = {shape: statistics.median(steps) for shape, steps in noop_steps.items()}
    one = min(noop, key=lambda s: (s[0], s[1])) if noop else None
    for r in rows:
        if "step_s" not in r:
            continue
        shape, step = (r["nodes"], r["ranks_per_node"]), statistics.median(r["step_s"])
        compute = noop.get(shape)
        r.update(step_ms=step * 1e3, min_ms=min(r["step_s"]) * 1e3, max_ms=max(r["step_s"]) * 1e3,
                 samples_per_s=batch * r.get("grad_accum", 1) * r["world"] / step,
                 compute_ms=compute * 1e3 if compute else None,
                 exposed_comm_ms=(step - compute) * 1e3 if compute else None,
                 compression_ms=r["compression_s"] * 1e3 if "compression_s" in r else None,
                 efficiency=compute / step if compute else None)
        if shape in noop_steps:
            evidence = None if r["comm"] == COMPUTE_ONLY else baseline_contradiction(r["step_s"], noop_steps[shape])
            r["contradicts_baseline"] = evidence is not None
            if evidence is not None:
                r["contradiction"] = evidence
        if one is not None:
            base = batch * r.get("grad_accum", 1) * one[0] * one[1] / noop[one]  # the smallest shape's noop
            r["efficiency_vs_1node"] = r["samples_per_s"] / (base * r["nodes"] / one[0])
    return rows


def auto_verdicts(rows: list[dict]) -> list[dict]:
    """Per shape with an ``auto`` row: its choice, its measured step, the best measured hook's step
    (noop and auto excluded) and their ratio (``train --comm auto``'s target: <= :data:`AUTO_TARGET`)."""
    out = []
    for a in rows:
        if a["comm"] != "auto" or "step_s" not in a:
            continue
        shape = (a["nodes"], a["ranks_per_node"])
        others = [r for r in rows if (r["nodes"], r["ranks_per_node"]) == shape and "step_s" in r
                  and r["comm"] not in (COMPUTE_ONLY, "auto")]
        if not others:
            continue
        best = min(others, key=lambda r: statistics.median(r["step_s"]))
        step, best_step = statistics.median(a["step_s"]), statistics.median(best["step_s"])
        out.append({"nodes": shape[0], "ranks_per_node": shape[1], "chosen": a["chosen"]["label"],
                    "explain": a["chosen"]["explain"], "auto_ms": step * 1e3, "best_comm": best["comm"],
                    "best_ms": best_step * 1e3, "ratio": step / best_step})
    return out


def simulate_rows(rows: list[dict], density: float, matrices: list | None) -> tuple[dict | None, list[dict]]:
    """Fit the simulator on this run's calibration shapes and predict every row (or say why not)."""
    from flashsgd.sim import scaling as sim

    measured = [{**r, "matrices": matrices} for r in rows if "step_s" in r]
    try:
        shapes = sim.default_calibration_shapes(measured)
        f = sim.fit(measured, shapes, density)
    except ValueError as exc:
        return {"error": str(exc)}, []
    preds = sim.predict(f, measured)
    return {"params": f.params, "calibration_shapes": [list(s) for s in shapes],
            "excluded": [{"comm": c, "nodes": n, "ranks_per_node": r} for c, n, r in f.excluded],
            "exclusion_note": f.exclusion_note(),
            "max_error_calibration": sim.max_error(preds, "calibration"),
            "max_error_validation": sim.max_error(preds, "validation"),
            "describe": f.describe()}, preds


def build_document(spec: dict, rows: list[dict], info: dict, rate: int, args, started: float,
                   load0: tuple) -> dict:
    """The JSON document: settings, machine, load, rows, the simulator's fit and predictions.

    ``meta.link_bps`` is the rate at the largest node count; each row carries its own ``link_bps``.
    """
    import torch

    summarize(rows, spec["batch"])
    fit, preds = simulate_rows(rows, spec["density"], info.get("matrices"))
    by = {(p["comm"], p["nodes"], p["ranks_per_node"]): p for p in preds}
    for r in rows:
        p = by.get((r["comm"], r["nodes"], r["ranks_per_node"]))
        if p is not None and p["predicted_s"] is not None:
            r.update(predicted_ms=p["predicted_s"] * 1e3, prediction_role=p["role"],
                     prediction_error=p["error"])
    meta = {"benchmark": "scaling", "argv": sys.argv, **{k: v for k, v in spec.items()},
            "link_bps": rate, "comm_compute": args.comm_compute, "link_arg": args.link,
            "params": info.get("params"), "numels": info.get("numels"), "matrices": info.get("matrices"),
            "grad_bytes": 4 * info["params"] if info.get("params") else None,
            "cpus": os.cpu_count(), "machine": platform.machine(), "kernel": platform.release(),
            "python": platform.python_version(), "torch": torch.__version__,
            "loadavg_start": load0, "loadavg_end": os.getloadavg(), "elapsed_s": time.time() - started,
            "started_utc": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime(started))}
    return {"meta": meta, "rows": rows, "simulator": fit, "auto": auto_verdicts(rows)}


def _fmt(v, spec: str, scale: float = 1.0) -> str:
    return "-" if v is None else format(v * scale, spec)


def _accum(meta: dict) -> str:
    k = meta.get("grad_accum", 1)
    return f" x {k} micro-batches per exchange (--grad-accum {k})" if k > 1 else ""


def _flow(meta: dict) -> str:
    """The per-flow cap as the header says it (at the largest node count, as the link)."""
    if not meta.get("flow_bps"):
        return ""
    return f", one TCP flow at most {meta['flow_bps'] / 1e6:.3f} Mbit/s (--flow-rate {meta['flow_rate']})"


def baseline_notes(rows: list[dict]) -> list[str]:
    """The table's footnotes on efficiency over 100%: why each ``!`` row is marked, and that the
    unmarked ones are noise."""
    marked = [r for r in rows if r.get("contradicts_baseline")]
    lines = []
    if marked:
        lines.append(f"# !: faster than the noop step at the same shape beyond the spread of both ("
                     f"{plural(len(marked), 'row')}): eff and exposed are the load's, not the hook's; kept out "
                     "of the simulator's fit and errors")
        lines += [f"#   {r['nodes']}x{r['ranks_per_node']} {r['comm']}: {r['contradiction']['why']}" for r in marked]
    if any(r["comm"] != COMPUTE_ONLY and not r.get("contradicts_baseline") and (r.get("exposed_comm_ms") or 0) < 0
           for r in rows if "step_s" in r):
        lines.append("# exposed < 0 (eff > 100%) without !: within the min..max of the row and its noop row "
                     "(noise), kept as measured")
    return lines


def format_table(doc: dict) -> str:
    """The table printed at the end of a run (one line per row, skipped/failed rows with why)."""
    m = doc["meta"]
    lines = [f"# bench scaling: {m['model']} ({m['params'] or 0:,} parameters, {size(m['grad_bytes'] or 0)} "
             f"gradient), batch {m['batch']}/rank{_accum(m)}, recipe {m['recipe']}, link "
             f"{m['link_bps'] / 1e6:.3f} Mbit/s"
             + (f" (--comm-compute {m['comm_compute']:g})" if m["comm_compute"] else "") + _flow(m),
             f"# {m['cpus']} CPUs, load avg {m['loadavg_start'][0]:.2f} at start, {m['loadavg_end'][0]:.2f} "
             f"at end; median of {plural(m['iters'], 'step')} after {m['warmup']} warm-up; {m['elapsed_s']:.0f} s",
             f"{'shape':>5} {'comm':>12} {'step ms':>8} {'min..max':>15} {'samples/s':>9} {'compute':>8} "
             f"{'exposed':>8} {'compr.':>7} {'eff':>6}  {'eff/1n':>6} {'sim ms':>8} {'err':>7} {'Mbit/s':>7} {'load':>5}"]
    for r in doc["rows"]:
        shape = f"{r['nodes']}x{r['ranks_per_node']}"
        if "step_s" not in r:
            why = r.get("skipped") or r.get("error", "")
            lines.append(f"{shape:>5} {r['comm']:>12} {'skipped' if 'skipped' in r else 'FAILED'}: "
                         f"{why.strip().splitlines()[-1] if why.strip() else ''}"[:300])
            continue
        lines.append(
            f"{shape:>5} {r['comm']:>12} {r['step_ms']:8.1f} {r['min_ms']:7.1f}..{r['max_ms']:<7.1f} "
            f"{r['samples_per_s']:9.1f} {_fmt(r['compute_ms'], '8.1f')} {_fmt(r['exposed_comm_ms'], '8.1f')} "
            f"{_fmt(r['compression_ms'], '7.1f')} {_fmt(r['efficiency'], '6.1%')}"
            f"{'!' if r.get('contradicts_baseline') else ' '} "
            f"{_fmt(r.get('efficiency_vs_1node'), '6.1%')} {_fmt(r.get('predicted_ms'), '8.1f')} "
            f"{_fmt(r.get('prediction_error'), '+7.1%')} {r['link_bps'] / 1e6:7.2f} {r['loadavg'][0]:5.2f}")
    lines += baseline_notes(doc["rows"])
    for v in auto_verdicts(doc["rows"]):
        lines.append(f"# auto at {v['nodes']}x{v['ranks_per_node']} chose {v['chosen']}: {v['auto_ms']:.1f} ms "
                     f"vs the best measured hook {v['best_comm']} {v['best_ms']:.1f} ms = "
                     f"{number(v['ratio'], than=AUTO_TARGET)}x (target <= {AUTO_TARGET:.2f})\n#   why: {v['explain']}")
    sim = doc.get("simulator") or {}
    if "params" in sim:
        lines.append(f"# simulator fitted on shapes {sim['calibration_shapes']} (the other shapes validate): "
                     f"max |error| calibration {percent(sim['max_error_calibration'], missing='none')}, "
                     f"validation {percent(sim['max_error_validation'], than=0.25, missing='none (no other shape)')}"
                     + (f"; {sim['exclusion_note']}" if sim.get("exclusion_note") else "")
                     + f"\n{sim['describe']}")
    elif sim:
        lines.append(f"# simulator: {sim['error']}")
    return "\n".join(lines)


def plot(doc: dict, path: str | Path) -> None:
    """Scaling efficiency vs nodes per hook: measured solid, the simulator's prediction dashed."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    rows = [r for r in doc["rows"] if r.get("efficiency") is not None and r["comm"] != COMPUTE_ONLY]
    fig, ax = plt.subplots(figsize=(7, 4.5), dpi=120)
    for i, comm in enumerate(dict.fromkeys(r["comm"] for r in rows)):
        rs = sorted((r for r in rows if r["comm"] == comm), key=lambda r: r["nodes"])
        color = f"C{i % 10}"
        good = [r for r in rs if not r.get("contradicts_baseline")]  # marked rows: apart, not on the line
        ax.plot([r["nodes"] for r in good], [100 * r["efficiency"] for r in good], "-o", color=color, label=comm)
        bad = [r for r in rs if r.get("contradicts_baseline")]
        if bad:
            ax.plot([r["nodes"] for r in bad], [100 * r["efficiency"] for r in bad], "x", color=color, markersize=8)
        sim = [r for r in rs if r.get("predicted_ms")]
        if sim:
            ax.plot([r["nodes"] for r in sim], [100 * r["compute_ms"] / r["predicted_ms"] for r in sim],
                    "--", color=color, alpha=0.7, linewidth=1)
    nodes = sorted({r["nodes"] for r in doc["rows"]})
    ax.set_xscale("log", base=2)
    ax.set_xticks(nodes, [str(n) for n in nodes])
    ax.minorticks_off()
    ax.set_xlabel(f"nodes (x {doc['meta']['ranks_per_node']} rank)")
    ax.set_ylabel("scaling efficiency vs noop at same N (%)")
    ax.set_ylim(0, max([110.0] + [100 * r["efficiency"] + 5 for r in rows]))
    m = doc["meta"]
    link = f"link {m['link_bps'] / 1e6:.3g} Mbit/s" + (" at the largest N, x its CPU share below"
                                                       if m.get("link_follows_cpu") else "")
    ratio = f" (dense comm = {m['comm_compute']:g}x compute)" if m["comm_compute"] else ""
    if m.get("flow_bps"):
        link += f", flow {m['flow_bps'] / 1e6:.3g} Mbit/s"
    if m.get("grad_accum", 1) > 1:
        link += f", {m['grad_accum']} micro-batches per exchange"
    marked = any(r.get("contradicts_baseline") for r in rows)
    ax.set_title(f"{m['model']}, {m['batch']}/rank, {link}{ratio}\nsolid: measured; dashed: simulator "
                 "(fitted on the calibration shapes)"
                 + ("\nx: faster than its noop beyond the spread of both (load), not fitted" if marked else ""), fontsize=8)
    ax.grid(True, alpha=0.3)
    ax.legend(fontsize=8, ncol=3, loc="lower left")
    fig.tight_layout()
    Path(path).parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path)
    plt.close(fig)
