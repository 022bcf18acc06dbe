"""Does a communication thread pay for itself in the Gloo hooks? (``threaded=False`` vs ``True``)

Trains an MLP with DDP on W local Gloo ranks and times full training steps (forward, backward with
the hook, SGD step; barrier before each, max over ranks, median over steps) for DDP's built-in
all-reduce (``native``) and for the ring and torus2d hooks of ``flashsgd.comm.dense_hooks``, each
with ``threaded=False`` (the bucket is reduced inside the hook, backward waits) and
``threaded=True`` (the hook's default: a communication thread reduces while backward goes on).
Both options are passed explicitly. Configurations are interleaved round by round so that
background load on a shared machine hits all of them alike. Prints the median step time and the
ratio to native measured in the same run.

    python benchmarks/hook_threading.py --world 4 --rounds 5 --steps 6
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch
import torch._dynamo  # noqa: F401  imported once before forking (DDP imports it)
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel as DDP

from flashsgd.comm.hooks import register_hook
from flashsgd.launch import spawn


def _model(width: int) -> torch.nn.Module:
    torch.manual_seed(0)
    layers = [torch.nn.Linear(64, width), torch.nn.ReLU()]
    for _ in range(4):
        layers += [torch.nn.Linear(width, width), torch.nn.ReLU()]
    return torch.nn.Sequential(*layers, torch.nn.Linear(width, 10))  # ~4 * width^2 parameters


def _worker(configs, rounds, steps, width, batch, bucket_mb):
    rank = dist.get_rank()
    g = torch.Generator().manual_seed(rank)
    x, y = torch.randn(batch, 64, generator=g), torch.randint(0, 10, (batch,), generator=g)
    runs = []
    for name, opts in configs:
        model = DDP(_model(width), bucket_cap_mb=bucket_mb)
        register_hook(model, name, **opts)
        runs.append((model, torch.optim.SGD(model.parameters(), lr=0.01)))
    times = {i: [] for i in range(len(configs))}
    for _ in range(rounds):
        for i, (model, opt) in enumerate(runs):
            for step in range(steps):
                dist.barrier()
                t0 = time.perf_counter()
                opt.zero_grad()
                torch.nn.functional.cross_entropy(model(x), y).backward()
                opt.step()
                dt = torch.tensor([time.perf_counter() - t0], dtype=torch.float64)
                dist.all_reduce(dt, op=dist.ReduceOp.MAX)
                if step >= 1:  # the first step of a round re-warms caches
                    times[i].append(dt.item())
    return {i: statistics.median(t) for i, t in times.items()}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--world", type=int, default=4)
    p.add_argument("--rounds", type=int, default=5)
    p.add_argument("--steps", type=int, default=6)
    p.add_argument("--width", type=int, default=512)
    p.add_argument("--batch", type=int, default=256)
    p.add_argument("--bucket-mb", type=float, default=1.0)
    p.add_argument("--grid", default=None)
    a = p.parse_args()
    configs = [("native", {})]
    for name in ("ring", "torus2d"):
        extra = {"grid": a.grid} if name == "torus2d" and a.grid else {}
        configs += [(name, dict(extra, threaded=False)), (name, dict(extra, threaded=True))]
    med = spawn(_worker, a.world, (configs, a.rounds, a.steps, a.width, a.batch, a.bucket_mb),
                timeout_s=1200)[0]
    params = sum(q.numel() for q in _model(a.width).parameters())
    print(f"# world {a.world}, MLP {params / 1e6:.2f} M params ({params * 4 / 2**20:.1f} MiB fp32), "
          f"batch {a.batch}/rank, bucket_cap_mb {a.bucket_mb}, {a.rounds} rounds x {a.steps} steps")
    print(f"{'hook':<28}{'step(ms)':>10}{'x native':>10}")
    for i, (name, opts) in enumerate(configs):
        label = name if name == "native" else f"{name} threaded={opts['threaded']}"
        print(f"{label:<28}{med[i] * 1e3:>10.1f}{med[0] / med[i]:>10.2f}")


if __name__ == "__main__":
    main()
