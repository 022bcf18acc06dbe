"""MNIST-1D data (generated locally, cached as .npz) and the small 1D CNN of the project's proxy.

Paper: Greydanus 2020, "Scaling down Deep Learning" (MNIST-1D; the ``mnist1d`` package). The data
are generated from ten 1-D templates with random padding, translation, shear, scaling and
correlated noise; nothing is downloaded. ``num_samples=40000`` gives 32,000 train / 8,000 test
sequences of length 40: the project's small-scale proxy for ImageNet-scale recipes (docs/recipe.md).

Example::

    >>> x_train, y_train, x_test, y_test = load_mnist1d()          # doctest: +SKIP
    >>> x_train.shape, y_train.dtype                               # doctest: +SKIP
    (torch.Size([32000, 40]), torch.int64)
    >>> model = MNIST1DCNN()
    >>> model(torch.randn(8, 40)).shape
    torch.Size([8, 10])
"""

from __future__ import annotations

import os
from pathlib import Path

import numpy as np
import torch
from torch import nn


def cache_dir(path: str | os.PathLike | None = None) -> Path:
    """The cache folder: ``path``, else ``$FLASHSGD_CACHE``, else ``~/.cache/flashsgd``."""
    if path is None:
        path = os.environ.get("FLASHSGD_CACHE") or Path.home() / ".cache" / "flashsgd"
    return Path(path)


def cache_file(num_samples: int, seed: int, cache_dir_: str | os.PathLike | None = None) -> Path:
    """The file :func:`load_mnist1d` caches ``num_samples`` samples of ``seed`` in."""
    return cache_dir(cache_dir_) / f"mnist1d_{num_samples}_{seed}.npz"


def load_mnist1d(num_samples: int = 40000, seed: int = 42,
                 cache_dir_: str | os.PathLike | None = None
                 ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """Generate (or load from cache) MNIST-1D: ``(x_train, y_train, x_test, y_test)`` tensors.

    x: float32 (N, 40), standardized by the generator; y: int64 (N,). 80/20 train/test split.
    Generation of 40,000 samples takes ~6.5 s; the arrays are then cached as
    ``mnist1d_{num_samples}_{seed}.npz`` in :func:`cache_dir`. The generator seeds numpy's and
    Python's global RNGs; their states are restored afterwards.

    Args:
        num_samples: total samples (train + test), a multiple of 10 (one share per class), >= 10.
        seed: generator seed (the package default is 42).
        cache_dir_: cache folder (see :func:`cache_dir`).
    """
    if not (isinstance(num_samples, int) and num_samples >= 10 and num_samples % 10 == 0):
        raise ValueError(f"num_samples must be a positive multiple of 10, got {num_samples!r}")
    path = cache_file(num_samples, seed, cache_dir_)
    if path.exists():
        with np.load(path) as z:
            arrays = [z[k] for k in ("x", "y", "x_test", "y_test")]
    else:
        import random

        from mnist1d.data import get_dataset_args, make_dataset

        args = get_dataset_args()
        args.num_samples = num_samples
        args.seed = seed
        np_state, py_state = np.random.get_state(), random.getstate()
        try:
            data = make_dataset(args)
        finally:
            np.random.set_state(np_state)
            random.setstate(py_state)
        arrays = [data["x"], data["y"], data["x_test"], data["y_test"]]
        path.parent.mkdir(parents=True, exist_ok=True)
        tmp = path.with_name(f"{path.stem}.{os.getpid()}.tmp.npz")  # atomic: several workers may race
        np.savez(tmp, x=arrays[0], y=arrays[1], x_test=arrays[2], y_test=arrays[3])
        os.replace(tmp, path)
    x, y, xt, yt = arrays
    return (torch.from_numpy(np.ascontiguousarray(x, dtype=np.float32)),
            torch.from_numpy(np.ascontiguousarray(y, dtype=np.int64)),
            torch.from_numpy(np.ascontiguousarray(xt, dtype=np.float32)),
            torch.from_numpy(np.ascontiguousarray(yt, dtype=np.int64)))


class MNIST1DCNN(nn.Module):
    """Small 1D CNN for MNIST-1D: 3 x (conv + BatchNorm + ReLU), flatten, linear.

    Input (N, 40) or (N, 1, 40); output (N, 10) logits. With ``channels=32``: 9,706 parameters in
    11 tensors (convs without bias, as they are followed by BN). BatchNorm statistics are per
    worker (Goyal et al.: never across workers).

    Args:
        channels: width of the conv layers.
        num_classes: output classes.
        zero_init_last_bn: set the last BatchNorm's gamma to 0 (the block-output BN trick of
            Goyal et al.; here the network has no residual blocks, so it is off by default).
    """

    def __init__(self, channels: int = 32, num_classes: int = 10, zero_init_last_bn: bool = False) -> None:
        super().__init__()
        if channels <= 0:
            raise ValueError(f"channels must be > 0, got {channels!r}")
        c = channels
        self.features = nn.Sequential(
            nn.Conv1d(1, c, 5, padding=2, bias=False), nn.BatchNorm1d(c), nn.ReLU(),       # (N, c, 40)
            nn.Conv1d(c, c, 3, stride=2, padding=1, bias=False), nn.BatchNorm1d(c), nn.ReLU(),  # (N, c, 20)
            nn.Conv1d(c, c, 3, stride=2, padding=1, bias=False), nn.BatchNorm1d(c), nn.ReLU(),  # (N, c, 10)
        )
        self.fc = nn.Linear(c * 10, num_classes)
        if zero_init_last_bn:
            nn.init.zeros_(self.features[7].weight)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if x.ndim == 2:
            x = x.unsqueeze(1)  # (N, 40) -> (N, 1, 40)
        return self.fc(self.features(x).flatten(1))
