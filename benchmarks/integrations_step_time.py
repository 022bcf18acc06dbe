"""Per-step time of a flashsgd dense hook inside Lightning and Accelerate vs the trainer's own DDP.

Run under torchrun (every rank runs this script)::

    ACCELERATE_USE_CPU=1 torchrun --standalone --nproc-per-node 2 benchmarks/integrations_step_time.py \
        --trainer accelerate --hooks ring,noop
    torchrun --standalone --nproc-per-node 2 benchmarks/integrations_step_time.py --trainer lightning

The step timed is the trainer's whole training step: forward, loss, backward with the exchange,
optimizer step (an MLP of ``--layers`` square layers of ``--width``, ``--batch`` samples per rank).
Baseline: the trainer's own DDP (no hook: DDP's built-in all-reduce), measured in the same run;
``noop`` (no exchange) is the ceiling.

- ``accelerate``: one ``Accelerator``, one prepared model + optimizer per configuration (the same
  initial weights); the steps are interleaved one by one with :func:`flashsgd.timing.time_ops`
  (barrier before each, slowest rank, order rotated, warm-up excluded, median with min-max).
- ``lightning``: a ``Trainer.fit`` of ``--steps`` steps per configuration, the configurations
  interleaved fit by fit for ``--rounds`` rounds (a Trainer cannot alternate two models step by
  step); a callback times each step after a barrier (slowest rank, the first ``--warmup`` steps of a
  fit excluded); median and min-max over all timed steps.

Prints the hardware, versions, world, model, the load average before and after, and per
configuration the median step time and its ratio to the trainer's own DDP (>= 1: faster).
"""

from __future__ import annotations

import argparse
import os
import platform
import statistics
import time

import torch
import torch.distributed as dist


def _mlp(layers: int, width: int) -> torch.nn.Module:
    torch.manual_seed(0)
    mods: list[torch.nn.Module] = []
    for _ in range(layers):
        mods += [torch.nn.Linear(width, width), torch.nn.ReLU()]
    return torch.nn.Sequential(*mods, torch.nn.Linear(width, 10))


def _batch(a: argparse.Namespace) -> tuple[torch.Tensor, torch.Tensor]:
    gen = torch.Generator().manual_seed(1 + int(os.environ.get("RANK", 0)))
    return torch.randn(a.batch, a.width, generator=gen), torch.randint(0, 10, (a.batch,), generator=gen)


def bench_accelerate(a: argparse.Namespace, configs: list[str]) -> dict[str, tuple[float, float, float]]:
    """Step-by-step interleaving of one prepared model per configuration (time_ops)."""
    from accelerate import Accelerator
    from accelerate.utils import DistributedDataParallelKwargs

    from flashsgd.integrations.accelerate import attach_hook
    from flashsgd.timing import time_ops

    accelerator = Accelerator(cpu=not torch.cuda.is_available(),
                              kwargs_handlers=[DistributedDataParallelKwargs(bucket_cap_mb=a.bucket_mb)])
    x, y = (t.to(accelerator.device) for t in _batch(a))
    fns = []
    for name in configs:
        model = _mlp(a.layers, a.width)
        opt = torch.optim.SGD(model.parameters(), lr=0.01)
        model, opt = accelerator.prepare(model, opt)
        if name != "default":
            attach_hook(accelerator, model, name)

        def step(model=model, opt=opt):
            loss = torch.nn.functional.cross_entropy(model(x), y)
            accelerator.backward(loss)
            opt.step()
            opt.zero_grad()
        fns.append(step)
    device = accelerator.device if accelerator.device.type == "cuda" else None
    timings = time_ops(fns, iters=a.rounds * a.steps, warmup=a.warmup, device=device)
    return {name: (t.median_s, t.min_s, t.max_s) for name, t in zip(configs, timings)}


