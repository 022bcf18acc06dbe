"""Build and tear down an emulated cluster: one network namespace per node, bandwidth-capped links.

Loopback has no network bottleneck; Linux network namespaces give one machine real, rate-limited
links. Every object lives in namespaces this module creates; the host's own interfaces,
addresses and routes are never touched::

    namespace <prefix>-br :  bridge br0 -- n0, n1, ... n{N-1}     (the "switch", its own namespace)
    namespace <prefix>-n<i>:  lo, veth0 = <subnet>.<i+1>/24        (node i; its ranks run here)
    veth pair: veth0 (node i)  <->  n<i> (switch port)
    tbf on veth0 egress caps node i's upload, tbf on n<i> egress caps its download
    with a flow rate: under veth0's tbf, each TCP flow capped at that rate (:mod:`.flows`)

With ``switches`` S > 1 (a fabric beyond the NICs: edge switches joined through a core, each
edge switch's uplink capped at ``uplink_bps``; oversubscribed when that is less than its nodes'
links together)::

    namespace <prefix>-core :  bridge br0 -- s0, s1, ... s{S-1}     (the core switch)
    namespace <prefix>-sw<j>:  bridge br0 -- uplink, and n<i> for each node i on edge switch j
    veth pair: uplink (edge switch j)  <->  s<j> (core port); tbf at uplink_bps on both ends' egress
    node i's veth goes to edge switch j = switch_of(i): ``ordered`` i // (N / S) (consecutive
    nodes share a switch), ``interleaved`` i % S

One L2 segment throughout (bridges, no routing): node addresses are the same as with one switch.
A flow between two nodes of one edge switch stays inside it; any other crosses two uplinks.

Ranks on the same node talk over the node's own loopback (local delivery), as on a real machine;
only inter-node traffic crosses the capped link. ``<prefix>`` is ``fsgdemu-<pid>``, so a setup left
by a crashed run is recognised (its pid is gone) and removed by :func:`clean_stale`.

Algorithm (:func:`build`):

1. Check root and iproute2 (``ip``, ``tc``); remove stale setups of dead runs.
2. Create the switch namespace and its bridge. With S > 1 switches: the core's namespace and
   bridge, then for each edge switch its namespace and bridge and its uplink, a veth pair from
   the edge bridge to a core port, both ends shaped with ``tbf`` at ``uplink_bps``
   (:func:`_shape`, the node links' queue rule).
3. For each node: create its namespace, a veth pair with one end in the node's namespace and
   one in its (edge) switch's, the address, bring links up, attach the switch end to the bridge.
4. Shape both ends with ``tbf`` at the link rate (:func:`_shape`); with ``flow_rate_bps``, pace
   each flow of the node's upload (:func:`flashsgd.emulate.flows.install`).

:func:`teardown` kills what still runs inside the namespaces and deletes them; deleting a namespace
deletes its veth ends, the bridges and the qdiscs with it. Every namespace (nodes, switches,
core) is named ``<prefix>-...``, so :func:`teardown` and :func:`clean_stale` find all of them.

Example::

    >>> spec = ClusterSpec(nodes=2, ranks_per_node=2, rate_bps=parse_rate("200mbit"))
    >>> with emulated_cluster(spec) as cluster:        # doctest: +SKIP
    ...     print(cluster.node_ns[0], cluster.node_ip[0])
    fsgdemu-1234-n0 10.213.0.1
"""

from __future__ import annotations

import contextlib
import ipaddress
import json
import os
import re
import shutil
import signal
import subprocess
import threading
from dataclasses import dataclass, field
from typing import Iterator

import numpy as np

from flashsgd.emulate import flows
from flashsgd.sim.fabric import PLACEMENTS, node_switches

NAME_PREFIX = "fsgdemu"
NODE_IFNAME = "veth0"
BRIDGE = "br0"
UPLINK_IFNAME = "uplink"
"""An edge switch's end of its uplink (the core's end is ``s<j>``)."""
_RATE_UNITS = {"bit": 1, "kbit": 10**3, "mbit": 10**6, "gbit": 10**9, "tbit": 10**12}


