"""Predict `flashsgd bench scaling` rows: a closed-form step-time model calibrated on measured rows.

The measured step of hook ``a`` at N nodes of L ranks (world W = N L) is modelled as::

    step(a, N) = compute(N) + sum over DDP buckets j of comm_a(n_j, W, L)

    comm_a(n) = s(N) [ c_msg A + c_byte Bcpu + c_elem E + c_call C + c_sparse S + c_flop F ]
                + link_factor B 8 / rate

* ``compute(N)``: the noop hook's measured step at the same setting (:func:`setting`: shape,
  micro-batches per exchange ``grad_accum``, per-flow cap ``flow_bps``, file): forward, backward,
  the trainer's small sync all-reduce and the optimizer; with ``--grad-accum K`` all K
  micro-steps. The noop rows are inputs, never predicted; a row is matched only with the noop row
  of its own setting, so rows of several files and settings can be fitted together;
* ``s(N) = (compute(N) / K) / (compute(N0) / K0)``: the CPU-sharing slowdown (W ranks share this
  machine's cores, so every CPU cost of the exchange grows with it), per micro-batch (a step of K
  micro-batches has K times the compute but one exchange); N0 the smallest measured world (the
  first such noop row);
* A, B, Bcpu, E, C, S, F: the coefficients of the algorithm's own closed-form cost
  (:data:`flashsgd.sim.algorithms.SIMULATED`, formulas in :mod:`flashsgd.sim.costs`) evaluated on unit
  clusters: A = message steps on the critical path, B = bytes on the critical path over the
  inter-node link (its flows sharing the node's link; B 8 / rate is their time at the nominal tbf
  rate). With a per-flow cap (``bench scaling --flow-rate``: the row's ``flow_bps``) B is the
  link-time-equivalent bytes B_eff: the unit cluster's inter link carries the cap at the same ratio
  to the link (:attr:`flashsgd.sim.network.Link.flow_gbps`), so each flow's bytes count
  max(flows, link / flow) / flows times (:meth:`~flashsgd.sim.network.Link.flow_beta`, used by
  :func:`flashsgd.sim.costs.ring_levels` and :func:`~flashsgd.sim.costs.pair_levels`): on 4x2 with
  flow = link / 4 the flat ring's one flow per NIC counts 4 x, the torus's two flows 2 x;
  Bcpu = bytes on the critical path on any
  level (our send/recv stages copy every byte), E = elements selected over (sparse: the local top-k
  and the 2k -> k merges), C = collective calls, S = sparse exchanges, F = floating-point
  operations of PowerSGD's matrix products (the whole model's matrices in one message,
  :mod:`flashsgd.sim.costs_lowrank`, from the file's ``meta.matrices``);
* the parameters, all >= 0: ``c_msg`` (s per message step: no latency is injected by the emulation,
  so this is the per-message CPU cost), ``link_factor`` (the link's time over its nominal rate's:
  TCP/IP headers and tbf bursts; 1.0 = exactly the configured rate),
  ``c_byte`` (CPU s per byte moved), ``c_elem`` (selection and merge s per element), ``c_call``
  (s per collective call), ``c_sparse`` (s per sparse exchange: packing and bookkeeping),
  ``c_flop`` (s per flop of PowerSGD's products).

DDP's reduction of the last bucket cannot overlap backward; with the 1-2 buckets of the small
models measured here the exchange is taken as exposed (no overlap term).

Algorithm (:func:`fit`): build the (A, B, Bcpu, E, C, S) row of every calibration row, scale the CPU
columns by s(N), subtract compute(N) from the measured median step, and solve a non-negative least
squares problem on the relative error of the step (:func:`_nnls_weighted`). :func:`predict` gives
every row; rows of hooks the simulator does not model (``powersgd``...) are listed as such. Rows
that contradict their noop row (every step faster than every noop step, :func:`baseline_contradiction`:
the noop was slowed by load more than they were) are measurement errors: never fitted, and
predicted with the role ``"contradicts noop"``, outside both error figures (:attr:`ScalingFit.excluded`).

Example::

    >>> doc = load_scaling("docs/data/scaling_8x1.json")                 # doctest: +SKIP
    >>> f = fit(doc.rows, calibration_shapes=[(2, 1), (8, 1)])          # doctest: +SKIP
    >>> [round(r["error"], 3) for r in predict(f, doc.rows)]            # doctest: +SKIP
"""

from __future__ import annotations

import math
import statistics
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from flashsgd.exchanges import COMPUTE_ONLY, WIRE_INDEX_BYTES, reads
from flashsgd.fmt import plural
from flashsgd.sim.algorithms import SIMULATED
from flashsgd.sim.calibrate import load_json
from flashsgd.sim.costs import CommSetup
from flashsgd.sim.network import ClusterModel, Link

