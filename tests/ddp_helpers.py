"""Small pieces shared by the multi-rank hook tests: a tiny MLP, a few SGD steps on per-rank
batches, the flat parameters (run inside the ranks of the ``run_ranks`` harness in conftest.py)."""

from __future__ import annotations

import torch
import torch.distributed as dist
from torch import nn


def tiny_net(seed: int = 0) -> nn.Module:
    """A 20 -> 64 -> 64 -> 5 MLP, the same on every rank for the same seed."""
    torch.manual_seed(seed)
    return nn.Sequential(nn.Linear(20, 64), nn.ReLU(), nn.Linear(64, 64), nn.ReLU(), nn.Linear(64, 5))


def train_steps(model: nn.Module, opt: torch.optim.Optimizer, steps: int, first: int = 0) -> None:
    """``steps`` optimizer steps on batches that depend on the step and the rank only (made on the
    CPU, moved to the model's device)."""
    device = next(model.parameters()).device
    for s in range(first, first + steps):
        g = torch.Generator().manual_seed(1000 * s + dist.get_rank())
        x, y = torch.randn(16, 20, generator=g).to(device), torch.randint(0, 5, (16,), generator=g).to(device)
        opt.zero_grad()
        nn.functional.cross_entropy(model(x), y).backward()
        opt.step()


def flat_params(model: nn.Module) -> torch.Tensor:
    return torch.cat([p.detach().flatten() for p in model.parameters()])
