"""`flashsgd bench gpu`: one command that checks flashsgd on an NVIDIA GPU and measures it.

Four checks, each a table whose rows carry their measured numbers and, where a target exists,
pass or FAIL (exit status 1 when any row fails, 0 when all pass):

1. ``hooks`` (:mod:`flashsgd.bench.gpu_hooks`): every DDP hook of the catalog
   (:data:`flashsgd.exchanges.EXCHANGES`: native, noop, ring, hierarchical, torus2d, topk, gtopk,
   hgtopk, powersgd, with their threaded variants and node splits) on CUDA gradient buckets, with
   2 and 4 Gloo ranks sharing one GPU (Gloo carries CUDA tensors; NCCL cannot put two ranks on one
   GPU) and with NCCL at world size 1; each pass's gradients compared with the dense all-reduce
   of the same local gradients (the sparse exchanges at density 1.0 send everything, so they
   must equal it; at density 0.05, and PowerSGD, error feedback must conserve the gradient).
   Target: max relative difference <= 1e-5.
2. ``select`` (:mod:`flashsgd.bench.gpu_kernels`): the sparse hooks' top-k selections on a
   25,557,032-element gradient on the GPU (ResNet-50's) against ``torch.topk``: time, speed-up,
   and agreement (target: the same selected magnitudes as torch.topk).
3. ``lars``: one LARS step over ResNet-50's parameters against a foreach momentum-SGD step (time
   ratio), and against the per-tensor loop of ``flashsgd bench lars`` (target: equal within 1e-5).
4. ``train`` (:mod:`flashsgd.bench.gpu_train`): ResNet-50 training images/s at fp32 / bf16 / fp16 x
   channels_last off / on x ``torch.compile`` off / on, flashsgd's training step beside a plain
   DDP training loop of the same model and GPU-resident batch timed in the same run (and
   torchvision's ResNet-50 in the plain loop where torchvision imports). Target: flashsgd's
   images/s >= 0.95 x the plain loop's at every configuration.

5. ``overhead`` (:mod:`flashsgd.bench.gpu_overhead`): every hook of the catalog in a user's own
   DDP loop (registered through the library API) against the plain DDP loop, ResNet-50 bf16
   channels_last at batch 256 and 64, one GPU: step time ratio and host synchronizations per step.
   Targets: >= 0.95x plain (PowerSGD 0.90x), no host synchronization beyond the plain loop's.

Timing is :func:`flashsgd.timing.time_ops` everywhere: warm-up calls excluded, compared calls
interleaved, the device synchronized before each clock read, median with min..max over the
repetitions. The header names the GPU, the driver stack and the versions.

Without a CUDA device the command prints one line (``no CUDA device: ...; nothing checked``) and
exits 0 (``--require-cuda``: 1). ``--device cpu`` (for development and tests) runs the same code
paths at tiny sizes on the CPU (ResNet-20, batch 8, 2^18 elements): its numbers say nothing about
a GPU.

Example::

    flashsgd bench gpu --json runs/gpu.json            # everything (tens of minutes with compile)
    flashsgd bench gpu --quick                          # hooks at 2 ranks, channels_last, no compile
    flashsgd bench gpu --checks train --compile on --precisions bf16 --json runs/gpu-compile.json
"""

from __future__ import annotations

import argparse
import dataclasses
import os
import platform

import torch
import torch.distributed as dist

from flashsgd.bench.common import run_metadata, write_json
from flashsgd.bench.gpu_common import RATIO_TARGET, GpuSettings, cuda_missing, first_line, run_job
from flashsgd.bench.gpu_hooks import HOOK_WORLDS
from flashsgd.fmt import plural
from flashsgd.outputs import add_output

HELP = ("check flashsgd on a GPU: every hook on CUDA, top-k selection, LARS, ResNet-50 images/s vs a plain loop, "
        "each hook's cost in a plain DDP loop (overhead)")

