"""Workloads for the simulator: per-tensor gradient sizes in backward order and backward-time shares.

A workload is what the iteration engine needs to know about a model: the gradient tensors in the
order backward produces them (the reverse of parameter registration, as DDP assumes) and each
tensor's share of the backward time. Built-ins are generated from architecture arithmetic, so they
need neither torchvision nor flashsgd's own model zoo:

* ``resnet50``: ImageNet ResNet-50 v1.5 (bottlenecks [3, 4, 6, 3], stride on the 3x3 conv), 161
  tensors, 25,557,032 parameters; backward share of a tensor = forward FLOPs of its layer at
  224x224 (a conv's backward is ~2x its forward, a constant factor that cancels);
* ``vgg16``: ImageNet VGG-16 (13 conv + 3 fc, with biases), 32 tensors, 138,357,544 parameters;
* ``vgg16-cifar10``: the CIFAR-10 VGG-16 that Shi et al. 2019 (gTop-k) trained (their
  ``models/vgg.py``: 13 conv 3x3 with bias, each followed by batch norm, then one 512 -> 10 linear
  layer), 54 tensors, 14,728,266 parameters, shares at 32x32;
* ``resnet20``: the CIFAR-10 ResNet-20 of He et al. 2016 (stem 3x3/16, 3 stages of 3 basic blocks
  at 16/32/64 channels, parameter-free option-A shortcuts, 64 -> 10 linear), the gTop-k paper's
  and ``flashsgd.train.models.resnet20``: 59 tensors, 269,722 parameters, shares at 32x32;
* transformers (:func:`transformer`, read from :data:`PROFILES`, which ``benchmarks/make_workloads.py``
  writes from transformers' module definitions on the meta device): ``bert-base`` (110,106,428
  parameters) and ``bert-large`` (336,226,108; ``BertForPreTraining``, sequences of 128 tokens;
  ``bert-large-seq512``: 512), ``gpt2`` (124,439,808) and ``gpt2-medium`` (354,823,168;
  ``GPT2LMHeadModel``, 1,024 tokens), ``vit-b16`` (86,567,656; ``ViTForImageClassification``, 224x224,
  1,000 classes); shares from backward FLOPs, so an embedding's scatter-add is nearly free. Their
  unit (:attr:`Workload.unit`) is ``sequences`` (``images`` for ViT): rates print as sequences/s.

Any ``torch.nn.Module`` works through :func:`from_module` (shares proportional to parameter count,
a fallback stated in the output), named as ``package.module:factory`` (flashsgd's training models:
``flashsgd.train.models:resnet20``; the simulator imports nothing from ``flashsgd.train``); a
measured profile is a JSON file (:func:`load_profile`). :func:`get_workload` resolves all of them
for ``flashsgd simulate`` and ``flashsgd plan`` alike.

How a step runs its exchange is described beside the model, as the trainer runs it:
``grad_accum`` micro-batches per exchange (``flashsgd train --grad-accum``, ``optim.grad_accum``:
the first N-1 micro-batches run forward and backward under DDP's ``no_sync``, with no exchange; the
last one's backward fills the buckets) and the exchange schedule (:data:`SCHEDULES`: buckets
overlapping backward, or after it); :func:`trainer_schedule` is the schedule ``flashsgd train``
runs an exchange with.

Example::

    >>> w = WORKLOADS.get("resnet50")()
    >>> w.num_tensors, w.num_params
    (161, 25557032)
    >>> trainer_schedule("torus2d"), trainer_schedule("gtopk")
    ('overlap', 'after_backward')
"""

from __future__ import annotations

import importlib
import json
import math
from dataclasses import dataclass, replace
from functools import lru_cache
from pathlib import Path

import numpy as np

from flashsgd.exchanges import EXCHANGES
from flashsgd.registry import Registry

# Batch norm is memory-bound; ASSUMPTION: its backward costs like 8 FLOPs per activation element.
_BN_FLOPS_PER_ELEM = 8.0


