"""The ``local`` cluster: fit alpha, beta (and gamma) to a ``flashsgd bench allreduce --json`` file.

The bench file (schema shared with ``flashsgd.bench.allreduce``)::

    {"meta": {"world": 8, "grid": [2, 4], "ranks_per_node": 8, "backend": "gloo", ...},
     "results": [{"algorithm": "ring", "size_bytes": 1048576, "time_us": 1234.5, ...}, ...]}

On one link level every cost in :mod:`flashsgd.sim.costs` is linear in (alpha, beta, gamma):
``t = A alpha + B beta + G gamma``. The coefficients (A, B, G) of a measurement are obtained by
evaluating the algorithm's own cost function on unit clusters, so the fit uses exactly the formulas
the simulator predicts with.

Algorithm:

1. Load and check the file; keep results whose algorithm the simulator models (others, such as a
   no-op ceiling, are listed as skipped).
2. Build the (A, B, G) row of each measurement.
3. Least squares on relative error (each row divided by its measured time), coefficients >= 0
   (a negative one is dropped and the rest refitted). ``joint``: one (alpha, beta, gamma) for all
   algorithms (gamma folded into beta when the algorithms' B and G columns are proportional);
   ``per-algorithm``: (alpha, beta) per algorithm with gamma folded into beta (they are collinear
   when only the size varies).
4. Report the fit error; :func:`validate` fits on every other size and predicts the sizes left out.

Example::

    >>> fit = calibrate("/tmp/ar.json")          # doctest: +SKIP
    >>> fit.cluster.describe(), fit.rms_rel_error  # doctest: +SKIP
"""

from __future__ import annotations

import json
import math
from dataclasses import dataclass, field
from pathlib import Path
from typing import Literal

import numpy as np

from flashsgd.comm.topology import parse_grid
from flashsgd.exchanges import reads
from flashsgd.sim.algorithms import SIMULATED
from flashsgd.sim.costs import CommSetup
from flashsgd.sim.network import ClusterModel, Link

_TINY_BETA_GBPS = 1e300  # "infinite" bandwidth: beta ~ 1e-309 s/B, i.e. zero


@dataclass(frozen=True)
class Measurement:
    algorithm: str
    size_bytes: float
    time_s: float


@dataclass(frozen=True)
class BenchFile:
    world: int
    ranks_per_node: int
    grid: tuple[int, int] | None
    meta: dict
    measurements: list[Measurement]
    skipped: list[str] = field(default_factory=list)


def _meta_grid(value, world: int, path: Path) -> tuple[int, int] | None:
    """meta.grid as written by the bench: "XxY", [X, Y] or null (parsed by
    :func:`flashsgd.comm.topology.parse_grid`)."""
    if value in (None, "", []):
        return None
    try:
        return parse_grid(value if isinstance(value, str) else tuple(value), world)
    except (TypeError, ValueError) as exc:
        raise ValueError(f"calibration file {str(path)!r}: meta.grid must be 'XxY' or [X, Y] with "
                         f"X*Y = world {world}, got {value!r} ({exc})") from None


def load_json(path: str | Path, what: str, keys: tuple[str, ...], hint: str = "") -> dict:
    """A benchmark's JSON output as a dict with top-level ``keys``; ValueError naming the file."""
    path = Path(path)
    try:
        doc = json.loads(path.read_text())
    except FileNotFoundError:
        raise ValueError(f"{what} {str(path)!r} does not exist") from None
    except json.JSONDecodeError as exc:
        raise ValueError(f"{what} {str(path)!r} is not JSON: {exc}") from None
    if not isinstance(doc, dict) or any(k not in doc for k in keys):
        raise ValueError(f"{what} {str(path)!r}: need top-level keys {', '.join(map(repr, keys))}{hint}")
    return doc


