"""`flashsgd bench recipe`: does the large-batch recipe close the accuracy gap? (MNIST-1D proxy)

The small-scale proxy (MNIST-1D, Greydanus 2020, standing in for ImageNet): the small 1D CNN
(:class:`~flashsgd.train.data.mnist1d.MNIST1DCNN`) on MNIST-1D (32,000 train / 8,000 test), one rank
(a 1-rank Gloo group) trained by the trainer's step (:class:`~flashsgd.train.step.TrainStep`),
data order and LR schedule (:func:`train_once`), the same number of epochs at every batch size:

1. baseline: batch 128, ``base`` recipe (momentum SGD, LR per 256, poly decay, no warmup).
2. For each large batch B (default 4096 and 8192), three variants:
   (a) ``sgd``: the baseline recipe with the LR linearly scaled to B;
   (b) ``sgd+warmup``: (a) plus gradual warmup;
   (c) ``full``: the registered ``fujitsu-mnist1d`` recipe (LARS, warmup, linear decay, no
       decay/adaptation on bias and BN, BN momentum 0.3, no label smoothing) - see :data:`FULL`;
   (d) ``full+bsc``: (c) plus batch-size control (Sony) growing to B - see :data:`FULL_BSC`;
   (e) ``full-lamb`` (asked for by name): (c) with LAMB in place of LARS - see :data:`FULL_LAMB`.
   (f) ``rule``, (g) ``rule-lamb``, (h) ``rule-sgd`` (asked for by name): the one rule for every
       batch, ``large-batch-mnist1d``, with LARS, LAMB and plain momentum SGD - see :data:`RULE`;
       for the large proxy (``--num-samples 625000``, :data:`LARGE_PROXY_SAMPLES`).
3. Each run is repeated over ``--seeds`` (model init + shuffling); the table reports the mean and
   min..max test accuracy, the gap to the baseline, steps and seconds; a PNG plots the test
   accuracy per epoch. A diagnostic column gives the final accuracy after re-estimating the BN
   running statistics over the training set (:func:`recalibrate_bn`), for every row alike.

Example::

    flashsgd bench recipe --out runs/recipe                     # full evidence run, ~minutes
    flashsgd bench recipe --epochs 1 --batches 512 --seeds 0 --num-samples 2000 --out /tmp/r
    flashsgd bench recipe --num-samples 625000 --epochs 5 --batches 4096 8192 16384 32768 \
        --variants rule rule-lamb rule-sgd --seeds 0 1 2 --jobs 2 --threads 1   # ~66 min, 2 cores
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import platform
import statistics
import time
from pathlib import Path

import torch
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel as DDP

from flashsgd.fmt import plural
from flashsgd.optim import RECIPES, Recipe, prepare
from flashsgd.optim.schedules import lr_at
from flashsgd.optim.stability import LossRiseGuard
from flashsgd.outputs import add_output
from flashsgd.train.config import RunConfig
from flashsgd.train.data import ShardedSampler
from flashsgd.train.data.mnist1d import MNIST1DCNN, load_mnist1d
from flashsgd.train.step import TrainStep

HELP = "MNIST-1D accuracy at batch 128 vs large batches: plain SGD, + warmup, full recipe"

BASE_BATCH = 128

# The baseline recipe: momentum SGD, LR 0.1 per 256 (Goyal's rule), decayed with poly power 2 to 0.
BASE = Recipe(name="base", optimizer="sgd", lr_per_ref=0.1, momentum=0.9, nesterov=False,
              weight_decay=5e-4, exclude_bias_and_norm=False, epochs=15.0, warmup_epochs=0.0,
              decay="poly", power=2.0, source="bench baseline (ours)")
# (b): plus linear warmup over the first 3 of 15 epochs from 0 (Goyal's gradual warmup).
WARMUP = dataclasses.replace(BASE, name="base+warmup", warmup_epochs=3.0)
# (c): the full recipe, fujitsu-style, tuned on this proxy: the registered ``fujitsu-mnist1d``
# (every value and where it comes from: flashsgd.optim.recipes; what was tried: docs/recipe.md).
FULL = dataclasses.replace(RECIPES["fujitsu-mnist1d"], name="full")
# (d): (c) plus Sony's batch-size control: 1/8 of the batch for 3 epochs, 1/2 for 3, then all of it
# (the final batch is B; fewer samples per step early on, so more steps than (c)).
FULL_BSC = dataclasses.replace(FULL, name="full+bsc", batch_fractions=((0, 0.125), (3, 0.5), (6, 1.0)))
# (e): (c) with LAMB in place of LARS (You et al. 2019), the same LR rule and trust coefficient
# (flashsgd.optim.lamb: an adapted tensor moves lr * eta * ||w|| under both): not in the default set.
FULL_LAMB = dataclasses.replace(FULL, name="full-lamb", optimizer="lamb")
# (f) the one rule for every batch (the registered ``large-batch-mnist1d``: (c) with the LR saturating
# at 3.2 and 40% warm-up), for the large proxy (--num-samples 625000); (g) and (h) the same rule
# with LAMB and with plain momentum SGD in place of LARS (no trust ratio).
RULE = dataclasses.replace(RECIPES["large-batch-mnist1d"], name="rule")
RULE_LAMB = dataclasses.replace(RULE, name="rule-lamb", optimizer="lamb")
RULE_SGD = dataclasses.replace(RULE, name="rule-sgd", optimizer="sgd")

VARIANTS = {"sgd": BASE, "sgd+warmup": WARMUP, "full": FULL, "full+bsc": FULL_BSC, "full-lamb": FULL_LAMB,
            "rule": RULE, "rule-lamb": RULE_LAMB, "rule-sgd": RULE_SGD}
DEFAULT_VARIANTS = ("sgd", "sgd+warmup", "full", "full+bsc")
LARGE_PROXY_SAMPLES = 625_000
"""The large proxy: 500,000 training samples, so that batch 32768 has 15 steps per epoch (Fujitsu's
81,920 on ImageNet: 15.6); generated in ~11 s on a 2-core VM, then cached."""


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--epochs", type=int, default=15, help="epochs for every run (default 15)")
    parser.add_argument("--batches", type=int, nargs="+", default=[4096, 8192],
                        help="large global batches to compare with batch 128")
    parser.add_argument("--seeds", type=int, nargs="+", default=[0, 1], help="seeds per run")
    parser.add_argument("--variants", nargs="+", default=list(DEFAULT_VARIANTS), choices=list(VARIANTS),
                        help="large-batch variants to run (default: all)")
    parser.add_argument("--num-samples", type=int, default=40000,
                        help="MNIST-1D samples (80%% train), default 40000")
    parser.add_argument("--channels", type=int, default=32, help="CNN width")
    add_output(parser, "--out", "dir", default="runs/bench-recipe", help="output folder for table + plot")
    add_output(parser, "--json", default=None, help="also write all results to this JSON file")
    parser.add_argument("--threads", type=int, default=0, help="torch threads (0: torch default)")
    parser.add_argument("--jobs", type=int, default=1,
                        help="runs trained at once, each in its own process (default 1: in this one)")


def evaluate(model: torch.nn.Module, x: torch.Tensor, y: torch.Tensor, chunk: int = 4096) -> float:
    """Test accuracy in percent (eval mode: BN running statistics)."""
    model.eval()
    correct = 0
    with torch.no_grad():
        for i in range(0, len(x), chunk):
            correct += (model(x[i:i + chunk]).argmax(1) == y[i:i + chunk]).sum().item()
    model.train()
    return 100.0 * correct / len(x)


@torch.no_grad()
def recalibrate_bn(model: torch.nn.Module, x: torch.Tensor, chunk: int = 1024) -> None:
    """Re-estimate BN running statistics as exact averages over ``x`` ("precise BN").

    With few optimizer steps (60 at batch 8192 here) running averages at torch's momentum 0.1 still
    carry statistics of earlier, very different weights; a diagnostic for that pitfall (the full
    recipe's ``bn_momentum=0.3`` removes most of it).
    """
    bns = [m for m in model.modules() if isinstance(m, torch.nn.modules.batchnorm._BatchNorm)]
    saved = [m.momentum for m in bns]
    for m in bns:
        m.reset_running_stats()
        m.momentum = None  # cumulative moving average = exact mean over the chunks
    model.train()
    for i in range(0, len(x), chunk):
        model(x[i:i + chunk])
    for m, mom in zip(bns, saved):
        m.momentum = mom


def train_once(data, recipe: Recipe, global_batch: int, epochs: int, seed: int,
               channels: int = 32) -> dict:
    """Train the CNN with ``recipe`` at ``global_batch`` for ``epochs``; test accuracy per epoch.

    One rank, trained as ``flashsgd train`` trains it (:func:`flashsgd.train.rank.build_rank`,
    ``Worker.train_step``): the recipe's tweaks and optimizer, the summed loss, DDP and TrainStep
    with ``run``'s non-finite defaults, the sampler's batches and the LR at the step's fractional
    epoch. A run the step stops as diverged (``diverged``: why) keeps its last accuracy.
    """
    x, y, xt, yt = data
    torch.manual_seed(seed)
    model = MNIST1DCNN(channels=channels)
    # the variants' lengths are for 15 epochs: rescaled to --epochs on purpose (no RecipeWarning)
    plan = prepare(recipe.for_epochs(epochs), model, global_batch, num_samples=len(x), epochs=epochs)
    loss_fn = torch.nn.CrossEntropyLoss(label_smoothing=plan.recipe.label_smoothing, reduction="sum")
    sampler, run = ShardedSampler(len(x), rank=0, world_size=1, seed=seed), RunConfig()
    step, accs, losses, t0, last_loss, diverged = 0, [], [], time.perf_counter(), float("nan"), None
    guard, unstable = LossRiseGuard(plan.recipe.warmup_epochs), None  # the trainer's stability guard
    # a real 1-rank Gloo group: the step all-reduces its loss and flags, DDP (a no-op average) its gradients
    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    try:
        train_step = TrainStep(DDP(model), plan.optimizer, loss_fn, nonfinite=run.nonfinite,
                               max_skipped=run.max_skipped)
        for epoch in range(plan.epochs):
            sampler.set_epoch(epoch, plan.batch_at(epoch))
            sizes = sampler.global_sizes()
            try:
                for i, idx in enumerate(sampler):
                    lr = lr_at(epoch + i / len(sizes), plan.schedule, plan.table)
                    last_loss = train_step(lambda: (x[idx], y[idx]), sizes[i], lr=lr, step=step,
                                           epoch=epoch).loss
                    unstable = guard.update(step, epoch + i / len(sizes), last_loss, lr, sizes[i]) or unstable
                    losses.append(last_loss)
                    step += 1
            except FloatingPointError as exc:  # where the trainer stops
                diverged = str(exc)
            accs += [evaluate(model, xt, yt)] * (plan.epochs - epoch if diverged else 1)
            if diverged:
                break
    finally:
        dist.destroy_process_group()
    seconds = time.perf_counter() - t0
    recalibrate_bn(model, x)  # after timing and after the per-epoch accuracies: a diagnostic only
    return {"recipe": recipe.name, "batch": global_batch, "seed": seed, "epochs": epochs,
            "test_acc_precise_bn": evaluate(model, xt, yt),
            "steps": step, "final_train_loss": last_loss, "test_acc": accs[-1],
            "acc_per_epoch": accs, "losses": losses, "seconds": seconds, "plan": plan.describe(), "diverged": diverged,
            "unstable": unstable}


def _variant(name: str) -> Recipe:
    return VARIANTS[name]


def _summary(rows: list[dict]) -> dict:
    accs = [r["test_acc"] for r in rows]
    return {"mean": statistics.fmean(accs), "min": min(accs), "max": max(accs),
            "precise_bn": statistics.fmean(r["test_acc_precise_bn"] for r in rows),
            "steps": rows[0]["steps"], "seconds": statistics.fmean(r["seconds"] for r in rows)}


def _plot(results: dict, path: Path) -> None:
    """One panel per large batch: the batch-128 baseline and each variant, mean over seeds."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    def curve(rows):
        return torch.tensor([r["acc_per_epoch"] for r in rows]).mean(0).tolist()

    base = curve(results[("baseline", BASE_BATCH)])
    batches = sorted({b for (_, b) in results if b != BASE_BATCH}) or [BASE_BATCH]
    fig, axes = plt.subplots(1, len(batches), figsize=(5.5 * len(batches), 4.2), squeeze=False)
    for ax, batch in zip(axes[0], batches):
        ax.plot(range(1, len(base) + 1), base, "k-", linewidth=2.5, label=f"baseline @ {BASE_BATCH}")
        for (variant, b), rows in results.items():
            if b == batch and variant != "baseline":
                c = curve(rows)
                style = {"full": "-", "full+bsc": "-.", "sgd+warmup": "--"}.get(variant, ":")
                ax.plot(range(1, len(c) + 1), c, style, linewidth=1.8, label=f"{variant} @ {batch}")
        ax.set_xlabel("epoch")
        ax.set_ylabel("test accuracy (%)")
        ax.set_title(f"batch {batch} vs {BASE_BATCH}")
        ax.set_ylim(0, 100)
        ax.grid(alpha=0.3)
        ax.legend(fontsize=8, loc="center right")
    fig.suptitle("MNIST-1D 1D-CNN, same epochs: large-batch recipe (mean over seeds)")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def _report(r: dict) -> None:
    print(f"{r['variant']:>11} batch {r['batch']:>5} seed {r['seed']}: test acc {r['test_acc']:6.2f}% "
          f"(BN recalibrated {r['test_acc_precise_bn']:6.2f}%)  "
          f"({plural(r['steps'], 'step')}, {r['seconds']:.1f} s{', diverged' if r['diverged'] else ''})  "
          f"{r['plan']}", flush=True)
    if r["unstable"]:
        print(f"{'':>11} warning: {r['unstable']}", flush=True)


def _task(task: tuple, num_samples: int, epochs: int, channels: int, threads: int) -> dict:
    """One run in a worker process (``--jobs``): the data from the cache the parent filled."""
    if threads:
        torch.set_num_threads(threads)
    variant, batch, recipe, seed = task
    r = train_once(load_mnist1d(num_samples), recipe, batch, epochs, seed, channels)
    return {**r, "variant": variant}


def _train_all(tasks: list[tuple], data, args: argparse.Namespace) -> list[dict]:
    """Every (variant, batch, recipe, seed) run, in order; ``--jobs`` of them at once in worker
    processes (spawned: each its own 1-rank Gloo group and ``--threads`` torch threads; they read
    the data from the cache that loading ``data`` filled)."""
    if args.jobs <= 1:
        out = []
        for variant, batch, recipe, seed in tasks:
            out.append({**train_once(data, recipe, batch, args.epochs, seed, args.channels), "variant": variant})
            _report(out[-1])
        return out
    import multiprocessing
    from concurrent.futures import ProcessPoolExecutor

    with ProcessPoolExecutor(args.jobs, mp_context=multiprocessing.get_context("spawn")) as pool:
        futures = [pool.submit(_task, t, args.num_samples, args.epochs, args.channels, args.threads)
                   for t in tasks]
        for f in futures:  # reported in task order as each finishes
            _report(f.result())
        return [f.result() for f in futures]


def _plot_vs_batch(results: dict, path: Path) -> None:
    """Final test accuracy against the global batch: per variant the mean over seeds, bars from the
    lowest to the highest seed; the batch-128 baseline as a line."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(6.5, 4.2))
    base = [r["test_acc"] for r in results[("baseline", BASE_BATCH)]]
    ax.axhline(statistics.fmean(base), color="k", linewidth=1.5, label=f"baseline @ {BASE_BATCH} (mean)")
    for variant in dict.fromkeys(v for v, _ in results if v != "baseline"):
        points = sorted((b, [r["test_acc"] for r in rows]) for (v, b), rows in results.items() if v == variant)
        xs = [b for b, _ in points]
        means = [statistics.fmean(a) for _, a in points]
        low = [m - min(a) for m, (_, a) in zip(means, points)]
        high = [max(a) - m for m, (_, a) in zip(means, points)]
        ax.errorbar(xs, means, yerr=[low, high], marker="o", capsize=3, label=variant)
    ax.set_xscale("log", base=2)
    ax.set_xlabel("global batch")
    ax.set_ylabel("final test accuracy (%)")
    ax.grid(alpha=0.3)
    ax.legend(fontsize=8)
    ax.set_title("MNIST-1D, same epochs: accuracy vs batch\n(mean over seeds, bars min..max)", fontsize=10)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def run(args: argparse.Namespace) -> int:
    for name in ("epochs", "num_samples", "channels", "jobs"):
        if getattr(args, name) <= 0:
            raise ValueError(f"--{name.replace('_', '-')} must be > 0, got {getattr(args, name)}")
    if any(b <= 0 for b in args.batches):
        raise ValueError(f"--batches must be > 0, got {args.batches}")
    prev_threads = torch.get_num_threads()
    if args.threads:
        torch.set_num_threads(args.threads)
    try:
        return _run(args)
    finally:
        torch.set_num_threads(prev_threads)


def _run(args: argparse.Namespace) -> int:
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    t_start = time.perf_counter()
    data = load_mnist1d(args.num_samples)
    print(f"# flashsgd bench recipe: torch {torch.__version__}, {platform.machine()}, "
          f"{torch.get_num_threads()} threads, {plural(args.jobs, 'job')}, python {platform.python_version()}")
    print(f"# MNIST-1D {len(data[0])} train / {len(data[2])} test, epochs {args.epochs}, "
          f"seeds {args.seeds}, CNN channels {args.channels}")
    runs = [("baseline", BASE_BATCH, BASE)] + [(v, b, _variant(v)) for b in args.batches
                                               for v in args.variants]
    tasks = [(variant, batch, recipe, seed) for variant, batch, recipe in runs for seed in args.seeds]
    done = _train_all(tasks, data, args)
    results: dict[tuple[str, int], list[dict]] = {}
    for (variant, batch, _, _), r in zip(tasks, done):
        results.setdefault((variant, batch), []).append(r)
    base = _summary(results[("baseline", BASE_BATCH)])["mean"]
    base_pbn = _summary(results[("baseline", BASE_BATCH)])["precise_bn"]
    lines = ["| batch | variant | test acc % (mean) | min..max | gap to batch 128 (points) | steps | s/run "
             "| acc after BN recalibration | its gap |",
             "|---:|---|---:|---:|---:|---:|---:|---:|---:|"]
    for (variant, batch), rows in results.items():
        s = _summary(rows)
        lines.append(f"| {batch} | {variant} | {s['mean']:.2f} | {s['min']:.2f}..{s['max']:.2f} | "
                     f"{s['mean'] - base:+.2f} | {s['steps']} | {s['seconds']:.1f} | "
                     f"{s['precise_bn']:.2f} | {s['precise_bn'] - base_pbn:+.2f} |")
    table = "\n".join(lines)
    print(table)
    (out / "recipe.md").write_text(
        f"MNIST-1D, {len(data[0])} train / {len(data[2])} test, {plural(args.epochs, 'epoch')}, "
        f"seeds {args.seeds}, torch {torch.__version__}, {torch.get_num_threads()} threads\n\n"
        + table + "\n")
    _plot(results, out / "recipe.png")
    _plot_vs_batch(results, out / "recipe_vs_batch.png")
    if args.json:
        Path(args.json).parent.mkdir(parents=True, exist_ok=True)
        Path(args.json).write_text(json.dumps(
            {"args": {k: v for k, v in vars(args).items() if not k.startswith("_")},
             "runs": [r for rows in results.values() for r in rows]}, indent=1, default=str))
    print(f"# wrote {out / 'recipe.md'}, {out / 'recipe.png'} and {out / 'recipe_vs_batch.png'} in {time.perf_counter() - t_start:.0f} s")
    return 0
