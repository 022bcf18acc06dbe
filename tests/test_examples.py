"""The own-code examples run as written and the docs show them verbatim: examples/train_ddp.py (the
README) and examples/custom_recipe.py (docs/recipe.md) under torchrun (2 ranks); the README's hook
list is the catalog's. examples/transformers_gtopk.py (a Hugging Face Trainer) runs under torchrun
too: stopped after its checkpoint of step 40, then resumed from it (needs transformers)."""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

import pytest
from torchrun_jobs import flashsgd_lines

from flashsgd.exchanges import EXCHANGES

ROOT = Path(__file__).resolve().parents[1]
EXAMPLE = ROOT / "examples" / "train_ddp.py"
CUSTOM = ROOT / "examples" / "custom_recipe.py"
TRAINER = ROOT / "examples" / "transformers_gtopk.py"
TORCHRUN = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2"]


def _python_blocks(path: Path) -> list[str]:
    return re.findall(r"```python\n(.*?)```", path.read_text(), flags=re.S)


def _own_code_section() -> str:
    readme = (ROOT / "README.md").read_text()
    return readme.split("## Using the pieces in your own code\n", 1)[1].split("\n## ", 1)[0]


@pytest.mark.parametrize("example, doc", [(EXAMPLE, "README.md"), (CUSTOM, "docs/recipe.md")])
def test_docs_show_the_example_verbatim(example, doc):
    assert example.read_text() in _python_blocks(ROOT / doc)


def test_example_trains_under_torchrun(tmp_path):
    out = subprocess.run(TORCHRUN + [str(EXAMPLE), str(tmp_path / "ckpt")], capture_output=True,
                         text=True, timeout=180, cwd=tmp_path)
    assert out.returncode == 0, out.stderr[-3000:]
    losses = [float(v) for v in re.findall(r"loss ([0-9.]+)", out.stdout)]
    assert len(losses) == 5 and losses[-1] < losses[0], out.stdout
    assert sorted(p.name for p in (tmp_path / "ckpt").iterdir()) == ["rank0.pt", "rank1.pt"]


@pytest.mark.slow  # 14 s; the recipe API is tested in tests/test_recipes.py
def test_custom_recipe_example_trains_under_torchrun_without_a_warning(tmp_path):
    out = subprocess.run(TORCHRUN + [str(CUSTOM)], capture_output=True, text=True, timeout=180, cwd=tmp_path)
    assert out.returncode == 0, out.stderr[-3000:]
    assert not re.search(r"\w+Warning: ", out.stderr), out.stderr[-3000:]  # no library trap is hit
    # the plan says global_batch is the final batch, and the loop follows the batch table
    assert "global_batch=512 (the final batch; batch-size control: 256 for epochs 0-1" in out.stdout
    rows = re.findall(r"epoch (\d): batch (\d+), lr ([0-9.e-]+), loss ([0-9.]+), test accuracy ([0-9.]+)%",
                      out.stdout)
    assert [(int(e), int(b)) for e, b, *_ in rows] == [(0, 256), (1, 256)] + [(e, 512) for e in range(2, 6)]
    lrs, losses, accs = ([float(r[i]) for r in rows] for i in (2, 3, 4))
    assert lrs[-1] < 0.01 * max(lrs)  # the poly decay reached its end
    assert losses[-1] < losses[0] and accs[-1] > 85.0, out.stdout  # chance is ~10%


def _trainer_example(out: Path, *stop: str) -> subprocess.CompletedProcess:
    pytest.importorskip("transformers", reason="needs Hugging Face Transformers (pip install "
                        "'flashsgd[integrations]'; scripts/setup.sh installs it)")
    done = subprocess.run(TORCHRUN + [str(TRAINER), str(out), *stop], capture_output=True, text=True,
                          timeout=180, cwd=out.parent)
    assert done.returncode == 0, done.stderr[-3000:]
    return done


@pytest.mark.slow  # 23 s; the Trainer path and its resume: tests/test_integrations_transformers.py
def test_transformers_example_trains_and_checkpoints_under_torchrun(tmp_path):
    """The first half of the example's stop-and-resume (the resume is the slow test below; a resume's
    bit-identity: tests/test_integrations_transformers.py)."""
    out = tmp_path / "run"
    first = _trainer_example(out, "40")
    assert sorted(p.name for p in out.iterdir()) == ["checkpoint-20", "checkpoint-40"], first.stdout
    for step in (20, 40):  # each rank's hook state inside each checkpoint
        assert sorted(p.name for p in (out / f"checkpoint-{step}" / "flashsgd_hook").iterdir()) == \
            ["rank0.pt", "rank1.pt"]
    assert len(flashsgd_lines(TRAINER)) <= 3, flashsgd_lines(TRAINER)


@pytest.mark.slow
def test_transformers_example_trains_stops_and_resumes_under_torchrun(tmp_path):
    out = tmp_path / "run"
    first = _trainer_example(out, "40")
    assert sorted(p.name for p in out.iterdir()) == ["checkpoint-20", "checkpoint-40"], first.stdout
    resumed = _trainer_example(out)
    assert f"resuming from {out / 'checkpoint-40'}" in resumed.stdout, resumed.stdout
    losses = [float(v) for v in re.findall(r"epoch \d: loss ([0-9.]+)", resumed.stdout)]
    assert len(losses) == 4 and losses[-1] < losses[0], resumed.stdout
    for step in (20, 40, 60, 80):  # each rank's hook state inside each checkpoint
        assert sorted(p.name for p in (out / f"checkpoint-{step}" / "flashsgd_hook").iterdir()) == \
            ["rank0.pt", "rank1.pt"]


def test_readme_hook_list_is_the_catalog():
    section = _own_code_section()
    rows = re.findall(r"^\| `(\w+)` \| (\w+) \| (.*) \|$", section, flags=re.M)
    assert rows == [(name, e.family, e.summary) for name, e in EXCHANGES.items()]
    # the density warm-up is named, for exactly the sparse exchanges
    sparse = re.search(r"The sparse hooks \(([^)]*)\) need DGC's \*\*density warm-up\*\*", section)
    assert sparse, "the README's own-code section must mention the sparse hooks' density warm-up"
    assert re.findall(r"`(\w+)`", sparse.group(1)) == [n for n, e in EXCHANGES.items() if e.family == "sparse"]
    assert "density_warmup=" in section and "density_warmup_steps=" in section