def load_bench(path: str | Path, statistic: Literal["time_us", "time_us_min"] = "time_us") -> BenchFile:
    """Read a bench JSON file; ValueError naming the field that is missing or wrong.

    ``statistic``: the bench's median (``time_us``) or its fastest repetition (``time_us_min``), the
    less contention-sensitive choice on a shared machine.
    """
    if statistic not in ("time_us", "time_us_min"):
        raise ValueError(f"statistic must be 'time_us' or 'time_us_min', got {statistic!r}")
    doc = load_json(path, "calibration file", ("meta", "results"))
    meta = doc["meta"]
    world = meta.get("world")
    if not isinstance(world, int) or world < 2:
        raise ValueError(f"calibration file {str(path)!r}: meta.world must be an int >= 2, got {world!r}")
    ranks_per_node = meta.get("ranks_per_node", world)
    if not isinstance(ranks_per_node, int) or ranks_per_node < 1:
        raise ValueError(f"calibration file {str(path)!r}: meta.ranks_per_node must be an int >= 1")
    grid = _meta_grid(meta.get("grid"), world, path)
    rows, skipped = [], set()
    for i, r in enumerate(doc["results"]):
        try:
            algo, size, t_us = r["algorithm"], float(r["size_bytes"]), float(r[statistic])
        except (KeyError, TypeError, ValueError):
            raise ValueError(
                f"calibration file {str(path)!r}: results[{i}] needs 'algorithm', 'size_bytes', "
                f"{statistic!r}"
            ) from None
        if algo not in SIMULATED:
            skipped.add(algo)
            continue
        if not (size > 0 and t_us > 0 and math.isfinite(t_us)):
            raise ValueError(f"calibration file {str(path)!r}: results[{i}] has size or time <= 0")
        rows.append(Measurement(algo, size, t_us * 1e-6))
    if not rows:
        raise ValueError(f"calibration file {str(path)!r}: no results for modelled algorithms "
                         f"{SIMULATED.names()}")
    return BenchFile(world, ranks_per_node, grid, meta, rows, sorted(skipped))


def bench_backend(bench: BenchFile) -> str:
    """The collective library the bench ran ``native`` on (meta.backend; gloo when unstated)."""
    return "nccl" if bench.meta.get("backend") == "nccl" else "gloo"


def _unit_cluster(bench: BenchFile, alpha: float, bw_gbps: float, gamma: float) -> ClusterModel:
    link = Link(alpha_s=alpha, bandwidth_gbps=bw_gbps)
    return ClusterModel(name="unit", ranks_per_node=bench.ranks_per_node, intra=link, inter=link,
                        gamma_s_per_byte=gamma, call_overhead_s=0.0, backend=bench_backend(bench))


def design_row(algorithm: str, size_bytes: float, bench: BenchFile) -> np.ndarray:
    """(A, B, G): cost = A alpha + B beta + G gamma for this measurement on one link level."""
    out = []
    for alpha, bw, gamma in ((1.0, _TINY_BETA_GBPS, 0.0), (0.0, 1e-9, 0.0), (0.0, _TINY_BETA_GBPS, 1.0)):
        setup = CommSetup(gpus=bench.world, cluster=_unit_cluster(bench, alpha, bw, gamma),
                          grid=bench.grid if reads(algorithm, "grid") else None)
        out.append(float(SIMULATED.get(algorithm)(size_bytes, setup).total))
    return np.array(out)


def _nnls_rel(x: np.ndarray, t: np.ndarray) -> np.ndarray:
    """min ||(x c - t) / t|| with c >= 0 (drop the most negative coefficient and refit)."""
    active = list(range(x.shape[1]))
    w = x / t[:, None]
    while True:
        c = np.zeros(x.shape[1])
        sol, *_ = np.linalg.lstsq(w[:, active], np.ones_like(t), rcond=None)
        c[active] = sol
        if np.all(c >= 0) or len(active) == 1:
            return np.maximum(c, 0.0)
        active.remove(active[int(np.argmin(sol))])


@dataclass(frozen=True)
class Fit:
    """Fitted parameters and how well they reproduce the measurements."""

    mode: str
    params: dict[str, tuple[float, float, float]]
    """algorithm (or '*' for joint) -> (alpha_s, beta_s_per_byte, gamma_s_per_byte)."""
    rms_rel_error: float
    max_rel_error: float
    cluster: ClusterModel


