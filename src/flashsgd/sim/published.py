"""A published scaling figure as the scaling efficiency ``flashsgd simulate`` prints.

Papers and vendor tables state scaling in several ways; the simulator's efficiency is one GPU-count's
throughput over ``GPUs x`` one GPU's (:class:`flashsgd.sim.engine.SimResult`). :func:`to_efficiency`
converts (:data:`KINDS`), ``flashsgd simulate --to-efficiency KIND VALUE --gpus N`` prints it:

* ``speedup``: throughput at N GPUs over that at ``base_gpus`` (default 1), e.g. "7.76x at 8 GPUs":
  ``S / (N / base)`` = 97.0% (relative to the base's efficiency when the base is not one GPU);
* ``weak-scaling``: NVIDIA's "Weak scaling" columns are the same factor at a fixed batch per GPU
  ("7.91" at 8 GPUs = 98.9%); strong scaling at a fixed global batch is too, but the batch per GPU
  then shrinks with N, so the simulator needs the batch of each run;
* ``weak-scaling-percent``: a percentage already (95 -> 95%);
* ``throughput``: the job's samples/s at N GPUs over ``N x`` one GPU's (``one_gpu``).

Example::

    >>> round(to_efficiency("speedup", 7.76, 8), 4), round(to_efficiency("throughput", 4591, 8, one_gpu=580), 4)
    (0.97, 0.9894)
"""

from __future__ import annotations

KINDS = {
    "speedup": "throughput at --gpus over that at --base-gpus (default 1)",
    "weak-scaling": "NVIDIA's 'Weak scaling' factor (throughput at N GPUs / at 1, batch per GPU fixed)",
    "weak-scaling-percent": "weak scaling as a percentage: the efficiency itself",
    "throughput": "the job's samples/s at --gpus; needs one GPU's (--samples-per-s)",
}
"""The published forms :func:`to_efficiency` converts."""


def to_efficiency(kind: str, value: float, gpus: int, base_gpus: int = 1, one_gpu: float | None = None) -> float:
    """The scaling efficiency (0-1) a published ``value`` of ``kind`` (:data:`KINDS`) at ``gpus`` means."""
    if kind not in KINDS:
        raise ValueError(f"--to-efficiency: unknown kind {kind!r}; valid: {', '.join(KINDS)}")
    if not value > 0 or gpus < 1 or base_gpus < 1 or base_gpus > gpus:
        raise ValueError(f"--to-efficiency: need a value > 0 and 1 <= base GPUs <= GPUs, got {value!r}, "
                         f"{base_gpus} -> {gpus}")
    if kind in ("speedup", "weak-scaling"):
        return value / (gpus / base_gpus)  # speed-up over the ideal N / base
    if kind == "weak-scaling-percent":
        return value / 100.0
    if not one_gpu or one_gpu <= 0:
        raise ValueError("--to-efficiency throughput needs one GPU's rate: --samples-per-s RATE")
    return value / (gpus * one_gpu)  # job throughput over N x one GPU's
