"""One rank of `flashsgd bench scaling`: real training steps per communication hook, timed.

Run by :mod:`flashsgd.bench.scaling` on every rank of an emulated cluster (torchrun's environment,
see :mod:`flashsgd.emulate.ranks`) as ``python -m flashsgd.bench.scaling_rank SPEC.json OUT.json``.
The step is the trainer's own :class:`flashsgd.train.step.TrainStep` (the object
:class:`flashsgd.train.worker.Worker` runs): a :class:`~flashsgd.train.data.ShardedSampler` batch of
the run's dataset, forward, loss (sum x W / B, Goyal et al. 2017), backward through DDP + the hook
(:func:`flashsgd.train.rank.build_ddp`), the small all-reduce of [loss, samples, non-finite], and
the recipe's optimizer step (:func:`flashsgd.optim.plan.prepare`: LARS or SGD). With the spec's
``grad_accum`` K the step is the trainer's accumulation (``optim.grad_accum``): K micro-batches of
``batch`` samples per rank, DDP's ``no_sync`` on the first K-1, one exchange after the last.

Algorithm (:func:`rank_main`):

1. Per hook of the spec's ``comms``: resolve the config (:func:`flashsgd.train.config.resolve`) and
   the plan (:func:`flashsgd.train.plan.build_plan`); a hook that cannot run here (ValueError, the
   same on every rank) becomes a row with ``skipped`` = the reason.
2. Build each hook's model (same seed), optimizer, DDP + hook (:class:`Trainer`); ``warmup``
   untimed steps each (DDP rebuilds its buckets after the first; sparse hooks compress from the
   third).
3. ``iters`` rounds of one timed step per hook (:func:`flashsgd.timing.time_ops`): the order
   rotating every round, each step after a barrier; a step's time is the slowest rank's (all-reduce
   MAX). Rank 0's split: forward, backward (with the exchange of synchronous hooks), the hook's own
   time (:class:`~flashsgd.train.rank.CommTimer`), sync all-reduce, optimizer.
4. Sparse hooks: the compression (accumulate + selection) of each DDP bucket timed apart on this
   rank, at the same CPU share.
5. Rank 0 writes the rows to ``OUT.json``; before every step it appends the hook's name to
   ``OUT.json.progress`` (the host's progress bar, and the hook a failed job was running).
"""

from __future__ import annotations

import json
import os
import statistics
import sys
import time
from pathlib import Path

import torch
import torch.distributed as dist

from flashsgd import launch
from flashsgd.comm.sparse.hooks import SPARSE_EXCHANGES
from flashsgd.exchanges import COMPUTE_ONLY
from flashsgd.train.data.loader import augmentation_key


