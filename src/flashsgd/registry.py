"""Name -> object registries: read-only mappings that refuse duplicates and explain unknown names.

flashsgd prefers registries to class hierarchies: an all-reduce algorithm, a DDP hook, a recipe or
a cluster preset is a function or a small value registered under a name that the CLI, the config
and the simulator all share. A :class:`Registry` is a ``collections.abc.Mapping`` (``reg[name]``,
``name in reg``, ``list(reg)``, ``reg.items()``); only :meth:`Registry.add` writes to it.

Example::

    >>> ALGOS = Registry("all-reduce algorithm")
    >>> @ALGOS.register("ring")
    ... def ring(tensor, topology, op="sum"): ...
    >>> ALGOS["rign"]
    Traceback (most recent call last):
    flashsgd.registry.UnknownNameError: unknown all-reduce algorithm 'rign'; known: ring
    >>> ALGOS.get("rign", None) is None, "ring" in ALGOS, list(ALGOS)
    (True, True, ['ring'])
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any, Callable, Generic, Iterator, TypeVar

T = TypeVar("T")

_NO_DEFAULT: Any = object()


class UnknownNameError(KeyError, ValueError):
    """An unknown registry name; the message lists the known names.

    A ``KeyError`` so that the registry behaves as a mapping (``in``, ``get(name, default)``), and
    a ``ValueError`` so that callers that report bad input values catch it as one.
    """

    def __str__(self) -> str:  # KeyError's str() would quote the whole message
        return str(self.args[0])


class Registry(Mapping[str, T], Generic[T]):
    """A read-only mapping from names to objects; :meth:`add` refuses duplicate names."""

    __slots__ = ("kind", "_items")

    def __init__(self, kind: str) -> None:
        self.kind = kind
        self._items: dict[str, T] = {}

    def add(self, name: str, obj: T) -> T:
        """Register ``obj`` under ``name`` (a new, non-empty string); returns ``obj``."""
        if not isinstance(name, str) or not name:
            raise ValueError(f"{self.kind} name must be a non-empty string, got {name!r}")
        if name in self._items:
            raise ValueError(f"{self.kind} {name!r} is already registered")
        self._items[name] = obj
        return obj

    def register(self, name: str) -> Callable[[T], T]:
        """Decorator form of :meth:`add`."""

        def decorator(obj: T) -> T:
            return self.add(name, obj)

        return decorator

    def __getitem__(self, name: str) -> T:
        try:
            return self._items[name]
        except (KeyError, TypeError):
            raise UnknownNameError(
                f"unknown {self.kind} {name!r}; known: {', '.join(self._items) or '(none)'}"
            ) from None

    def get(self, name: str, default: Any = _NO_DEFAULT) -> Any:
        """``self[name]``; with ``default`` given, the mapping's ``get`` (``default`` if unknown).

        Without a default an unknown name raises :class:`UnknownNameError` (listing the known
        names) instead of returning None, so that a misspelt name can never pass silently.
        """
        if default is _NO_DEFAULT:
            return self[name]
        return self._items.get(name, default)

    def names(self) -> list[str]:
        """The registered names, in registration order."""
        return list(self._items)

    def __contains__(self, name: object) -> bool:
        try:
            return name in self._items
        except TypeError:  # unhashable: not a name
            return False

    def __iter__(self) -> Iterator[str]:
        return iter(self._items)

    def __len__(self) -> int:
        return len(self._items)

    def __repr__(self) -> str:
        return f"Registry({self.kind!r}, {self.names()})"
