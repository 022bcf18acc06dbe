"""Cluster descriptions as small TOML files, besides the presets of :mod:`flashsgd.sim.network`.

A file describes what the simulator and the planner (``flashsgd plan``, ``train --comm auto``) need
to know about a cluster: how many nodes of how many ranks, the two link levels, and optionally the
per-call and compression costs of the devices. Units are in the key names::

    # lab.toml: 4 machines of 2 GPUs on 1 Gbit/s Ethernet
    name = "lab"
    nodes = 4                   # optional: the most nodes a plan may use
    ranks_per_node = 2          # GPUs (ranks) per node
    device = "a100"             # optional: the GPU class (flashsgd.sim.device_costs.DEVICES): its
                                # compute rates, reduction speed and compression costs
    selection = "auto"          # optional, with device: the top-k selection the sparse hooks run
                                # (exact, sampled, threshold; auto: the one they pick on the device)
    backend = "nccl"            # optional: what DDP's native all-reduce runs on, nccl or gloo

    [intra]                     # GPU <-> GPU inside a node, per GPU and direction
    bandwidth_gbit = 100.0      # Gbit/s (1e9 bits per second)
    latency_us = 5.0            # per message step

    [inter]                     # node <-> node: the node's NICs together, per direction
    bandwidth_gbit = 1.0
    latency_us = 50.0
    kind = "ethernet-1g"        # optional (both levels): the link, to check the value's units
    nics = 1                    # optional ([inter]): the node's NICs of that kind
    flow_bandwidth_gbit = 0.25  # optional (both levels): the most one flow (connection) carries
    incast = 0.0                # optional: goodput lost per extra node sending to one node at once
                                # (TCP incast; 0: none, lossless fabrics)

    [costs]                     # optional; every key defaults to a V100-class GPU (DEFAULT_COSTS)
    reduce_ns_per_byte = 0.0033 # summing one byte of a message (3 bytes of memory traffic / 900 GB/s)
    call_overhead_us = 10.0     # one collective call
    exchange_fixed_us = 500.0   # one sparse exchange, whatever its size (launches, host syncs, Python)
    round_fixed_us = 0.0        # each message round of a sparse exchange, beyond latency_us
    select_ns_per_elem = 0.5    # top-k selection per gradient element
    lowrank_ns_per_elem = 0.0   # PowerSGD's hook per compressed element beyond its flops (0: not charged;
                                # measured on an H200: 0.84, flashsgd.sim.device_costs)
    tflops = 15.0               # matrix products of PowerSGD
    step_overhead_us = 0.0      # fixed cost per multi-GPU step beyond the exchange (DDP, Python, syncs)
    jitter_percent = 1.5        # one rank's compute variation over steps and GPUs (std / mean, %): stragglers
    bucket_overhead_us = 0.0    # per bucket on the communication stream (the framework's hook, bookkeeping)
    overlap_slowdown_percent = 15.9  # compute speed lost while an exchange overlaps it (%, < 100)
    input_us_per_image = 0.0    # the node's host time per training image (read, decode, augment),
                                # shared by its GPUs; 0: the input pipeline keeps up

    [fabric]                    # optional; absent: one non-blocking switch (flashsgd.sim.fabric)
    nodes_per_switch = 16       # nodes on one edge switch
    oversubscription = 3.0      # what a switch's nodes send over what its uplink carries (3:1)
    oversubscription_range = [1.0, 4.0]
    placement = "ordered"       # ranks numbered switch by switch; "random": in no relation to them

``device`` sets what a preset on that GPU has (:func:`flashsgd.sim.network.on_device`): the
published compute rates ``simulate`` and ``plan`` look up for it, the reduction speed, the sparse
exchange's and PowerSGD's costs and their ranges; a ``[costs]`` key the file gives (or its range)
keeps the file's value, which its author measured or chose. ``plan --device`` overrides the file's
device (``--selection`` its selection), and sets the class's costs over those [costs] keys too.
``backend`` (default ``nccl``): ``native`` is NCCL's ring or tree, or Gloo's ring
(:mod:`flashsgd.sim.costs_nccl`).

Every bandwidth is in Gbit/s *per direction*: NVIDIA quotes NVLink as the "total" GB/s of both
directions (A100: 600 GB/s = 300 GB/s per direction = 2400 Gbit/s here; V100: 300 GB/s = 1200
Gbit/s), NICs by their line rate per port (InfiniBand HDR 200 Gbit/s; a node of 8 is 1600).
``kind`` names the link (:data:`flashsgd.sim.link_kinds.LINK_KINDS`: ``nvlink1``-``nvlink5``,
``pcie3``-``pcie6``, ``ib-fdr``/``edr``/``hdr``/``ndr``/``xdr``, ``ethernet-1g`` ... ``-400g``,
``roce-25g`` ... ``-400g``; ``nics``: how many per node): a value outside what it carries per
direction is warned about, with the likely unit mistake (``intra.bandwidth_gbit = 300`` with
``kind = "nvlink3"``: GB/s written where Gbit/s is asked, 2400), and so is a TCP link (``ethernet-*``)
of 25 Gbit/s or more without a per-flow limit.

``flow_bandwidth_gbit`` (Gbit/s, > 0; absent: one flow can fill the link) caps every flow
(:attr:`Link.flow_gbps`): a flat ring sends one flow through each node's link, hierarchical and
torus2d one cross-node ring per local rank, so with a cap below the link rate they are faster.
``flow_bandwidth_gbit_range`` without ``flow_bandwidth_gbit``: no limit stated, a limit in the
range plausible (its high end no limit either: it must hold the link's ``bandwidth_gbit``).
``incast`` (>= 0, absent: 0) is :attr:`Link.incast`: a round in which m nodes send to one node at
once (Top-k's direct exchange, m = N - 1) takes ``1 + incast (m - 1)`` times its bytes' time;
``incast_range`` without ``incast`` ranges the stated 0.

Assumed values carry a plausible range, ``KEY_range = [low, high]`` beside ``KEY`` in the same
table and unit (every link and cost key; the value must lie inside)::

    [costs]
    exchange_fixed_us = 500.0
    exchange_fixed_us_range = [100.0, 9100.0]

A value without a range is taken as measured (``train --comm auto`` writes such files). The
``[costs]`` keys a file leaves out take :data:`DEFAULT_COSTS`, assumptions: those with a preset
range (:data:`flashsgd.sim.network.SPARSE_RANGES`, :data:`flashsgd.sim.network.STEP_RANGES`) take
that range too. ``flashsgd plan`` varies
every ranged input (:mod:`flashsgd.sim.uncertainty`).

``input_us_per_image`` (:attr:`ClusterModel.input_s_per_image`) has no preset range: it depends on
the node's CPUs and its data loader, so a file that knows its host gives one, e.g. 40 cores that
each prepare at least 100 ImageNet images/s: ``input_us_per_image_range = [0.0, 250.0]`` (high: a
node's ``1e6 / (cores x rate)``; low 0: the pipeline keeps up, e.g. decoding on the GPUs); left
out, the input pipeline keeps up (0, not ranged).

``[fabric]`` (:class:`flashsgd.sim.fabric.Fabric`) says what lies beyond the NICs: flows that leave an
edge switch of ``nodes_per_switch`` nodes share its uplink, which carries ``nodes_per_switch x
inter.bandwidth_gbit / oversubscription``; ``placement`` (``ordered``, ``interleaved``, ``random``)
says where consecutive ranks sit. Only ``oversubscription`` takes a range.

``exchange_fixed_us`` and ``round_fixed_us`` are the fixed costs of a sparse exchange
(:attr:`ClusterModel.exchange_fixed_s`, :attr:`ClusterModel.round_fixed_s`): ``train --comm auto``
measures both (one real gTop-k exchange and one send/receive round) and records them here.
``sparse_overhead_us``, their former single key, is read as ``exchange_fixed_us``.

:func:`load_cluster` takes a preset name or a path; :func:`to_toml` writes a :class:`ClusterModel`
back in this format (``train --comm auto`` records the cluster it measured so, and the file can be
given back with ``--cluster`` to skip the measurement). Errors name the file, the key and the valid
range.

Example::

    >>> c = load_cluster("1gbe")
    >>> c.inter.bandwidth_gbps, c.ranks_per_node
    (0.111, 1)
    >>> back = load_cluster_text(to_toml(c), "round trip")
    >>> back.inter.bandwidth_gbps, round(back.inter.alpha_s * 1e6, 9)
    (0.111, 440.0)
"""

