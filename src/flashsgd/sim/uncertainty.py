"""A plan over the assumptions' ranges: each candidate's step and efficiency as (low, high), and
whether the choice changes inside them.

The inputs a cluster marks as assumed (:attr:`flashsgd.sim.network.ClusterModel.assumed`, one
(low, high) per input; the compute rate when it is the preset's figure or ``--images-per-s-range``)
are varied; measured inputs (``train --comm auto``, ``--calibration``, a cluster file's own values)
are not. Every input moves a step one way only (a faster link, a smaller fixed cost, a faster GPU
never make a step longer), so:

* a step's range is its step with every assumed input at its fast end and at its slow end;
* efficiency (T1 / step) is highest with the GPU slow and all else fast, lowest the other way round;
  its range is taken over those two corners and the two above;
* the choice is also made with each input alone at its low and at its high end (2 per input; one
  for a per-flow limit that is none at the stated values: its fast end is no limit either), the
  way to tell *which* assumption decides it.

That is up to 4 + 2k plans for k assumed inputs (a plan of 152 candidates on 4096 GPUs takes
0.02-0.1 s). ``flashsgd simulate`` needs ranges only, not the choice: :func:`runs_over_ranges`
evaluates its runs at the first four corners (:func:`range_corners`: the step, communication and
throughput at all fast / all slow, efficiency at the two mixed ones) and at up to three more
(:func:`field_corners`) for the two numbers that do not move with the step: the exposed exchange
is shortened by whatever lengthens backward (a slower GPU, jitter, compute slowed under overlap:
:data:`HIDING`), so its extremes have the exchange and backward at opposite ends; the input wait
(the host's bound minus the rest of the step) is longest with the host slow and all else fast.

Example::

    >>> from flashsgd.sim.network import CLUSTERS
    >>> from flashsgd.sim.workload import resnet50
    >>> r = plan_over_ranges(resnet50(), CLUSTERS.get("1gbe"), gpus=32, batch_per_gpu=32,
    ...                      images_per_s=200.0, compute_range=(164.0, 236.0), steps=50_000)
    >>> lo, hi = r.step_range(r.plan.choice)
    >>> lo < r.plan.choice.step_s < hi
    True
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable, Generic, Sequence, TypeVar

from flashsgd.sim.network import INPUTS, ClusterModel, input_value, with_input
from flashsgd.sim.planner import CommPlan, Prediction, make_plan
from flashsgd.sim.workload import Workload

COMPUTE = "compute"
"""The key of the compute rate (one GPU's images/s) among :class:`Assumption` keys."""

MEASURE_HINT = ("to decide, measure: `flashsgd train --comm auto` on the cluster measures compute, links and "
                "the sparse fixed costs and records them in <out>/cluster.toml (give it to `plan --cluster`); "
                "`sudo flashsgd bench emulate` runs the exchanges on an emulated cluster of those links")


@dataclass(frozen=True)
class Assumption:
    """One assumed input: its value and plausible range."""

    key: str
    """A :data:`flashsgd.sim.network.INPUTS` key, or :data:`COMPUTE`."""
    value: float | None
    """The stated value; None: no limit (a per-flow limit, :data:`flashsgd.sim.network.UNLIMITED`)."""
    low: float
    high: float
    what: str
    unit: str
    scale: float
    """Factor from the key's SI unit to ``unit``."""
    fast_high: bool
    """True when a higher value makes a step faster."""

    def end(self, fast: bool) -> float:
        """The value at the fast or the slow end of the range."""
        return self.high if fast == self.fast_high else self.low

    def fmt(self, v: float) -> str:
        """3 significant digits, whole numbers from 1000 up (``1000``, not ``1e+03``)."""
        x = v * self.scale
        return f"{x:.0f}" if abs(x) >= 1000 else f"{x:.3g}"

    def describe(self) -> str:
        """``sparse exchange fixed cost 0.5 ms (0.1-9.1)``; ``inter-node per-flow bandwidth no limit
        (2.5-6.2 GB/s)``."""
        if self.value is None:
            return f"{self.what} no limit ({self.fmt(self.low)}-{self.fmt(self.high)} {self.unit})"
        return f"{self.what} {self.fmt(self.value)} {self.unit} ({self.fmt(self.low)}-{self.fmt(self.high)})"

    def to_dict(self) -> dict:
        return {"input": self.key, "value": self.value, "low": self.low, "high": self.high}


def assumptions(cluster: ClusterModel, images_per_s: float, compute_range: tuple[float, float] | None,
                precision: str, unit: str = "images") -> list[Assumption]:
    """The assumed inputs of a plan: the cluster's (its ResNet-50 rates replaced by the compute
    rate in use, ranged by ``compute_range``); a range that leaves out the value is widened to it."""
    out = []
    for key, (lo, hi) in cluster.assumed.items():
        if key.startswith("resnet50_images_per_s."):
            continue  # the compute rate is the plan's images_per_s, ranged by compute_range
        what, shown, scale, fast_high = INPUTS[key]
        v = input_value(cluster, key)
        if v is not None:
            lo, hi = min(lo, v), max(hi, v)
        out.append(Assumption(key, v, lo, hi, what, shown, scale, fast_high))
    if compute_range is not None:
        lo, hi = compute_range
        if not (0 < lo <= images_per_s <= hi):
            raise ValueError(f"compute range must be 0 < low <= the rate ({images_per_s:g}) <= high {unit}/s, "
                             f"got {compute_range!r}")
        out.append(Assumption(COMPUTE, images_per_s, lo, hi,
                              f"compute ({precision})", f"{unit}/s", 1.0, True))
    return out


def preset_compute_range(cluster: ClusterModel, precision: str) -> tuple[float, float] | None:
    """The range of the cluster's own ResNet-50 rate at ``precision``, if it is an assumption."""
    return cluster.assumed.get(f"resnet50_images_per_s.{precision}")


@dataclass(frozen=True)
class Corner:
    """A setting of the assumed inputs: ``fast`` maps a key to its fast (True) or slow (False) end."""

    name: str
    fast: dict[str, bool]


def range_corners(inputs: list[Assumption]) -> list[Corner]:
    """All fast, all slow and the two efficiency corners (compute at one end, all else at the other):
    every reported number's extremes (module docstring); none without inputs."""
    if not inputs:
        return []
    net = [a.key for a in inputs if a.key != COMPUTE]
    out = [Corner("all fast", {a.key: True for a in inputs}),
           Corner("all slow", {a.key: False for a in inputs})]
    if net and len(net) < len(inputs):
        out += [Corner("compute slow, all else fast", {**{k: True for k in net}, COMPUTE: False}),
                Corner("compute fast, all else slow", {**{k: False for k in net}, COMPUTE: True})]
    return out


HIDING = ("jitter_cv", "overlap_slowdown")
"""Inputs whose slow end stretches backward (the slowest rank's compute; compute slowed beside an
exchange): a longer step, but more of the exchange hidden behind backward, as a slower GPU does."""
INPUT_WAIT = "input_s_per_image"
"""The host's time per image: its wait is longest with the host slow and everything else fast."""


def field_corners(inputs: list[Assumption]) -> list[Corner]:
    """:func:`range_corners`, then the corners of the two numbers that do not move with the step:
    the exposed exchange, longest with the exchange slow and backward short (compute fast, the
    :data:`HIDING` inputs at their fast ends) and shortest the other way round; and the input
    wait, longest with the host slow and all else fast (its shortest, 0, is at all fast)."""
    out = range_corners(inputs)
    keys = [a.key for a in inputs]
    short = set(HIDING) | {COMPUTE}
    if any(k in HIDING for k in keys):
        out += [Corner("exchange slow, backward short", {k: k in short for k in keys}),
                Corner("exchange fast, backward long", {k: k not in short for k in keys})]
    if INPUT_WAIT in keys and len(keys) > 1:
        out.append(Corner("host slow, all else fast", {k: k != INPUT_WAIT for k in keys}))
    return out


def corners(inputs: list[Assumption]) -> list[Corner]:
    """:func:`range_corners`, then each input alone at each end (a limit that is none at the stated
    values only at its slow end: at its fast end it is no limit either)."""
    out = range_corners(inputs)
    for a in inputs:
        for fast in (True, False) if a.value is not None else (False,):
            end = "high" if fast == a.fast_high else "low"
            out.append(Corner(f"{a.what} {end} ({a.fmt(a.end(fast))} {a.unit})", {a.key: fast}))
    return out


def at_corner(cluster: ClusterModel, images_per_s: float, inputs: list[Assumption],
              corner: Corner) -> tuple[ClusterModel, float]:
    """The cluster and the compute rate with the inputs ``corner`` names at its ends."""
    c, ips = cluster, images_per_s
    for a in inputs:
        if a.key in corner.fast:
            v = a.end(corner.fast[a.key])
            if a.key == COMPUTE:
                ips = v
            else:
                c = with_input(c, a.key, v)
    return c, ips


def assumed_lines(inputs: list[Assumption]) -> list[str]:
    """The ``assumed:`` line of ``plan`` and ``simulate``: each assumed input with its range, or
    that there is none (every number is then a single value)."""
    if not inputs:
        return ["assumed: nothing (every input measured or given): each number is a single value, "
                "without a range"]
    return ["assumed: " + "; ".join(a.describe() for a in inputs)
            + " (ranges: docs/planner.md); every other input measured or from the cluster's source"]


T = TypeVar("T")


@dataclass(frozen=True)
class RangedPlan:
    """The plan at the stated values and at every :func:`corners` setting."""

    plan: CommPlan
    inputs: list[Assumption]
    at: list[tuple[Corner, CommPlan]]

    def _all(self, p: Prediction) -> list[Prediction]:
        label = p.candidate.label()
        found = [p]
        for _, plan in self.at:
            found += [q for q in plan.ranked if q.candidate.label() == label]
        return found

    def step_range(self, p: Prediction) -> tuple[float, float]:
        """(shortest, longest) step of ``p``'s candidate over the corners, seconds."""
        steps = [q.step_s for q in self._all(p)]
        return min(steps), max(steps)

    def efficiency_range(self, p: Prediction) -> tuple[float, float]:
        effs = [q.result.efficiency for q in self._all(p)]
        return min(effs), max(effs)

    def speedup_range(self) -> tuple[float, float] | None:
        """(lowest, highest) of the chosen compressed exchange's speed-up over the best dense
        candidate, each setting of the assumptions with its own best dense; None for a dense choice."""
        if not self.plan.choice.candidate.compresses:
            return None
        label = self.plan.choice.candidate.label()
        ratios = []
        for plan in [self.plan, *(p for _, p in self.at)]:
            dense = plan.best_dense()
            mine = next((q for q in plan.ranked if q.candidate.label() == label), None)
            if dense is not None and mine is not None:
                ratios.append(dense.step_s / mine.step_s)
        return (min(ratios), max(ratios)) if ratios else None

    def choice_changes(self) -> dict[str, list[str]]:
        """Other choices (algorithm and setting) -> the corners where each is chosen instead."""
        nominal = self.plan.choice.candidate.setting()
        out: dict[str, list[str]] = {}
        for corner, plan in self.at:
            other = plan.choice.candidate.setting()
            if other != nominal:
                out.setdefault(other, []).append(corner.name)
        return out

    def summary(self) -> list[str]:
        """What was assumed, and whether (and where) the choice changes within it."""
        lines = assumed_lines(self.inputs)
        if not self.inputs:
            return lines
        changes = self.choice_changes()
        if not changes:
            lines.append(f"the choice ({self.plan.choice.candidate.setting()}) holds over every assumed range")
        else:
            lines.append(f"the choice changes within the assumptions: {self.plan.choice.candidate.setting()} "
                         "at the stated values, but")
            lines += [f"  {setting} at: {' | '.join(where)}" for setting, where in changes.items()]
            lines.append(MEASURE_HINT)
        return lines

    def to_dict(self) -> dict:
        return {"assumed": [a.to_dict() for a in self.inputs], "choice_changes": self.choice_changes()}

    def prediction_dict(self, p: Prediction) -> dict:
        return {**p.to_dict(), "step_s_range": list(self.step_range(p)),
                "efficiency_range": list(self.efficiency_range(p))}


def plan_over_ranges(workload: Workload, cluster: ClusterModel, gpus: int, batch_per_gpu: int,
                     images_per_s: float, compute_range: tuple[float, float] | None = None,
                     precision: str = "fp32", make: Callable[..., CommPlan] = make_plan,
                     **plan_kw) -> RangedPlan:
    """:func:`flashsgd.sim.planner.make_plan` at the stated values and at every corner of the
    assumed inputs (module docstring); ``plan_kw`` goes to every plan."""
    inputs = assumptions(cluster, images_per_s, compute_range, precision, workload.unit)
    nominal = make(workload, cluster, gpus, batch_per_gpu, images_per_s, precision=precision, **plan_kw)
    at = []
    for corner in corners(inputs):
        c, ips = at_corner(cluster, images_per_s, inputs, corner)
        at.append((corner, make(workload, c, gpus, batch_per_gpu, ips, precision=precision, **plan_kw)))
    return RangedPlan(nominal, inputs, at)


@dataclass(frozen=True)
class RangedRuns(Generic[T]):
    """Runs (anything with numeric fields, e.g. :class:`flashsgd.sim.engine.SimResult`) at the stated
    values and at every :func:`field_corners` setting, in the same order at each."""

    runs: list[T]
    inputs: list[Assumption]
    at: list[tuple[Corner, list[T]]]

    def range(self, i: int, field: str) -> tuple[float, float]:
        """(lowest, highest) of ``field`` of run ``i`` over the stated values and the corners."""
        values = [getattr(self.runs[i], field)] + [getattr(runs[i], field) for _, runs in self.at]
        return min(values), max(values)

    def ranges(self, i: int, fields: Sequence[str]) -> dict[str, list[float]]:
        return {f: list(self.range(i, f)) for f in fields}


def runs_over_ranges(run: Callable[[ClusterModel, float], list[T]], cluster: ClusterModel,
                     images_per_s: float, compute_range: tuple[float, float] | None = None,
                     precision: str = "fp32", unit: str = "images") -> RangedRuns[T]:
    """``run(cluster, images_per_s)`` at the stated values and at every :func:`field_corners`
    setting of the assumed inputs (:func:`assumptions`; ``unit``: the workload's, for the compute
    rate's line): the ranges of what it returns."""
    inputs = assumptions(cluster, images_per_s, compute_range, precision, unit)
    at = [(corner, run(*at_corner(cluster, images_per_s, inputs, corner))) for corner in field_corners(inputs)]
    return RangedRuns(run(cluster, images_per_s), inputs, at)
