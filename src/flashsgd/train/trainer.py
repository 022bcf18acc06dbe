"""The entry point of `flashsgd train`: DDP + communication hook + large-batch recipe, on W ranks.

Papers: Goyal et al. 2017 (per-worker BN, one shuffle split over workers, loss normalized by the
global batch, linear scaling + warmup), Mikami et al. 2018 (batch-size control, label smoothing,
2D-Torus), Yamazaki et al. 2019 (LARS), Shi et al. 2019 (gTop-k) - via flashsgd.optim and
flashsgd.comm.

:func:`train` builds the :class:`~flashsgd.train.plan.RunPlan` once (before any worker starts),
opens the run directory (:mod:`flashsgd.train.records.rundir`: lock, resume checks, config and plan
written), then runs :class:`~flashsgd.train.worker.Worker` on every rank through
:func:`flashsgd.launch.run` (torchrun's group when present, else one local rank per GPU over NCCL,
each bound to its GPU before the group exists, or W local Gloo processes on the CPU). What one
rank does (Steps 1-6) is in :mod:`flashsgd.train.worker`, its building blocks in
:mod:`flashsgd.train.rank`, the training step in :mod:`flashsgd.train.step`.
"""

from __future__ import annotations

import os
from typing import Any

import torch.distributed as dist

from flashsgd import launch
from flashsgd.train.config import TrainConfig
from flashsgd.fmt import plural
from flashsgd.train.data import Datasets, describe_loading
from flashsgd.train.models import check_input
from flashsgd.train.plan import RunPlan, build_plan
from flashsgd.train.preflight import check_environment
from flashsgd.train.rank import load_data
from flashsgd.train.records.rundir import RunDirError, Start, open_run_dir
from flashsgd.train.worker import Worker


def say_starting(cfg: TrainConfig, workers: int, backend: str) -> None:
    """The first line of a run, printed before the data are made (generating MNIST-1D the first
    time takes seconds): ``flashsgd train: generating MNIST-1D (...) for 4 workers (gloo) ...``.
    It says what happens now, not that workers started: the checks that need the data (model vs
    inputs, the plan, the run directory) can still refuse the run after it."""
    loading = describe_loading(cfg.data)
    print(f"flashsgd train: {loading} for {plural(workers, 'worker')} ({backend}) ...", flush=True)


def worker(plan: RunPlan, data: Datasets, start: Start) -> dict[str, Any]:
    """One rank's run (see :class:`~flashsgd.train.worker.Worker`)."""
    return Worker(plan, data, start).run()


def _torchrun_worker(cfg: TrainConfig) -> dict[str, Any]:
    """Under torchrun (each process is one rank): data, plan and run directory, then the worker.

    Local rank 0 builds the data first (MNIST-1D is generated and cached once per node); rank 0
    opens the run directory and tells every rank how to start (or why not).
    """
    local_rank = int(os.environ.get("LOCAL_RANK", dist.get_rank()))
    if dist.get_rank() == 0:
        say_starting(cfg, dist.get_world_size(), dist.get_backend())
    if local_rank != 0:
        dist.barrier()
    data = load_data(cfg)
    if local_rank == 0:
        dist.barrier()
    check_input(cfg.model.model, cfg.model.channels, data, cfg.data.dataset)
    plan = build_plan(cfg, dist.get_world_size(), len(data.train), local_spawn=False)
    if dist.get_rank() != 0:
        box: list[Any] = [None]
        dist.broadcast_object_list(box, src=0)
        if isinstance(box[0], str):
            raise RunDirError(box[0])
        return worker(plan, data, box[0])
    try:
        with open_run_dir(plan) as start:
            dist.broadcast_object_list([start], src=0)
            if start.kind == "complete":
                print(f"flashsgd train: {start.describe()}", flush=True)
                return start.summary or {}
            return worker(plan, data, start)
    except RunDirError as exc:
        dist.broadcast_object_list([str(exc)], src=0)
        raise


def train(cfg: TrainConfig) -> dict[str, Any]:
    """Run ``cfg``: under torchrun's group if there is one, else on local ranks
    (:func:`flashsgd.launch.local_ranks`: one per visible GPU over NCCL, or ``run.workers`` CPU
    ranks over Gloo).

    On local spawn every check (plan, run directory) happens here, before any process starts;
    a ValueError names the config key. Returns rank 0's summary (this rank's under torchrun).
    """
    check_environment(cfg)  # this machine can run it (outputs, backend, torchvision): exit 2
    r = cfg.run
    backend = None if r.backend == "auto" else r.backend
    if launch.under_torchrun():
        return launch.run(_torchrun_worker, (cfg,), world_size=int(os.environ["WORLD_SIZE"]),
                          backend=backend, timeout_s=r.timeout_s)
    workers, backend, note = launch.local_ranks(r.workers, r.backend)  # one rank per GPU, or CPU ranks
    if note:
        print(f"[flashsgd] {note}", flush=True)
    say_starting(cfg, workers, backend)
    with launch.one_thread():  # before the fork: no OpenMP pool in this process
        data = load_data(cfg)
        check_input(cfg.model.model, cfg.model.channels, data, cfg.data.dataset)  # exit 2, not 4 failed ranks
    plan = build_plan(cfg, workers, len(data.train), local_spawn=True, backend=backend)
    with open_run_dir(plan) as start:
        if start.kind == "complete":
            print(f"flashsgd train: {start.describe()}", flush=True)
            return start.summary or {}
        return launch.run(worker, (plan, data, start), world_size=workers, backend=backend,
                          timeout_s=r.timeout_s)
