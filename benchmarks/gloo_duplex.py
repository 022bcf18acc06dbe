"""Gloo moves the two directions of one connection in turn: bidirectional exchange of N floats
between 2 ranks on one group vs each direction on its own group vs one-way (median of 7, ms).

    python benchmarks/gloo_duplex.py   # 8 Mi floats = 32 MiB each way
"""
import time, torch, torch.distributed as dist, statistics
from flashsgd.launch import spawn
def work(n):
    r = dist.get_rank(); peer = 1 - r
    g2 = dist.new_group([0, 1])
    a = torch.zeros(n); b = torch.empty(n)
    res = {"one pair": [], "two groups": [], "one way": []}
    for it in range(8):
        for k in res:
            dist.barrier(); t0 = time.perf_counter()
            if k == "one pair":
                w = [dist.irecv(b, peer), dist.isend(a, peer)]
            elif k == "two groups":  # rank 0 sends on WORLD, rank 1 on g2
                if r == 0: w = [dist.isend(a, 1), dist.irecv(b, 1, group=g2)]
                else: w = [dist.irecv(b, 0), dist.isend(a, 0, group=g2)]
            else:
                w = [dist.isend(a, 1)] if r == 0 else [dist.irecv(b, 0)]
            for x in w: x.wait()
            if it: res[k].append(time.perf_counter() - t0)
    return {k: round(statistics.median(v)*1e3, 1) for k, v in res.items()}
if __name__ == "__main__":
    print(spawn(work, 2, (8 * 2**20,)))