PARAMS = ("c_msg", "link_factor", "c_byte", "c_elem", "c_call", "c_sparse", "c_flop")
CPU_PARAMS = ("c_msg", "c_byte", "c_elem", "c_call", "c_sparse", "c_flop")
_INF_GBPS = 1e300   # a link that costs nothing per byte
_UNIT_GBPS = 1e-9   # 1 s per byte


@dataclass(frozen=True)
class ScalingRows:
    """A `bench scaling` JSON file: its settings and its measured rows."""

    path: str
    meta: dict
    rows: list[dict]


def median_step_s(row: dict) -> float:
    return statistics.median(row["step_s"])


def load_scaling(path: str | Path) -> ScalingRows:
    """Read a ``flashsgd bench scaling --json`` file; ValueError naming what is missing."""
    doc = load_json(path, "scaling file", ("meta", "rows"), " (written by `flashsgd bench scaling --json`)")
    rows = []
    for i, r in enumerate(doc["rows"]):
        if "step_s" not in r:
            continue  # skipped or failed rows carry no time
        for key in ("comm", "nodes", "ranks_per_node", "world", "link_bps", "bucket_bytes"):
            if key not in r:
                raise ValueError(f"scaling file {str(path)!r}: rows[{i}] lacks {key!r}")
        # files written before --grad-accum / --flow-rate: one micro-batch, no per-flow cap
        rows.append({"grad_accum": 1, "flow_bps": None, **r, "source": str(path)})
    meta = doc["meta"]
    for key in ("density",):
        if key not in meta:
            raise ValueError(f"scaling file {str(path)!r}: meta lacks {key!r}")
    for r in rows:  # the sparse hooks' density of this file (files pooled in one fit may differ)
        r.setdefault("density", meta["density"])
    for r in rows:  # PowerSGD's cost needs the model's matrices (in memory only)
        r["matrices"] = meta.get("matrices")
    return ScalingRows(str(path), meta, rows)


def _unit(row: dict, *, alpha: float = 0.0, inter_gbps: float = _INF_GBPS, intra_gbps: float = _INF_GBPS,
          call: float = 0.0, sparse: float = 0.0, select: float = 0.0, flop: float = 0.0,
          flow_cap: bool = False) -> ClusterModel:
    """A unit cluster for one coefficient; ``flow_cap``: the inter link's per-flow limit at the
    row's ``flow_bps / link_bps`` of the link (none when the row has no cap)."""
    flow = row.get("flow_bps")
    inter_flow = inter_gbps * flow / row["link_bps"] if flow_cap and flow else None
    return ClusterModel(name="unit", ranks_per_node=row["ranks_per_node"],
                        intra=Link(alpha, intra_gbps), inter=Link(alpha, inter_gbps, inter_flow),
                        call_overhead_s=call, exchange_fixed_s=sparse, select_s_per_elem=select,
                        flop_s=flop, backend="gloo")


def design(row: dict, density: float) -> np.ndarray:
    """(A, B, Bcpu, E, C, S, F) of ``row``'s exchange, summed over its DDP buckets (B: link-time-
    equivalent bytes under the row's per-flow cap, see the module docstring); sparse hooks at the
    row's own ``density`` (its file's, :func:`load_scaling`), else ``density``."""
    density = row.get("density", density)
    clusters = (_unit(row, alpha=1.0), _unit(row, inter_gbps=_UNIT_GBPS, flow_cap=True),
                _unit(row, inter_gbps=_UNIT_GBPS, intra_gbps=_UNIT_GBPS), _unit(row, select=1.0),
                _unit(row, call=1.0), _unit(row, sparse=1.0), _unit(row, flop=1.0))
    grid = tuple(row["grid"]) if row.get("grid") and reads(row["comm"], "grid") else None
    n = np.asarray(row["bucket_bytes"], dtype=float)
    matrices = tuple(tuple(m) for m in row["matrices"]) if row.get("matrices") else None
    if reads(row["comm"], "matrix_approximation_rank") and matrices:
        n = np.asarray([n.sum()])  # the model's matrices, as one message
    fn = SIMULATED.get(row["comm"])
    out = []
    for cluster in clusters:
        setup = CommSetup(gpus=row["world"], cluster=cluster, grid=grid, density=density,
                          value_bytes=4, index_bytes=WIRE_INDEX_BYTES,  # comm/sparse/__init__.py: int32 under 2**31 elements
                          matrices=matrices, **({"node_split": row["node_split"]} if row.get("node_split") else {}))
        out.append(float(np.sum(fn(n, setup).total)) if row["world"] > 1 else 0.0)
    return np.array(out)


