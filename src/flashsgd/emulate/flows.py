"""Per-flow pacing on an emulated node's link: one TCP connection sends at most the flow rate.

A single TCP connection often cannot fill a node's NIC (kernel per-socket limits, one core per
stream, congestion control on long fat links); that is why several inter-node rings at once (the 2D
torus, the hierarchical all-reduce: one cross-node ring per local rank) can beat a flat ring that
puts the same bytes through the NIC (the model's side: :meth:`flashsgd.sim.network.Link.
flow_beta`, docs/simulator.md "Flows per NIC"). This module makes the emulated cluster show it.

The idiom would be the ``fq`` qdisc with ``maxrate`` (per-socket pacing), but not every kernel has
``sch_fq`` (this project's CI VM has tbf, htb, u32 and bpf only). HTB and a classic-BPF classifier
(``cls_bpf``, present wherever tc filters are) do the same with a hash, under the link's ``tbf``::

    tbf 1: (link rate)                                      on the node's veth0 egress (its upload)
     └ htb 2:
        └ 2:ffff  rate = ceil = link                        the classes below borrow from it fairly
           ├ 2:1              non-TCP (ARP...)              ceil link
           └ 2:2 .. 2:401     one per flow bucket           ceil = the flow rate

    bucket = ((TCP source port XOR destination port) AND 1023) + 2     (the BPF program, below)

Only a node's upload is paced: every packet of a flow leaves its sender through that node's
egress, so the flow's rate is bounded once; the download side keeps its tbf alone. The htb takes
the place of tbf's own queue, so the upload's queue bound is each class's default fifo (the veth's
1000 packets), not tbf's ``latency``; TCP small queues (TSQ) bound each local sender's bytes in
the qdisc to a couple of GSO packets, so the queue should stay short (its depth is not measured).

Hash collisions: two concurrent flows of a node in the same bucket share one flow's rate. With 1024
buckets and F flows sending at once from a node, P(some collision) ~ F (F - 1) / 2048 (2 flows:
0.1%, 8 flows: 2.7%). :func:`flow_bytes` reads every bucket's byte counter, so a run reports how
many flows carried its bytes (:func:`flows_seen`) and a collision shows as a count one short.

The return value of a ``cls_bpf`` program is the class id (0 = no match, -1 = the filter's own
class), and the packet starts at its Ethernet header (Linux net/sched/cls_bpf.c).
"""

from __future__ import annotations

import re
import subprocess

HTB_HANDLE = 2          # the htb under tbf 1:
ROOT_MINOR = 0xFFFF     # 2:ffff, the link-rate parent class
OTHER_MINOR = 1         # 2:1, non-TCP traffic
FIRST_FLOW_MINOR = 2    # 2:2 .. 2:(2 + BUCKETS - 1)
BUCKETS = 1024
_MASK = BUCKETS - 1

# Classic BPF opcodes (include/uapi/linux/filter.h)
_LD, _LDX, _ST, _ALU, _JMP, _RET = 0x00, 0x01, 0x02, 0x04, 0x05, 0x06
_H, _B = 0x08, 0x10
_ABS, _IND, _MEM, _MSH = 0x20, 0x40, 0x60, 0xA0
_K, _X, _A = 0x00, 0x08, 0x10
_JEQ, _ADD, _AND, _XOR = 0x10, 0x00, 0x50, 0xA0


def classid(minor: int) -> int:
    return (HTB_HANDLE << 16) | minor


def bucket_program() -> list[tuple[int, int, int, int]]:
    """The classifier, as (code, jt, jf, k) instructions: IPv4 TCP -> its flow bucket's class, else 2:1."""
    other = 13  # index of the last instruction
    prog = [
        (_LD | _H | _ABS, 0, 0, 12),                 # 0  A = EtherType
        (_JMP | _JEQ | _K, 0, other - 2, 0x0800),   # 1  not IPv4 -> other
        (_LD | _B | _ABS, 0, 0, 23),                 # 2  A = IP protocol (14 + 9)
        (_JMP | _JEQ | _K, 0, other - 4, 6),        # 3  not TCP -> other
        (_LDX | _B | _MSH, 0, 0, 14),                # 4  X = IP header length (4 * (byte 14 & 0xf))
        (_LD | _H | _IND, 0, 0, 14),                 # 5  A = source port (14 + X)
        (_ST, 0, 0, 0),                              # 6  M[0] = A
        (_LD | _H | _IND, 0, 0, 16),                 # 7  A = destination port (16 + X)
        (_LDX | _MEM, 0, 0, 0),                      # 8  X = M[0]
        (_ALU | _XOR | _X, 0, 0, 0),                 # 9  A = sport ^ dport (same for both directions)
        (_ALU | _AND | _K, 0, 0, _MASK),             # 10 A &= 1023
        (_ALU | _ADD | _K, 0, 0, classid(FIRST_FLOW_MINOR)),  # 11 A = 2:(bucket + 2)
        (_RET | _A, 0, 0, 0),                        # 12 return the class
        (_RET | _K, 0, 0, classid(OTHER_MINOR)),     # 13 other: 2:1
    ]
    assert len(prog) == other + 1
    return prog


