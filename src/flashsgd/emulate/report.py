"""Put emulated-cluster measurements next to the network's physical limits.

Pure functions over the bench JSON schema (``meta`` + ``results`` rows with ``algorithm``,
``size_bytes``, ``time_us``), so they are tested without root.

Physical bound (Patarasuk & Yuan 2009, "Bandwidth optimal all-reduce algorithms for clusters of
workstations"): a node-level all-reduce over N nodes must move at least
``2(N-1)/N * S`` bytes through every node's link in each direction, whatever the algorithm, so

    t_min = 2(N-1)/N * S / B        (S message bytes, B link rate in bytes/s)

and ``t_min / t`` is the fraction of the link an algorithm achieves (1.0 = perfect). Ranks inside a
node share its loopback, which is not the bottleneck here.

Link usage: the probe (:mod:`flashsgd.emulate.probe`) counts the bytes each node sent and received
per operation at one size; they are linear in S for the dense algorithms (each moves fixed
fractions of the message), so ``bytes_per_payload_byte * S / t`` gives, for every measured row,

* ``node_gbps``: bits/s one node sends while the operation runs (mean over nodes), and
* ``link_gbps``: the busiest link direction's bits/s, and ``link_util`` = that / the link rate.

Wire-time prediction (:func:`wire_s`): the simulator's own cost of the row's algorithm
(:func:`flashsgd.sim.algorithms.exchange_cost`) on the emulated links alone: the inter-node link at
the tbf rate with the per-flow cap if one is set, no latency, the in-node loopback free. Its ratio
between two algorithms is what the model predicts for their measured ratio (e.g. torus2d / ring
with a per-flow cap, docs/simulator.md "Validation against the emulated cluster").

Example::

    >>> doc = {"meta": {"world": 2}, "results": [
    ...     {"algorithm": "ring", "size_bytes": 125_000_000, "time_us": 1.25e6}]}
    >>> annotate(doc, nodes=2, rate_bps=1e9)["results"][0]["emu_frac_of_bound"]
    0.8
"""

from __future__ import annotations

import math
from typing import Any

from flashsgd.exchanges import reads
from flashsgd.fmt import mib, number

def bound_s(size_bytes: float, nodes: int, rate_bps: float) -> float:
    """Minimum all-reduce time over ``nodes`` nodes with ``rate_bps`` links: 2(N-1)/N * S / B."""
    if nodes < 1 or rate_bps <= 0:
        raise ValueError(f"need nodes >= 1 and rate_bps > 0, got nodes={nodes!r}, rate_bps={rate_bps!r}")
    # bytes through each node's link per direction, over bytes/s (rate_bps / 8)
    return 2 * (nodes - 1) / nodes * size_bytes / (rate_bps / 8)


