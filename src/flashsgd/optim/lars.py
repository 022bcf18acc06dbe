"""LARS with all per-layer norms computed in one batched call, and the parameter-group helper.

Papers: You, Gitman, Ginsburg 2017, "Large Batch Training of Convolutional Networks" (LARS,
arXiv 1708.03888); Yamazaki et al. 2019 (Fujitsu, arXiv 1903.12650) for the batched norm
computation; NVIDIA apex ``LARC`` for the clip mode.

Per parameter tensor ``w`` with gradient ``g`` (the paper's notation, ``eta`` = trust coefficient,
``wd`` = weight decay, ``m`` = momentum)::

    local_lr = eta * ||w|| / (||g|| + wd * ||w|| + eps)        (1 when ||w|| == 0 or ||g|| == 0)
    local_lr = min(local_lr / lr, 1)                             (clip mode, LARC; else unchanged)
    u        = local_lr * (g + wd * w)                           the adapted update direction
    v        = m * v + u                                         momentum buffer (no LR inside)
    w        = w - lr * (u + m * v if nesterov else v)

Momentum-buffer convention: **the global LR is kept outside the buffer** (torch.optim.SGD's
convention). The paper writes ``v <- m*v + lr*local_lr*(g + wd*w); w <- w - v``, i.e. the LR inside
the buffer, which needs Goyal et al.'s momentum correction ``v <- m*(lr_{t+1}/lr_t)*v + ...``
whenever the LR changes (warmup, decay, a batch-size change). With ``v_inside = lr_t * v_outside``
the two forms give identical iterates, so we keep only the LR-outside form: any LR change made by
a scheduler (or by hand, ``group["lr"] = ...``) is correct without a correction step to forget,
and checkpoints hold a buffer that does not depend on the LR at save time.

Excluded groups (``group["lars"] = False``, built by :func:`param_groups` for biases and
normalization parameters) get ``local_lr = 1`` and usually ``weight_decay = 0``: they follow plain
momentum SGD.

Algorithm of one :meth:`LARS.step` (the "# Step N" comments in the body):

1. Gather the parameters with a gradient, their gradients and momentum buffers, group by group.
2. Compute every ``||w||`` and ``||g||`` with two batched ``torch._foreach_norm`` calls over all
   tensors (Fujitsu's batched norms) instead of two norm calls per tensor in a Python loop.
   With ``grad_norm_source`` set, ``||g||`` comes from it instead: a sparsified exchange
   (``topk``/``gtopk`` with ``layer_trust``) hands the optimizer a mostly-zero gradient whose norm
   depends on how many of a layer's entries were sent, so the trust ratio is taken from the
   dense gradient's norm (:meth:`flashsgd.comm.sparse.hooks.SparseHookState.grad_norms`).
3. Compute all trust ratios at once on a stacked (n,) vector, zero-norm guards included.
4. Update the momentum buffers and the weights with ``torch._foreach_*`` ops, per group (on CUDA
   the per-tensor ratios written out to each tensor's shape, so that every op is one fused
   multi-tensor kernel: :func:`per_tensor`).

Cost: memory traffic ~13 passes over the parameter bytes (2 norm reads, buffer scale, two
multiply-adds into the buffer, the weight update); the per-tensor Python work is O(1) calls per
group instead of O(tensors).

Example::

    >>> model = torch.nn.Sequential(torch.nn.Linear(4, 3), torch.nn.BatchNorm1d(3))
    >>> opt = LARS(param_groups(model, weight_decay=5e-5), lr=1.0, momentum=0.9, trust_coefficient=1e-3)
    >>> model(torch.randn(8, 4)).square().mean().backward()
    >>> opt.step()
"""

from __future__ import annotations

from typing import Any, Iterable

import torch
from torch import nn

