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

Example::

    >>> check_environment(resolve(cli={"backend": "nccl"}))      # doctest: +SKIP
    ValueError: config key run.backend='nccl' needs CUDA, which this machine does not have ...
"""

from __future__ import annotations

import os
from pathlib import Path

from flashsgd.outputs import check_output
from flashsgd.train.config import TrainConfig


def check_environment(cfg: TrainConfig) -> None:
    """Steps 1-3 (see the module docstring)."""
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
