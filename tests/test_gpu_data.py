"""GPU tests of the image pipeline (issue 31 item 5; all marked ``gpu``: skipped without CUDA, run
them with ``pytest -m gpu``): torchvision decodes JPEG batches on this GPU (nvJPEG), its pixels are
close to the CPU decoder's, the device-side crops are close to the CPU crops, and a training batch
arrives normalized on CUDA in channels_last (the step's conversion is then no copy); evaluation
batches too, and the host-decode path normalizes on CUDA what the CPU normalizes.

Tolerances: nvJPEG and libjpeg(-turbo) implement the IDCT and the chroma upsampling differently, so
one JPEG decodes to pixels a few levels apart (more at edges): each image's mean absolute
difference must stay under :data:`LEVELS` uint8 levels (measured on an H100, torch 2.11 +
torchvision 0.26: up to 4.46 levels for the whole decoded photos of this fixture, 3.13 for the
training crops, 3.28 after normalization; a channel swap, a shifted crop window or a wrong resize
gives tens of levels). The crops then take the same
windows (same generator, same decoded size); the resize on the GPU goes through float32, on the
CPU through torch's uint8 kernel (within one level of each other), so the same bound holds after
augmentation. Normalization of the same uint8 batch on CUDA and on the CPU: within 1e-6.
"""

from __future__ import annotations

import pytest
import torch

from flashsgd.train.data import ShardedSampler
from flashsgd.train.data.images import (IMAGENET_STD, ImageFolderSplit, decode_bytes, decode_on,
                                   device_decode_unavailable, scan_folder, write_jpeg_folder)
from flashsgd.train.data.loader import BatchStream, eval_batches

pytestmark = pytest.mark.gpu

LEVELS = 6.0
"""Largest mean |GPU - CPU| per image, in uint8 levels (the module docstring: measured <= 4.46)."""
STD_255 = torch.tensor(IMAGENET_STD).view(3, 1, 1) * 255


def _cuda() -> torch.device:
    return torch.device("cuda", torch.cuda.current_device())


@pytest.fixture(scope="module")
def photos(tmp_path_factory):
    root = tmp_path_factory.mktemp("photos")
    write_jpeg_folder(root / "train", classes=2, per_class=8, size=(200, 150), seed=2)
    files, labels, _ = scan_folder(root / "train")
    return ImageFolderSplit(files, labels, 64)


def _mean_levels(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """Per image (leading dim) mean |a - b| of uint8 images, in levels."""
    return (a.cpu().int() - b.cpu().int()).abs().float().flatten(1).mean(1)


def test_torchvision_decodes_jpeg_batches_on_this_gpu():
    assert device_decode_unavailable(_cuda()) is None


def test_nvjpeg_pixels_are_close_to_the_cpu_decoders(photos):
    datas = [photos.read(i)[0] for i in range(len(photos))]
    gpu = decode_on(datas, _cuda(), photos.decoder)
    for d, g in zip(datas, gpu):
        c = decode_bytes(d, photos.decoder)
        assert g.device == _cuda() and g.dtype == torch.uint8 and g.shape == c.shape == (3, 150, 200)
        assert _mean_levels(g[None], c[None]).item() < LEVELS


@pytest.mark.parametrize("train", [True, False])
def test_device_crops_are_close_to_the_cpu_crops(photos, train):
    idx = list(range(len(photos)))
    gpu = photos.decode_batch([photos.read(i)[0] for i in idx], idx, train, 7, _cuda())
    cpu = torch.stack([photos.sample(i, train, 7)[0] for i in idx])
    assert gpu.device == _cuda() and gpu.shape == cpu.shape == (len(idx), 3, 64, 64)
    assert _mean_levels(gpu, cpu).max().item() < LEVELS


def _epoch(stream: BatchStream, n: int):
    sampler = ShardedSampler(n, 0, 1, seed=0)
    sampler.set_epoch(0, global_batch=8)
    return list(stream.epoch(sampler, key=3))


def test_a_training_batch_arrives_normalized_channels_last_on_cuda_without_another_copy(photos):
    stream = BatchStream(photos, 2, _cuda(), channels_last=True)
    assert stream.decode == "device"  # chosen by capability
    got = _epoch(stream, len(photos))
    stream.close()
    cpu = _epoch(BatchStream(photos, 0, decode="host"), len(photos))
    assert len(got) == len(cpu) == 2
    for (x, y), (xc, yc) in zip(got, cpu):
        assert x.device == y.device == _cuda() and x.dtype == torch.float32
        assert x.is_contiguous(memory_format=torch.channels_last)
        assert x.contiguous(memory_format=torch.channels_last).data_ptr() == x.data_ptr()  # the step's conversion
        assert torch.equal(y.cpu(), yc)
        levels = ((x.cpu() - xc).abs() * STD_255).flatten(1).mean(1)  # back to uint8 levels
        assert levels.max().item() < LEVELS


def test_host_decoded_batches_are_normalized_on_cuda_as_on_the_cpu(photos):
    stream = BatchStream(photos, 2, _cuda(), channels_last=True, decode="host")
    got = _epoch(stream, len(photos))
    stream.close()
    cpu = _epoch(BatchStream(photos, 0, decode="host"), len(photos))
    for (x, _), (xc, _) in zip(got, cpu):
        assert x.device == _cuda() and x.is_contiguous(memory_format=torch.channels_last)
        assert (x.cpu() - xc).abs().max().item() < 1e-6  # the same uint8, one fused op on each device


def test_evaluation_batches_arrive_on_cuda_in_channels_last(photos):
    got = list(eval_batches(photos, 0, len(photos), 8, workers=2, device=_cuda(), channels_last=True))
    cpu = list(eval_batches(photos, 0, len(photos), 8, workers=0, decode="host"))
    assert len(got) == len(cpu) == 2
    for (x, y), (xc, yc) in zip(got, cpu):
        assert x.device == _cuda() and x.is_contiguous(memory_format=torch.channels_last)
        assert torch.equal(y.cpu(), yc)
        assert ((x.cpu() - xc).abs() * STD_255).flatten(1).mean(1).max().item() < LEVELS
