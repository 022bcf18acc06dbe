"""Named starting points for `flashsgd train --preset NAME`: a layer of config values between the
defaults and the user's ``--config`` file and flags (defaults < preset < TOML < flags).

``imagenet-goyal``: Goyal et al. 2017's ResNet-50 on ImageNet as a GPU user runs it today -
ResNet-50 (torchvision's layout and parameter names), ``root/train/<class>/*.JPEG`` and
``root/val/<class>/*.JPEG`` (the layout torchvision's ``ImageFolder`` and PyTorch's ImageNet
example read; give ``--data-dir``), the goyal recipe (0.1 per 256 samples, 5 warm-up epochs,
/10 at 30, 60 and 80 of 90 epochs, Nesterov momentum 0.9, weight decay 1e-4 not on BN/bias, zero
gamma of each block's last BN), the paper's 32 images per GPU (global batch 256 on one 8-GPU node:
pass ``--global-batch 8192`` on 256 GPUs), bf16 autocast and channels_last (what makes tensor cores
do the work on Ampere/Hopper), DDP's own NCCL all-reduce with its 25 MiB buckets, DataLoader
workers chosen from the CPU count, a checkpoint every 1000 steps, and 76% top-1 as the accuracy to
time (the paper: 76.3% at 256, 76.2% at 8k).

Example::

    >>> PRESETS.get("imagenet-goyal").values["model"]
    'resnet50'

On one 8-GPU machine (``torchrun`` is optional there: a local run starts one NCCL rank per GPU)::

    torchrun --standalone --nproc-per-node 8 -m flashsgd train --preset imagenet-goyal \\
        --data-dir /data/imagenet --out runs/rn50
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from flashsgd.registry import Registry


@dataclass(frozen=True)
class Preset:
    """Config values (flat keys, as the flags name them) and a one-line summary."""

    summary: str
    values: dict[str, Any] = field(default_factory=dict)


PRESETS: Registry[Preset] = Registry("preset")

PRESETS.add("imagenet-goyal", Preset(
    summary="ResNet-50 on an ImageNet folder, Goyal et al. 2017 (90 epochs, 32 images per GPU), "
            "bf16 + channels_last, NCCL all-reduce",
    values={
        "dataset": "imagefolder", "image_size": 224,      # random-resized crop 224, eval 256 -> 224
        "model": "resnet50", "recipe": "goyal", "epochs": 90.0,
        "global_batch": 256,                             # 32 per GPU x 8 GPUs (Goyal sec. 5.1: n = 32)
        "precision": "bf16", "channels_last": True,      # autocast; tensor-core friendly layout
        "algorithm": "native", "bucket_mb": 25.0,        # DDP's NCCL all-reduce, its default buckets
        "checkpoint_every": 1000, "target_accuracy": 76.0,
    }))
