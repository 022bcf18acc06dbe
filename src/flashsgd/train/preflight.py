"""What `flashsgd train` checks about this machine before any process starts or any data is made.

The config's own rules (:func:`flashsgd.train.config.validate`) hold on every machine; these depend
on where the run starts, so a saved ``config.toml`` stays readable elsewhere. Each failure is a
ValueError naming the config key and what is valid here (exit 2, one line):

1. ``run.out`` can be written (:func:`flashsgd.outputs.check_output`: not empty, not a file, its
   nearest existing folder writable) and has a name (``/`` has none: nothing to move aside to);
   checked by the process that opens the run directory (rank 0 under torchrun).
2. ``run.backend = nccl`` needs CUDA and a torch built with NCCL.
3. ``model.model = torchvision:NAME`` needs a torchvision that imports (the registry's wheel for
   the CPU torch here does not) and knows NAME.
4. ``data.data_dir`` is usable here: MNIST-1D's cache folder can be written when the cache file is
   not there yet; an image folder is a directory. A checkpoint named by ``run.resume`` is intact
   (:func:`flashsgd.train.records.checkpoint.verify`; checked by the process that opens the run directory).

The trainer announces its work ("flashsgd train: generating MNIST-1D ...") after these steps, so the
checks that need the data also run here, on what the config says about the data before it is
made (:func:`expected_data`: the sample count, and two samples of the right shape), for the
datasets where that is known without reading them (mnist1d, synthetic; an image folder's count is
known only after the scan the trainer announces):

5. the model takes the dataset's input (:func:`flashsgd.train.models.check_input`, on two stand-in
   samples);
6. the plan can be built for this world (:func:`flashsgd.train.plan.build_plan`: the global batch
   against the samples and the workers, the grid, ranks per node, run.fail_at, grad_accum, the
   exchange's options, ``--comm auto``'s cluster). The trainer builds it again from the data it
   made; the two agree because the count here is the data's (a test holds them equal).

What still comes after the start line needs the run directory's lock (another run in it, a run
with other settings in it) or the data themselves (an image folder's classes).

Example::

    >>> check_environment(resolve(cli={"backend": "nccl"}))      # doctest: +SKIP
    ValueError: config key run.backend='nccl' needs CUDA, which this machine does not have ...
"""

from __future__ import annotations

import os
from pathlib import Path

from flashsgd.outputs import check_output
from flashsgd.train.config import TrainConfig

MNIST1D_LENGTH, MNIST1D_CLASSES, MNIST1D_TRAIN_SHARE = 40, 10, 0.8
"""MNIST-1D's format: the ``mnist1d`` package's defaults that
:func:`flashsgd.train.data.mnist1d.generate_mnist1d` uses (``final_seq_length``, one template per class,
``train_split``), stated here so that checking a run does not import the package (2 s of matplotlib
and scipy); ``tests/test_preflight.py`` holds them equal to generated data."""


def check_environment(cfg: TrainConfig) -> None:
    """Steps 1-6 (see the module docstring)."""
    out = cfg.run.out                                                      # Step 1
    if os.environ.get("RANK", "0") == "0":
        check_output(out, "config key run.out (--out)", "dir")
        if not Path(out).resolve().name:
            raise ValueError(f"config key run.out={out!r} is the file-system root; name a directory "
                             "below it (a previous run is moved aside next to it)")
    if cfg.run.backend == "nccl":                                          # Step 2
        import torch
        import torch.distributed as dist

        if not torch.cuda.is_available() or not dist.is_nccl_available():
            why = ("this torch has no NCCL" if torch.cuda.is_available() else
                   f"CUDA is not available here (torch {torch.__version__})")
            raise ValueError(f"config key run.backend='nccl' needs CUDA and NCCL: {why}; valid here: "
                             "auto (picks gloo), gloo")
    name = cfg.model.model                                                 # Step 3
    if name.startswith("torchvision:"):
        from flashsgd.train.models import MODELS

        ours = ", ".join(MODELS.names())
        try:
            import torchvision  # noqa: PLC0415 - optional
        except Exception as exc:  # noqa: BLE001 - a CUDA build on a CPU torch fails in many ways
            reason = (str(exc).strip().splitlines() or [""])[0][:120]
            raise ValueError(f"config key model.model={name!r} needs torchvision, which does not import "
                             f"here ({type(exc).__name__}: {reason}); valid here: {ours}") from None
        try:
            torchvision.models.get_model_builder(name.split(":", 1)[1])
        except ValueError:
            raise ValueError(f"config key model.model={name!r}: torchvision has no such model; valid: "
                             f"{ours}, or torchvision:NAME with NAME in "
                             "torchvision.models.list_models()") from None
    _check_data_dir(cfg)                                                   # Step 4
    _check_resume(cfg)
    _check_with_expected_data(cfg)                                         # Steps 5-6


