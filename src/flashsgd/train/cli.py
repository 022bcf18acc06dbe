"""`flashsgd train`: large-batch data-parallel training, from one laptop to a cluster.

With no arguments: 4 local Gloo workers (no torchrun needed) train the small 1D CNN on MNIST-1D
(generated locally) with the fujitsu recipe (LARS, warmup, poly decay, label smoothing) at global
batch 4096, exchanging gradients with the 2D-Torus all-reduce on a 2x2 grid (2 ranks per emulated
node). Under torchrun the same command joins the environment's rendezvous (NCCL with CUDA, else
Gloo) and runs one worker per process.

Configuration: defaults < TOML file (--config) < flags. Every config key is a flag (dashes for
underscores); see docs/training.md for the reference. Presets: --recipe goyal|sony|fujitsu,
--comm native|ring|hierarchical|torus2d|topk|gtopk.

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
import typing

from flashsgd.train import config as C


def _metavar(hint) -> str:
    if typing.get_origin(hint) is typing.Literal:
        return "{" + ",".join(map(str, typing.get_args(hint))) + "}"
    if typing.get_origin(hint) is typing.Union:
        return _metavar([a for a in typing.get_args(hint) if a is not type(None)][0])
    return getattr(hint, "__name__", "VALUE").upper()


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--config", default=None, metavar="TOML",
                        help="TOML file with [data] [model] [optim] [comm] [run] sections")
    docs = {}
    for cls in C.section_types().values():
        docs.update(C.field_docs(cls))
    groups: dict[str, argparse._ArgumentGroup] = {}
    for name, (section, f, hint) in C.field_index().items():
        group = groups.setdefault(section, parser.add_argument_group(f"[{section}]"))
        default = f.default if f.default is not dataclasses.MISSING else None
        # values stay strings here and are checked by config.coerce (errors name the key)
        group.add_argument("--" + name.replace("_", "-"), dest=name, default=argparse.SUPPRESS,
                           metavar=_metavar(hint),
                           help=f"{docs.get(name, '')} (default: {default})".replace("%", "%%"))


def parse_config(args: argparse.Namespace) -> C.TrainConfig:
    cli = {k: v for k, v in vars(args).items() if k in C.field_index()}
    return C.resolve(args.config, cli)


def run(args: argparse.Namespace) -> int:
    from flashsgd.train.trainer import build_recipe, train

    try:
        cfg = parse_config(args)
        build_recipe(cfg)  # recipe-level checks (e.g. warmup longer than the run) before spawning
    except ValueError as exc:
        print(f"flashsgd train: error: {exc}", file=sys.stderr)
        return 2

    summary = train(cfg)
    return 0 if summary is not None else 1