Setting = tuple
"""(nodes, ranks per node, grad_accum, flow_bps, source file): what a row shares with its noop row."""


def setting(row: dict) -> Setting:
    """The key matching a row with the noop row measured beside it (:data:`Setting`); rows without
    ``grad_accum`` / ``flow_bps`` (made in memory) have one micro-batch and no per-flow cap."""
    return (row["nodes"], row["ranks_per_node"], row.get("grad_accum", 1), row.get("flow_bps"),
            row.get("source"))


def options_label(grad_accum: int, flow_bps: int | None) -> str:
    """``""`` (one micro-batch, no cap), ``"accum 4"``, ``"flow 25 Mbit/s"``, ``"accum 4, flow ..."``."""
    return ", ".join(([f"accum {grad_accum}"] if grad_accum != 1 else [])
                     + ([f"flow {flow_bps / 1e6:g} Mbit/s"] if flow_bps else []))


def setting_label(key: Setting) -> str:
    """``"4x2"``, ``"4x2 accum 4"``, ``"4x2 flow 25 Mbit/s"``: a setting as printed."""
    options = options_label(key[2], key[3])
    return f"{key[0]}x{key[1]}" + (f" {options}" if options else "")


def compute_by_setting(rows: list[dict]) -> dict[Setting, float]:
    """:func:`setting` -> the noop row's median step (the compute of that shape and setting)."""
    return {setting(r): median_step_s(r) for r in rows if r["comm"] == COMPUTE_ONLY}


def baseline_contradiction(steps_s: list[float], noop_steps_s: list[float]) -> dict | None:
    """The evidence that a row contradicts its noop baseline, or None (consistent, or within noise).

    A hook's step is the noop step at the same setting plus its exchange (>= 0 s: the noop hook
    runs the same forward, backward and optimizer and sends nothing), so step >= noop step and
    efficiency = noop / step <= 1, exposed communication = step - noop >= 0, up to noise. The
    noise is what the two timings show: their min..max over the timed steps.

    Derivation: the table's efficiency and exposed communication are medians' ratio and
    difference; over every pair of measured steps (one of the row, one of the noop) they span::

        exposed    in [min(row) - max(noop),  max(row) - min(noop)]
        efficiency in [min(noop) / max(row),  max(noop) / min(row)]

    The row contradicts its baseline when the whole interval is impossible::

        max(row) - min(noop) < 0   <=>   min(noop) / max(row) > 1   <=>   max(row) < min(noop)

    i.e. its slowest step beat the noop's fastest: every step with the exchange was faster than
    every step without it. Load (other jobs on these cores) only slows steps, so this happens when
    the noop was slowed more than the row, for its whole measurement; its efficiency and exposed
    communication are then those of the load, not of the hook. A row whose interval still holds
    1 (efficiency 100.5%, spreads overlapping) is noise and is kept as measured: its negative
    exposed communication is not clamped at 0, since the fit regresses step - compute and
    clamping the noise of cheap exchanges at 0 would bias their fitted costs upwards. One timed
    step has no spread: any row faster than its noop is then marked (``--iters >= 2`` measures
    the noise).

    Returns ``{"row_max_ms", "noop_min_ms", "margin_ms" (noop's fastest - row's slowest, > 0),
    "efficiency_at_least" (min(noop) / max(row), > 1), "why"}``.

    Example::

        >>> baseline_contradiction([0.10, 0.11], [0.20, 0.25])["efficiency_at_least"]  # 0.20 / 0.11
        1.8181818181818183
        >>> baseline_contradiction([0.10, 0.21], [0.20, 0.25]) is None  # overlapping spreads: noise
        True
    """
    row_max, noop_min = max(steps_s), min(noop_steps_s)
    if not row_max < noop_min:
        return None
    return {"row_max_ms": row_max * 1e3, "noop_min_ms": noop_min * 1e3, "margin_ms": (noop_min - row_max) * 1e3,
            "efficiency_at_least": noop_min / row_max,
            "why": f"slowest step {row_max * 1e3:.1f} ms < the noop's fastest {noop_min * 1e3:.1f} ms: "
                   "baseline slowed by load more than this row; rerun on a quiet machine"}


def contradicting(rows: list[dict]) -> list[dict]:
    """The rows (noop rows excluded) that contradict the noop row of their own :func:`setting`
    (:func:`baseline_contradiction`); rows whose setting has no noop row are not judged."""
    noop = {setting(r): r["step_s"] for r in rows if r["comm"] == COMPUTE_ONLY}
    return [r for r in rows if r["comm"] != COMPUTE_ONLY and setting(r) in noop
            and baseline_contradiction(r["step_s"], noop[setting(r)]) is not None]


