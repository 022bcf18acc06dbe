"""Per-stage time of torus2d (2x4) and hierarchical (L=4) on 8 ranks, with and without the twin
("duplex") groups for 2-rank rings: reduce-scatter, inner all-reduce, all-gather, in ms (median
of 4 after one warm-up, max over ranks).

    python benchmarks/allreduce_stages.py 16777216   # elements per rank (64 MiB fp32)
"""
import time, torch, torch.distributed as dist, statistics, sys
from flashsgd.launch import spawn
from flashsgd.comm import dense
from flashsgd.comm.topology import get_topology
def work(n):
    res = {}
    t = torch.zeros(n)
    out = {}
    for label, kw, ra, ca in [("torus2x4", dict(ranks_per_node=4, grid="2x4"), "row", "col"), ("hier4", dict(ranks_per_node=4, grid="2x4"), "node", "cross")]:
        topo = get_topology(**kw); dup = dense.duplex_groups(topo)
        R, RG, C, CG = getattr(topo, ra+"_ranks"), getattr(topo, ra+"_group"), getattr(topo, ca+"_ranks"), getattr(topo, ca+"_group")
        for d in (False, True):
            st = [[], [], []]
            for it in range(5):
                dist.barrier(); a = time.perf_counter()
                lo, hi = dense.reduce_scatter(t, R, RG, dup[ra] if d else None); b = time.perf_counter()
                dense.ring_allreduce(t[lo:hi], C, CG, dup[ca] if d else None); c = time.perf_counter()
                dense.all_gather(t, R, RG, dup[ra] if d else None); e = time.perf_counter()
                if it: st[0].append(b-a); st[1].append(c-b); st[2].append(e-c)
            x = torch.tensor([statistics.median(s) for s in st], dtype=torch.float64)
            dist.all_reduce(x, op=dist.ReduceOp.MAX)
            out[f"{label} duplex={d}"] = [round(v*1e3) for v in x.tolist()]
    return out
if __name__ == "__main__":
    print(spawn(work, 8, (int(sys.argv[1]),))[0])
