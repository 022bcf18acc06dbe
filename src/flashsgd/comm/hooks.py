"""The DDP communication hooks by name: ``HOOKS``, :func:`register_hook` and :func:`hook_options`.

Use::

    state = register_hook(ddp_model, "torus2d", grid="2x4")     # on every rank, after DDP(...)
    ...train...
    torch.save({..., "hook": state.state_dict()}, f"ckpt/rank{rank}.pt")  # per rank (residuals)
    ...restart: state.load_state_dict(this rank's ["hook"]); rebuild_buckets(ddp_model, loss)

:func:`rebuild_buckets` makes a resumed run exact (DDP's rebuilt buckets before the first step).

Each entry of ``HOOKS`` is a factory ``make(ddp_model, options) -> (state, hook | None)``, one per
exchange of the catalog (:data:`flashsgd.exchanges.EXCHANGES`, in its order), whose typed options
class holds every option and default; :func:`register_hook` builds and validates the options and
calls ``ddp_model.register_comm_hook(state, hook)`` unless the hook is None. This module fills the
registry from the hook modules (one-way imports: they never import this one):

- :mod:`flashsgd.comm.dense_hooks`: ``native``, ``noop``, ``ring``, ``hierarchical``, ``torus2d``
  (all-reduce algorithms of :mod:`flashsgd.comm.dense`; threading, overlap and bucket sizes are
  discussed there);
- :mod:`flashsgd.comm.sparse.hooks`: ``topk``, ``gtopk`` (sparsified exchange with error
  feedback, Shi et al. 2019, arXiv 1901.04359);
- :mod:`flashsgd.comm.powersgd_hooks`: ``powersgd`` (PowerSGD, Vogels et al. 2019, arXiv
  1905.13727: torch's hook's arithmetic, batched per matrix shape, :mod:`flashsgd.comm.lowrank`;
  with a checkpointable state).

Example::

    >>> model = DDP(net, bucket_cap_mb=4)
    >>> state = register_hook(model, "hierarchical", ranks_per_node=4)
    >>> loss_fn(model(x), y).backward()      # gradients averaged by the hierarchical all-reduce
"""

from __future__ import annotations

import sys
import warnings
import weakref
from typing import Any, Callable

import torch
from torch.nn.parallel import DistributedDataParallel

from flashsgd.comm import dense_hooks, powersgd_hooks
from flashsgd.comm.sparse import hooks as sparse_hooks
from flashsgd.comm.hook_common import HookFactory, completed_future, ddp_hook, rank_and_world
from flashsgd.exchanges import EXCHANGES
from flashsgd.registry import Registry

_FACTORIES = {"native": dense_hooks.make_native, "noop": dense_hooks.make_noop,
              **{name: dense_hooks.dense_factory(name) for name in dense_hooks.DENSE_HOOKS},
              **{name: sparse_hooks.sparse_factory(name) for name in sparse_hooks.SPARSE_EXCHANGES},
              "powersgd": powersgd_hooks.make_powersgd}

HOOKS: Registry[HookFactory] = Registry("DDP communication hook")
for _name in EXCHANGES:  # every exchange of the catalog has a hook, in catalog order
    HOOKS.add(_name, _FACTORIES.pop(_name))
assert not _FACTORIES, f"hooks without a catalog entry: {sorted(_FACTORIES)}"
del _name


def hook_options(name: str, **offered: Any) -> Any:
    """The options object of hook ``name`` from the subset of ``offered`` it accepts (for callers,
    such as the trainer, that hold one set of settings for every hook).

    ValueError for a density warm-up without its length (``density_warmup`` set,
    ``density_warmup_steps`` 0 or absent): that warm-up would never happen (the density of the
    first step would be ``density``), and on MNIST-1D gTop-k at density 0.001 without it lost 12.9
    points (docs/sparse_accuracy.md). A planner choice (``flashsgd plan --json``) carries only the
    warm-up's start: :func:`flashsgd.integrations.plan.comm_from_plan` turns it into steps.

    Example::

        >>> hook_options("gtopk", density=0.01, density_warmup=0.25, density_warmup_steps=100, grid="2x2").density
        0.01
    """
    options = EXCHANGES[name].options_from(**offered)
    _check_density_warmup(name, options)
    return options


