"""The datasets' splits and loaders: what each entry of :data:`flashsgd.train.data.catalog.DATASETS` runs.

A loader takes the ``[data]`` config whole (:class:`flashsgd.train.config.DataConfig`, or anything
with its fields) and returns :class:`Datasets`, a train and a test split; its ``describe`` says in
words what loading is about to do. A loader reads only the keys its catalog entry lists in
``reads`` (``tests/test_config_file.py`` changes the others and finds the same data).

Splits have ``len()`` and ``batch(indices, train=True, key=0) -> (x, y)`` (``key``: the epoch's
augmentation stream; in-memory splits ignore it); in-memory splits also ``to(device)``.

Example::

    >>> from flashsgd.train.config import DataConfig
    >>> synthetic_splits(DataConfig(dataset="synthetic", num_samples=20, image_shape="cifar")).description
    'synthetic cifar 20 x 3x32x32'
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

import torch

from flashsgd.fmt import plural
from flashsgd.train.data.images import ImageFolderSplit, scan_folder


class TensorSplit:
    """An in-memory split: ``x[indices], y[indices]``."""

    def __init__(self, x: torch.Tensor, y: torch.Tensor) -> None:
        self.x, self.y = x, y

    def __len__(self) -> int:
        return len(self.y)

    def batch(self, idx: torch.Tensor, train: bool = True, key: int = 0):
        idx = idx.to(self.y.device)
        return self.x[idx], self.y[idx]

    def to(self, device: torch.device) -> "TensorSplit":
        return TensorSplit(self.x.to(device), self.y.to(device))


class SyntheticSplit:
    """``n`` samples drawn from a fixed pool of random images (sample i is pool[i % pool])."""

    def __init__(self, n: int, shape: tuple[int, ...], num_classes: int, seed: int, pool: int = 64) -> None:
        g = torch.Generator().manual_seed(seed)
        self.n = n
        self.pool = torch.randn((pool,) + shape, generator=g)  # (pool, C, H, W)
        self.labels = torch.randint(0, num_classes, (n,), generator=g)

    def __len__(self) -> int:
        return self.n

    def batch(self, idx: torch.Tensor, train: bool = True, key: int = 0):
        idx = idx.to(self.labels.device)
        return self.pool[idx % len(self.pool)], self.labels[idx]

    def to(self, device: torch.device) -> "SyntheticSplit":
        moved = object.__new__(SyntheticSplit)
        moved.n, moved.pool, moved.labels = self.n, self.pool.to(device), self.labels.to(device)
        return moved


@dataclass
class Datasets:
    train: Any
    test: Any
    num_classes: int
    description: str

    def to(self, device: torch.device) -> "Datasets":
        """The in-memory splits resident on ``device`` (image folders stay on disk)."""
        move = lambda split: split.to(device) if callable(getattr(split, "to", None)) else split  # noqa: E731
        return replace(self, train=move(self.train), test=move(self.test))


def load_mnist1d_splits(d: Any) -> Datasets:
    from flashsgd.train.data.mnist1d import load_mnist1d

    x, y, xt, yt = load_mnist1d(d.num_samples, seed=d.data_seed, cache_dir_=d.data_dir or None)
    return Datasets(TensorSplit(x, y), TensorSplit(xt, yt), 10, f"mnist1d {len(y)} train / {len(yt)} test")


def describe_mnist1d(d: Any) -> str:
    from flashsgd.train.data.mnist1d import cache_file

    path = cache_file(d.num_samples, d.data_seed, d.data_dir or None)
    if path.exists():
        return f"loading MNIST-1D ({d.num_samples:,} samples) from {path}"
    return f"generating MNIST-1D ({d.num_samples:,} samples; cached in {path.parent} for the next run)"


def synthetic_splits(d: Any) -> Datasets:
    shape, classes = ((3, 224, 224), 1000) if d.image_shape == "imagenet" else ((3, 32, 32), 10)
    test_n = max(1, d.num_samples // 10)
    return Datasets(SyntheticSplit(d.num_samples, shape, classes, d.data_seed),
                    SyntheticSplit(test_n, shape, classes, d.data_seed + 1), classes,
                    f"synthetic {d.image_shape} {d.num_samples} x {'x'.join(map(str, shape))}")


def describe_synthetic(d: Any) -> str:
    return f"synthetic {d.image_shape}-shaped images ({d.num_samples:,} samples)"


def image_folder_splits(d: Any) -> Datasets:
    root = Path(d.data_dir)
    if not root.is_dir():
        raise ValueError(f"data_dir {d.data_dir!r} is not a directory")
    train_root = root / "train" if (root / "train").is_dir() else root
    files, labels, classes = scan_folder(train_root)
    if (root / "val").is_dir():
        vfiles, vlabels, _ = scan_folder(root / "val", classes)
    else:  # hold out every 10th image of each class (deterministic)
        keep = [i % 10 != 9 for i in range(len(files))]
        vfiles = [f for f, k in zip(files, keep) if not k]
        vlabels = [c for c, k in zip(labels, keep) if not k]
        files = [f for f, k in zip(files, keep) if k]
        labels = [c for c, k in zip(labels, keep) if k]
    return Datasets(ImageFolderSplit(files, labels, d.image_size),
                    ImageFolderSplit(vfiles, vlabels, d.image_size), len(classes),
                    f"imagefolder {len(files)} train / {len(vfiles)} val, "
                    f"{plural(len(classes), 'class', 'classes')}")


def describe_image_folder(d: Any) -> str:
    return f"scanning the image folder {d.data_dir}"