from __future__ import annotations

import json
import math
import tomllib
from dataclasses import replace
from pathlib import Path

from flashsgd.sim.fabric import PLACEMENTS, Fabric
from flashsgd.sim.link_kinds import LINK_KINDS, check_link
from flashsgd.exchanges import SELECTIONS
from flashsgd.sim.device_costs import DEVICES
from flashsgd.sim.network import (BACKENDS, CLUSTERS, SPARSE_RANGES, STEP_RANGES, STEP_STATED, ClusterModel, Link,
                                   highest_bandwidth, on_device)

GBIT = 1e9 / 8 / 1e9  # 1 Gbit/s in GB/s (Link.bandwidth_gbps is in 1e9 bytes per second)

RENAMED_COSTS = {"sparse_overhead_us": "exchange_fixed_us"}
"""Keys of earlier files (``cluster.toml`` of earlier auto runs) and the key they are read as."""

COST_FIELDS = {"reduce_ns_per_byte": ("gamma_s_per_byte", 1e-9), "call_overhead_us": ("call_overhead_s", 1e-6),
               "exchange_fixed_us": ("exchange_fixed_s", 1e-6), "round_fixed_us": ("round_fixed_s", 1e-6),
               "select_ns_per_elem": ("select_s_per_elem", 1e-9),
               "lowrank_ns_per_elem": ("lowrank_s_per_elem", 1e-9),
               "step_overhead_us": ("step_overhead_s", 1e-6), "jitter_percent": ("jitter_cv", 1e-2),
               "bucket_overhead_us": ("bucket_overhead_s", 1e-6),
               "overlap_slowdown_percent": ("overlap_slowdown", 1e-2),
               "input_us_per_image": ("input_s_per_image", 1e-6)}