class EmulationUnavailable(RuntimeError):
    """Root or iproute2 (``ip``, ``tc``) or network namespaces are missing on this machine."""


def parse_rate(text: str | int | float) -> int:
    """Link rate in bits/s from ``"1gbit"``, ``"200mbit"``, ``"25gbit"`` or a number of bits/s.

    Units are SI like ``tc``'s (1gbit = 1e9 bit/s).
    """
    if isinstance(text, (int, float)) and not isinstance(text, bool):
        value = float(text)
    else:
        m = re.fullmatch(r"\s*([0-9]*\.?[0-9]+)\s*([a-zA-Z]*)\s*", str(text))
        unit = m.group(2).lower() if m else ""
        if not m or unit not in _RATE_UNITS | {"": 1}:
            raise ValueError(f"link rate must look like '1gbit', '200mbit' or '10gbit' "
                             f"(units {', '.join(_RATE_UNITS)}), got {text!r}")
        value = float(m.group(1)) * _RATE_UNITS.get(unit, 1)
    if value < 1e5:
        raise ValueError(f"link rate must be at least 100kbit, got {text!r} ({value:g} bit/s)")
    return int(value)


def parse_flow_rate(text: str | None, link_bps: int) -> int | None:
    """``--flow-rate`` at a link of ``link_bps``: bits/s one flow may send (None: no cap). ``text``
    is a rate as ``--link`` (:func:`flashsgd.emulate.netns.parse_rate`) or a fraction ``A/B`` of
    the link in (0, 1]; ValueError naming what is wrong and what is valid, also for a rate above
    the link's."""
    if text is None:
        return None
    m = re.fullmatch(r"\s*(\d+)\s*/\s*(\d+)\s*", text)
    if m:
        a, b = int(m.group(1)), int(m.group(2))
        if not 0 < a <= b:
            raise ValueError(f"--flow-rate {text!r}: a fraction of the link must be in (0, 1], such as 1/4")
        rate = link_bps * a // b
    else:
        try:
            rate = parse_rate(text)
        except ValueError as exc:
            raise ValueError(f"--flow-rate: {exc}, or a fraction of the link such as 1/4") from None
    if rate > link_bps:
        raise ValueError(f"--flow-rate {text} ({rate / 1e6:g} Mbit/s) is above the link rate "
                         f"({link_bps / 1e6:g} Mbit/s): one flow cannot send faster than its link; valid: "
                         f"at most the link rate, or a fraction of it such as 1/4")
    try:
        return parse_rate(rate)
    except ValueError as exc:  # a fraction of a slow link below tc's smallest rate
        raise ValueError(f"--flow-rate {text} at a {link_bps / 1e6:g} Mbit/s link: {exc}") from None


def parse_shape(text: str) -> tuple[int, int]:
    """``"4x2"`` -> (4 nodes, 2 ranks per node)."""
    m = re.fullmatch(r"\s*(\d+)\s*[xX]\s*(\d+)\s*", str(text))
    if not m or int(m.group(1)) < 1 or int(m.group(2)) < 1:
        raise ValueError(f"emulated cluster shape must be NODESxRANKS such as '4x2', got {text!r}")
    return int(m.group(1)), int(m.group(2))