def bench_lightning(a: argparse.Namespace, configs: list[str]) -> dict[str, tuple[float, float, float]]:
    """Fits interleaved configuration by configuration for ``rounds`` rounds; each step timed."""
    from datetime import timedelta

    import lightning as L
    from lightning.pytorch.strategies import DDPStrategy

    from flashsgd.integrations.lightning import FlashsgdHook

    x, y = _batch(a)
    data = torch.utils.data.TensorDataset(x.repeat(a.steps, 1), y.repeat(a.steps))

    class Net(L.LightningModule):
        def __init__(self):
            super().__init__()
            self.net = _mlp(a.layers, a.width)

        def training_step(self, batch, batch_idx):
            return torch.nn.functional.cross_entropy(self.net(batch[0]), batch[1])

        def configure_optimizers(self):
            return torch.optim.SGD(self.parameters(), lr=0.01)

    class StepTimer(L.Callback):
        def __init__(self):
            self.times: list[float] = []

        def on_train_batch_start(self, trainer, pl_module, batch, batch_idx):
            dist.barrier()
            self.t0 = time.perf_counter()

        def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
            if batch_idx >= a.warmup:
                self.times.append(time.perf_counter() - self.t0)

    times: dict[str, list[float]] = {name: [] for name in configs}
    for _ in range(a.rounds):
        for name in configs:
            timer = StepTimer()
            callbacks = [timer] + ([FlashsgdHook(name)] if name != "default" else [])
            trainer = L.Trainer(accelerator="auto", devices=int(os.environ["LOCAL_WORLD_SIZE"]),
                                strategy=DDPStrategy(bucket_cap_mb=a.bucket_mb, timeout=timedelta(seconds=300)),
                                max_steps=a.steps, callbacks=callbacks, logger=False, enable_checkpointing=False,
                                enable_progress_bar=False, enable_model_summary=False)
            loader = torch.utils.data.DataLoader(data, batch_size=a.batch, shuffle=False)
            trainer.fit(Net(), loader)
            t = torch.tensor(timer.times, dtype=torch.float64)
            dist.all_reduce(t, op=dist.ReduceOp.MAX)  # a step is done when the slowest rank is
            times[name] += t.tolist()
    return {name: (statistics.median(v), min(v), max(v)) for name, v in times.items()}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--trainer", choices=("accelerate", "lightning"), required=True)
    p.add_argument("--hooks", default="ring,noop", help="flashsgd hooks to time against the trainer's DDP "
                                                       "(comma-separated; default ring,noop)")
    p.add_argument("--layers", type=int, default=4)
    p.add_argument("--width", type=int, default=512)
    p.add_argument("--batch", type=int, default=64, help="samples per rank per step")
    p.add_argument("--bucket-mb", type=float, default=1.0, help="DDP's bucket_cap_mb for every configuration")
    p.add_argument("--steps", type=int, default=20, help="timed steps per round (lightning: steps of a fit)")
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--warmup", type=int, default=3, help="untimed steps (lightning: of each fit)")
    a = p.parse_args()
    configs = ["default", *[h for h in a.hooks.split(",") if h]]
    torch.set_num_threads(max(1, (os.cpu_count() or 1) // int(os.environ.get("LOCAL_WORLD_SIZE", 1))))
    load0 = os.getloadavg()
    if a.trainer == "lightning":
        result = bench_lightning(a, configs)
    else:
        result = bench_accelerate(a, configs)
    load1 = os.getloadavg()
    if dist.get_rank() != 0:
        return
    import importlib.metadata as md
    params = sum(q.numel() for q in _mlp(a.layers, a.width).parameters())
    version = md.version("lightning" if a.trainer == "lightning" else "accelerate")
    print(f"# {a.trainer} {version}, torch {torch.__version__}, {platform.processor() or platform.machine()}, "
          f"{os.cpu_count()} cores, world {dist.get_world_size()} ({dist.get_backend()}); MLP {params / 1e6:.2f} M "
          f"params ({params * 4 / 2**20:.1f} MiB fp32), batch {a.batch}/rank, bucket_cap_mb {a.bucket_mb}; "
          f"{a.rounds} rounds x {a.steps} steps, {a.warmup} warm-up")
    print(f"# load average (1/5/15 min) before {load0[0]:.2f}/{load0[1]:.2f}/{load0[2]:.2f}, "
          f"after {load1[0]:.2f}/{load1[1]:.2f}/{load1[2]:.2f}")
    base = result["default"][0]
    print(f"{'exchange':<34}{'median ms':>10}{'min-max ms':>16}{'x default':>11}")
    for name, (med, lo, hi) in result.items():
        label = f"{a.trainer}'s own DDP (no hook)" if name == "default" else f"flashsgd {name}"
        print(f"{label:<34}{med * 1e3:>10.2f}{f'{lo * 1e3:.1f}-{hi * 1e3:.1f}':>16}{base / med:>11.2f}")


if __name__ == "__main__":
    main()
