"""Command-line flags of exchange options, read from the catalog (:mod:`flashsgd.exchanges`).

Every subcommand that takes an exchange option (``--density``, ``--selection``, ``--node-split``,
``--matrix-approximation-rank`` ...) declares it with :func:`add_option_flag`: the flag's spelling
(dashes for underscores), type, choices, default and help are the options class's, so a default
or a spelling cannot drift between ``train``, ``bench`` and ``simulate``. The exchange itself is
``--comm`` everywhere (:func:`add_comm_flag`). ``flashsgd train`` reads the same catalog through its
config: every option is a ``[comm]`` key there, and every key a flag (:mod:`flashsgd.train.config`).

Example::

    >>> import argparse
    >>> p = argparse.ArgumentParser()
    >>> add_option_flag(p, "density")
    >>> p.parse_args([]).density
    0.001
"""

from __future__ import annotations

import argparse
import typing
from typing import Any

from flashsgd.exchanges import EXCHANGES, option_choices, option_default, option_doc, option_hint

__all__ = ["add_option_flag", "add_comm_flag", "comm_list", "option_doc"]


def _type(name: str) -> Any:
    """The value type of option ``name`` (``Optional[int]`` -> ``int``)."""
    hint = option_hint(name)
    args = [a for a in typing.get_args(hint) if a is not type(None)]
    return args[0] if args else hint


def add_option_flag(parser: Any, name: str, **override: Any) -> None:
    """``--name-with-dashes`` for exchange option ``name``: its type, choices, default and help from
    the catalog (``override`` replaces any of them, e.g. ``help=`` for a bench's wording)."""
    kind = _type(name)
    kwargs: dict[str, Any] = {"default": option_default(name), "help": option_doc(name)}
    if kind is bool:
        kwargs["action"] = argparse.BooleanOptionalAction
    else:
        kwargs["type"] = kind
        if option_choices(name):
            kwargs["choices"] = option_choices(name)
    kwargs.update(override)
    kwargs["help"] = f"{kwargs['help']} (default: %(default)s)"
    parser.add_argument("--" + name.replace("_", "-"), **kwargs)


def add_comm_flag(parser: Any, default: str | None, what: str = "exchanges to compare",
                  known: list[str] | tuple[str, ...] | None = None) -> None:
    """``--comm NAME[,NAME...]``: the exchange(s), names of :data:`flashsgd.exchanges.EXCHANGES`
    (or of ``known``, the subset a command runs; check the value with :func:`comm_list`)."""
    parser.add_argument("--comm", default=default, metavar="NAME[,NAME...]",
                        help=f"{what}, comma-separated (default: {default or 'all'}); "
                             f"known: {', '.join(EXCHANGES if known is None else known)}")


def comm_list(value: str | None, known: list[str], flag: str = "--comm") -> list[str]:
    """Split a ``--comm a,b`` value; every name must be in ``known`` (once); None: all of ``known``."""
    if value is None:
        return list(known)
    names = [n.strip() for n in value.split(",") if n.strip()]
    unknown = [n for n in names if n not in known]
    if not names or unknown:
        raise ValueError(f"{flag} {value!r}: unknown {', '.join(unknown) or '(empty)'}; known: {', '.join(known)}")
    if len(set(names)) != len(names):
        raise ValueError(f"{flag} {value!r} lists a name twice")
    return names