"""[costs] key -> (ClusterModel field, factor to its SI unit); ``tflops`` is ``flop_s = 1 / (tflops x 1e12)``."""
DEFAULT_COSTS = {"reduce_ns_per_byte": 3.0 / 900.0, "call_overhead_us": 10.0,
                 "exchange_fixed_us": 500.0, "round_fixed_us": 0.0, "select_ns_per_elem": 0.5,
                 "lowrank_ns_per_elem": 0.0, "tflops": 15.0,
                 **{key: round(STEP_STATED[field] / factor, 12) for key, (field, factor) in COST_FIELDS.items()
                    if field in STEP_STATED},
                 "input_us_per_image": 0.0}
"""A V100-class GPU (900 GB/s HBM2, ~15 TFLOPS fp32; NCCL-class call cost; the presets' sparse
assumptions and the step's stated costs, :data:`flashsgd.sim.network.STEP_STATED`, in this file's units)."""
LINK_FIELDS = {"bandwidth_gbit": ("bandwidth_gbps", GBIT), "latency_us": ("alpha_s", 1e-6),
               "flow_bandwidth_gbit": ("flow_gbps", GBIT), "incast": ("incast", 1.0)}
"""[intra] / [inter] key -> (Link field, factor to its unit)."""
RANGE = "_range"

_TOP = {"name", "nodes", "ranks_per_node", "device", "selection", "backend", "intra", "inter", "costs", "fabric"}
DEVICE_COSTS = {"gamma_s_per_byte": "reduce_ns_per_byte", "exchange_fixed_s": "exchange_fixed_us",
                "round_fixed_s": "round_fixed_us", "select_s_per_elem": "select_ns_per_elem",
                "lowrank_s_per_elem": "lowrank_ns_per_elem", "flop_s": "tflops"}
