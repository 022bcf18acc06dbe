"""Name -> object registries: plain dicts that refuse duplicates and explain unknown names.

flashsgd prefers registries to class hierarchies (DESIGN.md "Style"): an all-reduce algorithm, a
DDP hook, a recipe or a cluster preset is a function or a small value registered under a name that
the CLI, the config and the simulator all share.

Example::

    >>> ALGOS = Registry("all-reduce algorithm")
    >>> @ALGOS.register("ring")
    ... def ring(tensor, topology, op="sum"): ...
    >>> ALGOS.get("rign")
    Traceback (most recent call last):
    ValueError: unknown all-reduce algorithm 'rign'; known: ring
"""

from __future__ import annotations

from typing import Callable, Generic, Iterator, TypeVar

T = TypeVar("T")


class Registry(Generic[T]):
    """A mapping from names to objects that refuses duplicate names and unknown look-ups."""

    __slots__ = ("kind", "_items")

    def __init__(self, kind: str) -> None:
        self.kind = kind
        self._items: dict[str, T] = {}

    def add(self, name: str, obj: T) -> T:
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

    def get(self, name: str) -> T:
        try:
            return self._items[name]
        except KeyError:
            raise ValueError(
                f"unknown {self.kind} {name!r}; known: {', '.join(self.names()) or '(none)'}"
            ) from None

    def names(self) -> list[str]:
        return list(self._items)

    def __contains__(self, name: object) -> bool:
        return name in self._items

    def __iter__(self) -> Iterator[str]:
        return iter(self._items)

    def __len__(self) -> int:
        return len(self._items)

    def __repr__(self) -> str:
        return f"Registry({self.kind!r}, {self.names()})"