def _check_data_dir(cfg: TrainConfig) -> None:
    """Step 4: the data's folder is usable here."""
    d = cfg.data
    if d.dataset == "mnist1d":
        from flashsgd.train.data.mnist1d import cache_file

        path = cache_file(d.num_samples, d.data_seed, d.data_dir or None)
        if not path.is_file():  # generated now and written there
            where = "config key data.data_dir" if d.data_dir else \
                "$FLASHSGD_CACHE, else ~/.cache/flashsgd (or config key data.data_dir)"
            check_output(path.parent, f"the MNIST-1D cache folder ({where})", "dir")
    elif d.dataset == "imagefolder" and not Path(d.data_dir).is_dir():
        raise ValueError(f"config key data.data_dir={d.data_dir!r} is not a directory here; dataset "
                         "imagefolder reads a folder with train/<class>/ images (and optionally val/)")


def _check_resume(cfg: TrainConfig) -> None:
    """Step 4: a checkpoint named by ``run.resume`` is intact (the run directory checks it again
    under its lock, :func:`flashsgd.train.records.rundir.decide`, with the same words)."""
    if os.environ.get("RANK", "0") != "0" or cfg.run.resume in ("auto", "never"):
        return
    from flashsgd.train.records import checkpoint as ckpt

    try:
        ckpt.verify(cfg.run.resume)
    except ckpt.CheckpointError as exc:
        raise ValueError(f"config key run.resume: {exc}") from None


def _check_with_expected_data(cfg: TrainConfig) -> None:
    """Steps 5-6 on :func:`expected_data` (nothing where only the data can say)."""
    expected = expected_data(cfg)
    if expected is None:
        return
    from flashsgd import launch
    from flashsgd.train.models import check_input
    from flashsgd.train.plan import build_plan

    stand_in, num_train = expected
    with launch.one_thread():  # before the fork: no OpenMP pool in this process (as the trainer)
        check_input(cfg.model.model, cfg.model.channels, stand_in, cfg.data.dataset)  # Step 5
    world, backend, local = _world(cfg)                                    # Step 6
    build_plan(cfg, world, num_train, local_spawn=local, backend=backend)


def expected_data(cfg: TrainConfig):
    """``(stand_in, num_train)``: two samples of the dataset's shape and class count (a
    :class:`~flashsgd.train.data.Datasets`) and its training-sample count, as the config says before
    the data are made; None where only the data can say (an image folder)."""
    import torch

    from flashsgd.train.data import Datasets, TensorSplit, build_datasets

    d = cfg.data
    if d.dataset == "mnist1d":
        split = TensorSplit(torch.zeros(2, MNIST1D_LENGTH), torch.zeros(2, dtype=torch.long))
        # the generator's own expression: int(n * train_split)
        return Datasets(split, split, MNIST1D_CLASSES, "stand-in"), int(d.num_samples * MNIST1D_TRAIN_SHARE)
    if d.dataset == "synthetic":  # random images from a pool of 64: made in milliseconds
        data = build_datasets(d)
        return data, len(data.train)
    return None


def _world(cfg: TrainConfig) -> tuple[int, str | None, bool]:
    """(ranks, local backend or None, local spawn) of the run, as :func:`flashsgd.train.trainer.train`
    decides them: torchrun's WORLD_SIZE, else :func:`flashsgd.launch.local_ranks`."""
    from flashsgd import launch

    if launch.under_torchrun():
        return int(os.environ["WORLD_SIZE"]), None, False
    workers, backend, _ = launch.local_ranks(cfg.run.workers, cfg.run.backend)
    return workers, backend, True
