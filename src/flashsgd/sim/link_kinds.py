"""What a link named in a cluster file can carry, to catch a unit mistake before it is planned with.

A cluster file gives bandwidths in Gbit/s per direction (:mod:`flashsgd.sim.cluster_file`), while
vendors quote NVLink in GB/s "total" (both directions), NICs in Gbit/s per port and PCIe in GB/s
per direction or both. A file's ``[intra]`` / ``[inter]`` table may name its link
(``kind = "nvlink3"``, ``"ib-hdr"``, ``"ethernet-100g"``, ...; ``nics = 8`` for the NICs of a node);
:func:`check_link` then warns when the value lies outside what that link can carry per direction and
names the likely mistake (a factor 8: GB/s written where Gbit/s is asked; 4: the vendors' "total"
GB/s of both directions; 16: that total halved twice; 1/2: Gbit/s of both directions), and when a
TCP link of 25 Gbit/s or more has no per-flow limit (one TCP connection rarely fills it: the
``flow_bandwidth_gbit`` key).

Example::

    >>> check_link("intra", "nvlink3", 300.0)[0][:60]
    'intra.bandwidth_gbit = 300 Gbit/s is outside what NVLink 3 ('
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

from flashsgd.registry import Registry


@dataclass(frozen=True)
class LinkKind:
    """One kind of link: its rate per direction, per GPU (intra) or per NIC (inter)."""

    title: str
    level: Literal["intra", "inter"]
    gbit: float
    """The most one GPU's links (intra) or one NIC (inter) carry per direction, Gbit/s."""
    low_gbit: float
    """The least a GPU's link of this kind carries per direction (intra: one link, a bridge), Gbit/s."""
    transport: Literal["nvlink", "pcie", "rdma", "tcp"]
    source: str
    marketed: str = ""
    """How the vendor quotes it, the figure users copy."""


LINK_KINDS: Registry[LinkKind] = Registry("link kind")

# NVLink per GPU, per direction: links x per-link rate (NVIDIA's datasheets give the "total" of
# both directions: P100 160 GB/s, V100 300, A100 600, H100 900, B200 1,800 GB/s). low: one link
# (NVLink 1, 2: a hybrid cube-mesh ring may use one), four from NVLink 3 on [judgement: bridged
# PCIe cards, e.g. the H100 NVL's 600 GB/s total = 12 links' worth].
for _name, _title, _links, _gbs, _low_links, _total in (
        ("nvlink1", "NVLink 1 (P100)", 4, 20.0, 1, 160),
        ("nvlink2", "NVLink 2 (V100)", 6, 25.0, 1, 300),
        ("nvlink3", "NVLink 3 (A100)", 12, 25.0, 4, 600),
        ("nvlink4", "NVLink 4 (H100)", 18, 25.0, 4, 900),
        ("nvlink5", "NVLink 5 (B200)", 18, 50.0, 4, 1800)):
    LINK_KINDS.add(_name, LinkKind(
        _title, "intra", _links * _gbs * 8, _low_links * _gbs * 8, "nvlink",
        f"NVIDIA datasheet: {_links} links x {_gbs:g} GB/s per direction = {_links * _gbs:g} GB/s "
        f"= {_links * _gbs * 8:g} Gbit/s per direction", f"{_total} GB/s total (both directions)"))

# PCIe x16 per direction after encoding (gen3 128b/130b: 15.75 GB/s; each generation doubles);
# low: an x4 link.
for _name, _title, _gbs in (("pcie3", "PCIe 3.0 x16", 15.75), ("pcie4", "PCIe 4.0 x16", 31.5),
                            ("pcie5", "PCIe 5.0 x16", 63.0), ("pcie6", "PCIe 6.0 x16", 121.0)):
    LINK_KINDS.add(_name, LinkKind(_title, "intra", _gbs * 8, _gbs * 2, "pcie",
                                   f"PCI-SIG: {_gbs:g} GB/s per direction for x16", f"{2 * _gbs:g} GB/s both directions"))

