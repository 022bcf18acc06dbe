"""Per-stage time of torus2d (2x4) and hierarchical (L=4) on 8 ranks, with and without the twin
("duplex") groups for 2-rank rings: reduce-scatter, inner all-reduce, all-gather, in ms (each stage
timed on its own by :func:`flashsgd.timing.time_ops`: barrier before each, max over ranks, median of
4 after one warm-up, the three stages interleaved).

    python benchmarks/allreduce_stages.py 16777216   # elements per rank (64 MiB fp32)
"""
import sys

import torch

from flashsgd.comm import dense
from flashsgd.comm.topology import get_topology
from flashsgd.launch import spawn
from flashsgd.timing import time_ops


def work(n):
    t = torch.zeros(n)  # zeros stay zeros: the stages can run in any order
    out = {}
    for label, kw, ra, ca in [("torus2x4", dict(ranks_per_node=4, grid="2x4"), "row", "col"),
                              ("hier4", dict(ranks_per_node=4, grid="2x4"), "node", "cross")]:
        topo = get_topology(**kw)
        dup = dense.duplex_groups(topo)
        R, RG = getattr(topo, ra + "_ranks"), getattr(topo, ra + "_group")
        C, CG = getattr(topo, ca + "_ranks"), getattr(topo, ca + "_group")
        for d in (False, True):
            lo, hi = dense.reduce_scatter(t, R, RG, dup[ra] if d else None)  # this rank's slice
            stages = [lambda: dense.reduce_scatter(t, R, RG, dup[ra] if d else None),
                      lambda: dense.ring_allreduce(t[lo:hi], C, CG, dup[ca] if d else None),
                      lambda: dense.all_gather(t, R, RG, dup[ra] if d else None)]
            out[f"{label} duplex={d}"] = [round(x.median_s * 1e3) for x in time_ops(stages, iters=4, warmup=1)]
    return out


if __name__ == "__main__":
    print(spawn(work, 8, (int(sys.argv[1]),))[0])