"""The fields a ``device`` sets (:func:`flashsgd.sim.network.on_device`) and the [costs] key that, given
in the file, keeps the file's own value instead."""
_FABRIC = {"nodes_per_switch", "oversubscription", "oversubscription" + RANGE, "placement"}
_LINK = {"bandwidth_gbit", "latency_us"}
_LINK_OPTIONAL = {"flow_bandwidth_gbit", "incast", "kind", "nics"}
LINK_DEFAULTS = {"incast": 0.0}
"""Optional link keys with a stated value when absent (``flow_bandwidth_gbit`` absent: no limit)."""


LIMITS = {"nics": 64, "bandwidth_gbit": 1e5, "flow_bandwidth_gbit": 1e5, "latency_us": 1e7, "ranks_per_node": 4096,
          "nodes": 10 ** 6, "incast": 100.0, "overlap_slowdown_percent": 99.0,
          "jitter_percent": 99.0, "input_us_per_image": 1e6, "nodes_per_switch": 10 ** 6,
          "oversubscription": 1e4}
"""The largest value a cluster file may give (a key's last part; its ``_range`` bounds too): far
past any machine (100 Tbit/s, 10 s, 4,096 ranks per node, a million nodes, an incast loss of 100
per extra sender, compute at 1% of its speed under overlap, a step-to-step spread of 99%, a second
of host time per image), so that a typo (1e308, 1e30) is refused instead of planned with infinite
or absurd costs; an uplink 10,000 times oversubscribed)."""


UNITS = {"bandwidth_gbit": "Gbit/s per direction (1e9 bits/s; NVLink 3's '600 GB/s total' is 2400)",
         "flow_bandwidth_gbit": "Gbit/s one flow carries per direction", "latency_us": "microseconds per message step",
         "incast": "goodput lost per extra sender", "reduce_ns_per_byte": "ns per byte summed",
         "call_overhead_us": "microseconds per collective call", "exchange_fixed_us": "microseconds per sparse exchange",
         "round_fixed_us": "microseconds per message round", "select_ns_per_elem": "ns per gradient element",
         "lowrank_ns_per_elem": "ns per compressed element", "tflops": "TFLOPS (1e12 FLOP/s)",
         "step_overhead_us": "microseconds per step", "jitter_percent": "% (std / mean)",
         "bucket_overhead_us": "microseconds per bucket", "overlap_slowdown_percent": "% of compute speed",
         "input_us_per_image": "microseconds of host time per image", "oversubscription": "to 1 (3 for 3:1)"}
"""The unit of every number a cluster file gives (by the key's last part), named in its errors."""


def _number(where: str, key: str, value, *, positive: bool, limit: str | None = None) -> float:
    """``value`` as a float, or ValueError naming ``key``, its unit and the valid values (``limit``:
    the :data:`LIMITS` entry, default the key's last part)."""
    base = limit or key.rsplit(".", 1)[-1]
    high = LIMITS.get(base)
    ok = isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value) \
        and (value > 0 if positive else value >= 0) and (high is None or value <= high)
    if not ok:
        bound = f"{'> 0' if positive else '>= 0'}" + (f" and <= {high:g}" if high is not None else "")
        unit = UNITS.get(base.removesuffix(RANGE))
        raise ValueError(f"{where}: {key} must be a finite number {bound}, got {value!r}"
                         + (f" (unit: {unit})" if unit else ""))
    return float(value)


def _table(where: str, doc: dict, key: str, allowed: set[str], required: bool,
           former: frozenset[str] = frozenset()) -> dict:
    table = doc.get(key)
    if table is None:
        if required:
            raise ValueError(f"{where}: missing [{key}] table with {', '.join(sorted(allowed))}")
        return {}
    if not isinstance(table, dict):
        raise ValueError(f"{where}: {key} must be a table [{key}], got {table!r}")
    unknown = sorted(set(table) - allowed - former)  # former names are read, never suggested
    if unknown:
        raise ValueError(f"{where}: unknown key(s) {', '.join(f'{key}.{u}' for u in unknown)}; valid: "
                         f"{', '.join(f'{key}.{a}' for a in sorted(allowed))}")
    return table


