"""`flashsgd bench lars`: LARS step time, batched norms vs a per-parameter Python loop (ResNet-50).

Fujitsu (Yamazaki et al. 2019, arXiv 1903.12650) computes all layers' LARS norms in one batched
operation instead of a loop per layer. This benchmark times one optimizer step over ResNet-50's
161 parameter tensors (25,557,032 parameters, shapes of torchvision's ``resnet50`` in
``named_parameters`` order, built here without torchvision):

1. ``loop``: a straightforward LARS as in common open implementations - for each tensor, two
   norm calls, the trust ratio, the buffer and weight updates (the same math as ours).
2. ``lars``: :class:`flashsgd.optim.lars.LARS` - two ``torch._foreach_norm`` calls for all
   tensors, one vectorized trust-ratio computation, ``_foreach`` updates.
3. ``sgd``: ``torch.optim.SGD(foreach=True)`` with momentum, the same groups: the cost of a plain
   momentum step (no norms), as a floor for what any LARS step costs.
4. ``norms-loop`` vs ``norms-batched``: the norm + trust-ratio phase alone (what Fujitsu batched).

Warm-up steps are excluded; each variant is timed ``--reps`` times (``--steps`` steps per rep,
device synchronized, variants interleaved round-robin), median and min..max per step are
printed, and the ratio loop / lars is taken within the same run. Bias and BN tensors (107 of
161) are excluded from adaptation and decay, as in the recipes.

Example::

    flashsgd bench lars                       # CPU, fp32
    flashsgd bench lars --device cuda --json runs/lars.json
"""

from __future__ import annotations

import argparse
import json
import platform
import statistics
import time
from pathlib import Path

import torch

from flashsgd.fmt import number, plural
from flashsgd.optim.lars import LARS
from flashsgd.outputs import add_output

HELP = "LARS step time: batched norms (_foreach_norm) vs a per-parameter loop, ResNet-50 shapes"

SPEEDUP_TARGET = 3.0
"""Speed-up of the batched-norm LARS step over the per-parameter loop this benchmark checks for."""
RESNET50_PARAMS = 25_557_032
RESNET50_TENSORS = 161


def resnet50_shapes() -> list[tuple[str, tuple[int, ...]]]:
    """(name, shape) of torchvision ``resnet50()``'s parameters, in ``named_parameters`` order."""
    shapes: list[tuple[str, tuple[int, ...]]] = [("conv1.weight", (64, 3, 7, 7)),
                                                 ("bn1.weight", (64,)), ("bn1.bias", (64,))]
    inplanes = 64
    for layer, (planes, blocks) in enumerate([(64, 3), (128, 4), (256, 6), (512, 3)], start=1):
        for b in range(blocks):
            pre, out = f"layer{layer}.{b}", planes * 4  # Bottleneck expansion 4
            shapes += [(f"{pre}.conv1.weight", (planes, inplanes, 1, 1)),
                       (f"{pre}.bn1.weight", (planes,)), (f"{pre}.bn1.bias", (planes,)),
                       (f"{pre}.conv2.weight", (planes, planes, 3, 3)),
                       (f"{pre}.bn2.weight", (planes,)), (f"{pre}.bn2.bias", (planes,)),
                       (f"{pre}.conv3.weight", (out, planes, 1, 1)),
                       (f"{pre}.bn3.weight", (out,)), (f"{pre}.bn3.bias", (out,))]
            if b == 0:  # projection shortcut on the first block of each stage
                shapes += [(f"{pre}.downsample.0.weight", (out, inplanes, 1, 1)),
                           (f"{pre}.downsample.1.weight", (out,)), (f"{pre}.downsample.1.bias", (out,))]
            inplanes = out
    shapes += [("fc.weight", (1000, 2048)), ("fc.bias", (1000,))]
    return shapes


@torch.no_grad()
def loop_lars_step(groups: list[dict], state: dict) -> None:
    """One LARS step, one tensor at a time (the usual open-source form; same math as LARS)."""
    for group in groups:
        lr, m, wd = group["lr"], group["momentum"], group["weight_decay"]
        eta, eps = group["trust_coefficient"], group["eps"]
        for p in group["params"]:
            g = p.grad
            v = state.setdefault(p, torch.zeros_like(p))
            v.mul_(m)
            if group["lars"]:
                wn, gn = torch.linalg.vector_norm(p), torch.linalg.vector_norm(g)
                ratio = eta * wn / (gn + wd * wn + eps)
                ratio = torch.where((wn > 0) & (gn > 0), ratio, torch.ones_like(ratio))
                v.addcmul_(g, ratio)
                if wd != 0.0:
                    v.addcmul_(p, ratio * wd)
            else:
                v.add_(g)
                if wd != 0.0:
                    v.add_(p, alpha=wd)
            p.add_(v, alpha=-lr)


def make_groups(device: torch.device, dtype: torch.dtype, seed: int = 0) -> list[dict]:
    """ResNet-50-shaped parameters with fixed random gradients, split into adapted / excluded."""
    gen = torch.Generator().manual_seed(seed)
    adapt, excl = [], []
    for name, shape in resnet50_shapes():
        p = (torch.randn(shape, generator=gen) * 0.05).to(device, dtype).requires_grad_()
        p.grad = (torch.randn(shape, generator=gen) * 1e-3).to(device, dtype)
        (excl if len(shape) == 1 else adapt).append(p)
    hp = dict(lr=0.1, momentum=0.9, trust_coefficient=0.001, eps=1e-9)
    return [dict(params=adapt, weight_decay=5e-5, lars=True, **hp),
            dict(params=excl, weight_decay=0.0, lars=False, **hp)]


