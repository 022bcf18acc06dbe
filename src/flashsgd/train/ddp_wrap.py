"""How the trainer wraps a model in DDP: one definition, read by the trainer
(:func:`flashsgd.train.rank.build_ddp`) and by ``--comm auto``'s probe (:mod:`flashsgd.train.auto`),
so that the probe times the DDP the run will train with."""

from __future__ import annotations

import inspect

import torch
from torch.nn.parallel import DistributedDataParallel as DDP


def wrap_ddp(model: torch.nn.Module, device: torch.device, bucket_mb: float) -> DDP:
    """``model`` in DDP as the trainer runs it: ``bucket_mb`` buckets, BN buffers per worker during
    training (Goyal et al.; averaged before eval and checkpoints), no hook yet."""
    sync = {"forward_sync_buffers": False} if "forward_sync_buffers" in \
        inspect.signature(DDP.__init__).parameters else {"broadcast_buffers": False}
    return DDP(model, bucket_cap_mb=bucket_mb, device_ids=[device.index] if device.type == "cuda" else None,
               **sync)