@dataclass(frozen=True)
class ClusterSpec:
    """What to emulate."""

    nodes: int
    """Number of nodes (network namespaces), 1..200."""
    ranks_per_node: int
    """Ranks started in each node's namespace."""
    rate_bps: int
    """Each node's link rate in bits/s, both directions (full duplex), e.g. 1_000_000_000."""
    subnet: str = "10.213.0.0/24"
    """Private /24 assigned only to the namespaces' veths (node i gets host address i+1)."""
    latency_ms: float = 20.0
    """tbf queue length expressed as the time to drain it at the link rate (with ``flow_rate_bps``
    the upload's queue is the per-flow classes' instead, :mod:`flashsgd.emulate.flows`)."""
    flow_rate_bps: int | None = None
    """The most one TCP flow (connection) sends from a node, bits/s (<= rate_bps); None: one flow
    can fill the link."""
    switches: int = 1
    """Edge switches, 1..nodes; 1: every node on one switch (no uplinks, the layout of old)."""
    uplink_bps: int | None = None
    """Each edge switch's uplink to the core, bits/s, both directions; required when switches > 1,
    None otherwise."""
    placement: str = "ordered"
    """Which switch node i is on (:func:`switch_of`): ``ordered``, ``interleaved`` or ``random``."""
    placement_seed: int = 0
    """``random``: the seed of the shuffle of the nodes over the switches (one placement per seed)."""

    def __post_init__(self) -> None:
        if not isinstance(self.nodes, int) or not 1 <= self.nodes <= 200:
            raise ValueError(f"nodes must be an integer in 1..200, got {self.nodes!r}")
        if not isinstance(self.ranks_per_node, int) or self.ranks_per_node < 1:
            raise ValueError(f"ranks_per_node must be an integer >= 1, got {self.ranks_per_node!r}")
        parse_rate(self.rate_bps)
        if self.flow_rate_bps is not None and not (parse_rate(self.flow_rate_bps) <= self.rate_bps):
            raise ValueError(f"the flow rate ({self.flow_rate_bps} bit/s) must not exceed the link rate "
                             f"({self.rate_bps} bit/s); leave it unset for flows that can fill the link")
        net = ipaddress.ip_network(self.subnet, strict=True)
        if net.version != 4 or net.prefixlen != 24 or not net.is_private:
            raise ValueError(f"subnet must be a private IPv4 /24 such as '10.213.0.0/24', got {self.subnet!r}")
        if (not isinstance(self.switches, int) or isinstance(self.switches, bool)
                or not 1 <= self.switches <= self.nodes):
            raise ValueError(f"switches must be an integer in 1..nodes (1..{self.nodes}), got {self.switches!r}")
        if self.nodes % self.switches:
            valid = ", ".join(str(d) for d in range(1, self.nodes + 1) if self.nodes % d == 0)
            raise ValueError(f"switches must divide the {self.nodes} nodes (every edge switch holds as many, "
                             f"as the simulator's Fabric has it), got {self.switches}; valid: {valid}")
        if self.placement not in PLACEMENTS:
            raise ValueError(f"placement must be one of {', '.join(PLACEMENTS)}, got {self.placement!r}")
        if not isinstance(self.placement_seed, int) or isinstance(self.placement_seed, bool) or self.placement_seed < 0:
            raise ValueError(f"placement_seed must be an integer >= 0, got {self.placement_seed!r}")
        if self.switches > 1 and self.uplink_bps is None:
            raise ValueError(f"uplink_bps (each edge switch's uplink rate, bits/s) is required with "
                             f"switches > 1 (got switches={self.switches}); valid: a rate of at least 100kbit")
        if self.switches == 1 and self.uplink_bps is not None:
            raise ValueError(f"uplink_bps applies only with switches > 1 (one switch has no uplink), got "
                             f"uplink_bps={self.uplink_bps!r} with switches=1; valid: None, or switches in "
                             f"2..{self.nodes}")
        if self.uplink_bps is not None:
            parse_rate(self.uplink_bps)

    @property
    def world_size(self) -> int:
        return self.nodes * self.ranks_per_node

    @property
    def burst_bytes(self) -> int:
        return burst_bytes(self.rate_bps)


