"""`flashsgd bench data`: images/s of the image-folder pipeline: in-process vs DataLoader workers, CPU vs GPU decode.

What it answers: how many ImageNet-sized JPEGs per second one rank's pipeline decodes and
augments (random-resized crop to 224, flip, normalize: :mod:`flashsgd.train.data.images`) with the
decoding in the training process (``--data-workers 0``: what the trainer did before it had a
pipeline), with N DataLoader workers decoding on the CPU (:mod:`flashsgd.train.data.loader`), and with
the workers reading bytes while the rank decodes on its GPU (nvJPEG), on the same files. Every
pipeline delivers what a rank trains on: normalized float32 batches on the rank's device (CUDA
when available, else the CPU).

1. Files: ``--data-dir`` (an image folder, ``train/<class>/*`` or ``<class>/*``), or ``--images`` JPEGs
   of ``--photo-size`` (default 500x375, ImageNet's median photo) generated into a temporary folder
   (:func:`flashsgd.train.data.images.write_jpeg_folder`).
2. Pipelines: one :class:`~flashsgd.train.data.loader.BatchStream` per worker count with CPU decoding
   (``decode="host"``), and one per worker count with GPU decoding (``decode="device"``) where
   torchvision decodes JPEG batches on CUDA (:func:`flashsgd.train.data.images.device_decode_unavailable`;
   elsewhere its row says why it is absent); persistent workers started once, each pipeline read
   once untimed (warm-up: worker start, page cache, nvJPEG's first batch). Each worker count's
   GPU row says which of the two the trainer picks by default
   (:func:`flashsgd.train.data.loader.decode_place`, :data:`~flashsgd.train.data.loader.HOST_DECODE_FROM_WORKERS`).
3. Repetitions, interleaved (every pipeline once per repetition, the order rotating): one epoch of
   ``--batch``-image batches through each, timed to a CUDA synchronize on a GPU; images/s =
   images / seconds; the median over repetitions with min and max, the ratio to the in-process
   pipeline of the same repetitions, and GPU decode's ratio to CPU decode with the same workers
   (the measurement the default's break-even comes from).
4. ``--train-steps K``: ``flashsgd train`` of ``--model`` (resnet18) on those files, one rank,
   ``max_steps`` K, with 0 and with the largest worker count: median images/s per step and the
   data wait per step (``t_data_s``: the time the step waited for its batch), from metrics.jsonl
   (steps after the first two).

Example::

    flashsgd bench data --images 512 --data-workers 0,1,2 --reps 3    # + a GPU-decode row on CUDA
    flashsgd bench data --images 256 --train-steps 8
"""

from __future__ import annotations

import argparse
import json
import statistics
import tempfile
import time
from pathlib import Path

from flashsgd.fmt import plural
from flashsgd.outputs import add_output

