"""flashsgd in the Hugging Face Transformers Trainer (flashsgd.integrations.transformers): 2 ranks on CPU
under torchrun.

A tiny BERT (2 layers, hidden 32, dropout on) built from its config, on synthetic sequences, in 7 DDP
buckets whose rebuilt layout (gradient-ready order: its classifier is registered before the encoder) is
not the first iteration's. A gTop-k run of 20 steps checkpoints every 5 steps keeping 3
(``save_total_limit``: checkpoint-5 goes, with its hook states); resumed from checkpoint-10 in fresh
processes (``resume_from_checkpoint=True`` in a copy, and the path of the original), every loss after the
resume, the final parameters and every rank's hook state (its iteration count, residuals, RNG) are the
uninterrupted run's bit for bit; the controls depart: the same resume without the bucket rebuild, and
from a checkpoint without the hook states (which warns, naming it); one process (no DDP) is an error
that says how to launch. The loss scaler reaches the hook: with a GradScaler forced onto the CPU, and
with ``fp16=True`` on one GPU (2 Gloo ranks sharing it; marked gpu), an overflow injected on rank 0 is
skipped by the GradScaler on both ranks (the scale halves) and leaves every hook memory bit-identical;
with the fused AdamW that transformers 5 uses by default too (GradScaler calls it on every step with
its ``found_inf``; the hook reads that on a non-finite step).
This file is also the job's script (torchrun runs it as ``__main__`` with a JSON list of runs).
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import warnings
from pathlib import Path

import pytest
from test_hook_step import _assert_same
from torchrun_jobs import job

REASON = "needs Hugging Face Transformers (pip install 'flashsgd[integrations]'; scripts/setup.sh installs it)"
WORLD = 2
STEPS, SAVE_EVERY, BATCH, SEQ, VOCAB = 20, 5, 8, 12, 64  # BATCH per rank
GTOPK = {"hook": "gtopk", "options": {"density": 0.05, "density_warmup": 0.5, "density_warmup_steps": 5}}
DDP_ARGS = {"ddp_find_unused_parameters": False, "ddp_bucket_cap_mb": 0.01}
"""Every parameter is used, so DDP rebuilds its buckets after the first step (the Trainer's default for a
PreTrainedModel, find_unused_parameters=True, never does); 10 kB buckets: 7 of them."""
OVERFLOW = {"hook": "gtopk", "options": {"density": 0.05, "start_iter": 2}, "overflow_at": 6,
            "args": {"max_steps": 8, "save_strategy": "no", "max_grad_norm": 0.0}}
"""An Inf in rank 0's gradient at step 6 of 8 (no clipping: GradScaler's own unscale finds it)."""
OPTIMIZERS = {"plain": "adamw_torch", "fused": "adamw_torch_fused"}
"""The Trainer's AdamW, and its fused kernel (transformers 5's default optimizer): GradScaler calls a
fused optimizer's ``step`` even on an overflow (the kernel skips the update itself)."""


# ------------------------------------------------------------------------- the job (torchrun) ---