def _range(where: str, table: dict, table_name: str, key: str, value: float | None) -> tuple[float, float] | None:
    """``KEY_range = [low, high]`` of ``table`` (file units), checked to hold ``value`` (if any); None if absent."""
    bounds = table.get(key + RANGE)
    if bounds is None:
        return None
    name = f"{table_name}.{key}{RANGE}"
    if not (isinstance(bounds, list) and len(bounds) == 2):
        raise ValueError(f"{where}: {name} must be [low, high], got {bounds!r}")
    lo, hi = (_number(where, name, b, positive=False, limit=key) for b in bounds)  # the key's own limit
    if value is not None and not lo <= value <= hi:
        raise ValueError(f"{where}: {name} = [{lo:g}, {hi:g}] must hold {table_name}.{key} = {value:g} "
                         "(low <= value <= high)")
    return lo, hi


def _link_ranges(where: str, doc: dict, key: str) -> dict[str, tuple[float, float]]:
    t = doc.get(key) or {}
    out = {}
    for fkey, (field, factor) in LINK_FIELDS.items():
        if fkey in t or fkey in LINK_DEFAULTS:
            r = _range(where, t, key, fkey, float(t.get(fkey, LINK_DEFAULTS.get(fkey, 0.0))))
            if r is not None:
                out[f"{key}.{field}"] = (r[0] * factor, r[1] * factor)
        elif fkey + RANGE in t:  # only flow_bandwidth_gbit is optional: no limit stated, a limit plausible
            bw = highest_bandwidth(float(t["bandwidth_gbit"]), t.get("bandwidth_gbit" + RANGE))  # both checked above
            lo, hi = _range(where, t, key, fkey, None)
            if hi < bw:
                raise ValueError(f"{where}: {key}.{fkey}{RANGE} = [{lo:g}, {hi:g}] without {key}.{fkey} (no "
                                 f"limit stated) must reach no limit: high >= {key}.bandwidth_gbit's highest, {bw:g}")
            out[f"{key}.{field}"] = (lo * factor, hi * factor)
    return out


def _cost_ranges(where: str, given: dict, costs: dict) -> dict[str, tuple[float, float]]:
    out = {}
    for key, value in costs.items():
        r = _range(where, given, "costs", key, value)
        if key == "tflops":
            if r is not None:
                if r[0] <= 0:
                    raise ValueError(f"{where}: costs.tflops{RANGE} low must be > 0, got {r[0]!r}")
                out["flop_s"] = (1.0 / (r[1] * 1e12), 1.0 / (r[0] * 1e12))
            continue
        field, factor = COST_FIELDS[key]
        if r is not None:
            out[field] = (r[0] * factor, r[1] * factor)
        elif key not in given and field in {**SPARSE_RANGES, **STEP_RANGES}:  # a default: the presets' assumption
            out[field] = {**SPARSE_RANGES, **STEP_RANGES}[field]
    return out


def _link(where: str, doc: dict, key: str) -> Link:
    t = _table(where, doc, key, _LINK | _LINK_OPTIONAL | {k + RANGE for k in LINK_FIELDS}, required=True)
    for k in sorted(_LINK - set(t)):
        raise ValueError(f"{where}: missing {key}.{k} ({'Gbit/s, > 0' if k == 'bandwidth_gbit' else 'us, >= 0'})")
    if key == "intra" and ({"incast", "incast" + RANGE} & set(t)):  # many nodes into one: a network's loss
        raise ValueError(f"{where}: intra.incast: TCP incast is a loss of the network between nodes "
                         "(many nodes sending to one); give incast and incast_range under [inter]")
    bw = _number(where, f"{key}.bandwidth_gbit", t["bandwidth_gbit"], positive=True)
    lat = _number(where, f"{key}.latency_us", t["latency_us"], positive=False)
    flow = t.get("flow_bandwidth_gbit")
    if flow is not None:
        flow = _number(where, f"{key}.flow_bandwidth_gbit", flow, positive=True) * GBIT
    incast = _number(where, f"{key}.incast", t.get("incast", LINK_DEFAULTS["incast"]), positive=False)
    if "nics" in t:
        _count(where, t, "nics", required=True, table=key)
    if "kind" in t and (not isinstance(t["kind"], str) or t["kind"] not in LINK_KINDS):
        raise ValueError(f"{where}: {key}.kind must be one of {', '.join(n for n, k in LINK_KINDS.items() if k.level == key)}, "
                         f"got {t['kind']!r}")
    return Link(alpha_s=lat * 1e-6, bandwidth_gbps=bw * GBIT, flow_gbps=flow, incast=incast)


