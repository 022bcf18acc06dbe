"""Image folders: decoding, the standard ImageNet augmentation, and generated JPEG folders.

``root/<class>/<image>`` (ImageNet's ``train/`` and ``val/`` layout, torchvision's ``ImageFolder``):

* Decode: ``torchvision.io.decode_image`` where torchvision imports (GPU images), Pillow otherwise
  (the CPU builds here: torchvision does not import beside them). Both are libjpeg(-turbo) decoders
  of the same file into the same uint8 (3, H, W) tensor (the decoder is chosen once, in the process
  that builds the dataset, and recorded in the run plan).
* Train augmentation: the Inception-style random-resized crop (area 8-100 %, aspect 3/4-4/3), a
  horizontal flip with probability 1/2, ImageNet mean/std normalization (Goyal et al. 2017 sec. 5;
  torchvision's ``RandomResizedCrop`` draws the same parameters). Eval: resize the short side to
  size * 256/224, center crop. Resizing is ``F.interpolate(bilinear, antialias=True)`` on uint8,
  the op torchvision's tensor ``resize`` runs, on every machine.
* Hand-over: a sample leaves :meth:`ImageFolderSplit.sample` as the uint8 crop (3, size, size)
  (decoded, cropped and resized in uint8, as torchvision's pipelines do); the batch is normalized to float32 where it is
  used (:meth:`ImageFolderSplit.normalize`: on the rank's device, after the copy), so a worker
  process hands over a quarter of the bytes and the host-to-GPU copy moves a quarter too.
* Randomness: sample ``i`` of the augmentation stream ``key`` draws from its own generator, seeded
  ``key * 1_000_003 + i`` (:func:`sample_generator`). Its crop and flip depend only on (run seed,
  epoch, sample), not on which process decodes it, in which order, or how many workers the run has:
  the in-process path and every DataLoader worker produce the same tensors, and a resumed run
  (on any number of workers) the same augmentation as an uninterrupted one.

Example::

    >>> import tempfile
    >>> root = write_jpeg_folder(tempfile.mkdtemp(), classes=2, per_class=3, size=(40, 30))
    >>> files, labels, classes = scan_folder(root)
    >>> split = ImageFolderSplit(files, labels, size=24)
    >>> x, y = split.batch(torch.tensor([0, 4]), train=True, key=7)
    >>> tuple(x.shape), y.tolist()
    ((2, 3, 24, 24), [0, 1])
    >>> torch.equal(x[1], split.normalize(split.sample(4, train=True, key=7)[0][None])[0])
    True
"""

from __future__ import annotations

import functools
import math
from pathlib import Path

import numpy as np
import torch
import torch.nn.functional as F

IMAGENET_MEAN = (0.485, 0.456, 0.406)
IMAGENET_STD = (0.229, 0.224, 0.225)
IMAGE_EXTENSIONS = (".jpg", ".jpeg", ".png", ".bmp", ".ppm", ".webp")
SAMPLE_STRIDE = 1_000_003
"""Seed of sample i in stream ``key``: ``key * SAMPLE_STRIDE + i`` (a prime above any dataset here)."""


@functools.lru_cache(maxsize=None)
def decoder() -> str:
    """``"torchvision"`` when ``torchvision.io`` imports (and works with this torch), else ``"pillow"``."""
    try:
        from torchvision.io import decode_image  # noqa: F401, PLC0415 - optional
    except Exception:  # noqa: BLE001 - ImportError, or "operator torchvision::nms does not exist"
        return "pillow"
    return "torchvision"


def load_image(path: Path, how: str = "pillow") -> torch.Tensor:
    """The image at ``path`` as uint8 (3, H, W), RGB (Pillow's: a view of its (H, W, 3) pixels, the
    channels-last layout the uint8 resize is fastest on)."""
    if how == "torchvision":
        from torchvision.io import ImageReadMode, decode_image, read_file  # noqa: PLC0415

        return decode_image(read_file(str(path)), mode=ImageReadMode.RGB)
    from PIL import Image  # noqa: PLC0415

    with Image.open(path) as img:
        arr = np.array(img.convert("RGB"), dtype=np.uint8)  # (H, W, 3), one copy, writable
    return torch.from_numpy(arr).permute(2, 0, 1)


def sample_generator(key: int, i: int) -> torch.Generator:
    """The generator of sample ``i`` in augmentation stream ``key`` (module docstring)."""
    return torch.Generator().manual_seed((key * SAMPLE_STRIDE + i) % 2 ** 63)


def _resize(img: torch.Tensor, size: tuple[int, int]) -> torch.Tensor:
    """Antialiased bilinear resize of a uint8 (3, h, w) image, in uint8 (torch's CPU kernel for
    uint8 channels-last input, the one torchvision's ``resize`` uses: 0.12 ms for 300x260 -> 224,
    against 0.76 ms through float32 here; results within one level of the float path)."""
    x = img[None]
    if not x.is_contiguous(memory_format=torch.channels_last):
        x = x.contiguous(memory_format=torch.channels_last)
    return F.interpolate(x, size=size, mode="bilinear", align_corners=False, antialias=True)[0]


