"""``python -m flashsgd.emulate BENCHMARK [ARGS...]``: the per-rank entry of an emulated benchmark.

Runs ``flashsgd bench BENCHMARK ARGS`` through :mod:`flashsgd.bench.cli` only, so a rank imports
the benchmarks and nothing else of the CLI (faster start-up for W processes on shared cores).
"""

import argparse
import os
import sys

from flashsgd.bench import cli

parser = argparse.ArgumentParser(prog="python -m flashsgd.emulate")
cli.add_arguments(parser)
code = cli.run(parser.parse_args())
# End without C++ static destructors (see flashsgd.emulate.probe: an abort at interpreter exit, after
# the work and the JSON are done, in ~1 of 3 runs with subgroups on torch 2.13 + Gloo).
sys.stdout.flush()
sys.stderr.flush()
os._exit(code)
