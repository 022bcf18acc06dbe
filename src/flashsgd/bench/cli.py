"""`flashsgd bench NAME`: measurements in the field's conventions.

Each benchmark is a module exposing ``HELP``, ``add_arguments(parser)`` and ``run(args) -> int``;
register it in ``BENCHMARKS`` below (one line).
"""

from __future__ import annotations

import argparse
import importlib


BENCHMARKS = {
    "allreduce": "flashsgd.bench.allreduce",
    "sparse": "flashsgd.bench.sparse",
    "lars": "flashsgd.bench.lars",
    "recipe": "flashsgd.bench.recipe",
    "train": "flashsgd.bench.train",
    "emulate": "flashsgd.bench.emulate",
    "scaling": "flashsgd.bench.scaling",
    "gpu": "flashsgd.bench.gpu",
    "data": "flashsgd.bench.data",
}


def add_arguments(parser: argparse.ArgumentParser) -> None:
    sub = parser.add_subparsers(dest="benchmark", required=True)
    for name, module_name in BENCHMARKS.items():
        module = importlib.import_module(module_name)
        p = sub.add_parser(name, help=module.HELP, description=module.__doc__, allow_abbrev=False,
                           formatter_class=argparse.RawDescriptionHelpFormatter)
        module.add_arguments(p)
        p.set_defaults(_bench_run=module.run)


def run(args: argparse.Namespace) -> int:
    return int(args._bench_run(args) or 0)
