"""What every trainer integration shares (issue 32), in one process, without Lightning or Accelerate:
a planner choice -> hook, options and DDP bucket size; a density warm-up without its length is an
error; register_hook's run-length check; RecipeLR stepped any number of times per optimizer step;
``flashsgd plan --model MOD:FN`` finds MOD in the working directory."""

from __future__ import annotations

import json
import uuid
import warnings

import pytest
import torch

from flashsgd.comm.hooks import hook_options, register_hook
from flashsgd.integrations.plan import comm_from_plan, warmup_in_steps
from flashsgd.integrations.recipe import recipe_optimizer

WARMUP_ERROR = r"density_warmup=0.25 needs density_warmup_steps >= 1 .* no warm-up at all"


def test_density_warmup_without_steps_is_an_error_not_a_silent_no_op():
    with pytest.raises(ValueError, match=WARMUP_ERROR):
        hook_options("gtopk", density=0.01, density_warmup=0.25)
    with pytest.raises(ValueError, match=WARMUP_ERROR):  # a planner choice passed on as it is
        hook_options("gtopk", **{"algorithm": "gtopk", "density": 0.01, "density_warmup": 0.25})
    with pytest.raises(ValueError, match=WARMUP_ERROR):  # checked before the model's type
        register_hook(torch.nn.Linear(2, 2), "gtopk", density=0.01, density_warmup=0.25)
    options = hook_options("gtopk", density=0.01, density_warmup=0.25, density_warmup_steps=10)
    assert options.density_at(0) == 0.25 and options.density_at(10) == 0.01
    assert hook_options("ring", density_warmup=0.25).__class__.__name__ == "DenseOptions"  # not ring's option


def test_register_hook_runs_the_trainers_step_count_check():
    model = torch.nn.Linear(2, 2)
    with pytest.warns(UserWarning, match=r"gtopk at density 0.01 over 35 steps can send each gradient entry at "
                                         r"most 0.33 times .* use >= 2002 steps or a density >= 0.61"):
        with pytest.raises(TypeError):  # the warning comes first; then: not a DDP model
            register_hook(model, "gtopk", density=0.01, total_steps=35)
    with pytest.raises(ValueError, match=r"over total_steps=10: the density warm-up lasts 20 steps, longer than "
                                         r"the run \(10 steps\): shorten density_warmup_steps"):
        register_hook(model, "gtopk", density=0.01, density_warmup=0.25, density_warmup_steps=20, total_steps=10)
    with pytest.raises(ValueError, match="total_steps must be the run's number of optimizer steps"):
        register_hook(model, "ring", total_steps=0)
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # dense, or enough steps: no warning
        for name, steps in (("ring", 10), ("gtopk", 4000)):
            with pytest.raises(TypeError, match=r"wrap it: DDP\(model\)"):
                register_hook(model, name, total_steps=steps, **({"density": 0.01} if name == "gtopk" else {}))


def test_plan_choice_gives_hook_options_warmup_steps_and_bucket(tmp_path):
    choice = {"algorithm": "gtopk", "bucket_mb": 128.0, "grid": None, "density": 0.001, "node_split": None,
              "matrix_approximation_rank": None, "label": "gtopk density 0.001, 128 MiB buckets",
              "density_warmup": 0.25}
    comm = comm_from_plan({"gpus": 32, "choice": choice}, total_steps=1000, steps_per_epoch=125)
    assert comm.hook == "gtopk" and comm.ddp_kwargs == {"bucket_cap_mb": 128.0}
    # DGC's warm-up scaled to the run, as flashsgd train derives it: min(4 epochs, half the run)
    assert comm.options == {"density": 0.001, "density_warmup": 0.25, "density_warmup_steps": 500}
    assert comm.warnings == ()  # coverage 22.7 >= 20
    short = comm_from_plan(choice, total_steps=200, steps_per_epoch=10)
    assert short.options["density_warmup_steps"] == 40 and "at most" in short.warnings[0]
    path = tmp_path / "plan.json"
    path.write_text(json.dumps({"choice": {"algorithm": "torus2d", "bucket_mb": 4.0, "grid": [2, 4],
                                           "density": None}}))
    torus = comm_from_plan(path, total_steps=100, steps_per_epoch=10)
    assert (torus.hook, torus.options, torus.bucket_cap_mb) == ("torus2d", {"grid": "2x4"}, 4.0)
    with pytest.raises(ValueError, match="needs 'algorithm' and 'bucket_mb'"):
        comm_from_plan({"density": 0.01}, total_steps=100, steps_per_epoch=10)
    with pytest.raises(ValueError, match="not a readable `flashsgd plan --json` file"):
        comm_from_plan(tmp_path / "missing.json", total_steps=100, steps_per_epoch=10)


