"""The input pipeline of one rank: this rank's batches, decoded beside training instead of before it.

An image folder decoded in the training process stops the model for every JPEG (measured 88-236
images/s per rank for ImageNet-sized files on this VM, a tenth of what one GPU trains). So image
splits (those with a per-sample ``sample(i, train, key)``, :class:`flashsgd.train.data.images.
ImageFolderSplit`) go through ``torch.utils.data.DataLoader`` - as PyTorch's ImageNet example does -
with ``data.data_workers`` worker processes, ``prefetch_factor`` batches each in flight, pinned
memory when the rank trains on CUDA (what makes the ``non_blocking`` copy asynchronous), and
persistent workers (started once per run, not per epoch). In-memory splits (MNIST-1D, synthetic,
tensors) are indexed in the training process: a worker would only add a copy.

Where the images are decoded (``decode``, chosen per rank; :func:`decode_place`):

* ``"device"`` - on a CUDA rank where torchvision decodes JPEG batches there
  (:func:`flashsgd.train.data.images.device_decode_unavailable` is None) and the rank has fewer than
  :data:`HOST_DECODE_FROM_WORKERS` data workers: the workers only read the files' bytes; the rank
  decodes each batch with nvJPEG and crops, flips and resizes on the GPU
  (:meth:`~flashsgd.train.data.images.ImageFolderSplit.decode_batch`). A rank with few CPU cores
  (~250-300 images/s per worker process) is then no longer bound by CPU decoding.
* ``"host"`` - everywhere else: the workers decode and augment (libjpeg-turbo) and hand over
  uint8 crops, copied to the device pinned and non-blocking. With many workers this is the faster
  path: nvJPEG's batched decode runs its Huffman stage on the rank's one CPU thread.

Either way the uint8 batch is normalized on the rank's device (:meth:`~flashsgd.train.data.images.
ImageFolderSplit.normalize`: one fused op, constants made once per device), straight into
``channels_last`` when the run uses it (``channels_last=True``: the step's conversion is then a
no-op). Evaluation (:func:`eval_batches`) goes the same way, without augmentation.

Order and resume: the batches are the :class:`~flashsgd.train.data.ShardedSampler`'s, in its order
(the DataLoader's ``batch_sampler`` is this epoch's remaining shards), and each sample's
augmentation has its own generator (:func:`flashsgd.train.data.images.sample_generator`), so the
tensors are the same with 0 or N workers and after a resume (with host decoding bit for bit; the
device path crops the same windows from nvJPEG's pixels). The sampler's position advances when
the training loop *takes* a batch, not when a worker prefetches it: a checkpoint resumes after the
last batch trained on.

Cost: with W workers decoding in parallel the rank waits only for the part of decoding that W
processes cannot hide behind its step (the step's ``t_data_s`` in metrics.jsonl; with device
decoding, nvJPEG's time is in it); each worker holds ``prefetch_factor`` batches of uint8 images
(B/W x 3 x 224 x 224 bytes: 4.8 MB at 32 images) or of encoded files (about 110 KB per ImageNet JPEG).

Example::

    stream = BatchStream(split, workers=2, device=torch.device("cuda", 0), channels_last=True)
    for x, y in stream.epoch(sampler, key=augmentation_key(seed, epoch)):
        ...   # sampler.position is the number of batches taken
"""

from __future__ import annotations

import os
from typing import Any, Iterator, Literal, Sequence

import torch
from torch.utils.data import DataLoader, Dataset, default_collate

PREFETCH = 2
"""Batches in flight per worker (DataLoader's ``prefetch_factor`` default)."""
MAX_AUTO_WORKERS = 8
"""``data.data_workers`` unset: at most this many per rank (PyTorch's ImageNet example uses 4-8 per GPU)."""
Decode = Literal["host", "device"]


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


HOST_DECODE_FROM_WORKERS = 7
"""From this many data workers a rank decodes on the host even where nvJPEG is available. Measured
by ``flashsgd bench data --images 512 --data-workers 0,4,8,16`` on an NVIDIA H100 node (16 CPUs,
torch 2.11, torchvision 0.26, crop 224, batch 32): CPU decode 1,252 / 2,404 / 3,910 images/s with
4 / 8 / 16 workers (245-313 per worker), nvJPEG 2,019 images/s (16 workers reading bytes), i.e.
0.52x CPU decode at 16 workers; the two meet near 7 workers (7 x ~300 = ~2,100)."""


def decode_place(split: Any, device: torch.device, decode: Decode | None = None,
                 workers: int = 0) -> Decode:
    """Where ``split``'s images are decoded for a rank on ``device`` with ``workers`` data workers
    (module docstring): ``decode`` when given (``"device"`` on the CPU decodes there from the
    bytes: the same tensors as ``"host"``), else ``"device"`` exactly when torchvision decodes JPEG
    batches on ``device`` and ``workers`` < :data:`HOST_DECODE_FROM_WORKERS`."""
    if decode not in (None, "host", "device"):
        raise ValueError(f"decode must be 'host' or 'device' (None: device where possible), got {decode!r}")
    if not (streams(split) and callable(getattr(split, "read", None))):
        if decode == "device":
            raise ValueError(f"decode='device' needs a split that reads encoded files, not {type(split).__name__}")
        return "host"
    if decode is None:
        from flashsgd.train.data.images import device_decode_unavailable

        if workers >= HOST_DECODE_FROM_WORKERS or device_decode_unavailable(device):
            return "host"
        return "device"
    return decode


