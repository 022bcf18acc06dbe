"""One GPU's training throughput for known GPU x model x precision pairs, each with its source.

``flashsgd simulate`` and ``flashsgd plan`` need one GPU's training rate (samples/s at the batch
per GPU). When ``--samples-per-s`` (``--images-per-s``) is not given they take, in this order:

1. the preset's own ResNet-50 figure (``ClusterModel.resnet50_images_per_s``), for ``resnet50``;
2. a published rate from :data:`RATES` for the cluster's device class (``ClusterModel.device``,
   :data:`flashsgd.sim.device_costs.DEVICES`), the workload and the precision;
3. a rate derived from the GPU's peak and the workload's FLOPs (:func:`derived`): ``MFU x peak /
   (3 x forward FLOPs per sample)`` (backward ~2x forward), an ASSUMPTION ranged by :data:`MFU`.

Every rate is ranged like every other assumption (:mod:`flashsgd.sim.uncertainty`), and ``plan``
and ``simulate`` print which one they used and its source (:meth:`RateChoice.describe`).
``precision`` is the run's arithmetic as the sources name it: ``fp16`` mixed precision (AMP),
``fp32`` FP32 or, on A100/H100, TF32 (the vendors' default for FP32 training); the same flag says
what the gradients are on the wire (``--precision``).

Example::

    >>> r = RATES["a100/bert-large/fp16"]
    >>> r.rate, r.batch
    (580.0, 256)
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from typing import Literal

from flashsgd.registry import Registry

# NVIDIA DeepLearningExamples, PyTorch/LanguageModeling/BERT/README.md, "Training performance
# results" (pytorch:21.11-py3 container): "Pre-training NVIDIA DGX A100 (8x A100 80GB)" and
# "Pre-training NVIDIA DGX-1 With 32G", the 1-GPU rows (sequences/s). The batch is the micro-batch:
# the accumulated batch per GPU over the accumulation steps (A100: 8192 / 64 TF32 = 128, 8192 / 32
# AMP = 256 at length 128; 4096 / 256 = 16 and 4096 / 128 = 32 at 512. V100 32G: 4096 / 128 = 32
# and 4096 / 64 = 64; 2048 / 512 = 4 and 2048 / 256 = 8).
_DLE_BERT = ("NVIDIA DeepLearningExamples PyTorch BERT README, 'Pre-training NVIDIA DGX A100 (8x A100 80GB)' "
             "table, 1 GPU, pytorch:21.11")
_DLE_BERT_V100 = ("NVIDIA DeepLearningExamples PyTorch BERT README, 'Pre-training NVIDIA DGX-1 With 32G' table, "
                  "1 GPU, pytorch:21.11")
# ResNet-50 v1.5: NVIDIA DeepLearningExamples PyTorch/Classification/ConvNets/resnet50v1.5/README.md,
# "Training performance" tables, 1 GPU (the rows of docs/data/published_scaling.toml).
_DLE_RN50_A100 = "NVIDIA DeepLearningExamples PyTorch ResNet-50 v1.5 README, 'Training performance: NVIDIA DGX A100 (8x A100 80GB)', 1 GPU"
_DLE_RN50_V100 = "NVIDIA DeepLearningExamples PyTorch ResNet-50 v1.5 README, 'Training performance: NVIDIA DGX-1 16GB (8x V100 16GB)', 1 GPU"

# GPT-2 (124M, 350M; 1,024 tokens) with llm.c (C/CUDA, bf16, micro-batch 64, 524,288 tokens per step,
# 8 GPUs of one node, so the all-reduce is inside the figure: a slight lower bound on one GPU's rate):
# H100: KellerJordan/modded-nanogpt records/track_1_short/2024-10-13_llmc/README.md, "8x H100 HBM3 ...
# The mean per-step time was 140ms": 524,288 / 0.140 / 8 / 1,024 = 457 sequences/s per GPU; 350M: the
# repository's README track 2 table, "llm.c baseline (350M parameters)", 5.8 hours for llm.c's 60,000
# steps (scripts/run_gpt2_350M.sh): 184 per GPU, a lower bound (wall clock with its evaluations).
# A100: karpathy/llm.c scripts/run_gpt2_124M.sh "on 8X A100 80GB SXM ... steps in ~300ms/iter" (213)
# and run_gpt2_350M.sh "~820ms/iter" (78). mosaicml/llm-foundry's benchmark table (MPT-125m / 350m, 8x
# A100 80GB, amp_bf16: 156,468 and 64,813 tokens/s per GPU = 153 and 63 sequences/s) sits at 0.72x and
# 0.81x of them, inside the range. TF32: FlagOpen/FlagPerf training/nvidia/gpt2-pytorch/README.md,
# Megatron GPT-2 345M on one A100 40GB, "fp32" 14.2 samples/s at micro-batch 4 (TF32: 14.2 x 3 x 827
# GFLOP is 35 TFLOPS, above the A100's 19.5 FP32 peak).
_LLMC_H100 = "llm.c GPT-2 on 8x H100 SXM (modded-nanogpt's llm.c baseline record), bf16, 1,024 tokens"
_LLMC_A100 = "llm.c scripts/run_gpt2_*.sh, 8x A100 80GB SXM, bf16, 1,024 tokens"
_FLAGPERF_GPT2 = "FlagPerf gpt2-pytorch README, Megatron GPT-2 345M, 1x A100 40GB, 'fp32' (TF32), 1,024 tokens"
# ViT-B/16 at 224 px: NVIDIA/JAX-Toolbox rosetta/projects/vit/README.md (JAX/T5X, bf16, 512 per GPU, 8
# GPUs): "Samples/Sec (A100) 7200.38, (H100) 11669.52" = 900 and 1,459 per GPU (30% and 16% of the
# dense peak with this project's FLOP count; the README: "ViT currently does not support Transformer
# Engine"). High end: FlagPerf vit-pytorch (torchvision vit_b_16, one A100 40GB, amp per its config)
# 1,151 images/s, 1.28x the JAX figure; the H100's high end the same 1.28x [judgement].
_ROSETTA_VIT = "NVIDIA JAX-Toolbox Rosetta ViT-B/16 README, 8x {gpu}, bf16, 224 px"
_FLAGPERF_VIT_A100 = 1151.0  # images/s, FlagPerf vit-pytorch, one A100 40GB: the high end's source
# H100 BERT-large: no published pre-training rate (NVIDIA's README has no H100 rows in any revision).
# ASSUMPTION [ratio transfer]: the A100 rows above x the H100 / A100 ratio of one harness with the same
# code and container, lambdal/deeplearning-benchmark pytorch/pytorch-train-throughput-{fp16,fp32}.csv,
# BERT-large SQuAD fine-tuning (384 tokens): H100 80GB SXM5 301 / A100 80GB SXM4 152 = 1.98 (fp16), 141 /
# 75 = 1.88 (fp32). Range 0.6x-1.3x [judgement: one ratio of another task carried over; its high end
# near the 40%-of-peak derivation, 1.32x].
_LAMBDA_H100_OVER_A100 = {"fp16": 301 / 152, "fp32": 141 / 75}
_RATIO_SPREAD = (0.6, 1.3)

# A published rate's range [judgement]: high 1.05x (the vendor's tuned code, fused attention and
# optimizer kernels, is already near the fast end); low 0.6x (an unfused model, e.g. transformers'
# modules on plain PyTorch, another container, a smaller batch).
PUBLISHED_SPREAD = (0.6, 1.05)

MFU = (0.40, 0.25, 0.55)
"""ASSUMPTION [unverified] (stated, low, high): the share of the GPU's dense peak a training step
reaches when no rate is published. Check against the cited rows with this project's FLOP counts
(benchmarks/make_workloads.py, 3 x forward per sample): BERT-large at 128 tokens on an A100, AMP
580 seq/s x 261.6 GFLOP = 152 TFLOPS of 312 = 49%, TF32 317 x 261.6 = 83 of 156 = 53%; on a V100,
AMP 224 -> 47% of 125 (the V100's FP32 50 seq/s would be 83% of its 15.7 TFLOPS: the FLOP count
includes the vocabulary projection over every token, which NVIDIA's code runs on the masked ones
only, ~9% of the forward). Large-model training reports 30-55% (e.g. Megatron-LM; PaLM's 46%)."""

PEAK_TFLOPS: dict[str, dict[str, float]] = {
    # Dense (no structured sparsity) tensor-core peaks from the vendor datasheets; fp32: TF32 where
    # the GPU has it (A100, H100: the FP32 training default), else the FP32 peak.
    "h100": {"fp16": 989.0, "fp32": 494.0},   # H100 SXM5 datasheet: FP16 1,979 / TF32 989 with sparsity
    "a100": {"fp16": 312.0, "fp32": 156.0},   # A100 datasheet: FP16 312, TF32 156
    "v100": {"fp16": 125.0, "fp32": 15.7},    # V100 SXM2 datasheet: tensor 125, FP32 15.7
    "p100": {"fp16": 21.2, "fp32": 10.6},     # P100 SXM2 datasheet: FP16 21.2, FP32 10.6
    "gtx1080ti": {"fp16": 11.3, "fp32": 11.3},  # GP102: FP16 at 1/64 rate; mixed precision runs at FP32's
}
"""Dense peak TFLOPS by device class (:data:`flashsgd.sim.device_costs.DEVICES`) and precision."""


@dataclass(frozen=True)
class ComputeRate:
    """One GPU's published training throughput for a model at a precision."""

    device: str
    """Device class (:data:`flashsgd.sim.device_costs.DEVICES`)."""
    model: str
    """Workload name (:data:`flashsgd.sim.workload.WORKLOADS`)."""
    precision: Literal["fp16", "fp32"]
    rate: float
    """Samples per second (the workload's unit: images, sequences)."""
    batch: int
    """The batch per GPU (micro-batch) it was measured at."""
    source: str
    spread: tuple[float, float] = PUBLISHED_SPREAD
    """Its plausible range as factors of ``rate`` (low, high)."""

    def __post_init__(self) -> None:
        if not self.rate > 0 or self.batch < 1 or self.precision not in ("fp16", "fp32"):
            raise ValueError(f"ComputeRate {self.device}/{self.model}: rate > 0, batch >= 1, precision "
                             f"fp16 or fp32 needed, got {self.rate!r}, {self.batch!r}, {self.precision!r}")
        if not 0 < self.spread[0] <= 1 <= self.spread[1]:
            raise ValueError(f"ComputeRate {self.device}/{self.model}: need 0 < spread low <= 1 <= high, "
                             f"got {self.spread!r}")

    @property
    def low(self) -> float:
        return self.rate * self.spread[0]

    @property
    def high(self) -> float:
        return self.rate * self.spread[1]


RATES: Registry[ComputeRate] = Registry("compute rate")


def _add(r: ComputeRate) -> None:
    RATES.add(f"{r.device}/{r.model}/{r.precision}", r)


for _r in (
    ComputeRate("a100", "bert-large", "fp16", 580.0, 256, _DLE_BERT + ", mixed precision, length 128"),
    ComputeRate("a100", "bert-large", "fp32", 317.0, 128, _DLE_BERT + ", TF32, length 128"),
    ComputeRate("a100", "bert-large-seq512", "fp16", 210.0, 32, _DLE_BERT + ", mixed precision, length 512"),
    ComputeRate("a100", "bert-large-seq512", "fp32", 110.0, 16, _DLE_BERT + ", TF32, length 512"),
    ComputeRate("v100", "bert-large", "fp16", 224.0, 64, _DLE_BERT_V100 + ", mixed precision, length 128"),
    ComputeRate("v100", "bert-large", "fp32", 50.0, 32, _DLE_BERT_V100 + ", FP32, length 128"),
    ComputeRate("v100", "bert-large-seq512", "fp16", 75.0, 8, _DLE_BERT_V100 + ", mixed precision, length 512"),
    ComputeRate("v100", "bert-large-seq512", "fp32", 19.0, 4, _DLE_BERT_V100 + ", FP32, length 512"),
    ComputeRate("a100", "resnet50", "fp16", 2470.0, 256, _DLE_RN50_A100 + ", mixed precision"),
    ComputeRate("a100", "resnet50", "fp32", 938.0, 256, _DLE_RN50_A100 + ", TF32"),
    ComputeRate("v100", "resnet50", "fp16", 1200.0, 256, _DLE_RN50_V100 + ", mixed precision"),
    ComputeRate("v100", "resnet50", "fp32", 367.0, 112, _DLE_RN50_V100 + ", FP32"),
    ComputeRate("h100", "gpt2", "fp16", 457.0, 64, _LLMC_H100 + ", 140 ms per step"),
    ComputeRate("h100", "gpt2-medium", "fp16", 184.0, 64, _LLMC_H100 + ", 350M: 5.8 h for 60,000 steps (a lower bound)",
                spread=(0.6, 1.2)),
    ComputeRate("a100", "gpt2", "fp16", 213.0, 64, _LLMC_A100 + ", ~300 ms per step"),
    ComputeRate("a100", "gpt2-medium", "fp16", 78.0, 64, _LLMC_A100 + ", 350M: ~820 ms per step"),
    ComputeRate("a100", "gpt2-medium", "fp32", 14.2, 4, _FLAGPERF_GPT2),
    ComputeRate("a100", "vit-b16", "fp16", 900.0, 512, _ROSETTA_VIT.format(gpu="A100"),
                spread=(0.6, _FLAGPERF_VIT_A100 / 900.0)),
    ComputeRate("h100", "vit-b16", "fp16", 1458.7, 512, _ROSETTA_VIT.format(gpu="H100"),
                spread=(0.6, _FLAGPERF_VIT_A100 / 900.0)),
):
    _add(_r)


def _ratio_transfer(a100: ComputeRate) -> ComputeRate:
    """The H100's rate for ``a100``'s model and precision: ``a100.rate`` x Lambda's H100 / A100 ratio."""
    ratio = _LAMBDA_H100_OVER_A100[a100.precision]
    return replace(a100, device="h100", rate=a100.rate * ratio, spread=_RATIO_SPREAD,
                   source=f"ASSUMPTION [ratio transfer]: the A100 row (NVIDIA's BERT README) x {ratio:.3g} = H100 / "
                          f"A100 of Lambda's BERT-large SQuAD benchmark ({a100.precision}); no published H100 "
                          "pre-training rate")


for _key in ("bert-large/fp16", "bert-large/fp32", "bert-large-seq512/fp16", "bert-large-seq512/fp32"):
    _add(_ratio_transfer(RATES[f"a100/{_key}"]))


@dataclass(frozen=True)
class RateChoice:
    """The compute rate a prediction uses, its range (None: measured, given) and where it came from."""

    rate: float
    range: tuple[float, float] | None
    source: str
    unit: str = "images"
    batch: int | None = None
    """The batch the source measured at, when it is a published rate."""

    def describe(self, batch_per_gpu: int | None = None) -> str:
        """``compute rate: 580 sequences/s/GPU [348-609] (NVIDIA ...; measured at batch 256)``."""
        rng = f" [{self.range[0]:.4g}-{self.range[1]:.4g}]" if self.range else ""
        text = f"compute rate: {self.rate:.4g} {self.unit}/s/GPU{rng} ({self.source}"
        if self.batch is not None:
            text += f"; measured at batch {self.batch}"
            if batch_per_gpu is not None and batch_per_gpu * 2 <= self.batch:
                text += (f": at batch {batch_per_gpu} a GPU usually runs fewer samples/s (launch-bound); "
                         "give --samples-per-s if you know yours")
        return text + ")"


def derived(device: str, precision: str, forward_flops: float) -> tuple[float, float, float]:
    """(stated, low, high) samples/s from the peak: ``MFU x peak / (3 x forward FLOPs)``."""
    peak = PEAK_TFLOPS[device][precision] * 1e12
    per_sample = 3.0 * forward_flops  # forward + backward (~2x forward)
    return tuple(m * peak / per_sample for m in MFU)  # type: ignore[return-value]


def lookup(device: str, model: str, precision: str, forward_flops: float | None, unit: str) -> RateChoice | None:
    """A published rate (:data:`RATES`), else one derived from the peak (:func:`derived`), else None."""
    key = f"{device}/{model}/{precision}"
    if key in RATES:
        r = RATES[key]
        return RateChoice(r.rate, (r.low, r.high), r.source, unit, r.batch)
    if device in PEAK_TFLOPS and forward_flops:
        rate, lo, hi = derived(device, precision, forward_flops)
        return RateChoice(rate, (lo, hi), f"ASSUMPTION [unverified]: derived, {MFU[0]:.0%} (range "
                          f"{MFU[1]:.0%}-{MFU[2]:.0%}) of the {device.upper()}'s {PEAK_TFLOPS[device][precision]:g} "
                          f"{precision} TFLOPS over 3 x {forward_flops / 1e9:.3g} GFLOP per sample; no published "
                          f"rate in flashsgd.sim.compute_rates", unit)
    return None
