"""Per-rank entry on the emulated cluster: all-reduce, check the sum, count the bytes on each link.

Run by :mod:`flashsgd.bench.emulate` on every rank (``python -m flashsgd.emulate.probe``, environment
from :func:`flashsgd.emulate.ranks.rank_env`). It is the cluster's self-check and the source of the
per-link byte counts: for each algorithm and size it

1. fills a float32 tensor with ``rank + 1`` on every rank,
2. reads the node's interface counters (``/proc/net/dev`` of the node's namespace, local rank 0),
3. runs ``warmup + reps`` all-reduces (:func:`flashsgd.timing.time_ops`: barrier before each,
   timed on every rank, max over ranks, median; the input refilled untimed before each),
4. reads the counters again and checks the result is exactly ``W (W + 1) / 2`` per repetition,
5. gathers the per-node byte deltas (per operation) to rank 0, which writes one JSON file in the
   dense bench's schema (``meta`` + ``results`` rows with ``algorithm``, ``size_bytes``,
   ``time_us``) plus ``node_tx_bytes`` / ``node_rx_bytes`` lists; on a cluster with a per-flow cap,
   also ``node_flows``: per node, the TCP flows that carried >= 5% of its upload
   (:func:`flashsgd.emulate.flows.flows_seen`; a flow-bucket collision shows as one short).

Algorithms come from :data:`flashsgd.comm.dense.ALLREDUCE`; ``native`` is ``dist.all_reduce``.

Example::

    $ RANK=0 WORLD_SIZE=1 MASTER_ADDR=127.0.0.1 MASTER_PORT=29511 GLOO_SOCKET_IFNAME=lo \\
        python -m flashsgd.emulate.probe --ifname lo --sizes-mb 1 --json /tmp/p.json
"""

from __future__ import annotations

import argparse
import json
import os
import sys

import torch
import torch.distributed as dist

from flashsgd.cli_flags import add_comm_flag, comm_list
from flashsgd.comm.dense import ALLREDUCE
from flashsgd.comm.topology import get_topology
from flashsgd.emulate import flows
from flashsgd.emulate.ranks import FLOW_ENV
from flashsgd.exchanges import BUILT_IN
from flashsgd.launch import init_from_env, shutdown
from flashsgd.timing import time_ops


def read_counters(ifname: str) -> tuple[int, int]:
    """(tx_bytes, rx_bytes) of ``ifname`` in this process's network namespace."""
    with open("/proc/net/dev") as f:
        for line in f:
            name, _, rest = line.partition(":")
            if name.strip() == ifname:
                fields = rest.split()
                return int(fields[8]), int(fields[0])  # rx bytes is field 0, tx bytes field 8
    raise ValueError(f"interface {ifname!r} not found in /proc/net/dev of this namespace")


def _allreduce_fn(name: str):
    if name == BUILT_IN:
        return lambda t, topo: dist.all_reduce(t)
    fn = ALLREDUCE.get(name)  # ValueError listing the known names
    return lambda t, topo: fn(t, topo, op="sum")


class _CheckedAllReduce:
    """One all-reduce per call on a fresh ``rank + 1`` input (filled by :meth:`prepare`, untimed);
    counts the results that are not ``expected``."""

    def __init__(self, fn, topo, numel: int, rank: int, expected: float) -> None:
        self.fn, self.topo, self.rank, self.expected = fn, topo, rank, expected
        self.t = torch.empty(numel, dtype=torch.float32)
        self.wrong, self.pending = 0, False

    def check(self) -> None:
        if self.pending:
            self.wrong += int(not bool(torch.all(self.t == self.expected)))
            self.pending = False

    def prepare(self) -> None:
        self.check()
        self.t.fill_(self.rank + 1)

    def __call__(self) -> None:
        self.fn(self.t, self.topo)
        self.pending = True


