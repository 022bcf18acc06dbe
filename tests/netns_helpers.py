"""``needs_netns``: skip a test, naming the reason, where the emulated cluster cannot be built
(not root, no ``ip``/``tc``, no network namespaces)."""

from __future__ import annotations

import pytest

from flashsgd.emulate.netns import EmulationUnavailable, check_available


def _unavailable_reason() -> str | None:
    try:
        check_available()
    except EmulationUnavailable as exc:
        return str(exc)
    return None


REASON = _unavailable_reason()
needs_netns = pytest.mark.skipif(REASON is not None, reason=f"emulated cluster unavailable: {REASON}")