def run_config(spec: dict, comm: str, world: int) -> dict:
    """The flat config keys (:func:`flashsgd.train.config.resolve`) of one measured hook: a global
    batch of ``grad_accum`` micro-batches of ``batch`` samples per rank (the trainer splits each
    rank's shard into them, :class:`flashsgd.train.step.TrainStep`)."""
    accum = spec.get("grad_accum", 1)  # specs written before --grad-accum: one micro-batch
    batch = spec["batch"] * world * accum
    samples = batch * (spec["warmup"] + spec["iters"] + 1)
    if spec["dataset"] == "mnist1d":  # generated in multiples of 10
        samples = -(-samples // 10) * 10
    return {"dataset": spec["dataset"], "image_shape": spec["image_shape"], "model": spec["model"],
            "channels": spec["channels"], "num_samples": samples,
            "recipe": spec["recipe"], "proxy_tuning": False, "global_batch": batch,
            "grad_accum": accum,
            "algorithm": comm, "ranks_per_node": spec["ranks_per_node"], "density": spec["density"],
            "selection": spec["selection"], "bucket_mb": spec["bucket_mb"], "workers": world,
            "density_warmup": 0,  # a speed measurement: the density asked for from the first step
            "timeout_s": spec["timeout_s"], "threads": spec["threads"], "progress": False,
            "out": spec["out_dir"], "seed": 0, **({"grid": spec["grid"]} if spec.get("grid") else {}),
            **({"precision": spec["precision"]} if spec.get("precision") else {}),
            # auto: a benchmark measures speed, so every candidate may be chosen (as measured here)
            **({"accuracy_risk": "any"} if comm == "auto" else {})}


class Trainer:
    """Model, optimizer, DDP + hook, sampler and :class:`~flashsgd.train.step.TrainStep` of one
    hook's measurement (Step 2)."""

    def __init__(self, plan, data, device) -> None:
        from flashsgd.train.data import ShardedSampler
        from flashsgd.train.rank import build_rank

        self.data, self.device = data, device
        self.rank, self.world = dist.get_rank(), dist.get_world_size()
        parts = build_rank(plan, data, device)  # the trainer's own rank (--comm auto: its choice)
        self.plan, self.model, self.optimizer, self.auto = parts.plan, parts.model, parts.optimizer, parts.auto
        self.timer, self.ddp, self.hook_state, self.train_step = parts.timer, parts.ddp, parts.hook_state, parts.step
        cfg = plan.config
        self.sampler = ShardedSampler(plan.num_train, self.rank, self.world, cfg.run.seed)
        self.sampler.set_epoch(0, plan.batch_at(0))
        self.batches = iter(self.sampler)
        self.sizes = self.sampler.global_sizes()
        self.step_no = 0
        self.splits: list[dict[str, float]] = []

    def step(self) -> dict[str, float]:
        """One training step as the trainer runs it; returns (and records) rank 0's split in
        seconds and the loss."""
        i = self.step_no % len(self.sizes)
        idx = next(self.batches)
        key = augmentation_key(self.plan.config.run.seed, 0)
        res = self.train_step(lambda: self.data.train.batch(idx, True, key), self.sizes[i],
                              lr=self.plan.lr_at(i / len(self.sizes)), step=self.step_no)
        self.step_no += 1
        t = res.times()
        split = {"data": t["data"], "forward": t["forward"], "backward": t["backward"], "hook": t["comm"],
                 "sync": t["sync"], "optimizer": t["optimizer"], "loss": res.loss}
        self.splits.append(split)
        return split

    def bucket_bytes(self) -> list[int]:
        """DDP's gradient bucket sizes in bytes (after its rebuild), in reduction order."""
        text = str(self.ddp._get_ddp_logging_data().get("bucket_sizes", ""))
        return [int(v) for v in text.replace(" ", "").split(",") if v]


def model_info(spec: dict) -> dict:
    """Parameters, per-tensor gradient sizes and matrix shapes in backward order (the simulator's
    workload)."""
    from flashsgd.train.config import resolve
    from flashsgd.train.models import build_model
    from flashsgd.train.rank import load_data

    data = load_data(resolve(cli=run_config(spec, COMPUTE_ONLY, 1)))
    model = build_model(spec["model"], data.num_classes, spec["channels"])
    params = [p for p in model.parameters() if p.requires_grad][::-1]  # backward order
    numels = [p.numel() for p in params]
    # as torch's PowerSGD hook views each gradient: shape[0] x the rest
    matrices = [[p.shape[0], p.numel() // p.shape[0]] for p in params]
    return {"params": sum(numels), "numels": numels, "matrices": matrices}


def compression_seconds(spec: dict, bucket_bytes: list[int], reps: int = 5) -> float:
    """Step 4: median time of the sparse hooks' local work per step (accumulate + selection), summed
    over the DDP buckets: :data:`flashsgd.comm.sparse.select.SELECTIONS` on a bucket-sized tensor."""
    from flashsgd.comm.sparse.select import SELECTIONS, SelectionWorkspace, k_from_density, selection_for
    from flashsgd.exchanges import resolved_selection

    total = 0.0
    g = torch.Generator().manual_seed(1)
    for nbytes in bucket_bytes:
        n = max(1, nbytes // 4)
        grad, residual = torch.randn(n, generator=g), torch.randn(n, generator=g)
        k, ws, times = k_from_density(n, spec["density"]), SelectionWorkspace(), []
        for _ in range(reps):
            t0 = time.perf_counter()
            acc = residual.add(grad)
            if resolved_selection(spec["selection"], acc.device.type) == "sampled":
                SELECTIONS["sampled"](acc, k, generator=g, workspace=ws)
            else:
                selection_for(spec["selection"], acc.device)(acc, k)
            times.append(time.perf_counter() - t0)
        total += statistics.median(times)
    return total


def build(spec: dict, comm: str, data) -> "Trainer | dict":
    """Steps 1-2 for one hook: its trainer, or a ``skipped`` row naming why it cannot run here."""
    from flashsgd.train.config import resolve
    from flashsgd.train.plan import build_plan
    from flashsgd.train.rank import setup_process

    world = dist.get_world_size()
    try:
        plan = build_plan(resolve(cli=run_config(spec, comm, world)), world, len(data.train),
                          local_spawn=False)
        return Trainer(plan, data, setup_process(plan))
    except ValueError as exc:  # the same on every rank: the hook cannot run at this world/layout
        return {"comm": comm, "skipped": str(exc).splitlines()[0]}


def timed_steps(spec: dict, trainers: dict, progress: Path | None) -> dict[str, list]:
    """Steps 2-3: warm-up per hook, then ``iters`` rounds of one step per hook, the order rotating
    each round (drifting background load biases no hook); each step after a barrier
    (:func:`flashsgd.timing.time_ops`). Returns {hook: [(slowest rank's seconds, rank 0's split)]}."""
    from flashsgd.timing import time_ops

    def timed(comm: str, trainer: Trainer):
        def step() -> None:
            _tick(progress, comm)
            trainer.step()
        return step

    names = list(trainers)
    for trainer in trainers.values():
        trainer.splits.clear()
    timings = time_ops([timed(c, trainers[c]) for c in names], iters=spec["iters"], warmup=spec["warmup"])
    return {c: list(zip(t.times_s, trainers[c].splits[spec["warmup"]:]))
            for c, t in zip(names, timings)}


def row_of(spec: dict, comm: str, trainer: Trainer, steps: list) -> dict:
    """The row of one hook: step times of the slowest rank, rank 0's split (Step 3), compression
    (Step 4)."""
    splits = [s for _, s in steps]
    buckets = trainer.bucket_bytes()
    plan = trainer.plan
    row = {"comm": comm, "step_s": [d for d, _ in steps], "bucket_bytes": buckets,
           "split_s": {k: statistics.median(s[k] for s in splits) for k in splits[0] if k != "loss"},
           "loss_first": splits[0]["loss"], "loss_last": splits[-1]["loss"],
           "hook_options": plan.hook_options, "grid": list(plan.grid) if plan.grid else None,
           "loadavg": os.getloadavg()}
    if trainer.auto is not None:
        row["chosen"] = {**trainer.auto["choice"], "explain": trainer.auto["explain"],
                         "measured": trainer.auto["measured"]}
    if plan.config.comm.algorithm in SPARSE_EXCHANGES:
        row["compression_s"] = compression_seconds({**spec, "density": plan.config.comm.density}, buckets)
    return row


def _tick(progress: Path | None, comm: str) -> None:
    """One line per step, written before it starts (the host counts them; the last names the hook
    a failed job was running)."""
    if progress is not None:
        with open(progress, "a") as fh:
            fh.write(comm + "\n")


def rank_main(spec: dict, out: str) -> None:
    """All of the spec's hooks on this rank; rank 0 writes ``out`` (Step 5)."""
    from flashsgd.train.config import resolve
    from flashsgd.train.rank import load_data

    rank = dist.get_rank()
    data = load_data(resolve(cli=run_config(spec, COMPUTE_ONLY, dist.get_world_size())))
    progress = Path(out + ".progress") if rank == 0 else None
    built = {comm: build(spec, comm, data) for comm in spec["comms"]}
    trainers = {c: t for c, t in built.items() if isinstance(t, Trainer)}
    steps = timed_steps(spec, trainers, progress)
    rows = [row_of(spec, c, t, steps[c]) if isinstance(t, Trainer) else t for c, t in built.items()]
    if rank == 0:
        Path(out).write_text(json.dumps({"rows": rows}))


def main(argv: list[str]) -> int:
    if len(argv) != 2:
        print("usage: python -m flashsgd.bench.scaling_rank SPEC.json OUT.json", file=sys.stderr)
        return 2
    spec = json.loads(Path(argv[0]).read_text())
    launch.run(rank_main, (spec, argv[1]), world_size=int(os.environ["WORLD_SIZE"]), backend="gloo",
               timeout_s=spec["timeout_s"])
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