def link_warnings(where: str, doc: dict) -> tuple[str, ...]:
    """The warnings of :func:`flashsgd.sim.link_kinds.check_link` for each link table that names its
    ``kind`` (checked by :func:`_link`)."""
    out = []
    for key in ("intra", "inter"):
        t = doc.get(key) or {}
        if "kind" in t:
            flow = "flow_bandwidth_gbit" in t or "flow_bandwidth_gbit" + RANGE in t
            out += [f"{where}: {w}" for w in check_link(key, t["kind"], float(t["bandwidth_gbit"]), t.get("nics"), flow)]
    return tuple(out)


def _count(where: str, doc: dict, key: str, required: bool, table: str = "") -> int | None:
    """``doc[key]``, an integer in [1, LIMITS[key]] (``table``: the table's name, for errors)."""
    value, name = doc.get(key), f"{table}.{key}" if table else key
    if value is None:
        if required:
            raise ValueError(f"{where}: missing {name} (an integer >= 1)")
        return None
    if not isinstance(value, int) or isinstance(value, bool) or not 1 <= value <= LIMITS[key]:
        raise ValueError(f"{where}: {name} must be an integer in [1, {LIMITS[key]:,}], got {value!r}")
    return value


def _fabric(where: str, doc: dict) -> tuple[Fabric, dict[str, tuple[float, float]]]:
    """The ``[fabric]`` table (absent: one non-blocking switch) and its oversubscription's range."""
    if "fabric" not in doc:
        return Fabric(), {}
    t = _table(where, doc, "fabric", _FABRIC, required=True)
    if "nodes_per_switch" not in t:
        raise ValueError(f"{where}: [fabric] needs fabric.nodes_per_switch (an integer >= 1: the nodes on one "
                         "edge switch); leave [fabric] out for one non-blocking switch")
    per_switch = _count(where, t, "nodes_per_switch", required=True, table="fabric")
    placement = t.get("placement", "ordered")
    if placement not in PLACEMENTS:
        raise ValueError(f"{where}: fabric.placement must be one of {', '.join(PLACEMENTS)}, got {placement!r}")
    over = t.get("oversubscription", 1.0)
    bounds = t.get("oversubscription" + RANGE)
    for name, v in [("oversubscription", over)] + [(f"oversubscription{RANGE}", b) for b in bounds or ()]:
        if isinstance(v, (int, float)) and not isinstance(v, bool) and not 1 <= v <= LIMITS["oversubscription"]:
            raise ValueError(f"{where}: fabric.{name} must be in [1, {LIMITS['oversubscription']:g}] (1: "
                             f"non-blocking, 3 for 3:1), got {v!r}")
    over = _number(where, "fabric.oversubscription", over, positive=True)
    r = _range(where, t, "fabric", "oversubscription", over)
    fabric = Fabric(nodes_per_switch=per_switch, oversubscription=over, placement=placement)
    return fabric, ({"fabric.oversubscription": r} if r is not None else {})