class _Samples(Dataset):
    """What a DataLoader worker runs: ``(key, i) -> split.sample(i, train, key)`` (host decoding),
    or ``split.read(i)`` (device decoding: the encoded bytes)."""

    def __init__(self, split: Any, train: bool, encoded: bool = False) -> None:
        self.split, self.train, self.encoded = split, train, encoded

    def __len__(self) -> int:
        return len(self.split)

    def __getitem__(self, item: tuple[int, int]):
        key, i = item
        return self.split.read(i) if self.encoded else self.split.sample(i, self.train, key)

    def collate(self, items: list) -> tuple[Any, torch.Tensor]:
        """The batch of ``items``: stacked uint8 crops, or (the files differ in length) a list of
        encoded files; the labels stacked."""
        if not self.encoded:
            return default_collate(items)
        return [d for d, _ in items], torch.stack([y for _, y in items])


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


def _loader(samples: _Samples, batches: Any, workers: int, pin_memory: bool, persistent: bool) -> DataLoader:
    return DataLoader(samples, batch_sampler=batches, num_workers=workers, collate_fn=samples.collate,
                      pin_memory=pin_memory, prefetch_factor=PREFETCH, persistent_workers=persistent,
                      worker_init_fn=_one_thread)


def _raw(samples: _Samples, items: list[list[tuple[int, int]]], loader: DataLoader | None) -> Iterator:
    """The batches of ``items`` as the workers hand them over (``loader``), or made here alike."""
    if loader is not None:
        return iter(loader)
    return (samples.collate([samples[item] for item in batch]) for batch in items)


def _on_device(samples: _Samples, raw: tuple[Any, torch.Tensor], idx: Sequence[int], key: int,
               device: torch.device, channels_last: bool) -> tuple[torch.Tensor, torch.Tensor]:
    """One handed-over batch -> (normalized float32 x, labels) on ``device``: the encoded files
    decoded and augmented there, or the uint8 crops copied there (pinned by the loader on CUDA:
    asynchronous); then :meth:`normalize` into ``channels_last`` when asked."""
    x, y = raw
    split = samples.split
    if samples.encoded:
        x = split.decode_batch(x, idx, samples.train, key, device)
    else:
        x = x.to(device, non_blocking=True)
    return split.normalize(x, channels_last), y.to(device, non_blocking=True)


class BatchStream:
    """One rank's training batches (module docstring): ``workers`` DataLoader processes for
    per-sample splits, the training process itself otherwise (or with ``workers=0``).

    Args:
        split: the training split.
        workers: DataLoader processes (0: in this process).
        device: where the batches go (default the CPU).
        channels_last: image batches in ``torch.channels_last`` (``run.channels_last``).
        decode: ``"host"`` or ``"device"`` (:func:`decode_place`; None: ``"device"`` with few workers where torchvision
            decodes on ``device``). In-memory splits: ``"host"``.
    """

    def __init__(self, split: Any, workers: int, device: torch.device | None = None,
                 channels_last: bool = False, decode: Decode | None = None) -> None:
        if workers < 0:
            raise ValueError(f"data workers must be >= 0 (0: decode in the training process), got {workers}")
        self.split = split
        self.workers = workers if streams(split) else 0
        self.device = torch.device(device) if device is not None else torch.device("cpu")
        self.channels_last = channels_last
        self.decode = decode_place(split, self.device, decode, workers)
        self._samples = _Samples(split, True, encoded=self.decode == "device") if streams(split) else None
        self._batches = _Batches()
        self._loader = (_loader(self._samples, self._batches, self.workers, self.device.type == "cuda",
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
        if self._samples is None:
            parts = (self.split.batch(idx, True, key) for idx in shards)
        else:
            items = [[(key, i) for i in idx.tolist()] for idx in shards]
            self._batches.batches = items
            parts = (_on_device(self._samples, raw, [i for _, i in batch], key, self.device, self.channels_last)
                     for batch, raw in zip(items, _raw(self._samples, items, self._loader)))
        for idx, (x, y) in zip(shards, parts):
            sampler.position += 1  # taken: a checkpoint from here on resumes after this batch
            self.last_size = len(idx)
            yield x, y


def eval_batches(split: Any, lo: int, hi: int, chunk: int, workers: int, device: torch.device | None = None,
                 channels_last: bool = False,
                 decode: Decode | None = None) -> Iterator[tuple[torch.Tensor, torch.Tensor]]:
    """(x, y) on ``device`` (default the CPU) of samples ``lo..hi-1`` of ``split`` in chunks of
    ``chunk``, without augmentation; per-sample splits through ``workers`` DataLoader processes
    (started for this pass), handed over as uint8 crops or encoded files (``decode``, as
    :class:`BatchStream`) and normalized on ``device``."""
    device = torch.device(device) if device is not None else torch.device("cpu")
    starts = range(lo, hi, chunk)
    if not streams(split):
        for i in starts:
            x, y = split.batch(torch.arange(i, min(i + chunk, hi)), False)
            yield x.to(device, non_blocking=True), y.to(device, non_blocking=True)
        return
    if hi <= lo:
        return
    samples = _Samples(split, False, encoded=decode_place(split, device, decode, workers) == "device")
    items = [[(0, j) for j in range(i, min(i + chunk, hi))] for i in starts]
    loader = (_loader(samples, items, min(workers, len(items)), device.type == "cuda", persistent=False)
              if workers else None)
    for batch, raw in zip(items, _raw(samples, items, loader)):
        yield _on_device(samples, raw, [i for _, i in batch], 0, device, channels_last)
