"""The input pipeline (flashsgd.train.data.loader, flashsgd.train.data.images) and where ranks run (launch.local_ranks).

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
from flashsgd.train.data.images import ImageFolderSplit, scan_folder, write_jpeg_folder
from flashsgd.train.data.loader import BatchStream, default_data_workers, eval_batches


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


# ------------------------------------------------------------------ issue 31 item 5 -------------
# The CPU path is unchanged: uint8 crops of the committed JPEGs (tests/data/jpegs: 2 classes x 3,
# 40x30, Pillow quality 90) as the pipeline made them before device decoding existed (sha256 of the
# stacked (6, 3, 24, 24) tensors, computed with that code; libjpeg-turbo's decode is bit-exact
# across its versions). Train: stream 7; eval: center crop.
GOLDEN = {"train": "c8e30a9b40c3f6830aeced639090388f7a85cc6174ba9fa57892ba57a2b34e52",
          "eval": "6cdc6bb78ae058cb03ac46dfdcb76208707ea0921812853845946266bfec6c71"}
NORMALIZE_ATOL = 1e-6
"""|normalize - (x - 255 mean) / (255 std)| over every level of every channel: 4 float32 ulps at
the largest |value| (2.64); measured 4.8e-7 on the CPU (two roundings against the former two)."""


def test_cpu_decode_and_augmentation_are_bit_identical_to_before():
    import hashlib
    from pathlib import Path

    files, labels, _ = scan_folder(Path(__file__).parent / "data" / "jpegs")
    split = ImageFolderSplit(files, labels, 24, how="pillow")
    for name, train in (("train", True), ("eval", False)):
        x = torch.stack([split.sample(i, train, 7)[0] for i in range(len(split))])
        assert x.dtype == torch.uint8 and hashlib.sha256(x.numpy().tobytes()).hexdigest() == GOLDEN[name]


def test_device_normalization_equals_the_former_cpu_formula_and_is_channels_last_when_asked(jpegs):
    from flashsgd.train.data.images import IMAGENET_MEAN, IMAGENET_STD

    split = _split(jpegs)
    levels = torch.arange(256, dtype=torch.uint8).repeat(2, 3, 1, 1)  # (2, 3, 1, 256): every level
    old = levels.float().sub_(torch.tensor(IMAGENET_MEAN).view(3, 1, 1) * 255).div_(
        torch.tensor(IMAGENET_STD).view(3, 1, 1) * 255)
    new = split.normalize(levels)
    assert new.dtype == torch.float32 and (new - old).abs().max() <= NORMALIZE_ATOL
    x = torch.stack([split.sample(i, True, 3)[0] for i in range(4)])  # (4, 3, 16, 16)
    cl = split.normalize(x, channels_last=True)
    assert cl.is_contiguous(memory_format=torch.channels_last) and not cl.is_contiguous()
    assert torch.equal(cl, split.normalize(x))
    assert cl.contiguous(memory_format=torch.channels_last).data_ptr() == cl.data_ptr()  # the step copies nothing
    scale, _ = split.constants(x.device)
    split.normalize(x)
    assert split.constants(x.device)[0] is scale  # made once per device, not per batch
    import pickle

    assert pickle.loads(pickle.dumps(split))._constants == {}  # workers get no device tensors


@pytest.mark.parametrize("workers", [0, 2])
def test_decoding_from_bytes_in_the_receiving_process_gives_the_worker_tensors(jpegs, workers):
    """decode='device' on the CPU: workers only read the files, this process decodes (Pillow here,
    nvJPEG on a CUDA rank) and augments - the same tensors as decoding in the workers, bit for bit."""
    split = _split(jpegs)
    host, _ = _epoch(split, 0)
    sampler = ShardedSampler(len(split), rank=1, world_size=2, seed=0)
    sampler.set_epoch(0, global_batch=8)
    stream = BatchStream(split, workers, decode="device", channels_last=True)
    got = list(stream.epoch(sampler, key=5))
    assert stream.decode == "device" and sampler.position == len(got) == len(host)
    for (xa, ya), (xb, yb) in zip(host, got):
        assert torch.equal(xa, xb) and torch.equal(ya, yb) and xb.is_contiguous(memory_format=torch.channels_last)
    a = list(eval_batches(split, 3, 20, chunk=5, workers=0))
    b = list(eval_batches(split, 3, 20, chunk=5, workers=workers, decode="device", channels_last=True))
    assert all(torch.equal(xa, xb) and torch.equal(ya, yb) for (xa, ya), (xb, yb) in zip(a, b))


def test_decode_place_is_the_host_without_cuda_and_checked():
    from flashsgd.train.data.images import device_decode_unavailable

    d = build_datasets("synthetic", num_samples=20, image_shape="cifar")
    assert BatchStream(d.train, 0).decode == "host"
    assert "not to a CUDA device" in device_decode_unavailable(torch.device("cpu"))
    with pytest.raises(ValueError, match="decode must be 'host' or 'device'"):
        BatchStream(d.train, 0, decode="gpu")
    with pytest.raises(ValueError, match="needs a split that reads encoded files"):
        BatchStream(d.train, 0, decode="device")


def _eval_rank(root, precision):
    from flashsgd.train.models import build_model
    from flashsgd.train.rank import evaluate
    from flashsgd.train.step import PRECISIONS

    torch.manual_seed(0)
    model = build_model("resnet20", 3, 8).to(memory_format=torch.channels_last)
    seen = []
    model.register_forward_hook(lambda m, inp, out: seen.append(
        (inp[0].is_contiguous(memory_format=torch.channels_last), out.dtype)))
    acc, loss = evaluate(model, _split(root), 0, 1, torch.device("cpu"), workers=1,
                         autocast=PRECISIONS[precision], channels_last=True)
    return acc, loss, seen


def test_evaluation_runs_under_the_training_autocast_on_cpu(jpegs, run_ranks):
    (acc32, loss32, seen32), = run_ranks(_eval_rank, 1, jpegs, "fp32")
    (acc16, loss16, seen16), = run_ranks(_eval_rank, 1, jpegs, "bf16")
    assert {s for s in seen32} == {(True, torch.float32)}  # channels_last input, fp32 without autocast
    assert {s for s in seen16} == {(True, torch.bfloat16)}  # under bf16 autocast
    assert 0 <= acc16 <= 100 and loss16 == pytest.approx(loss32, rel=0.05)


def test_default_decode_place_follows_the_worker_count(tmp_path, monkeypatch):
    """Where nvJPEG is available the default decodes on the device below HOST_DECODE_FROM_WORKERS
    data workers and on the host from there (nvJPEG: 0.52x CPU decode with 16 workers, H100)."""
    from flashsgd.train.data import images
    from flashsgd.train.data.loader import HOST_DECODE_FROM_WORKERS, decode_place

    images.write_jpeg_folder(tmp_path / "train", classes=1, per_class=2, size=(40, 30), seed=0)
    files, labels, _ = images.scan_folder(tmp_path / "train")
    split = images.ImageFolderSplit(files, labels, 16)
    monkeypatch.setattr(images, "device_decode_unavailable", lambda device: None)
    dev = torch.device("cpu")
    assert [decode_place(split, dev, None, w) for w in (0, HOST_DECODE_FROM_WORKERS - 1)] == ["device"] * 2
    assert decode_place(split, dev, None, HOST_DECODE_FROM_WORKERS) == "host"
    assert decode_place(split, dev, "device", 16) == "device"  # asked for: kept
