"""Does a communication thread pay for itself in the Gloo hooks? (``threaded=False`` vs ``True``)

Trains an MLP with DDP on W local Gloo ranks and times full training steps - the trainer's own
step (:class:`flashsgd.train.step.TrainStep` through :func:`flashsgd.bench.sparse_hook.hook_step`:
forward, loss, backward with the hook, the [loss, samples, non-finite] all-reduce, SGD step) - for
DDP's built-in all-reduce (``native``) and for the ring and torus2d hooks of
``flashsgd.comm.dense_hooks``, each with ``threaded=False`` (the bucket is reduced inside the hook,
backward waits) and ``threaded=True`` (the hook's default: a communication thread reduces while
backward goes on). Both options are passed explicitly. Timed with :func:`flashsgd.timing.time_ops`
(interleaved step by step, barrier before each, slowest rank, median): ``--rounds`` x
(``--steps`` - 1) timed steps per configuration after ``--steps`` - 1 untimed ones. The MLP is
``bench sparse --hook``'s (5 square layers of ``--width`` and a 10-way head). Prints the median
step time and the ratio to native measured in the same run.

    python benchmarks/hook_threading.py --workers 4 --rounds 5 --steps 6
"""

from __future__ import annotations

import argparse

import torch._dynamo  # noqa: F401  imported once before forking (DDP imports it)

from flashsgd.bench.sparse_hook import hook_model, hook_step
from flashsgd.launch import spawn
from flashsgd.timing import time_ops

LAYERS = 5


def _worker(configs, rounds, steps, width, batch, bucket_mb):
    fns = [hook_step(name, opts, LAYERS, width, bucket_mb, batch)[0] for name, opts in configs]
    timings = time_ops(fns, iters=rounds * max(1, steps - 1), warmup=max(1, steps - 1))
    return [t.median_s for t in timings]


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--workers", type=int, default=4, help="local ranks (default 4)")
    p.add_argument("--rounds", type=int, default=5)
    p.add_argument("--steps", type=int, default=6)
    p.add_argument("--width", type=int, default=512)
    p.add_argument("--batch", type=int, default=256)
    p.add_argument("--bucket-mb", type=float, default=1.0)
    p.add_argument("--grid", default=None)
    a = p.parse_args()
    configs = [("native", {})]
    for name in ("ring", "torus2d"):
        extra = {"grid": a.grid} if name == "torus2d" and a.grid else {}
        configs += [(name, dict(extra, threaded=False)), (name, dict(extra, threaded=True))]
    med = spawn(_worker, a.workers, (configs, a.rounds, a.steps, a.width, a.batch, a.bucket_mb),
                timeout_s=1200)[0]
    params = sum(q.numel() for q in hook_model(LAYERS, a.width).parameters())
    print(f"# world {a.workers}, MLP {params / 1e6:.2f} M params ({params * 4 / 2**20:.1f} MiB fp32), "
          f"batch {a.batch}/rank, bucket_cap_mb {a.bucket_mb}, {a.rounds * max(1, a.steps - 1)} timed steps")
    print(f"{'hook':<28}{'step(ms)':>10}{'x native':>10}")
    for i, (name, opts) in enumerate(configs):
        label = name if name == "native" else f"{name} threaded={opts['threaded']}"
        print(f"{label:<28}{med[i] * 1e3:>10.1f}{med[0] / med[i]:>10.2f}")


if __name__ == "__main__":
    main()
