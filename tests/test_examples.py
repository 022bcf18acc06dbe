"""The README's own-code example runs as written: examples/train_ddp.py under torchrun (2 ranks),
and the README shows that file verbatim."""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
EXAMPLE = ROOT / "examples" / "train_ddp.py"


def test_readme_shows_the_example_verbatim():
    blocks = re.findall(r"```python\n(.*?)```", (ROOT / "README.md").read_text(), flags=re.S)
    assert EXAMPLE.read_text() in blocks


def test_example_trains_under_torchrun(tmp_path):
    torchrun = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2"]
    out = subprocess.run(torchrun + [str(EXAMPLE), str(tmp_path / "ckpt")], capture_output=True,
                         text=True, timeout=180, cwd=tmp_path)
    assert out.returncode == 0, out.stderr[-3000:]
    losses = [float(v) for v in re.findall(r"loss ([0-9.]+)", out.stdout)]
    assert len(losses) == 5 and losses[-1] < losses[0], out.stdout
    assert sorted(p.name for p in (tmp_path / "ckpt").iterdir()) == ["rank0.pt", "rank1.pt"]