# NICs: the line rate per port per direction (InfiniBand FDR 4x 56, EDR 100, HDR 200, NDR 400,
# XDR 800 Gbit/s; Ethernet by its name). Ethernet kinds run TCP (Gloo, NCCL's socket transport);
# RoCE is RDMA over Ethernet.
for _name, _title, _gbit, _tr in (
        ("ib-fdr", "InfiniBand FDR", 56.0, "rdma"), ("ib-edr", "InfiniBand EDR", 100.0, "rdma"),
        ("ib-hdr", "InfiniBand HDR", 200.0, "rdma"), ("ib-ndr", "InfiniBand NDR", 400.0, "rdma"),
        ("ib-xdr", "InfiniBand XDR", 800.0, "rdma"),
        *[(f"ethernet-{g}g", f"{g} Gbit/s Ethernet (TCP)", float(g), "tcp") for g in (1, 10, 25, 40, 50, 100, 200, 400)],
        *[(f"roce-{g}g", f"{g} Gbit/s RoCE", float(g), "rdma") for g in (25, 50, 100, 200, 400)]):
    LINK_KINDS.add(_name, LinkKind(_title, "inter", _gbit, _gbit * 0.5, _tr, f"line rate {_gbit:g} Gbit/s per port",
                                   f"{_gbit:g} Gbit/s per port"))

MAX_NICS = 16
"""The most NICs a node is taken to have when ``nics`` is not given (DGX H100: 8 compute + 2 storage)."""

MISTAKES = (
    (8.0, "GB/s written where the file wants Gbit/s (x8)"),
    (4.0, "a 'total' GB/s figure of both directions, as vendors quote NVLink (x8 for bits, /2 for one direction)"),
    (16.0, "GB/s of one direction halved again (x16)"),
    (0.5, "Gbit/s of both directions (/2 for one direction)"),
)
"""(factor that makes the value right, the mistake it undoes)."""

TCP_FLOW_HINT_GBIT = 25.0
"""A TCP link at or above this rate without a per-flow limit gets a warning: one TCP connection
often carries far less. Amazon EC2 documents it ("Amazon EC2 instance network bandwidth": traffic of
one flow is limited to 5 Gbit/s outside a cluster placement group, 10 Gbit/s inside one)."""


def check_link(level: str, kind: str, gbit: float, nics: int | None = None,
               flow_given: bool = True) -> list[str]:
    """Warnings for ``level``'s ``bandwidth_gbit`` = ``gbit`` on a link of ``kind`` (:data:`LINK_KINDS`);
    ``nics``: the node's NICs (inter); ``flow_given``: whether a per-flow limit or its range is set."""
    k = LINK_KINDS.get(kind)
    if k.level != level:
        raise ValueError(f"{level}.kind = {kind!r} is a link {'between' if k.level == 'inter' else 'inside'} "
                         f"nodes: put it under [{k.level}] (kinds for [{level}]: "
                         f"{', '.join(n for n, v in LINK_KINDS.items() if v.level == level)})")
    if level == "inter":
        hi, lo = k.gbit * (nics or MAX_NICS), k.low_gbit * (nics or 1)
        what = f"{nics or f'1-{MAX_NICS}'} x {k.title} ({k.gbit:g} Gbit/s per port)"
    else:
        hi, lo, what = k.gbit, k.low_gbit, f"{k.title} ({k.source}; marketed as {k.marketed})"
    out = []
    if not lo <= gbit <= hi * 1.02:
        fixes = [(f, why) for f, why in MISTAKES if lo <= gbit * f <= hi * 1.02]
        guess = (f"; likely {fixes[0][1]}: {gbit * fixes[0][0]:g}" if fixes else "")
        out.append(f"{level}.bandwidth_gbit = {gbit:g} Gbit/s is outside what {what} carries per direction, "
                   f"{lo:g}-{hi:g} Gbit/s{guess}")
    elif level == "intra" and k.transport == "nvlink":
        total = float(k.marketed.split()[0])  # the "total" GB/s users copy
        for f, why in MISTAKES:
            if abs(gbit * f - hi) <= 0.02 * hi and abs(gbit - total) <= 0.02 * total:
                out.append(f"{level}.bandwidth_gbit = {gbit:g} is {k.title}'s marketed {k.marketed}; per "
                           f"direction in Gbit/s the full link is {hi:g} ({why})")
    if k.transport == "tcp" and k.gbit >= TCP_FLOW_HINT_GBIT and not flow_given:
        out.append(f"{level}: a {k.title} link without a per-flow limit: one TCP connection often carries far "
                   f"less than the port (Amazon EC2: 5 Gbit/s per flow outside a cluster placement group, 10 "
                   f"inside); give flow_bandwidth_gbit (Gbit/s one flow carries) or flow_bandwidth_gbit_range")
    return out