def _data(n: int):
    """Sequences of VOCAB tokens; the label: is the first token in the lower half of the vocabulary."""
    import torch
    gen = torch.Generator().manual_seed(7)
    ids = torch.randint(0, VOCAB, (n, SEQ), generator=gen)
    labels = (ids[:, 0] < VOCAB // 2).long()
    return [{"input_ids": i, "labels": y} for i, y in zip(ids, labels)]


def _run(spec: dict) -> None:
    """One ``Trainer.train``; per-step losses, the final hook state and parameters to spec["out"]."""
    import torch
    from transformers import BertConfig, BertForSequenceClassification, Trainer, TrainingArguments

    from flashsgd.integrations.transformers import FlashsgdCallback

    if spec.get("gpu"):  # 2 Gloo ranks on one GPU: both are local rank 0 for the Trainer (device cuda:0)
        os.environ["LOCAL_RANK"] = "0"
    out, rank = Path(spec["out"]), int(os.environ.get("RANK", 0))
    out.mkdir(parents=True, exist_ok=True)
    torch.manual_seed(0)
    model = BertForSequenceClassification(BertConfig(
        vocab_size=VOCAB, hidden_size=32, num_hidden_layers=2, num_attention_heads=2, intermediate_size=64,
        max_position_embeddings=SEQ, num_labels=2))
    bert = model.bert
    del model.bert
    model.bert = bert  # registered after the classifier: DDP's first buckets are not its rebuilt ones
    args = TrainingArguments(**{
        "output_dir": str(out / "run"), "use_cpu": not spec.get("gpu"), "per_device_train_batch_size": BATCH,
        "max_steps": STEPS, "learning_rate": 1e-3, "warmup_steps": 4, "save_strategy": "steps",
        "save_steps": SAVE_EVERY, "save_total_limit": 3, "logging_steps": STEPS, "report_to": "none",
        "disable_tqdm": True, "seed": 0, "ddp_timeout": 120, "fp16": bool(spec.get("gpu")),
        "ddp_backend": "gloo" if spec.get("gpu") else None,  # CPU: Gloo (given in one process: an error)
        **DDP_ARGS, **spec.get("args", {})})
    losses: list[tuple[int, float]] = []

    class Recording(Trainer):
        def training_step(self, *args, **kwargs):
            loss = super().training_step(*args, **kwargs)
            losses.append((self.state.global_step, loss.item()))
            return loss

    trainer = Recording(model=model, args=args, train_dataset=_data(BATCH * WORLD * SAVE_EVERY * 2))
    if spec.get("cpu_scaler"):  # fp16's loss scaling forced onto the CPU (Accelerate has none there)
        trainer.accelerator.scaler = torch.amp.GradScaler("cpu")
    callback = FlashsgdCallback(spec["hook"], **spec.get("options", {})).attach(trainer)
    if spec.get("no_rebuild"):  # the control: DDP's first step after the resume in its first-iteration buckets
        callback._rebuild_before_first_step = lambda *args, **kwargs: None
    if spec.get("overflow_at") is not None:
        trainer.add_callback(_overflow_callback()(callback, trainer, spec["overflow_at"], out / f"overflow{rank}.json"))
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        try:
            trainer.train(resume_from_checkpoint=spec.get("resume"))
        except (TypeError, ValueError, RuntimeError) as exc:
            (out / f"error{rank}.txt").write_text(f"{type(exc).__name__}: {exc}")
            return
    (out / f"warnings{rank}.txt").write_text("\n".join(str(w.message) for w in caught))
    (out / f"losses{rank}.json").write_text(json.dumps(losses))
    torch.save(callback.state.state_dict(), out / f"hook{rank}.pt")
    if rank == 0:
        torch.save({k: v.clone() for k, v in trainer.model.state_dict().items()}, out / "params.pt")


def _overflow_callback():
    """The class (it needs transformers, imported in the job only)."""
    from transformers import TrainerCallback

    class Overflow(TrainerCallback):
        """At step ``at``, rank 0's gradient of one weight gets an Inf (the loss finite): GradScaler's
        overflow. Records the scale and the hook's memories before and after that step."""

        def __init__(self, flashsgd, trainer, at: int, path: Path):
            self.flashsgd, self.trainer, self.at, self.path, self.handle = flashsgd, trainer, at, path, None

        def on_step_begin(self, args, state, control, **kwargs):
            import torch
            import torch.distributed as dist
            if state.global_step != self.at:
                return
            self.scale = self.trainer.accelerator.scaler.get_scale()
            self.before = _floating(self.flashsgd.state.state_dict())
            weight = self.trainer.model.classifier.weight
            if dist.get_rank() == 0:
                self.handle = weight.register_hook(
                    lambda g: g.index_fill(0, torch.tensor([0], device=g.device), float("inf")))

        def on_step_end(self, args, state, control, **kwargs):
            import torch
            if state.global_step != self.at + 1:
                return
            if self.handle is not None:
                self.handle.remove()
            after = _floating(self.flashsgd.state.state_dict())
            self.path.write_text(json.dumps({
                "scale_before": self.scale, "scale_after": self.trainer.accelerator.scaler.get_scale(),
                "skipped": bool(self.trainer.accelerator.optimizer_step_was_skipped),
                "same": len(after) == len(self.before) and all(torch.equal(a.cpu(), b.cpu())
                                                               for a, b in zip(self.before, after))}))
    return Overflow


def _floating(state) -> list:
    """Every floating tensor of a nested state dict, cloned."""
    import torch
    if isinstance(state, torch.Tensor):
        return [state.clone()] if state.is_floating_point() else []
    items = state.values() if isinstance(state, dict) else state if isinstance(state, (list, tuple)) else ()
    return [t for item in items for t in _floating(item)]


def main(specs: list[dict]) -> None:
    import torch
    torch.set_num_threads(1)
    for spec in specs:
        _run(spec)


# ------------------------------------------------------------------------------- the tests ---

ENV = {"PYTHONWARNINGS": "ignore::DeprecationWarning,ignore::FutureWarning"}


def _records(out: Path) -> list[list[tuple]]:
    return [[tuple(r) for r in json.loads((out / f"losses{r}.json").read_text())] for r in range(WORLD)]


@pytest.fixture(scope="module")
def first_job(tmp_path_factory) -> Path:
    """One torchrun job: the uninterrupted gTop-k run, and the overflow runs with GradScaler forced
    onto the CPU (plain and fused AdamW)."""
    pytest.importorskip("transformers", reason=REASON)
    root = tmp_path_factory.mktemp("trainer")
    job(__file__, [{**GTOPK, "out": str(root / "full")}]
        + [{**OVERFLOW, "cpu_scaler": True, "out": str(root / f"overflow-{name}"),
            "args": {**OVERFLOW["args"], "optim": optim}} for name, optim in OPTIMIZERS.items()],
        root, WORLD, 180, ENV)
    return root


def test_trainer_gtopk_resume_is_bit_identical_and_a_missing_state_warns(first_job, tmp_path):
    import torch

    full = first_job / "full"
    run = full / "run"
    # checkpoints every 5 steps, the last 3 kept: checkpoint-5 went with its per-rank hook states
    assert sorted(p.name for p in run.iterdir()) == [f"checkpoint-{s}" for s in (10, 15, 20)]
    for step in (10, 15, 20):
        assert sorted(p.name for p in (run / f"checkpoint-{step}" / "flashsgd_hook").iterdir()) == \
            [f"rank{r}.pt" for r in range(WORLD)]
    half = STEPS // 2
    # fresh processes: resume_from_checkpoint=True (the last of a copy), the path in the original
    # run's folder (outside this run's output_dir); the controls: without the bucket rebuild, and
    # from a copy without the hook states
    for name in ("latest", "bare"):
        shutil.copytree(run / f"checkpoint-{half}", tmp_path / name / "run" / f"checkpoint-{half}")
    shutil.rmtree(tmp_path / "bare" / "run" / f"checkpoint-{half}" / "flashsgd_hook")
    original = str(run / f"checkpoint-{half}")
    job(__file__, [{**GTOPK, "out": str(tmp_path / "latest"), "resume": True},
                   {**GTOPK, "out": str(tmp_path / "path"), "resume": original},
                   {**GTOPK, "out": str(tmp_path / "unbuilt"), "resume": original, "no_rebuild": True},
                   {**GTOPK, "out": str(tmp_path / "bare"), "resume": str(tmp_path / "bare" / "run" / f"checkpoint-{half}")}],
        tmp_path, WORLD, 180, ENV)
    uninterrupted = _records(full)
    assert all(len(r) == STEPS for r in uninterrupted)
    for name in ("latest", "path"):
        for r, (a, b) in enumerate(zip(uninterrupted, _records(tmp_path / name))):
            assert b == a[half:], f"{name}, rank {r}: resumed losses differ: {a[half:]} vs {b}"
            hook_a, hook_b = (torch.load(d / f"hook{r}.pt", weights_only=False) for d in (full, tmp_path / name))
            assert hook_b["iter"] == hook_a["iter"] >= STEPS, (hook_a["iter"], hook_b["iter"])
            _assert_same(hook_a, hook_b, f"{name}: rank {r}'s hook state")
        p, q = torch.load(full / "params.pt"), torch.load(tmp_path / name / "params.pt")
        assert all(torch.equal(p[k], q[k]) for k in p), name
    # the controls depart: the first-iteration buckets after the resume; empty residuals (a warning)
    bare = tmp_path / "bare"
    assert f"the checkpoint {bare / 'run' / f'checkpoint-{half}'} has no flashsgd hook state" in \
        (bare / "warnings0.txt").read_text()
    assert "has no flashsgd hook state" not in (bare / "warnings1.txt").read_text()  # rank 0 only
    for name in ("unbuilt", "bare"):
        gap = max(abs(a[1] - b[1]) for a, b in zip(uninterrupted[0][half:], _records(tmp_path / name)[0]))
        print(f"gtopk resumed, {name}: max |dloss| = {gap:.3g} over {STEPS - half} steps")
        assert gap > 1e-5, name


@pytest.mark.slow  # 16 s (a fresh interpreter importing transformers)
def test_one_process_names_model_wrapped_and_the_launch(tmp_path):
    """A Trainer in one process (python, not torchrun): model_wrapped is the plain model."""
    pytest.importorskip("transformers", reason=REASON)
    code = (f"import sys; sys.path.insert(0, {str(Path(__file__).parent)!r})\n"
            "import test_integrations_transformers as t\n"
            f"t._run({{'hook': 'ring', 'out': {str(tmp_path)!r}}})\n")
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120, cwd=tmp_path,
                          env={**os.environ, **ENV})
    assert done.returncode == 0, done.stderr[-3000:]
    error = (tmp_path / "error0.txt").read_text()
    assert error.startswith("TypeError: FlashsgdCallback('ring') needs") and "trainer.model_wrapped is " \
        "transformers.models.bert.modeling_bert.BertForSequenceClassification" in error, error
    assert "torchrun --nproc-per-node N" in error and "use_cpu=True" in error, error