def burst_bytes(rate_bps: int) -> int:
    """tbf bucket of a link of ``rate_bps``: at least two 64 KiB GSO super-packets (veth hands tbf
    unsegmented GSO packets), and at least 1 ms at the line rate: rate_bps / 8 B/s * 1e-3 s."""
    return max(2 * 65536, rate_bps // 8 // 1000)


def switch_of(node: int, spec: ClusterSpec) -> int:
    """The edge switch of node ``node`` (0-based): ``ordered`` node // (nodes / switches)
    (consecutive nodes share a switch), ``interleaved`` node % switches (the simulator's layouts,
    :class:`flashsgd.sim.fabric.Fabric`; ``switches`` divides ``nodes``), ``random`` its position in
    a shuffle of the nodes seeded by ``placement_seed``, // (nodes / switches) (one placement of the
    kind the simulator's ``random`` averages over). Always 0 with one switch.

    >>> [switch_of(i, ClusterSpec(4, 1, 10**8, switches=2, uplink_bps=10**8)) for i in range(4)]
    [0, 0, 1, 1]
    """
    if not isinstance(node, int) or not 0 <= node < spec.nodes:
        raise ValueError(f"node must be an integer in 0..{spec.nodes - 1}, got {node!r}")
    return switch_layout(spec)[node]


def switch_layout(spec: ClusterSpec) -> list[int]:
    """The edge switch of every node (:func:`switch_of`), from the simulator's own rule,
    :func:`flashsgd.sim.fabric.node_switches` (``random``: its shuffle drawn from ``placement_seed``)."""
    rng = np.random.default_rng(spec.placement_seed)
    return node_switches(spec.nodes, spec.nodes // spec.switches, spec.placement, rng).tolist()


@dataclass
class EmulatedCluster:
    """A built emulated cluster: namespace names and addresses, node i at index i."""

    spec: ClusterSpec
    prefix: str
    switch_ns: str
    """The switch's namespace; with several switches, the core's."""
    node_ns: list[str] = field(default_factory=list)
    node_ip: list[str] = field(default_factory=list)
    ifname: str = NODE_IFNAME
    edge_ns: list[str] = field(default_factory=list)
    """Edge switch j's namespace at index j (one switch: ``[switch_ns]``)."""

    def port_ns(self, node: int) -> str:
        """The namespace holding node ``node``'s switch port ``n<node>``."""
        return self.edge_ns[switch_of(node, self.spec)] if self.spec.switches > 1 else self.switch_ns

    def link_bytes(self) -> list[dict[str, int]]:
        """Bytes each node has sent and received over its link so far, read at the switch ports.

        The switch port ``n<i>`` receives what node i transmits (``tx``) and transmits what it
        receives (``rx``).
        """
        ports = {}
        for ns in dict.fromkeys(self.port_ns(i) for i in range(self.spec.nodes)):
            ports[ns] = {d["ifname"]: d["stats64"] for d in _ip_json(["-n", ns, "-s", "link", "show"])
                         if "stats64" in d}
        return [{"tx_bytes": int(ports[self.port_ns(i)][f"n{i}"]["rx"]["bytes"]),
                 "rx_bytes": int(ports[self.port_ns(i)][f"n{i}"]["tx"]["bytes"])}
                for i in range(self.spec.nodes)]

    def uplink_bytes(self) -> list[dict[str, int]]:
        """Bytes each edge switch has sent to the core (``tx``) and received from it (``rx``) so
        far, read at the core ports ``s<j>``; empty with one switch."""
        if self.spec.switches == 1:
            return []
        ports = {d["ifname"]: d["stats64"] for d in _ip_json(["-n", self.switch_ns, "-s", "link", "show"])
                 if "stats64" in d}
        return [{"tx_bytes": int(ports[f"s{j}"]["rx"]["bytes"]),
                 "rx_bytes": int(ports[f"s{j}"]["tx"]["bytes"])}
                for j in range(self.spec.switches)]


def _run(cmd: list[str], check: bool = True) -> subprocess.CompletedProcess:
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=30)
    if check and proc.returncode != 0:
        raise RuntimeError(f"command failed ({proc.returncode}): {' '.join(cmd)}\n{proc.stderr.strip()}")
    return proc


def _ip_json(args: list[str]) -> list[dict]:
    return json.loads(_run(["ip", "-j", *args]).stdout or "[]")


def check_available() -> None:
    """Raise :class:`EmulationUnavailable` saying what is missing (root, ``ip``, ``tc``, netns)."""
    if os.geteuid() != 0:
        raise EmulationUnavailable("the emulated cluster needs root (network namespaces, tc); "
                                   f"running as uid {os.geteuid()}")
    missing = [t for t in ("ip", "tc") if shutil.which(t) is None]
    if missing:
        raise EmulationUnavailable(f"the emulated cluster needs iproute2; missing {', '.join(missing)} "
                                   "(install with scripts/install_iproute2.sh)")
    probe = f"{NAME_PREFIX}-{os.getpid()}-probe"  # stale-cleanable name
    made = subprocess.run(["ip", "netns", "add", probe], capture_output=True, text=True, timeout=30)
    subprocess.run(["ip", "netns", "delete", probe], capture_output=True, timeout=30)
    if made.returncode != 0:
        raise EmulationUnavailable(f"cannot create network namespaces here: {made.stderr.strip()}")


def list_namespaces(prefix: str = NAME_PREFIX) -> list[str]:
    """Names of existing namespaces made by this module (``prefix`` narrows to one run)."""
    out = _run(["ip", "netns", "list"]).stdout.split("\n")
    names = [line.split()[0] for line in out if line.strip()]
    return [n for n in names if n == prefix or n.startswith(prefix + "-")]


def _pid_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def _kill_inside(ns: str) -> None:
    """Kill the processes still running inside namespace ``ns`` (only our ranks ever run there)."""
    pids = _run(["ip", "netns", "pids", ns], check=False).stdout.split()
    for pid in pids:
        with contextlib.suppress(ProcessLookupError, ValueError):
            os.kill(int(pid), signal.SIGKILL)


def teardown(prefix: str) -> list[str]:
    """Delete every namespace of the run ``prefix`` (and the links, bridge, qdiscs in them)."""
    names = list_namespaces(prefix)
    for ns in names:
        _kill_inside(ns)
    for ns in names:
        _run(["ip", "netns", "delete", ns], check=False)
    left = list_namespaces(prefix)
    if left:
        raise RuntimeError(f"teardown left namespaces behind: {left}")
    return names


def clean_stale() -> list[str]:
    """Remove setups of runs whose process is gone (a crash or SIGKILL); returns what was removed."""
    removed = []
    runs = {m.group(1) for n in list_namespaces()
            if (m := re.match(rf"({NAME_PREFIX}-(\d+))-", n)) and not _pid_alive(int(m.group(2)))}
    for run in sorted(runs):
        removed += teardown(run)
    return removed


def _shape(ns: str, dev: str, rate_bps: int, spec: ClusterSpec, handle: str | None = None) -> None:
    """Cap ``dev``'s egress in namespace ``ns`` at ``rate_bps`` with ``tbf``: bucket
    :func:`burst_bytes` of the rate, queue ``spec.latency_ms`` at the rate (every shaped link, the
    nodes' and the uplinks', follows this one rule); ``handle`` names the root qdisc."""
    _run(["tc", "-n", ns, "qdisc", "add", "dev", dev, "root", *(["handle", handle] if handle else []),
          "tbf", "rate", f"{rate_bps}bit", "burst", str(burst_bytes(rate_bps)),
          "latency", f"{spec.latency_ms:g}ms"])


def build(spec: ClusterSpec, prefix: str | None = None) -> EmulatedCluster:
    """Create the namespaces, bridges, veths, addresses and tbf shaping of ``spec`` (see module doc).

    On any failure the partial setup is torn down before the error propagates.
    """
    # Step 1: preconditions, and leftovers of crashed runs
    check_available()
    clean_stale()
    prefix = prefix or f"{NAME_PREFIX}-{os.getpid()}"
    if list_namespaces(prefix):
        raise RuntimeError(f"an emulated cluster named {prefix!r} already exists; tear it down first")
    net = ipaddress.ip_network(spec.subnet)
    fabric = spec.switches > 1
    cluster = EmulatedCluster(spec, prefix, switch_ns=f"{prefix}-core" if fabric else f"{prefix}-br")
    try:
        # Step 2: the switch (one), or the core, the edge switches and their uplinks
        _bridge(cluster.switch_ns)
        if not fabric:
            cluster.edge_ns.append(cluster.switch_ns)
        for j in range(spec.switches if fabric else 0):
            edge, core_port = f"{prefix}-sw{j}", f"s{j}"
            _bridge(edge)
            cluster.edge_ns.append(edge)
            _run(["ip", "link", "add", UPLINK_IFNAME, "netns", edge, "type", "veth",
                  "peer", "name", core_port, "netns", cluster.switch_ns])
            for ns, dev in ((edge, UPLINK_IFNAME), (cluster.switch_ns, core_port)):
                _run(["ip", "-n", ns, "link", "set", dev, "master", BRIDGE])
                _run(["ip", "-n", ns, "link", "set", dev, "up"])
                _shape(ns, dev, spec.uplink_bps, spec)
        for i in range(spec.nodes):
            # Step 3: node i, its veth pair and address
            ns, port, ip = f"{prefix}-n{i}", f"n{i}", str(net.network_address + i + 1)
            sw = cluster.port_ns(i)
            _run(["ip", "netns", "add", ns])
            cluster.node_ns.append(ns)
            cluster.node_ip.append(ip)
            _run(["ip", "link", "add", NODE_IFNAME, "netns", ns, "type", "veth",
                  "peer", "name", port, "netns", sw])
            _run(["ip", "-n", ns, "addr", "add", f"{ip}/{net.prefixlen}", "dev", NODE_IFNAME])
            _run(["ip", "-n", ns, "link", "set", "lo", "up"])
            _run(["ip", "-n", ns, "link", "set", NODE_IFNAME, "up"])
            _run(["ip", "-n", sw, "link", "set", port, "master", BRIDGE])
            _run(["ip", "-n", sw, "link", "set", port, "up"])
            # Step 4: cap both directions of node i's link
            _shape(ns, NODE_IFNAME, spec.rate_bps, spec, handle="1:")
            if spec.flow_rate_bps is not None:
                flows.install(ns, NODE_IFNAME, spec.rate_bps, spec.flow_rate_bps, spec.burst_bytes)
            _shape(sw, port, spec.rate_bps, spec)
    except BaseException:
        with _interrupts_deferred():
            teardown(prefix)
        raise
    return cluster


def _bridge(ns: str) -> None:
    """Create namespace ``ns`` holding bridge :data:`BRIDGE`, up."""
    _run(["ip", "netns", "add", ns])
    _run(["ip", "-n", ns, "link", "add", BRIDGE, "type", "bridge"])
    _run(["ip", "-n", ns, "link", "set", BRIDGE, "up"])


@contextlib.contextmanager
def emulated_cluster(spec: ClusterSpec, prefix: str | None = None) -> Iterator[EmulatedCluster]:
    """Build the cluster, yield it, and ALWAYS tear it down (errors, Ctrl-C, SIGTERM, SIGHUP).

    SIGTERM and SIGHUP are turned into ``SystemExit`` while the cluster exists (in the main thread),
    so ``finally`` runs instead of the process dying with the namespaces still there; Ctrl-C
    (``KeyboardInterrupt``) unwinds the same way, and a second Ctrl-C during the teardown is ignored.
    """
    handlers = {}
    if _in_main_thread():
        def _exit(signum, frame):  # noqa: ARG001 - signal handler signature
            raise SystemExit(128 + signum)
        for sig in (signal.SIGTERM, signal.SIGHUP):
            handlers[sig] = signal.signal(sig, _exit)
    cluster = None
    try:
        cluster = build(spec, prefix)
        yield cluster
    finally:
        try:
            if cluster is not None:
                with _interrupts_deferred():
                    teardown(cluster.prefix)
        finally:
            for sig, old in handlers.items():
                signal.signal(sig, old)


def _in_main_thread() -> bool:
    return threading.current_thread() is threading.main_thread()


@contextlib.contextmanager
def _interrupts_deferred() -> Iterator[None]:
    """Ignore SIGINT inside the block (main thread only): a teardown is never left half done."""
    if not _in_main_thread():
        yield
        return
    old = signal.signal(signal.SIGINT, signal.SIG_IGN)
    try:
        yield
    finally:
        signal.signal(signal.SIGINT, old)
