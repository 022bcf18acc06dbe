"""`flashsgd train`: large-batch data-parallel training, from one laptop to a cluster.

With no arguments: 4 local Gloo workers on the CPU (one NCCL rank per GPU where CUDA is available;
no torchrun needed) train the small 1D CNN on MNIST-1D
(generated locally) with the fujitsu recipe (LARS, warmup, poly decay; its MNIST-1D-tuned variant)
at global batch 4096, exchanging gradients with the 2D-Torus all-reduce on a 2x2 grid (2 ranks per
emulated node). Under torchrun the same command joins the environment's rendezvous (NCCL with CUDA,
else Gloo) and runs one worker per process.

Configuration: defaults < preset (--preset) < TOML file (--config) < flags. Every config key is a flag (dashes for
underscores; the exchange, TOML key comm.algorithm, is --comm); booleans are --x / --no-x;
see docs/training.md for the reference.

Run directory (--out): a rerun with the same settings resumes from the newest checkpoint (or says
the run is already complete); other settings are refused with the differing keys listed;
--resume never moves the previous run's files aside and starts over.

Exit codes: 0 done, 1 the run failed (one line per failed rank; tracebacks in <out>/error.log),
2 bad input (one line naming the key), 130/143 interrupted (SIGINT/SIGTERM).

Examples:
  flashsgd train
  flashsgd train --comm gtopk --density 0.01 --global-batch 8192 --out runs/gtopk
  flashsgd train --config my.toml --workers 8 --grid 4x2
  torchrun --nnodes 2 --nproc-per-node 4 --rdzv-backend c10d --rdzv-endpoint HOST:29500 \\
      -m flashsgd train --out /shared/run1 --resume auto
"""

from __future__ import annotations

import argparse
import dataclasses
import sys
import tempfile
import typing
from pathlib import Path

from flashsgd.train import config as C

FLAGS = {"algorithm": "comm"}
"""Config keys whose flag is spelled differently (one spelling each): the exchange is ``--comm`` on
every subcommand."""


def _is_bool(hint) -> bool:
    return hint is bool or (typing.get_origin(hint) is typing.Union and bool in typing.get_args(hint))


def _metavar(f: dataclasses.Field, hint) -> str:
    choices = C.choices_of(f, hint)
    if choices:
        return "{" + ",".join(choices) + "}"
    if typing.get_origin(hint) is typing.Union:
        return getattr([a for a in typing.get_args(hint) if a is not type(None)][0], "__name__", "VALUE").upper()
    return getattr(hint, "__name__", "VALUE").upper()


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--config", default=None, metavar="TOML",
                        help="TOML file with [data] [model] [optim] [comm] [run] sections")
    from flashsgd.train.config.presets import PRESETS

    parser.add_argument("--preset", default=None, choices=PRESETS.names(),
                        help="start from a named set of values (defaults < preset < --config < flags): "
                        + "; ".join(f"{n}: {PRESETS.get(n).summary}" for n in PRESETS.names()))
    docs = {}
    for cls in C.section_types().values():
        docs.update(C.field_docs(cls))
    groups: dict[str, argparse._ArgumentGroup] = {}
    for name, (section, f, hint) in C.field_index().items():
        group = groups.setdefault(section, parser.add_argument_group(f"[{section}]"))
        default = f.default if f.default is not dataclasses.MISSING else None
        flag = "--" + FLAGS.get(name, name).replace("_", "-")
        text = f"{docs.get(name, '')} (default: {default})".replace("%", "%%")
        if _is_bool(hint):  # --x / --no-x
            group.add_argument(flag, dest=name, default=argparse.SUPPRESS, help=text,
                               action=argparse.BooleanOptionalAction)
            continue
        # values stay strings here and are checked by config.coerce (errors name the key); a key
        # whose ``true`` means a value (metadata true_means) also takes the bare flag
        bare = {"nargs": "?", "const": "true"} if "true_means" in f.metadata else {}
        group.add_argument(flag, dest=name, default=argparse.SUPPRESS, metavar=_metavar(f, hint), help=text,
                           **bare)


def parse_config(args: argparse.Namespace) -> C.TrainConfig:
    cli = {k: v for k, v in vars(args).items() if k in C.field_index()}
    return C.resolve(args.config, cli, preset=getattr(args, "preset", None))


def _report_failure(err: Exception, out: Path) -> None:
    """One line per failed rank on stderr; the tracebacks into ``<out>/error.log``."""
    summary = getattr(err, "summary", None) or str(err).splitlines()[0]
    details = getattr(err, "details", None) or str(err)
    try:
        out.mkdir(parents=True, exist_ok=True)
        log = out / "error.log"
        log.write_text(details + "\n")
    except OSError:
        log = Path(tempfile.mkstemp(prefix="flashsgd-error-", suffix=".log")[1])
        log.write_text(details + "\n")
    print(f"flashsgd train: failed: {summary}\n  tracebacks: {log}", file=sys.stderr)


def run(args: argparse.Namespace) -> int:
    from flashsgd import launch
    from flashsgd.train.trainer import train

    try:
        cfg = parse_config(args)
    except ValueError as exc:
        print(f"flashsgd train: error: {exc}", file=sys.stderr)
        return 2
    try:
        train(cfg)
    except launch.WorkerError as exc:
        _report_failure(exc, Path(cfg.run.out))
        return 1
    except launch.Interrupted as exc:  # SIGINT / SIGTERM: the workers were stopped with us
        print(f"flashsgd train: interrupted ({exc}); {_resumable(Path(cfg.run.out))}", file=sys.stderr)
        return 128 + exc.signum
    except ValueError as exc:  # plan or run-directory checks, before any worker started
        print(f"flashsgd train: error: {exc}", file=sys.stderr)
        return 2
    except OSError as exc:  # before any worker started (the lock, config.toml on a full disk)
        where = "" if exc.filename else f" (run directory {cfg.run.out})"
        print(f"flashsgd train: failed before any worker started: {exc}{where}", file=sys.stderr)
        return 1
    return 0


def _resumable(out: Path) -> str:
    """What a rerun with the same settings does after an interruption, in words."""
    from flashsgd.train.records import checkpoint as ckpt

    try:
        target, _ = ckpt.resume_point(out / "checkpoints")
    except (ckpt.CheckpointError, OSError):
        target = None
    if target is None:
        return "no checkpoint was written yet: a rerun starts over"
    return f"the same command resumes from its last checkpoint ({target.name})"
