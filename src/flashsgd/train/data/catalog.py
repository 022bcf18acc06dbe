"""The catalog of datasets `flashsgd train` trains on: one entry each, read by everything else.

An entry says which of the ``[data]`` keys the dataset reads, whether its samples are 4-D images
(where ``run.channels_last`` means something), whether it lives in memory (indexed in the training
process; else read by DataLoader workers, ``data.data_workers``), its config checks, its loader and
its start-up description (functions of the ``[data]`` config whole, :mod:`flashsgd.train.data.sources`).
The config's ``dataset`` choices and help (:func:`describe_all`), :func:`flashsgd.train.config.validate`,
config.toml's "keys this run reads" (:func:`flashsgd.train.config.file.applies`), the plan's
channels_last and data-workers rules and :func:`flashsgd.train.data.build_datasets` read it. Adding a
dataset is its loader (and description) and one entry below; a new ``[data]`` key is its field in
:class:`flashsgd.train.config.DataConfig` and the ``reads`` of the entries whose loaders read it.

=============== ========================================================= ======== =========
``mnist1d``     MNIST-1D (Greydanus 2020), generated once and cached       1-D      in memory
``synthetic``   random ImageNet- or CIFAR-shaped images (throughput runs)  images   in memory
``imagefolder`` an ImageFolder tree of JPEGs (train/ and val/ or held out)  images   workers
=============== ========================================================= ======== =========

Example::

    >>> DATASETS.get("imagefolder").reads
    ('data_dir', 'image_size', 'data_workers')
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable

from flashsgd.registry import Registry
from flashsgd.train.data.sources import (Datasets, describe_image_folder, describe_mnist1d, describe_synthetic,
                                         image_folder_splits, load_mnist1d_splits, synthetic_splits)


def _no_check(data: Any) -> None:
    return None


@dataclass(frozen=True)
class Dataset:
    """One dataset: what it reads and is, its loader and its description."""

    name: str
    summary: str
    reads: tuple[str, ...]
    """The ``[data]`` keys it reads (besides ``dataset``)."""
    images: bool
    """Its samples are 4-D (N, C, H, W) images: ``run.channels_last`` applies."""
    in_memory: bool
    """Indexed in the training process (no DataLoader workers: ``data.data_workers`` is not read)."""
    load: Callable[[Any], Datasets]
    """``(DataConfig) -> Datasets``: the train and test splits (reads only the keys in ``reads``)."""
    describe: Callable[[Any], str]
    """``(DataConfig) -> str``: what loading it is about to do, in words (the start-up line)."""
    check: Callable[[Any], None] = _no_check
    """``(DataConfig) -> None``: a ValueError naming the key when the settings cannot work."""


def _check_mnist1d(d: Any) -> None:
    if d.num_samples % 10:
        raise ValueError(f"config key data.num_samples must be a multiple of 10 for mnist1d, got {d.num_samples}")


def _check_imagefolder(d: Any) -> None:
    if not d.data_dir:
        raise ValueError("config key data.data_dir is required for dataset 'imagefolder' "
                         "(a folder with train/<class>/ images)")


DATASETS: Registry[Dataset] = Registry("dataset")
for _d in (
    Dataset("mnist1d", "MNIST-1D (Greydanus 2020): 40-value 1-D signals, 10 classes",
            reads=("num_samples", "data_dir", "data_seed"), images=False, in_memory=True,
            load=load_mnist1d_splits, describe=describe_mnist1d, check=_check_mnist1d),
    Dataset("synthetic", "random images of ImageNet's or CIFAR's shape (throughput runs)",
            reads=("num_samples", "image_shape", "data_seed"), images=True, in_memory=True,
            load=synthetic_splits, describe=describe_synthetic),
    Dataset("imagefolder", "an ImageFolder tree of JPEGs, decoded and augmented by DataLoader workers",
            reads=("data_dir", "image_size", "data_workers"), images=True, in_memory=False,
            load=image_folder_splits, describe=describe_image_folder, check=_check_imagefolder),
):
    DATASETS.add(_d.name, _d)
del _d


def dataset_keys() -> set[str]:
    """The ``[data]`` keys some dataset reads (a key no entry names is read by every dataset)."""
    return {key for d in DATASETS.values() for key in d.reads}


def describe_all() -> str:
    """One clause per dataset (``name: summary``): the help of the ``--dataset`` flag."""
    return "; ".join(f"{name}: {d.summary}" for name, d in DATASETS.items())
