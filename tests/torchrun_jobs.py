"""The integration tests' launcher: a real ``torchrun`` job (``python -m torch.distributed.run
--standalone``) in a session of its own, killed whole when it outlives its timeout."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
from pathlib import Path

import pytest


def torchrun(args: list[str], timeout: float, cwd: Path, world: int, env: dict[str, str] | None = None
             ) -> subprocess.CompletedProcess:
    """torchrun ``args`` with ``world`` ranks (one thread each, ``env`` added); on timeout the whole
    session is killed and the test fails with the job's stderr."""
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", str(world), *args]
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, cwd=cwd,
                            env={**os.environ, "OMP_NUM_THREADS": "1", **(env or {})}, start_new_session=True)
    try:
        out, err = proc.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        out, err = proc.communicate()
        pytest.fail(f"torchrun timed out after {timeout:.0f} s: {err[-3000:]}")
    return subprocess.CompletedProcess(cmd, proc.returncode, out, err)


def job(script: str, specs: list[dict], cwd: Path, world: int, timeout: float,
        env: dict[str, str] | None = None) -> subprocess.CompletedProcess:
    """``script`` (a test file that is also its job's script) run by :func:`torchrun` with ``specs``
    as its JSON argument; the job must succeed."""
    done = torchrun([script, json.dumps(specs)], timeout, cwd, world, env)
    assert done.returncode == 0, done.stderr[-4000:]
    return done