@dataclass(frozen=True)
class Workload:
    """Gradient tensors in backward order with their share of the backward time."""

    name: str
    numels: np.ndarray
    """(T,) elements per gradient tensor, in the order backward produces them."""
    backward_share: np.ndarray
    """(T,) relative backward cost of producing each tensor (any scale; normalised on use)."""
    tensor_names: tuple[str, ...] = ()
    note: str = ""
    """How the shares were obtained (printed with results)."""
    matrices: np.ndarray | None = None
    """(T, 2) rows x cols of each tensor as torch's PowerSGD hook views it (``shape[0] x rest``;
    1-D tensors are (n, 1)); None: unknown (the simulator then takes each bucket as one square
    matrix)."""
    reference_run: tuple[int, float, str] | None = None
    """The model's published training run, when there is one: (training samples, epochs, source);
    ``flashsgd plan`` takes its optimizer steps at the planned batch when ``--steps`` is not given
    (:meth:`reference_steps`)."""
    unit: str = "images"
    """What one sample is, plural, as rates are printed (``images``, ``sequences``): ``sequences/s``."""
    sample: str = ""
    """One sample in words, e.g. ``a sequence of 128 tokens``; "" for a plain image."""
    forward_flops: float | None = None
    """Forward FLOPs of one sample (matrix products 2mnk), the basis of a compute rate derived from a
    GPU's peak (:mod:`flashsgd.sim.compute_rates`); None: unknown or not a fair basis (the CNNs:
    cuDNN's Winograd and FFT convolutions do fewer FLOPs than 2mnk, so a rate from the peak would
    be too low)."""
    tokens_per_sample: int | None = None
    """Tokens (sequence positions) in one sample; None for images."""

    def reference_steps(self, global_batch: int) -> int | None:
        """Optimizer steps of :attr:`reference_run` at ``global_batch``: ceil(samples x epochs / batch)."""
        if self.reference_run is None:
            return None
        samples, epochs, _ = self.reference_run
        return math.ceil(samples * epochs / global_batch)

    def __post_init__(self) -> None:
        numels = np.asarray(self.numels, dtype=np.int64)
        share = np.asarray(self.backward_share, dtype=float)
        if numels.ndim != 1 or numels.size == 0 or np.any(numels <= 0):
            raise ValueError(f"workload {self.name!r}: numels must be a non-empty 1-D array of positive ints")
        if share.shape != numels.shape or np.any(share < 0) or share.sum() <= 0:
            raise ValueError(
                f"workload {self.name!r}: backward_share must have {numels.size} entries >= 0 "
                "with a positive sum"
            )
        object.__setattr__(self, "numels", numels)
        object.__setattr__(self, "backward_share", share / share.sum())
        if self.matrices is not None:
            m = np.asarray(self.matrices, dtype=np.int64)
            if m.shape != (numels.size, 2) or np.any(m <= 0) or np.any(m[:, 0] * m[:, 1] != numels):
                raise ValueError(f"workload {self.name!r}: matrices must be {numels.size} (rows, cols) "
                                 "pairs with rows x cols = the tensor's numel")
            object.__setattr__(self, "matrices", m)

    @property
    def num_tensors(self) -> int:
        return int(self.numels.size)

    @property
    def num_params(self) -> int:
        return int(self.numels.sum())


WORKLOADS: Registry = Registry("workload")

SCHEDULES = {
    "overlap": "each bucket's exchange starts when its last gradient is ready, during backward, on "
               "one communication stream (DDP's own all-reduce; NCCL; a Gloo hook with threaded=True)",
    "after_backward": "the exchanges run after backward, one after another (a hook that runs "
                      "synchronously inside backward, threaded=False, stalls backward for each bucket: "
                      "the same step time on one stream)",
    "horovod": "Horovod's tensor fusion: every cycle (HOROVOD_CYCLE_TIME, SimConfig.cycle_ms) the "
               "gradients ready since the last one are fused into buffers of at most the fusion threshold "
               "(HOROVOD_FUSION_THRESHOLD, SimConfig.fusion_mb: a ceiling, not a size to wait for) and "
               "exchanged in order on one stream",
}
"""When a step's exchanges run (``SimConfig.schedule``, ``flashsgd simulate --schedule``)."""


