"""Datasets of `flashsgd train` and the sharded sampler that splits each global batch over workers.

Datasets (:func:`build_datasets`), each a pair of splits with ``len()`` and
``batch(indices, generator, train) -> (x, y)``:

* ``mnist1d`` - MNIST-1D generated locally (Greydanus 2020; :func:`flashsgd.train.mnist1d.load_mnist1d`).
* ``synthetic`` - random ImageNet-shaped (3x224x224, 1000 classes) or CIFAR-shaped (3x32x32, 10
  classes) images from a small fixed pool: for throughput, not accuracy.
* ``imagefolder`` - ``root/train/<class>/<image>`` (and ``root/val/<class>/...``; without ``val/``
  every 10th image is held out), decoded with Pillow. Training augmentation is the
  standard Inception-style random-resized crop (area 8-100%, aspect 3/4-4/3), horizontal flip and
  ImageNet mean/std normalization; eval resizes the short side to size*256/224 and center-crops.
  All done with torch ops (torchvision does not import on these CPU builds).

Sharding (:class:`ShardedSampler`, Goyal et al. 2017 sec. 3: "one random shuffle per epoch, split
across all workers"):

1. At each epoch, permute ``range(n)`` with a generator seeded by ``(seed, epoch)``: every worker
   computes the same permutation, no communication.
2. Cut it into global batches of the epoch's global batch B (batch-size control changes B per
   epoch); a last remainder smaller than the world is merged into the previous batch, so no worker
   ever gets an empty batch and no sample is dropped.
3. Worker r takes a contiguous slice of each global batch: ``B // W`` samples, one more for
   ``r < B % W``. Over an epoch the workers together see every sample exactly once.

The position (epoch, step within epoch) is the sampler's ``state_dict``: a resumed run continues
with the same batches.

Example::

    >>> s = ShardedSampler(10, rank=1, world_size=3, seed=0)
    >>> s.set_epoch(0, global_batch=4)
    >>> s.steps()                       # the remainder of 2 < 3 workers joins the last batch
    [4, 10]
    >>> [len(b) for b in s]
    [1, 2]
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import torch
import torch.nn.functional as F

from flashsgd.optim.schedules import batch_ends

IMAGENET_MEAN = (0.485, 0.456, 0.406)
IMAGENET_STD = (0.229, 0.224, 0.225)
IMAGE_EXTENSIONS = (".jpg", ".jpeg", ".png", ".bmp", ".ppm", ".webp")


class ShardedSampler:
    """Steps 1-3 of the module docstring: this worker's index batches for one epoch."""

    def __init__(self, num_samples: int, rank: int, world_size: int, seed: int = 0) -> None:
        if num_samples < world_size:
            raise ValueError(f"num_samples ({num_samples}) must be >= world_size ({world_size})")
        if not 0 <= rank < world_size:
            raise ValueError(f"rank must be in [0, {world_size}), got {rank}")
        self.num_samples, self.rank, self.world_size, self.seed = num_samples, rank, world_size, seed
        self.epoch, self.global_batch, self.position = 0, num_samples, 0
        self._perm: torch.Tensor | None = None

    def set_epoch(self, epoch: int, global_batch: int, position: int = 0) -> None:
        """Start ``epoch`` at global batch ``global_batch``; ``position``: steps already done."""
        if global_batch < self.world_size:
            raise ValueError(f"global_batch ({global_batch}) must be >= world size ({self.world_size})")
        self.epoch, self.global_batch, self.position = epoch, global_batch, position
        # Step 1: same permutation on every worker
        g = torch.Generator().manual_seed(self.seed * 1_000_003 + epoch)
        self._perm = torch.randperm(self.num_samples, generator=g)

    @staticmethod
    def batch_ends(num_samples: int, global_batch: int, world_size: int) -> list[int]:
        """Step 2: end offsets of an epoch's global batches (the one rule,
        :func:`flashsgd.optim.schedules.batch_ends`: a remainder smaller than the world joins the
        last full batch)."""
        return batch_ends(num_samples, global_batch, min_last=world_size)

    def steps(self) -> list[int]:
        """End offsets of this epoch's global batches (:meth:`batch_ends`)."""
        return self.batch_ends(self.num_samples, self.global_batch, self.world_size)

    def __len__(self) -> int:
        return len(self.steps())

    def global_sizes(self) -> list[int]:
        ends = self.steps()
        return [e - s for s, e in zip([0] + ends[:-1], ends)]

    def shard(self, start: int, end: int) -> torch.Tensor:
        """Step 3: this worker's contiguous slice of the global batch perm[start:end]."""
        b, w, r = end - start, self.world_size, self.rank
        lo = start + r * (b // w) + min(r, b % w)
        hi = lo + b // w + (1 if r < b % w else 0)
        assert self._perm is not None, "call set_epoch first"
        return self._perm[lo:hi]

    def __iter__(self):
        ends = self.steps()
        starts = [0] + ends[:-1]
        while self.position < len(ends):
            i = self.position
            self.position += 1  # advance first: a checkpoint taken after this batch resumes after it
            yield self.shard(starts[i], ends[i])

    def state_dict(self) -> dict[str, Any]:
        return {"epoch": self.epoch, "global_batch": self.global_batch, "position": self.position,
                "seed": self.seed, "num_samples": self.num_samples, "world_size": self.world_size}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Continue where ``state`` stopped. From another world size (an elastic resume) the
        position is carried as the global sample offset: the permutation and the global batches
        do not depend on the world size (only a too-small last remainder merges differently), so the
        run continues with the same samples, split over this world's workers."""
        for key in ("seed", "num_samples"):
            if state[key] != getattr(self, key):
                raise ValueError(f"sampler state mismatch: checkpoint {key}={state[key]}, "
                                 f"this run {key}={getattr(self, key)}")
        position = state["position"]
        if state["world_size"] != self.world_size and position:
            old = self.batch_ends(self.num_samples, state["global_batch"], state["world_size"])
            offset = old[position - 1]  # samples of this epoch already trained on
            new = self.batch_ends(self.num_samples, state["global_batch"], self.world_size)
            if offset not in new:
                raise ValueError(
                    f"sampler: the checkpoint (world size {state['world_size']}) stopped after "
                    f"sample {offset} of {self.num_samples} in epoch {state['epoch']}, where no "
                    f"global batch of world size {self.world_size} ends (the last "
                    f"{self.num_samples - offset} samples are fewer than its workers); resume with "
                    f"{state['world_size']} workers")
            position = new.index(offset) + 1
        self.set_epoch(state["epoch"], state["global_batch"], position)


# ------------------------------------------------------------------------------- datasets -------

class TensorSplit:
    """An in-memory split: ``x[indices], y[indices]``."""

    def __init__(self, x: torch.Tensor, y: torch.Tensor) -> None:
        self.x, self.y = x, y

    def __len__(self) -> int:
        return len(self.y)

    def batch(self, idx: torch.Tensor, generator: torch.Generator | None = None, train: bool = True):
        return self.x[idx], self.y[idx]


class SyntheticSplit:
    """``n`` samples drawn from a fixed pool of random images (sample i is pool[i % pool])."""

    def __init__(self, n: int, shape: tuple[int, ...], num_classes: int, seed: int, pool: int = 64) -> None:
        g = torch.Generator().manual_seed(seed)
        self.n = n
        self.pool = torch.randn((pool,) + shape, generator=g)  # (pool, C, H, W)
        self.labels = torch.randint(0, num_classes, (n,), generator=g)

    def __len__(self) -> int:
        return self.n

    def batch(self, idx: torch.Tensor, generator: torch.Generator | None = None, train: bool = True):
        return self.pool[idx % len(self.pool)], self.labels[idx]


def _load_image(path: Path) -> torch.Tensor:
    from PIL import Image

    with Image.open(path) as img:
        arr = np.asarray(img.convert("RGB"), dtype=np.uint8)
    return torch.from_numpy(arr.copy()).permute(2, 0, 1)  # (3, H, W) uint8


def _resize(img: torch.Tensor, size: tuple[int, int]) -> torch.Tensor:
    return F.interpolate(img[None].float(), size=size, mode="bilinear", align_corners=False,
                         antialias=True)[0]


def random_resized_crop(img: torch.Tensor, size: int, g: torch.Generator,
                        scale: tuple[float, float] = (0.08, 1.0),
                        ratio: tuple[float, float] = (3 / 4, 4 / 3)) -> torch.Tensor:
    """Crop a random area fraction in ``scale`` with aspect in ``ratio``, resize to size x size."""
    _, h, w = img.shape
    for _ in range(10):
        u = torch.rand(2, generator=g).tolist()
        area = h * w * (scale[0] + (scale[1] - scale[0]) * u[0])
        aspect = math.exp(math.log(ratio[0]) + (math.log(ratio[1]) - math.log(ratio[0])) * u[1])
        cw, ch = round(math.sqrt(area * aspect)), round(math.sqrt(area / aspect))
        if 0 < cw <= w and 0 < ch <= h:
            i = int(torch.randint(0, h - ch + 1, (1,), generator=g))
            j = int(torch.randint(0, w - cw + 1, (1,), generator=g))
            return _resize(img[:, i:i + ch, j:j + cw], (size, size))
    return center_crop(img, size, resize_to=size)  # fallback: whole image, center


def center_crop(img: torch.Tensor, size: int, resize_to: int | None = None) -> torch.Tensor:
    """Resize the short side to ``resize_to`` (default size*256/224), then take the central square."""
    _, h, w = img.shape
    short = resize_to or round(size * 256 / 224)
    nh, nw = (short, max(short, round(w * short / h))) if h <= w else (max(short, round(h * short / w)), short)
    img = _resize(img, (nh, nw))
    top, left = (nh - size) // 2, (nw - size) // 2
    return img[:, top:top + size, left:left + size]


class ImageFolderSplit:
    """Class subfolders of images; decode with Pillow, augment with torch ops (module docstring)."""

    def __init__(self, files: list[Path], labels: list[int], size: int) -> None:
        self.files, self.labels, self.size = files, torch.tensor(labels, dtype=torch.int64), size
        self.mean = torch.tensor(IMAGENET_MEAN).view(3, 1, 1) * 255
        self.std = torch.tensor(IMAGENET_STD).view(3, 1, 1) * 255

    def __len__(self) -> int:
        return len(self.files)

    def batch(self, idx: torch.Tensor, generator: torch.Generator | None = None, train: bool = True):
        g = generator or torch.Generator().manual_seed(0)
        out = []
        for i in idx.tolist():
            img = _load_image(self.files[i])
            if train:
                img = random_resized_crop(img, self.size, g)
                if float(torch.rand(1, generator=g)) < 0.5:
                    img = img.flip(-1)
            else:
                img = center_crop(img, self.size)
            out.append((img - self.mean) / self.std)
        return torch.stack(out), self.labels[idx]


def scan_folder(root: Path, classes: list[str] | None = None) -> tuple[list[Path], list[int], list[str]]:
    """Files and labels of ``root/<class>/*`` (classes sorted by name)."""
    classes = classes or sorted(d.name for d in root.iterdir() if d.is_dir())
    if not classes:
        raise ValueError(f"data_dir {str(root)!r} has no class subfolders")
    files, labels = [], []
    for k, c in enumerate(classes):
        for f in sorted((root / c).iterdir()) if (root / c).is_dir() else []:
            if f.suffix.lower() in IMAGE_EXTENSIONS:
                files.append(f)
                labels.append(k)
    if not files:
        raise ValueError(f"data_dir {str(root)!r}: no images ({', '.join(IMAGE_EXTENSIONS)}) found")
    return files, labels, classes


@dataclass
class Datasets:
    train: Any
    test: Any
    num_classes: int
    description: str


def build_datasets(dataset: str, num_samples: int = 40000, data_dir: str = "",
                   image_shape: str = "imagenet", image_size: int = 224, data_seed: int = 42) -> Datasets:
    """The train and test splits of ``dataset`` (see the module docstring)."""
    if dataset == "mnist1d":
        from flashsgd.train.mnist1d import load_mnist1d

        x, y, xt, yt = load_mnist1d(num_samples, seed=data_seed, cache_dir_=data_dir or None)
        return Datasets(TensorSplit(x, y), TensorSplit(xt, yt), 10,
                        f"mnist1d {len(y)} train / {len(yt)} test")
    if dataset == "synthetic":
        shape, classes = ((3, 224, 224), 1000) if image_shape == "imagenet" else ((3, 32, 32), 10)
        test_n = max(1, num_samples // 10)
        return Datasets(SyntheticSplit(num_samples, shape, classes, data_seed),
                        SyntheticSplit(test_n, shape, classes, data_seed + 1), classes,
                        f"synthetic {image_shape} {num_samples} x {'x'.join(map(str, shape))}")
    if dataset == "imagefolder":
        root = Path(data_dir)
        if not root.is_dir():
            raise ValueError(f"data_dir {data_dir!r} is not a directory")
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
        return Datasets(ImageFolderSplit(files, labels, image_size),
                        ImageFolderSplit(vfiles, vlabels, image_size), len(classes),
                        f"imagefolder {len(files)} train / {len(vfiles)} val, {len(classes)} classes")
    raise ValueError(f"unknown dataset {dataset!r}; valid choices: mnist1d, synthetic, imagefolder")
