"""Image folders: decoding (on the CPU, or on the GPU with nvJPEG), the standard ImageNet
augmentation, the normalization on the device, and generated JPEG folders.

``root/<class>/<image>`` (ImageNet's ``train/`` and ``val/`` layout, torchvision's ``ImageFolder``):

* Decode, in one of two places (:class:`flashsgd.train.data.loader.BatchStream` picks per rank):

  - host: ``torchvision.io.decode_image`` where torchvision imports (GPU images), Pillow otherwise
    (the CPU builds here: torchvision does not import beside them), in DataLoader workers
    (:meth:`ImageFolderSplit.sample`). Both are libjpeg(-turbo) decoders of the same file into the
    same uint8 (3, H, W) tensor (the decoder is chosen once, in the process that builds the dataset).
  - device: the workers only read the files' bytes (:meth:`ImageFolderSplit.read`); the rank
    decodes the batch's JPEGs with one ``torchvision.io.decode_jpeg(list, device=...)`` (nvJPEG,
    batched) and crops, flips and resizes each on the GPU (:meth:`ImageFolderSplit.decode_batch`).
    Used where :func:`device_decode_unavailable` is None: a 16 x 16 JPEG decoded once on the
    device, a capability, not a version. nvJPEG's IDCT and chroma upsampling differ from
    libjpeg's by a level or two on some pixels (tests/test_gpu_data.py: mean |diff| < 2 levels);
    a file nvJPEG cannot take (PNG, CMYK) is decoded on the CPU and copied.

* Train augmentation: the Inception-style random-resized crop (area 8-100 %, aspect 3/4-4/3), a
  horizontal flip with probability 1/2, ImageNet mean/std normalization (Goyal et al. 2017 sec. 5;
  torchvision's ``RandomResizedCrop`` draws the same parameters). Eval: resize the short side to
  size * 256/224, center crop. Resizing is ``F.interpolate(bilinear, antialias=True)``: on the CPU
  in uint8 (the op torchvision's tensor ``resize`` runs), on a GPU through float32, rounded back to
  uint8 (torchvision's ``resize`` off the CPU: torch has no uint8 antialiased kernel there).
* Hand-over: a sample leaves :meth:`ImageFolderSplit.sample` as the uint8 crop (3, size, size)
  (decoded, cropped and resized in uint8, as torchvision's pipelines do); the batch is normalized
  where it is used (:meth:`ImageFolderSplit.normalize`, on the rank's device after a pinned,
  non-blocking uint8 copy: a quarter of the bytes of float32 through shared memory and PCIe).
  Normalizing is ``x * 1/(255 std) - mean/std``, on a GPU one fused multiply-add from uint8
  (``addcmul``) into a float32 ``empty_like`` output, ``channels_last`` when the run uses it (the
  step's conversion is then a no-op, not a second copy of the batch); the constants are made once
  per device. It differs from the former ``(x - 255 mean) / (255 std)`` by at most 2 float32 ulps
  (4.8e-7 over every level of every channel on the CPU: tests/test_loader.py).
* Randomness: sample ``i`` of the augmentation stream ``key`` draws from its own generator, seeded
  ``key * 1_000_003 + i`` (:func:`sample_generator`). Its crop and flip depend only on (run seed,
  epoch, sample), not on which process decodes it, in which order, or how many workers the run has:
  the in-process path and every DataLoader worker produce the same tensors, and a resumed run
  (on any number of workers) the same augmentation as an uninterrupted one. The device path draws
  the same crop window and flip (from the same generator and the decoded size).

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
    >>> data = [split.read(i)[0] for i in (0, 4)]   # what a worker hands over for device decoding
    >>> torch.equal(split.decode_batch(data, [0, 4], True, 7, torch.device("cpu")),
    ...             torch.stack([split.sample(i, True, 7)[0] for i in (0, 4)]))
    True
"""

from __future__ import annotations

import functools
import io
import math
from pathlib import Path
from typing import Sequence

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


def read_bytes(path: Path) -> torch.Tensor:
    """The encoded file at ``path`` as a uint8 1-D tensor (what a worker hands over when the rank
    decodes on its device: ~110 KB for an ImageNet JPEG against 150 KB for its 224 x 224 crop)."""
    return torch.from_numpy(np.fromfile(path, dtype=np.uint8))


def decode_bytes(data: torch.Tensor, how: str = "pillow") -> torch.Tensor:
    """:func:`load_image` of an encoded file already read (uint8 1-D), on the CPU: the same decoder,
    the same pixels."""
    if how == "torchvision":
        from torchvision.io import ImageReadMode, decode_image  # noqa: PLC0415

        return decode_image(data, mode=ImageReadMode.RGB)
    from PIL import Image  # noqa: PLC0415

    with Image.open(io.BytesIO(data.numpy().tobytes())) as img:
        arr = np.array(img.convert("RGB"), dtype=np.uint8)
    return torch.from_numpy(arr).permute(2, 0, 1)


