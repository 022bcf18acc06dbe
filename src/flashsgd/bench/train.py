"""`flashsgd bench train`: images/s of the trainer's training step per communication hook, over W ranks.

One process group of W local ranks (or torchrun's). For each hook (``--comm``; default: every name
in ``flashsgd.comm.hooks.HOOKS``) the step is exactly what `flashsgd train` runs: the run plan of
:func:`flashsgd.train.plan.build_plan` (the recipe's optimizer, LARS or SGD with its LR schedule;
the hook's options), the model, DDP + hook of :func:`flashsgd.train.rank.build_ddp`, and
:class:`flashsgd.train.step.TrainStep` (forward, loss sum x W / B, backward with the exchange, the
[loss, samples, non-finite] all-reduce, optimizer step), built by ``bench scaling``'s
:func:`flashsgd.bench.scaling_rank.build` on a synthetic CIFAR- or ImageNet-shaped dataset (or
MNIST-1D). Until the shared step it timed its own loop (plain SGD at lr 0.01, mean loss, no
agreement all-reduce); its times are now comparable with ``flashsgd train``'s and ``bench scaling``'s.

1. Warm-up steps per hook are excluded (DDP rebuilds its buckets after the first iteration;
   sparse hooks start compressing later).
2. The hooks' steps are timed interleaved (:func:`flashsgd.timing.time_ops`: barrier before each
   step, the slowest rank's time, rotating order), so drifting background load on a shared machine
   biases no hook.
3. Reported per hook: median step time (min..max), images/s = global batch / median time, the
   ratio to DDP's ``native`` hook measured in the same run, and the ratio to ``noop`` (no
   communication at all: the ceiling a perfect all-reduce would approach). A hook that cannot run
   at this world or layout is a row with the reason.
4. The baseline (``--plain-loop``, on by default): a hand-written DDP loop of the same model,
   optimizer, batches and ``--precision`` (:class:`flashsgd.bench.plain_loop.PlainLoop`), timed
   interleaved with the hooks; each row's ``vs plain`` is its images/s over the loop's (``native``
   vs plain: the cost of the shared step itself).

Example::

    flashsgd bench train --workers 4 --model resnet20 --batch 32 --iters 10
    flashsgd bench train --model resnet50 --image-shape imagenet --batch 8 --comm native,noop,torus2d
    flashsgd bench train --workers 2 --precision bf16 --comm native   # vs the plain autocast loop
"""

from __future__ import annotations

import argparse

import torch.distributed as dist

from flashsgd import launch
from flashsgd.bench.common import run_metadata, write_json
from flashsgd.cli_flags import add_comm_flag, add_option_flag, comm_list
from flashsgd.exchanges import BUCKET_MB, BUILT_IN, COMPUTE_ONLY, names as exchange_names
from flashsgd.outputs import add_output
from flashsgd.timing import time_ops

PLAIN = "plain"
"""The baseline row's name: a hand-written DDP loop (:mod:`flashsgd.bench.plain_loop`)."""