def _check_density_warmup(name: str, options: Any) -> None:
    """ValueError when ``options`` has a density warm-up start but no length (a silent no-op)."""
    start = getattr(options, "density_warmup", None)
    if start is not None and getattr(options, "density_warmup_steps", 0) < 1:
        raise ValueError(
            f"hook {name!r}: density_warmup={start:g} needs density_warmup_steps >= 1 (its length in "
            f"optimizer steps), got {options.density_warmup_steps}: without it there is no warm-up at all "
            f"(density {options.density:g} from the first step). Give density_warmup_steps=N (DGC's "
            f"default: min(4 epochs, half the run), flashsgd.exchanges.DensityWarmup().steps(total_steps, "
            f"steps_per_epoch); a plan's choice: flashsgd.integrations.plan.comm_from_plan(choice, "
            f"total_steps=..., steps_per_epoch=...)), or density_warmup=None for no warm-up")


def _check_run_length(name: str, options: Any, total_steps: int) -> None:
    """The trainer's coverage check (:func:`flashsgd.comm.sparse.checks.check_sparse_run`) for a
    run of ``total_steps``: ValueError for a warm-up longer than the run; the step-count bound's
    warning on rank 0 (a :class:`UserWarning`, as ``flashsgd train`` prints it in its plan)."""
    from flashsgd.comm.sparse.checks import check_sparse_run

    if isinstance(total_steps, bool) or not isinstance(total_steps, int) or total_steps < 1:
        raise ValueError(f"register_hook: total_steps must be the run's number of optimizer steps, an "
                         f"integer >= 1 (or None: not checked), got {total_steps!r}")
    try:
        lines = check_sparse_run(name, options, total_steps)
    except ValueError as exc:
        raise ValueError(f"hook {name!r} over total_steps={total_steps}: {exc}".replace(
            "shorten comm.density_warmup_epochs", "shorten density_warmup_steps")) from None
    here = rank_and_world()
    if here is None or here[0] == 0:
        for line in lines:
            warnings.warn(line, UserWarning, stacklevel=3)


def _not_ddp_remedy(model: Any) -> str:
    """How to get a DDP model from what was passed: the trainer's own way where one is recognised
    (Lightning and Accelerate wrap the model themselves), else ``DDP(model)``."""
    names = {(c.__module__.split(".")[0], c.__name__) for c in type(model).__mro__}
    if {("lightning", "LightningModule"), ("pytorch_lightning", "LightningModule")} & names:
        return ("this is a LightningModule: Lightning wraps it in DDP inside Trainer.fit, so register the "
                "hook there with the callback flashsgd.integrations.lightning.FlashsgdHook(NAME, **options) "
                "in Trainer(strategy='ddp', callbacks=[...]), or pass trainer.strategy.model (the DDP model, once "
                "fit has started) (docs/integrations.md)")
    if {("transformers", "PreTrainedModel")} & names:
        return ("a transformers model: a Hugging Face Trainer wraps it in DDP inside train(), so use the callback "
                "flashsgd.integrations.transformers.FlashsgdCallback(NAME, **options).attach(trainer), "
                "or pass trainer.model_wrapped (the DDP model, once train() has started); in an Accelerate "
                "loop, pass the model accelerator.prepare(model) returned (docs/integrations.md)")
    state = sys.modules.get("accelerate.state")
    if state is not None and getattr(state.PartialState, "_shared_state", None):
        world = getattr(state.PartialState(), "num_processes", 1)
        attach = ("flashsgd.integrations.accelerate.attach_hook(accelerator, model, NAME, ...) after "
                  "accelerator.prepare (docs/integrations.md)")
        if world > 1:
            return f"Accelerate runs {world} processes: pass the model accelerator.prepare(model) returned, with {attach}"
        return (f"Accelerate runs one process, and accelerator.prepare(model) returns a DDP model only in a "
                f"distributed launch: launch with `accelerate launch --num_processes N` or torchrun "
                f"(ACCELERATE_USE_CPU=1 on CPUs), then call {attach}")
    return "wrap it: DDP(model)"


