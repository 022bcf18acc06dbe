"""Failures name their real cause (issue 23): a diverged run never passes as done, a full disk is
the path and the OS error (never "a collective failed"), a model/dataset mismatch is bad input
before any process starts, and failure lines are whole words without torch's doubled prefixes."""

from __future__ import annotations

import errno
import re
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel as DDP

from ddp_helpers import tiny_net
from flashsgd.cli import main
from flashsgd.launch import WorkerError
from flashsgd.launch_failures import describe_exception
from flashsgd.train import checkpoint as ckpt
from flashsgd.train import config as C
from flashsgd.train.step import TrainStep

TINY = ["--num-samples", "2000", "--epochs", "2", "--global-batch", "256", "--no-progress",
        "--workers", "2", "--comm", "ring"]
REPO = Path(__file__).resolve().parents[1]


def _train(out, *extra):
    return main(["train", *TINY, "--out", str(out), *extra])


# ---------------------------------------------------------------- item 1: divergence -----------
def _step_with(max_skipped: int, poison_at: set[int], nan_param_at: int | None):
    ddp = DDP(tiny_net())
    opt = torch.optim.SGD(ddp.parameters(), lr=0.1)
    step = TrainStep(ddp, opt, torch.nn.CrossEntropyLoss(reduction="sum"), max_skipped=max_skipped)
    torch.manual_seed(dist.get_rank())
    x, y = torch.randn(8, 20), torch.randint(0, 5, (8,))
    skipped = []
    for i in range(10):
        if i == nan_param_at:
            with torch.no_grad():
                next(ddp.parameters())[0].fill_(float("nan"))
        try:
            skipped.append(step(lambda: (x, y), 16, step=i, epoch=0,
                                poison=i in poison_at and dist.get_rank() == 1).skipped)
        except FloatingPointError as exc:
            return skipped, str(exc)
    return skipped, None


def test_nonfinite_parameters_stop_a_skipping_run_at_once(run_ranks):
    for skipped, error in run_ranks(_step_with, 2, 0, set(), 3):
        assert skipped == [False] * 3, skipped
        assert error.startswith("training diverged: the model's parameters are non-finite at step 3 (epoch 0)")
        assert "optim.lr_per_ref" in error and "run.nonfinite = 'stop'" in error


def test_a_bounded_number_of_consecutive_skips_stops_the_run(run_ranks):
    # steps 1-2 skipped, 3 applied (the count starts over), 4-6 skipped: the third in a row stops
    for skipped, error in run_ranks(_step_with, 2, 3, {1, 2, 4, 5, 6, 7}, None):
        assert skipped == [False, True, True, False, True, True], skipped
        assert "3 steps in a row were skipped" in error and "(run.max_skipped = 3)" in error
        assert "the first at step 4 (epoch 0)" in error and "warmup" in error


def test_a_diverged_run_exits_1_and_writes_no_result(tmp_path, capfd):
    out = tmp_path / "run"
    assert _train(out, "--lr-per-ref", "1e20", "--checkpoint-every", "1") == 1
    err = capfd.readouterr().err.strip().splitlines()
    assert len(err) == 2 and "error.log" in err[1], err
    assert "ranks 0,1 failed: FloatingPointError: training diverged" in err[0], err
    assert re.search(r"the first (non-finite loss or gradient was )?at step \d+", err[0]), err[0]
    assert err[0].endswith("run.nonfinite = 'stop' to stop at the first non-finite step"), err[0]
    assert not (out / "summary.json").exists()
    for _, path in ckpt.step_dirs(out / "checkpoints"):  # every checkpoint written is a finite model
        model = torch.load(path / "shared.pt", weights_only=True)["model"]
        assert all(torch.isfinite(t).all() for t in model.values() if t.is_floating_point()), path


def test_max_skipped_is_a_checked_config_key_that_a_resume_may_change():
    from flashsgd.train.rundir import NEUTRAL_KEYS

    assert C.resolve(cli={"max_skipped": "4"}).run.max_skipped == 4
    with pytest.raises(ValueError, match="run.max_skipped"):
        C.resolve(cli={"max_skipped": "-1"})
    assert "max_skipped" in NEUTRAL_KEYS


# ---------------------------------------------------------------- item 3: a full disk ----------
def _cfg(out, **over):
    base = dict(num_samples=2000, epochs=2.0, global_batch=256, progress=False, out=str(out),
                workers=2, algorithm="ring", checkpoint_every=4)
    return C.resolve(cli={**base, **over})