CHECKS = ("hooks", "select", "lars", "train", "overhead")
QUICK_CHECKS = ("hooks", "select", "lars", "train")
"""What ``--quick`` runs unless ``--checks`` says (the overhead check is its own run: ``--checks overhead``)."""
PRECISIONS = ("fp32", "bf16", "fp16")
SWITCH = {"both": (False, True), "on": (True,), "off": (False,)}
TORCHVISION_MODELS = ("resnet50",)
"""Models of the training check that torchvision also has (timed in the plain loop where it imports)."""


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--checks", default=None,
                        help=f"checks to run (default {','.join(CHECKS)}; --quick: {','.join(QUICK_CHECKS)})")
    parser.add_argument("--quick", action="store_true",
                        help="a shorter run: hooks at 2 ranks (and NCCL at 1), training with channels_last "
                             "on and compile off only (unless --hook-ranks / --channels-last / --compile say)")
    parser.add_argument("--hook-ranks", default=None, help="Gloo ranks on one GPU for the hooks check "
                        f"(default {','.join(map(str, HOOK_WORLDS))}; --quick: {HOOK_WORLDS[0]})")
    parser.add_argument("--precisions", default=",".join(PRECISIONS),
                        help=f"training precisions (default {','.join(PRECISIONS)})")
    parser.add_argument("--channels-last", choices=list(SWITCH), default=None, help="training: default both")
    parser.add_argument("--compile", choices=list(SWITCH), default=None, help="training: default both")
    parser.add_argument("--batch", type=int, default=None,
                        help="training batch per GPU (default 256; the overhead check also runs a quarter of it)")
    parser.add_argument("--steps", type=int, default=None,
                        help="timed repetitions per measured call (default 20; --device cpu: 2)")
    parser.add_argument("--warmup", type=int, default=None,
                        help="untimed calls before timing (default 5; --device cpu: 1)")
    parser.add_argument("--densities", default=None,
                        help="densities of the selection check (default: the catalog's 0.001 and 10x it)")
    parser.add_argument("--require-cuda", action="store_true",
                        help="exit 1 instead of 0 when no CUDA device is available")
    parser.add_argument("--device", choices=["cuda", "cpu"], default="cuda", help=argparse.SUPPRESS)
    add_output(parser, "--json", default=None, metavar="PATH", help="also write every row and the metadata here")


def _names(text: str, valid: tuple[str, ...], flag: str) -> tuple[str, ...]:
    names = tuple(n.strip() for n in str(text).split(",") if n.strip())
    bad = [n for n in names if n not in valid]
    if bad or not names:
        raise ValueError(f"{flag} {text!r}: {'unknown ' + ', '.join(bad) if bad else 'names nothing'}; "
                         f"valid: {', '.join(valid)}")
    return names


def _numbers(text: str, kind: type, flag: str, ok, valid: str) -> tuple:
    try:
        values = tuple(kind(v) for v in str(text).split(",") if v.strip())
    except ValueError:
        values = ()
    if not values or not all(ok(v) for v in values):
        raise ValueError(f"{flag} {text!r} must be a comma-separated list of {valid}")
    return values


def settings_from(args: argparse.Namespace, torchvision: bool) -> tuple[GpuSettings, tuple[str, ...], tuple[int, ...]]:
    """(settings, checks, hook worlds) of the command line; ValueError naming a bad flag.
    ``torchvision``: whether it imports (then its model of the same name joins the plain loop)."""
    from flashsgd.exchanges import check_density

    checks = _names(args.checks or ",".join(QUICK_CHECKS if args.quick else CHECKS), CHECKS, "--checks")
    for flag, value, low in (("--batch", args.batch, 1), ("--steps", args.steps, 1), ("--warmup", args.warmup, 0)):
        if value is not None and value < low:
            raise ValueError(f"{flag} must be >= {low}, got {value}")
    quick = args.quick
    default_worlds = HOOK_WORLDS[:1] if quick else HOOK_WORLDS
    worlds = _numbers(args.hook_ranks or ",".join(map(str, default_worlds)), int, "--hook-ranks",
                      lambda w: w >= 1, "rank counts >= 1, e.g. 2,4")
    densities = None if args.densities is None else _numbers(
        args.densities, float, "--densities", lambda d: check_density(d, "--densities") > 0, "numbers in (0, 1]")
    settings = GpuSettings.for_device(
        args.device, batch=args.batch, steps=args.steps, warmup=args.warmup, densities=densities,
        precisions=_names(args.precisions, PRECISIONS, "--precisions"),
        channels_last=SWITCH[args.channels_last or ("on" if quick else "both")],
        compile=SWITCH[args.compile or ("off" if quick else "both")])
    return dataclasses.replace(settings, torchvision=torchvision and settings.model in TORCHVISION_MODELS), \
        checks, worlds