def random_resized_crop(img: torch.Tensor, size: int, g: torch.Generator,
                        scale: tuple[float, float] = (0.08, 1.0),
                        ratio: tuple[float, float] = (3 / 4, 4 / 3)) -> torch.Tensor:
    """Crop a random area fraction in ``scale`` with aspect in ``ratio``, resize to size x size
    (up to 10 tries, as torchvision; then the center crop of the whole image)."""
    _, h, w = img.shape
    for _ in range(10):
        u = torch.rand(2, generator=g).tolist()
        area = h * w * (scale[0] + (scale[1] - scale[0]) * u[0])
        aspect = math.exp(math.log(ratio[0]) + (math.log(ratio[1]) - math.log(ratio[0])) * u[1])
        cw, ch = round(math.sqrt(area * aspect)), round(math.sqrt(area / aspect))
        if 0 < cw <= w and 0 < ch <= h:
            i = int(torch.randint(0, h - ch + 1, (1,), generator=g))
            j = int(torch.randint(0, w - cw + 1, (1,), generator=g))
            return _resize(img[:, i:i + ch, j:j + cw], (size, size))
    return center_crop(img, size, resize_to=size)


def center_crop(img: torch.Tensor, size: int, resize_to: int | None = None) -> torch.Tensor:
    """Resize the short side to ``resize_to`` (default size*256/224), then take the central square."""
    _, h, w = img.shape
    short = resize_to or round(size * 256 / 224)
    nh, nw = (short, max(short, round(w * short / h))) if h <= w else (max(short, round(h * short / w)), short)
    img = _resize(img, (nh, nw))
    top, left = (nh - size) // 2, (nw - size) // 2
    return img[:, top:top + size, left:left + size]


class ImageFolderSplit:
    """Files with class labels; :meth:`sample` decodes and augments one (module docstring).

    ``sample`` is what a DataLoader worker runs (:mod:`flashsgd.train.loader`), ``normalize``
    what the rank runs on the batch; :meth:`batch` is both, in this process."""

    def __init__(self, files: list[Path], labels: list[int], size: int, how: str | None = None) -> None:
        self.files, self.labels, self.size = files, torch.tensor(labels, dtype=torch.int64), size
        self.decoder = how or decoder()
        self.mean = torch.tensor(IMAGENET_MEAN).view(3, 1, 1) * 255
        self.std = torch.tensor(IMAGENET_STD).view(3, 1, 1) * 255

    def __len__(self) -> int:
        return len(self.files)

    def sample(self, i: int, train: bool = True, key: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
        """(uint8 (3, size, size) image, label) of sample ``i`` (one generator per sample)."""
        img = load_image(self.files[i], self.decoder)
        if train:
            g = sample_generator(key, i)
            img = random_resized_crop(img, self.size, g)
            if float(torch.rand(1, generator=g)) < 0.5:
                img = img.flip(-1)
        else:
            img = center_crop(img, self.size)
        return img.contiguous(), self.labels[i]

    def normalize(self, x: torch.Tensor) -> torch.Tensor:
        """uint8 (N, 3, H, W) -> float32 with ImageNet mean/std, on ``x``'s device."""
        return x.float().sub_(self.mean.to(x.device)).div_(self.std.to(x.device))  # one float copy

    def batch(self, idx: torch.Tensor, train: bool = True, key: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
        """Normalized float32 (N, 3, size, size) and labels of ``idx``, in this process."""
        samples = [self.sample(i, train, key) for i in idx.tolist()]
        return self.normalize(torch.stack([x for x, _ in samples])), self.labels[idx]


def scan_folder(root: Path, classes: list[str] | None = None) -> tuple[list[Path], list[int], list[str]]:
    """Files and labels of ``root/<class>/*`` (classes sorted by name)."""
    root = Path(root)
    classes = classes or sorted(d.name for d in root.iterdir() if d.is_dir())
    if not classes:
        raise ValueError(f"data_dir {str(root)!r} has no class subfolders")
    files, labels = [], []
    for k, c in enumerate(classes):
        for f in sorted((root / c).iterdir()) if (root / c).is_dir() else []:
            if f.suffix.lower() in IMAGE_EXTENSIONS:
                files.append(f)
                labels.append(k)
    if not files:
        raise ValueError(f"data_dir {str(root)!r}: no images ({', '.join(IMAGE_EXTENSIONS)}) found")
    return files, labels, classes


def write_jpeg_folder(root: str | Path, classes: int = 10, per_class: int = 10,
                      size: tuple[int, int] = (500, 375), seed: int = 0, quality: int = 90) -> Path:
    """Write ``classes`` x ``per_class`` JPEGs of ``size`` (width, height; ImageNet's median photo is
    about 500 x 375) under ``root/<class>/``; returns ``root``. Each class is a smooth colour
    gradient with its own hue plus noise (photo-like JPEG entropy, learnable labels): for tests and
    for timing decode, not for accuracy claims."""
    from PIL import Image  # noqa: PLC0415

    root = Path(root)
    rng = np.random.default_rng(seed)
    w, h = size
    yy, xx = np.mgrid[0:h, 0:w].astype(np.float32)
    for c in range(classes):
        folder = root / f"class{c:03d}"
        folder.mkdir(parents=True, exist_ok=True)
        hue = np.array([np.sin(c), np.cos(c * 1.3), np.sin(c * 0.7 + 1)], dtype=np.float32) * 90 + 128
        for k in range(per_class):
            base = hue[None, None, :] + (xx / w * 60 - 30)[..., None] + (yy / h * 40 - 20)[..., None]
            img = base + rng.normal(0, 25, (h, w, 3)).astype(np.float32)
            Image.fromarray(np.clip(img, 0, 255).astype(np.uint8)).save(
                folder / f"img{k:05d}.jpg", quality=quality)
    return root