_NORM_TYPES: tuple[type, ...] = (
    nn.modules.batchnorm._NormBase,
    nn.GroupNorm,
    nn.LayerNorm,
    nn.LocalResponseNorm,
)
if hasattr(nn, "RMSNorm"):
    _NORM_TYPES = _NORM_TYPES + (nn.RMSNorm,)


def _check_hparams(lr: float, momentum: float, weight_decay: float, trust_coefficient: float,
                   eps: float, nesterov: bool) -> None:
    if not lr >= 0.0:
        raise ValueError(f"lr must be >= 0, got {lr!r}")
    if not 0.0 <= momentum < 1.0:
        raise ValueError(f"momentum must be in [0, 1), got {momentum!r}")
    if not weight_decay >= 0.0:
        raise ValueError(f"weight_decay must be >= 0, got {weight_decay!r}")
    if not trust_coefficient > 0.0:
        raise ValueError(f"trust_coefficient must be > 0, got {trust_coefficient!r}")
    if not eps >= 0.0:
        raise ValueError(f"eps must be >= 0, got {eps!r}")
    if nesterov and momentum <= 0.0:
        raise ValueError("nesterov=True needs momentum > 0 (got momentum=0)")


class LARS(torch.optim.Optimizer):
    """Layer-wise Adaptive Rate Scaling with batched norms; LR outside the momentum buffer.

    Args:
        params: tensors or parameter groups (see :func:`param_groups`); a group may set ``lars``
            (bool, adapt this group, default True) and any hyper-parameter below.
        lr: global learning rate (the schedule's value; use the linear-scaling rule for it).
        momentum: momentum factor ``m`` in [0, 1).
        weight_decay: L2 coefficient ``wd`` added to the gradient (and to the trust-ratio
            denominator) of adapted groups; excluded groups use their own ``weight_decay``.
        trust_coefficient: ``eta`` > 0 (the paper uses 0.001).
        eps: added to the trust-ratio denominator.
        nesterov: Nesterov momentum (torch.optim.SGD's form).
        clip: LARC clip mode, ``local_lr = min(local_lr / lr, 1)`` so that the effective LR of a
            tensor never exceeds the global LR.

    The momentum buffer lives in ``state[p]["momentum_buffer"]`` in LR-free units (see the module
    docstring); ``state_dict()``/``load_state_dict()`` are torch's and round-trip exactly.

    Attribute ``grad_norm_source`` (None): a callable ``(params) -> (len(params),) tensor or None``
    giving the ``||g||`` of the trust ratio per adapted tensor (Step 2); None or a None result:
    the norms of the gradients themselves.
    """

    def __init__(self, params: Iterable[Any], lr: float = 0.1, momentum: float = 0.9,
                 weight_decay: float = 0.0, trust_coefficient: float = 0.001, eps: float = 1e-9,
                 nesterov: bool = False, clip: bool = False) -> None:
        _check_hparams(lr, momentum, weight_decay, trust_coefficient, eps, nesterov)
        defaults = dict(lr=lr, momentum=momentum, weight_decay=weight_decay,
                        trust_coefficient=trust_coefficient, eps=eps, nesterov=nesterov,
                        clip=clip, lars=True)
        super().__init__(params, defaults)
        self.grad_norm_source = None
        for group in self.param_groups:
            _check_hparams(group["lr"], group["momentum"], group["weight_decay"],
                           group["trust_coefficient"], group["eps"], group["nesterov"])

    @torch.no_grad()
    def step(self, closure=None):  # noqa: D102 - torch.optim.Optimizer.step
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        groups = self._groups_with_grads()  # Step 1
        if not groups:
            return loss
        # Step 2: all ||w|| and ||g|| of adapted groups in two batched calls.
        adapt_w = [p for g, ps, _, _ in groups if g["lars"] for p in ps]
        adapt_g = [q for g, _, gs, _ in groups if g["lars"] for q in gs]
        if adapt_w:
            w_norm = torch.stack(torch._foreach_norm(adapt_w))  # (n,)
            dense = self.grad_norm_source(adapt_w) if self.grad_norm_source is not None else None
            g_norm = torch.stack(torch._foreach_norm(adapt_g)) if dense is None else dense  # (n,)
        offset = 0
        for group, params, grads, bufs in groups:
            if group["lars"]:
                n = len(params)
                ratio = _trust_ratios(group, w_norm[offset:offset + n], g_norm[offset:offset + n])  # Step 3
                offset += n
                _adapted_update(group, params, grads, bufs, ratio)  # Step 4
            else:
                _momentum_sgd_update(group, params, grads, bufs)  # Step 4 (excluded group)
        return loss

    def _groups_with_grads(self) -> list[tuple[dict, list, list, list]]:
        """Step 1: (group, params, grads, momentum buffers) of the parameters with a gradient."""
        groups = []
        for group in self.param_groups:
            params = [p for p in group["params"] if p.grad is not None]
            if not params:
                continue
            if any(p.grad.is_sparse for p in params):
                raise ValueError("LARS does not support sparse gradients")
            grads = [p.grad for p in params]
            bufs = []
            for p in params:
                state = self.state[p]
                if "momentum_buffer" not in state:
                    state["momentum_buffer"] = torch.zeros_like(p, memory_format=torch.preserve_format)
                bufs.append(state["momentum_buffer"])
            groups.append((group, params, grads, bufs))
        return groups


