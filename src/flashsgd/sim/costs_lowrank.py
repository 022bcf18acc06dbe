"""PowerSGD for the simulator: low-rank gradient compression as torch's ``powerSGD_hook`` runs it.

Paper: Vogels, Karimireddy & Jaggi 2019, "PowerSGD: Practical Low-Rank Gradient Compression for
Distributed Optimization" (arXiv 1905.13727); the exchange of
``torch.distributed.algorithms.ddp_comm_hooks.powerSGD_hook`` (flashsgd's ``powersgd`` hook,
:mod:`flashsgd.comm.powersgd_hooks`). Per message, every tensor viewed as a matrix M (n x m, torch's
``shape[0] x rest``) is compressed at rank r' = min(n, m, r) when n m > (n + m) r' x 2 (the hook's
``min_compression_rate``); the others travel uncompressed:

1. ring all-reduce of the uncompressed elements u;
2. P = M Q (2 n m r' flops each), ring all-reduce of sum n r' elements, orthogonalise P
   (2 n r'^2 flops);
3. Q = M^T P (2 n m r'), ring all-reduce of sum m r' elements;
4. M = P Q^T (2 n m r').

Cost: three ring all-reduces (:func:`flashsgd.sim.costs.ring`, each with its per-call overhead) +
flops x ``flop_s`` + the error-feedback add (n m elements, gamma per byte) + the hook's own work per
compressed element, n m x ``lowrank_s_per_elem`` (measured on an H200: launch-bound,
:mod:`flashsgd.sim.device_costs`). Registered in
:data:`flashsgd.sim.algorithms.SIMULATED` as ``powersgd``; the signature is
``cost(n_bytes, setup) -> Cost`` of :mod:`flashsgd.sim.costs`. Without ``setup.matrices`` each
message is taken as one square matrix.

Example::

    >>> split(((64, 576), (64, 1)), rank=1)    # the (64, 1) bias travels uncompressed
    (64.0, 64.0, 576.0, 221312.0, 36864.0)
    >>> from flashsgd.sim.costs import CommSetup
    >>> from flashsgd.sim.network import CLUSTERS
    >>> setup = CommSetup(gpus=8, cluster=CLUSTERS.get("1gbe"), matrices=((64, 576), (64, 1)))
    >>> round(float(powersgd(0.0, setup).latency_s) * 1e3, 2)   # 3 rings of 2(P-1) steps of 0.44 ms
    18.48
"""

from __future__ import annotations

import numpy as np

from flashsgd.sim.costs import CommSetup, Cost, cost, ring, zero_cost

MIN_COMPRESSION_RATE = 2.0  # flashsgd.comm.powersgd_hooks.make_powersgd's default (torch's: 2.0)


def split(matrices, rank: int) -> tuple[float, float, float, float, float]:
    """(uncompressed elements, P elements, Q elements, matmul + orthogonalisation flops, n m sum)."""
    u = ps = qs = flops = nm = 0.0
    for rows, cols in matrices:
        r = min(rows, cols, rank)
        if rows * cols > (rows + cols) * r * MIN_COMPRESSION_RATE:  # worth compressing
            ps, qs, nm = ps + rows * r, qs + cols * r, nm + rows * cols
            flops += 3 * 2.0 * rows * cols * r + 2.0 * rows * r * r  # Steps 2-4 + orthogonalisation
        else:
            u += rows * cols
    return u, ps, qs, flops, nm


@cost("powersgd")
def powersgd(n_bytes, setup: CommSetup) -> Cost:
    """Steps 1-4 of the module docstring for a message of ``n_bytes`` (or ``setup.matrices``)."""
    n = np.asarray(n_bytes, dtype=float)
    if setup.gpus == 1:
        return zero_cost(n)
    vb = setup.value_bytes
    if setup.matrices is not None:
        parts = [np.full_like(n, v) for v in split(setup.matrices, setup.matrix_approximation_rank)]
    else:  # one square matrix per message
        side = np.sqrt(n / vb)
        r = np.minimum(side, setup.matrix_approximation_rank)
        worth = side * side > 2 * side * r * MIN_COMPRESSION_RATE
        parts = [np.where(worth, 0.0, side * side), np.where(worth, side * r, 0.0),
                 np.where(worth, side * r, 0.0), np.where(worth, 6 * side * side * r + 2 * side * r * r, 0.0),
                 np.where(worth, side * side, 0.0)]
    u, ps, qs, flops, nm = parts
    cost = ring(u * vb, setup) + ring(ps * vb, setup) + ring(qs * vb, setup)        # Steps 1-3
    c = setup.cluster
    compute = flops * c.flop_s + nm * (vb * c.gamma_s_per_byte + c.lowrank_s_per_elem)  # Steps 2-4
    z = np.zeros_like(n)
    return cost + Cost(z, z, compute, z)
