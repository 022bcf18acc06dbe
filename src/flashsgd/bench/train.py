"""`flashsgd bench train`: images/s of the full training step per communication hook, over W ranks.

One process group of W local ranks (or torchrun's). For each hook (default: every name in
``flashsgd.comm.hooks.HOOKS``) a copy of the same model is wrapped in its own DDP with that hook
(one hook per DDP instance). The step is what `flashsgd train` does: forward, loss, backward (the
hook exchanges the gradients), SGD step, on synthetic ImageNet- or CIFAR-shaped batches.

1. Warm-up steps per hook are excluded (DDP rebuilds its buckets after the first iteration;
   sparse hooks start compressing later).
2. The hooks' steps are timed interleaved (:func:`flashsgd.bench.common.time_ops`: barrier before
   each step, the slowest rank's time, rotating order), so drifting background load on a shared
   machine biases no hook.
3. Reported per hook: median step time (min..max), images/s = global batch / median time, the
   ratio to DDP's ``native`` hook measured in the same run, and the ratio to ``noop`` (no
   communication at all: the ceiling a perfect all-reduce would approach).

Example::

    flashsgd bench train --workers 4 --model resnet20 --batch 32 --iters 10
    flashsgd bench train --model resnet50 --image-shape imagenet --batch 8 --hooks native noop torus2d
"""

from __future__ import annotations

import argparse
import copy

import torch
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel as DDP

from flashsgd import launch
from flashsgd.bench.common import run_metadata, time_ops, write_json

HELP = "images/s of the training step per DDP hook over W ranks, vs native and the no-op ceiling"


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--workers", type=int, default=4, help="local ranks (torchrun's world wins)")
    parser.add_argument("--model", default="resnet20", help="a name in flashsgd.train.models.MODELS")
    parser.add_argument("--image-shape", choices=["cifar", "imagenet", "mnist1d"], default="cifar",
                        help="synthetic input: 3x32x32, 3x224x224, or MNIST-1D's 40 values")
    parser.add_argument("--batch", type=int, default=32, help="per-worker batch")
    parser.add_argument("--hooks", nargs="+", default=None, help="hooks to compare (default: all)")
    parser.add_argument("--grid", default=None, help="torus2d grid XxY (default: X = ranks per node)")
    parser.add_argument("--ranks-per-node", type=int, default=None,
                        help="ranks per (emulated) node; default 2 on local spawn when W is even")
    parser.add_argument("--density", type=float, default=0.001,
                        help="topk/gtopk density (default 0.001, Shi et al.'s)")
    parser.add_argument("--bucket-mb", type=float, default=25.0, help="DDP bucket size (MB)")
    parser.add_argument("--iters", type=int, default=10, help="timed steps per hook")
    parser.add_argument("--warmup", type=int, default=3, help="untimed steps per hook")
    parser.add_argument("--json", default=None, help="write results to this JSON file")


def _bench(opts: dict, emulate: bool) -> dict:
    from flashsgd.comm.hooks import HOOKS, hook_options, register_hook
    from flashsgd.comm.topology import get_topology
    from flashsgd.train.models import build_model

    from flashsgd.train.plan import emulated_ranks_per_node

    world, rank = dist.get_world_size(), dist.get_rank()
    rpn = opts["ranks_per_node"] or (emulated_ranks_per_node(world) if emulate else None)
    topo = get_topology(ranks_per_node=rpn, grid=opts["grid"])
    names = opts["hooks"] or HOOKS.names()
    for n in names:
        HOOKS.get(n)  # unknown names: ValueError listing the known ones
    shape, classes = {"cifar": ((3, 32, 32), 10), "imagenet": ((3, 224, 224), 1000),
                      "mnist1d": ((40,), 10)}[opts["image_shape"]]
    torch.manual_seed(0)
    base = build_model(opts["model"], classes)
    g = torch.Generator().manual_seed(rank)
    x = torch.randn((opts["batch"],) + shape, generator=g)
    y = torch.randint(0, classes, (opts["batch"],), generator=g)
    loss_fn = torch.nn.CrossEntropyLoss()
    steps = []
    for name in names:
        model = DDP(copy.deepcopy(base), bucket_cap_mb=opts["bucket_mb"])
        register_hook(model, name, **hook_options(name, ranks_per_node=rpn, grid=opts["grid"],
                                                  density=opts["density"]))
        opt = torch.optim.SGD(model.parameters(), lr=0.01, momentum=0.9)

        def step(model=model, opt=opt):
            opt.zero_grad(set_to_none=False)
            loss_fn(model(x), y).backward()
            opt.step()
        steps.append(step)
    # Steps 1-2
    timings = time_ops(steps, iters=opts["iters"], warmup=opts["warmup"])
    # Step 3
    gb = opts["batch"] * world
    rows = [{"hook": n, "step_ms": t.median_s * 1e3, "min_ms": t.min_s * 1e3, "max_ms": t.max_s * 1e3,
             "images_per_s": gb / t.median_s} for n, t in zip(names, timings)]
    by = {r["hook"]: r["images_per_s"] for r in rows}
    for r in rows:
        r["ratio_to_native"] = r["images_per_s"] / by["native"] if "native" in by else None
        r["ratio_to_noop"] = r["images_per_s"] / by["noop"] if "noop" in by else None
    params = sum(p.numel() for p in base.parameters())
    return {"rows": rows, "world": world, "topology": topo.describe(), "params": params,
            "global_batch": gb}


def run(args: argparse.Namespace) -> int:
    if args.batch < 1 or args.iters < 1 or args.warmup < 0 or args.workers < 1:
        raise ValueError("--batch, --iters and --workers must be >= 1 and --warmup >= 0")
    opts = {k: getattr(args, k) for k in ("model", "image_shape", "batch", "hooks", "grid",
                                           "ranks_per_node", "density", "bucket_mb", "iters",
                                           "warmup")}
    if launch.under_torchrun():
        res = launch.run(_bench, (opts, False), world_size=args.workers)
    else:
        res = launch.spawn(_bench, args.workers, (opts, True), timeout_s=300, deadline_s=1800)[0]
    if res is None or (launch.under_torchrun() and dist.is_initialized() and dist.get_rank() != 0):
        return 0
    meta = run_metadata(benchmark="train", **{k: v for k, v in opts.items()}, world=res["world"],
                        topology=res["topology"], params=res["params"], global_batch=res["global_batch"])
    print(f"# bench train: {args.model} ({res['params']:,} parameters), {res['topology']}, "
          f"per-worker batch {args.batch} (global {res['global_batch']}), {args.image_shape} input")
    print(f"# torch {meta['torch']}, {meta['cpu_count']} CPUs, load avg {meta['loadavg_1m']:.1f}; "
          f"median of {args.iters} interleaved steps after {args.warmup} warm-up")
    print(f"{'hook':>13} {'step ms':>9} {'min..max ms':>17} {'images/s':>10} {'vs native':>10} {'vs noop':>8}")
    for r in res["rows"]:
        fmt = lambda v: "-" if v is None else f"{v:.3f}"  # noqa: E731
        print(f"{r['hook']:>13} {r['step_ms']:9.1f} {r['min_ms']:8.1f}..{r['max_ms']:<8.1f} "
              f"{r['images_per_s']:10.1f} {fmt(r['ratio_to_native']):>10} {fmt(r['ratio_to_noop']):>8}")
    if args.json:
        write_json(args.json, meta, res["rows"])
    return 0
