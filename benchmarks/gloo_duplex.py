"""Gloo moves the two directions of one connection in turn: bidirectional exchange of N floats
between 2 ranks on one group vs each direction on its own group vs one-way (ms: median of 7 after
one warm-up, barrier before each, max over ranks, interleaved; :func:`flashsgd.timing.time_ops`).

    python benchmarks/gloo_duplex.py   # 8 Mi floats = 32 MiB each way
"""
import torch
import torch.distributed as dist

from flashsgd.launch import spawn
from flashsgd.timing import time_ops


def work(n):
    r = dist.get_rank()
    peer = 1 - r
    g2 = dist.new_group([0, 1])
    a, b = torch.zeros(n), torch.empty(n)

    def one_pair():
        return [dist.irecv(b, peer), dist.isend(a, peer)]

    def two_groups():  # rank 0 sends on WORLD, rank 1 on g2
        if r == 0:
            return [dist.isend(a, 1), dist.irecv(b, 1, group=g2)]
        return [dist.irecv(b, 0), dist.isend(a, 0, group=g2)]

    def one_way():
        return [dist.isend(a, 1)] if r == 0 else [dist.irecv(b, 0)]

    variants = {"one pair": one_pair, "two groups": two_groups, "one way": one_way}
    fns = [lambda f=f: [w.wait() for w in f()] for f in variants.values()]
    return {k: round(t.median_s * 1e3, 1) for k, t in zip(variants, time_ops(fns, iters=7, warmup=1))}


if __name__ == "__main__":
    print(spawn(work, 2, (8 * 2**20,)))
