"""The DDP communication hooks by name: ``HOOKS``, :func:`register_hook` and :func:`hook_options`.

Use::

    state = register_hook(ddp_model, "torus2d", grid="2x4")     # on every rank, after DDP(...)
    ...train...
    ckpt["hook"] = state.state_dict(); state.load_state_dict(ckpt["hook"])

Each entry of ``HOOKS`` is a factory ``make(ddp_model, **options) -> (state, hook | None)``;
:func:`register_hook` validates the options and calls ``ddp_model.register_comm_hook(state, hook)``
unless the hook is None. This module fills the registry from the two hook modules (one-way
imports: they never import this one):

- :mod:`flashsgd.comm.dense_hooks`: ``native``, ``noop``, ``ring``, ``hierarchical``, ``torus2d``
  (all-reduce algorithms of :mod:`flashsgd.comm.dense`; threading, overlap and bucket sizes are
  discussed there);
- :mod:`flashsgd.comm.sparse_hooks`: ``topk``, ``gtopk`` (sparsified exchange with error
  feedback, Shi et al. 2019, arXiv 1901.04359);
- :mod:`flashsgd.comm.powersgd_hooks`: ``powersgd`` (torch's PowerSGD hook, Vogels et al. 2019,
  arXiv 1905.13727, with a checkpointable state).

Example::

    >>> model = DDP(net, bucket_cap_mb=4)
    >>> state = register_hook(model, "hierarchical", ranks_per_node=4)
    >>> loss_fn(model(x), y).backward()      # gradients averaged by the hierarchical all-reduce
"""

from __future__ import annotations

import inspect
from typing import Any, Callable

from flashsgd.comm import dense_hooks, powersgd_hooks, sparse_hooks
from flashsgd.comm.hook_common import HookFactory
from flashsgd.registry import Registry

HOOKS: Registry[HookFactory] = Registry("DDP communication hook")
HOOKS.add("native", dense_hooks.make_native)
HOOKS.add("noop", dense_hooks.make_noop)
for _name in dense_hooks.DENSE_HOOKS:
    HOOKS.add(_name, dense_hooks.dense_factory(_name))
for _name in sparse_hooks.ALGORITHMS:
    HOOKS.add(_name, sparse_hooks.sparse_factory(_name))
HOOKS.add("powersgd", powersgd_hooks.make_powersgd)


def hook_options(name: str, **offered: Any) -> dict[str, Any]:
    """The subset of ``offered`` options that hook ``name`` accepts (for callers, such as the
    trainer, that hold one set of settings for every hook)."""
    accepted = list(inspect.signature(HOOKS.get(name)).parameters)[1:]  # after ddp_model
    return {k: v for k, v in offered.items() if k in accepted}


def register_hook(ddp_model: Any, name: str, *, wrap: Callable | None = None,
                  **options: Any) -> Any:
    """Attach the hook registered as ``name`` to a DDP model; return its state (for checkpoints).

    Must be called on every rank, with the same name and options, before the first backward
    (dense hooks build their process groups here). ``native`` registers nothing and leaves DDP's
    built-in all-reduce in place.

    Args:
        ddp_model: a ``torch.nn.parallel.DistributedDataParallel`` module.
        name: a name in :data:`HOOKS` (unknown names raise ValueError listing the known ones).
        wrap: optional ``wrap(hook) -> hook`` applied before registration (e.g. a timer).
        **options: the hook's options (unknown options raise ValueError listing the valid ones).

    Returns:
        The hook state: ``state_dict()`` / ``load_state_dict()`` work for every hook.
    """
    factory = HOOKS.get(name)
    params = list(inspect.signature(factory).parameters)[1:]  # after ddp_model
    unknown = sorted(set(options) - set(params))
    if unknown:
        raise ValueError(f"hook {name!r} got unknown option(s) {', '.join(unknown)}; "
                         f"valid: {', '.join(params) or '(none)'}")
    state, hook = factory(ddp_model, **options)
    if hook is not None:
        ddp_model.register_comm_hook(state, wrap(hook) if wrap else hook)
    return state


