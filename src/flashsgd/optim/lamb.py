"""LAMB with every per-layer norm computed in one batched call, as LARS does.

Paper: You et al. 2019, "Large Batch Optimization for Deep Learning: Training BERT in 76 minutes"
(LAMB, arXiv 1904.00962), Algorithm 2; the batched norms of Yamazaki et al. 2019 (Fujitsu).

Per parameter tensor ``w`` with gradient ``g`` at step t (``b1``, ``b2`` the Adam moments' decays,
``wd`` the weight decay, ``eta`` the trust coefficient)::

    m = b1 * m + (1 - b1) * g                       first moment
    v = b2 * v + (1 - b2) * g * g                   second moment
    r = (m / (1 - b1^t)) / (sqrt(v / (1 - b2^t)) + eps)     Adam's bias-corrected direction
    u = r + wd * w                                  decoupled weight decay (AdamW's), inside the trust
    ratio = eta * ||w|| / ||u||                     (1 when ||w|| == 0 or ||u|| == 0)
    w = w - lr * ratio * u

``eta`` is 1 in the paper (its phi is the identity). With ``eta`` the update of every adapted tensor
has norm ``lr * eta * ||w||``, the same as a LARS step of the same ``lr`` and ``eta`` (LARS:
``lr * eta * ||w|| / ||g|| * ||g||``), so one recipe's LR rule serves both
(:data:`flashsgd.optim.optimizers.OPTIMIZERS` passes the recipe's trust coefficient).

Excluded groups (``group["lars"] = False``: biases and normalization parameters,
:func:`flashsgd.optim.lars.param_groups`) take Adam's step with ratio 1 (the paper's "no
adaptation" layers) and, as built there, no weight decay.

Algorithm of one :meth:`LAMB.step` ("# Step N" in the body):

1. Gather parameters with a gradient, their gradients and moment buffers; count the step.
2. Update both moments and form ``u`` with ``torch._foreach_*`` ops over all tensors of a group.
3. Compute every ``||w||`` and ``||u||`` of the adapted tensors in two batched
   ``torch._foreach_norm`` calls; all ratios at once on an (n,) vector, zero-norm guards included.
4. ``w -= lr * ratio * u`` (the per-tensor ratios as :func:`flashsgd.optim.lars.per_tensor` makes
   them: fused on CUDA).

Cost: memory traffic ~16 passes over the parameter bytes (two moments, the direction, two norm
reads, the update); O(1) Python calls per group.

Example::

    >>> model = torch.nn.Sequential(torch.nn.Linear(4, 3), torch.nn.BatchNorm1d(3))
    >>> opt = LAMB(param_groups(model, weight_decay=0.01), lr=1e-3)
    >>> model(torch.randn(8, 4)).square().mean().backward()
    >>> opt.step()
"""

from __future__ import annotations

import math
from typing import Any, Iterable

import torch

from flashsgd.optim.lars import param_groups, per_tensor  # noqa: F401  (param_groups: the example's)


class LAMB(torch.optim.Optimizer):
    """LAMB (You et al. 2019) with batched per-layer norms; module docstring for the update.

    Args:
        params: parameters or groups (:func:`flashsgd.optim.lars.param_groups`: a group with
            ``lars=False`` is not trust-adapted).
        lr: learning rate (> 0 or 0).
        betas: the moments' decays ``(b1, b2)``, each in [0, 1).
        eps: added to the second moment's square root, > 0.
        weight_decay: decoupled weight decay, >= 0.
        trust_coefficient: ``eta`` of the ratio, > 0 (1: the paper's).
    """

    def __init__(self, params: Iterable[Any], lr: float = 1e-3, betas: tuple[float, float] = (0.9, 0.999),
                 eps: float = 1e-6, weight_decay: float = 0.0, trust_coefficient: float = 1.0) -> None:
        _check(lr, betas, eps, weight_decay, trust_coefficient)
        super().__init__(params, dict(lr=lr, betas=tuple(betas), eps=eps, weight_decay=weight_decay,
                                      trust_coefficient=trust_coefficient, lars=True))
        for group in self.param_groups:
            _check(group["lr"], group["betas"], group["eps"], group["weight_decay"], group["trust_coefficient"])

    @torch.no_grad()
    def step(self, closure=None):  # noqa: D102 - torch.optim.Optimizer.step
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        for group in self.param_groups:
            params = [p for p in group["params"] if p.grad is not None]  # Step 1
            if not params:
                continue
            if any(p.grad.is_sparse for p in params):
                raise ValueError("LAMB does not support sparse gradients")
            grads = [p.grad for p in params]
            for p in params:
                state = self.state[p]
                if not state:
                    state["step"] = 0
                    state["exp_avg"] = torch.zeros_like(p, memory_format=torch.preserve_format)
                    state["exp_avg_sq"] = torch.zeros_like(p, memory_format=torch.preserve_format)
                state["step"] += 1
            t = self.state[params[0]]["step"]  # one group's tensors step together
            ms = [self.state[p]["exp_avg"] for p in params]
            vs = [self.state[p]["exp_avg_sq"] for p in params]
            update = _direction(group, params, grads, ms, vs, t)  # Step 2
            if group["lars"]:
                wn = torch.stack(torch._foreach_norm(params))  # Step 3
                un = torch.stack(torch._foreach_norm(update))
                ratio = group["trust_coefficient"] * wn / un
                ratio = torch.where((wn > 0) & (un > 0), ratio, torch.ones_like(ratio))
                torch._foreach_mul_(update, per_tensor(ratio, params))
            torch._foreach_add_(params, update, alpha=-group["lr"])  # Step 4
        return loss


def _direction(group: dict, params: list, grads: list, ms: list, vs: list, t: int) -> list[torch.Tensor]:
    """Step 2: the moments updated in place; returns ``u = m_hat / (sqrt(v_hat) + eps) + wd * w``."""
    b1, b2 = group["betas"]
    torch._foreach_lerp_(ms, grads, 1.0 - b1)                 # m = b1 m + (1 - b1) g
    torch._foreach_mul_(vs, b2)
    torch._foreach_addcmul_(vs, grads, grads, value=1.0 - b2)  # v = b2 v + (1 - b2) g^2
    denom = torch._foreach_sqrt(vs)
    torch._foreach_div_(denom, math.sqrt(1.0 - b2 ** t))      # sqrt(v_hat)
    torch._foreach_add_(denom, group["eps"])
    update = torch._foreach_div(ms, denom)
    torch._foreach_div_(update, 1.0 - b1 ** t)                # m_hat / (sqrt(v_hat) + eps)
    if group["weight_decay"] != 0.0:
        torch._foreach_add_(update, params, alpha=group["weight_decay"])
    return update


def _check(lr: float, betas: Any, eps: float, weight_decay: float, trust_coefficient: float) -> None:
    if not (isinstance(lr, (int, float)) and math.isfinite(lr) and lr >= 0):
        raise ValueError(f"lr must be a finite number >= 0, got {lr!r}")
    if not (isinstance(betas, (tuple, list)) and len(betas) == 2 and all(0.0 <= b < 1.0 for b in betas)):
        raise ValueError(f"betas must be two numbers in [0, 1), got {betas!r}")
    if not eps > 0:
        raise ValueError(f"eps must be > 0, got {eps!r}")
    if not (math.isfinite(weight_decay) and weight_decay >= 0):
        raise ValueError(f"weight_decay must be a finite number >= 0, got {weight_decay!r}")
    if not (math.isfinite(trust_coefficient) and trust_coefficient > 0):
        raise ValueError(f"trust_coefficient must be a finite number > 0, got {trust_coefficient!r}")