HELP = "images/s of the training step per DDP hook over W ranks, vs native and the no-op ceiling"


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--workers", type=int, default=4, help="local ranks (torchrun's world wins)")
    parser.add_argument("--model", default="resnet20", help="a name in flashsgd.train.models.MODELS")
    parser.add_argument("--image-shape", choices=["cifar", "imagenet", "mnist1d"], default="cifar",
                        help="synthetic input: 3x32x32, 3x224x224, or MNIST-1D's 40 values")
    parser.add_argument("--batch", type=int, default=32, help="per-worker batch")
    add_comm_flag(parser, None, "hooks to compare")
    parser.add_argument("--grid", default=None, help="torus2d grid XxY (default: X = ranks per node)")
    parser.add_argument("--ranks-per-node", type=int, default=None,
                        help="ranks per (emulated) node; default 2 on local spawn when W is even")
    add_option_flag(parser, "density")
    add_option_flag(parser, "selection")
    parser.add_argument("--bucket-mb", type=float, default=BUCKET_MB,
                        help=f"DDP bucket cap in MiB (default {BUCKET_MB:g})")
    parser.add_argument("--recipe", default="fujitsu", help="a name in flashsgd.optim.recipes.RECIPES")
    parser.add_argument("--precision", choices=["fp32", "bf16", "fp16"], default="fp32",
                        help="autocast dtype of the step and of the plain loop (run.precision)")
    parser.add_argument("--plain-loop", action=argparse.BooleanOptionalAction, default=True,
                        help="also time a hand-written DDP loop of the same model, batch and precision")
    parser.add_argument("--iters", type=int, default=10, help="timed steps per hook")
    parser.add_argument("--warmup", type=int, default=3, help="untimed steps per hook")
    add_output(parser, "--json", default=None, help="write results to this JSON file")


def spec_of(opts: dict, world: int, emulate: bool, out_dir: str) -> dict:
    """The ``bench scaling`` rank spec (:func:`flashsgd.bench.scaling_rank.run_config`) of ``opts``."""
    from flashsgd.train.config import TrainConfig
    from flashsgd.train.plan import emulated_ranks_per_node

    rpn = opts["ranks_per_node"] or (emulated_ranks_per_node(world) if emulate else None)
    mnist = opts["image_shape"] == "mnist1d"
    return {"dataset": "mnist1d" if mnist else "synthetic", "image_shape": "cifar" if mnist else opts["image_shape"],
            "model": opts["model"], "channels": TrainConfig().model.channels, "recipe": opts["recipe"],
            "ranks_per_node": rpn, "density": opts["density"], "selection": opts["selection"],
            "bucket_mb": opts["bucket_mb"], "grid": opts["grid"], "timeout_s": 300.0, "threads": 0,
            "batch": opts["batch"], "warmup": opts["warmup"], "iters": opts["iters"], "out_dir": out_dir,
            "precision": opts.get("precision", "fp32")}


def _bench(opts: dict, emulate: bool) -> dict:
    import tempfile

    from flashsgd.bench.scaling_rank import Trainer, build, run_config
    from flashsgd.comm.topology import get_topology
    from flashsgd.train.config import resolve
    from flashsgd.train.rank import load_data

    world = dist.get_world_size()
    names = opts["comm"]
    spec = spec_of(opts, world, emulate, tempfile.gettempdir())
    data = load_data(resolve(cli=run_config(spec, COMPUTE_ONLY, world)))
    built = {n: build(spec, n, data) for n in names}
    trainers = {n: t for n, t in built.items() if isinstance(t, Trainer)}
    first = next(iter(trainers.values()), None)
    steps = {n: t.step for n, t in trainers.items()}
    if opts.get("plain_loop") and first is not None:  # Step 4: the tutorial's loop, same everything
        from flashsgd.bench.plain_loop import PlainLoop

        steps[PLAIN] = PlainLoop(first.plan, data, first.device).step
    # Steps 1-2
    timings = dict(zip(steps, time_ops(list(steps.values()), iters=opts["iters"], warmup=opts["warmup"])))
    plain = timings.pop(PLAIN, None)
    # Step 3
    gb = opts["batch"] * world
    rows = [{"hook": n, "step_ms": t.median_s * 1e3, "min_ms": t.min_s * 1e3, "max_ms": t.max_s * 1e3,
             "images_per_s": gb / t.median_s} if (t := timings.get(n)) else
            {"hook": n, "skipped": built[n]["skipped"]} for n in names]
    by = {r["hook"]: r["images_per_s"] for r in rows if "images_per_s" in r}
    plain_row = None if plain is None else {
        "loop": PLAIN, "step_ms": plain.median_s * 1e3, "min_ms": plain.min_s * 1e3,
        "max_ms": plain.max_s * 1e3, "images_per_s": gb / plain.median_s}
    for r in rows:
        if "images_per_s" in r:
            r["ratio_to_native"] = r["images_per_s"] / by[BUILT_IN] if BUILT_IN in by else None
            r["ratio_to_noop"] = r["images_per_s"] / by[COMPUTE_ONLY] if COMPUTE_ONLY in by else None
            r["ratio_to_plain"] = r["images_per_s"] / plain_row["images_per_s"] if plain_row else None
    params = sum(p.numel() for p in first.model.parameters()) if first else 0
    topo = get_topology(ranks_per_node=first.plan.ranks_per_node if first else spec["ranks_per_node"],
                        grid=opts["grid"])
    recipe = f"{first.plan.recipe.name} ({type(first.optimizer).__name__})" if first else opts["recipe"]
    return {"rows": rows, "world": world, "topology": topo.describe(), "params": params,
            "global_batch": gb, "recipe": recipe, "plain": plain_row}


def _check(opts: dict, world: int) -> None:
    """Every input by the trainer's own rules (model, recipe, precision, grid...), before a worker
    starts: the run config each rank will resolve (:func:`flashsgd.bench.scaling_rank.run_config`),
    resolved here once; a ValueError names the key and the valid values."""
    import tempfile

    from flashsgd.bench.scaling_rank import run_config
    from flashsgd.train.config import resolve

    resolve(cli=run_config(spec_of(opts, world, not launch.under_torchrun(), tempfile.gettempdir()),
                           COMPUTE_ONLY, world))


def run(args: argparse.Namespace) -> int:
    if args.batch < 1 or args.iters < 1 or args.warmup < 0 or args.workers < 1:
        raise ValueError("--batch, --iters and --workers must be >= 1 and --warmup >= 0")
    opts = {k: getattr(args, k) for k in ("model", "image_shape", "batch", "grid", "ranks_per_node",
                                           "density", "selection", "bucket_mb", "iters", "warmup",
                                           "recipe", "precision", "plain_loop")}
    opts["comm"] = comm_list(args.comm, exchange_names())  # HOOKS has one hook per exchange
    _check(opts, args.workers)
    if launch.under_torchrun():
        res = launch.run(_bench, (opts, False), world_size=args.workers)
    else:
        res = launch.spawn(_bench, args.workers, (opts, True), timeout_s=300, deadline_s=1800)[0]
    if res is None or (launch.under_torchrun() and dist.is_initialized() and dist.get_rank() != 0):
        return 0
    meta = run_metadata(benchmark="train", **{k: v for k, v in opts.items()}, world=res["world"],
                        topology=res["topology"], params=res["params"], global_batch=res["global_batch"])
    print(f"# bench train: {args.model} ({res['params']:,} parameters), {res['topology']}, "
          f"per-worker batch {args.batch} (global {res['global_batch']}), {args.image_shape} input, "
          f"recipe {res['recipe']}, precision {args.precision}")
    print(f"# torch {meta['torch']}, {meta['cpu_count']} CPUs, load avg {meta['loadavg_1m']:.1f}; "
          f"median of {args.iters} interleaved steps after {args.warmup} warm-up")
    print(f"{'hook':>13} {'step ms':>9} {'min..max ms':>17} {'images/s':>10} {'vs native':>10} {'vs noop':>8}"
          f" {'vs plain':>9}")
    fmt = lambda v: "-" if v is None else f"{v:.3f}"  # noqa: E731
    for r in res["rows"]:
        if "skipped" in r:
            print(f"{r['hook']:>13} skipped: {r['skipped']}")
            continue
        print(f"{r['hook']:>13} {r['step_ms']:9.1f} {r['min_ms']:8.1f}..{r['max_ms']:<8.1f} "
              f"{r['images_per_s']:10.1f} {fmt(r['ratio_to_native']):>10} {fmt(r['ratio_to_noop']):>8} "
              f"{fmt(r['ratio_to_plain']):>9}")
    p = res["plain"]
    if p is not None:
        print(f"{PLAIN:>13} {p['step_ms']:9.1f} {p['min_ms']:8.1f}..{p['max_ms']:<8.1f} {p['images_per_s']:10.1f}"
              f"   (hand-written DDP loop, DDP's built-in all-reduce, same model/batch/precision)")
    if args.json:
        write_json(args.json, meta, res["rows"] + ([p] if p is not None else []))
    return 0