def load_cluster_text(text: str, where: str, default_name: str = "file") -> ClusterModel:
    """The :class:`ClusterModel` a TOML text describes (module docstring); ``where`` names it in errors."""
    try:
        doc = tomllib.loads(text)
    except tomllib.TOMLDecodeError as exc:
        raise ValueError(f"{where}: not valid TOML ({exc})") from None
    unknown = sorted(set(doc) - _TOP)
    if unknown:
        raise ValueError(f"{where}: unknown key(s) {', '.join(unknown)}; valid: {', '.join(sorted(_TOP))}")
    given = dict(_table(where, doc, "costs", set(DEFAULT_COSTS) | {k + RANGE for k in DEFAULT_COSTS},
                        required=False,
                        former=frozenset(RENAMED_COSTS)))
    for old, new in RENAMED_COSTS.items():
        if old in given:
            if new in given:
                raise ValueError(f"{where}: costs.{old} and costs.{new} are the same cost ({old} is its "
                                 f"former name): keep costs.{new}")
            given[new] = given.pop(old)
    costs = {**DEFAULT_COSTS, **{k: v for k, v in given.items() if not k.endswith(RANGE)}}
    c = {k: _number(where, f"costs.{k}", v, positive=(k == "tflops")) for k, v in costs.items()}
    intra, inter = _link(where, doc, "intra"), _link(where, doc, "inter")  # checked before their ranges
    fabric, fabric_range = _fabric(where, doc)
    assumed = {**_link_ranges(where, doc, "intra"), **_link_ranges(where, doc, "inter"),
               **_cost_ranges(where, given, c), **fabric_range}
    name = doc.get("name", default_name)
    if not isinstance(name, str) or not name:
        raise ValueError(f"{where}: name must be a non-empty string, got {name!r}")
    backend = doc.get("backend", "nccl")
    if backend not in BACKENDS:
        raise ValueError(f"{where}: backend must be one of {', '.join(BACKENDS)} (the library DDP's native "
                         f"all-reduce runs on), got {backend!r}")
    cluster = ClusterModel(
        name=name, ranks_per_node=_count(where, doc, "ranks_per_node", required=True),
        nodes=_count(where, doc, "nodes", required=False),
        intra=intra, inter=inter,
        gamma_s_per_byte=c["reduce_ns_per_byte"] * 1e-9, call_overhead_s=c["call_overhead_us"] * 1e-6,
        exchange_fixed_s=c["exchange_fixed_us"] * 1e-6, round_fixed_s=c["round_fixed_us"] * 1e-6,
        select_s_per_elem=c["select_ns_per_elem"] * 1e-9, lowrank_s_per_elem=c["lowrank_ns_per_elem"] * 1e-9,
        step_overhead_s=c["step_overhead_us"] * 1e-6, jitter_cv=c["jitter_percent"] * 1e-2,
        bucket_overhead_s=c["bucket_overhead_us"] * 1e-6, overlap_slowdown=c["overlap_slowdown_percent"] * 1e-2,
        input_s_per_image=c["input_us_per_image"] * 1e-6,
        flop_s=1.0 / (c["tflops"] * 1e12), fabric=fabric, source=where, assumed=assumed,
        warnings=link_warnings(where, doc), backend=backend)
    return _on_named_device(where, doc, cluster, given)


def _on_named_device(where: str, doc: dict, cluster: ClusterModel, given: dict) -> ClusterModel:
    """``cluster`` on the file's ``device`` (and ``selection``), as a preset on it is
    (:func:`flashsgd.sim.network.on_device`), except the [costs] keys the file gives (a value or a
    range): those keep the file's value and range."""
    device, selection = doc.get("device"), doc.get("selection")
    if device is None:
        if selection is not None:
            raise ValueError(f"{where}: selection needs device (the class whose selection costs apply: "
                             f"{', '.join(DEVICES.names())})")
        return cluster
    if device not in DEVICES:
        raise ValueError(f"{where}: device must be one of {', '.join(DEVICES.names())} "
                         f"(flashsgd.sim.device_costs.DEVICES), got {device!r}")
    if selection is not None and selection not in SELECTIONS:
        raise ValueError(f"{where}: selection must be one of {', '.join(SELECTIONS)}, got {selection!r}")
    on = on_device(cluster, device, selection or "auto")
    kept = [f for f, key in DEVICE_COSTS.items() if key in given or key + RANGE in given]
    assumed = {k: v for k, v in on.assumed.items() if k not in kept}
    assumed.update({f: cluster.assumed[f] for f in kept if f in cluster.assumed})
    return replace(on, **{f: getattr(cluster, f) for f in kept}, assumed=assumed)