def fit(bench: BenchFile, mode: Literal["joint", "per-algorithm"] = "joint",
        measurements: list[Measurement] | None = None) -> Fit:
    """Least-squares fit of ``measurements`` (default: all in ``bench``)."""
    if mode not in ("joint", "per-algorithm"):
        raise ValueError(f"mode must be 'joint' or 'per-algorithm', got {mode!r}")
    ms = bench.measurements if measurements is None else measurements
    x = np.array([design_row(m.algorithm, m.size_bytes, bench) for m in ms])
    t = np.array([m.time_s for m in ms])
    params: dict[str, tuple[float, float, float]] = {}
    if mode == "joint":
        # Ring-family algorithms on one level have B and G in a fixed ratio ((P-1)/P n : 2(P-1)/P n):
        # then gamma is not identifiable and is folded into beta.
        xn = x / np.maximum(np.linalg.norm(x, axis=0), 1e-300)
        if np.linalg.matrix_rank(xn, tol=1e-6) < 3:
            a, b = _nnls_rel(x[:, :2], t)
            params["*"] = (a, b, 0.0)
        else:
            params["*"] = tuple(_nnls_rel(x, t))
    else:
        for algo in sorted({m.algorithm for m in ms}):
            idx = np.array([m.algorithm == algo for m in ms])
            a, b = _nnls_rel(x[idx][:, :2], t[idx])
            params[algo] = (a, b, 0.0)
    pred = predict(params, ms, bench, x)
    rel = np.abs(pred - t) / t
    alpha, beta, gamma = params.get("*") or params.get("ring") or next(iter(params.values()))
    cluster = local_cluster(bench, alpha, beta, gamma)
    return Fit(mode, params, float(np.sqrt(np.mean(rel ** 2))), float(rel.max()), cluster)


def local_cluster(bench: BenchFile, alpha: float, beta: float, gamma: float) -> ClusterModel:
    """The ``local`` cluster from fitted parameters (one link level for intra and inter)."""
    link = Link(alpha_s=alpha, bandwidth_gbps=1.0 / max(beta, 1e-300) / 1e9)
    return ClusterModel(name="local", ranks_per_node=bench.ranks_per_node, intra=link, inter=link,
                   gamma_s_per_byte=gamma, backend=bench_backend(bench),
                   source=f"fitted to {bench.meta.get('backend', '?')} bench on "
                          f"{bench.meta.get('host', '?')}, world {bench.world}")


def predict(params: dict, ms: list[Measurement], bench: BenchFile, x: np.ndarray | None = None) -> np.ndarray:
    """Predicted seconds for each measurement under fitted ``params``."""
    x = np.array([design_row(m.algorithm, m.size_bytes, bench) for m in ms]) if x is None else x
    coef = np.array([params.get(m.algorithm, params.get("*")) for m in ms])
    return np.sum(x * coef, axis=1)


def calibrate(path: str | Path, mode: Literal["joint", "per-algorithm"] = "joint") -> Fit:
    """Fit ``mode`` to every measurement in the bench file at ``path``."""
    return fit(load_bench(path), mode)


@dataclass(frozen=True)
class Validation:
    """Predictions for the sizes left out of the fit."""

    mode: str
    rows: list[dict]
    """algorithm, size_bytes, measured_us, predicted_us, rel_error."""
    fit_sizes: list[float]

    def max_error(self, min_bytes: float = 0.0) -> float:
        errs = [abs(r["rel_error"]) for r in self.rows if r["size_bytes"] >= min_bytes]
        return float(max(errs)) if errs else float("nan")  # a Python float: fmt.percent compares it


def validate(bench: BenchFile, mode: Literal["joint", "per-algorithm"] = "joint") -> Validation:
    """Fit on every other distinct size (smallest first) and predict the others."""
    sizes = sorted({m.size_bytes for m in bench.measurements})
    if len(sizes) < 4:
        raise ValueError(f"validation needs >= 4 distinct sizes in the bench file, got {len(sizes)}")
    fit_sizes = set(sizes[0::2]) | {sizes[-1]}  # keep the largest in the fit: predict inside the range
    train = [m for m in bench.measurements if m.size_bytes in fit_sizes]
    test = [m for m in bench.measurements if m.size_bytes not in fit_sizes]
    f = fit(bench, mode, train)
    pred = predict(f.params, test, bench)
    rows = [dict(algorithm=m.algorithm, size_bytes=m.size_bytes, measured_us=m.time_s * 1e6,
                 predicted_us=p * 1e6, rel_error=(p - m.time_s) / m.time_s) for m, p in zip(test, pred)]
    return Validation(mode, rows, sorted(fit_sizes))
