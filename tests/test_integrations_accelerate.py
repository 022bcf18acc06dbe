"""flashsgd in Hugging Face Accelerate (flashsgd.integrations.accelerate): 2 ranks on CPU under torchrun.

Targets (issue 32): a dense flashsgd hook matches Accelerate's own DDP all-reduce (losses within 1e-6
over 20 steps); a gTop-k run stopped at mid-run (``save_state``) and resumed (``load_state``) in fresh
processes is bit-identical to the uninterrupted run; the recipe's LR is right with the scheduler
through ``accelerator.prepare`` (stepped ``num_processes`` times per step there) and a plain flashsgd
``lambda_lr`` through it is refused; the example runs. This file is also the job's script (torchrun runs
it as ``__main__`` with a JSON list of runs).
"""

from __future__ import annotations

import json
import re
import subprocess
import sys
from pathlib import Path

import pytest
from torchrun_jobs import flashsgd_lines, job, torchrun

REASON = "needs Hugging Face Accelerate (pip install 'flashsgd[integrations]'; scripts/setup.sh installs it)"
ROOT = Path(__file__).resolve().parents[1]
WORLD = 2
STEPS_PER_EPOCH, EPOCHS, BATCH = 10, 2, 8  # BATCH per process


# ------------------------------------------------------------------------- the job (torchrun) ---

def _run(spec: dict) -> None:
    """One training loop of a small MLP; per-step losses and LRs (and parameters) to spec["out"]."""
    import torch
    from accelerate import Accelerator

    from flashsgd.integrations.accelerate import attach_hook, recipe_optimizer
    from flashsgd.optim.schedules import lambda_lr

    accelerator = Accelerator(cpu=not spec.get("gpu"), mixed_precision="fp16" if spec.get("fp16") else "no")
    world, rank = accelerator.num_processes, accelerator.process_index
    n = STEPS_PER_EPOCH * BATCH * world
    gen = torch.Generator().manual_seed(7)
    x = torch.randn(n, 32, generator=gen)
    y = (x @ torch.randn(32, 10, generator=gen)).argmax(1)
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(32, 64), torch.nn.ReLU(), torch.nn.Linear(64, 10))
    optimizer, scheduler, setup = recipe_optimizer(model, "goyal", global_batch=BATCH * world, num_samples=n,
                                                   epochs=EPOCHS)
    if spec.get("plain_lambda_lr"):
        scheduler = lambda_lr(optimizer, setup.schedule, setup.table, n)
    loader = torch.utils.data.DataLoader(torch.utils.data.TensorDataset(x, y), batch_size=BATCH)
    model, optimizer, loader, scheduler = accelerator.prepare(model, optimizer, loader, scheduler)
    out = Path(spec["out"])
    if spec.get("load_first"):  # the control: the hook attached after load_state gets no state back
        accelerator.load_state(spec["resume"])
    if spec["hook"] != "accelerate":
        try:
            attach_hook(accelerator, model, spec["hook"], total_steps=setup.total_steps(), **spec.get("options", {}))
        except ValueError as exc:
            (out / f"error{rank}.txt").write_text(str(exc))
            return
    start, stop = spec.get("start", 0), spec.get("stop", STEPS_PER_EPOCH * EPOCHS)
    if spec.get("resume") and not spec.get("load_first"):
        accelerator.load_state(spec["resume"])
    records, step, seen = [], start, {}
    while step < stop:
        for xb, yb in loader:  # an epoch: this process's shard, in order (a resume starts at an epoch)
            if step >= stop:
                break
            lr = optimizer.param_groups[0]["lr"]
            loss = setup.loss_fn(model(xb), yb)
            if step == spec.get("overflow_at"):  # fp16: finite in fp32, its fp16 gradients overflow
                loss = loss * 1e30
                seen["before"] = _hook_memories(model)
                seen["params"] = [p.detach().clone() for p in model.parameters()]
            accelerator.backward(loss)
            optimizer.step()
            if step == spec.get("overflow_at"):
                after = _hook_memories(model)
                seen["same"] = seen["before"].keys() == after.keys() and all(
                    torch.equal(seen["before"][k], after[k]) for k in after)
                seen["stepped"] = not all(torch.equal(a, b) for a, b in zip(seen.pop("params"), model.parameters()))
                del seen["before"]
            scheduler.step()  # prepared: Accelerate steps it num_processes times
            optimizer.zero_grad()
            records.append((step, loss.item(), lr))
            step += 1
    if spec.get("save"):
        accelerator.save_state(spec["save"])
    (out / f"losses{rank}.json").write_text(json.dumps(records))
    if spec.get("fp16"):
        seen["scale"] = accelerator.scaler.get_scale()
        (out / f"report{rank}.json").write_text(json.dumps(seen))
    if rank == 0:
        torch.save({k: v.clone() for k, v in accelerator.unwrap_model(model).state_dict().items()}, out / "params.pt")