def cpu_share(rows: list[dict]) -> dict[Setting, float]:
    """s(N): each setting's noop step per micro-batch over that of the smallest world's first noop
    row (CPU-sharing slowdown)."""
    compute = compute_by_setting(rows)
    if not compute:
        raise ValueError("the rows have no 'noop' row: the compute of each node count is the noop "
                         "step (run bench scaling with noop in --comm)")
    first = min(compute, key=lambda k: (k[0] * k[1], k[:2]))  # dicts keep the rows' order on ties
    base = compute[first] / first[2]
    return {key: t / key[2] / base for key, t in compute.items()}


def modelled(row: dict) -> bool:
    return row["comm"] in SIMULATED


@dataclass(frozen=True)
class ScalingFit:
    """Fitted parameters (seconds per unit, see :data:`PARAMS`) and where they came from."""

    params: dict[str, float]
    calibration: list[tuple[str, int, int]]
    """(comm, nodes, ranks per node) of every row used."""
    density: float
    compute: dict[Setting, float]
    share: dict[Setting, float]
    excluded: tuple[tuple[str, int, int], ...] = ()
    """(comm, nodes, ranks per node) of every modelled multi-rank row given to :func:`fit` that
    contradicts its noop row (:func:`contradicting`): kept out of the fit and of both error figures."""

    def exclusion_note(self) -> str:
        """``""``, or one line saying how many rows were kept out and which."""
        if not self.excluded:
            return ""
        rows = ", ".join(f"{c} {n}x{r}" for c, n, r in self.excluded)
        return (f"excluded {plural(len(self.excluded), 'row')} faster than their noop step beyond "
                f"the spread of both (baseline slowed by load): {rows}")

    def describe(self) -> str:
        """The calibrated parameters, one per line with its unit (printed by bench and simulate)."""
        p = self.params
        return "\n".join([
            f"  c_msg     {p['c_msg'] * 1e6:10.1f} us per message step (CPU, x s(N))",
            f"  link      {p['link_factor']:10.3f} x the time of the bytes at the nominal link rate",
            f"  c_byte    {p['c_byte'] * 1e9:10.3f} ns per byte moved (CPU, x s(N))",
            f"  c_elem    {p['c_elem'] * 1e9:10.3f} ns per element selected or merged (CPU, x s(N))",
            f"  c_call    {p['c_call'] * 1e6:10.1f} us per collective call (CPU, x s(N))",
            f"  c_sparse  {p['c_sparse'] * 1e6:10.1f} us per sparse exchange (CPU, x s(N))",
            f"  c_flop    {p['c_flop'] * 1e9:10.3f} ns per flop of PowerSGD's products (CPU, x s(N))",
            "  compute   " + ", ".join(f"{label}: {t * 1e3:.1f} ms (s={self.share[key]:.2f})"
                                       for label, key, t in self._compute_labels()),
        ])

    def _compute_labels(self) -> list[tuple[str, Setting, float]]:
        """(label, setting, compute) sorted; the file's name is added where a label repeats."""
        keys = sorted(self.compute, key=lambda k: (k[:3], k[3] or 0, k[4] or ""))
        labels = [setting_label(k) for k in keys]
        return [(label + (f" ({Path(k[4]).name})" if labels.count(label) > 1 and k[4] else ""),
                 k, self.compute[k]) for label, k in zip(labels, keys)]


def _scaled_row(row: dict, density: float, share: dict) -> np.ndarray:
    x = design(row, density)
    s = share[setting(row)]
    unit = {"link_factor": 8.0 / row["link_bps"]}  # bytes -> seconds at the nominal rate
    return np.array([v * (s if name in CPU_PARAMS else unit[name]) for name, v in zip(PARAMS, x)])


