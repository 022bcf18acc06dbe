"""Per-flow pacing on the emulated cluster (issue 25): the classifier, the tc lines, the flow count,
the simulator's wire time; and, as root, one flow held to its rate while two go twice as fast."""

from __future__ import annotations

import argparse
import json
import os
import re
import struct

import pytest

from flashsgd.emulate import flows, netns
from flashsgd.emulate.netns import ClusterSpec, parse_rate
from flashsgd.emulate.report import annotate, format_table, wire_s
from netns_helpers import needs_netns


def run_cbpf(prog: list[tuple[int, int, int, int]], pkt: bytes) -> int:
    """A classic-BPF interpreter for the opcodes the classifier uses (include/uapi/linux/filter.h)."""
    a = x = pc = 0
    mem = [0] * 16
    while True:
        code, jt, jf, k = prog[pc]
        pc += 1
        if code == 0x28:                       # ldh [k]
            a = struct.unpack_from(">H", pkt, k)[0]
        elif code == 0x30:                     # ldb [k]
            a = pkt[k]
        elif code == 0x48:                     # ldh [x + k]
            a = struct.unpack_from(">H", pkt, x + k)[0]
        elif code == 0xB1:                     # ldx 4 * ([k] & 0xf)
            x = 4 * (pkt[k] & 0xF)
        elif code == 0x02:                     # st M[k]
            mem[k] = a
        elif code == 0x61:                     # ldx M[k]
            x = mem[k]
        elif code == 0xAC:                     # xor x
            a ^= x
        elif code == 0x54:                     # and #k
            a &= k
        elif code == 0x04:                     # add #k
            a = (a + k) & 0xFFFFFFFF
        elif code == 0x15:                     # jeq #k
            pc += jt if a == k else jf
        elif code == 0x16:                     # ret a
            return a
        elif code == 0x06:                     # ret #k
            return k
        else:
            raise AssertionError(f"opcode {code:#x} not in the interpreter")


def packet(ethertype: int = 0x0800, proto: int = 6, sport: int = 40000, dport: int = 29500,
           ihl: int = 5) -> bytes:
    eth = b"\x00" * 12 + struct.pack(">H", ethertype)
    ip = bytes([0x40 | ihl, 0]) + b"\x00" * 7 + bytes([proto]) + b"\x00" * (4 * ihl - 10)
    return eth + ip + struct.pack(">HH", sport, dport) + b"\x00" * 16


def test_classifier_puts_each_tcp_flow_in_its_bucket_and_the_rest_in_2_1():
    prog = flows.bucket_program()
    bucket = lambda s, d: (2 << 16) | (((s ^ d) & 1023) + 2)  # noqa: E731
    assert run_cbpf(prog, packet()) == bucket(40000, 29500)
    assert run_cbpf(prog, packet(sport=29500, dport=40000)) == bucket(40000, 29500)  # both directions
    assert run_cbpf(prog, packet(ihl=7, sport=1234, dport=5678)) == bucket(1234, 5678)  # IP options
    assert run_cbpf(prog, packet(ethertype=0x0806)) == (2 << 16) | 1  # ARP
    assert run_cbpf(prog, packet(proto=17)) == (2 << 16) | 1          # UDP
    seen = {run_cbpf(prog, packet(sport=s)) & 0xFFFF for s in range(30000, 31024)}
    assert seen == set(range(2, 2 + flows.BUCKETS))  # every bucket reachable, none outside
    text = flows.bytecode()
    assert text.startswith(f"{len(prog)},") and text.count(",") == len(prog)


def test_tc_lines_and_their_limits():
    lines = flows.tc_batch("veth0", 400_000_000, 100_000_000, 131072).splitlines()
    assert lines[0] == "qdisc add dev veth0 parent 1:1 handle 2: htb default 1"
    leaves = [ln for ln in lines if "ceil 100000000bit" in ln]
    assert len(leaves) == flows.BUCKETS and "classid 2:401 " in leaves[-1]
    # HTB's guarantees of the classes under 2:ffff fit its rate (the link)
    parent = next(ln for ln in lines if "classid 2:ffff " in ln)
    children = [ln for ln in lines if "parent 2:ffff " in ln]
    rate = lambda ln: int(re.search(r" rate (\d+)bit", ln).group(1))  # noqa: E731
    assert len(children) == flows.BUCKETS + 1 and sum(map(rate, children)) <= rate(parent) == 400_000_000
    assert lines[-1].startswith("filter add dev veth0 parent 2: bpf bytecode ")
    for bad in (0, 400_000_001):
        with pytest.raises(ValueError, match="flow rate"):
            flows.tc_batch("veth0", 400_000_000, bad, 131072)
    with pytest.raises(ValueError, match="must not exceed the link rate"):
        ClusterSpec(2, 2, parse_rate("100mbit"), flow_rate_bps=parse_rate("200mbit"))
    assert ClusterSpec(2, 2, parse_rate("100mbit"), flow_rate_bps=parse_rate("25mbit")).flow_rate_bps == 25 * 10**6
    # bench emulate reads --flow-rate as bench scaling does: a rate or a fraction of the link
    from flashsgd.bench import emulate
    parser = argparse.ArgumentParser()
    emulate.add_arguments(parser)
    args = parser.parse_args(["--link", "100mbit", "--flow-rate", "3/4", "--cluster", "2x1"])
    assert netns.parse_flow_rate(args.flow_rate, parse_rate(args.link)) == 75 * 10**6
    assert emulate.run(parser.parse_args(["--link", "100mbit", "--flow-rate", "200mbit"])) == 2  # above it