def trainer_schedule(algorithm: str, threaded: bool | None = None) -> str:
    """The :data:`SCHEDULES` entry ``flashsgd train`` runs ``algorithm`` with on Gloo: DDP's own
    all-reduce (``native``) and PowerSGD (torch's hook chains all-reduce futures) overlap backward;
    flashsgd's hooks overlap when their ``threaded`` option is on (``threaded``; None: the
    catalog's default, :mod:`flashsgd.exchanges`: True for the dense hooks, False for the sparse
    ones, which then exchange inside backward) and run after backward otherwise."""
    if algorithm not in EXCHANGES:
        raise ValueError(f"{algorithm!r} is simulator-only: flashsgd train does not run it, so it has "
                         f"no trainer schedule; choose one of {', '.join(SCHEDULES)}")
    options = EXCHANGES.get(algorithm).options
    if "threaded" not in options.__dataclass_fields__:
        return "overlap"
    on = options.__dataclass_fields__["threaded"].default if threaded is None else threaded
    return "overlap" if on else "after_backward"


def _conv(name: str, cin: int, cout: int, k: int, hout: int, bias: bool = False) -> list:
    flops = 2.0 * cin * cout * k * k * hout * hout
    rows = [(f"{name}.weight", cout * cin * k * k, flops, cout)]
    return rows + [(f"{name}.bias", cout, 0.0, cout)] if bias else rows


def _bn(name: str, c: int, h: int) -> list:
    return [(f"{name}.weight", c, _BN_FLOPS_PER_ELEM * c * h * h, c), (f"{name}.bias", c, 0.0, c)]


def resnet50_rows(num_classes: int = 1000, image: int = 224) -> list[tuple[str, int, float, int]]:
    """(name, numel, forward FLOPs of its layer, shape[0]) per parameter tensor, in registration
    order."""
    h = image // 2  # conv1 7x7 stride 2: 224 -> 112
    rows = _conv("conv1", 3, 64, 7, h) + _bn("bn1", 64, h)
    h //= 2  # max-pool stride 2: 112 -> 56
    cin = 64
    for stage, (planes, blocks) in enumerate(zip((64, 128, 256, 512), (3, 4, 6, 3)), start=1):
        for b in range(blocks):
            stride = 2 if (b == 0 and stage > 1) else 1
            hout = h // stride
            p = f"layer{stage}.{b}"
            rows += _conv(f"{p}.conv1", cin, planes, 1, h) + _bn(f"{p}.bn1", planes, h)
            rows += _conv(f"{p}.conv2", planes, planes, 3, hout) + _bn(f"{p}.bn2", planes, hout)
            rows += _conv(f"{p}.conv3", planes, 4 * planes, 1, hout) + _bn(f"{p}.bn3", 4 * planes, hout)
            if b == 0:  # projection shortcut: channels (and stride) change
                rows += _conv(f"{p}.downsample.0", cin, 4 * planes, 1, hout)
                rows += _bn(f"{p}.downsample.1", 4 * planes, hout)
            cin, h = 4 * planes, hout
    return rows + [("fc.weight", num_classes * cin, 2.0 * num_classes * cin, num_classes),
                   ("fc.bias", num_classes, 0.0, num_classes)]


def vgg16_rows(num_classes: int = 1000, image: int = 224) -> list[tuple[str, int, float, int]]:
    """(name, numel, forward FLOPs, shape[0]) per tensor of ImageNet VGG-16 (configuration D),
    registration order."""
    cfg = (64, 64, "M", 128, 128, "M", 256, 256, 256, "M", 512, 512, 512, "M", 512, 512, 512, "M")
    rows, cin, h, idx = [], 3, image, 0
    for v in cfg:
        if v == "M":
            h //= 2
        else:
            rows += _conv(f"features.{idx}", cin, v, 3, h, bias=True)
            cin = v
        idx += 1
    dims = (cin * h * h, 4096, 4096, num_classes)  # 512*7*7 = 25088 -> 4096 -> 4096 -> classes
    for i, (a, b) in enumerate(zip(dims[:-1], dims[1:])):
        rows += [(f"classifier.{i}.weight", a * b, 2.0 * a * b, b), (f"classifier.{i}.bias", b, 0.0, b)]
    return rows


