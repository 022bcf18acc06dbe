"""Shared pieces of `flashsgd bench gpu`: the run's sizes, where its ranks run, and row verdicts.

The GPU check (:mod:`flashsgd.bench.gpu`) runs every measurement in ranks started by
:func:`flashsgd.launch.spawn`: NCCL for one rank per GPU, Gloo for several ranks on one GPU (Gloo
carries CUDA tensors; NCCL cannot put two ranks on one device). CUDA ranks are started with the
``spawn`` start method (a process forked after its parent touched CUDA cannot use CUDA), CPU ranks
(``--device cpu``, the CI path) with ``fork``. Every rank makes its tensors on :func:`rank_device`
and reads clocks through :func:`flashsgd.timing.time_ops` (a synchronize before each read).

Example::

    >>> s = GpuSettings.for_device("cpu")
    >>> s.model, s.batch, s.steps
    ('resnet20', 8, 2)
"""

from __future__ import annotations

import dataclasses
import json
import os
import tempfile
from dataclasses import dataclass
from typing import Any, Callable, Sequence

import torch

from flashsgd.exchanges import DEFAULT_DENSITY

RATIO_TARGET = 0.95
"""flashsgd's training step must reach this fraction of a plain loop's images/s (same model,
batch and precision, timed in the same run)."""

MODEL_INPUTS = {"resnet50": ((3, 224, 224), 1000, "imagenet"), "resnet20": ((3, 32, 32), 10, "cifar")}
"""model -> (input shape, classes, synthetic image shape): ImageNet's 224 x 224 crops and 1000
classes for ResNet-50, CIFAR's 32 x 32 and 10 classes for ResNet-20 (He et al. 2016)."""

COLLECTIVE_TIMEOUT_S = 120.0
"""Every collective of a spawned check (and every hook's peer wait) fails after this long, so a
rank that hangs or dies ends its peers' waits instead of the whole check."""


@dataclass(frozen=True)
class GpuSettings:
    """What one run of the check measures, and at what size (picklable: handed to every rank)."""

    device: str
    """"cuda" (the check) or "cpu" (the same code paths at tiny sizes, for tests)."""
    model: str
    """The training check's and the LARS check's model (a name in flashsgd.train.models.MODELS)."""
    batch: int
    """Per-GPU training batch."""
    steps: int
    """Timed repetitions per measured function (median, min and max reported)."""
    warmup: int
    """Untimed calls per measured function before timing (compilation, cuDNN autotuning, DDP's
    bucket rebuild happen here)."""
    numel: int
    """Elements of the selection check's gradient (ResNet-50's 25,557,032 on CUDA)."""
    densities: tuple[float, ...] = (DEFAULT_DENSITY, 0.01)
    """Densities of the selection check (the catalog's default and 10x it)."""
    precisions: tuple[str, ...] = ("fp32", "bf16", "fp16")
    channels_last: tuple[bool, ...] = (False, True)
    compile: tuple[bool, ...] = (False, True)
    torchvision: bool = False
    """Also time torchvision's model of the same name in the plain loop (where it imports)."""
    recipe: str = "goyal"
    """The training step's optimizer and LR (Goyal et al. 2017: momentum SGD, the plain loop's)."""

    @classmethod
    def for_device(cls, device: str, **changes: Any) -> "GpuSettings":
        """Defaults for ``device``: ResNet-50, batch 256 and 25.6M elements on CUDA; ResNet-20,
        batch 8 and 2^18 elements on CPU (seconds, for tests)."""
        from flashsgd.bench.sparse import RESNET50_NUMEL

        if device == "cuda":
            base = cls("cuda", "resnet50", batch=256, steps=20, warmup=5, numel=RESNET50_NUMEL)
        else:
            base = cls("cpu", "resnet20", batch=8, steps=2, warmup=1, numel=2 ** 18)
        return dataclasses.replace(base, **{k: v for k, v in changes.items() if v is not None})

    @property
    def cuda(self) -> bool:
        return self.device == "cuda"


def rank_device(settings: GpuSettings) -> torch.device:
    """This rank's device: GPU 0 for every rank of a CUDA check (several Gloo ranks share it; an
    NCCL rank was bound to its GPU by the launcher), else the CPU."""
    if not settings.cuda:
        return torch.device("cpu")
    if not torch.distributed.is_initialized() or torch.distributed.get_backend() != "nccl":
        torch.cuda.set_device(0)
    return torch.device("cuda", torch.cuda.current_device())


def run_job(fn: Callable, world: int, args: Sequence, settings: GpuSettings, backend: str,
            deadline_s: float | None = None) -> tuple[list[dict], str | None]:
    """``fn(*args, progress)`` on ``world`` ranks (:func:`flashsgd.launch.spawn` with the check's
    start method and collective timeout); returns (rank 0's rows, None), or, when the job fails (a
    rank crashed, hung or raised), (the rows rank 0 had finished, the launcher's diagnosis).

    ``fn`` hands each finished row to :func:`record` with ``progress`` (a file path), so a row
    measured before a crash is kept."""
    from flashsgd.launch import WorkerError, spawn

    fd, progress = tempfile.mkstemp(prefix="flashsgd-bench-gpu-", suffix=".jsonl")
    os.close(fd)
    try:
        rows = spawn(fn, world, (*args, progress), backend=backend, timeout_s=COLLECTIVE_TIMEOUT_S,
                     deadline_s=deadline_s, start_method="spawn" if settings.cuda else "fork")[0]
        return rows, None
    except WorkerError as exc:
        with open(progress) as fh:
            return [json.loads(line) for line in fh if line.strip()], first_line(exc, 300)
    finally:
        os.unlink(progress)


def record(progress: str, row: dict, line: str) -> None:
    """Rank 0: print a finished row's ``line`` and append the row to ``progress`` (see :func:`run_job`)."""
    if torch.distributed.get_rank() == 0:
        print(line, flush=True)
        with open(progress, "a") as fh:
            fh.write(json.dumps(row) + "\n")


def first_line(text: str, limit: int = 200) -> str:
    """The first line of an error, at most ``limit`` characters."""
    line = (str(text).strip().splitlines() or [""])[0]
    return line if len(line) <= limit else line[:limit - 3] + "..."


def verdict(passed: bool | None) -> str:
    """'pass', 'FAIL' or '-' (no target)."""
    return "-" if passed is None else ("pass" if passed else "FAIL")


def cuda_missing() -> str | None:
    """Why this process cannot run the CUDA check, or None when it can."""
    if torch.version.cuda is None:
        return f"torch {torch.__version__} is built without CUDA"
    if not torch.cuda.is_available():
        visible = os.environ.get("CUDA_VISIBLE_DEVICES")
        return (f"torch.cuda.is_available() is False (torch {torch.__version__} built for CUDA "
                f"{torch.version.cuda}; no NVIDIA driver or no visible GPU"
                + (f", CUDA_VISIBLE_DEVICES={visible!r}" if visible is not None else "") + ")")
    return None