def _trust_ratios(group: dict, wn: torch.Tensor, gn: torch.Tensor) -> torch.Tensor:
    """Step 3: the (n,) trust ratios of one group from its ||w|| and ||g|| (ratio 1 on zero norms)."""
    ratio = group["trust_coefficient"] * wn / (gn + group["weight_decay"] * wn + group["eps"])
    ratio = torch.where((wn > 0) & (gn > 0), ratio, torch.ones_like(ratio))
    if group["clip"]:
        # LARC (apex): ratio <- min(ratio / lr, 1), so lr * ratio <= lr for every tensor.
        lr = group["lr"]
        ratio = torch.clamp(ratio / lr, max=1.0) if lr > 0 else torch.ones_like(ratio)
    return ratio


def per_tensor(ratio: torch.Tensor, tensors: list[torch.Tensor], fused: bool | None = None) -> list[torch.Tensor]:
    """``ratio[i]`` as the multiplier of ``tensors[i]`` in the foreach ops of Step 4.

    CPU: n 0-d tensors, broadcast. CUDA: torch's foreach kernels fuse a list only when every pair
    of tensors has the same sizes and strides; a list of 0-d tensors sends each op down a loop of
    n single-tensor kernels (n launches per op, ~4 ops per step). So each ratio is written out to
    its tensor's size (one ``cat`` of expanded views: one kernel, no host sync) and viewed with the
    tensor's own strides (any dense layout, channels_last included: every element is the same).
    Same values element by element, so the same update bit for bit; costs one write of the
    adapted parameters' size. A tensor that is not dense keeps the 0-d form (correct, unfused).
    ``fused`` (default: on CUDA) picks the written-out form."""
    if not (ratio.is_cuda if fused is None else fused) or not all(t.is_contiguous() or t.is_contiguous(memory_format=torch.channels_last)
                                    for t in tensors):
        return list(ratio.unbind(0))
    sizes = [t.numel() for t in tensors]
    flat = torch.cat([r.expand(n) for r, n in zip(ratio.unbind(0), sizes)])
    return [f.as_strided(t.shape, t.stride()) for f, t in zip(flat.split(sizes), tensors)]