def _worker_on_a_full_disk(plan, data, start, full_from_step: int):
    """Rank 0's checkpoint writes fail as on a full disk (a write() raising ENOSPC) from a step on."""
    from flashsgd.train import checkpoint as ckpt_mod
    from flashsgd.train.trainer import worker

    real = ckpt_mod.torch.save

    def save(obj, f, *a, **k):
        if dist.get_rank() == 0 and obj["meta"]["step"] >= full_from_step:
            if isinstance(f, (str, os.PathLike)):  # torch.save(obj, path)
                Path(f).write_bytes(b"PK\x03\x04 partial")
            else:
                f.write(b"PK\x03\x04 partial")
            raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))
        return real(obj, f, *a, **k)

    ckpt_mod.torch.save = save
    return worker(plan, data, start)


def test_a_full_disk_names_the_rank_path_and_os_error_and_keeps_the_resume_point(tmp_path, run_ranks):
    from flashsgd.train.plan import build_plan
    from flashsgd.train.rank import load_data
    from flashsgd.train.rundir import open_run_dir
    from flashsgd.train.trainer import train

    out = tmp_path / "run"
    cfg = _cfg(out)
    data = load_data(cfg)
    plan = build_plan(cfg, 2, len(data.train), local_spawn=True, backend="gloo")
    with open_run_dir(plan) as start, pytest.raises(WorkerError) as err:
        run_ranks(_worker_on_a_full_disk, 2, plan, data, start, 8, timeout_s=60)
    first = str(err.value).splitlines()[0]
    path = out / "checkpoints" / "step-00000008" / "shared.pt"
    assert first.startswith(f"rank 0 failed: CheckpointWriteError: cannot write the checkpoint of step 8: "
                            f"[Errno 28] No space left on device: '{path}'; the resume point stays "
                            "step-00000007; rank 1 then failed: "), first  # 4, 7 (epoch end), 8
    assert "collective" not in str(err.value) and err.value.causes == (0,)
    assert ckpt.resume_point(out / "checkpoints")[0].name == "step-00000007"
    assert not list((out / "checkpoints").rglob("*.tmp*"))
    assert train(cfg)["steps"] == 14  # the rerun resumes from step 7 and completes


def test_enospc_when_taking_the_lock_is_one_line(tmp_path, capfd, monkeypatch):
    from flashsgd.train import rundir

    real_write = os.write

    def full(fd, data):  # a full disk: the lock file is created, writing its holder line fails
        if sys._getframe(1).f_globals.get("__name__") == rundir.__name__:
            raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))
        return real_write(fd, data)

    monkeypatch.setattr(rundir.os, "write", full)
    out = tmp_path / "run"
    assert _train(out) == 1
    err = capfd.readouterr().err.strip().splitlines()
    assert err == ["flashsgd train: failed before any worker started: [Errno 28] No space left on device: "
                   f"'{out / '.lock'}'"], err


# ---------------------------------------------------------------- item 4: model vs dataset -----
def test_a_model_that_does_not_take_the_datasets_input_is_bad_input(tmp_path, capfd):
    out = tmp_path / "run"
    assert _train(out, "--model", "resnet20") == 2
    err = capfd.readouterr().err.strip().splitlines()
    assert len(err) == 1, err
    assert "model 'resnet20' does not accept dataset 'mnist1d'" in err[0] and "(40,)" in err[0]
    assert "collective" not in err[0]
    assert not out.exists() or not any(out.iterdir())


def _worker_with_a_bug(plan, data, start):
    from flashsgd.train.step import TrainStep as Step
    from flashsgd.train.trainer import worker

    def broken(self, x, y):
        raise RuntimeError("mat1 and mat2 shapes cannot be multiplied (64x40 and 12x10)")

    Step.forward_loss = broken
    return worker(plan, data, start)


def test_an_error_of_a_rank_is_not_called_a_communication_failure(tmp_path, run_ranks):
    from flashsgd.train.plan import build_plan
    from flashsgd.train.rank import load_data
    from flashsgd.train.rundir import open_run_dir

    cfg = _cfg(tmp_path / "run")
    data = load_data(cfg)
    plan = build_plan(cfg, 2, len(data.train), local_spawn=True, backend="gloo")
    with open_run_dir(plan) as start, pytest.raises(WorkerError) as err:
        run_ranks(_worker_with_a_bug, 2, plan, data, start, timeout_s=60)
    assert str(err.value) == ("ranks 0,1 failed: RuntimeError: mat1 and mat2 shapes cannot be multiplied "
                              "(64x40 and 12x10)"), str(err.value)


# ---------------------------------------------------------------- item 12: messages ------------
def test_torchs_doubled_callback_prefix_is_dropped():
    from flashsgd.launch_failures import one_line

    inner = "PeerTimeout: rank 0: no data from peer rank 1 within 5 s (torus2d all-reduce, row stage)"
    doubled = ("Got the following error when running the callback: RuntimeError: Got the following "
               f"error when running the callback: {inner}")
    assert one_line(doubled) == inner.split(": ", 1)[1]
    wrapped = RuntimeError(f"rank 0: failed at step 3 - a collective failed ({one_line(doubled)})")
    assert "Got the following" not in describe_exception(wrapped)["error"]


