"""The `flashsgd` command: `flashsgd train | bench | simulate` (thin: parse, then call the library).

Each subcommand lives in its own module exposing ``HELP`` (one line), ``add_arguments(parser)`` and
``run(args) -> int``; this file only wires them together.
"""

from __future__ import annotations

import argparse
import importlib
import sys

COMMANDS = {
    "train": "flashsgd.train.cli",
    "bench": "flashsgd.bench.cli",
    "simulate": "flashsgd.sim.cli",
}


def build_parser() -> argparse.ArgumentParser:
    from flashsgd import __version__

    parser = argparse.ArgumentParser(
        prog="flashsgd",
        description="Large-minibatch, massively data-parallel synchronous SGD on PyTorch.",
    )
    parser.add_argument("--version", action="version", version=f"flashsgd {__version__}")
    sub = parser.add_subparsers(dest="command", required=True, metavar="{" + ",".join(COMMANDS) + "}")
    for name, module_name in COMMANDS.items():
        module = importlib.import_module(module_name)
        p = sub.add_parser(name, help=module.HELP, description=module.__doc__,
                           formatter_class=argparse.RawDescriptionHelpFormatter)
        module.add_arguments(p)
        p.set_defaults(_run=module.run)
    return parser


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    return int(args._run(args) or 0)


if __name__ == "__main__":
    sys.exit(main())
