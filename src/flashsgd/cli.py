"""The `flashsgd` command: `flashsgd train | bench | simulate | plan | compare` (thin: parse, then call the library).

Each subcommand lives in its own module exposing ``add_arguments(parser)`` and ``run(args) -> int``
(its one-line help is in ``COMMANDS`` below); this file only wires them together. Only the chosen subcommand's module is
imported, so `flashsgd simulate` never pays for importing torch.
"""

from __future__ import annotations

import argparse
import importlib
import os
import sys

# name -> (module, one-line help shown by `flashsgd --help` without importing the module)
COMMANDS = {
    "train": ("flashsgd.train.cli", "train with large-batch data-parallel SGD "
              "(default: 4 local workers on MNIST-1D)"),
    "bench": ("flashsgd.bench.cli", "measure all-reduce, sparse exchange, optimizer and "
              "training-step speed"),
    "simulate": ("flashsgd.sim.cli", "predict iteration time and scaling efficiency on "
                 "1,000s of GPUs"),
    "plan": ("flashsgd.sim.plan_cli", "which algorithm, grid, bucket size and density to run on "
             "a cluster, and the step time to expect"),
    "compare": ("flashsgd.train.records.compare", "one plot and table from several training runs "
                "(accuracy and loss vs step, samples and time)"),
}


def build_parser(load: tuple[str, ...] | None = None) -> argparse.ArgumentParser:
    """The parser; the subcommands in ``load`` (default: all) are imported with full arguments."""
    from flashsgd import __version__

    parser = argparse.ArgumentParser(
        prog="flashsgd",
        description="Large-minibatch, massively data-parallel synchronous SGD on PyTorch.",
        allow_abbrev=False,
    )
    parser.add_argument("--version", action="version", version=f"flashsgd {__version__}")
    sub = parser.add_subparsers(dest="command", required=True, metavar="{" + ",".join(COMMANDS) + "}")
    for name, (module_name, help_line) in COMMANDS.items():
        if load is not None and name not in load:
            sub.add_parser(name, help=help_line, allow_abbrev=False)
            continue
        module = importlib.import_module(module_name)
        # no abbreviations: a retired spelling (--timeout for --timeout-s) is an error, not a guess
        p = sub.add_parser(name, help=help_line, description=module.__doc__, allow_abbrev=False,
                           formatter_class=argparse.RawDescriptionHelpFormatter)
        module.add_arguments(p)
        p.set_defaults(_run=module.run)
    return parser


def main(argv: list[str] | None = None) -> int:
    """Parse, check the output paths (:mod:`flashsgd.outputs`), run; a ``ValueError`` (bad input)
    is printed as ``flashsgd: error: ...``, exit 2.

    Set ``FLASHSGD_DEBUG=1`` to get the traceback instead.
    """
    argv = sys.argv[1:] if argv is None else list(argv)
    command = next((a for a in argv if not a.startswith("-")), None)
    parser = build_parser((command,) if command in COMMANDS else ())
    args = parser.parse_args(argv)
    try:
        from flashsgd.outputs import check_args

        check_args(args)  # every declared output path, before any work
        return int(args._run(args) or 0)
    except BrokenPipeError:  # the reader went away (`flashsgd plan ... | head`): stop quietly
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())  # as the Python docs advise
        return 0
    except ValueError as exc:
        if os.environ.get("FLASHSGD_DEBUG"):
            raise
        print(f"flashsgd {command}: error: {exc}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
