"""The DDP communication hooks by name: ``HOOKS``, :func:`register_hook` and :func:`hook_options`.

Use::

    state = register_hook(ddp_model, "torus2d", grid="2x4")     # on every rank, after DDP(...)
    ...train...
    ckpt["hook"] = state.state_dict(); state.load_state_dict(ckpt["hook"])

Each entry of ``HOOKS`` is a factory ``make(ddp_model, options) -> (state, hook | None)``, one per
exchange of the catalog (:data:`flashsgd.exchanges.EXCHANGES`, in its order), whose typed options
class holds every option and default; :func:`register_hook` builds and validates the options and
calls ``ddp_model.register_comm_hook(state, hook)`` unless the hook is None. This module fills the
registry from the hook modules (one-way imports: they never import this one):

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

from typing import Any, Callable

from flashsgd.comm import dense_hooks, powersgd_hooks, sparse_hooks
from flashsgd.comm.hook_common import HookFactory
from flashsgd.exchanges import EXCHANGES
from flashsgd.registry import Registry

_FACTORIES = {"native": dense_hooks.make_native, "noop": dense_hooks.make_noop,
              **{name: dense_hooks.dense_factory(name) for name in dense_hooks.DENSE_HOOKS},
              **{name: sparse_hooks.sparse_factory(name) for name in sparse_hooks.ALGORITHMS},
              "powersgd": powersgd_hooks.make_powersgd}

HOOKS: Registry[HookFactory] = Registry("DDP communication hook")
for _name in EXCHANGES:  # every exchange of the catalog has a hook, in catalog order
    HOOKS.add(_name, _FACTORIES.pop(_name))
assert not _FACTORIES, f"hooks without a catalog entry: {sorted(_FACTORIES)}"
del _name


def hook_options(name: str, **offered: Any) -> Any:
    """The options object of hook ``name`` from the subset of ``offered`` it accepts (for callers,
    such as the trainer, that hold one set of settings for every hook)."""
    return EXCHANGES[name].options_from(**offered)


def register_hook(ddp_model: Any, name: str, options: Any = None, *, wrap: Callable | None = None,
                  **kwargs: Any) -> Any:
    """Attach the hook registered as ``name`` to a DDP model; return its state (for checkpoints).

    Must be called on every rank, with the same name and options, before the first backward
    (dense hooks build their process groups here). ``native`` registers nothing and leaves DDP's
    built-in all-reduce in place.

    Args:
        ddp_model: a ``torch.nn.parallel.DistributedDataParallel`` module.
        name: a name in :data:`HOOKS` (unknown names raise ValueError listing the known ones).
        options: the hook's options object (:attr:`flashsgd.exchanges.Exchange.options`), or None
            to build it from ``kwargs``.
        wrap: optional ``wrap(hook) -> hook`` applied before registration (e.g. a timer).
        **kwargs: the hook's options by name (unknown options raise ValueError listing the valid
            ones; bad values raise ValueError naming the option).

    Returns:
        The hook state: ``state_dict()`` / ``load_state_dict()`` work for every hook.
    """
    factory, exchange = HOOKS.get(name), EXCHANGES[name]
    if options is None:
        options = exchange.make_options(**kwargs)
    elif kwargs or not isinstance(options, exchange.options):
        raise ValueError(f"hook {name!r}: pass either an {exchange.options.__name__} or options by "
                         f"name, got {type(options).__name__} and {sorted(kwargs)}")
    state, hook = factory(ddp_model, options)
    if hook is not None:
        ddp_model.register_comm_hook(state, wrap(hook) if wrap else hook)
    return state