def fit(rows: list[dict], calibration_shapes: list[tuple[int, int]], density: float) -> ScalingFit:
    """Fit :data:`PARAMS` to the modelled, non-noop rows of ``calibration_shapes`` (N, L) (rows of
    every setting at those shapes whose noop row was measured)."""
    share, compute = cpu_share(rows), compute_by_setting(rows)
    # measurement errors: out of the fit and of predict's error figures (the rows either could use)
    bad = [r for r in contradicting(rows) if modelled(r) and r["world"] > 1]
    bad_ids = {id(r) for r in bad}
    cal = [r for r in rows if (r["nodes"], r["ranks_per_node"]) in calibration_shapes
           and r["comm"] != COMPUTE_ONLY and modelled(r) and r["world"] > 1 and setting(r) in compute
           and id(r) not in bad_ids]
    shapes = {k[:2] for k in compute}
    missing = [s for s in calibration_shapes if s not in shapes]
    if missing:
        raise ValueError(f"calibration shapes {missing} have no noop row (compute unknown); measured "
                         f"shapes: {sorted(shapes)}")
    if len(cal) < len(PARAMS):
        dropped = sum((r["nodes"], r["ranks_per_node"]) in calibration_shapes for r in bad)
        why = (f" ({dropped} more contradict their noop row: rerun on a quiet machine)" if dropped else "")
        raise ValueError(f"calibration needs >= {len(PARAMS)} measured rows of modelled hooks at "
                         f"{calibration_shapes}, got {len(cal)}{why}")
    x = np.array([_scaled_row(r, density, share) for r in cal])
    comm = np.array([median_step_s(r) - compute[setting(r)] for r in cal])
    # Relative error of the predicted step (not of the small, noisy communication part alone);
    # columns scaled to unit norm first (their units differ by ~1e9).
    t = np.array([median_step_s(r) for r in cal])
    scale = np.maximum(np.linalg.norm(x, axis=0), 1e-300)
    coef = _nnls_weighted(x / scale, comm, t) / scale
    return ScalingFit(dict(zip(PARAMS, map(float, coef))),
                      [(r["comm"], r["nodes"], r["ranks_per_node"]) for r in cal], density, compute, share,
                      tuple((r["comm"], r["nodes"], r["ranks_per_node"]) for r in bad))


def _nnls_weighted(x: np.ndarray, y: np.ndarray, w: np.ndarray) -> np.ndarray:
    """min || (x c - y) / w || with c >= 0 (drop the most negative coefficient and refit)."""
    active = list(range(x.shape[1]))
    a, b = x / w[:, None], y / w
    while True:
        c = np.zeros(x.shape[1])
        sol, *_ = np.linalg.lstsq(a[:, active], b, rcond=None)
        c[active] = sol
        if np.all(c >= 0) or len(active) == 1:
            return np.maximum(c, 0.0)
        active.remove(active[int(np.argmin(sol))])


def predict(f: ScalingFit, rows: list[dict]) -> list[dict]:
    """Predicted step of every row: role (calibration / validation / input / not modelled /
    contradicts noop: :func:`contradicting`, outside :func:`max_error`'s roles), error."""
    cal = set(f.calibration)
    bad = {id(r) for r in contradicting(rows)}
    coef = np.array([f.params[p] for p in PARAMS])
    out = []
    for r in rows:
        shape, key = (r["nodes"], r["ranks_per_node"]), setting(r)
        measured = median_step_s(r)
        base = {"comm": r["comm"], "nodes": r["nodes"], "ranks_per_node": r["ranks_per_node"],
                "world": r["world"], "grad_accum": key[2], "flow_bps": key[3], "measured_s": measured,
                "source": r.get("source")}
        if r["comm"] == COMPUTE_ONLY:
            out.append({**base, "role": "input (compute)", "predicted_s": measured, "error": 0.0})
            continue
        if r["world"] == 1:  # nothing is exchanged: predicted = compute, not a test of the model
            out.append({**base, "role": "one rank", "predicted_s": f.compute.get(key),
                        "error": None})
            continue
        if not modelled(r) or key not in f.compute:
            why = "not modelled" if not modelled(r) else "no noop row at this shape"
            out.append({**base, "role": why, "predicted_s": None, "error": None})
            continue
        pred = f.compute[key] + float(_scaled_row(r, f.density, f.share) @ coef)
        role = ("contradicts noop" if id(r) in bad else
                "calibration" if (r["comm"], *shape) in cal else "validation")
        out.append({**base, "role": role, "predicted_s": pred, "error": (pred - measured) / measured})
    return out


def max_error(predictions: list[dict], role: str) -> float:
    errs = [abs(p["error"]) for p in predictions if p["role"] == role and p["error"] is not None]
    return max(errs) if errs else math.nan


def default_calibration_shapes(rows: list[dict]) -> list[tuple[int, int]]:
    """The smallest and the largest multi-rank shape (the others validate)."""
    shapes = sorted({(r["nodes"], r["ranks_per_node"]) for r in rows if r["world"] > 1},
                    key=lambda s: (s[0] * s[1], s))
    if not shapes:
        raise ValueError("no rows with >= 2 ranks: nothing communicates, nothing to calibrate")
    return sorted({shapes[0], shapes[-1]})
