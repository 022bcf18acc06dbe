"""The baseline of `flashsgd bench train`: a hand-written DDP training loop, no flashsgd step.

What a user writes from the PyTorch DDP tutorial (and the AMP recipe): the same model (same seed),
the same recipe's optimizer and LR, the same sampler batches and augmentation, DDP with its
built-in all-reduce and the same bucket size, and ``torch.autocast`` around forward and loss; a
mean loss, ``zero_grad``, ``backward``, ``optimizer.step()`` (fp16: through a
``torch.amp.GradScaler``). No agreement all-reduce, no non-finite policy, no phase clocks: the
ratio of :class:`flashsgd.train.step.TrainStep` with DDP's ``native`` exchange to this loop is the
cost of the one training step's bookkeeping (the target: >= 0.95).

Example::

    loop = PlainLoop(trainer.plan, data, torch.device("cpu"))
    loop.step()   # one iteration, as the tutorial writes it
"""

from __future__ import annotations

import torch
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel as DDP

from flashsgd.train.data.loader import augmentation_key
from flashsgd.train.step import PRECISIONS


class PlainLoop:
    """A tutorial DDP loop over the plan's model, recipe optimizer, batches and precision."""

    def __init__(self, plan, data, device: torch.device) -> None:
        from flashsgd.optim.plan import build_optimizer
        from flashsgd.train.data import ShardedSampler
        from flashsgd.train.models import build_model

        cfg = plan.config
        rank, world = dist.get_rank(), dist.get_world_size()
        torch.manual_seed(cfg.run.seed)
        model = build_model(cfg.model.model, data.num_classes, cfg.model.channels).to(device)
        self.ddp = DDP(model, bucket_cap_mb=cfg.comm.bucket_mb,
                       device_ids=[device.index] if device.type == "cuda" else None)
        self.optimizer = build_optimizer(plan.recipe, model, cfg.optim.global_batch)
        self.loss_fn = torch.nn.CrossEntropyLoss(label_smoothing=plan.recipe.label_smoothing)
        self.dtype = PRECISIONS[cfg.run.precision]
        self.scaler = torch.amp.GradScaler(device.type) if cfg.run.precision == "fp16" else None
        self.plan, self.data, self.device = plan, data, device
        self.sampler = ShardedSampler(plan.num_train, rank, world, cfg.run.seed)
        self.sampler.set_epoch(0, plan.batch_at(0))
        self.batches, self.n = iter(self.sampler), len(self.sampler.global_sizes())
        self.i = 0

    def step(self) -> None:
        """One iteration: LR, batch, autocast forward + loss, zero_grad, backward, step."""
        for group in self.optimizer.param_groups:
            group["lr"] = self.plan.lr_at((self.i % self.n) / self.n)
        idx = next(self.batches)
        x, y = self.data.train.batch(idx, True, augmentation_key(self.plan.config.run.seed, 0))
        x, y = x.to(self.device, non_blocking=True), y.to(self.device, non_blocking=True)
        tutorial_update(self.ddp, self.loss_fn, self.optimizer, self.scaler, self.dtype, x, y)
        self.i += 1


def tutorial_update(forward, loss_fn, optimizer: torch.optim.Optimizer,
                    scaler: "torch.amp.GradScaler | None", dtype: "torch.dtype | None",
                    x: torch.Tensor, y: torch.Tensor) -> None:
    """The update as the DDP tutorial and the AMP recipe write it: autocast forward + mean loss,
    zero_grad, backward, step (fp16: through the GradScaler)."""
    with torch.autocast(x.device.type, dtype=dtype or torch.float32, enabled=dtype is not None):
        loss = loss_fn(forward(x), y)
    optimizer.zero_grad()
    if scaler is None:
        loss.backward()
        optimizer.step()
    else:
        scaler.scale(loss).backward()
        scaler.step(optimizer)
        scaler.update()
