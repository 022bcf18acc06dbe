"""The input pipeline (flashsgd.train.loader, flashsgd.train.images) and where ranks run (launch.local_ranks).

DataLoader workers and the training process produce the same tensors (each sample has its own
augmentation generator); the sampler's position counts batches taken, not prefetched, so a resume
continues exactly; a run on an image folder with worker processes equals one without them.
"""

from __future__ import annotations

import json

import pytest
import torch

from flashsgd import launch
from flashsgd.train.data import ShardedSampler, build_datasets
from flashsgd.train.images import ImageFolderSplit, scan_folder, write_jpeg_folder
from flashsgd.train.loader import BatchStream, default_data_workers, eval_batches


@pytest.fixture(scope="module")
def jpegs(tmp_path_factory):
    root = tmp_path_factory.mktemp("jpegs")
    write_jpeg_folder(root / "train", classes=3, per_class=8, size=(48, 36), seed=1)
    return root


def _split(root, size=16):
    files, labels, _ = scan_folder(root / "train")
    return ImageFolderSplit(files, labels, size)


def _epoch(split, workers, position=0, key=5):
    sampler = ShardedSampler(len(split), rank=1, world_size=2, seed=0)
    sampler.set_epoch(0, global_batch=8, position=position)
    stream = BatchStream(split, workers)
    return [(x, y) for x, y in stream.epoch(sampler, key)], sampler


def test_worker_processes_give_the_in_process_tensors(jpegs):
    split = _split(jpegs)
    here, _ = _epoch(split, 0)
    there, sampler = _epoch(split, 2)
    assert len(here) == len(there) == 3 and sampler.position == 3
    for (xa, ya), (xb, yb) in zip(here, there):
        assert torch.equal(xa, xb) and torch.equal(ya, yb)
    other_epoch, _ = _epoch(split, 0, key=6)  # another epoch: other crops
    assert not torch.equal(here[0][0], other_epoch[0][0])


def test_position_counts_batches_taken_not_prefetched(jpegs):
    split = _split(jpegs)
    full, _ = _epoch(split, 0)
    sampler = ShardedSampler(len(split), rank=1, world_size=2, seed=0)
    sampler.set_epoch(0, global_batch=8)
    stream = BatchStream(split, workers=2)  # prefetches 2 batches per worker
    batches = stream.epoch(sampler, key=5)
    next(batches)
    assert sampler.position == 1 and stream.last_size == 4
    state = sampler.state_dict()
    resumed = ShardedSampler(len(split), rank=1, world_size=2, seed=0)
    resumed.load_state_dict(state)
    rest = list(BatchStream(split, workers=0).epoch(resumed, key=5))
    assert len(rest) == 2 and all(torch.equal(a[0], b[0]) for a, b in zip(full[1:], rest))


def test_eval_batches_through_workers_equal_in_process(jpegs):
    split = _split(jpegs)
    a = list(eval_batches(split, 3, 20, chunk=5, workers=0))
    b = list(eval_batches(split, 3, 20, chunk=5, workers=2))
    assert [len(y) for _, y in a] == [5, 5, 5, 2]
    assert all(torch.equal(xa, xb) and torch.equal(ya, yb) for (xa, ya), (xb, yb) in zip(a, b))


def test_in_memory_splits_stay_in_process_and_move_to_the_device():
    d = build_datasets("synthetic", num_samples=20, image_shape="cifar")
    assert BatchStream(d.train, workers=4).workers == 0
    moved = d.to(torch.device("meta"))  # made where the data lives: nothing is copied per step
    x, y = moved.train.batch(torch.arange(3))
    assert x.device.type == y.device.type == "meta" and d.train.pool.device.type == "cpu"
    with pytest.raises(ValueError, match="data workers must be >= 0"):
        BatchStream(d.train, workers=-1)


def test_default_data_workers_split_the_cores():
    assert default_data_workers(local_ranks=1, cpus=2) == 2
    assert default_data_workers(local_ranks=4, cpus=2) == 1
    assert default_data_workers(local_ranks=8, cpus=128) == 8
    assert default_data_workers(local_ranks=1, cpus=128) == 8


@pytest.mark.parametrize("workers,backend,gpus,expect", [
    (None, "auto", 0, (4, "gloo")), (None, "auto", 8, (8, "nccl")), (2, "auto", 8, (2, "nccl")),
    (8, "auto", 2, (8, "gloo")), (None, "gloo", 8, (4, "gloo")), (None, "nccl", 2, (2, "nccl")),
])
def test_local_ranks_one_per_gpu_over_nccl_else_cpu(workers, backend, gpus, expect):
    ranks, chosen, note = launch.local_ranks(workers, backend, gpus=gpus)
    assert (ranks, chosen) == expect
    assert bool(note) == (workers == 8 and gpus == 2)  # more workers than GPUs: said


def test_local_ranks_refuses_more_nccl_ranks_than_gpus():
    with pytest.raises(ValueError, match=r"run.workers=4 with run.backend='nccl'.*valid: run.workers <= 2"):
        launch.local_ranks(4, "nccl", gpus=2)


def _steps(out):
    rows = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    return [r for r in rows if r.get("kind") == "step"]


def test_training_on_an_image_folder_with_workers_equals_without_and_resumes_exactly(jpegs, tmp_path):
    from flashsgd.train import config as C
    from flashsgd.train.trainer import train

    def cfg(out, **cli):
        base = dict(dataset="imagefolder", data_dir=str(jpegs), image_size=16, model="resnet20",
                    recipe="goyal", global_batch=8, epochs=2.0, workers=2, algorithm="ring",
                    progress=False, deterministic=True, out=str(out), checkpoint_every=100, threads=1)
        return C.resolve(cli={**base, **cli})

    train(cfg(tmp_path / "a", data_workers=2))
    train(cfg(tmp_path / "b", data_workers=0, max_steps=3))  # stopped mid-epoch, then resumed
    train(cfg(tmp_path / "b", data_workers=1))
    a, b = _steps(tmp_path / "a"), _steps(tmp_path / "b")
    assert len(a) == len(b) > 3 and [r["loss"] for r in a] == [r["loss"] for r in b]
    assert all(r["t_data_s"] >= 0 for r in a)
    plan = json.loads((tmp_path / "a" / "plan.json").read_text())
    assert plan["execution"]["data_workers"] == 2


ONE_RANK_RUN = """
import sys
from flashsgd.train import config as C
from flashsgd.train.trainer import train

cfg = C.resolve(cli=dict(dataset="imagefolder", data_dir=sys.argv[1], image_size=16, model="resnet20",
                         recipe="goyal", global_batch=4, workers=1, backend="gloo", max_steps=2,
                         progress=False, out=sys.argv[2], data_workers=0, timeout_s=60.0))
assert train(cfg)["steps"] == 2
"""


def test_a_one_rank_image_run_after_decoding_here_does_not_hang(jpegs, tmp_path):
    """The launching process decodes a batch (check_input) before it forks: with one rank (all
    cores' threads) the rank used to hang in DDP's first broadcast (GNU OpenMP after fork).

    In a fresh process: this one has run parallel regions of earlier tests (any test before this
    file that computes on large tensors), after which every one-rank fork hangs, guarded or not."""
    import subprocess
    import sys

    run = subprocess.run([sys.executable, "-c", ONE_RANK_RUN, str(jpegs), str(tmp_path / "r")],
                         capture_output=True, text=True, timeout=240)
    assert run.returncode == 0, run.stderr[-3000:]
