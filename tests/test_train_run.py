"""flashsgd train end to end: the CLI with tiny settings, resume equivalence, faults, torchrun."""

from __future__ import annotations

import json
import os
import random
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

from flashsgd.cli import main
from flashsgd.launch import WorkerError
from flashsgd.train import config as C
from flashsgd.train.records.report import read_metrics
from flashsgd.train.trainer import train
from ports import free_port

TINY = ["--num-samples", "2000", "--epochs", "2", "--global-batch", "256", "--no-progress"]
REPO = Path(__file__).resolve().parents[1]


def tiny(out, **cli):
    base = dict(num_samples=2000, epochs=2.0, global_batch=256, progress=False, out=str(out))
    return C.resolve(cli={**base, **cli})


def test_default_command_end_to_end(tmp_path, capfd):
    assert main(["train", *TINY, "--out", str(tmp_path)]) == 0
    printed = capfd.readouterr().out
    assert "world 4 (world 4 = 2 nodes x 2 ranks/node, grid 2x2" in printed
    assert "per worker 64" in printed and "torus2d" in printed and "effective peak" in printed
    for name in ("config.toml", "metrics.jsonl", "summary.json", "report.png", "checkpoints/latest"):
        assert (tmp_path / name).exists(), name
    assert list((tmp_path / "tensorboard").glob("events.out.tfevents.*"))
    steps, evals = read_metrics(tmp_path / "metrics.jsonl")
    assert len(steps) == 2 * 7 and [e["epoch"] for e in evals] == [1, 2]  # 1600 / 256 -> 7 steps
    assert sum(s["global_batch"] for s in steps) == 2 * 1600
    assert {"loss", "lr", "images_per_s", "t_forward_s", "t_backward_s", "t_comm_s"} <= set(steps[0])
    summary = json.loads((tmp_path / "summary.json").read_text())
    assert summary["steps"] == 14 and summary["scaling"]["grid"] == "2x2"
    assert summary["final_test_accuracy"] == evals[-1]["test_accuracy"]
    assert C.resolve(tmp_path / "config.toml").optim.global_batch == 256  # resolved config reloads


def _final_state(out):
    latest = (Path(out) / "checkpoints" / "latest").read_text().strip()
    return torch.load(Path(out) / "checkpoints" / latest / "shared.pt", weights_only=True)["model"]


def test_resume_gives_the_same_parameters(tmp_path):
    common = dict(workers=2, deterministic=True, checkpoint_every=4, algorithm="ring", seed=3)
    train(tiny(tmp_path / "a", **common))
    train(tiny(tmp_path / "b", max_steps=6, **common))             # interrupted after step 6
    train(tiny(tmp_path / "b", **common))                           # --resume auto continues
    a, b = _final_state(tmp_path / "a"), _final_state(tmp_path / "b")
    assert a.keys() == b.keys()
    for k in a:
        assert torch.equal(a[k], b[k]), k
    _, evals_b = read_metrics(tmp_path / "b" / "metrics.jsonl")
    _, evals_a = read_metrics(tmp_path / "a" / "metrics.jsonl")
    assert [e["test_accuracy"] for e in evals_a] == [e["test_accuracy"] for e in evals_b]


def test_nonfinite_skip_counts_and_stop_names_the_step(tmp_path):
    s = train(tiny(tmp_path / "skip", workers=2, fail_at="1:3:nan", max_steps=5))
    assert s["skipped_steps"] == 1 and s["steps"] == 5
    with pytest.raises(WorkerError, match="non-finite loss or gradient at step 3"):
        train(tiny(tmp_path / "stop", workers=2, fail_at="0:3:nan", nonfinite="stop"))


@pytest.mark.parametrize("mode", ["exit", "hang"])
def test_dead_or_hung_worker_fails_the_run_in_time(tmp_path, mode):
    t0 = time.monotonic()
    with pytest.raises(WorkerError) as err:
        train(tiny(tmp_path, workers=2, fail_at=f"1:2:{mode}", timeout_s=4, algorithm="native"))
    assert time.monotonic() - t0 < 60
    assert err.value.causes == (1,), err.value.details
    expected = "rank 1 exited with code 17" if mode == "exit" else "rank 1 stopped responding"
    assert str(err.value).startswith(expected), str(err.value)


def _torchrun(args, out, env_extra=None):
    env = {**os.environ, "GLOO_SOCKET_IFNAME": "lo", "PYTHONPATH": str(REPO / "src"),
           "OMP_NUM_THREADS": "1", **(env_extra or {})}
    cmd = [sys.executable, "-m", "torch.distributed.run", *args, "-m", "flashsgd", "train", *TINY,
           "--out", str(out), "--checkpoint-every", "2"]
    return subprocess.Popen(cmd, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)


