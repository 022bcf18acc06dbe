"""Driver of the runs in docs/sparse_accuracy.md: one `flashsgd train` run from key=value pairs.

Every hook option of the sparse exchanges (momentum_correction, momentum_masking, local_clip,
layer_trust, ...) is a `[comm]` config key of `flashsgd train` now, so this driver only turns its
arguments into a config and prints the run's summary; `hook.OPTION=value` (the form the queue files
of the first runs used) is the config key OPTION.

Usage::

    python docs/data/sparse_accuracy/run.py OUT key=value ... [hook.OPTION=value ...]

`key=value` are `flashsgd train` config keys (flat names, e.g. algorithm=gtopk density=0.01).
"""

from __future__ import annotations

import ast
import json
import sys

from flashsgd.train.config import resolve
from flashsgd.train.trainer import train


def _value(text: str):
    try:
        return ast.literal_eval(text)
    except (ValueError, SyntaxError):
        return text


def main(argv: list[str]) -> None:
    out, *pairs = argv
    cli = {"out": out, "progress": False, "resume": "never", "checkpoint_every": 0}
    for pair in pairs:
        key, value = pair.split("=", 1)
        cli[key.removeprefix("hook.")] = _value(value)
    summary = train(resolve(cli=cli))
    print(json.dumps({k: summary.get(k) for k in ("final_test_accuracy", "best_test_accuracy", "steps")}))


if __name__ == "__main__":
    main(sys.argv[1:])
