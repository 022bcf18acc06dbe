"""The input pipeline of one rank: this rank's batches, decoded beside training instead of before it.

An image folder decoded in the training process stops the model for every JPEG (measured 88-236
images/s per rank for ImageNet-sized files on this VM, a tenth of what one GPU trains). So image
splits (those with a per-sample ``sample(i, train, key)``, :class:`flashsgd.train.images.
ImageFolderSplit`) go through ``torch.utils.data.DataLoader`` - as PyTorch's ImageNet example does -
with ``data.data_workers`` worker processes, ``prefetch_factor`` batches each in flight, pinned
memory when the rank trains on CUDA (what makes the step's ``non_blocking`` copy asynchronous), and
persistent workers (started once per run, not per epoch). Workers hand over uint8 crops; the
rank normalizes them on its device after the copy (:meth:`flashsgd.train.images.ImageFolderSplit.
normalize`: a quarter of the bytes through shared memory and over PCIe). In-memory splits (MNIST-1D, synthetic,
tensors) are indexed in the training process: a worker would only add a copy.

Order and resume: the batches are the :class:`~flashsgd.train.data.ShardedSampler`'s, in its order
(the DataLoader's ``batch_sampler`` is this epoch's remaining shards), and each sample's
augmentation has its own generator (:func:`flashsgd.train.images.sample_generator`), so the
tensors are the same with 0 or N workers and after a resume. The sampler's position advances when
the training loop *takes* a batch, not when a worker prefetches it: a checkpoint resumes after the
last batch trained on.

Cost: with W workers decoding in parallel the rank waits only for the part of decoding that W
processes cannot hide behind its step (the step's ``t_data_s`` in metrics.jsonl); each worker holds
``prefetch_factor`` batches of uint8 images (B/W x 3 x 224 x 224 bytes: 4.8 MB at 32 images).

Example::

    stream = BatchStream(split, workers=2, device=torch.device("cuda", 0))
    for x, y in stream.epoch(sampler, key=augmentation_key(seed, epoch)):
        ...   # sampler.position is the number of batches taken
"""

from __future__ import annotations

import os
from typing import Any, Iterator

import torch
from torch.utils.data import DataLoader, Dataset

PREFETCH = 2
"""Batches in flight per worker (DataLoader's ``prefetch_factor`` default)."""
MAX_AUTO_WORKERS = 8
"""``data.data_workers`` unset: at most this many per rank (PyTorch's ImageNet example uses 4-8 per GPU)."""


def default_data_workers(local_ranks: int, cpus: int | None = None) -> int:
    """``data.data_workers`` unset: this node's cores split over its ranks, 1 to
    :data:`MAX_AUTO_WORKERS` per rank (a rank's own process mostly waits on its device)."""
    cpus = cpus or os.cpu_count() or 1
    return max(1, min(MAX_AUTO_WORKERS, cpus // max(1, local_ranks)))


def augmentation_key(seed: int, epoch: int) -> int:
    """The augmentation stream of ``epoch`` of a run seeded ``seed`` (one per epoch: every epoch
    sees new crops; the same on every rank and world size)."""
    return seed * 7919 + epoch


def streams(split: Any) -> bool:
    """True when ``split`` is decoded per sample (goes through worker processes)."""
    return callable(getattr(split, "sample", None))


class _Samples(Dataset):
    """What a DataLoader worker runs: ``(key, i) -> split.sample(i, train, key)``."""

    def __init__(self, split: Any, train: bool) -> None:
        self.split, self.train = split, train

    def __len__(self) -> int:
        return len(self.split)

    def __getitem__(self, item: tuple[int, int]):
        key, i = item
        return self.split.sample(i, self.train, key)


class _Batches:
    """The DataLoader's ``batch_sampler``: the batches of the epoch being read (set before each
    ``iter(loader)``; persistent workers re-read it every epoch)."""

    def __init__(self) -> None:
        self.batches: list[list[tuple[int, int]]] = []

    def __iter__(self):
        return iter(self.batches)

    def __len__(self) -> int:
        return len(self.batches)


def _one_thread(_: int) -> None:
    torch.set_num_threads(1)  # W workers x N intra-op threads would oversubscribe the cores


def _loader(split: Any, train: bool, batches: Any, workers: int, pin_memory: bool,
            persistent: bool) -> DataLoader:
    return DataLoader(_Samples(split, train), batch_sampler=batches, num_workers=workers,
                      pin_memory=pin_memory, prefetch_factor=PREFETCH, persistent_workers=persistent,
                      worker_init_fn=_one_thread)


class BatchStream:
    """One rank's training batches (module docstring): ``workers`` DataLoader processes for
    per-sample splits, the training process itself otherwise (or with ``workers=0``)."""

    def __init__(self, split: Any, workers: int, device: torch.device | None = None) -> None:
        if workers < 0:
            raise ValueError(f"data workers must be >= 0 (0: decode in the training process), got {workers}")
        self.split = split
        self.workers = workers if streams(split) else 0
        self._batches = _Batches()
        self.device = device or torch.device("cpu")
        self._loader = (_loader(split, True, self._batches, self.workers, self.device.type == "cuda",
                                persistent=True) if self.workers else None)
        self.last_size = 0
        """Samples in the batch taken last (this rank's shard)."""

    def close(self) -> None:
        """Stop the worker processes now (before this process forks: a fork must not copy the
        loader's queue threads). Idempotent; the stream cannot be read afterwards."""
        if self._loader is not None and self._loader._iterator is not None:
            self._loader._iterator._shutdown_workers()
        self._loader = None

    def epoch(self, sampler, key: int) -> Iterator[tuple[torch.Tensor, torch.Tensor]]:
        """(x, y) for each remaining shard of ``sampler``'s epoch, advancing its position per batch
        taken; ``key``: the epoch's augmentation stream (:func:`augmentation_key`)."""
        shards = sampler.remaining()
        if self._loader is None:
            parts = (self.split.batch(idx, True, key) for idx in shards)
        else:
            self._batches.batches = [[(key, i) for i in idx.tolist()] for idx in shards]
            parts = ((self.split.normalize(x.to(self.device, non_blocking=True)),
                      y.to(self.device, non_blocking=True)) for x, y in self._loader)
        for idx, (x, y) in zip(shards, parts):
            sampler.position += 1  # taken: a checkpoint from here on resumes after this batch
            self.last_size = len(idx)
            yield x, y


def eval_batches(split: Any, lo: int, hi: int, chunk: int, workers: int,
                 pin_memory: bool = False) -> Iterator[tuple[torch.Tensor, torch.Tensor]]:
    """(x, y) of samples ``lo..hi-1`` of ``split`` in chunks of ``chunk``, without augmentation;
    per-sample splits through ``workers`` DataLoader processes (started for this pass)."""
    starts = range(lo, hi, chunk)
    if not (workers and streams(split)) or hi <= lo:
        for i in starts:
            yield split.batch(torch.arange(i, min(i + chunk, hi)), False)
        return
    batches = [[(0, j) for j in range(i, min(i + chunk, hi))] for i in starts]
    for x, y in _loader(split, False, batches, min(workers, len(batches)), pin_memory, persistent=False):
        yield split.normalize(x), y
