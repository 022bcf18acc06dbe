"""Driver of the runs in docs/sparse_accuracy.md: one `flashsgd train` run with extra hook options.

The sparse hooks' correction switches (momentum_correction, momentum_masking, local_clip) are
not `[comm]` config keys yet, so this driver adds them to the options the plan computed (the
plan's `_hook_options` wrapped, in this process only; workers receive the resolved plan).

Usage::

    python docs/data/sparse_accuracy/run.py OUT key=value ... [hook.OPTION=value ...]

`key=value` are `flashsgd train` config keys (flat names, e.g. algorithm=gtopk density=0.01);
`hook.OPTION=value` are hook options (e.g. hook.momentum_correction=0.9).
"""

from __future__ import annotations

import ast
import json
import sys

import flashsgd.train.plan as plan_mod
import flashsgd.train.worker as worker_mod
from flashsgd.train.config import resolve
from flashsgd.train.trainer import train


def _value(text: str):
    try:
        return ast.literal_eval(text)
    except (ValueError, SyntaxError):
        return text


def main(argv: list[str]) -> None:
    out, *pairs = argv
    cli, extra = {"out": out, "progress": False, "resume": "never", "checkpoint_every": 0}, {}
    for pair in pairs:
        key, value = pair.split("=", 1)
        (extra if key.startswith("hook.") else cli)[key.removeprefix("hook.")] = _value(value)
    original = plan_mod._hook_options

    def with_extra(cfg, ranks_per_node, steps_per_epoch):
        options = original(cfg, ranks_per_node, steps_per_epoch)
        if cfg.comm.algorithm in ("topk", "gtopk"):  # the sparse factory refuses it outside hgtopk
            options.pop("ranks_per_node", None)
        options.update(extra)
        return options

    plan_mod._hook_options = with_extra
    build = worker_mod.Worker.__init__

    def connect_layer_norms(self, *args, **kwargs):
        """LARS takes the trust ratio's gradient norms from the hook (layer_trust); the workers
        are forked, so they inherit this."""
        build(self, *args, **kwargs)
        if getattr(self.hook_state, "layer_trust", False) and hasattr(self.optimizer, "grad_norm_source"):
            self.optimizer.grad_norm_source = self.hook_state.grad_norms

    worker_mod.Worker.__init__ = connect_layer_norms
    summary = train(resolve(cli=cli))
    print(json.dumps({k: summary.get(k) for k in ("final_test_accuracy", "best_test_accuracy", "steps")}))


if __name__ == "__main__":
    main(sys.argv[1:])
