"""Registry: a read-only Mapping that refuses duplicates and names the known entries."""

from collections.abc import Mapping

import pytest

from flashsgd.optim import RECIPES
from flashsgd.registry import Registry, UnknownNameError


def _widgets():
    reg = Registry("widget")
    reg.add("a", 1)
    reg.add("b", 2)
    return reg


def test_registry_is_a_mapping():
    reg = _widgets()
    assert isinstance(reg, Mapping)
    assert reg["a"] == 1 and reg.get("b") == 2
    assert dict(reg) == {"a": 1, "b": 2} and list(reg) == ["a", "b"] and len(reg) == 2
    assert list(reg.items()) == [("a", 1), ("b", 2)] and list(reg.values()) == [1, 2]
    assert "a" in reg and "c" not in reg and [] not in reg
    assert reg.get("c", None) is None and reg.get("c", 0) == 0
    assert reg == {"a": 1, "b": 2}
    with pytest.raises(TypeError):
        reg["c"] = 3  # read-only: only add() registers


def test_unknown_name_lists_the_known_ones():
    reg = _widgets()
    for lookup in (lambda: reg["c"], lambda: reg.get("c")):
        with pytest.raises(UnknownNameError) as info:
            lookup()
        assert str(info.value) == "unknown widget 'c'; known: a, b"
        assert isinstance(info.value, KeyError) and isinstance(info.value, ValueError)
    with pytest.raises(UnknownNameError, match="known: a, b"):
        reg[["unhashable"]]
    with pytest.raises(ValueError, match=r"unknown widget 'x'; known: \(none\)"):
        Registry("widget")["x"]


def test_duplicates_and_bad_names_are_refused():
    reg = _widgets()
    with pytest.raises(ValueError, match="widget 'a' is already registered"):
        reg.add("a", 3)
    with pytest.raises(ValueError, match="widget name must be a non-empty string"):
        reg.add("", 3)

    @reg.register("c")
    def c():
        return 3

    assert reg["c"] is c


def test_recipes_are_subscriptable():
    assert RECIPES["fujitsu"] is RECIPES.get("fujitsu")
    assert {"goyal", "sony", "fujitsu", "fujitsu-mnist1d"} <= set(RECIPES)
    with pytest.raises(KeyError, match="unknown recipe 'fujitsuu'; known: goyal, sony, fujitsu"):
        RECIPES["fujitsuu"]
