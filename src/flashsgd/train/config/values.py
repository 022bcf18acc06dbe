"""Checking one config value against its type hint: the parsing half of :mod:`flashsgd.train.config`.

A value comes from TOML (typed) or the command line (a string). :func:`coerce` converts it to the
field's type or raises a ValueError naming the key and what is valid: ``Literal`` choices or a
registry's names (a field made with :func:`flashsgd.train.config.choice`), integers (any integral
number, numpy's too), finite floats, booleans (true/false/1/0/yes/no), strings, ``Optional``.

Example::

    >>> coerce("optim.epochs", "7.5", float)
    7.5
    >>> coerce("run.timeout_s", "nan", float)
    Traceback (most recent call last):
    ValueError: config key 'run.timeout_s': expected a finite number, got 'nan'
"""

from __future__ import annotations

import dataclasses
import math
import numbers
import typing
from typing import Any, Callable, Literal


def choices_of(f: dataclasses.Field, hint: Any) -> list[str] | None:
    """The valid values of a field: its registry's names (``choice``) or its ``Literal`` args."""
    if "choices" in f.metadata:
        return list(f.metadata["choices"]())
    if typing.get_origin(hint) is Literal:
        return [str(a) for a in typing.get_args(hint)]
    return None


def coerce(key: str, value: Any, hint: Any, choices: Callable[[], list[str]] | None = None) -> Any:
    """Check/convert ``value`` (from TOML or a CLI string) to the type ``hint``; ValueError names key.

    ``choices`` (a registry's names) restricts a ``str`` field; numbers must be finite.
    """
    origin, args = typing.get_origin(hint), typing.get_args(hint)
    if origin is typing.Union:  # Optional[X]
        inner = [a for a in args if a is not type(None)][0]
        if value is None or (isinstance(value, str) and value.lower() in ("none", "")):
            return None
        return coerce(key, value, inner, choices)
    if choices is not None:
        valid = choices()
        if value not in valid:
            raise ValueError(f"config key {key!r}: invalid value {value!r}; valid choices: "
                             f"{', '.join(valid)}")
        return value
    if origin is Literal:
        if value not in args:
            raise ValueError(f"config key {key!r}: invalid value {value!r}; valid choices: "
                             f"{', '.join(map(str, args))}")
        return value
    if hint is bool:
        if isinstance(value, bool):
            return value
        if isinstance(value, str) and value.lower() in ("true", "1", "yes", "false", "0", "no"):
            return value.lower() in ("true", "1", "yes")
        raise ValueError(f"config key {key!r}: expected true or false, got {value!r}")
    if hint in (int, float):
        return _number(key, value, hint)
    if hint is str:
        if not isinstance(value, str):
            raise ValueError(f"config key {key!r}: expected a string, got {value!r}")
        return value
    raise TypeError(f"unsupported config type {hint!r} for {key!r}")  # pragma: no cover


def _number(key: str, value: Any, hint: type) -> int | float:
    """An int (any integral number, e.g. numpy's) or a finite float; strings are parsed."""
    if isinstance(value, bool):
        raise ValueError(f"config key {key!r}: expected {hint.__name__}, got {value!r}")
    try:
        out = hint(value) if isinstance(value, str) else value
    except ValueError:
        raise ValueError(f"config key {key!r}: expected {hint.__name__}, got {value!r}") from None
    if hint is int:
        if not isinstance(out, numbers.Integral):
            raise ValueError(f"config key {key!r}: expected an integer, got {value!r}")
        return int(out)
    if not isinstance(out, numbers.Real):
        raise ValueError(f"config key {key!r}: expected {hint.__name__}, got {value!r}")
    if not math.isfinite(out):
        raise ValueError(f"config key {key!r}: expected a finite number, got {value!r}")
    return float(out)