def load_cluster(spec: str) -> ClusterModel:
    """A preset name (``abci``, ``1gbe``, ...) or the path of a ``.toml`` cluster file."""
    path = Path(spec)
    if spec.endswith(".toml") or path.exists():
        if not path.is_file():
            raise ValueError(f"cluster file {spec!r} does not exist (presets: {', '.join(CLUSTERS.names())})")
        try:
            text = path.read_text()
        except (OSError, UnicodeDecodeError) as exc:  # a binary file, unreadable: named
            raise ValueError(f"cluster file {spec!r} is not a readable TOML text file "
                             f"({type(exc).__name__}: {exc})") from None
        return load_cluster_text(text, f"cluster file {spec!r}", default_name=path.stem)
    try:
        return CLUSTERS.get(spec)
    except ValueError as exc:
        raise ValueError(f"{exc}; or the path of a cluster file NAME.toml "
                         "(format: flashsgd.sim.cluster_file)") from None


def to_toml(c: ClusterModel, comment: str = "") -> str:
    """``c`` in the file format of the module docstring (a measured cluster, to reuse)."""
    lines = [f"# {line}" for line in comment.splitlines()]
    lines += [f"name = {json.dumps(c.name)}"]  # a JSON string is a TOML basic string
    if c.nodes is not None:
        lines.append(f"nodes = {c.nodes}")
    lines.append(f"ranks_per_node = {c.ranks_per_node}")
    if c.device:  # the costs below are written out, so they keep their values when read back
        lines.append(f"device = {json.dumps(c.device)}")
        if c.selection:
            lines.append(f"selection = {json.dumps(c.selection)}")
    if c.backend != "nccl":
        lines.append(f"backend = {json.dumps(c.backend)}")
    for key, link in (("intra", c.intra), ("inter", c.inter)):
        lines += ["", f"[{key}]"]
        for fkey, (field, factor) in LINK_FIELDS.items():
            bounds = _scaled(c.assumed.get(f"{key}.{field}"), 1 / factor)
            if getattr(link, field) == LINK_DEFAULTS.get(fkey) and bounds is None:
                continue  # the default, stated and not ranged: files without the key stay as they were
            if getattr(link, field) is not None:
                lines += _key_lines(fkey, getattr(link, field) / factor, bounds)
            elif bounds is not None:  # a per-flow limit: none stated, a range plausible
                lines.append(f"{fkey}{RANGE} = [{_digits(bounds[0])!r}, {_digits(bounds[1])!r}]")
    lines += ["", "[costs]"]
    for fkey, (field, factor) in COST_FIELDS.items():
        lines += _key_lines(fkey, getattr(c, field) / factor, _scaled(c.assumed.get(field), 1 / factor))
    tflops = 1.0 / (c.flop_s * 1e12) if c.flop_s > 0 else DEFAULT_COSTS["tflops"]
    r = c.assumed.get("flop_s")
    lines += _key_lines("tflops", tflops, None if r is None or r[0] <= 0 else (1 / (r[1] * 1e12), 1 / (r[0] * 1e12)))
    f = c.fabric
    if f.nodes_per_switch is not None:
        lines += ["", "[fabric]", f"nodes_per_switch = {f.nodes_per_switch}",
                  *_key_lines("oversubscription", float(f.oversubscription), c.assumed.get("fabric.oversubscription")),
                  f"placement = {json.dumps(f.placement)}"]
    return "\n".join(lines) + "\n"


def _scaled(bounds: tuple[float, float] | None, factor: float) -> tuple[float, float] | None:
    return None if bounds is None else (bounds[0] * factor, bounds[1] * factor)


def _key_lines(key: str, value: float, bounds: tuple[float, float] | None) -> list[str]:
    """``key = value`` and, for an assumed value, ``key_range = [low, high]`` (widened to hold it);
    12 significant digits (the unit conversions' rounding noise dropped; rounding keeps the order)."""
    lines = [f"{key} = {_digits(value)!r}"]
    if bounds is not None:
        lines.append(f"{key}{RANGE} = [{_digits(min(bounds[0], value))!r}, {_digits(max(bounds[1], value))!r}]")
    return lines


def _digits(v: float) -> float:
    return float(f"{v:.12g}")