def _hook_memories(model) -> dict:
    """The memories of the hook on ``model`` (after ``state_dict()``: a finished step is closed)."""
    from flashsgd.comm.hooks import hook_state_of

    state = hook_state_of(model)
    state.state_dict()
    return {f"{kind}{k}": v.clone() for kind, d in (("r", state.residuals), ("v", state.velocities),
                                                      ("n", state.layer_norms)) for k, v in d.items()}


def main(specs: list[dict]) -> None:
    import torch
    torch.set_num_threads(1)
    for spec in specs:
        Path(spec["out"]).mkdir(parents=True, exist_ok=True)
        _run(spec)


# ------------------------------------------------------------------------------- the tests ---

ENV = {"ACCELERATE_USE_CPU": "1"}


def _torchrun(args: list[str], timeout: float, cwd: Path) -> subprocess.CompletedProcess:
    return torchrun(args, timeout, cwd, WORLD, ENV)


def _job(tmp_path: Path, specs: list[dict], timeout: float = 180) -> subprocess.CompletedProcess:
    return job(__file__, specs, tmp_path, WORLD, timeout, ENV)


def _records(out: Path) -> list[list[tuple]]:
    return [[tuple(r) for r in json.loads((out / f"losses{r}.json").read_text())] for r in range(WORLD)]


def test_accelerate_dense_matches_and_gtopk_resume_is_bit_identical(tmp_path):
    pytest.importorskip("accelerate", reason=REASON)
    import torch

    from flashsgd.optim import RECIPES, prepare

    d = {k: tmp_path / k for k in ("native", "ring", "full", "half", "resumed", "plain")}
    gtopk = {"hook": "gtopk", "options": {"density": 0.05, "density_warmup": 0.5, "density_warmup_steps": 5}}
    first = _job(tmp_path, [{"hook": "accelerate", "out": str(d["native"])},
                            {"hook": "ring", "out": str(d["ring"])},
                            {**gtopk, "out": str(d["full"])},
                            {**gtopk, "out": str(d["half"]), "stop": STEPS_PER_EPOCH, "save": str(d["half"] / "state")},
                            {**gtopk, "out": str(d["plain"]), "plain_lambda_lr": True}])
    # dense: flashsgd's ring == Accelerate's all-reduce
    native, ring = _records(d["native"]), _records(d["ring"])
    assert all(len(r) == STEPS_PER_EPOCH * EPOCHS for r in native)
    worst = max(abs(a[1] - b[1]) for rn, rr in zip(native, ring) for a, b in zip(rn, rr))
    print(f"dense ring vs Accelerate's all-reduce, {WORLD} ranks x 20 steps: max |dloss| = {worst:.3g}")
    assert worst <= 1e-6
    # the recipe's LR at every step, though Accelerate stepped the prepared scheduler twice per step
    model = torch.nn.Linear(32, 10)
    setup = prepare(RECIPES["goyal"], model, BATCH * WORLD, STEPS_PER_EPOCH * BATCH * WORLD, epochs=EPOCHS)
    assert [r[2] for r in native[0]] == [setup.lr_at_step(s) for s in range(STEPS_PER_EPOCH * EPOCHS)]
    # a plain flashsgd lambda_lr through prepare: refused, naming the remedy
    assert "Accelerate steps it 2 times per optimizer step" in (d["plain"] / "error0.txt").read_text()
    # each process's hook state in its own file of the save_state directory
    assert sorted(p.name for p in (d["half"] / "state" / "flashsgd_hook").iterdir()) == ["rank0.pt", "rank1.pt"]
    assert first.stderr.count("can send each gradient entry at most") == 1  # rank 0 only (Python shows it once)

    resume = {**gtopk, "resume": str(d["half"] / "state"), "start": STEPS_PER_EPOCH}
    second = _job(tmp_path, [{**resume, "out": str(d["resumed"])},
                             {**resume, "out": str(tmp_path / "bare"), "load_first": True}])
    # attach_hook after load_state: told that the hook state was not restored, and what to do
    assert second.stderr.count("attach_hook('gtopk') after the optimizer already has state") == 1, second.stderr[-3000:]
    assert "call attach_hook before accelerator.load_state" in second.stderr
    full = _records(d["full"])
    for r, (a, b) in enumerate(zip(full, _records(d["resumed"]))):
        assert b == a[STEPS_PER_EPOCH:], f"rank {r}: resumed steps differ: {a[STEPS_PER_EPOCH:]} vs {b}"
    # the control: the same resume without the per-rank residuals departs from the uninterrupted run
    bare = _records(tmp_path / "bare")[0]
    gap = max(abs(a[1] - b[1]) for a, b in zip(full[0][STEPS_PER_EPOCH:], bare))
    print(f"gtopk resumed without the hook state: max |dloss| = {gap:.3g} over 10 steps")
    assert gap > 1e-4
    p, q = torch.load(d["full"] / "params.pt"), torch.load(d["resumed"] / "params.pt")
    assert all(torch.equal(p[k], q[k]) for k in p)
    print(f"gtopk {WORLD} ranks: steps 10-19 after load_state bit-identical (losses, LRs, parameters)")