_STATES: "weakref.WeakKeyDictionary[Any, Any]" = weakref.WeakKeyDictionary()  # DDP model -> its hook state


def hook_state_of(ddp_model: Any) -> Any:
    """The state :func:`register_hook` returned for ``ddp_model`` (None: no flashsgd hook on it)."""
    try:
        return _STATES.get(ddp_model)
    except TypeError:  # not weak-referenceable: never registered
        return None


def _check_scaler(name: str, scaler: Any) -> None:
    """TypeError unless ``scaler`` is None or a loss scaler (``torch.amp.GradScaler`` or anything
    with its ``scale(tensor)`` and ``update()``: Lightning's and Accelerate's are torch's)."""
    if scaler is not None and not (callable(getattr(scaler, "scale", None)) and callable(getattr(scaler, "update", None))):
        raise TypeError(f"register_hook({name!r}, scaler=...): a loss scaler is a torch.amp.GradScaler (the one "
                        f"whose scaler.scale(loss).backward() this loop calls), got {type(scaler).__name__}; "
                        f"pass scaler=None without fp16 loss scaling")


def register_hook(ddp_model: Any, name: str, options: Any = None, *, wrap: Callable | None = None,
                  total_steps: int | None = None, scaler: Any = None, **kwargs: Any) -> Any:
    """Attach the hook registered as ``name`` to a DDP model; return its state (for checkpoints).

    Must be called on every rank, with the same name and options, before the first backward
    (dense hooks build their process groups here). ``native`` registers nothing and leaves DDP's
    built-in all-reduce in place.

    Args:
        ddp_model: a ``torch.nn.parallel.DistributedDataParallel`` module (anything else is a
            TypeError saying to wrap it, after the name and options are checked).
        name: a name in :data:`HOOKS` (unknown names raise ValueError listing the known ones).
        options: the hook's options object (:attr:`flashsgd.exchanges.Exchange.options`), or None
            to build it from ``kwargs``.
        wrap: optional ``wrap(hook) -> hook`` applied before registration (e.g. a timer).
        total_steps: the run's number of optimizer steps, or None. Given, the trainer's check
            runs (:func:`flashsgd.comm.sparse.checks.check_sparse_run`): a density warm-up longer
            than the run is a ValueError, and a sparse hook whose step-count bound is below
            :data:`~flashsgd.exchanges.MIN_COVERAGE` warns on rank 0 (UserWarning), as
            ``flashsgd train`` does.
        scaler: the loop's ``torch.amp.GradScaler`` under fp16 (None: none). A hook with memory
            across steps (``topk``, ``gtopk``, ``hgtopk``, ``powersgd``) then keeps them in true
            gradient units, and a step the scaler skips leaves them as they were, GradScaler
            seeing the overflow on every rank as with DDP's own all-reduce
            (:mod:`flashsgd.comm.hook_step`). Hooks without memory need none (accepted).
        **kwargs: the hook's options by name (unknown options raise ValueError listing the valid
            ones; bad values raise ValueError naming the option; ``density_warmup`` without
            ``density_warmup_steps`` raises ValueError: :func:`hook_options`).

    Returns:
        The hook state: ``state_dict()`` / ``load_state_dict()`` work for every hook.
    """
    factory, exchange = HOOKS.get(name), EXCHANGES[name]
    if options is None:
        options = exchange.make_options(**kwargs)
    elif kwargs or not isinstance(options, exchange.options):
        raise ValueError(f"hook {name!r}: pass either an {exchange.options.__name__} or options by "
                         f"name, got {type(options).__name__} and {sorted(kwargs)}")
    _check_density_warmup(name, options)
    _check_scaler(name, scaler)
    if total_steps is not None:
        _check_run_length(name, options, total_steps)
    if not isinstance(ddp_model, DistributedDataParallel):
        raise TypeError(f"register_hook needs a torch.nn.parallel.DistributedDataParallel model, got "
                        f"{type(ddp_model).__module__}.{type(ddp_model).__qualname__}; "
                        f"{_not_ddp_remedy(ddp_model)}")
    state, hook = factory(ddp_model, options)
    state.use_scaler(scaler)
    if hook is not None:
        ddp_model.register_comm_hook(state, _gated(ddp_model, wrap(hook) if wrap else hook))
    _STATES[ddp_model] = state
    return state


