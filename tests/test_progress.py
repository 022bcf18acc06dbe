"""`flashsgd train`'s progress (flashsgd.train.progress) and its first line (trainer.say_starting):
tqdm on a terminal, a plain line every few seconds elsewhere; a line naming the workers and the
data before the data are made."""

from __future__ import annotations

import doctest
import io
import os
import subprocess
import sys
from pathlib import Path

from flashsgd.train import progress
from flashsgd.train.data import describe_loading
from flashsgd.train.progress import ProgressLines, progress_bar

TINY = ["--num-samples", "2000", "--epochs", "2", "--global-batch", "256"]


class _Terminal(io.StringIO):
    def isatty(self) -> bool:
        return True


def test_doctest():
    assert doctest.testmod(progress).failed == 0


def test_lines_come_every_few_seconds_and_never_carry_carriage_returns():
    out, now = io.StringIO(), [100.0]
    p = ProgressLines(total=50, initial=10, file=out, every_s=5.0, clock=lambda: now[0])
    for step in range(40):  # a resumed run: steps 10..49, one per second
        now[0] += 1.0
        p.set_postfix(loss=f"{1 / (step + 1):.3f}", refresh=False)
        p.update(1)
        if step == 20:
            p.set_postfix(acc="97.00%", refresh=True)  # an evaluation's accuracy stays shown
    p.close()
    text = out.getvalue()
    assert "\r" not in text
    lines = text.splitlines()
    assert len(lines) == 8  # one per 5 s of 40 s
    assert lines[0] == "step 15/50 (30%), 1 step/s, 5 s elapsed, ~35 s left | loss=0.200"
    assert lines[-1] == "step 50/50 (100%), 1 step/s, 40 s elapsed | loss=0.025, acc=97.00%"
    p.close()  # nothing new: no second final line
    assert out.getvalue() == text


def test_tqdm_on_a_terminal_lines_elsewhere():
    bar = progress_bar(120, stream=_Terminal())
    assert type(bar).__name__ == "tqdm"
    bar.close()
    assert isinstance(progress_bar(120, initial=7, stream=io.StringIO()), ProgressLines)


def test_describe_loading_says_generating_then_loading(tmp_path):
    mnist1d = dict(num_samples=2000, data_dir=str(tmp_path))
    assert describe_loading("mnist1d", **mnist1d).startswith("generating MNIST-1D (2,000 samples")
    (tmp_path / "mnist1d_2000_42.npz").write_bytes(b"")
    assert describe_loading("mnist1d", **mnist1d).startswith("loading MNIST-1D (2,000 samples) from ")
    assert describe_loading("synthetic", num_samples=512, image_shape="cifar") == "synthetic cifar-shaped images (512 samples)"


def test_train_says_what_it_starts_first_and_writes_progress_lines_to_a_pipe(tmp_path):
    """stdout and stderr are pipes here, as in a CI log: no carriage returns, a final line."""
    flashsgd = Path(sys.executable).with_name("flashsgd")
    env = {**os.environ, "PYTHONUNBUFFERED": "1"}
    out = subprocess.run([str(flashsgd), "train", *TINY, "--data-dir", str(tmp_path / "data"),
                          "--out", str(tmp_path / "run")], capture_output=True, text=True, timeout=240,
                         cwd=tmp_path, env=env)
    assert out.returncode == 0, out.stderr[-3000:]
    first = out.stdout.splitlines()[0]
    assert first == (f"flashsgd train: generating MNIST-1D (2,000 samples; cached in {tmp_path / 'data'} "
                     f"for the next run) for 4 workers (gloo) ..."), out.stdout[:500]
    assert "\r" not in out.stderr
    assert "step 14/14 (100%)" in out.stderr and "acc=" in out.stderr, out.stderr[-2000:]
