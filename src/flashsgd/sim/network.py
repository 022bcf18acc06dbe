"""Cluster models for the simulator (:class:`ClusterModel`): link levels (alpha, beta), reduction speed, presets.

A cluster has two link levels, the way every GPU cluster in the papers is built:

* ``intra``: GPU <-> GPU inside a node (NVLink, PCIe, shared memory), per GPU and per direction;
* ``inter``: the node's network interface(s), *aggregate over the node's NICs*, per direction.

``alpha`` is the latency of one message step (seconds), ``beta = 1 / bandwidth`` (seconds per byte)
and ``gamma`` the time to reduce one byte (seconds per byte). When several ranks of a node talk to
other nodes at once they share the node's NICs: the cost functions in :mod:`flashsgd.sim.costs`
divide the node bandwidth by the number of concurrent flows, and no flow goes faster than the
link's per-flow limit ``flow_gbps`` (:meth:`Link.flow_beta`; None: no limit, the presets).

Presets (``CLUSTERS``) carry the physical figures they were built from in ``source``; nothing is
tuned to hit a published result. Inputs that are assumptions rather than measurements or
specifications carry a plausible (low, high) in :attr:`ClusterModel.assumed` (keys:
:data:`INPUTS`): the presets' compute rates and sparse costs, and their links (a line rate is a
specification, what a run achieves of it and the latency of a step are not; a TCP preset also a
per-flow limit), each bound's source in a comment beside it. ``flashsgd plan`` and ``flashsgd
simulate`` evaluate every prediction over those ranges (:mod:`flashsgd.sim.uncertainty`). ``local`` is not a preset: it is fitted from a
``flashsgd bench allreduce --json`` file by :func:`flashsgd.sim.calibrate.calibrate`.

Example::

    >>> c = CLUSTERS.get("abci")
    >>> c.ranks_per_node, round(c.inter.bandwidth_gbps, 1)
    (4, 24.0)
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field, replace

from flashsgd.fmt import plural
from flashsgd.registry import Registry
from flashsgd.sim.compute_rates import RATES
from flashsgd.sim.device_costs import DEVICES
from flashsgd.sim.fabric import Fabric

GB = 1e9  # nccl-tests convention: GB/s = 1e9 bytes per second

MAX_GPUS = 2 ** 18
"""The most GPUs a prediction takes (262,144: above the largest single training clusters reported,
about 100,000-200,000 GPUs in 2025).
Measured on a 2-core VM with the abci preset (4 GPUs per node: the fabric model's work is linear in
the nodes): `flashsgd simulate` 0.5 s at 10,000 GPUs, 0.9 s at 100,000, 1.0 s at 262,144, 1.9 s
at 1,000,000 and 12 s with 1.7 GB at 10,000,000 (over 100 s at 1e9); `flashsgd plan` 3.8 s,
9.7 s, 16.5 s and 74 s at the first four."""


def _check_positive(owner: str, name: str, value: float, *, allow_zero: bool = False) -> None:
    ok = value >= 0 if allow_zero else value > 0
    if not (isinstance(value, (int, float)) and math.isfinite(value) and ok):
        bound = ">= 0" if allow_zero else "> 0"
        raise ValueError(f"{owner}.{name} must be a finite number {bound}, got {value!r}")


@dataclass(frozen=True)
class Link:
    """One link level: per-step latency, per-direction bandwidth, and what one flow can carry."""

    alpha_s: float
    """Latency of one message step in seconds (software + wire)."""
    bandwidth_gbps: float
    """Bandwidth per direction in GB/s (1e9 bytes/s); for ``inter`` the node aggregate over NICs."""
    flow_gbps: float | None = None
    """The most one flow (one connection: a ring's hop, one message of a direct exchange) can carry
    per direction, GB/s; None: one flow can fill the link. A single TCP connection often cannot
    fill a fast NIC (window, one core's copy and interrupt work), which is why several concurrent
    rings (torus2d, hierarchical: one cross-node ring per local rank) can beat one flat ring."""
    incast: float = 0.0
    """TCP incast: the goodput lost into one receiving node per extra node sending to it at once
    (dimensionless, >= 0; 0: no loss). When m nodes send to one node in the same round (Top-k's
    direct exchange: m = N - 1), their synchronized bursts overflow the switch port's buffer, packets
    drop and flows wait for retransmission timeouts: the round's bandwidth term is multiplied by
    :meth:`incast_factor` ``1 + incast (m - 1)`` (Phanishayee et al. FAST 2008, Vasudevan et al.
    SIGCOMM 2009: up to 90% of the goodput lost; Alizadeh et al. SIGCOMM 2010, DCTCP: avoided with
    ECN marking and shallow queues). 0 on lossless fabrics (InfiniBand, RoCE with PFC: credit-based
    flow control drops nothing); on TCP unknown without a measurement, so the presets state 0 and
    range it. One sender per receiver (rings, pairwise rounds, trees) never pays it."""

    def __post_init__(self) -> None:
        _check_positive("Link", "alpha_s", self.alpha_s, allow_zero=True)
        _check_positive("Link", "bandwidth_gbps", self.bandwidth_gbps)
        if self.flow_gbps is not None:
            _check_positive("Link", "flow_gbps", self.flow_gbps)
        _check_positive("Link", "incast", self.incast, allow_zero=True)

    @property
    def beta_s_per_byte(self) -> float:
        """Seconds per byte: 1 / bandwidth."""
        return 1.0 / (self.bandwidth_gbps * GB)

    def flow_beta(self, flows: int = 1) -> float:
        """Seconds per byte of one of ``flows`` flows crossing this link at once: they share its
        bandwidth (``flows x beta``) and none goes faster than ``flow_gbps``:
        ``max(flows / bandwidth, 1 / flow_gbps)``."""
        shared = flows * self.beta_s_per_byte
        return shared if self.flow_gbps is None else max(shared, 1.0 / (self.flow_gbps * GB))

    def incast_factor(self, senders: int) -> float:
        """How much longer the bytes of a round take when ``senders`` nodes send to one node at
        once: ``1 + incast (senders - 1)`` (goodput into the receiver divided by it); 1 for one
        sender. Example: incast 0.1, 7 senders -> 1.6 (goodput 62.5% of the link's)."""
        return 1.0 + self.incast * max(senders - 1, 0)


BACKENDS = ("nccl", "gloo")
"""The collective libraries ``native`` is costed for (:attr:`ClusterModel.backend`)."""


@dataclass(frozen=True)
class ClusterModel:
    """A homogeneous GPU cluster: nodes of ``ranks_per_node`` GPUs, two link levels."""

    name: str
    """Preset name (``abci``, ``1gbe``, ``dgx-a100``, ...) or ``local``."""
    ranks_per_node: int
    """GPUs (ranks) per node; ranks 0..L-1 live on node 0, L..2L-1 on node 1, ..."""
    intra: Link
    """GPU <-> GPU inside a node, per GPU and direction."""
    inter: Link
    """Node <-> node, aggregate over the node's NICs, per direction."""
    gamma_s_per_byte: float = 0.0
    """Reduction (sum) time per byte of the message on one rank."""
    call_overhead_s: float = 0.0
    """Fixed cost of one collective call (kernel launch, synchronisation)."""
    exchange_fixed_s: float = 0.0
    """Fixed cost of one sparse exchange of a bucket, whatever its size: selection launch, index
    packing, the size check, host syncs, Python (seconds; once per exchange call)."""
    round_fixed_s: float = 0.0
    """Fixed cost of each message round of a sparse exchange beyond the link's ``alpha``: posting a
    send/receive pair from Python and waiting for it, the synchronisation of the round (seconds; the
    rounds are the a terms of :mod:`flashsgd.sim.costs_sparse`, ``message_pattern(...).rounds``).
    Dense exchanges have no such term: their per-step cost is the link's ``alpha``, fitted from the
    dense collective itself, and their per-call cost ``call_overhead_s``."""
    select_s_per_elem: float = 0.0
    """Top-k selection time per gradient element (a few passes over the gradient)."""
    flop_s: float = 0.0
    """Seconds per floating-point operation of a compressor's matrix products (PowerSGD)."""
    lowrank_s_per_elem: float = 0.0
    """PowerSGD's compression work per element of the matrices it compresses, beyond ``flop_s`` and
    its error-feedback pass: the launches and small kernels of a per-tensor hook (seconds)."""
    device: str = ""
    """The device class the compression costs above come from (:data:`flashsgd.sim.device_costs.DEVICES`,
    e.g. ``h100``); "": none named (a cluster file's or a measured cluster's own values)."""
    selection: str = ""
    """The top-k selection the sparse hooks run on that device (``exact``, ``sampled``,
    ``threshold``: ``selection="auto"`` resolved by the device, :data:`flashsgd.exchanges.SELECTION_BY_DEVICE`),
    whose cost ``select_s_per_elem`` is; "": not named."""
    backend: str = "nccl"
    """The collective library DDP's ``native`` all-reduce runs on: ``nccl`` (GPUs: its ring or tree,
    whichever its tuning model finds faster for the size) or ``gloo`` (CPUs: the ring;
    :mod:`flashsgd.sim.costs_nccl`). flashsgd's own exchanges cost the same on either."""
    step_overhead_s: float = 0.0
    """Fixed cost per step of a multi-GPU run that one GPU does not pay (seconds): the DDP reducer's
    bookkeeping, the hooks' Python, the step's host synchronization, launch gaps (Sergeev & Del
    Balso 2018 and others: 20+ points of scaling efficiency between frameworks on the same GPUs and
    fabric)."""
    jitter_cv: float = 0.0
    """Variation of one rank's compute time, from step to step and from GPU to GPU, as a coefficient
    of variation (std / mean). A synchronous step waits for the slowest of P ranks: the simulator
    adds the expected maximum of P such times (:func:`flashsgd.sim.engine.straggler_factor`)."""
    bucket_overhead_s: float = 0.0
    """Fixed cost of each bucket of a multi-GPU step on the communication stream, beside the
    collective's own ``call_overhead_s`` (seconds per bucket): the framework's hook, bookkeeping and
    launch work before the bucket's exchange can start, e.g. Horovod's negotiation cycle (tensors
    that become ready are fused and reduced once per cycle) or a Python communication hook.
    Added to every bucket's exchange time (:func:`flashsgd.sim.engine.simulate`, Step 3)."""
    overlap_slowdown: float = 0.0
    """How much compute slows while an exchange runs beside it, as the fraction ``s`` of its speed
    lost (0 <= s < 1): GPU collectives run as kernels that take streaming multiprocessors and
    memory bandwidth from backward, so backward runs ``1 / (1 - s)`` times longer for the time an
    exchange overlaps it (:func:`flashsgd.sim.engine.comm_timeline`). 0: overlap is free."""
    input_s_per_image: float = 0.0
    """Host time of one node's input pipeline per training image (seconds; 0: input never limits):
    reading, decoding and augmenting on the node's CPUs, which its GPUs share. The loader works ahead
    while the GPUs compute and exchange, so a step lasts at least ``batch x L x c`` for L > 1 GPUs
    on a node (:func:`flashsgd.sim.engine.simulate`, Step 6). One GPU had the whole host when its
    rate was measured; with L of them the host feeds L times the images (Mohan et al., VLDB
    2021, "Analyzing and Mitigating Data Stalls in DNN Training": CPU pre-processing, not the GPU,
    bounds image training on common 8-GPU servers). ``1 / c`` is the node's images/s."""
    fabric: Fabric = Fabric()
    """The switches beyond the NICs (:mod:`flashsgd.sim.fabric`): nodes per edge switch, the
    uplinks' oversubscription and where ranks sit; the default, one non-blocking switch."""
    resnet50_images_per_s: dict[str, float] = field(default_factory=dict)
    """Single-GPU ResNet-50 training throughput by precision (``fp16``/``fp32``), if known."""
    source: str = ""
    """Where every number above comes from (shown by ``flashsgd simulate --cluster X --show``)."""
    nodes: int | None = None
    """Nodes the cluster has (None: as many as a run needs; the presets)."""
    warnings: tuple[str, ...] = field(default=(), compare=False)
    """What looked wrong in the description (a cluster file's bandwidth outside what its link
    ``kind`` carries, a TCP link without a per-flow limit: :func:`flashsgd.sim.link_kinds.check_link`);
    ``flashsgd simulate`` and ``flashsgd plan`` print each one."""
    assumed: dict[str, tuple[float, float]] = field(default_factory=dict)
    """The inputs that are assumptions, each with its plausible (low, high) in the input's own units
    (key: one of :data:`INPUTS`, e.g. ``exchange_fixed_s``, ``inter.bandwidth_gbps``,
    ``resnet50_images_per_s.fp32``). Every other input is measured (``train --comm auto``,
    ``--calibration``) or taken from the specification ``source`` names."""

    def __post_init__(self) -> None:
        if not isinstance(self.ranks_per_node, int) or self.ranks_per_node < 1:
            raise ValueError(f"ClusterModel.ranks_per_node must be an int >= 1, got {self.ranks_per_node!r}")
        if self.nodes is not None and (not isinstance(self.nodes, int) or self.nodes < 1):
            raise ValueError(f"ClusterModel.nodes must be an int >= 1 or None, got {self.nodes!r}")
        for name in ("gamma_s_per_byte", "call_overhead_s", "exchange_fixed_s", "round_fixed_s",
                     "select_s_per_elem", "flop_s", "lowrank_s_per_elem", "step_overhead_s", "jitter_cv", "bucket_overhead_s",
                     "overlap_slowdown", "input_s_per_image"):
            _check_positive("ClusterModel", name, getattr(self, name), allow_zero=True)
        if self.device and self.device not in DEVICES:
            raise ValueError(f"ClusterModel.device: unknown device class {self.device!r}; known: "
                             f"{', '.join(DEVICES)} (or '' for none)")
        if self.backend not in BACKENDS:
            raise ValueError(f"ClusterModel.backend must be one of {', '.join(BACKENDS)}, got {self.backend!r}")
        if self.selection not in ("", "exact", "sampled", "threshold"):
            raise ValueError(f"ClusterModel.selection must be exact, sampled, threshold or '' (none named), "
                             f"got {self.selection!r}")
        if self.jitter_cv >= 1:
            raise ValueError(f"ClusterModel.jitter_cv must be < 1 (a coefficient of variation: std / mean), "
                             f"got {self.jitter_cv!r}")
        if self.overlap_slowdown >= 1:
            raise ValueError(f"ClusterModel.overlap_slowdown must be < 1 (the fraction of compute speed lost "
                             f"while an exchange overlaps it), got {self.overlap_slowdown!r}")
        for key, value in self.resnet50_images_per_s.items():
            _check_positive("ClusterModel", f"resnet50_images_per_s[{key!r}]", value)
        for key, bounds in self.assumed.items():
            if key not in INPUTS:
                raise ValueError(f"ClusterModel.assumed: unknown input {key!r}; valid: {', '.join(INPUTS)}")
            if input_value(self, key) is None and key not in UNLIMITED:
                raise ValueError(f"ClusterModel.assumed[{key!r}]: the cluster has no value for {key}")
            if not (isinstance(bounds, tuple) and len(bounds) == 2):
                raise ValueError(f"ClusterModel.assumed[{key!r}] must be a (low, high) pair, got {bounds!r}")
            for name, v in zip(("low", "high"), bounds):
                _check_positive("ClusterModel", f"assumed[{key!r}] {name}", v, allow_zero=True)
            if bounds[0] > bounds[1]:
                raise ValueError(f"ClusterModel.assumed[{key!r}]: low {bounds[0]!r} > high {bounds[1]!r}")
            if key.startswith("fabric.") and self.fabric.nodes_per_switch is None:
                raise ValueError(f"ClusterModel.assumed[{key!r}]: the cluster has no fabric (one non-blocking "
                                 "switch): give it a Fabric with nodes_per_switch, or leave the range out")
            if key == "fabric.oversubscription" and bounds[0] < 1:
                raise ValueError(f"ClusterModel.assumed[{key!r}] low must be >= 1 (1: non-blocking), got {bounds[0]!r}")
            if key in UNLIMITED and input_value(self, key) is None:
                level = key.partition(".")[0]
                bandwidth, spread = getattr(self, level).bandwidth_gbps, self.assumed.get(f"{level}.bandwidth_gbps")
                top = highest_bandwidth(bandwidth, spread)
                if bounds[1] < top:
                    raise ValueError(f"ClusterModel.assumed[{key!r}]: with no per-flow limit stated (one flow "
                                     f"fills the link) the high end must be no limit either: >= the link's "
                                     f"highest bandwidth {top:g} GB/s, got {bounds[1]!r}")

    def check_gpus(self, gpus: int) -> None:
        """ValueError unless ``gpus`` ranks fit this cluster: full nodes, at most ``nodes`` of them,
        at most :data:`MAX_GPUS` (the one rule `flashsgd simulate` and `flashsgd plan` read before
        any output)."""
        if isinstance(gpus, bool) or not isinstance(gpus, int) or gpus < 1:
            raise ValueError(f"the number of GPUs must be an int >= 1, got {gpus!r}")
        if gpus > MAX_GPUS:
            raise ValueError(f"{gpus:,} GPUs is more than flashsgd simulates or plans: at most {MAX_GPUS:,} "
                             f"(2**18); a prediction's time and memory grow with the GPUs, and flashsgd "
                             f"plan takes seconds already at the bound")
        per_node = self.ranks_per_node
        if gpus > per_node and gpus % per_node:
            raise ValueError(f"{gpus} GPUs do not fill whole nodes of cluster {self.name!r} "
                             f"({per_node} per node): use a multiple of {per_node} or at most {per_node}")
        if self.nodes is not None and gpus > self.nodes * per_node:
            raise ValueError(f"{gpus} GPUs exceed cluster {self.name!r}: {self.nodes} nodes x {per_node} = "
                             f"{self.nodes * per_node} GPUs at most")

    def describe(self) -> str:
        """Human-readable summary of the cluster's parameters."""
        return (
            f"cluster {self.name}: {plural(self.nodes, 'node') + ' x ' if self.nodes else ''}"
            f"{plural(self.ranks_per_node, 'GPU')}/node; "
            f"intra alpha={self.intra.alpha_s * 1e6:.2f} us, {self.intra.bandwidth_gbps:.3g} GB/s"
            f"{_per_flow(self.intra)}; inter alpha={self.inter.alpha_s * 1e6:.2f} us, "
            f"{self.inter.bandwidth_gbps:.3g} GB/s/node{_per_flow(self.inter)}; "
            f"native on {'NCCL (ring or tree)' if self.backend == 'nccl' else 'Gloo (ring)'}; "
            f"gamma={self.gamma_s_per_byte * 1e12:.3g} ps/B; call overhead "
            f"{self.call_overhead_s * 1e6:.3g} us; sparse exchange fixed {self.exchange_fixed_s * 1e6:.3g} us "
            f"+ {self.round_fixed_s * 1e6:.3g} us per round; "
            f"top-k select {self.select_s_per_elem * 1e9:.3g} ns/elem"
            + (f" ({self.selection or 'selection'} on {self.device})" if self.device else "")
            + (f"; PowerSGD {self.lowrank_s_per_elem * 1e9:.3g} ns/elem" if self.lowrank_s_per_elem else "")
            + f"; step overhead "
            f"{self.step_overhead_s * 1e3:.3g} ms, compute jitter {self.jitter_cv:.1%} over steps and GPUs"
            + (f", {self.bucket_overhead_s * 1e3:.3g} ms per bucket" if self.bucket_overhead_s else "")
            + (f", compute {self.overlap_slowdown:.1%} slower under overlap" if self.overlap_slowdown else "")
            + (f", input pipeline {1 / self.input_s_per_image:.0f} images/s per node" if self.input_s_per_image else "")
            + (f"; fabric: {self.fabric.describe()}" if self.fabric.nodes_per_switch is not None else "")
        )


def _per_flow(link: Link) -> str:
    flow = "" if link.flow_gbps is None else f" ({link.flow_gbps:.3g} GB/s per flow)"
    return flow + (f" (incast {link.incast:.3g} per extra sender)" if link.incast else "")


INPUTS: dict[str, tuple[str, str, float, bool]] = {
    "inter.bandwidth_gbps": ("inter-node bandwidth", "GB/s", 1.0, True),
    "inter.alpha_s": ("inter-node latency", "us", 1e6, False),
    "inter.flow_gbps": ("inter-node per-flow bandwidth", "GB/s", 1.0, True),
    "inter.incast": ("inter-node incast loss", "per extra sender", 1.0, False),
    "intra.bandwidth_gbps": ("intra-node bandwidth", "GB/s", 1.0, True),
    "intra.alpha_s": ("intra-node latency", "us", 1e6, False),
    "intra.flow_gbps": ("intra-node per-flow bandwidth", "GB/s", 1.0, True),
    "fabric.oversubscription": ("switch uplink oversubscription", "to 1", 1.0, False),
    "gamma_s_per_byte": ("reduction", "ps/B", 1e12, False),
    "call_overhead_s": ("collective call overhead", "us", 1e6, False),
    "exchange_fixed_s": ("sparse exchange fixed cost", "ms", 1e3, False),
    "round_fixed_s": ("sparse per-round fixed cost", "ms", 1e3, False),
    "select_s_per_elem": ("top-k selection", "ns/elem", 1e9, False),
    "flop_s": ("matrix products", "ps/flop", 1e12, False),
    "lowrank_s_per_elem": ("PowerSGD compression", "ns/elem", 1e9, False),
    "step_overhead_s": ("per-step overhead", "ms", 1e3, False),
    "jitter_cv": ("compute jitter (CV)", "%", 100.0, False),
    "bucket_overhead_s": ("per-bucket overhead", "ms", 1e3, False),
    "overlap_slowdown": ("compute slowdown under overlap", "%", 100.0, False),
    "input_s_per_image": ("host input time per image and node", "us", 1e6, False),
    "resnet50_images_per_s.fp32": ("compute (ResNet-50 fp32)", "images/s", 1.0, True),
    "resnet50_images_per_s.fp16": ("compute (ResNet-50 fp16)", "images/s", 1.0, True),
}
"""Inputs that can be assumptions (:attr:`ClusterModel.assumed`): key -> (what it is, display unit,
factor from the key's SI unit to the display unit, True when a higher value makes a step faster)."""

UNLIMITED = ("inter.flow_gbps", "intra.flow_gbps")
"""Inputs whose value may be None, no limit (one flow fills the link), and still carry a range: the
limit a flow may meet. Its fast end must not be below the link's bandwidth (then it never binds)."""


def input_value(c: ClusterModel, key: str) -> float | None:
    """The value of input ``key`` (:data:`INPUTS`) of ``c``; None where the cluster has none (for a
    per-flow limit, :data:`UNLIMITED`: no limit)."""
    head, _, tail = key.partition(".")
    if head in ("inter", "intra", "fabric"):
        return getattr(getattr(c, head), tail)
    if head == "resnet50_images_per_s":
        return c.resnet50_images_per_s.get(tail)
    return getattr(c, key)


def with_input(c: ClusterModel, key: str, value: float) -> ClusterModel:
    """``c`` with input ``key`` set to ``value`` (its ranges kept)."""
    head, _, tail = key.partition(".")
    if head in ("inter", "intra", "fabric"):
        return replace(c, **{head: replace(getattr(c, head), **{tail: value})})
    if head == "resnet50_images_per_s":
        return replace(c, resnet50_images_per_s={**c.resnet50_images_per_s, tail: value})
    return replace(c, **{key: value})


def highest_bandwidth(bandwidth: float, spread: tuple[float, float] | list[float] | None) -> float:
    """The link's highest plausible bandwidth (its value, or its range's high end), in its own units:
    a per-flow range with no limit stated must reach it at its high end ("no limit" is among the
    plausible values), checked for presets (:class:`ClusterModel`) and cluster files alike."""
    return max([bandwidth, *(spread or ())])


CLUSTERS: Registry[ClusterModel] = Registry("cluster preset")

# Latencies: NCCL's own tuning model (src/graph/tuning.cc) charges ~3.4 us per ring step on NVLink
# and ~14 us per step over the network with the Simple protocol used for large messages, plus a
# base latency of ~8-17 us per call. We use those orders of magnitude for every GPU preset.
_NCCL_NVLINK_STEP_S = 3.4e-6
_NCCL_NET_STEP_S = 14e-6
_NCCL_CALL_S = 10e-6
# Their ranges. low: the same table's Low-Latency (LL) protocol figures, the fastest NCCL charges a
# ring step (NVLink 0.6 us, network 2.7 us); high: twice the Simple figures [judgement: a step
# through host memory or PCIe switches, a busy host].
_NVLINK_STEP_RANGE = (0.6e-6, 2 * _NCCL_NVLINK_STEP_S)
_NET_STEP_RANGE = (2.7e-6, 2 * _NCCL_NET_STEP_S)
# An NVLink ring's achieved bandwidth: low 80% of the link rate [judgement: what large all-reduces
# reach of NVLink after protocol overhead], high the link rate (nothing moves faster).
_NVLINK_ACHIEVED = (0.8, 1.0)
# Sparse exchange bookkeeping: the presets take the fixed cost per exchange and the selection per
# element from their device class (flashsgd.sim.device_costs: measured on an H100 / H200 and the
# 2-core VM, derived for older GPUs), and no fixed cost per round beyond the link's alpha
# (ASSUMPTION; `train --comm auto` measures both). A cluster file's defaults (a V100-class GPU,
# flashsgd.sim.cluster_file.DEFAULT_COSTS: 0.5 ms, 0.5 ns/elem) are ranged by SPARSE_RANGES.
SPARSE_RANGES = {
    # low: a handful of kernel launches (~10 us each) and one host sync [judgement]; high: 9.1 ms,
    # measured by `train --comm auto` (4 Gloo ranks on a 2-core VM, load 10; docs/planner.md).
    "exchange_fixed_s": (0.1e-3, 9.1e-3),
    # low: none beyond the link's alpha (the presets' value); high: 0.13 ms, measured by the same probe.
    "round_fixed_s": (0.0, 0.13e-3),
    # low: 0.2 ns/elem [judgement: torch.topk's radix select, a few passes over HBM]; high: the gTop-k
    # paper's measured selection, 0.154 s for ResNet-50's 25,557,032 gradients = 6.03 ns/elem
    # (Shi et al. 2019; docs/simulator.md, "The gTop-k paper's breakdown as inputs").
    "select_s_per_elem": (0.2e-9, 6.03e-9),
}
"""The plausible ranges of the sparse exchange's assumed costs (seconds; per element for selection):
the defaults of a cluster file (:mod:`flashsgd.sim.cluster_file`, a V100-class GPU); the presets
take ``round_fixed_s``'s and their device class's (:func:`device_ranges`)."""

DEVICE_INPUTS = ("exchange_fixed_s", "select_s_per_elem", "flop_s", "lowrank_s_per_elem")
"""The inputs a device class sets (:class:`flashsgd.sim.device_costs.DeviceClass`), with gamma."""


def device_fields(device: str, selection: str = "auto") -> dict:
    """:class:`ClusterModel` keyword arguments of device class ``device`` (:data:`flashsgd.sim.device_costs.DEVICES`)
    running ``selection`` (``auto``: the one the hooks resolve on it): its name, the resolved
    selection, its reduction speed (gamma from its memory bandwidth) and its compression costs."""
    d = DEVICES.get(device)
    return {"device": device, "selection": d.selection(selection), "gamma_s_per_byte": d.gamma_s_per_byte,
            **d.costs(selection)}


def device_ranges(device: str, selection: str = "auto") -> dict[str, tuple[float, float]]:
    """The assumed ranges of a preset on device class ``device``: the sparse exchange's fixed cost
    and selection and PowerSGD's costs from the class (each with its source in
    :mod:`flashsgd.sim.device_costs`), the per-round cost from :data:`SPARSE_RANGES`."""
    r = DEVICES.get(device).ranges(selection)
    return {"exchange_fixed_s": r["exchange_fixed_s"], "round_fixed_s": SPARSE_RANGES["round_fixed_s"],
            "select_s_per_elem": r["select_s_per_elem"], "flop_s": r["flop_s"],
            "lowrank_s_per_elem": r["lowrank_s_per_elem"]}


def on_device(c: ClusterModel, device: str, selection: str = "auto") -> ClusterModel:
    """``c`` on device class ``device`` running ``selection``: :func:`device_fields` in place of its
    own, and their ranges (:func:`device_ranges`) in :attr:`ClusterModel.assumed` (its other ranges
    kept). ``flashsgd plan --device/--selection``; the presets are built so.

    Example::

        >>> c = CLUSTERS.get("1gbe")
        >>> c.device, c.selection, on_device(c, "cpu").selection, on_device(c, "cpu", "exact").selection
        ('gtx1080ti', 'exact', 'sampled', 'exact')
    """
    ranges = device_ranges(device, selection)
    assumed = {**c.assumed, **{k: ranges[k] for k in DEVICE_INPUTS}}
    return replace(c, **device_fields(device, selection), assumed=assumed)
STEP_STATED = {
    # Per-step overhead: 0, nothing has measured DDP's fixed cost of a multi-GPU step on GPUs
    # (`train --comm auto` measures it where it runs: 0-0.47 ms for 4 Gloo ranks here).
    "step_overhead_s": 0.0,
    # Compute jitter, the variation of one rank's compute time across GPUs and steps: 1.5%, two
    # measured parts in quadrature (independent, so their variances add and the slowest of P ranks
    # is e(P) times their joint CV, engine.straggler_factor):
    # - from GPU to GPU, 1.2%: Sinha et al., "Not All GPUs Are Created Equal: Characterizing
    #   Variability in Large-Scale, Accelerator-Rich Systems" (arXiv 2208.11035, abstract):
    #   "8% (max 22%) average performance variation even though the GPU architecture and vendor SKU
    #   are identical within each cluster", over five computing centers (Summit, Vortex, Frontera,
    #   Longhorn, Corona), read as the spread from the slowest to the fastest GPU [judgement: the
    #   paper's definition was not read], which for normal speeds over ~1,000 GPUs [judgement: the
    #   clusters hold ~100 to ~27,000; 1.3-1.6% over that span] is 2 e(1000) = 6.5 standard
    #   deviations: 8% / 6.5 = 1.2%. The SC22 program's abstract of the same work (4 clusters,
    #   "32% (max 72%) average performance variation") is not used [judgement: the paper's own
    #   abstract, on arXiv since before the conference, gives the figures above];
    # - from step to step, 0.9%: the median of the CVs measured on an NVIDIA H100 over 20 ResNet-50
    #   steps (fp32 0.4%, bf16 0.9%, fp16 1.5%; docs/gpu.md).
    # sqrt(1.2^2 + 0.9^2) = 1.5%. Their outliers ("up to 1.5X slower than the median GPU") are not
    # in it: one such GPU in a job sets its pace.
    "jitter_cv": 0.015,
    # Per-bucket overhead: 0, DDP starts a bucket's all-reduce from the autograd hook that marks its
    # last gradient ready (no wait beyond the collective's own call cost; `train --comm auto`
    # measured 0-90 us per bucket for 4 Gloo ranks here).
    "bucket_overhead_s": 0.0,
    # Compute slowdown under overlap: s = 0.159, the average of a characterization of overlapped
    # distributed training ("Characterizing Compute-Communication Overlap in GPU-Accelerated
    # Distributed Deep Learning: Performance and Power Implications", arXiv 2507.03114, 2025,
    # abstract): "overlapping computation and communication can result in an average computational
    # slowdown of 18.9%, with a maximum of 40.0% slowdown" against compute alone ("GPT and LLaMA
    # models, across 4 A100s, H100s, MI250, and MI210", the paper's HTML version). Compute 1.189
    # times longer while overlapped is 1 / (1 - s) = 1.189 [judgement: their compute taken as
    # overlapped throughout, and their LLM training's overlap taken for a data-parallel all-reduce
    # beside backward]; their maximum is s = 0.286.
    "overlap_slowdown": 0.159,
}
"""The stated values of the step's assumed costs beyond the exchange (:attr:`ClusterModel.step_overhead_s`,
:attr:`ClusterModel.jitter_cv`, :attr:`ClusterModel.bucket_overhead_s`, :attr:`ClusterModel.overlap_slowdown`):
each a measured central figure where one was found, else 0, so that the nominal prediction is a
best estimate, not the fast end of :data:`STEP_RANGES` (docs/simulator.md, "Validation against
published figures"). Every preset's, a cluster file's defaults and what ``train --comm auto`` does
not measure."""
STEP_RANGES = {
    # Per-step overhead: low 0; high 2 ms, the order measured on an NVIDIA H100 for flashsgd's step
    # beside a plain DDP loop (70.7 vs 69.1 ms, ResNet-50 bf16 batch 256, world 1; docs/gpu.md)
    # [judgement: the same again for DDP's reducer with several ranks].
    "step_overhead_s": (0.0, 2e-3),
    # Compute jitter: low 0 (every rank as fast every step); high 3.7%: STEP_STATED's two parts at
    # their measured highs, Sinha et al.'s maximum variation 22% / 6.5 = 3.4% and the H100's fp16
    # 1.5%, sqrt(3.4^2 + 1.5^2).
    "jitter_cv": (0.0, 0.037),
    # Per-bucket overhead on the communication stream: low 0; high 5 ms, one Horovod cycle at its
    # default before v0.21 (release notes of Horovod v0.21.0: "Changed default cycle time from 5ms
    # to 1ms", horovod#2468; docs/tensor-fusion.rst: the tensors ready are fused and reduced once
    # per cycle, so a bucket ready just after a cycle began waits for the whole of it; Horovod's
    # 2017-2018 published benchmarks ran with 5 ms).
    "bucket_overhead_s": (0.0, 5e-3),
    # Compute slowdown under overlap (the fraction s of compute speed lost while an exchange runs):
    # low 0 (overlap is free: collectives on DMA engines or the host); high 0.79: Agrawal et al.
    # 2024 (AMD, "Optimizing ML Concurrent Computation and Communication with GPU DMA Engines",
    # arXiv 2412.14335, abstract): "C3 on average achieves only 21% of ideal speedup. This is so,
    # due to known challenges of compute and memory interference between concurrent GPU kernels
    # (that is, sharing of GPU's compute units, caches and HBM)" (C3: concurrent computation and
    # communication; 42% with schedule prioritization and partitioned compute units); with the
    # exchange shorter than the compute it overlaps, the model's time saved is (1 - s) of the
    # exchange, so 21% of the ideal saving is s = 0.79 [judgement: their average over GEMM +
    # collective pairs is taken as the worst a data-parallel backward sees]. Between the two an
    # NVIDIA forum report on an H100 (forums.developer.nvidia.com/t/337991): a GEMM at ~80% of peak
    # ("execution time nearly doubles, and its MFU drops to ~47%") with an ncclAllGather beside it
    # holding 24 of 132 SMs, s = 0.41-0.5.
    "overlap_slowdown": (0.0, 0.79),
}
"""The plausible ranges of the step's assumed costs beyond the exchange, around :data:`STEP_STATED`:
every preset's and a cluster file's defaults (the range's slow end holds the costs of untuned
frameworks and hosts)."""


# TCP incast (Link.incast): stated 0 on every preset (unknown without a measurement: it depends on
# the switch's buffers, the kernel's minimum retransmission timeout and the message sizes); its
# range on the TCP presets: low 0 (deep buffers, DCTCP or a fine-grained RTO: Alizadeh et al. 2010,
# Vasudevan et al. 2009); high 0.29 per extra sender = goodput down to 10% (the "up to 90%" of
# Vasudevan et al. SIGCOMM 2009 and Phanishayee et al. FAST 2008 on 1 GbE commodity switches)
# reached at 32 senders, 9 / 31 [judgement: those papers see the collapse from a handful of
# senders with 256 KB blocks, the size of Top-k's messages at density 0.001, so this is not their
# worst]. RDMA presets: none (lossless, credit-based flow control).
INCAST_RANGE = (0.0, 9.0 / 31.0)


def _rate_range(rates: dict[str, float], spread: float) -> dict[str, tuple[float, float]]:
    """``(rate x (1 - spread), rate x (1 + spread))`` for each precision's ResNet-50 throughput."""
    return {f"resnet50_images_per_s.{k}": (v * (1 - spread), v * (1 + spread)) for k, v in rates.items()}


CLUSTERS.add("abci", ClusterModel(
    name="abci",
    ranks_per_node=4,
    # 4x V100 SXM2 fully connected by NVLink2, 2 links (2 x 25 GB/s) between each pair: a ring
    # through the node moves 50 GB/s per direction per GPU.
    intra=Link(alpha_s=_NCCL_NVLINK_STEP_S, bandwidth_gbps=50.0),
    # 2x InfiniBand EDR 100 Gbit/s = 2 x 12.5 GB/s line rate; ~12 GB/s each is what RDMA achieves
    # for large messages (96% of line rate after 64b/66b encoding and headers).
    inter=Link(alpha_s=_NCCL_NET_STEP_S, bandwidth_gbps=24.0),
    call_overhead_s=_NCCL_CALL_S,
    # V100 SXM2 (900 GB/s HBM2): gamma and the compression costs (flashsgd.sim.device_costs).
    **device_fields("v100"),
    # Published single-V100 PyTorch ResNet-50 training: ~1200 images/s mixed precision, ~370 fp32.
    resnet50_images_per_s={"fp16": 1200.0, "fp32": 370.0},
    # A rack of 34 nodes (68 EDR ports) is full bisection through its leaf and FBB switches; from the
    # FBB switches to the spine (two Mellanox CS7500 directors) 24 ports' worth per rack, "1/3 of full
    # bisection (1/3 oversubscription)" (mynavi.jp, "ABCI uses an EDR InfiniBand network", the
    # system's network figure). Ranks numbered rack by rack [assumption: the papers' launchers].
    fabric=Fabric(nodes_per_switch=34, oversubscription=3.0, placement="ordered"),
    # +-1/6: docs/simulator.md's bracket for the published 1200 (1000-1400 img/s; PyTorch figures,
    # not the frameworks of the ABCI papers), the same relative spread for fp32.
    **STEP_STATED,
    assumed={**device_ranges("v100"), **STEP_RANGES, **_rate_range({"fp16": 1200.0, "fp32": 370.0}, 1 / 6),
             # NVLink2: 80-100% of 50 GB/s (_NVLINK_ACHIEVED); NCCL's NVLink step (_NVLINK_STEP_RANGE).
             "intra.bandwidth_gbps": (50.0 * _NVLINK_ACHIEVED[0], 50.0 * _NVLINK_ACHIEVED[1]),
             "intra.alpha_s": _NVLINK_STEP_RANGE,
             # 2x EDR: low 18 GB/s, 75% of the 25 GB/s line rate [judgement: two HCAs rarely both at
             # full rate, e.g. one GPU's traffic through one of them, PCIe contention]; high 25 GB/s,
             # the line rate. Alpha: NCCL's network step (_NET_STEP_RANGE). RDMA: one queue pair
             # fills the link, no per-flow limit; lossless, no incast.
             "inter.bandwidth_gbps": (18.0, 25.0), "inter.alpha_s": _NET_STEP_RANGE},
    source="ABCI node: 4x V100 SXM2 + NVLink2, 2x IB EDR; racks of 34 nodes, 3:1 to the spine; NCCL tuning-model latencies",
))

CLUSTERS.add("bigbasin-50gbe", ClusterModel(
    name="bigbasin-50gbe",
    ranks_per_node=8,
    # Facebook Big Basin (Goyal et al. 2017): 8x P100 SXM2, NVLink1 hybrid cube mesh, 20 GB/s
    # per link per direction; a ring uses one link per hop.
    intra=Link(alpha_s=_NCCL_NVLINK_STEP_S, bandwidth_gbps=20.0),
    # One 50 Gbit/s Ethernet port per server = 6.25 GB/s line rate; TCP/Gloo reaches ~90% of it
    # (5.6 GB/s) for large messages. A TCP round costs ~15 us more than RDMA: alpha 30 us.
    inter=Link(alpha_s=30e-6, bandwidth_gbps=5.6),
    call_overhead_s=_NCCL_CALL_S,
    # P100 SXM2 (732 GB/s HBM2): gamma and the compression costs (flashsgd.sim.device_costs).
    **device_fields("p100"),
    # ASSUMPTION [unverified]: P100 ResNet-50 fp32 training ~220 images/s (tf_cnn_benchmarks-class
    # figure); P100 has no tensor cores, so fp16 is taken as 1.5x at best.
    resnet50_images_per_s={"fp32": 220.0, "fp16": 330.0},
    # +-18%: docs/simulator.md's bracket of the unverified 220 (180-260 img/s) [judgement].
    **STEP_STATED,
    assumed={**device_ranges("p100"), **STEP_RANGES, **_rate_range({"fp32": 220.0, "fp16": 330.0}, 0.18),
             # NVLink1: 80-100% of 20 GB/s (_NVLINK_ACHIEVED); NCCL's NVLink step (_NVLINK_STEP_RANGE).
             "intra.bandwidth_gbps": (20.0 * _NVLINK_ACHIEVED[0], 20.0 * _NVLINK_ACHIEVED[1]),
             "intra.alpha_s": _NVLINK_STEP_RANGE,
             # 50 GbE over TCP: low 4.4 GB/s, 70% of the 6.25 GB/s line rate [judgement: Gloo's
             # pairs on busy hosts]; high 6.2 GB/s, TCP's payload share of the line with 9000-byte
             # frames (8948 / 9038 = 99%; 94% with 1500-byte frames). Alpha: low 15 us, a kernel
             # TCP round on a tuned host (half a ~30 us ping-pong) [judgement]; high 100 us [judgement:
             # a socket round trip under load, interrupt coalescing].
             "inter.bandwidth_gbps": (4.4, 6.2), "inter.alpha_s": (15e-6, 100e-6),
             # One TCP connection: the stated value is no limit (one flow fills the link); low
             # 2.5 GB/s (20 Gbit/s) [judgement: a single kernel-TCP stream bound by one core's copy
             # and interrupt work, as an untuned host shows when one iperf3 stream falls short of a
             # 40-100 GbE NIC and several streams fill it]; high the link's high end (no limit).
             "inter.flow_gbps": (2.5, 6.2),
             "inter.incast": INCAST_RANGE},
    source="Big Basin: 8x P100 + NVLink1, 50 Gbit Ethernet (Goyal et al. 2017)",
))

CLUSTERS.add("1gbe", ClusterModel(
    name="1gbe",
    ranks_per_node=1,
    # One GPU per machine; there is no intra-node level in use (kept equal to inter for safety).
    intra=Link(alpha_s=0.44e-3, bandwidth_gbps=0.111),
    # Shi et al. 2019 (gTop-k, arXiv 1901.04359) setting: alpha ~0.44 ms, ~111 MB/s on 1 Gbit/s Ethernet.
    inter=Link(alpha_s=0.44e-3, bandwidth_gbps=0.111),
    call_overhead_s=50e-6,  # Gloo/MPI over TCP: a call is a few socket round trips of setup
    # GTX 1080 Ti / P102-class GPU (GP102, ~480 GB/s): gamma and the compression costs
    # (flashsgd.sim.device_costs; the exact selection's high end is the gTop-k paper's own, 6.03 ns/elem).
    **device_fields("gtx1080ti"),
    # ASSUMPTION [unverified]: a 1080 Ti-class GPU trains ResNet-50 fp32 at ~200 images/s.
    resnet50_images_per_s={"fp32": 200.0, "fp16": 300.0},
    # +-18%, as bigbasin-50gbe's unverified rate [judgement]. The gTop-k paper's own breakdown implies
    # 13.1 img/s (64 / 4.882 s), far outside: docs/data/gtopk_paper_*.toml are that case.
    **STEP_STATED,
    assumed={**device_ranges("gtx1080ti"), **STEP_RANGES, **_rate_range({"fp32": 200.0, "fp16": 300.0}, 0.18),
             # 1 GbE over TCP: 111 MB/s is the gTop-k paper's figure for its cluster; low 90 MB/s
             # [judgement: MPI/Gloo over kernel TCP with small socket buffers, busy hosts]; high
             # 117.7 MB/s, TCP's payload at 1 Gbit/s with 1500-byte frames (1448 B per 1538 B on the
             # wire = 941 Mbit/s). Alpha: low 0.2 ms, high 1 ms [judgement: an MPI/Gloo message step
             # over TCP is one or two ~0.1 ms round trips plus library work; under load several].
             # No per-flow limit: one TCP stream fills 1 GbE (941 Mbit/s above), and with one GPU per
             # node a cap below the link would act as the low bandwidth end already does. The intra
             # level is unused (one GPU per node).
             "inter.bandwidth_gbps": (0.090, 0.1177), "inter.alpha_s": (0.2e-3, 1e-3),
             "inter.incast": INCAST_RANGE},
    source="gTop-k paper setting: 32 machines x 1 GPU, 1 Gbit/s Ethernet (alpha 0.44 ms, 111 MB/s)",
))


def _dgx(name: str, device: str, nvlink_gbps: float, nic_node_gbps: float, rates: dict[str, float],
         nodes_per_switch: int, source: str) -> ClusterModel:
    """A DGX-class node: 8 GPUs on NVSwitches (``nvlink_gbps`` per direction, every GPU to every
    other), one InfiniBand NIC per GPU (``nic_node_gbps`` per node per direction, line rate), the
    ``device`` class's gamma and compression costs (:mod:`flashsgd.sim.device_costs`).
    Stated: the NVLink rate; 96% of the NICs' line rate for large RDMA messages, as abci's EDR; the
    rates; NVIDIA's DGX SuperPOD reference layout, a rail-optimized non-blocking fat tree in scalable
    units of ``nodes_per_switch`` nodes (per node in the simulator's fabric: that many nodes per edge
    switch, 1:1 to the spine), ranks numbered node by node [assumption]. Ranged: NVLink 80-100%
    (_NVLINK_ACHIEVED) and NCCL's NVLink step; the NICs 75% of the line rate [judgement, as abci:
    HCAs not all at full rate, PCIe contention] to the line rate, NCCL's network step; RDMA: one
    queue pair fills the link, no per-flow limit, lossless; the fat tree 1:1 to 2:1 [judgement: a
    tapered spine, cheaper than the reference design]; the rates +-20% [judgement: another
    framework, a real input pipeline, another batch]."""
    return ClusterModel(
        name=name,
        ranks_per_node=8,
        intra=Link(alpha_s=_NCCL_NVLINK_STEP_S, bandwidth_gbps=nvlink_gbps),
        inter=Link(alpha_s=_NCCL_NET_STEP_S, bandwidth_gbps=0.96 * nic_node_gbps),
        call_overhead_s=_NCCL_CALL_S,
        **device_fields(device),
        resnet50_images_per_s=dict(rates),
        fabric=Fabric(nodes_per_switch=nodes_per_switch, oversubscription=1.0, placement="ordered"),
        **STEP_STATED,
        assumed={**device_ranges(device), **STEP_RANGES, **_rate_range(rates, 0.2),
                 "intra.bandwidth_gbps": (nvlink_gbps * _NVLINK_ACHIEVED[0], nvlink_gbps * _NVLINK_ACHIEVED[1]),
                 "intra.alpha_s": _NVLINK_STEP_RANGE,
                 "inter.bandwidth_gbps": (0.75 * nic_node_gbps, nic_node_gbps), "inter.alpha_s": _NET_STEP_RANGE,
                 "fabric.oversubscription": (1.0, 2.0)},
        source=source,
    )


# DGX H100's NVLink 4 ring: NVIDIA's figure is 900 GB/s per GPU "total" (both directions), 18 links
# x 25 GB/s = 450 GB/s per direction; nccl-tests on 8x H100 SXM5 report an all-reduce bus bandwidth
# of 460-480 GB/s (docs.alayanew.com, "NCCL-tests in practice", 2026: reference numbers; NCCL's
# NVLink SHARP reduces inside the NVSwitches, which the ring model does not see): stated 450, the
# link rate, ranged as every NVLink preset (_NVLINK_ACHIEVED: 360-450).
_NVLINK4_GBPS = 450.0
# 8x ConnectX-7 InfiniBand NDR, one per GPU: 8 x 400 Gbit/s = 8 x 50 GB/s = 400 GB/s per node per
# direction line rate; 96% of it after encoding and headers for large RDMA messages, as abci's EDR
# (8 x 48 = 384 GB/s).
_NDR_NODE_GBPS = 8 * 50.0
# ResNet-50 on one H100 80GB HBM3 (this project's own measurement, docs/gpu.md "Results": the plain
# PyTorch DDP loop, batch 256, channels_last, GPU-resident synthetic data, bench gpu session 1):
# 4,471 images/s fp16 (autocast), 2,439 fp32 (TF32 matmul off). NVIDIA's published H100 figures
# (MLPerf, Deep Learning Examples) were not read here. At batch 32 the same GPU is launch-bound:
# 773-830 images/s (bf16, flashsgd train; give --images-per-s for small batches).
_H100_RESNET50 = {"fp16": 4471.0, "fp32": 2439.0}

# H100 SXM5 (3.35 TB/s HBM3) on four third-generation NVSwitches; SuperPOD units of 32 nodes.
CLUSTERS.add("dgx-h100", _dgx(
    "dgx-h100", "h100", _NVLINK4_GBPS, _NDR_NODE_GBPS, _H100_RESNET50, nodes_per_switch=32,
    source="DGX H100: 8x H100 SXM5 + NVLink 4 (NVSwitch, 450 GB/s per direction), 8x IB NDR 400 Gbit/s; "
           "rail-optimized non-blocking fat tree in units of 32 nodes (assumed); NCCL tuning-model latencies"))


# DGX A100's NVLink 3: NVIDIA's figure is 600 GB/s per GPU "total" (both directions), 12 links x
# 25 GB/s = 300 GB/s per direction through six second-generation NVSwitches: stated 300, ranged as
# every NVLink preset (_NVLINK_ACHIEVED: 240-300). (A cluster file writes it as 2400 Gbit/s.)
_NVLINK3_GBPS = 300.0
# 8x ConnectX-6 InfiniBand HDR for the compute fabric, one per GPU: 8 x 200 Gbit/s = 8 x 25 GB/s =
# 200 GB/s per node per direction line rate (DGX A100 datasheet: "8x single-port Mellanox ConnectX-6
# VPI 200Gb/s HDR InfiniBand"); 96% of it for large RDMA messages, as abci's EDR (192 GB/s).
_HDR_NODE_GBPS = 8 * 25.0
# ResNet-50 v1.5 on one A100 80GB: NVIDIA DeepLearningExamples' PyTorch README, 1 GPU at batch 256
# (mixed precision, TF32), as flashsgd.sim.compute_rates.RATES holds it with its source.
_A100_RESNET50 = {p: RATES.get(f"a100/resnet50/{p}").rate for p in ("fp16", "fp32")}

# A100 SXM4 80GB (2,039 GB/s HBM2e: its compression costs derived from the H100's by memory
# bandwidth) on six NVSwitches; SuperPOD units of 20 nodes.
CLUSTERS.add("dgx-a100", _dgx(
    "dgx-a100", "a100", _NVLINK3_GBPS, _HDR_NODE_GBPS, _A100_RESNET50, nodes_per_switch=20,
    source="DGX A100: 8x A100 SXM4 80GB + NVLink 3 (NVSwitch, 300 GB/s per direction), 8x IB HDR 200 Gbit/s; "
           "rail-optimized non-blocking fat tree in units of 20 nodes (assumed); NCCL tuning-model latencies"))


def get_cluster(name: str) -> ClusterModel:
    """The preset called ``name``; ValueError listing presets (and how to get ``local``) otherwise."""
    if name == "local":
        raise ValueError(
            "cluster 'local' is fitted from a bench file: pass --calibration PATH "
            "(written by `flashsgd bench allreduce --json PATH`)"
        )
    try:
        return CLUSTERS.get(name)
    except ValueError as exc:
        raise ValueError(f"{exc}; or 'local' with --calibration PATH") from None
