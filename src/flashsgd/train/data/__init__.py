"""Datasets of `flashsgd train` and the sharded sampler that splits each global batch over workers.

Datasets (:func:`build_datasets`: the catalog entry's loader, :mod:`flashsgd.train.data.sources`,
given the ``[data]`` config whole), each a pair of splits:

* ``mnist1d`` - MNIST-1D generated locally (Greydanus 2020; :func:`flashsgd.train.data.mnist1d.load_mnist1d`).
* ``synthetic`` - random ImageNet-shaped (3x224x224, 1000 classes) or CIFAR-shaped (3x32x32, 10
  classes) images from a small fixed pool: for throughput, not accuracy.
* ``imagefolder`` - ``root/train/<class>/<image>`` (and ``root/val/<class>/...``; without ``val/``
  every 10th image is held out): decoding and the Inception-style augmentation of
  :mod:`flashsgd.train.data.images`, one sample at a time in DataLoader workers
  (:mod:`flashsgd.train.data.loader`).

Splits have ``len()`` and ``batch(indices, train=True, key=0) -> (x, y)`` (``key``: the epoch's
augmentation stream; in-memory splits ignore it); in-memory splits also ``to(device)``: on a CUDA
rank MNIST-1D and the synthetic images are resident on the GPU (a pure throughput run copies
nothing per step).

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

from typing import Any

import torch

from flashsgd.fmt import plural
from flashsgd.optim.schedules import batch_ends
from flashsgd.train.data.catalog import DATASETS
from flashsgd.train.data.sources import Datasets, SyntheticSplit, TensorSplit

__all__ = ["ShardedSampler", "Datasets", "TensorSplit", "SyntheticSplit", "build_datasets", "describe_loading",
           "data_config"]


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

    def remaining(self) -> list[torch.Tensor]:
        """This worker's shards of the epoch's batches from ``position`` on (the position stays)."""
        ends = self.steps()
        starts = [0] + ends[:-1]
        return [self.shard(starts[i], ends[i]) for i in range(self.position, len(ends))]

    def __iter__(self):
        for idx in self.remaining():
            self.position += 1  # advance first: a checkpoint taken after this batch resumes after it
            yield idx

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
                    f"{plural(self.num_samples - offset, 'sample')} are fewer than its workers); resume with "
                    f"{plural(state['world_size'], 'worker')}")
            position = new.index(offset) + 1
        self.set_epoch(state["epoch"], state["global_batch"], position)


# ------------------------------------------------------------------------------- datasets -------

def data_config(data: Any = None, **values: Any) -> Any:
    """``data`` (a :class:`flashsgd.train.config.DataConfig`) itself, or a DataConfig of dataset
    ``data`` (a name) with ``values`` for its other keys (the config's defaults for the rest)."""
    if not isinstance(data, str):
        if values:
            raise TypeError(f"pass a DataConfig or a dataset name with keys, got both ({', '.join(values)})")
        return data
    from flashsgd.train.config import DataConfig

    return DataConfig(dataset=data, **values)


def build_datasets(data: Any, **values: Any) -> Datasets:
    """The train and test splits of the ``[data]`` config ``data`` (or of dataset ``data`` with
    ``values``: ``build_datasets("synthetic", num_samples=20)``): its catalog entry's loader
    (:data:`flashsgd.train.data.catalog.DATASETS`)."""
    d = data_config(data, **values)
    return DATASETS.get(d.dataset).load(d)


def describe_loading(data: Any, **values: Any) -> str:
    """What :func:`build_datasets` (same arguments) is about to do, in words: `flashsgd train`
    says it before the seconds that generating MNIST-1D the first time takes."""
    d = data_config(data, **values)
    return DATASETS.get(d.dataset).describe(d)