HELP = "images/s of the image-folder pipeline: in-process decode vs DataLoader workers vs GPU (nvJPEG) decode"


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--data-dir", default="", help="an image folder (train/<class>/* or <class>/*); "
                   "default: generate --images JPEGs in a temporary folder")
    p.add_argument("--images", type=int, default=256, help="JPEGs to generate (default 256)")
    p.add_argument("--photo-size", default="500x375", help="generated JPEGs' WIDTHxHEIGHT (default 500x375)")
    p.add_argument("--image-size", type=int, default=224, help="crop side (default 224)")
    p.add_argument("--batch", type=int, default=32, help="images per batch (default 32)")
    p.add_argument("--data-workers", default="0,2", help="worker counts to compare, 0 = in-process "
                   "(default 0,2)")
    p.add_argument("--reps", type=int, default=3, help="timed epochs per pipeline (default 3)")
    p.add_argument("--train-steps", type=int, default=0, help="also train --model for this many steps "
                   "with 0 and the most workers (default 0: no training)")
    p.add_argument("--model", default="resnet18", help="model of --train-steps (default resnet18)")
    add_output(p, "--json", help="write the results as JSON to PATH", metavar="PATH")


def _workers(spec: str) -> list[int]:
    try:
        counts = sorted({int(v) for v in spec.split(",") if v.strip()})
    except ValueError:
        counts = []
    if not counts or counts[0] < 0:
        raise ValueError(f"--data-workers {spec!r} must be comma-separated integers >= 0, e.g. 0,2")
    return counts


def _photo_size(spec: str) -> tuple[int, int]:
    try:
        w, h = (int(v) for v in spec.lower().split("x"))
    except ValueError:
        w = h = 0
    if w < 1 or h < 1:
        raise ValueError(f"--photo-size {spec!r} must be WIDTHxHEIGHT in pixels, e.g. 500x375")
    return w, h


def _folder(args: argparse.Namespace, tmp: str) -> Path:
    from flashsgd.train.data.images import write_jpeg_folder

    if args.data_dir:
        root = Path(args.data_dir)
        if not root.is_dir():
            raise ValueError(f"--data-dir {args.data_dir!r} is not a directory")
        return root / "train" if (root / "train").is_dir() else root
    classes = 8
    per_class = -(-args.images // classes)
    return write_jpeg_folder(Path(tmp) / "train", classes=classes, per_class=per_class,
                             size=_photo_size(args.photo_size))


def time_pipelines(root: Path, counts: list[int], image_size: int, batch: int, reps: int,
                   device: str | None = None) -> tuple[list[dict], dict]:
    """Steps 2-3: (rows of images/s per worker count with CPU decoding (median, min, max, ratio to
    in-process), the GPU-decode row or ``{"absent": why}``). ``device``: where the batches go
    (default: CUDA when available, else the CPU). The in-process pipeline runs with a one-rank run's
    intra-op threads (all cores), each DataLoader worker with one, and the receiving process with one."""
    import os

    import torch

    from flashsgd.train.data import ShardedSampler
    from flashsgd.train.data.images import ImageFolderSplit, device_decode_unavailable, scan_folder
    from flashsgd.train.data.loader import BatchStream, decode_place

    threads = os.cpu_count() or 1
    dev = torch.device(device or ("cuda" if torch.cuda.is_available() else "cpu"))
    files, labels, _ = scan_folder(root)
    split = ImageFolderSplit(files, labels, image_size)
    n = len(split)
    pipes = {("host", w): BatchStream(split, w, dev, decode="host") for w in counts}
    absent = device_decode_unavailable(dev if device else "cuda")  # auto on a CPU machine: "no CUDA device"
    if absent is None:
        pipes.update({("device", w): BatchStream(split, w, dev, decode="device") for w in counts})
    sampler = ShardedSampler(n, 0, 1, seed=0)

    def epoch(pipe: tuple[str, int], key: int) -> float:
        sampler.set_epoch(key, min(batch, n))
        # in-process: a one-rank run's intra-op threads; with workers this process only receives
        # and normalizes (on a GPU rank: on the device), one thread, no OpenMP spinning beside them
        torch.set_num_threads(threads if pipe[1] == 0 else 1)
        t0 = time.perf_counter()
        for x, _ in pipes[pipe].epoch(sampler, key):
            assert x.shape[-1] == image_size
        if dev.type == "cuda":
            torch.cuda.synchronize(dev)
        return n / (time.perf_counter() - t0)

    order0 = list(pipes)
    for pipe in order0:  # Step 2: warm-up
        epoch(pipe, 0)
    rates: dict[tuple[str, int], list[float]] = {pipe: [] for pipe in order0}
    for r in range(reps):  # Step 3: interleaved, rotating
        k = r % len(order0)
        for pipe in order0[k:] + order0[:k]:
            rates[pipe].append(epoch(pipe, r + 1))
    for stream in pipes.values():  # before any fork (training below): no loader threads left
        stream.close()
    base = statistics.median(rates[("host", 0)]) if counts[0] == 0 else None

    def row(pipe: tuple[str, int], v: list[float]) -> dict:
        return {"decode": pipe[0], "decoder": "nvjpeg" if pipe[0] == "device" else split.decoder,
                "device": str(dev), "data_workers": pipe[1], "images": n,
                "images_per_s": statistics.median(v), "min": min(v), "max": max(v),
                "ratio_to_in_process": statistics.median(v) / base if base else None}

    rows = [row(("host", w), rates[("host", w)]) for w in counts]
    if absent is not None:
        return rows, {"decode": "device", "absent": absent}
    gpu = []
    for w, cpu in zip(counts, rows):
        r = row(("device", w), rates[("device", w)])
        r["ratio_to_cpu_decode"] = r["images_per_s"] / cpu["images_per_s"]
        r["default"] = decode_place(split, dev, None, w)  # what the trainer picks with w workers
        gpu.append(r)
    return rows, gpu


def time_training(root: Path, workers: list[int], model: str, image_size: int, batch: int,
                  steps: int, tmp: str) -> list[dict]:
    """Step 4: per worker count, median images/s and data wait of ``steps`` training steps, each a
    ``flashsgd train`` command of its own (a fresh process: this one has run the pipelines)."""
    import subprocess
    import sys

    rows = []
    for w in workers:
        out = Path(tmp) / f"train-{w}"
        cmd = [sys.executable, "-m", "flashsgd", "train", "--dataset", "imagefolder", "--data-dir", str(root),
               "--image-size", str(image_size), "--model", model, "--recipe", "goyal",
               "--global-batch", str(batch), "--workers", "1", "--backend", "gloo",
               "--data-workers", str(w), "--max-steps", str(steps), "--no-progress",
               "--checkpoint-every", "0", "--out", str(out)]
        proc = subprocess.run(cmd, capture_output=True, text=True, timeout=1800)
        if proc.returncode:
            raise RuntimeError(f"bench data: {' '.join(cmd)} failed (exit {proc.returncode}): "
                               f"{proc.stderr.strip()[-1500:]}")
        rec = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
        done = [r for r in rec if r.get("kind") == "step"]
        steady = done[2:] or done
        rows.append({"data_workers": w, "steps": len(steady),
                     "images_per_s": statistics.median(r["images_per_s"] for r in steady),
                     "data_wait_s": statistics.median(r["t_data_s"] for r in steady),
                     "step_s": statistics.median(r["t_step_s"] for r in steady)})
    return rows


def run(args: argparse.Namespace) -> int:
    from flashsgd.bench.common import run_metadata

    counts = _workers(args.data_workers)
    for name in ("images", "image_size", "batch", "reps"):
        if getattr(args, name) < 1:
            raise ValueError(f"--{name.replace('_', '-')} must be >= 1, got {getattr(args, name)}")
    if args.train_steps < 0:
        raise ValueError(f"--train-steps must be >= 0, got {args.train_steps}")
    with tempfile.TemporaryDirectory(prefix="flashsgd-bench-data-") as tmp:
        root = _folder(args, tmp)
        meta = run_metadata(benchmark="data", data_workers=counts, batch=args.batch,
                            image_size=args.image_size)
        rows, gpu = time_pipelines(root, counts, args.image_size, args.batch, args.reps)
        print(f"# bench data: {rows[0]['images']} images in {root}, crop {args.image_size}, batch "
              f"{args.batch}, normalized on {rows[0]['device']}; {meta['cpu_count']} CPUs, load avg "
              f"{meta['loadavg_1m']:.1f}, torch {meta['torch']}; median of {args.reps} interleaved "
              "epochs after one warm-up epoch")
        print(f"{'decode':>16} {'data workers':>13} {'images/s':>10} {'min..max':>15} {'vs in-process':>14}")
        for r in rows + (gpu if isinstance(gpu, list) else []):
            ratio = "-" if r["ratio_to_in_process"] is None else f"{r['ratio_to_in_process']:.2f}x"
            name = f"{'gpu' if r['decode'] == 'device' else 'cpu'} ({r['decoder']})"
            print(f"{name:>16} {r['data_workers']:>13} {r['images_per_s']:>10.1f} "
                  f"{r['min']:>7.1f}..{r['max']:<7.1f} {ratio:>14}")
        if isinstance(gpu, list):
            print("# gpu decode vs cpu decode with the same data workers: " + ", ".join(
                f"{plural(r['data_workers'], 'worker')} {r['ratio_to_cpu_decode']:.2f}x (default: "
                f"{'gpu' if r['default'] == 'device' else 'cpu'})" for r in gpu))
        else:
            print(f"{'gpu (nvjpeg)':>16} {'-':>13}  absent: {gpu['absent']}")
        train_rows = []
        if args.train_steps:
            train_rows = time_training(root, [counts[0], counts[-1]], args.model, args.image_size,
                                       args.batch, args.train_steps, tmp)
            print(f"# training {args.model}, 1 rank, batch {args.batch}: median over steps 3..{args.train_steps}")
            print(f"{'data workers':>13} {'images/s':>10} {'step s':>8} {'data wait s':>12} {'wait share':>11}")
            for r in train_rows:
                print(f"{r['data_workers']:>13} {r['images_per_s']:>10.2f} {r['step_s']:>8.3f} "
                      f"{r['data_wait_s']:>12.4f} {r['data_wait_s'] / r['step_s']:>10.1%}")
    if args.json:
        Path(args.json).write_text(json.dumps({"meta": meta, "pipeline": rows, "gpu_decode": gpu,
                                               "training": train_rows}, indent=2))
    return 0
