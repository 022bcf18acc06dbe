"""scripts/setup.sh's torch decisions (issue 33 item 8): the user's own torch, also one in the
virtual environment they activated, is used; a CUDA build is never downloaded onto a machine without
a GPU unless asked (scripts/torch_build.py reads pip's resolution)."""

from __future__ import annotations

import json
import subprocess
import sys
import venv
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "scripts"))
from torch_build import build  # noqa: E402


def _report(*packages: tuple[str, str]) -> dict:
    return {"install": [{"metadata": {"name": n, "version": v}} for n, v in packages]}


def test_the_registry_build_is_read_from_pip_resolution():
    assert build(_report(("torch", "2.13.0"), ("nvidia-cublas-cu12", "12.8"), ("filelock", "3"))) == "cuda"
    assert build(_report(("torch", "2.13.0+cu126"))) == "cuda"
    assert build(_report(("torch", "2.13.0+cpu"), ("filelock", "3"))) == "cpu"
    assert build(_report(("torch", "2.13.0"))) == "cpu"  # a registry pinning a CPU wheel
    out = subprocess.run([sys.executable, str(ROOT / "scripts" / "torch_build.py")], input="not json",
                         capture_output=True, text=True, check=True).stdout.strip()
    assert out == "unknown"
    report = json.dumps(_report(("torch", "2.13.0"), ("nvidia-nccl-cu12", "2.27")))
    assert subprocess.run([sys.executable, str(ROOT / "scripts" / "torch_build.py")], input=report,
                          capture_output=True, text=True, check=True).stdout.strip() == "cuda"


def _python_of(env: Path) -> str:
    return str(env / "bin" / "python")


def test_a_torch_in_the_users_activated_venv_is_used(tmp_path):
    """A venv made from an activated venv's Python sees the base interpreter's packages only: the
    user's torch there was invisible and setup.sh installed another, multi-GB, one on top."""
    base = Path(sys.base_prefix) / "bin" / "python3"
    user, ours = tmp_path / "user-env", tmp_path / ".venv"
    venv.EnvBuilder(with_pip=False).create(user)
    site = subprocess.run([_python_of(user), "-c", "import sysconfig; print(sysconfig.get_paths()['purelib'])"],
                          capture_output=True, text=True, check=True).stdout.strip()
    (Path(site) / "torch").mkdir()
    (Path(site) / "torch" / "__init__.py").write_text("__version__ = 'user-cuda-build'\n")
    subprocess.run([str(base), "-m", "venv", "--without-pip", "--system-site-packages", str(ours)], check=True)
    ask = [_python_of(ours), "-c", "import torch; print(torch.__version__)"]
    before = subprocess.run(ask, capture_output=True, text=True)
    assert "user-cuda-build" not in before.stdout  # what setup.sh saw before this issue
    done = subprocess.run(["bash", str(ROOT / "scripts" / "use_user_torch.sh"), _python_of(user), str(ours)],
                          capture_output=True, text=True, check=True)
    assert "using the torch of" in done.stderr
    assert subprocess.run(ask, capture_output=True, text=True, check=True).stdout.strip() == "user-cuda-build"
    # idempotent, and nothing happens for a Python without torch
    again = subprocess.run(["bash", str(ROOT / "scripts" / "use_user_torch.sh"), _python_of(user), str(ours)],
                           capture_output=True, text=True, check=True)
    assert again.stderr == ""
    bare = tmp_path / "bare"
    venv.EnvBuilder(with_pip=False).create(bare)
    none = subprocess.run(["bash", str(ROOT / "scripts" / "use_user_torch.sh"), _python_of(bare), str(ours)],
                          capture_output=True, text=True, check=True)
    assert none.stderr == ""