@pytest.mark.gpu
def test_accelerate_fp16_overflow_is_skipped_with_the_memories_untouched(tmp_path):
    """One GPU (NCCL), ``mixed_precision="fp16"``: ``attach_hook`` hands ``accelerator.scaler`` to
    the hook (no extra line); an overflow at step 6 is skipped by Accelerate's GradScaler (the
    parameters stay, the scale halves against the run without it), the hook's memories are bit for
    bit as before it, and the runs end within 0.1 of each other."""
    pytest.importorskip("accelerate", reason=REASON)
    gtopk = {"hook": "gtopk", "options": {"density": 0.05, "start_iter": 2, "layer_trust": True},
             "gpu": True, "fp16": True}
    job(__file__, [{**gtopk, "out": str(tmp_path / "clean")}, {**gtopk, "out": str(tmp_path / "over"), "overflow_at": 6}],
        tmp_path, 1, 300, {})
    clean, over = (json.loads((tmp_path / d / "report0.json").read_text()) for d in ("clean", "over"))
    assert over["same"] and not over["stepped"], over
    assert over["scale"] == clean["scale"] / 2, (over, clean)
    a, b = (json.loads((tmp_path / d / "losses0.json").read_text())[-1][1] for d in ("clean", "over"))
    assert abs(a - b) <= 0.1, (a, b)


def test_accelerate_example_runs(tmp_path):
    pytest.importorskip("accelerate", reason=REASON)
    example = ROOT / "examples" / "accelerate_gtopk.py"
    done = _torchrun([str(example), str(tmp_path / "state")], 180, tmp_path)
    assert done.returncode == 0, done.stderr[-4000:]
    losses = [float(v) for v in re.findall(r"loss ([0-9.]+)", done.stdout)]
    assert len(losses) >= 2 and losses[-1] < losses[0], done.stdout
    assert sorted(p.name for p in (tmp_path / "state" / "flashsgd_hook").iterdir()) == ["rank0.pt", "rank1.pt"]
    assert len(flashsgd_lines(example)) <= 3, flashsgd_lines(example)


def test_attach_hook_on_one_process_names_the_launch(tmp_path):
    """A single process: prepare() returns the plain module; the error names Accelerate's remedy."""
    pytest.importorskip("accelerate", reason=REASON)
    code = ("import torch; from accelerate import Accelerator\n"
            "from flashsgd.integrations.accelerate import attach_hook\n"
            "acc = Accelerator(cpu=True); model = acc.prepare(torch.nn.Linear(4, 2))\n"
            "try:\n    attach_hook(acc, model, 'ring')\nexcept TypeError as e:\n    print(e)\n")
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120, cwd=tmp_path)
    assert done.returncode == 0, done.stderr[-3000:]
    assert "accelerate launch --num_processes N" in done.stdout and "DDP(model)" not in done.stdout, done.stdout


if __name__ == "__main__":
    main(json.loads(sys.argv[1]))