def vgg16_cifar10_rows(num_classes: int = 10, image: int = 32) -> list[tuple[str, int, float, int]]:
    """(name, numel, forward FLOPs, shape[0]) per tensor of the CIFAR-10 VGG-16 of Shi et al. 2019
    (gTop-k; ``models/vgg.py`` of their code: VGG('VGG16')), registration order: per conv layer
    its weight and bias, then its batch norm's weight and bias (``features.{i}``, conv, BN and
    ReLU each one module, pooling one), then ``fc`` 512 -> classes. 13 convs: 14,714,688; BN:
    2 x 4,224; fc: 5,130; total 14,728,266."""
    cfg = (64, 64, "M", 128, 128, "M", 256, 256, 256, "M", 512, 512, 512, "M", 512, 512, 512, "M")
    rows, cin, h, idx = [], 3, image, 0
    for v in cfg:
        if v == "M":
            h //= 2
            idx += 1
        else:
            rows += _conv(f"features.{idx}", cin, v, 3, h, bias=True) + _bn(f"features.{idx + 1}", v, h)
            cin, idx = v, idx + 3  # conv, BN, ReLU
    return rows + [("fc.weight", num_classes * cin, 2.0 * num_classes * cin, num_classes),
                   ("fc.bias", num_classes, 0.0, num_classes)]


def resnet20_rows(num_classes: int = 10, image: int = 32) -> list[tuple[str, int, float, int]]:
    """(name, numel, forward FLOPs, shape[0]) per tensor of the CIFAR ResNet-20 (He et al. 2016,
    sec. 4.2: n = 3 blocks per stage, option-A shortcuts without parameters), registration order
    and names as ``flashsgd.train.models.resnet20``. Stem 432 + 32, stages 14,016 + 51,072 +
    203,520, fc 650: 269,722."""
    rows = _conv("conv1", 3, 16, 3, image) + _bn("bn1", 16, image)
    cin, h, b = 16, image, 0
    for stage, width in enumerate((16, 32, 64)):
        for j in range(3):
            h = h // 2 if (j == 0 and stage > 0) else h  # the first block of stages 2-3 strides by 2
            p = f"blocks.{b}"
            rows += _conv(f"{p}.conv1", cin, width, 3, h) + _bn(f"{p}.bn1", width, h)
            rows += _conv(f"{p}.conv2", width, width, 3, h) + _bn(f"{p}.bn2", width, h)
            cin, b = width, b + 1
    return rows + [("fc.weight", num_classes * cin, 2.0 * num_classes * cin, num_classes),
                   ("fc.bias", num_classes, 0.0, num_classes)]