def test_callback_checks_its_options_and_needs_attach():
    pytest.importorskip("transformers", reason=REASON)
    from flashsgd.integrations.transformers import FlashsgdCallback

    with pytest.raises(ValueError, match="density_warmup=0.25 needs its length: density_warmup_epochs"):
        FlashsgdCallback("gtopk", density=0.01, density_warmup=0.25)
    with pytest.raises(ValueError, match="unknown option"):
        FlashsgdCallback("ring", density=0.01)
    with pytest.raises(RuntimeError, match=r"attach\(trainer\)"):
        FlashsgdCallback("ring").on_train_begin(None, None, None)


def _overflow_reports(out: Path) -> list[dict]:
    return [json.loads((out / f"overflow{r}.json").read_text()) for r in range(WORLD)]


def _skipped_and_put_back(reports: list[dict], fused: bool = False) -> bool:
    """On every rank: the step skipped, the scale halved, every hook memory bit-identical across it.
    ``fused``: Accelerate's ``optimizer_step_was_skipped`` is False for a fused optimizer's skipped
    step (GradScaler calls its ``step``, whose kernel skips; Accelerate sees the call), so the halved
    scale is the evidence there."""
    for report in reports:
        assert report["scale_after"] == report["scale_before"] / 2, report
    return all((report["skipped"] or fused) and report["same"] for report in reports)


