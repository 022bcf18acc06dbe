"""Deep Gradient Compression's corrections to sparsified SGD, as steps on one flat bucket.

Paper: Lin, Han, Mao, Wang, Dally 2018, "Deep Gradient Compression" (DGC, arXiv 1712.01887),
sec. 3.2-3.3 and Algorithm 1 (with momentum correction), and the authors' code
(github.com/synxlin/deep-gradient-compression, ``dgc/memory.py``). Used by the ``topk`` / ``gtopk``
hooks of :mod:`flashsgd.comm.sparse.hooks`, per bucket and rank, before the selection:

1. :func:`clip_local_` - local gradient clipping: this rank's bucket gradient is scaled to a norm
   of at most ``max_norm`` before it enters the accumulation (DGC sec. 3.3: clip before
   accumulating, so that a few large gradients cannot dominate the residual for many steps).
2. :func:`accumulate_velocity` - momentum correction: the momentum is applied here, on the local
   gradient, and the *velocity* is accumulated into the residual (DGC eq. 6-7)::

       u = m * u + g;        v = v + u              (heavy ball)
       u = m * (u + g);      v = v + u + g          (Nesterov, the DGC code's form)

   so that the sparse update that leaves the rank is the part of ``v`` that momentum SGD would
   have applied. The optimizer must then run with momentum 0 (the velocity is already in the
   update); :func:`check_momentum_owner` refuses both at once.
3. :func:`mask_momentum_` - momentum-factor masking: ``u`` is zeroed where ``v`` was sent (DGC
   sec. 3.3), so that a sent coordinate's old velocity does not keep pushing it ("stale momentum").

4. :func:`layer_norms` - for LARS (``layer_trust``): the norm of each parameter's gradient,
   dense, so that the optimizer's trust ratio does not depend on how many entries were sent.

Cost: clipping one norm and one scale (2 passes over the bucket), momentum 2 passes, masking a
scatter of k entries.

Example::

    >>> g, u, v = torch.ones(4), torch.zeros(4), torch.zeros(4)
    >>> v, u = accumulate_velocity(v, u, clip_local_(g, 4.0), momentum=0.9)
    >>> mask_momentum_(u, torch.tensor([0])); u.tolist()
    [0.0, 1.0, 1.0, 1.0]
"""

from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist

from flashsgd.comm.waits import wait_collective


def check_momentum_owner(hook_momentum: float, optimizer_momentum: float) -> None:
    """ValueError when the hook's momentum correction and the optimizer would both apply momentum.

    Momentum correction moves the momentum into the compressor: build the optimizer with
    momentum 0 (and nesterov False) when the hook's ``owns_momentum`` is True.
    """
    if hook_momentum > 0 and optimizer_momentum > 0:
        raise ValueError(f"momentum applied twice: the sparse hook's momentum_correction="
                         f"{hook_momentum:g} accumulates the velocity, and the optimizer has momentum="
                         f"{optimizer_momentum:g}; set the optimizer's momentum to 0 (nesterov off) or "
                         f"momentum_correction to 0")


def clip_local_(grad: torch.Tensor, max_norm: float | None) -> torch.Tensor:
    """Step 1: scale ``grad`` in place to an L2 norm <= ``max_norm`` (None: unchanged); returns it."""
    if max_norm is not None:
        norm = torch.linalg.vector_norm(grad)
        # one scale factor, min(1, max_norm / norm): torch.nn.utils.clip_grad_norm_'s rule
        grad.mul_(torch.clamp(max_norm / (norm + 1e-6), max=1.0))
    return grad


def accumulate_velocity(residual: torch.Tensor, velocity: torch.Tensor, grad: torch.Tensor,
                        momentum: float, nesterov: bool = False, *, out: torch.Tensor | None = None,
                        out_velocity: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """Step 2: ``(v + u', u')`` with ``u' = m*u + g`` (Nesterov: ``u' = m*(u + g)``, and
    ``v + u' + g``), as new tensors: ``residual`` v and ``velocity`` u are left as they were (the
    hooks keep a step's starting memories until the step is kept, :mod:`flashsgd.comm.hook_step`).
    The same arithmetic, in the same order, as the in-place form ``u.mul_(m).add_(g); v.add_(u)``.
    ``out`` / ``out_velocity``: where to write them (buffers of the caller's), else new tensors."""
    if nesterov:
        velocity = torch.add(velocity, grad, out=out_velocity).mul_(momentum)
        return torch.add(residual, velocity, out=out).add_(grad), velocity
    velocity = torch.mul(velocity, momentum, out=out_velocity).add_(grad)
    return torch.add(residual, velocity, out=out), velocity


def mask_momentum_(velocity: torch.Tensor, sent: Any) -> None:
    """Step 3: zero the velocity at the ``sent`` indices (int64, into the flat bucket), or at the
    counted ones of a :class:`flashsgd.comm.sparse.Counted` (fixed size: no host sync)."""
    if isinstance(sent, torch.Tensor):
        velocity.index_fill_(0, sent, 0)
    else:
        sent.zero_(velocity)


def layer_norms(buf: torch.Tensor, sizes: list[int], group: Any, timeout_s: float,
                what: str) -> torch.Tensor:
    """Per-parameter L2 norms of the world's gradient, estimated from every rank's local one:
    ``sqrt(mean_r ||g_r||^2)`` per parameter slice of the flat bucket ``buf`` (one all-reduce
    of ``len(sizes)`` floats). LARS's trust ratio divides by it instead of the norm of the sparse
    aggregate, whose norm depends on how many entries of the layer were sent (docs/sparse_accuracy.md).
    """
    squares = torch.stack([piece.square().sum() for piece in buf.split(sizes)]) if sizes \
        else buf.new_zeros(0)
    squares.div_(dist.get_world_size(group))
    if squares.numel():
        wait_collective(dist.all_reduce(squares, group=group, async_op=True), group, timeout_s, what, squares)
    return squares.sqrt_()
