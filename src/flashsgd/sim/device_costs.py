"""What compression costs on each class of device: the compressing hooks' compute per gradient element.

One table (:data:`DEVICES`, a registry of :class:`DeviceClass`) of the costs the simulator charges a
compressing exchange on top of its wire time, per device class: the top-k selection per element for
each selection method (:data:`flashsgd.exchanges.SELECTIONS`: ``exact``, ``sampled``, ``threshold``),
the fixed cost of one sparse exchange of a bucket (:attr:`~flashsgd.sim.network.ClusterModel.exchange_fixed_s`),
PowerSGD's compression per element of the matrices it compresses and per flop of their products,
and the memory bandwidth the reduction speed (gamma) comes from. Every value is a :class:`Ranged`:
a stated value, a plausible (low, high) and its source; the ranges feed the planner's uncertainty
(:attr:`~flashsgd.sim.network.ClusterModel.assumed`, :mod:`flashsgd.sim.uncertainty`).

Which selection a hook runs follows the device: ``selection="auto"`` resolves by the bucket's device
type (:data:`flashsgd.exchanges.SELECTION_BY_DEVICE`: ``exact`` on CUDA, ``sampled`` on the CPU), so
a cluster's costs are :meth:`DeviceClass.costs` of its device class at the selection the hooks
resolve (:func:`on_device` puts them on a cluster). A preset names its class
(:attr:`~flashsgd.sim.network.ClusterModel.device`).

Sources (measured by this project; every derivation is written next to its arithmetic below):

* ``h100`` (NVIDIA H100 SXM / H200, one GH100 chip): the selections from docs/gpu.md, "Selection"
  (one H100 80GB HBM3, 25,557,032 fp32 elements, median of 20 calls, two sessions); the whole hook
  from the H200 table of docs/gpu.md, "The hooks' cost in a user's loop" (ResNet-50 bf16,
  channels_last, batch 256, DDP at world 1, where the exchange moves nothing: the hook's own cost
  per step is ``step x (1 / ratio - 1)``), with the plain DDP step from docs/gpu.md's training table
  (H100, bf16: 3,705 images/s of the plain loop = 69.1 ms for 256 images).
* ``a100``, ``v100``, ``p100``, ``gtx1080ti``: derived from ``h100`` by memory bandwidth (not
  measured): the selections and passes are memory-bound kernels, so their time per element is
  taken as H100's x (3,350 GB/s / the class's bandwidth), and ranged from that figure to twice it
  [judgement: older GPUs have fewer SMs and smaller caches, torch.topk's radix select is not purely
  bandwidth-bound] or to H100's measured in-loop worst where that is larger; the fixed cost per bucket and PowerSGD's per-element cost were measured as
  launch- and Python-bound on the H200 (the selection explains under half of the hook's cost), so
  they keep H100's stated value, ranged up to the bandwidth-scaled one.
* ``cpu`` (the project's 2-core VM, torch 2.13 CPU build, one intra-op thread per rank as
  ``flashsgd.launch`` gives W >= 2 ranks): the selections from docs/data/sparse_selection_fast.json,
  sparse_selection_pass2.json and sparse_selection_quiet.json (docs/benchmarks.md, "Selection"); the
  fixed cost per exchange from ``train --comm auto`` (docs/planner.md: 5.42 ms and 9.1 ms, 4 Gloo
  ranks on the VM).

Example::

    >>> h100, cpu = DEVICES.get("h100"), DEVICES.get("cpu")
    >>> h100.selection(), cpu.selection()          # what selection="auto" runs on each
    ('exact', 'sampled')
    >>> round(h100.select("exact").value * 1e12, 1), round(cpu.select("exact").value * 1e9, 2)  # ps / ns per element
    (32.5, 10.13)
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from flashsgd.exchanges import SELECTION_BY_DEVICE, SELECTIONS, resolved_selection
from flashsgd.registry import Registry

GB = 1e9

RESNET50_ELEMS = 25_557_032
"""Gradient elements of ResNet-50 (torchvision's, :func:`flashsgd.sim.workload.resnet50`): the size
every selection of docs/gpu.md and docs/benchmarks.md was timed on."""
RESNET50_COMPRESSED_ELEMS = 25_502_912
"""Elements of the ResNet-50 matrices PowerSGD compresses at rank 1 (the n m sum of
:func:`flashsgd.sim.costs_lowrank.split`, min_compression_rate 2; the other 54,120 travel uncompressed)."""
RESNET50_BUCKETS = (4, 5)
"""DDP buckets of ResNet-50's fp32 gradients (97.5 MiB) at its default 25 MiB cap: 4 as the simulator
fuses them (:func:`flashsgd.sim.engine.bucket_bounds`), 5 with DDP's 1 MiB first bucket; 5 stated."""

H100_MEMORY_GBPS = 3350.0
"""H100 SXM5 80GB HBM3: 3.35 TB/s (NVIDIA H100 Tensor Core GPU datasheet)."""


@dataclass(frozen=True)
class Ranged:
    """A cost with its plausible range and where it comes from (SI units: seconds per element, per
    flop or per bucket)."""

    value: float
    low: float
    high: float
    source: str

    def __post_init__(self) -> None:
        for name in ("value", "low", "high"):
            v = getattr(self, name)
            if not (isinstance(v, (int, float)) and math.isfinite(v) and v >= 0):
                raise ValueError(f"Ranged.{name} must be a finite number >= 0, got {v!r} ({self.source})")
        if not self.low <= self.value <= self.high:
            raise ValueError(f"Ranged: low <= value <= high, got {self.low!r} <= {self.value!r} <= {self.high!r} "
                             f"({self.source})")

    @property
    def bounds(self) -> tuple[float, float]:
        return (self.low, self.high)

    def scaled(self, factor: float, source: str) -> "Ranged":
        """A memory-bound cost on a device ``factor`` times slower (a derived class): value and low x
        factor; high the larger of 2 x factor x value [judgement] and this high (a measured worst
        case, e.g. a host-synchronizing hook, holds on a slower device too)."""
        return Ranged(self.value * factor, self.low * factor, max(2 * factor * self.value, self.high), source)


@dataclass(frozen=True)
class DeviceClass:
    """The compression costs of one class of device (one row of :data:`DEVICES`)."""

    name: str
    description: str
    device_type: str
    """torch's device type of its buckets (``cuda``, ``cpu``): what ``selection="auto"`` resolves by."""
    memory_gbps: float
    """Memory bandwidth, GB/s: the reduction's speed (gamma, 3 bytes of traffic per byte summed)."""
    select_s_per_elem: dict[str, Ranged]
    """Top-k selection per gradient element, by selection method (``exact``, ``sampled``, ``threshold``)."""
    exchange_fixed_s: Ranged
    """Fixed cost of one sparse exchange of a bucket beyond its selection and its residual pass:
    launches, bookkeeping, host work (seconds per bucket)."""
    lowrank_s_per_elem: Ranged
    """PowerSGD's compression per element of the matrices it compresses, beyond its flops and its
    error-feedback pass (launches and small kernels of a per-tensor hook; seconds per element)."""
    flop_s: Ranged
    """Seconds per flop of PowerSGD's matrix products."""
    source: str = ""
    """Where the row comes from (measured, or derived and how)."""

    def __post_init__(self) -> None:
        if self.device_type not in SELECTION_BY_DEVICE:
            raise ValueError(f"DeviceClass {self.name!r}: device_type must be one of "
                             f"{', '.join(SELECTION_BY_DEVICE)}, got {self.device_type!r}")
        missing = [s for s in SELECTIONS if s != "auto" and s not in self.select_s_per_elem]
        if missing:
            raise ValueError(f"DeviceClass {self.name!r}: no selection cost for {', '.join(missing)}")
        if not (math.isfinite(self.memory_gbps) and self.memory_gbps > 0):
            raise ValueError(f"DeviceClass {self.name!r}: memory_gbps must be > 0, got {self.memory_gbps!r}")

    @property
    def gamma_s_per_byte(self) -> float:
        """Seconds to sum one byte: a + b -> a reads 2 bytes and writes 1 per byte of message."""
        return 3.0 / (self.memory_gbps * GB)

    def selection(self, selection: str = "auto") -> str:
        """The selection a sparse hook runs on this device: ``selection``, with ``auto`` resolved by
        the device type (:func:`flashsgd.exchanges.resolved_selection`)."""
        if selection not in SELECTIONS:
            raise ValueError(f"selection must be one of {', '.join(SELECTIONS)}, got {selection!r}")
        return resolved_selection(selection, self.device_type)

    def select(self, selection: str = "auto") -> Ranged:
        """The selection cost per element of ``selection`` (``auto``: the device's)."""
        return self.select_s_per_elem[self.selection(selection)]

    def costs(self, selection: str = "auto") -> dict[str, float]:
        """The :class:`~flashsgd.sim.network.ClusterModel` fields this class sets, stated values."""
        return {"select_s_per_elem": self.select(selection).value, "exchange_fixed_s": self.exchange_fixed_s.value,
                "lowrank_s_per_elem": self.lowrank_s_per_elem.value, "flop_s": self.flop_s.value}

    def ranges(self, selection: str = "auto") -> dict[str, tuple[float, float]]:
        """The same fields' plausible (low, high): :attr:`~flashsgd.sim.network.ClusterModel.assumed` entries."""
        return {"select_s_per_elem": self.select(selection).bounds, "exchange_fixed_s": self.exchange_fixed_s.bounds,
                "lowrank_s_per_elem": self.lowrank_s_per_elem.bounds, "flop_s": self.flop_s.bounds}

    def describe(self, selection: str = "auto") -> str:
        """``h100 (NVIDIA H100 SXM / H200 ...): exact selection 0.0325 ns/elem (0.0317-0.0664), ...``."""
        sel, name = self.select(selection), self.selection(selection)
        return (f"{self.name} ({self.description}): {name} selection {sel.value * 1e9:.3g} ns/elem "
                f"({sel.low * 1e9:.3g}-{sel.high * 1e9:.3g}), sparse exchange fixed "
                f"{self.exchange_fixed_s.value * 1e3:.3g} ms/bucket, PowerSGD "
                f"{self.lowrank_s_per_elem.value * 1e9:.3g} ns/elem + {1 / self.flop_s.value / 1e12:.3g} TFLOPS")


DEVICES: Registry[DeviceClass] = Registry("device class")


def _per_elem(ms: float, elems: int = RESNET50_ELEMS) -> float:
    """Seconds per element of ``ms`` milliseconds over ``elems`` elements."""
    return ms * 1e-3 / elems


def _hook_ms(step_ms: float, ratio: float) -> float:
    """The hook's own cost per step at world 1: a step ``ratio`` times as fast as plain DDP's
    ``step_ms`` lasts step / ratio, so the hook adds step x (1 / ratio - 1)."""
    return step_ms * (1.0 / ratio - 1.0)


# ---------------------------------------------------------------- h100: measured (H100, H200) ----
# The plain DDP step the H200 ratios are relative to: 69.1 ms stated (256 / 3,705 images/s, the plain
# bf16 loop on the H100, docs/gpu.md session 1; session 2: 256 / 3,699 = 69.2 ms); low 60 ms
# [judgement: the H200 is the same GH100 with 1.43x the memory bandwidth, 4.8 / 3.35 TB/s, so its
# ResNet-50 step may be up to ~13% shorter]; high 72.8 ms (flashsgd train's bf16 step at batch 256 on
# the H100, docs/gpu.md).
_STEP_MS = (60.0, 256 / 3705 * 1e3, 72.8)  # (low, stated = 69.10, high)
# A ratio's noise: +-0.005 [judgement: the dense hooks came out at 0.996, ~0.4% from 1, rounded up].
_RATIO_NOISE = 0.005
# The H200 ratios to plain DDP (docs/gpu.md, "The hooks' cost in a user's loop", density 0.001).
_H200_RATIO = {"gtopk exact": 0.970, "topk exact": 0.969, "gtopk sampled": 0.792, "gtopk threshold": 0.717,
               "powersgd": 0.762}

# Exact selection (topk_exact: torch.topk + index sort + gather) on the H100, ms per 25,557,032 elements
# (docs/gpu.md "Selection": sessions 1 and 2, densities 0.001 and 0.01): 0.828, 0.848, 0.810, 0.835.
# Stated: their mean 0.83025 ms / 25,557,032 = 32.49 ps/elem; low 0.810 -> 31.69 ps; high 0.848 -> 33.18 ps.
_H100_EXACT_MS = (0.828, 0.848, 0.810, 0.835)
_EXACT = Ranged(_per_elem(sum(_H100_EXACT_MS) / 4), _per_elem(min(_H100_EXACT_MS)), _per_elem(max(_H100_EXACT_MS)),
                "H100, docs/gpu.md Selection: exact 0.810-0.848 ms per 25,557,032 elements")
# Sampled: 1.048, 1.115 (session 1), 0.740, 0.752 ms (session 2): mean 0.91375 ms -> 35.75 ps; low 0.740 ->
# 28.95 ps. High: the whole hook in the H200 loop with the sampled selection (then with 20 host syncs
# per step, each one stalling the GPU): 69.10 x (1 / 0.792 - 1) = 18.15 ms / 25,557,032 = 0.710 ns/elem
# [judgement: the worst a sampled hook costs on a GPU; the hooks now run without those syncs, unmeasured].
_H100_SAMPLED_MS = (1.048, 1.115, 0.740, 0.752)
_SAMPLED = Ranged(_per_elem(sum(_H100_SAMPLED_MS) / 4), _per_elem(min(_H100_SAMPLED_MS)),
                  _per_elem(_hook_ms(_STEP_MS[1], _H200_RATIO["gtopk sampled"])),
                  "H100, docs/gpu.md Selection: sampled 0.740-1.115 ms; high: the H200 loop's gtopk sampled 0.792x")
# Threshold: 3.191 (s1), 2.719 (s2) ms at 0.001; 7.452, 6.945 ms at 0.01. Stated: the mean at the default
# density 0.001, 2.955 ms -> 115.6 ps; low 2.719 -> 106.4 ps; high: the H200 loop's gtopk threshold
# (70 host syncs): 69.10 x (1 / 0.717 - 1) = 27.27 ms -> 1.067 ns/elem.
_H100_THRESHOLD_MS = (3.191, 2.719)
_THRESHOLD = Ranged(_per_elem(sum(_H100_THRESHOLD_MS) / 2), _per_elem(min(_H100_THRESHOLD_MS)),
                    _per_elem(_hook_ms(_STEP_MS[1], _H200_RATIO["gtopk threshold"])),
                    "H100, docs/gpu.md Selection: threshold 2.719-3.191 ms at density 0.001 (6.9-7.5 at 0.01); "
                    "high: the H200 loop's gtopk threshold 0.717x")

# The fixed cost per bucket: the rest of the exact hooks' measured cost after their selection and the
# residual add (the simulator's n x gamma: 102.2 MB x 3 / 3.35 TB/s = 0.0916 ms), over the buckets.
# Hook cost: gtopk exact 69.10 x (1 / 0.970 - 1) = 2.137 ms, topk exact 69.10 x (1 / 0.969 - 1) = 2.211 ms,
# mean 2.174 ms; stated (2.174 - 0.830 - 0.092) / 5 = 0.2504 ms per bucket;
# low: step 60 ms, ratio 0.975: 60 x (1/0.975 - 1) = 1.538 ms, (1.538 - 0.848 - 0.092) / 5 = 0.1197 ms;
# high: step 72.8 ms, ratio 0.964: 72.8 x (1/0.964 - 1) = 2.719 ms, (2.719 - 0.810 - 0.092) / 4 = 0.454 ms.
_ADD_MS = RESNET50_ELEMS * 4 * 3.0 / (H100_MEMORY_GBPS * GB) * 1e3  # 0.0916 ms
_HOOK_EXACT_MS = (_hook_ms(_STEP_MS[1], _H200_RATIO["gtopk exact"]) + _hook_ms(_STEP_MS[1], _H200_RATIO["topk exact"])) / 2
_FIXED = Ranged(
    (_HOOK_EXACT_MS - sum(_H100_EXACT_MS) / 4 - _ADD_MS) * 1e-3 / RESNET50_BUCKETS[1],
    (_hook_ms(_STEP_MS[0], _H200_RATIO["gtopk exact"] + _RATIO_NOISE) - max(_H100_EXACT_MS) - _ADD_MS) * 1e-3
    / RESNET50_BUCKETS[1],
    (_hook_ms(_STEP_MS[2], _H200_RATIO["topk exact"] - _RATIO_NOISE) - min(_H100_EXACT_MS) - _ADD_MS) * 1e-3
    / RESNET50_BUCKETS[0],
    "H200 loop: gtopk / topk exact 0.970 / 0.969x plain DDP (2.14-2.21 ms per step), less the H100's "
    "exact selection and one residual pass, over ResNet-50's 4-5 buckets")

# PowerSGD (flashsgd's hook with torch's inside, rank 1): 69.10 x (1 / 0.762 - 1) = 21.58 ms per step,
# less the error-feedback pass (25,502,912 x 4 B x 3 / 3.35 TB/s = 0.091 ms) and the flops (153 Mflop
# at 67 TFLOPS: 2.3 us), over the 25,502,912 compressed elements: 0.843 ns/elem stated;
# low: 60 x (1/0.767 - 1) = 18.23 ms -> 0.711 ns; high: 72.8 x (1/0.757 - 1) = 23.37 ms -> 0.913 ns.
_EF_MS = RESNET50_COMPRESSED_ELEMS * 4 * 3.0 / (H100_MEMORY_GBPS * GB) * 1e3  # 0.0914 ms


def _lowrank(step_ms: float, ratio: float) -> float:
    return _per_elem(_hook_ms(step_ms, ratio) - _EF_MS, RESNET50_COMPRESSED_ELEMS)


_LOWRANK = Ranged(_lowrank(_STEP_MS[1], _H200_RATIO["powersgd"]),
                  _lowrank(_STEP_MS[0], _H200_RATIO["powersgd"] + _RATIO_NOISE),
                  _lowrank(_STEP_MS[2], _H200_RATIO["powersgd"] - _RATIO_NOISE),
                  "H200 loop: powersgd (torch's per-tensor hook, rank 1) 0.762x plain DDP = 21.6 ms per step, "
                  "over ResNet-50's 25.5M compressed elements")


def _flops(tflops: float, spec: str) -> Ranged:
    """Seconds per flop: stated at the fp32 (non-tensor-core) peak ``tflops``; high at a tenth of it
    [judgement: the skinny products of a rank-1..4 approximation are far from peak; the measured
    per-element cost, lowrank_s_per_elem, already holds the measured hook's time]."""
    return Ranged(1 / (tflops * 1e12), 1 / (tflops * 1e12), 10 / (tflops * 1e12), f"{spec}: {tflops:g} TFLOPS fp32 peak")


DEVICES.add("h100", DeviceClass(
    name="h100", description="NVIDIA H100 SXM / H200, GH100", device_type="cuda", memory_gbps=H100_MEMORY_GBPS,
    select_s_per_elem={"exact": _EXACT, "sampled": _SAMPLED, "threshold": _THRESHOLD},
    exchange_fixed_s=_FIXED, lowrank_s_per_elem=_LOWRANK,
    flop_s=_flops(67.0, "H100 SXM datasheet"),
    source="measured: H100 selections and the H200 loop's hook costs (docs/gpu.md)",
))


def _scaled_gpu(name: str, description: str, memory_gbps: float, tflops: float, spec: str,
                high_select: dict[str, Ranged] | None = None) -> DeviceClass:
    """A GPU class derived from ``h100`` by memory bandwidth (module docstring): f = 3,350 / memory_gbps;
    selections x f (:meth:`Ranged.scaled`: high 2 f x H100's value, or H100's measured in-loop worst
    if larger); the fixed cost per bucket and PowerSGD's per-element cost stated as H100's
    (launch-bound), high x f."""
    f = H100_MEMORY_GBPS / memory_gbps
    how = f"h100 x {f:.3g} (memory bandwidth {H100_MEMORY_GBPS:g} / {memory_gbps:g} GB/s), derived, not measured"
    h = DEVICES.get("h100")
    select = {k: v.scaled(f, f"{how}; {v.source}") for k, v in h.select_s_per_elem.items()}
    for k, r in (high_select or {}).items():
        select[k] = Ranged(select[k].value, select[k].low, max(select[k].high, r.high), f"{select[k].source}; {r.source}")
    launch = {n: Ranged(getattr(h, n).value, getattr(h, n).low, getattr(h, n).high * f, f"{how}; {getattr(h, n).source}")
              for n in ("exchange_fixed_s", "lowrank_s_per_elem")}
    return DeviceClass(name=name, description=description, device_type="cuda", memory_gbps=memory_gbps,
                       select_s_per_elem=select, flop_s=_flops(tflops, spec), source=how, **launch)


# A100 SXM4 80GB: 2,039 GB/s HBM2e, 19.5 TFLOPS fp32 (NVIDIA A100 datasheet): f = 1.64.
DEVICES.add("a100", _scaled_gpu("a100", "NVIDIA A100 SXM4 80GB", 2039.0, 19.5, "A100 datasheet"))
# V100 SXM2: 900 GB/s HBM2, 15.7 TFLOPS fp32 (NVIDIA Tesla V100 datasheet): f = 3.72, exact 32.49 x 3.72 = 121 ps.
DEVICES.add("v100", _scaled_gpu("v100", "NVIDIA V100 SXM2", 900.0, 15.7, "V100 datasheet"))
# P100 SXM2: 732 GB/s HBM2, 10.6 TFLOPS fp32 (NVIDIA Tesla P100 datasheet): f = 4.58, exact 149 ps.
DEVICES.add("p100", _scaled_gpu("p100", "NVIDIA P100 SXM2", 732.0, 10.6, "P100 datasheet"))
# GP102: the GTX 1080 Ti has 11 Gbit/s GDDR5X x 352 bits = 484 GB/s and 11.3 TFLOPS fp32 (NVIDIA's
# specification); the P102-100 of the gTop-k paper's cluster is the same chip with a narrower bus:
# ~480 GB/s stated for the class (the 1gbe preset's figure since it was built). f = 6.98, exact 227 ps. The
# exact selection's high end: the gTop-k paper's measured selection on that cluster, 0.154 s for
# ResNet-50's 25,557,032 gradients = 6.03 ns/elem (Shi et al. 2019; docs/simulator.md, "The gTop-k
# paper's breakdown as inputs"): their 2019 implementation, 27x the bandwidth-scaled torch.topk.
_GTOPK_PAPER = Ranged(0.154 / RESNET50_ELEMS, 0.154 / RESNET50_ELEMS, 0.154 / RESNET50_ELEMS,
                      "high: the gTop-k paper's selection on a P102 (GP102), 0.154 s per 25,557,032 = 6.03 ns/elem")
DEVICES.add("gtx1080ti", _scaled_gpu("gtx1080ti", "NVIDIA GTX 1080 Ti / P102-100, GP102", 480.0, 11.3,
                                     "GTX 1080 Ti specification", high_select={"exact": _GTOPK_PAPER}))

# ---------------------------------------------------------------------- cpu: measured (2-core VM) ----
# ms per 25,557,032 fp32 elements, one thread, density 0.001 (docs/data/sparse_selection_fast.json,
# sparse_selection_pass2.json); low: the 2-thread run at load 2.9 (sparse_selection_quiet.json, 0.001);
# high: density 0.01 (sparse_selection_fast.json).
# exact: (269.2 + 248.7) / 2 = 258.95 ms -> 10.13 ns/elem; low 246.6 -> 9.65 ns; high 544.4 -> 21.30 ns.
# sampled: (26.36 + 24.91) / 2 = 25.64 ms -> 1.003 ns; low 17.67 -> 0.692 ns; high 72.2 -> 2.825 ns.
# threshold: (21.29 + 19.79) / 2 = 20.54 ms -> 0.804 ns; low 18.37 (with reuse, pass2) -> 0.719 ns;
# high 112.8 -> 4.415 ns.
_CPU_MS = {"exact": ((269.2, 248.7), 246.6, 544.4), "sampled": ((26.36, 24.91), 17.67, 72.2),
           "threshold": ((21.29, 19.79), 18.37, 112.8)}
_CPU_SELECT = {k: Ranged(_per_elem(sum(mid) / len(mid)), _per_elem(lo), _per_elem(hi),
                         f"2-core VM, docs/data/sparse_selection_*.json: {k} {lo:g}-{hi:g} ms per 25,557,032")
               for k, (mid, lo, hi) in _CPU_MS.items()}
DEVICES.add("cpu", DeviceClass(
    name="cpu", description="x86 CPU, one thread per rank (the project's 2-core VM)", device_type="cpu",
    # One add pass over 25,557,032 fp32 (3 x 102.2 MB of traffic) took 7.44-8.32 ms on one thread
    # (sparse_selection_pass2.json, _fast.json): 306.7 MB / 7.87 ms = 39 GB/s.
    memory_gbps=39.0,
    select_s_per_elem=_CPU_SELECT,
    # One real gTop-k exchange less the model's time for it, measured by `train --comm auto` (4 Gloo
    # ranks on the 2-core VM): 5.42 ms stated (docs/planner.md's run); high 9.1 ms (the same at load 10);
    # low 1 ms [judgement: one rank per core, no load].
    exchange_fixed_s=Ranged(5.42e-3, 1e-3, 9.1e-3, "train --comm auto on the 2-core VM: 5.42 and 9.1 ms"),
    # ASSUMPTION [judgement, unmeasured on the CPU]: torch's PowerSGD hook is a few passes over the
    # compressed elements per step: 4 add passes, 4 x 0.31 ns (7.87 ms / 25,557,032) = 1.2 ns/elem;
    # low 1 pass 0.31 ns, high 10x 1.2 ns.
    lowrank_s_per_elem=Ranged(1.2e-9, 0.31e-9, 12e-9, "ASSUMPTION [judgement]: 4 memory passes (1-40)"),
    # ASSUMPTION [judgement]: ~50 GFLOPS fp32 from 2 AVX2 cores (peak 2 x 32 flop x ~2.5 GHz = 160);
    # range 160 (peak) to 10 GFLOPS.
    flop_s=Ranged(1 / 50e9, 1 / 160e9, 1 / 10e9, "ASSUMPTION [judgement]: 50 GFLOPS (10-160)"),
    source="measured on the project's 2-core VM (selections, the fixed cost); PowerSGD assumed",
))


def device_class(name: str) -> DeviceClass:
    """The class called ``name``; ValueError naming the known classes otherwise."""
    return DEVICES.get(name)
