"""The run directory's ``config.toml``: the resolved config, with only the keys that apply to the run.

A key applies when the run reads it (:func:`applies`):

* ``[data]``: the keys each dataset reads (its entry in :data:`flashsgd.train.data.catalog.DATASETS`);
* ``[model]``: ``channels`` only for a model whose builder takes it (``mnist1d_cnn``);
* ``[optim]``: an override of a recipe field some optimizer reads (``momentum``, ``nesterov``,
  ``weight_decay``, ``trust_coefficient``) only when the run's optimizer reads it (its entry in
  :data:`flashsgd.optim.optimizers.OPTIMIZERS`, ``reads``), or when the hook takes the momentum
  (``comm.momentum_correction``: ``momentum`` and ``nesterov``);
* ``[comm]``: ``algorithm``, ``ranks_per_node`` and ``bucket_mb`` always; under ``auto`` every key
  (the planner may choose any exchange); otherwise a key applies when the exchange's options
  class (:mod:`flashsgd.exchanges`) has the option it sets (``density_warmup_epochs`` sets
  ``density_warmup_steps``), so ``torus2d`` reads no sparse key and ``gtopk`` no ``grid``;
  ``layer_trust`` only when the run's optimizer takes layer norms (``lars``): the hook is then not
  asked for them (one all-reduce per bucket saved);
* ``[run]``: ``channels_last`` only for 4-D image inputs (the dataset entry's ``images``);
  every other key applies.

:func:`dumps_run_config` leaves out a key that does not apply and holds its default; one that does
not apply but was set is kept under a comment saying so (and the plan warns: :func:`set_but_unread`).
So the file still loads back to the same config (``resolve(toml_text=dumps_run_config(cfg)) == cfg``), which is what a resume compares
(:func:`flashsgd.train.records.rundir.config_changes`, which also ignores keys that apply to neither run).

Example::

    >>> from flashsgd.train.config import resolve
    >>> cfg = resolve(cli={"algorithm": "torus2d"})
    >>> applies(cfg, "data", "image_shape"), applies(cfg, "comm", "density"), applies(cfg, "comm", "grid")
    (False, False, True)
    >>> resolve(toml_text=dumps_run_config(cfg)) == cfg
    True
"""

from __future__ import annotations

import dataclasses
import inspect

from flashsgd.exchanges import EXCHANGES
from flashsgd.optim.optimizers import OPTIMIZERS, layer_norm_optimizers, optimizer_fields
from flashsgd.train.config import SECTIONS, TrainConfig, recipe_value, to_dict
from flashsgd.train.data.catalog import DATASETS, dataset_keys

COMM_ALWAYS = ("algorithm", "ranks_per_node", "bucket_mb")
"""``[comm]`` keys every exchange's run reads (the hook, the topology, DDP's bucket cap)."""
COMM_OPTION = {"density_warmup_epochs": "density_warmup_steps"}
"""``[comm]`` keys whose option in :mod:`flashsgd.exchanges` has another name."""


def _model_takes_channels(name: str) -> bool:
    from flashsgd.train.models import MODELS  # noqa: PLC0415 - torch, only when asked

    if name not in MODELS:  # torchvision:NAME
        return False
    return "channels" in inspect.signature(MODELS.get(name)).parameters


def applies(cfg: TrainConfig, section: str, key: str) -> bool:
    """Whether the run of ``cfg`` reads ``section.key`` (module docstring)."""
    return unread_by(cfg, section, key) is None


def unread_by(cfg: TrainConfig, section: str, key: str) -> str | None:
    """What of the run of ``cfg`` does not read ``section.key`` (``"exchange ring"``), naming what
    would; None when the run reads it (:func:`applies`)."""
    if section == "data" and key in dataset_keys():
        return None if key in DATASETS.get(cfg.data.dataset).reads else f"dataset {cfg.data.dataset}"
    if section == "model" and key == "channels":
        return None if _model_takes_channels(cfg.model.model) else f"model {cfg.model.model}"
    if section == "run" and key == "channels_last":
        return None if DATASETS.get(cfg.data.dataset).images else f"dataset {cfg.data.dataset}"
    if section == "optim" and key in optimizer_fields():
        if key in ("momentum", "nesterov") and _hook_takes_momentum(cfg):
            return None  # the hook applies them (momentum correction)
        name = recipe_value(cfg, "optimizer")
        if key in OPTIMIZERS.get(name).reads:
            return None
        return f"optimizer {name} (read by {', '.join(n for n, o in OPTIMIZERS.items() if key in o.reads)})"
    if section == "comm" and key == "layer_trust":
        name = recipe_value(cfg, "optimizer")
        if not OPTIMIZERS.get(name).layer_norms:
            return (f"optimizer {name}, which takes no layer norms (those that do: "
                    f"{', '.join(layer_norm_optimizers())}; no norms are exchanged)")
    if section == "comm" and key not in COMM_ALWAYS and cfg.comm.algorithm != "auto":
        if not EXCHANGES[cfg.comm.algorithm].reads(COMM_OPTION.get(key, key)):
            return f"exchange {cfg.comm.algorithm}"
    return None


def _hook_takes_momentum(cfg: TrainConfig) -> bool:
    """The run's hook applies the momentum (``comm.momentum_correction`` on an exchange with it)."""
    c = cfg.comm
    return bool(c.momentum_correction) and (c.algorithm == "auto" or EXCHANGES[c.algorithm].reads("momentum_correction"))


def dumps_run_config(cfg: TrainConfig) -> str:
    """``config.toml`` text of ``cfg``: the keys that apply; one that does not is left out at its
    default, and kept under a comment when it was set (so the file loads back to ``cfg``)."""
    import tomli_w  # noqa: PLC0415

    ignored = set_but_unread(cfg)
    lines = ["# flashsgd train: resolved configuration (unset optional keys take the recipe's value;",
             "# keys this run does not read are left out at their defaults)"]
    for section, values in to_dict(cfg).items():
        used = {k: v for k, v in values.items() if applies(cfg, section, k)}
        unused: dict[str, dict] = {}  # by what does not read them
        for k, v in values.items():
            if f"{section}.{k}" in ignored:
                unused.setdefault(ignored[f"{section}.{k}"], {})[k] = v
        lines += ["", f"[{section}]"]
        lines += tomli_w.dumps(used).splitlines()
        for why, keys in unused.items():
            lines.append(f"# set, but not read by {why}:")
            lines += tomli_w.dumps(keys).splitlines()
    return "\n".join(lines) + "\n"


def set_but_unread(cfg: TrainConfig) -> dict[str, str]:
    """``{section.key: "what does not read it"}`` for every key set away from its default that the
    run of ``cfg`` does not read (``--comm ring --grid 4x1``: the grid is torus2d's): the plan warns
    about each, and config.toml keeps them under a comment."""
    defaults = to_dict(TrainConfig())
    unread = {f"{section}.{k}": unread_by(cfg, section, k) for section, values in to_dict(cfg).items()
              for k, v in values.items() if k not in defaults[section] or defaults[section][k] != v}
    return {key: why for key, why in unread.items() if why is not None}


def unread_keys(cfg: TrainConfig) -> list[str]:
    """``section.key`` of every key the run of ``cfg`` does not read."""
    return [f"{s}.{f.name}" for s in SECTIONS for f in dataclasses.fields(getattr(cfg, s))
            if not applies(cfg, s, f.name)]


def reads(cfg: TrainConfig, flat_key: str) -> bool:
    """:func:`applies` of a ``section.key`` name."""
    section, key = flat_key.split(".", 1)
    return applies(cfg, section, key)
