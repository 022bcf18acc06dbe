"""The one shared harness for multi-process tests: ``run_ranks(fn, world, *args)``.

It spawns ``world`` ranks on Gloo over loopback through :func:`flashsgd.launch.spawn` (the same
launcher the CLI uses), with a deadline so that a hang fails the test instead of the CI run, and
returns the per-rank results. ``fork`` is used for speed (the workers inherit imported torch), so
``fn`` may be any module-level function of a test file.
"""

from __future__ import annotations

import os

import pytest
import torch._dynamo  # noqa: F401  DDP imports it (~800 modules): once here, not in every forked rank

from flashsgd.launch import spawn

DEFAULT_TIMEOUT_S = float(os.environ.get("FLASHSGD_TEST_TIMEOUT", "120"))


def _run_ranks(fn, world, *args, timeout_s=DEFAULT_TIMEOUT_S, env=None):
    return spawn(fn, world, args, backend="gloo", timeout_s=timeout_s, deadline_s=timeout_s,
                 start_method="fork", env=env)


@pytest.fixture
def run_ranks():
    """``run_ranks(fn, world, *args, timeout_s=120, env=None) -> [result of rank 0, 1, ...]``."""
    return _run_ranks