def is_jpeg(data: torch.Tensor) -> bool:
    """Whether encoded bytes start with JPEG's SOI marker (FF D8)."""
    return data.numel() > 2 and data[:2].tolist() == [0xFF, 0xD8]


def _first_line(exc: BaseException) -> str:
    return f"{type(exc).__name__}: {(str(exc).strip().splitlines() or [''])[0][:160]}"


def device_decode_unavailable(device: torch.device | str) -> str | None:
    """None when ``torchvision.io.decode_jpeg`` decodes a list of JPEGs on ``device`` (nvJPEG),
    else why not, in words. Asked of the device itself, once per device (a 16 x 16 JPEG encoded and
    decoded there): torchvision without the ``device`` argument, without list input, or built
    without nvJPEG all answer with the reason, whatever their version."""
    device = torch.device(device)
    if device.type != "cuda":
        return f"the batches go to {device.type}, not to a CUDA device"
    if not torch.cuda.is_available():
        return "no CUDA device (torch.cuda.is_available() is False)"
    index = device.index if device.index is not None else torch.cuda.current_device()
    return _try_device_decode(torch.device("cuda", index))


@functools.lru_cache(maxsize=None)
def _try_device_decode(device: torch.device) -> str | None:
    try:
        from torchvision.io import ImageReadMode, decode_jpeg, encode_jpeg  # noqa: PLC0415 - optional
    except Exception as exc:  # noqa: BLE001 - ImportError, or an operator missing for this torch
        return f"torchvision.io does not import ({_first_line(exc)})"
    try:
        probe = encode_jpeg(torch.full((3, 16, 16), 128, dtype=torch.uint8))
        out = decode_jpeg([probe], mode=ImageReadMode.RGB, device=device)
        if out[0].device != device or tuple(out[0].shape) != (3, 16, 16):
            return f"torchvision.io.decode_jpeg returned {tuple(out[0].shape)} on {out[0].device}"
    except Exception as exc:  # noqa: BLE001 - TypeError (no device / list), RuntimeError (no nvJPEG)
        return f"torchvision.io.decode_jpeg cannot decode a list of JPEGs on {device} ({_first_line(exc)})"
    return None


def decode_on(datas: Sequence[torch.Tensor], device: torch.device, how: str = "pillow") -> list[torch.Tensor]:
    """uint8 (3, H, W) RGB images on ``device`` of encoded files (uint8 1-D, on the CPU; pinned is
    fine). On CUDA the JPEGs go to nvJPEG in one batch (a file it refuses fails the whole batch:
    then one by one); whatever nvJPEG does not decode, and everything on other devices, is decoded
    by ``how`` on the CPU (:func:`decode_bytes`) and copied."""
    if device.type != "cuda":
        return [decode_bytes(d, how).to(device) for d in datas]
    from torchvision.io import ImageReadMode, decode_jpeg  # noqa: PLC0415

    imgs: list[torch.Tensor | None] = [None] * len(datas)
    jpegs = [k for k, d in enumerate(datas) if is_jpeg(d)]
    if jpegs:
        try:
            for k, img in zip(jpegs, decode_jpeg([datas[k] for k in jpegs], mode=ImageReadMode.RGB,
                                                  device=device)):
                imgs[k] = img
        except RuntimeError:  # no partial results: find the file(s) nvJPEG refuses
            for k in jpegs:
                try:
                    imgs[k] = decode_jpeg(datas[k], mode=ImageReadMode.RGB, device=device)
                except RuntimeError:
                    pass
    return [img if img is not None else decode_bytes(d, how).to(device) for img, d in zip(imgs, datas)]


def sample_generator(key: int, i: int) -> torch.Generator:
    """The generator of sample ``i`` in augmentation stream ``key`` (module docstring)."""
    return torch.Generator().manual_seed((key * SAMPLE_STRIDE + i) % 2 ** 63)


def _resize(img: torch.Tensor, size: tuple[int, int]) -> torch.Tensor:
    """Antialiased bilinear resize of a uint8 (3, h, w) image, in uint8. On the CPU: torch's kernel
    for uint8 channels-last input, the one torchvision's ``resize`` uses (0.12 ms for 300x260 -> 224,
    against 0.76 ms through float32 here; results within one level of the float path). Elsewhere
    (a GPU): through float32, rounded and clamped back to uint8, as torchvision's ``resize`` does
    off the CPU."""
    x = img[None]
    if x.device.type != "cpu":
        y = F.interpolate(x.float(), size=size, mode="bilinear", align_corners=False, antialias=True)
        return y.round_().clamp_(0, 255).to(torch.uint8)[0]
    if not x.is_contiguous(memory_format=torch.channels_last):
        x = x.contiguous(memory_format=torch.channels_last)
    return F.interpolate(x, size=size, mode="bilinear", align_corners=False, antialias=True)[0]


