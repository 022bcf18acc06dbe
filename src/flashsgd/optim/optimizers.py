"""The catalog of optimizers a recipe can name: one entry per optimizer, read by everything else.

Each entry names its class, says how to build it from a recipe (over
:func:`~flashsgd.optim.lars.param_groups`, at the schedule's first LR), which recipe fields it reads
(``reads``: of the fields some optimizer reads, :func:`optimizer_fields`, the others are not read by
this one), what the start-up line says of it, and whether it takes layer norms from a sparse exchange
(``layer_norms``: LARS's trust ratio from the dense gradient's norms, ``comm.layer_trust``).
:class:`~flashsgd.optim.recipes.Recipe` checks its ``optimizer`` against the names here,
:func:`~flashsgd.optim.plan.build_optimizer` and the plan's description read the entry, the train
config's ``optim.optimizer`` key offers the names (its help is :func:`describe_all`), the train
config warns about an override the run's optimizer does not read and about ``comm.layer_trust``
without an optimizer that takes layer norms (:func:`flashsgd.train.config.file.applies`), and the
rank wires the layer norms by the entry's flag. Adding an optimizer is its module and one entry below.

=========== ================================================================= ====================
``sgd``     ``torch.optim.SGD``: momentum, LR outside the buffer (Goyal et al. 2017)
``lars``    :class:`~flashsgd.optim.lars.LARS`: layer-wise trust ratio on momentum SGD (You et   layer norms
            al. 2017; batched norms, Yamazaki et al. 2019)
``lamb``    :class:`~flashsgd.optim.lamb.LAMB`: layer-wise trust ratio on Adam's direction (You
            et al. 2019), the recipe's ``momentum`` as beta1 and ``trust_coefficient`` as eta
=========== ================================================================= ====================

Example::

    >>> OPTIMIZERS.get("lamb").summary
    "LAMB (You et al. 2019): Adam's direction, a layer-wise trust ratio"
    >>> OPTIMIZERS.get("sgd").unread()
    ('trust_coefficient', 'lars_eps', 'lars_clip')
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable

import torch

from flashsgd.optim.lamb import LAMB
from flashsgd.optim.lars import LARS
from flashsgd.registry import Registry


@dataclass(frozen=True)
class Optimizer:
    """One optimizer: its class, how a recipe builds it, what it reads and what is said of it."""

    name: str
    summary: str
    cls: type
    """The ``torch.optim.Optimizer`` subclass :attr:`build` returns."""
    build: Callable[[list, Any, float], torch.optim.Optimizer]
    """``(param groups, recipe, first LR) -> optimizer``."""
    reads: tuple[str, ...]
    """The recipe fields :attr:`build` and :attr:`describe` read besides the ones every run reads
    (LR rule, schedule, weight-decay exclusions, loss, model tweaks)."""
    describe: Callable[[Any], str] = lambda recipe: ""
    """The recipe's hyper-parameters of this optimizer for the start-up line (empty: none beyond
    the common ones)."""
    layer_norms: bool = False
    """Takes ``grad_norm_source`` (a sparse exchange's dense layer norms, ``comm.layer_trust``)."""

    def unread(self) -> tuple[str, ...]:
        """The recipe fields some other optimizer reads and this one does not (in catalog order)."""
        return tuple(f for f in optimizer_fields() if f not in self.reads)


def _sgd(groups: list, r: Any, lr: float) -> torch.optim.Optimizer:
    return torch.optim.SGD(groups, lr=lr, momentum=r.momentum, nesterov=r.nesterov, weight_decay=r.weight_decay)


def _lars(groups: list, r: Any, lr: float) -> torch.optim.Optimizer:
    return LARS(groups, lr=lr, momentum=r.momentum, weight_decay=r.weight_decay,
                trust_coefficient=r.trust_coefficient, eps=r.lars_eps, nesterov=r.nesterov, clip=r.lars_clip)


def _lamb(groups: list, r: Any, lr: float) -> torch.optim.Optimizer:
    return LAMB(groups, lr=lr, betas=(r.momentum, 0.999), weight_decay=r.weight_decay,
                trust_coefficient=r.trust_coefficient)


OPTIMIZERS: Registry[Optimizer] = Registry("optimizer")
for _o in (
    Optimizer("sgd", "momentum SGD (torch.optim.SGD, LR outside the buffer)", torch.optim.SGD, _sgd,
              reads=("momentum", "nesterov", "weight_decay")),
    Optimizer("lars", "LARS (You et al. 2017): momentum SGD, a layer-wise trust ratio", LARS, _lars,
              reads=("momentum", "nesterov", "weight_decay", "trust_coefficient", "lars_eps", "lars_clip"),
              describe=lambda r: f" eta={r.trust_coefficient:g} clip={r.lars_clip}", layer_norms=True),
    Optimizer("lamb", "LAMB (You et al. 2019): Adam's direction, a layer-wise trust ratio", LAMB, _lamb,
              reads=("momentum", "weight_decay", "trust_coefficient"),
              describe=lambda r: f" eta={r.trust_coefficient:g} betas=({r.momentum:g}, 0.999)"),
):
    OPTIMIZERS.add(_o.name, _o)
del _o


def optimizer_fields() -> tuple[str, ...]:
    """The recipe fields some optimizer reads (each read by the optimizers whose ``reads`` name it)."""
    return tuple(dict.fromkeys(f for o in OPTIMIZERS.values() for f in o.reads))


def layer_norm_optimizers() -> list[str]:
    """The optimizers that take a sparse exchange's layer norms (``comm.layer_trust``)."""
    return [name for name, o in OPTIMIZERS.items() if o.layer_norms]


def describe_all() -> str:
    """One clause per optimizer (``name: summary``): the help of every ``--optimizer`` flag."""
    return "; ".join(f"{name}: {o.summary}" for name, o in OPTIMIZERS.items())