def _adapted_update(group: dict, params: list, grads: list, bufs: list, ratio: torch.Tensor) -> None:
    """Step 4: v = m*v + ratio*(g + wd*w); w -= lr * (ratio*(g + wd*w) + m*v if nesterov else v)."""
    lr, m, wd = group["lr"], group["momentum"], group["weight_decay"]
    scale = per_tensor(ratio, params)  # ratio[i] as a multiplier of tensor i
    if m != 0.0:
        torch._foreach_mul_(bufs, m)
    else:
        torch._foreach_zero_(bufs)
    wd_scale = per_tensor(ratio * wd, params) if wd != 0.0 else None  # ratio*wd, built once
    torch._foreach_addcmul_(bufs, grads, scale)
    if wd_scale is not None:
        torch._foreach_addcmul_(bufs, params, wd_scale)
    if group["nesterov"]:
        # u + m*v with u = ratio*(g + wd*w)
        upd = torch._foreach_mul(grads, scale)
        if wd_scale is not None:
            torch._foreach_addcmul_(upd, params, wd_scale)
        torch._foreach_add_(upd, bufs, alpha=m)
        torch._foreach_add_(params, upd, alpha=-lr)
    else:
        torch._foreach_add_(params, bufs, alpha=-lr)


def _momentum_sgd_update(group: dict, params: list, grads: list, bufs: list) -> None:
    """Step 4 (excluded group): plain momentum SGD, v = m*v + g + wd*w; w -= lr * (g + wd*w + m*v
    if nesterov else v)."""
    lr, m, wd = group["lr"], group["momentum"], group["weight_decay"]
    if m != 0.0:
        torch._foreach_mul_(bufs, m)
    else:
        torch._foreach_zero_(bufs)
    torch._foreach_add_(bufs, grads)
    if wd != 0.0:
        torch._foreach_add_(bufs, params, alpha=wd)
    if group["nesterov"]:
        upd = torch._foreach_add(grads, bufs, alpha=m)
        if wd != 0.0:
            torch._foreach_add_(upd, params, alpha=wd)
        torch._foreach_add_(params, upd, alpha=-lr)
    else:
        torch._foreach_add_(params, bufs, alpha=-lr)


def is_bias_or_norm(module: nn.Module, name: str, param: torch.Tensor) -> bool:
    """True for biases (and any 1-D parameter) and for parameters of normalization layers."""
    return param.ndim <= 1 or name.endswith("bias") or isinstance(module, _NORM_TYPES)


def param_groups(model: nn.Module, weight_decay: float, exclude_bias_and_norm: bool = True
                 ) -> list[dict[str, Any]]:
    """Split ``model``'s parameters into a decayed/adapted group and an excluded group.

    Biases and normalization parameters get ``weight_decay = 0`` and ``lars = False`` (no LARS
    adaptation) when ``exclude_bias_and_norm`` is set (Goyal et al. 2017 sec. 5; the MLPerf
    ResNet-50 LARS reference). The ``lars`` key is ignored by torch.optim.SGD, so the same groups
    serve both optimizers. Empty groups are dropped; shared parameters appear once.

    Args:
        model: the module whose ``named_parameters`` (requires_grad only) are split.
        weight_decay: L2 coefficient for the main group, >= 0.
        exclude_bias_and_norm: put biases and norm parameters in a no-decay, no-adaptation group.

    Example::

        >>> groups = param_groups(torch.nn.Linear(3, 2), weight_decay=1e-4)
        >>> [(len(g["params"]), g["weight_decay"], g["lars"]) for g in groups]
        [(1, 0.0001, True), (1, 0.0, False)]
    """
    if not weight_decay >= 0.0:
        raise ValueError(f"weight_decay must be >= 0, got {weight_decay!r}")
    main: list[torch.Tensor] = []
    excluded: list[torch.Tensor] = []
    seen: set[int] = set()
    for module in model.modules():
        for name, p in module.named_parameters(recurse=False):
            if not p.requires_grad or id(p) in seen:
                continue
            seen.add(id(p))
            (excluded if exclude_bias_and_norm and is_bias_or_norm(module, name, p) else main).append(p)
    groups = []
    if main:
        groups.append({"params": main, "weight_decay": weight_decay, "lars": True})
    if excluded:
        groups.append({"params": excluded, "weight_decay": 0.0, "lars": False})
    return groups