def random_resized_crop(img: torch.Tensor, size: int, g: torch.Generator,
                        scale: tuple[float, float] = (0.08, 1.0),
                        ratio: tuple[float, float] = (3 / 4, 4 / 3)) -> torch.Tensor:
    """Crop a random area fraction in ``scale`` with aspect in ``ratio``, resize to size x size
    (up to 10 tries, as torchvision; then the center crop of the whole image). ``g`` is a CPU
    generator; ``img`` may be on any device (the window depends only on ``g`` and its size)."""
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
    """Files with class labels (module docstring). Host decoding: :meth:`sample` is what a
    DataLoader worker runs (:mod:`flashsgd.train.data.loader`), :meth:`normalize` what the rank runs on
    the batch; :meth:`batch` is both, in this process. Device decoding: a worker runs :meth:`read`,
    the rank :meth:`decode_batch` then :meth:`normalize`."""

    def __init__(self, files: list[Path], labels: list[int], size: int, how: str | None = None) -> None:
        self.files, self.labels, self.size = files, torch.tensor(labels, dtype=torch.int64), size
        self.decoder = how or decoder()
        self._constants: dict[torch.device, tuple[torch.Tensor, torch.Tensor]] = {}  # per device

    def __len__(self) -> int:
        return len(self.files)

    def __getstate__(self) -> dict:
        """Pickled for a worker process: without the per-device constants (CUDA tensors)."""
        return {**self.__dict__, "_constants": {}}

    def augment(self, img: torch.Tensor, i: int, train: bool = True, key: int = 0) -> torch.Tensor:
        """Sample ``i``'s crop of its decoded uint8 (3, H, W) image, on the image's device: train:
        random-resized crop and flip from :func:`sample_generator` (``key``, ``i``); eval: center crop."""
        if train:
            g = sample_generator(key, i)
            img = random_resized_crop(img, self.size, g)
            if float(torch.rand(1, generator=g)) < 0.5:
                img = img.flip(-1)
        else:
            img = center_crop(img, self.size)
        return img

    def sample(self, i: int, train: bool = True, key: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
        """(uint8 (3, size, size) image, label) of sample ``i``, decoded on the CPU."""
        return self.augment(load_image(self.files[i], self.decoder), i, train, key).contiguous(), self.labels[i]

    def read(self, i: int) -> tuple[torch.Tensor, torch.Tensor]:
        """(encoded bytes (uint8 1-D), label) of sample ``i``: all a worker does when the rank
        decodes on its device."""
        return read_bytes(self.files[i]), self.labels[i]

    def decode_batch(self, datas: Sequence[torch.Tensor], idx: Sequence[int], train: bool, key: int,
                     device: torch.device) -> torch.Tensor:
        """uint8 (N, 3, size, size) on ``device`` of samples ``idx`` from their encoded bytes
        ``datas`` (:meth:`read`): decoded there (:func:`decode_on`: nvJPEG on CUDA), then each
        image's :meth:`augment` on the device, written into one preallocated batch. On the CPU
        these are :meth:`sample`'s tensors, bit for bit."""
        imgs = decode_on(datas, device, self.decoder)
        out = torch.empty((len(imgs), 3, self.size, self.size), dtype=torch.uint8, device=device)
        for k, (img, i) in enumerate(zip(imgs, idx)):
            out[k] = self.augment(img, int(i), train, key)
        return out

    def constants(self, device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
        """(scale, shift), float32 (3, 1, 1) on ``device``: 1 / (255 std) and -mean / std (made once
        per device, from float64 values)."""
        c = self._constants.get(device)
        if c is None:
            scale = [1.0 / (255.0 * s) for s in IMAGENET_STD]
            shift = [-m / s for m, s in zip(IMAGENET_MEAN, IMAGENET_STD)]
            c = self._constants[device] = (torch.tensor(scale, device=device).view(3, 1, 1),
                                           torch.tensor(shift, device=device).view(3, 1, 1))
        return c

    def normalize(self, x: torch.Tensor, channels_last: bool = False) -> torch.Tensor:
        """uint8 (N, 3, H, W) -> float32 ``x * scale + shift`` (:meth:`constants`) on ``x``'s device,
        in ``torch.channels_last`` when asked. On a GPU one fused ``addcmul`` reads the uint8 and
        writes an ``empty_like`` output in the asked layout (no second copy). On the CPU, where
        kernels cast mixed dtypes element by element (``addcmul`` from uint8: 22 ms for 32 x 3 x
        224 x 224 on one core here), a conversion then two in-place passes (1.4 ms), and for
        channels_last a copy afterwards (5.0 ms in all, against 10-13 ms computing into the
        channels-last output: the per-channel broadcast does not vectorize there)."""
        scale, shift = self.constants(x.device)
        cl = channels_last and x.dim() == 4
        if x.device.type == "cpu":
            out = x.float().mul_(scale).add_(shift)
            return out.contiguous(memory_format=torch.channels_last) if cl else out
        out = torch.empty_like(x, dtype=torch.float32,
                              memory_format=torch.channels_last if cl else torch.contiguous_format)
        return torch.addcmul(shift, x, scale, out=out)

    def batch(self, idx: torch.Tensor, train: bool = True, key: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
        """Normalized float32 (N, 3, size, size) and labels of ``idx``, in this process (on the CPU)."""
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
