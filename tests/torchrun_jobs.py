"""The integration tests' shared helpers: a real ``torchrun`` job (``python -m torch.distributed.run
--standalone``) in a session of its own, killed whole when it outlives its timeout, and the count of
an example's flashsgd lines."""

from __future__ import annotations

import ast
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


def flashsgd_lines(path: Path) -> list[int]:
    """The lines of ``path`` that import from flashsgd or use a name imported from it (an example's
    "flashsgd lines")."""
    tree = ast.parse(path.read_text())
    names, lines = set(), set()
    for node in ast.walk(tree):
        if isinstance(node, (ast.Import, ast.ImportFrom)):
            mods = [node.module or ""] if isinstance(node, ast.ImportFrom) else [a.name for a in node.names]
            if any(m.split(".")[0] == "flashsgd" for m in mods):
                lines.add(node.lineno)
                names |= {(a.asname or a.name).split(".")[0] for a in node.names}
    lines |= {n.lineno for n in ast.walk(tree) if isinstance(n, ast.Name) and n.id in names}
    return sorted(lines)