def wire_s(algorithm: str, size_bytes: float, world: int, nodes: int, rate_bps: float,
           flow_bps: float | None = None, grid: tuple[int, int] | list[int] | str | None = None,
           fabric=None) -> float | None:
    """The simulator's wire time of one dense all-reduce on the emulated links (module doc), through
    ``fabric`` (a :class:`flashsgd.sim.fabric.Fabric`: the emulated switches, :func:`emulated_fabric`;
    None: one switch); None for anything else (sparse and low-rank rows carry their own sizes, not a
    message of ``size_bytes``)."""
    from flashsgd.comm.dense import ALLREDUCE
    from flashsgd.comm.topology import parse_grid
    from flashsgd.sim.algorithms import SIMULATED, exchange_cost
    from flashsgd.sim.costs import CommSetup
    from flashsgd.sim.fabric import Fabric
    from flashsgd.sim.network import ClusterModel, Link

    if algorithm not in ALLREDUCE or algorithm not in SIMULATED:
        return None
    free = Link(0.0, 1e9)  # loopback: taken as free (1e18 B/s)
    inter = Link(0.0, rate_bps / 8e9, None if flow_bps is None else flow_bps / 8e9)
    cluster = ClusterModel("emulated", world // nodes, free, inter, fabric=fabric or Fabric(), backend="gloo")
    if grid and reads(algorithm, "grid"):  # meta.grid: "XxY" (bench allreduce) or [X, Y] (the probe)
        grid = parse_grid(grid if isinstance(grid, str) else tuple(grid), world)
    setup = CommSetup(world, cluster, grid=grid if reads(algorithm, "grid") else None)
    return float(exchange_cost(algorithm, size_bytes, setup).total)


def emulated_fabric(nodes: int, switches: int, rate_bps: float, uplink_bps: float, placement: str):
    """The simulator's :class:`~flashsgd.sim.fabric.Fabric` of an emulated cluster of ``nodes`` nodes
    on ``switches`` edge switches of ``n = nodes / switches`` each (:func:`flashsgd.emulate.netns.switch_of`,
    the same layouts): a switch's nodes send ``n x rate_bps`` into an uplink of ``uplink_bps``, an
    oversubscription of ``n rate / uplink`` (at least 1); None with one switch."""
    from flashsgd.sim.fabric import Fabric

    if switches <= 1:
        return None
    if nodes % switches:
        raise ValueError(f"switches must divide the {nodes} nodes (as the emulator builds them), got {switches}")
    per_switch = nodes // switches
    return Fabric(nodes_per_switch=per_switch, oversubscription=max(1.0, per_switch * rate_bps / uplink_bps),
                  placement=placement)


def bytes_per_payload_byte(probe_doc: dict | None) -> dict[str, dict[str, float]]:
    """From a probe file: per algorithm, link bytes per message byte (mean node tx, busiest link)."""
    out: dict[str, dict[str, float]] = {}
    for row in (probe_doc or {}).get("results", []):
        tx, rx, size = row.get("node_tx_bytes"), row.get("node_rx_bytes"), row["size_bytes"]
        if not tx or not rx:
            continue
        out[row["algorithm"]] = {"node_tx": sum(tx) / len(tx) / size,
                                 "busiest": max(max(tx), max(rx)) / size}
    return out


def _size_and_time(row: dict, meta: dict) -> tuple[float, float] | None:
    """(message bytes, seconds) of a row: dense bench rows (``size_bytes``, ``time_us``) or sparse
    bench rows (``e2e_ms``, gradient of ``meta.config.numel`` fp32 elements)."""
    size, t_us = row.get("size_bytes"), row.get("time_us")
    if size is None and "e2e_ms" in row:
        numel = meta.get("config", {}).get("numel")
        size, t_us = (numel * 4 if isinstance(numel, int) else None), row["e2e_ms"] * 1e3
    if not isinstance(size, (int, float)) or not isinstance(t_us, (int, float)) or t_us <= 0:
        return None
    return float(size), t_us * 1e-6


def annotate(doc: dict, nodes: int, rate_bps: float, probe_doc: dict | None = None,
             flow_bps: float | None = None, fabric=None) -> dict:
    """Add ``emu_*`` fields (bound, fraction of it, the simulator's wire time through ``fabric``,
    link usage, algbw, busbw) to every timed row; the bound and the link usage are the nodes' links'.

    Link usage comes from the probe's measured bytes per message byte (dense algorithms), else from
    the row's own ``bytes_per_rank`` (the sparse bench's count) times the ranks per node, which is
    exact with one rank per node and an upper bound otherwise (``emu_bytes_source`` says which).
    """
    meta = doc.get("meta", {})
    world = int(meta.get("world", nodes))
    rpn = max(1, world // max(1, nodes))
    ratios = bytes_per_payload_byte(probe_doc)
    for row in doc.get("results", []):
        st = _size_and_time(row, meta)
        if st is None:
            continue
        size, t = st
        if "size_bytes" in row:
            row.setdefault("algbw_gbps", size / t / 1e9)  # nccl-tests: GB/s, GB = 1e9 B
            row.setdefault("busbw_gbps", row["algbw_gbps"] * 2 * (world - 1) / world)
        b = bound_s(size, nodes, rate_bps)
        row["emu_bound_us"] = b * 1e6
        row["emu_frac_of_bound"] = b / t if nodes > 1 else None
        if "size_bytes" in row and nodes > 1:
            wire = wire_s(row.get("algorithm", ""), size, world, nodes, rate_bps, flow_bps, meta.get("grid"), fabric)
            if wire is not None:
                row["emu_wire_us"] = wire * 1e6
        r = ratios.get(row.get("algorithm"))
        if r:
            node_tx, busiest, source = r["node_tx"] * size, r["busiest"] * size, "measured (probe)"
        elif isinstance(row.get("bytes_per_rank"), (int, float)):
            node_tx = busiest = row["bytes_per_rank"] * rpn
            source = "bench bytes_per_rank x ranks per node"
        else:
            continue
        row["emu_bytes_source"] = source
        row["emu_node_tx_bytes"] = node_tx
        row["emu_node_gbps"] = node_tx * 8 / t / 1e9
        row["emu_link_bytes"] = busiest
        row["emu_link_gbps"] = busiest * 8 / t / 1e9
        row["emu_link_util"] = row["emu_link_gbps"] * 1e9 / rate_bps
    return doc


def _fmt(value: Any, spec: str) -> str:
    if value is None or (isinstance(value, float) and math.isnan(value)):
        return "-"
    return format(value, spec)


def format_table(doc: dict) -> str:
    """nccl-tests-like columns plus the bound, the fraction of it, and link usage (sizes in MiB,
    2**20 bytes, as ``bench allreduce --sizes 1M``; rates in GB/s and Gbit/s, 1e9, as nccl-tests)."""
    head = (f"{'algorithm':>12} {'size_MiB':>9} {'time_ms':>10} {'algbw_GB/s':>10} {'busbw_GB/s':>10} "
            f"{'bound_ms':>9} {'of_bound':>8} {'wire_ms':>9} {'link_B/B':>8} {'node_Gb/s':>9} "
            f"{'link_Gb/s':>9} {'util':>5} {'flows':>7}")
    lines = [head]
    for row in doc.get("results", []):
        if "emu_bound_us" not in row:
            continue
        size, t = _size_and_time(row, doc.get("meta", {}))
        per_byte = row["emu_link_bytes"] / size if "emu_link_bytes" in row else None
        sparse = row.get("density", 1.0) < 1.0  # a sparse exchange is named with its density
        name = row["algorithm"] + (f"@{row['density']:g}" if sparse else "")
        # flows that carried the upload of each node (per-flow cap only): min-max over nodes
        counts = [c for c in row.get("node_flows") or [] if c is not None]
        flows = "-" if not counts else (f"{min(counts)}" if min(counts) == max(counts)
                                        else f"{min(counts)}-{max(counts)}")
        lines.append(
            f"{name:>12} {number(mib(size)):>9} {t * 1e3:10.2f} "
            f"{_fmt(row.get('algbw_gbps'), '10.4f')} {_fmt(row.get('busbw_gbps'), '10.4f')} "
            f"{row['emu_bound_us'] / 1e3:9.2f} "
            f"{_fmt(row['emu_frac_of_bound'], '8.3f')} "
            f"{_fmt(row.get('emu_wire_us', math.nan) / 1e3, '9.2f')} {_fmt(per_byte, '8.3f')} "
            f"{_fmt(row.get('emu_node_gbps'), '9.3f')} {_fmt(row.get('emu_link_gbps'), '9.3f')} "
            f"{_fmt(row.get('emu_link_util'), '5.2f')} {flows:>7}")
    return "\n".join(lines)