def test_warmup_in_epochs_becomes_steps():
    assert warmup_in_steps("gtopk", {"density": 0.01}, 20, 1.5) == {
        "density": 0.01, "density_warmup": 0.25, "density_warmup_steps": 30}
    with pytest.raises(ValueError, match="has no density warm-up"):
        warmup_in_steps("ring", {}, 20, 1.0)
    with pytest.raises(ValueError, match="needs the run's steps per epoch"):
        warmup_in_steps("gtopk", {}, None, 1.0)


def test_recipe_lr_is_the_same_however_often_it_is_stepped():
    runs = []
    for calls in (1, 2, 5):  # Lightning: once per step; Accelerate on P processes: P times
        torch.manual_seed(0)
        model = torch.nn.Linear(4, 2)
        optimizer, scheduler, setup = recipe_optimizer(model, "goyal", global_batch=512, num_samples=5120,
                                                       epochs=4)
        lrs = []
        for _ in range(setup.total_steps()):
            lrs.append(optimizer.param_groups[0]["lr"])
            model(torch.ones(1, 4)).sum().backward()
            optimizer.step()
            optimizer.zero_grad()
            for _ in range(calls):
                scheduler.step()
        runs.append(lrs)
        assert lrs == [setup.lr_at_step(s) for s in range(setup.total_steps())]
    assert runs[0] == runs[1] == runs[2]
    state = scheduler.state_dict()
    assert state["optimizer_steps"] == setup.total_steps() and "_counter" not in state
    _, again, _ = recipe_optimizer(torch.nn.Linear(4, 2), "goyal", global_batch=512, num_samples=5120, epochs=4)
    again.load_state_dict(state)
    assert again.optimizer_steps == setup.total_steps()


def test_plan_model_spec_is_found_in_the_working_directory(tmp_path, monkeypatch):
    from flashsgd.sim.workload import get_workload

    name = f"mymodels_{uuid.uuid4().hex[:8]}"
    (tmp_path / f"{name}.py").write_text("import torch\n\ndef mlp():\n    return torch.nn.Sequential("
                                         "torch.nn.Linear(32, 64), torch.nn.ReLU(), torch.nn.Linear(64, 10))\n")
    monkeypatch.chdir(tmp_path)
    monkeypatch.setattr("sys.path", [p for p in __import__("sys").path if p not in ("", str(tmp_path))])
    assert get_workload(f"{name}:mlp").num_params == 32 * 64 + 64 + 64 * 10 + 10
    with pytest.raises(ValueError, match=r"No module named 'nomodule_x'; modules are looked up in the working "
                                         r"directory"):
        get_workload("nomodule_x:mlp")


def test_setup_refuses_an_extra_whose_plan_brings_another_torch():
    """scripts/pip_plan.py: setup.sh installs the integrations extra only from a plan without torch."""
    import subprocess
    import sys
    from pathlib import Path

    script = Path(__file__).resolve().parents[1] / "scripts" / "pip_plan.py"

    def plan(*pins: str) -> str:
        return json.dumps({"install": [{"metadata": {"name": p.split("==")[0], "version": p.split("==")[1]}}
                                       for p in pins]})

    ok = subprocess.run([sys.executable, str(script), "--skip", "flashsgd"], capture_output=True, text=True,
                        input=plan("flashsgd==0.1.0", "lightning==2.6.6", "lightning_utilities==0.15.3"))
    assert ok.returncode == 0 and ok.stdout.split() == ["lightning==2.6.6", "lightning_utilities==0.15.3"]
    for bad in ("torch==2.9.0", "nvidia-cublas-cu12==12.8.4.1", "triton==3.5.0", "torchvision==0.26.0"):
        refused = subprocess.run([sys.executable, str(script)], capture_output=True, text=True,
                                 input=plan("lightning==2.6.6", bad))
        assert refused.returncode == 1 and refused.stdout == "" and bad in refused.stderr
    assert subprocess.run([sys.executable, str(script)], capture_output=True, text=True,
                          input="not json").returncode == 2


def test_docs_show_the_integration_examples_verbatim():
    import re
    from pathlib import Path

    root = Path(__file__).resolve().parents[1]
    blocks = re.findall(r"```python\n(.*?)```", (root / "docs" / "integrations.md").read_text(), flags=re.S)
    for example in ("lightning_gtopk.py", "accelerate_gtopk.py"):
        assert (root / "examples" / example).read_text() in blocks, example
    assert "(docs/integrations.md)" in (root / "README.md").read_text()