def test_two_torchrun_agents_train_together(tmp_path):
    port = free_port()
    rdzv = ["--nnodes", "2", "--nproc-per-node", "2", "--rdzv-backend", "c10d",
            "--rdzv-endpoint", f"127.0.0.1:{port}", "--rdzv-id", "pytest"]
    agents = [_torchrun(rdzv, tmp_path) for _ in range(2)]
    logs = [p.communicate(timeout=240)[0] for p in agents]
    assert [p.returncode for p in agents] == [0, 0], "\n".join(logs)
    summary = json.loads((tmp_path / "summary.json").read_text())
    assert summary["scaling"]["world_size"] == 4 and summary["scaling"]["nodes"] == 2
    assert summary["steps"] == 14


def test_killed_worker_restarts_and_resumes_from_checkpoint(tmp_path):
    kill_step = random.Random().randrange(3, 13)  # a random step of the 14
    agent = _torchrun(["--standalone", "--nnodes", "1", "--nproc-per-node", "2", "--max-restarts", "1"],
                      tmp_path, {"FLASHSGD_FAIL_AT": f"1:{kill_step}:exit"})
    log = agent.communicate(timeout=240)[0]
    assert agent.returncode == 0, log
    assert f"rank 1 exits at step {kill_step}" in log
    rows = [json.loads(line) for line in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    resumed = [r["step"] for r in rows if r["kind"] == "resume"]
    assert len(resumed) == 1
    # checkpoints every 2 steps and at epoch ends (step 7): at most 2 steps are lost
    assert kill_step - 2 <= resumed[0] <= kill_step, (kill_step, resumed)
    summary = json.loads((tmp_path / "summary.json").read_text())
    assert summary["steps"] == 14 and summary["epochs"] == 2


SLOW_HUNG = {"torus2d", "hierarchical", "topk", "hgtopk"}
"""Hooks whose run-level hang test is marked slow (~11 s each, for the default suite's 12 minutes):
each shares its kind of wait with one kept here (ring: dense stages; gtopk: p2p rounds; hgtopk:
both), and
tests/test_comm_timeouts.py times each of their waits out on real process groups."""


def _hook_names():
    from flashsgd.comm.hooks import HOOKS

    names = [n for n in HOOKS.names() if n != "noop"]  # noop never communicates: nothing to wait on
    return [pytest.param(n, marks=pytest.mark.slow) if n in SLOW_HUNG else n for n in names]


@pytest.mark.parametrize("algorithm", _hook_names())
def test_a_hung_worker_is_named_within_the_timeout_for_every_hook(tmp_path, algorithm):
    """Every wait in every algorithm honours run.timeout_s and the hung rank is named first."""
    t0 = time.monotonic()
    with pytest.raises(WorkerError) as err:
        train(tiny(tmp_path, workers=4, fail_at="1:3:hang", timeout_s=5, algorithm=algorithm,
                   density=0.05))
    elapsed = time.monotonic() - t0
    assert str(err.value).startswith("rank 1 stopped responding"), err.value.details
    assert err.value.causes == (1,)
    assert elapsed < 5 + 25, elapsed  # start-up (4 processes on 2 cores), 3 steps, timeout, settle


def test_sigterm_stops_the_run_and_its_workers(tmp_path):
    out = tmp_path / "run"
    env = {**os.environ, "PYTHONPATH": str(REPO / "src")}
    proc = subprocess.Popen([sys.executable, "-m", "flashsgd", "train", *TINY, "--epochs", "30",
                             "--out", str(out)], env=env, stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True)
    deadline = time.monotonic() + 120
    while not (out / "metrics.jsonl").exists() or not (out / "metrics.jsonl").read_text():
        assert proc.poll() is None and time.monotonic() < deadline, proc.communicate()
        time.sleep(0.2)
    proc.terminate()
    _, err = proc.communicate(timeout=60)
    assert proc.returncode == 143, err
    assert "interrupted" in err and "Traceback" not in err
    time.sleep(1.0)
    left = subprocess.run(["pgrep", "-f", str(out)], capture_output=True, text=True).stdout.split()
    assert left == [], f"workers still running: {left}"
    # the run directory is consistent: a resume continues from the last complete checkpoint
    assert main(["train", *TINY, "--epochs", "30", "--out", str(out), "--max-steps", "1"]) == 0