_REBUILDING: set[int] = set()  # id() of the DDP models inside rebuild_buckets' warm-up backward


def _gated(ddp_model: Any, hook: Callable) -> Callable:
    """``hook``, except inside :func:`rebuild_buckets`: then the bucket is returned untouched
    (no exchange, the hook state unchanged)."""
    key = id(ddp_model)

    @ddp_hook(host_staged=False)  # ``hook`` stages a CUDA bucket on Gloo itself (or not: powersgd)
    def gated(state, bucket):
        if key in _REBUILDING:
            return completed_future(bucket.buffer())
        return hook(state, bucket)
    return gated


def rebuild_buckets(ddp_model: Any, loss: Callable[[], torch.Tensor]) -> bool:
    """Give DDP its final buckets now, with one forward/backward that changes nothing.

    DDP puts every parameter in one bucket for its first iteration and rebuilds the buckets in
    the order the gradients became ready (``bucket_cap_mb`` each) before the second: a run
    restarted from a checkpoint would exchange its first step in the first-iteration layout,
    where the uninterrupted run used the rebuilt one (another summation order with more than two
    ranks per reduction; other Top-k selections and misplaced residuals for the sparse hooks).
    Call this on every rank after restoring a checkpoint, before the first step: then every
    step after a resume sees the buckets the uninterrupted run saw, and the resume is exact.

    1. ``loss()`` (a forward through ``ddp_model``) and its backward; hooks registered with
       :func:`register_hook` exchange nothing (``native``: DDP's own all-reduce runs on every
       rank, its result is discarded). DDP records the order in which gradients became ready.
    2. Restore what the warm-up touched: buffers (BN statistics), torch's RNG states, gradients
       (back to None); the hook state was never called.
    3. DDP rebuilds its buckets (a broadcast of rank 0's order: collective).

    Returns True when the buckets were rebuilt (False: DDP had already rebuilt them).

    Example::

        >>> state = register_hook(ddp, "gtopk", density=0.01)
        >>> state.load_state_dict(torch.load(f"ckpt/rank{rank}.pt")["hook"])   # this rank's file
        >>> rebuild_buckets(ddp, lambda: loss_fn(ddp(x0), y0))                  # any batch
    """
    if getattr(ddp_model, "_has_rebuilt_buckets", False):
        return False
    module = getattr(ddp_model, "module", ddp_model)
    params = list(ddp_model.parameters())
    # Step 2's saved copies: buffers, RNG streams, gradients
    buffers = [(b, b.detach().clone()) for b in module.buffers()]
    grads = [p.grad for p in params]
    devices = sorted({p.device.index for p in params if p.device.type == "cuda"})
    with torch.random.fork_rng(devices=devices), torch.enable_grad():       # Step 1
        _REBUILDING.add(id(ddp_model))
        try:
            loss().backward()
        finally:
            _REBUILDING.discard(id(ddp_model))
    with torch.no_grad():                                                       # Step 2
        for b, saved in buffers:
            b.copy_(saved)
    for p, g in zip(params, grads):
        p.grad = g
    rebuilt = bool(ddp_model.reducer._rebuild_buckets())                       # Step 3
    ddp_model._has_rebuilt_buckets = ddp_model._has_rebuilt_buckets or rebuilt
    return rebuilt