def test_long_failure_lines_are_cut_between_words():
    from flashsgd.launch_failures import one_line

    words = [f"word{i:03d}" for i in range(80)]
    text = one_line(" ".join(words), 300)
    assert len(text) <= 300 and text.endswith(" ...")
    assert set(text[:-4].split()) <= set(words)  # no word cut in half
    err = RuntimeError("Connection closed by peer " + " ".join(words))
    short = describe_exception(err)["error"]
    assert short.endswith(" ...") and set(short[:-4].split()) <= set(words) | {"Connection", "closed", "by", "peer"}


def test_an_interrupted_run_without_a_checkpoint_does_not_promise_a_resume(tmp_path):
    out = tmp_path / "run"
    env = {**os.environ, "PYTHONPATH": str(REPO / "src")}
    proc = subprocess.Popen([sys.executable, "-m", "flashsgd", "train", *TINY, "--out", str(out),
                             "--fail-at", "0:1:hang"], env=env, stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True)
    deadline = time.monotonic() + 120
    while not (out / "metrics.jsonl").exists() or not (out / "metrics.jsonl").read_text():
        assert proc.poll() is None and time.monotonic() < deadline, proc.communicate()
        time.sleep(0.2)
    time.sleep(1.0)  # rank 0 is in its hang at step 1, before the first checkpoint (step 7)
    proc.send_signal(signal.SIGTERM)
    _, err = proc.communicate(timeout=60)
    assert proc.returncode == 143, err
    assert "no checkpoint was written yet: a rerun starts over" in err
    assert "can be resumed" not in err and "resumes from" not in err, err


# ------------------------------------------------------------------ faults by their real cause ---
def test_a_partition_is_named_as_the_lost_connection_not_as_ranks_blaming_each_other():
    """Issue 33 item 5: a node cut off for good made both sides fail by timeout, each blaming a rank
    of the other; every failed rank timing out on the other node, on both sides, is a lost link."""
    from flashsgd.launch_failures import RankOutcome, attribute, lost_connections

    both = {0: 2, 1: 3, 2: 0, 3: 1}
    assert lost_connections(both, 2) == (
        "the connection between node 0 (ranks 0,1) and node 1 (ranks 2,3) was lost: every failed rank "
        "timed out waiting for a rank of the other node, and none died or failed on its own")
    assert lost_connections({0: 2, 1: 3}, 2) is None           # node 1 silent: it stopped, not a link
    assert lost_connections({**both, 3: None}, 2) is None      # a rank died or failed on its own
    assert lost_connections({0: 1, 1: 0}, 2) is None           # inside a node
    outcomes = [RankOutcome(r, "raised", error=f"rank {r}: no data from peer rank {p} within 10 s",
                            comm=True, timeout=True, peer=p) for r, p in both.items()]
    err = attribute(outcomes, ranks_per_node=2)
    assert str(err).splitlines()[0].startswith("the connection between node 0 (ranks 0,1) and node 1")
    assert not attribute(outcomes).summary.startswith("the connection")  # one node: no partition
    died = [RankOutcome(3, "exited", exitcode=-9)] + outcomes[:3]
    assert str(attribute(died, ranks_per_node=2)).startswith("rank 3 exited with code -9 (SIGKILL)")


def test_a_rank_timing_out_on_another_node_says_it_may_be_the_link():
    """The rank's own line: a timeout on a rank of another node is that rank, or the link."""
    from types import SimpleNamespace

    from flashsgd.comm.errors import PeerTimeout
    from flashsgd.train.worker import Worker

    me = SimpleNamespace(rank=0, cfg=SimpleNamespace(run=SimpleNamespace(timeout_s=30.0)),
                         topology=SimpleNamespace(ranks_per_node=2))
    across = Worker._what_failed(me, [PeerTimeout(0, 2, 30.0, "torus2d all-reduce, col stage")])
    assert across == ("no data from rank 2 (node 1) within 30 s: rank 2 stopped, or the connection "
                      "between node 0 and node 1 was lost")
    inside = Worker._what_failed(me, [PeerTimeout(0, 1, 30.0, "ring")])
    assert inside.startswith("a collective failed, so a worker died or hung")


def test_the_emulated_launcher_reads_the_peer_each_rank_waited_for(tmp_path):
    from flashsgd.emulate.ranks import waited_for

    log = tmp_path / "rank0.log"
    log.write_text("...\nRuntimeError: rank 0: failed at step 3 - no data from rank 2 (node 1) within 10 s: "
                   "... (rank 0: no data from peer rank 2 within 10 s (torus2d all-reduce, col stage))\n")
    assert waited_for(log) == 2
    log.write_text("RuntimeError: rank 0: peer rank 3 did not receive our data within 10 s (gtopk)\n")
    assert waited_for(log) == 3
    log.write_text("ValueError: a bug\n")
    assert waited_for(log) is None and waited_for(tmp_path / "missing.log") is None