def _time(variants: dict, device: torch.device, warmup: int, reps: int, steps: int) -> dict:
    """Seconds per step for each variant; repetitions interleaved round-robin, so that a load
    change on a shared machine hits every variant alike."""
    sync = torch.cuda.synchronize if device.type == "cuda" else (lambda: None)
    for step in variants.values():
        for _ in range(warmup):
            step()
    sync()
    per_step: dict[str, list[float]] = {k: [] for k in variants}
    for _ in range(reps):
        for name, step in variants.items():
            t0 = time.perf_counter()
            for _ in range(steps):
                step()
            sync()
            per_step[name].append((time.perf_counter() - t0) / steps)
    return per_step


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--device", default="cpu", help="cpu or cuda (default cpu)")
    parser.add_argument("--dtype", default="float32", choices=["float32", "float16", "bfloat16"])
    parser.add_argument("--warmup", type=int, default=3, help="untimed steps per variant")
    parser.add_argument("--reps", type=int, default=7, help="timed repetitions per variant")
    parser.add_argument("--steps", type=int, default=5, help="steps per repetition")
    parser.add_argument("--threads", type=int, default=0, help="torch CPU threads (0: default)")
    add_output(parser, "--json", default=None, help="write the results to this JSON file")


def run(args: argparse.Namespace) -> int:
    for name in ("reps", "steps"):
        if getattr(args, name) <= 0:
            raise ValueError(f"--{name} must be > 0, got {getattr(args, name)}")
    if args.warmup < 0:
        raise ValueError(f"--warmup must be >= 0, got {args.warmup}")
    device = torch.device(args.device)
    if device.type == "cuda" and not torch.cuda.is_available():
        raise ValueError("--device cuda requested but torch.cuda.is_available() is False; use --device cpu")
    if args.threads:
        torch.set_num_threads(args.threads)
    dtype = getattr(torch, args.dtype)
    shapes = resnet50_shapes()
    n_params = sum(torch.Size(s).numel() for _, s in shapes)
    assert len(shapes) == RESNET50_TENSORS and n_params == RESNET50_PARAMS, (len(shapes), n_params)

    hw = torch.cuda.get_device_name(device) if device.type == "cuda" else platform.processor() or platform.machine()
    print(f"# flashsgd bench lars: torch {torch.__version__}, device {device} ({hw}), "
          f"{torch.get_num_threads()} threads, python {platform.python_version()}")
    print(f"# ResNet-50 shapes: {len(shapes)} tensors, {n_params:,} params, {args.dtype}; "
          f"warmup {args.warmup}, {plural(args.reps, 'rep')} x {plural(args.steps, 'step')}")

    # Each variant owns its copy of the ResNet-50-shaped parameters, gradients and buffers.
    g_loop, loop_state = make_groups(device, dtype), {}
    opt = LARS(make_groups(device, dtype))
    sgd = torch.optim.SGD(make_groups(device, dtype), lr=0.1, momentum=0.9, foreach=True)

    # The norm phase alone (what Fujitsu batched): 2 x 161 norm calls + per-tensor trust ratios in a
    # loop, vs 2 _foreach_norm calls + one vectorized ratio.
    ps = [p for g in make_groups(device, dtype) for p in g["params"]]
    gs = [p.grad for p in ps]

    def norms_loop():
        out = []
        for p, g in zip(ps, gs):
            wn, gn = torch.linalg.vector_norm(p), torch.linalg.vector_norm(g)
            out.append(torch.where((wn > 0) & (gn > 0), 1e-3 * wn / (gn + 5e-5 * wn + 1e-9),
                                   torch.ones_like(wn)))
        return out

    def norms_batched():
        wn, gn = torch.stack(torch._foreach_norm(ps)), torch.stack(torch._foreach_norm(gs))
        return torch.where((wn > 0) & (gn > 0), 1e-3 * wn / (gn + 5e-5 * wn + 1e-9), torch.ones_like(wn))

    torch.testing.assert_close(torch.stack(norms_loop()), norms_batched())
    results = _time({"loop": lambda: loop_lars_step(g_loop, loop_state), "lars": opt.step,
                     "sgd": sgd.step, "norms-loop": norms_loop, "norms-batched": norms_batched},
                    device, args.warmup, args.reps, args.steps)

    med = {k: statistics.median(v) for k, v in results.items()}
    print(f"{'variant':>13} {'median ms/step':>15} {'min..max ms':>17} {'vs loop':>8}")
    for k, v in results.items():
        base = med["norms-loop"] if k.startswith("norms") else med["loop"]
        print(f"{k:>13} {med[k] * 1e3:15.2f} {min(v) * 1e3:8.2f}..{max(v) * 1e3:<8.2f} "
              f"{base / med[k]:7.2f}x")
    print(f"# speed-up of batched-norm LARS over the per-parameter loop: "
          f"{number(med['loop'] / med['lars'], than=SPEEDUP_TARGET)}x (target >= {SPEEDUP_TARGET:g}x); plain momentum SGD step: {med['sgd'] * 1e3:.2f} ms; norm phase alone: "
          f"{med['norms-loop'] / med['norms-batched']:.2f}x")
    if args.json:
        Path(args.json).parent.mkdir(parents=True, exist_ok=True)
        Path(args.json).write_text(json.dumps({
            "torch": torch.__version__, "device": str(device), "hardware": hw,
            "threads": torch.get_num_threads(), "dtype": args.dtype, "tensors": len(shapes),
            "params": n_params, "seconds_per_step": results,
            "median_ms": {k: v * 1e3 for k, v in med.items()},
            "speedup_loop_over_lars": med["loop"] / med["lars"],
            "speedup_norms": med["norms-loop"] / med["norms-batched"]}, indent=1))
    return 0