def bytecode() -> str:
    """:func:`bucket_program` in tc's ``bpf bytecode`` syntax: ``N,code jt jf k,...``."""
    prog = bucket_program()
    return f"{len(prog)}," + ",".join(f"{c} {jt} {jf} {k}" for c, jt, jf, k in prog)


def tc_batch(dev: str, link_bps: int, flow_bps: int, burst_bytes: int) -> str:
    """The ``tc -batch`` lines that hang the per-flow classes under ``tbf 1:`` on ``dev``.

    Leaves get a guaranteed rate of link / (buckets + 1) (their sum is the link: HTB's guarantees
    must fit the parent) and borrow up to the flow rate from 2:ffff, which HTB shares among the
    busy ones in turn (fair when the flows together would exceed the link).
    """
    if not 0 < flow_bps <= link_bps:
        raise ValueError(f"flow rate must be in (0, link rate {link_bps} bit/s], got {flow_bps}")
    common = f"burst {burst_bytes} cburst {burst_bytes} quantum 65536"
    guaranteed = max(8, link_bps // (BUCKETS + 1))
    root = f"{HTB_HANDLE}:{ROOT_MINOR:x}"
    lines = [
        f"qdisc add dev {dev} parent 1:1 handle {HTB_HANDLE}: htb default {OTHER_MINOR:x}",
        f"class add dev {dev} parent {HTB_HANDLE}: classid {root} htb rate {link_bps}bit "
        f"ceil {link_bps}bit {common}",
        f"class add dev {dev} parent {root} classid {HTB_HANDLE}:{OTHER_MINOR:x} htb "
        f"rate {guaranteed}bit ceil {link_bps}bit {common}",
    ]
    lines += [f"class add dev {dev} parent {root} classid {HTB_HANDLE}:{m:x} htb rate {guaranteed}bit "
              f"ceil {flow_bps}bit {common}"
              for m in range(FIRST_FLOW_MINOR, FIRST_FLOW_MINOR + BUCKETS)]
    lines.append(f'filter add dev {dev} parent {HTB_HANDLE}: bpf bytecode "{bytecode()}"')
    return "\n".join(lines) + "\n"


def install(ns: str, dev: str, link_bps: int, flow_bps: int, burst_bytes: int) -> None:
    """Add the per-flow classes to ``dev`` in namespace ``ns`` (its root must be ``tbf`` handle 1:)."""
    proc = subprocess.run(["tc", "-n", ns, "-batch", "-"], input=tc_batch(dev, link_bps, flow_bps, burst_bytes),
                          capture_output=True, text=True, timeout=60)
    if proc.returncode != 0:
        raise RuntimeError(f"per-flow pacing on {ns}/{dev} failed (needs the kernel's htb qdisc and bpf "
                           f"classifier): {proc.stderr.strip()[-800:]}")


def flow_bytes(ns: str | None, dev: str) -> dict[int, int]:
    """Bytes sent so far by each flow bucket of ``dev`` (bucket minor -> bytes; busy buckets only)
    in namespace ``ns`` (None: this process's own, as a rank inside its node)."""
    where = ["-n", ns] if ns else []
    proc = subprocess.run(["tc", *where, "-s", "class", "show", "dev", dev],
                          capture_output=True, text=True, timeout=30)
    if proc.returncode != 0:
        raise RuntimeError(f"cannot read {ns or 'this namespace'}/{dev}'s classes: {proc.stderr.strip()}")
    return parse_class_stats(proc.stdout)


_CLASS = re.compile(rf"^class htb {HTB_HANDLE}:([0-9a-f]+) .*?\n\s*Sent (\d+) bytes", re.M)


def parse_class_stats(text: str) -> dict[int, int]:
    """Busy flow buckets in ``tc -s class show`` text (iproute2 prints no JSON for classes
    everywhere): ``class htb 2:<minor> ...`` followed by `` Sent <bytes> bytes ...``."""
    out = {}
    for minor_hex, sent in _CLASS.findall(text):
        m = int(minor_hex, 16)
        if FIRST_FLOW_MINOR <= m < FIRST_FLOW_MINOR + BUCKETS and int(sent):
            out[m] = int(sent)
    return out


def flows_seen(before: dict[int, int], after: dict[int, int], share: float = 0.05) -> int:
    """Flow buckets that sent at least ``share`` of the node's bulk bytes between two readings."""
    sent = {m: after[m] - before.get(m, 0) for m in after}
    total = sum(sent.values())
    return sum(1 for v in sent.values() if total and v >= share * total)