def torchvision_version() -> tuple[str | None, str]:
    """(torchvision's version, or None, and why not)."""
    try:
        import torchvision  # noqa: PLC0415 - optional
    except Exception as exc:  # noqa: BLE001 - a CPU torch with a CUDA torchvision fails in many ways
        return None, f"does not import ({type(exc).__name__}: {first_line(exc, 80)})"
    return torchvision.__version__, ""


def _device_lines(settings: GpuSettings) -> list[str]:
    """The header: the device, the software stack, the numeric settings both loops share."""
    if not settings.cuda:
        return [f"# flashsgd bench gpu --device cpu: the CUDA check's code paths at tiny sizes on the CPU "
                f"({platform.machine()}, {os.cpu_count()} CPUs); no figure here describes a GPU"]
    props = torch.cuda.get_device_properties(0)
    nccl = torch.cuda.nccl.version() if dist.is_nccl_available() else "not built"  # (major, minor, patch)
    nccl = ".".join(map(str, nccl)) if isinstance(nccl, tuple) else str(nccl)
    return [f"# flashsgd bench gpu: {torch.cuda.get_device_name(0)} (cuda:0, compute capability "
            f"{props.major}.{props.minor}, {props.total_memory / 2**30:.1f} GiB), "
            f"{plural(torch.cuda.device_count(), 'GPU')} visible",
            f"# CUDA {torch.version.cuda}, cuDNN {torch.backends.cudnn.version()}, NCCL {nccl}; TF32: matmul "
            f"{_on(torch.backends.cuda.matmul.allow_tf32)}, cuDNN {_on(torch.backends.cudnn.allow_tf32)}; "
            f"cudnn.benchmark {_on(torch.backends.cudnn.benchmark)} (torch's defaults, as flashsgd train runs)"]


def _on(flag: bool) -> str:
    return "on" if flag else "off"


def _plan_line(settings: GpuSettings, checks: tuple[str, ...], worlds: tuple[int, ...]) -> str:
    from flashsgd.bench.gpu_overhead import PRECISION, overhead_batches
    from flashsgd.bench.gpu_train import configurations

    parts = {"hooks": f"hooks ({','.join(map(str, worlds))} Gloo ranks on one device, and "
                      f"{'NCCL' if settings.cuda else 'Gloo'} x 1)",
             "select": f"select ({settings.numel:,} elements, densities {','.join(f'{d:g}' for d in settings.densities)})",
             "lars": f"lars ({settings.model})",
             "train": f"train ({settings.model}, batch {settings.batch}, "
                      f"{plural(len(configurations(settings)), 'configuration')}, recipe {settings.recipe}, torchvision's model: "
                      f"{'yes' if settings.torchvision else 'no'})",
             "overhead": f"overhead ({settings.model}, batch {','.join(map(str, overhead_batches(settings)))}, "
                         f"{PRECISION}, channels_last, every hook vs plain DDP at world 1)"}
    return (f"# checks: {'; '.join(parts[c] for c in checks)}; {settings.steps} timed repetitions after "
            f"{settings.warmup} warm-up (excluded), median (min..max)")


def _section(title: str) -> None:
    print(f"\n## {title}", flush=True)


def _job(fn, args: tuple, settings: GpuSettings, check: str) -> list[dict]:
    """One check's rows from its own rank (NCCL on CUDA); a failed job adds one failed row."""
    backend = "nccl" if settings.cuda else "gloo"
    rows, error = run_job(fn, 1, args, settings, backend)
    if error is not None:
        rows.append({"check": check, "passed": False, "error": f"the job failed: {error}"})
        print(f"FAIL: the {check} job failed: {error}", flush=True)
    return rows