def test_flow_counters_are_read_from_tc_text():
    text = ("class tbf 1:1 parent 1: leaf 2: \n"
            "class htb 2:5 parent 2:ffff prio 0 rate 1Mbit ceil 1Mbit burst 1600b cburst 1600b \n"
            " Sent 900 bytes 7 pkt (dropped 0, overlimits 0 requeues 0) \n"
            "class htb 2:1a parent 2:ffff prio 0 rate 195Kbit ceil 50Mbit \n"
            " Sent 0 bytes 0 pkt (dropped 0, overlimits 0 requeues 0) \n"
            "class htb 2:ffff root rate 200Mbit ceil 200Mbit \n Sent 5000 bytes 9 pkt\n"
            "class htb 2:1 parent 2:ffff rate 1Mbit\n Sent 77 bytes 1 pkt\n")
    assert flows.parse_class_stats(text) == {5: 900}  # the parent and the non-TCP class are not flows
    # flows that carried >= 5% of the node's upload between two readings
    assert flows.flows_seen({5: 100}, {5: 1100, 7: 1000, 9: 40}) == 2
    assert flows.flows_seen({}, {}) == 0


def test_wire_time_of_ring_and_torus_with_a_flow_cap():
    n, link, flow = 100 * 2**20, 400e6, 100e6
    # 4 nodes x 2: the flat ring's one flow per node carries 2 (8-1)/8 n at the flow rate
    ring = wire_s("ring", n, 8, 4, link, flow)
    assert ring == pytest.approx(2 * 7 / 8 * n * 8 / flow)
    # the 2x4 torus: two column rings per node, each 2 (4-1)/4 (n/2) at the flow rate, together
    # half the link: 3/7 of the ring's time
    torus = wire_s("torus2d", n, 8, 4, link, flow, grid=(2, 4))
    assert torus == pytest.approx(2 * 3 / 4 * (n / 2) * 8 / flow)
    assert torus / ring == pytest.approx(3 / 7)
    # the grid as each bench writes meta.grid: [X, Y] (the probe) or "XxY" (bench allreduce)
    assert wire_s("torus2d", n, 8, 4, link, flow, grid="2x4") == torus
    assert wire_s("torus2d", n, 8, 4, link, flow, grid=[2, 4]) == torus
    doc = {"meta": {"world": 8, "grid": "2x4"}, "results": [
        {"algorithm": "torus2d", "size_bytes": n, "time_us": 5e6}, {"algorithm": "ring", "size_bytes": n, "time_us": 1e7}]}
    rows = annotate(doc, nodes=4, rate_bps=link, flow_bps=flow)["results"]
    assert [r["emu_wire_us"] for r in rows] == pytest.approx([torus * 1e6, ring * 1e6])
    assert "wire_ms" in format_table(doc)
    # without the cap both share the link: 1.5 n against 1.75 n per node
    assert wire_s("torus2d", n, 8, 4, link, None, grid=(2, 4)) / wire_s("ring", n, 8, 4, link) == \
        pytest.approx(1.5 / 1.75)
    assert wire_s("powersgd", n, 8, 4, link) is None  # not a dense all-reduce of n bytes
    assert wire_s("gtopk", n, 8, 4, link) is None


@needs_netns
def test_one_flow_is_held_to_its_rate_and_two_flows_go_twice_as_fast(tmp_path):
    from flashsgd.bench import emulate

    parser = argparse.ArgumentParser()
    emulate.add_arguments(parser)
    out = tmp_path / "emu.json"
    args = parser.parse_args(["--cluster", "2x2", "--link", "200mbit", "--flow-rate", "50mbit",
                              "--probe-comm", "ring,torus2d", "--sizes-mb", "2", "--json", str(out),
                              "--timeout-s", "60", "--logs", str(tmp_path / "logs")])
    assert emulate.run(args) == 0
    doc = json.loads(out.read_text())
    assert doc["meta"]["emulated"]["flow_bps"] == 50 * 10**6
    rows = {r["algorithm"]: r for r in doc["results"]}
    assert all(r["correct"] for r in rows.values())
    # the flat ring leaves each node on one connection, the 2x2 torus on two (one per column ring)
    assert rows["ring"]["node_flows"] == [1, 1] and rows["torus2d"]["node_flows"] == [2, 2]
    # the ring's one flow runs at the flow rate, a quarter of the link: never faster than that ...
    assert rows["ring"]["time_us"] >= rows["ring"]["emu_wire_us"] * 0.97
    assert rows["ring"]["emu_link_gbps"] <= 0.05 * 1.03
    # ... and the torus, with a third of the ring's wire time, measurably faster
    assert rows["torus2d"]["time_us"] < 0.6 * rows["ring"]["time_us"]
    assert netns.list_namespaces(f"{netns.NAME_PREFIX}-{os.getpid()}") == []  # torn down