def _from_rows(name: str, rows: list, note: str) -> Workload:
    rows = rows[::-1]  # backward order: last registered parameter's gradient is ready first
    return Workload(
        name=name,
        numels=np.array([r[1] for r in rows]),
        backward_share=np.array([r[2] for r in rows]),
        tensor_names=tuple(r[0] for r in rows),
        note=note,
        matrices=np.array([(r[3], r[1] // r[3]) for r in rows]),
    )  # no forward_flops: cuDNN's Winograd / FFT convolutions do fewer than 2mnk, so no rate from a peak


IMAGENET_TRAIN = 1_281_167
"""Training images of ImageNet-1k (ILSVRC-2012)."""


@WORKLOADS.register("resnet50")
def resnet50() -> Workload:
    """Built-in ImageNet ResNet-50: 161 tensors, 25,557,032 parameters, FLOP-weighted backward; its
    reference run: 90 epochs of ImageNet (Goyal et al. 2017, and every large-batch paper after)."""
    return replace(_from_rows("resnet50", resnet50_rows(),
                              "backward share per tensor = forward FLOPs of its layer at 224x224 (BN: 8/elem)"),
                   reference_run=(IMAGENET_TRAIN, 90.0, "ImageNet, Goyal et al. 2017"))


@WORKLOADS.register("vgg16")
def vgg16() -> Workload:
    """Built-in ImageNet VGG-16: 32 tensors, 138,357,544 parameters, FLOP-weighted backward; its
    reference run: 370K iterations at batch 256, 74 epochs (Simonyan & Zisserman 2015)."""
    return replace(_from_rows("vgg16", vgg16_rows(), "backward share per tensor = forward FLOPs at 224x224"),
                   reference_run=(IMAGENET_TRAIN, 74.0, "ImageNet, Simonyan & Zisserman 2015"))


@WORKLOADS.register("vgg16-cifar10")
def vgg16_cifar10() -> Workload:
    """Built-in CIFAR-10 VGG-16 with batch norm (Shi et al. 2019's): 54 tensors, 14,728,266
    parameters, FLOP-weighted backward at 32x32."""
    return _from_rows("vgg16-cifar10", vgg16_cifar10_rows(),
                      "backward share per tensor = forward FLOPs of its layer at 32x32 (BN: 8/elem)")


@WORKLOADS.register("resnet20")
def resnet20() -> Workload:
    """Built-in CIFAR-10 ResNet-20: 59 tensors, 269,722 parameters, FLOP-weighted backward at 32x32."""
    return _from_rows("resnet20", resnet20_rows(),
                      "backward share per tensor = forward FLOPs of its layer at 32x32 (BN: 8/elem)")


PROFILES = Path(__file__).with_name("workload_profiles.json")
"""The transformer workloads, written by ``benchmarks/make_workloads.py`` from transformers' module
definitions on the meta device (per-tensor sizes in DDP's gradient order, backward FLOPs per
tensor, the unit of a sample and the source configuration); tests/test_sim_workloads.py
regenerates it and fails when it has drifted."""


@lru_cache(maxsize=1)
def _profiles() -> dict:
    return json.loads(PROFILES.read_text())


def transformer(name: str, positions: int | None = None, sample: str = "") -> Workload:
    """The built-in transformer workload ``name`` of :data:`PROFILES` at ``positions`` tokens per
    sample (None: the file's reference length).

    A tensor's backward share is its backward FLOPs (``benchmarks/make_workloads.py``: matrix
    products 4mnk, the attention core 8 s^2 d per sequence, an embedding's scatter-add 1 per
    element, LayerNorm 8 per element) at that length: the part linear in the length scaled by
    ``positions / reference``, the attention core's by its square. Example::

        >>> w = transformer("bert-large")
        >>> w.num_params, w.unit, w.tokens_per_sample
        (336226108, 'sequences', 128)
    """
    doc = _profiles()["models"][name]
    ref = doc["positions"]
    k = (positions or ref) / ref  # the length's ratio to the reference
    t = doc["tensors"]
    lin = np.array([r["bwd_flops"] for r in t])
    att = np.array([r["bwd_flops_attention"] for r in t])
    fwd_att = att.sum() / 2  # backward = 2x forward for the attention core's products
    forward = (doc["forward_flops"] - fwd_att) * k + fwd_att * k * k
    return Workload(
        name=name, numels=np.array([r["numel"] for r in t]), backward_share=lin * k + att * k * k,
        tensor_names=tuple(r["name"] for r in t),
        note=f"backward share per tensor = its backward FLOPs at {positions or ref} positions "
             f"(benchmarks/make_workloads.py: {doc['source']})",
        matrices=np.array([r["matrix"] for r in t]), unit=doc["unit"], sample=sample or doc["sample"],
        forward_flops=float(forward), tokens_per_sample=(positions or ref) if doc["unit"] == "sequences" else None)


def _register_transformers() -> None:
    """Every model and variant of :data:`PROFILES` in :data:`WORKLOADS` (bert-base, bert-large,
    bert-large-seq512, gpt2, gpt2-medium, vit-b16)."""
    doc = _profiles()
    for name in doc["models"]:
        WORKLOADS.add(name, lambda name=name: transformer(name))
    for name, v in doc["variants"].items():
        WORKLOADS.add(name, lambda v=v, name=name: replace(transformer(v["model"], v["positions"], v["sample"]),
                                                           name=name))


_register_transformers()


def from_module(module, name: str | None = None) -> Workload:
    """Workload of any ``torch.nn.Module``: trainable parameters in reverse registration order.

    Backward shares are proportional to parameter counts (no FLOP information in a module); build a
    :class:`Workload` from measured per-tensor backward times when their placement in time matters.
    """
    params = [(n, p) for n, p in module.named_parameters() if p.requires_grad][::-1]
    if not params:
        raise ValueError(f"module {type(module).__name__} has no trainable parameters")
    numels = np.array([p.numel() for _, p in params])
    matrices = np.array([(p.shape[0], p.numel() // p.shape[0]) if p.dim() else (1, 1) for _, p in params])
    return Workload(name or type(module).__name__, numels, numels.astype(float),
                    tuple(n for n, _ in params), "backward share per tensor = parameter count", matrices)


MODEL_HELP = ("built-in workload (resnet50, vgg16: ImageNet; vgg16-cifar10, resnet20: CIFAR-10; transformers: "
              "bert-base, bert-large (128 tokens), bert-large-seq512, gpt2, gpt2-medium (1,024 tokens), vit-b16), "
              "a profile .json ({\"numels\": [...], optional "
              "\"backward_share\", \"matrices\"}), or package.module:factory returning a torch model "
              "(flashsgd's own: flashsgd.train.models:resnet20, :resnet18, :mnist1d_cnn)")
"""``--model`` of ``flashsgd simulate`` and ``flashsgd plan`` (:func:`get_workload`)."""


def load_profile(path: str) -> Workload:
    """A workload from a JSON profile: ``numels`` in backward order, optional ``backward_share``
    (default: proportional to the sizes), ``matrices`` ((rows, cols) per tensor) and ``name``."""
    try:
        doc = json.loads(Path(path).read_text())
    except (OSError, json.JSONDecodeError) as exc:
        raise ValueError(f"model profile {path!r}: cannot read it as JSON ({exc})") from None
    numels = doc.get("numels") if isinstance(doc, dict) else None
    if not (isinstance(numels, list) and numels
            and all(isinstance(n, int) and not isinstance(n, bool) and n > 0 for n in numels)):
        raise ValueError(f"model profile {path!r}: needs \"numels\": a non-empty list of positive "
                         "integers (per-tensor gradient sizes in backward order)")
    share = doc.get("backward_share", numels)
    if not (isinstance(share, list) and all(isinstance(v, (int, float)) and math.isfinite(v) for v in share)):
        raise ValueError(f"model profile {path!r}: \"backward_share\" must be a list of finite numbers")
    matrices = doc.get("matrices")
    if matrices is not None and not (isinstance(matrices, list) and all(
            isinstance(m, list) and len(m) == 2 and all(isinstance(v, int) and v > 0 for v in m)
            for m in matrices)):
        raise ValueError(f"model profile {path!r}: \"matrices\" must be [rows, cols] pairs of positive "
                         "integers, one per tensor")
    try:
        return Workload(doc.get("name", Path(path).stem), np.asarray(numels), np.asarray(share, dtype=float),
                        note=f"profile {path}", matrices=matrices)
    except ValueError as exc:
        raise ValueError(f"model profile {path!r}: {exc}") from None


def get_workload(spec: str) -> Workload:
    """``--model``: a profile ``.json`` (:func:`load_profile`), a built-in name (:data:`WORKLOADS`:
    ``resnet50``, ``vgg16``, ``vgg16-cifar10``, ``resnet20``, the transformers) or ``package.module:factory`` returning an nn.Module (:func:`from_module`)."""
    if spec.endswith(".json"):
        return load_profile(spec)
    if ":" in spec:
        import sys  # the working directory joins the path for this import (a console script's
        mod_name, _, fn_name = spec.partition(":")  # sys.path lacks it; ``python -m`` has it)
        cwd = str(Path.cwd())
        added = cwd not in sys.path and "" not in sys.path
        if added:
            sys.path.insert(0, cwd)
        try:
            factory = getattr(importlib.import_module(mod_name), fn_name)
        except (ImportError, AttributeError) as exc:
            raise ValueError(f"model {spec!r}: cannot load {fn_name!r} from {mod_name!r} ({exc}; modules "
                             f"are looked up in the working directory {cwd} and on the Python path)") from None
        finally:
            if added:
                sys.path.remove(cwd)
        return from_module(factory(), name=spec)
    if spec not in WORKLOADS:
        raise ValueError(f"--model {spec!r}: not a built-in workload (unknown workload {spec!r}; known: "
                         f"{', '.join(WORKLOADS.names())}), a profile .json or package.module:factory "
                         f"for any torch model (flashsgd's training models: 'flashsgd.train.models:{spec}')")
    return WORKLOADS.get(spec)()