def probe(algorithms: list[str], sizes_bytes: list[int], ifname: str, warmup: int, reps: int) -> dict:
    """Run the measurements of the module doc on this rank; rank 0 returns the JSON document."""
    world, rank = dist.get_world_size(), dist.get_rank()
    rpn = int(os.environ.get("LOCAL_WORLD_SIZE", world))
    topo = None
    if any(a != BUILT_IN for a in algorithms):
        topo = get_topology(ranks_per_node=rpn)
    counting = rank % rpn == 0  # one reader per node: the counters are per node
    paced = FLOW_ENV in os.environ  # per-flow classes exist on this node's link

    def flow_counters() -> dict[int, int]:
        return flows.flow_bytes(None, ifname) if counting and paced else {}
    expected = world * (world + 1) / 2  # sum of rank + 1 over ranks, exact in float32
    rows = []
    for algo in algorithms:
        fn = _allreduce_fn(algo)
        for size in sizes_bytes:
            numel = max(1, size // 4)  # float32
            call = _CheckedAllReduce(fn, topo, numel, rank, expected)
            # Step 2: counters before
            dist.barrier()
            before = read_counters(ifname) if counting else (0, 0)
            flows_before = flow_counters()
            # Steps 1, 3: fresh input (untimed), barrier, timed all-reduce (max over ranks, median)
            timing = time_ops([call], iters=reps, warmup=warmup, prepare=[call.prepare])[0]
            dist.barrier()
            # Step 4: counters after; the last result checked too
            after = read_counters(ifname) if counting else (0, 0)
            seen = flows.flows_seen(flows_before, flow_counters()) if counting and paced else None
            call.check()
            # Step 5: correctness everywhere, per-node bytes per operation
            bad = torch.tensor([float(call.wrong)], dtype=torch.float64)
            dist.all_reduce(bad, op=dist.ReduceOp.MAX)
            delta = [(after[0] - before[0]) / (warmup + reps), (after[1] - before[1]) / (warmup + reps)]
            gathered = [None] * world
            dist.all_gather_object(gathered, [*delta, seen] if counting else None)
            per_node = [d for d in gathered if d is not None]
            rows.append({"algorithm": algo, "size_bytes": numel * 4, "time_us": timing.median_s * 1e6,
                         "times_us": [x * 1e6 for x in timing.times_s],
                         "correct": bool(bad.item() == 0),
                         "node_tx_bytes": [d[0] for d in per_node],
                         "node_rx_bytes": [d[1] for d in per_node],
                         **({"node_flows": [d[2] for d in per_node]} if paced else {})})
    return {"meta": {"world": world, "ranks_per_node": rpn, "backend": dist.get_backend(),
                     **({"grid": list(topo.grid)} if topo is not None else {}),
                     "torch": torch.__version__, "warmup": warmup, "reps": reps,
                     "emulated": os.environ.get("FLASHSGD_EMULATED", "")},
            "results": rows}


def build_parser() -> argparse.ArgumentParser:
    """The probe's options (``--comm`` as in every ``flashsgd bench``)."""
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    add_comm_flag(p, BUILT_IN, "all-reduce algorithms to probe", known=ALLREDUCE.names())
    p.add_argument("--sizes-mb", default="8",
                   help="comma-separated message sizes in MiB (2**20 bytes, DDP's bucket_cap_mb unit)")
    p.add_argument("--ifname", default=os.environ.get("GLOO_SOCKET_IFNAME", "veth0"))
    p.add_argument("--warmup", type=int, default=1)
    p.add_argument("--reps", type=int, default=1)
    p.add_argument("--json", required=True, help="where rank 0 writes the results")
    return p


def sizes_bytes(sizes_mib: str) -> list[int]:
    """``--sizes-mb`` (MiB, comma-separated) in bytes: ``"1,10"`` -> [1048576, 10485760]."""
    return [int(float(s) * 2 ** 20) for s in sizes_mib.split(",") if s.strip()]


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    algorithms = comm_list(args.comm, ALLREDUCE.names())
    sizes = sizes_bytes(args.sizes_mb)
    init_from_env("gloo")
    try:
        doc = probe(algorithms, sizes, args.ifname, args.warmup, args.reps)
        if dist.get_rank() == 0:
            with open(args.json, "w") as f:
                json.dump(doc, f, indent=1)
    finally:
        shutdown()  # drops cached subgroups first: no abort at interpreter exit
    return 0


if __name__ == "__main__":
    sys.exit(main())