def test_cpu_loss_scaler_overflow_is_skipped_and_leaves_the_hook_memories(first_job):
    """The callback hands ``trainer.accelerator.scaler`` to the hook (here a GradScaler forced onto
    the CPU: the Trainer's fp16 needs a GPU): an overflow on rank 0 at step 6 is skipped on both
    ranks, the scale halves, every hook memory is as it was."""
    reports = _overflow_reports(first_job / "overflow-plain")
    assert _skipped_and_put_back(reports), reports


def test_cpu_loss_scaler_overflow_with_the_fused_default_optimizer(first_job):
    reports = _overflow_reports(first_job / "overflow-fused")
    assert _skipped_and_put_back(reports, fused=True), reports


@pytest.mark.gpu
def test_fp16_overflow_is_skipped_and_leaves_the_hook_memories(tmp_path):
    """``fp16=True`` on one GPU (2 Gloo ranks on it): an Inf in rank 0's gradient at step 6 is
    GradScaler's overflow on both ranks: the step is skipped, the scale halves, every hook memory is
    as before (plain AdamW and the fused default)."""
    pytest.importorskip("transformers", reason=REASON)
    specs = [{**OVERFLOW, "gpu": True, "out": str(tmp_path / name), "args": {**OVERFLOW["args"], "optim": optim}}
             for name, optim in OPTIMIZERS.items()]
    job(__file__, specs, tmp_path, WORLD, 300, ENV)
    plain, fused = (_overflow_reports(tmp_path / name) for name in OPTIMIZERS)
    assert _skipped_and_put_back(plain), plain
    assert _skipped_and_put_back(fused, fused=True), fused


if __name__ == "__main__":
    main(json.loads(sys.argv[1]))