def run(args: argparse.Namespace) -> int:
    settings_from(args, torchvision=False)  # a bad flag is an error with or without a GPU
    missing = cuda_missing() if args.device == "cuda" else None
    if missing:
        print(f"no CUDA device: {missing}; nothing checked", flush=True)
        return 1 if args.require_cuda else 0
    tv, tv_why = torchvision_version()
    settings, checks, worlds = settings_from(args, torchvision=tv is not None)
    from flashsgd.bench.gpu_hooks import HEADER as HOOKS_HEADER, run_hooks
    from flashsgd.bench.gpu_kernels import kernels_rank
    from flashsgd.bench.gpu_train import TRAIN_HEADER, configurations, train_rank

    tv_text = tv or tv_why
    for line in _device_lines(settings):
        print(line)
    meta = run_metadata(benchmark="gpu", settings=dataclasses.asdict(settings), checks=list(checks),
                        hook_ranks=list(worlds), torchvision=tv_text,
                        device=_device_lines(settings))
    print(f"# torch {meta['torch']}, torchvision {tv_text}, python {meta['python']}, {meta['cpu_count']} CPUs, "
          f"host {meta['host']}, load avg {meta['loadavg_1m']:.1f}")
    print(_plan_line(settings, checks, worlds), flush=True)
    rows: list[dict] = []
    if "hooks" in checks:
        _section("hooks: each pass's gradients vs the dense all-reduce of the same local gradients "
                 "(noop: the local gradient; error feedback: the gradient conserved)")
        print(HOOKS_HEADER, flush=True)
        rows += run_hooks(settings, worlds)
        _save(args.json, meta, rows)
    kernels = tuple(c for c in checks if c in ("select", "lars"))
    if kernels:
        rows += _job(kernels_rank, (settings, kernels), settings, "/".join(kernels))
        _save(args.json, meta, rows)
    if "train" in checks:
        _section(f"train: {settings.model} images/s, flashsgd's step vs a plain DDP loop, one {settings.device}-"
                 f"resident batch of {settings.batch}; target x plain (and x tv) >= {RATIO_TARGET}")
        print(TRAIN_HEADER, flush=True)
        rows += _job(train_rank, (settings, configurations(settings)), settings, "train")
        _save(args.json, meta, rows)
    if "overhead" in checks:
        from flashsgd.bench.gpu_overhead import HEADER as OVERHEAD_HEADER, overhead_rank

        _section("overhead: each hook in a plain DDP loop (world 1: the hook's own work) vs the plain loop; "
                 f"target x plain >= {RATIO_TARGET} (powersgd 0.90) on CUDA, no host sync beyond the plain loop's")
        print(OVERHEAD_HEADER, flush=True)
        rows += _job(overhead_rank, (settings,), settings, "overhead")
        _save(args.json, meta, rows)
    return _summary(rows)


def _save(path: str | None, meta: dict, rows: list[dict]) -> None:
    if path:
        write_json(path, meta, rows)


def _summary(rows: list[dict]) -> int:
    """The closing line; exit status 1 when a row failed."""
    failed = [r for r in rows if r.get("passed") is False]
    judged = sum(r.get("passed") is not None for r in rows)
    names = ", ".join(_name(r) for r in failed[:8]) + (", ..." if len(failed) > 8 else "")
    print(f"\n# {plural(judged, 'row')} with a target: {judged - len(failed)} pass, {len(failed)} FAIL"
          + (f" ({names})" if failed else ""), flush=True)
    return 1 if failed else 0


def _name(row: dict) -> str:
    if row["check"] == "hooks":
        return f"hooks {row.get('case')} x{row.get('world')}"
    if row["check"] == "overhead" and "hook" in row:
        return f"overhead {row['hook']} batch {row['batch']}"
    if row["check"] == "train" and "precision" in row:
        return f"train {row['precision']} ch_last {_on(row['channels_last'])} compile {_on(row['compile'])}"
    return f"{row['check']} {row.get('method') or row.get('step') or 'job'}"
