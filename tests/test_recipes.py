"""Recipes: presets, the MNIST-1D-tuned variant, plan building, model tweaks, MNIST-1D data/model and
a tiny recipe bench run."""

import argparse
import dataclasses
import json
import warnings

import numpy as np
import pytest
import torch
from torch import nn

from flashsgd.bench import recipe as bench_recipe
from flashsgd.optim import LARS, RECIPES, Recipe, RecipeWarning, lambda_lr, prepare, tuned_variant
from flashsgd.optim.plan import apply_model_tweaks, build_batch_table, build_loss, build_optimizer
from flashsgd.optim.schedules import epoch_at_step, lr_at
from flashsgd.train.data.mnist1d import MNIST1DCNN, load_mnist1d


class _Block(nn.Module):
    def __init__(self):
        super().__init__()
        self.conv = nn.Conv1d(4, 4, 3, padding=1, bias=False)
        self.last_bn = nn.BatchNorm1d(4)

    def forward(self, x):
        return x + self.last_bn(self.conv(x))


def _model():
    return nn.Sequential(nn.Conv1d(1, 4, 3, padding=1), nn.BatchNorm1d(4), _Block(), _Block(),
                         nn.Flatten(), nn.Linear(4 * 8, 10))


def test_registry_presets_and_sources():
    assert {"goyal", "sony", "fujitsu"} <= set(RECIPES.names())
    for name in ("goyal", "sony", "fujitsu"):
        r = RECIPES.get(name)
        assert r.name == name and r.source and r.exclude_bias_and_norm
    with pytest.raises(ValueError, match="unknown recipe 'goyl'"):
        RECIPES.get("goyl")
    g, s, f = RECIPES.get("goyal"), RECIPES.get("sony"), RECIPES.get("fujitsu")
    assert (g.optimizer, g.nesterov, g.lr_per_ref, g.ref_batch, g.warmup_epochs, g.decay) == (
        "sgd", True, 0.1, 256, 5.0, "step")
    assert g.zero_init_last_bn and g.milestones == (30.0, 60.0, 80.0)
    assert s.label_smoothing == 0.1 and len(s.batch_fractions) == 2
    assert (f.optimizer, f.decay, f.power, f.label_smoothing, f.trust_coefficient) == ("lars", "poly", 2.0, 0.1, 0.0025)


# The MNIST-1D values the trainer overlaid on the fujitsu preset before they became a registered
# recipe (train/config/__init__.py PROXY_TUNING, warmup given for 15 epochs; lr_per_256 is now lr_per_ref).
PROXY_TUNING_FUJITSU = dict(lr_per_ref=0.1, momentum=0.9, nesterov=True, weight_decay=5e-4,
                            warmup_epochs=3.0, label_smoothing=0.0, trust_coefficient=0.02,
                            power=1.0, bn_momentum=0.3)


def _overlaid_fujitsu(epochs):
    """The trainer's former path: the preset rescaled, then the proxy values (warmup rescaled)."""
    tuned = dict(PROXY_TUNING_FUJITSU)
    tuned["warmup_epochs"] *= epochs / 15.0  # as the trainer did: warmup * (epochs / PROXY_EPOCHS)
    return dataclasses.replace(RECIPES["fujitsu"].for_epochs(epochs), **tuned)


def _fields(recipe, skip=("name", "source")):
    return {f.name: getattr(recipe, f.name) for f in dataclasses.fields(recipe) if f.name not in skip}


def _optimizer_hparams(opt):
    return [(type(opt), {k: v for k, v in g.items() if k != "params"}, len(g["params"]))
            for g in opt.param_groups]


@pytest.mark.parametrize("epochs", [15, 15.0, 3, 7.5, 20, 90])
def test_fujitsu_mnist1d_is_the_former_proxy_tuning(epochs):
    old, new = _overlaid_fujitsu(epochs), RECIPES["fujitsu-mnist1d"].for_epochs(epochs)
    assert _fields(new) == _fields(old)  # every number, bit for bit
    m_old, m_new = MNIST1DCNN(channels=8), MNIST1DCNN(channels=8)
    p_old = prepare(old, m_old, 4096, 32000, epochs=epochs)
    p_new = prepare(RECIPES["fujitsu-mnist1d"], m_new, 4096, 32000, epochs=epochs)
    assert (p_new.schedule, p_new.table, p_new.epochs) == (p_old.schedule, p_old.table, p_old.epochs)
    assert _optimizer_hparams(p_new.optimizer) == _optimizer_hparams(p_old.optimizer)
    assert p_new.loss_fn.label_smoothing == p_old.loss_fn.label_smoothing == 0.0
    assert p_new.model_tweaks == p_old.model_tweaks == ["bn_momentum=0.3 on 3 BatchNorm layers"]
    assert [p_new.lr_at_step(s) for s in range(p_new.total_steps())] == \
        [p_old.lr_at_step(s) for s in range(p_old.total_steps())]


def test_fujitsu_mnist1d_is_registered_with_its_sources():
    r = RECIPES["fujitsu-mnist1d"]
    assert (r.name, r.epochs, r.optimizer) == ("fujitsu-mnist1d", 15.0, "lars")
    assert "docs/recipe.md" in r.source and "MNIST-1D" in r.source
    assert tuned_variant("fujitsu", "mnist1d") == "fujitsu-mnist1d"
    assert tuned_variant("goyal", "mnist1d") == "goyal"
    assert tuned_variant("fujitsu", "imagefolder") == "fujitsu"


def test_bench_full_recipe_reads_the_registered_variant():
    # bench recipe's former FULL table, written out (its milestones were the unused default)
    former = Recipe(name="full", optimizer="lars", lr_per_ref=0.1, momentum=0.9, nesterov=True,
                    weight_decay=5e-4, exclude_bias_and_norm=True, epochs=15.0, warmup_epochs=3.0,
                    decay="poly", power=1.0, label_smoothing=0.0, trust_coefficient=0.02, bn_momentum=0.3)
    assert bench_recipe.FULL.name == "full"
    assert _fields(bench_recipe.FULL) == _fields(RECIPES["fujitsu-mnist1d"])
    assert _fields(bench_recipe.FULL, skip=("name", "source", "milestones")) == \
        _fields(former, skip=("name", "source", "milestones"))
    assert bench_recipe.FULL.schedule() == former.schedule()


def test_bench_full_recipe_trains_as_the_former_overlay():
    x, y, xt, yt = load_mnist1d(num_samples=1000)
    data = (x, y, xt, yt)
    a = bench_recipe.train_once(data, bench_recipe.FULL, 256, epochs=2, seed=0, channels=8)
    b = bench_recipe.train_once(data, _overlaid_fujitsu(2), 256, epochs=2, seed=0, channels=8)
    assert (a["final_train_loss"], a["acc_per_epoch"]) == (b["final_train_loss"], b["acc_per_epoch"])


def test_bench_recipe_trains_with_the_trainers_step():
    import ast
    from pathlib import Path

    tree = ast.parse(Path(bench_recipe.__file__).read_text())
    calls = {getattr(n.func, "id", getattr(n.func, "attr", ""))
             for n in ast.walk(tree) if isinstance(n, ast.Call)}
    assert {"TrainStep", "ShardedSampler", "lr_at"} <= calls
    assert not calls & {"backward", "set_lr", "randperm"}  # no loop, data order or schedule of its own


def test_build_optimizer_and_loss():
    model = _model()
    opt = build_optimizer(RECIPES.get("goyal"), model, global_batch=8192)
    assert isinstance(opt, torch.optim.SGD) and opt.param_groups[0]["nesterov"]
    assert opt.param_groups[0]["lr"] == pytest.approx(0.1)  # Goyal warmup starts at the 256-batch LR
    assert [g["weight_decay"] for g in opt.param_groups] == [1e-4, 0.0]
    lars = build_optimizer(RECIPES.get("fujitsu"), model, global_batch=4096)
    assert isinstance(lars, LARS) and lars.param_groups[0]["trust_coefficient"] == 0.0025
    assert [g["lars"] for g in lars.param_groups] == [True, False]
    assert build_loss(RECIPES.get("sony")).label_smoothing == 0.1


def test_for_epochs_rescales_lengths():
    g = RECIPES.get("goyal").for_epochs(9)
    assert g.epochs == 9 and g.warmup_epochs == pytest.approx(0.5)
    assert g.milestones == pytest.approx((3.0, 6.0, 8.0))
    s = RECIPES.get("sony").for_epochs(15)
    assert s.batch_fractions == ((0, 0.5), (5, 1.0))
    with pytest.raises(ValueError, match="epochs"):
        g.for_epochs(0)


def test_sony_batch_control_follows_scaling_rule():
    r = RECIPES.get("sony")
    table = build_batch_table(r, 8192)
    assert table.rows == ((0, 4096), (30, 8192))
    peak_before = lr_at(29.0, r.schedule(), table)
    peak_after = lr_at(30.0, r.schedule(), table)
    assert peak_after / peak_before == pytest.approx(2.0 * ((1 - 25 / 85) / (1 - 24 / 85)) ** 2)


def test_zero_init_last_bn():
    model = _model()
    assert apply_model_tweaks(RECIPES.get("goyal"), model) == ["zero gamma of 2 last BNs"]
    assert torch.count_nonzero(model[2].last_bn.weight) == 0 and torch.count_nonzero(model[1].weight) == 4
    assert apply_model_tweaks(RECIPES.get("fujitsu"), _model()) == []


def test_bn_momentum_tweak():
    model = _model()
    apply_model_tweaks(RECIPES.get("fujitsu"), model)  # bn_momentum None: torch default kept
    assert [m.momentum for m in model.modules() if isinstance(m, nn.BatchNorm1d)] == [0.1] * 3
    plan = prepare(dataclasses.replace(RECIPES.get("fujitsu"), bn_momentum=0.3), model, 64, 320, epochs=90)
    assert [m.momentum for m in model.modules() if isinstance(m, nn.BatchNorm1d)] == [0.3] * 3
    assert "bn_momentum=0.3" in plan.describe()
    assert plan.model_tweaks == ["bn_momentum=0.3 on 3 BatchNorm layers"]
    bn = model[1]
    bn.reset_running_stats()
    x = torch.randn(16, 4, 8) * 2 + 5
    bn(x)  # running_mean = (1 - 0.3) * 0 + 0.3 * batch mean
    assert torch.allclose(bn.running_mean, 0.3 * x.mean((0, 2)), atol=1e-6)


def test_plan_lr_and_batch_per_step():
    model = _model()
    r = dataclasses.replace(RECIPES.get("sony").for_epochs(6), batch_fractions=((0, 0.5), (2, 1.0)))
    plan = prepare(r, model, global_batch=64, num_samples=320)
    assert [plan.batch_at(e) for e in range(6)] == [32, 32, 64, 64, 64, 64]
    assert plan.total_steps() == 2 * 10 + 4 * 5
    for step in (0, 7, 20, 25, 39):
        assert plan.set_lr(step) == pytest.approx(lr_at(epoch_at_step(step, plan.table, 320), plan.schedule, plan.table))
        assert all(g["lr"] == plan.lr_at_step(step) for g in plan.optimizer.param_groups)
    assert "recipe=sony" in plan.describe()


@pytest.mark.parametrize("kwargs, name", [
    (dict(lr_per_ref=-1.0), "lr_per_ref"),
    (dict(lr_per_ref=float("nan")), "lr_per_ref"),
    (dict(ref_batch=0), "ref_batch"),
    (dict(ref_batch=256.0), "ref_batch"),
    (dict(weight_decay=float("inf")), "weight_decay"),
    (dict(trust_coefficient=0.0), "trust_coefficient"),
    (dict(epochs=10, warmup_epochs=20), "warmup_epochs"),
    (dict(label_smoothing=1.0), "label_smoothing"),
    (dict(optimizer="adam"), "optimizer"),
    (dict(batch_fractions=()), "batch_fractions"),
    (dict(batch_fractions=((0, 2.0),)), "batch_fractions"),
    (dict(bn_momentum=0.0), "bn_momentum"),
    (dict(bn_momentum=1.5), "bn_momentum"),
])
def test_bad_recipe_names_the_parameter(kwargs, name):
    with pytest.raises(ValueError, match=name):
        Recipe(name="x", **kwargs)
    with pytest.raises(ValueError, match="global_batch"):
        build_batch_table(RECIPES.get("goyal"), 0)


def test_mnist1d_data_and_model(tmp_path):
    x, y, xt, yt = load_mnist1d(num_samples=500, cache_dir_=tmp_path)
    assert x.shape == (400, 40) and xt.shape == (100, 40) and x.dtype == torch.float32
    assert y.dtype == torch.int64 and set(y.tolist()) <= set(range(10))
    assert len(list(tmp_path.glob("*.npz"))) == 1
    x2, *_ = load_mnist1d(num_samples=500, cache_dir_=tmp_path)  # from the cache
    assert torch.equal(x, x2)
    assert MNIST1DCNN()(x[:5]).shape == (5, 10)
    with pytest.raises(ValueError, match="num_samples"):
        load_mnist1d(num_samples=55, cache_dir_=tmp_path)


def test_tiny_recipe_bench_run(tmp_path, monkeypatch, capsys):
    monkeypatch.setenv("FLASHSGD_CACHE", str(tmp_path / "cache"))
    parser = argparse.ArgumentParser()
    bench_recipe.add_arguments(parser)
    args = parser.parse_args(["--epochs", "3", "--batches", "512", "--seeds", "0", "--num-samples",
                              "3000", "--channels", "16", "--threads", "1", "--out", str(tmp_path / "out"),
                              "--json", str(tmp_path / "r.json")])
    assert bench_recipe.run(args) == 0
    table = (tmp_path / "out" / "recipe.md").read_text()
    for variant in ("baseline", "sgd", "sgd+warmup", "full", "full+bsc"):
        assert f"| {variant} |" in table
    assert (tmp_path / "out" / "recipe.png").stat().st_size > 1000
    assert (tmp_path / "r.json").exists()
    # the baseline learns something in 3 epochs on 2,400 samples (chance is 10%)
    assert "| 128 | baseline |" in table
    base_acc = float(table.split("| 128 | baseline | ")[1].split(" |")[0])
    assert base_acc > 30.0


# ---------------------------------------------------------------- the traps of a user's own loop ------
# (issue 24, "the library"): each is an error or one RecipeWarning, and the right use is silent.

def _silent(fn, *args, **kwargs):
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        return fn(*args, **kwargs)


def _steps(plan, model, n, set_lr=False):
    x, y = torch.randn(16, 1, 8, generator=torch.Generator().manual_seed(0)), torch.arange(16) % 10
    for step in range(n):
        if set_lr:
            plan.set_lr(step)
        plan.optimizer.zero_grad()
        plan.loss_fn(model(x), y).backward()
        plan.optimizer.step()


MINE = Recipe(name="mine", optimizer="lars", warmup_epochs=2.0, decay="step", milestones=(10.0, 15.0))


def test_a_custom_recipe_rescaled_by_epochs_says_so():
    with pytest.warns(RecipeWarning, match=r"recipe 'mine' is written for 90 epochs \(Recipe.epochs\); "
                                           r"prepare\(\.\.\., epochs=20\) rescales it by 20/90: warm-up 2 -> "
                                           r"0.4444 epochs; milestones \(10, 15\) -> \(2.222, 3.333\).*"
                                           r"Recipe\(\.\.\., epochs=20\).*recipe.for_epochs\(20\)"):
        plan = prepare(MINE, _model(), 512, 1000, epochs=20)
    assert plan.recipe.milestones == pytest.approx((20 / 9, 30 / 9))  # still rescaled: only said
    # the right ways are silent: lengths written for the run, an explicit rescale, a preset's lengths
    mine20 = dataclasses.replace(MINE, epochs=20.0)
    assert _silent(prepare, mine20, _model(), 512, 1000, epochs=20).recipe.milestones == (10.0, 15.0)
    _silent(prepare, MINE.for_epochs(20), _model(), 512, 1000, epochs=20)
    _silent(prepare, dataclasses.replace(RECIPES["goyal"], lr_per_ref=0.2, name="g2"), _model(), 512, 1000, epochs=20)
    # nothing but the length to rescale (no warm-up, poly decay, one batch row): nothing to say
    _silent(prepare, Recipe(name="plain", decay="poly"), _model(), 512, 1000, epochs=20)
    with pytest.warns(RecipeWarning, match=r"batch rows from epochs \(0, 30\) -> \(0, 7\)"):
        prepare(dataclasses.replace(RECIPES["sony"], warmup_epochs=0.0, batch_fractions=((0, 0.5), (30, 1.0)),
                                    power=1.0, name="s"), _model(), 512, 1000, epochs=20)


def test_a_recipe_field_its_optimizer_does_not_read_is_named():
    with pytest.warns(RecipeWarning, match=r"recipe 'mine-sgd': optimizer 'sgd' does not read "
                                           r"trust_coefficient=0.01 \(read by lars, lamb\): ignored"):
        prepare(Recipe(name="mine-sgd", optimizer="sgd", trust_coefficient=0.01, decay="poly"), _model(), 512,
                1000, epochs=20)
    with pytest.warns(RecipeWarning, match=r"optimizer 'lamb' does not read lars_clip=True \(read by lars\)"):
        prepare(Recipe(name="mine-lamb", optimizer="lamb", lars_clip=True, decay="poly"), _model(), 512, 1000,
                epochs=20)
    # a preset's own values under another optimizer, and the fields the optimizer reads: silent
    _silent(prepare, dataclasses.replace(RECIPES["fujitsu-mnist1d"], optimizer="sgd", name="f-sgd"), _model(),
            512, 1000, epochs=15)
    _silent(prepare, Recipe(name="mine-lars", optimizer="lars", trust_coefficient=0.01, decay="poly"), _model(),
            512, 1000, epochs=20)


@pytest.mark.parametrize("name", ["goyal", "sony", "fujitsu", "fujitsu-mnist1d"])
def test_forgetting_set_lr_warns_at_the_second_step(name):
    model = _model()
    plan = prepare(RECIPES[name], model, 512, 5120, epochs=9, model_tweaks=False)
    lr0 = plan.optimizer.param_groups[0]["lr"]
    with pytest.warns(RecipeWarning, match=rf"optimizer step 1 runs at LR {lr0:.4g}, the value prepare\(\) "
                                           r"wrote for step 0.*schedule is at .* for step 1: call "
                                           r"plan.set_lr\(step\) before every optimizer step"):
        _steps(plan, model, 2)
    assert (lr0 == 0) == (name != "goyal")  # three of the four presets start at LR 0
    _silent(_steps, plan, model, 9)  # once per plan


def test_an_lr_driven_by_the_loop_is_silent():
    for drive in ("set_lr", "lambda_lr", "own"):
        model = _model()
        plan = prepare(RECIPES["sony"], model, 512, 5120, epochs=9)
        if drive == "set_lr":
            _silent(_steps, plan, model, 9, set_lr=True)
            continue
        if drive == "lambda_lr":
            sched = lambda_lr(plan.optimizer, plan.schedule, plan.table, 5120)
        else:
            for g in plan.optimizer.param_groups:
                g["lr"] = 0.05
        for _ in range(9):
            _silent(_steps, plan, model, 1)
            if drive == "lambda_lr":
                sched.step()


def test_a_decay_never_applied_is_caught_too():
    # no warm-up: the LR written for step 0 is the peak, right until the first milestone (epoch 1 of 3)
    recipe = Recipe(name="flat", epochs=3.0, decay="step", milestones=(1.0,))
    model = _model()
    plan = prepare(recipe, model, 512, 5120, epochs=3)  # 10 steps per epoch
    _silent(_steps, plan, model, 9)
    with pytest.warns(RecipeWarning, match="optimizer step 16 runs at LR 0.2.*at 0.02 for step 16"):
        _steps(plan, model, 8)


def test_the_dataset_size_can_come_after_the_optimizer():
    model = _model()
    plan = prepare(RECIPES["fujitsu-mnist1d"], model, 512, epochs=3)  # before the dataset exists
    assert isinstance(plan.optimizer, LARS) and plan.num_samples is None
    with pytest.raises(RuntimeError, match=r"does not know the dataset size yet: call "
                                           r"plan.set_num_samples\(len\(train_set\)\)"):
        plan.set_lr(0)
    with pytest.raises(RuntimeError, match="dataset size"):
        plan.total_steps()
    assert plan.set_num_samples(5120) is plan
    ref = prepare(RECIPES["fujitsu-mnist1d"], _model(), 512, 5120, epochs=3)
    assert [plan.set_lr(s) for s in range(30)] == [ref.set_lr(s) for s in range(30)]
    assert plan.total_steps() == ref.total_steps() == 30
    plan.set_num_samples(np.int64(5120))  # the same size again: fine
    with pytest.raises(ValueError, match="num_samples is already 5120.*got 4000"):
        plan.set_num_samples(4000)
    # forgetting both the size and set_lr: the LR-0 steps are still caught
    model = _model()
    plan = prepare(RECIPES["sony"], model, 512, epochs=3)
    with pytest.warns(RecipeWarning, match=r"nothing is learned at LR 0.*plan.set_num_samples\(N\)"):
        _steps(plan, model, 2)


def test_describe_says_global_batch_is_the_final_batch():
    plan = prepare(RECIPES["sony"], _model(), 512, 5120, epochs=90)
    assert ("global_batch=512 (the final batch; batch-size control: 256 for epochs 0-29 (33% of the "
            "epochs), 512 from epoch 30)") in plan.describe()
    assert "global_batch=512 lr_per_ref" in prepare(RECIPES["goyal"], _model(), 512, 5120, epochs=9).describe()
    assert "global_batch=64 (the final batch; batch-size control: 32 for epoch 0 (33% of the epochs), 64 from " \
           "epoch 1)" in prepare(RECIPES["sony"], _model(), 64, 5120, epochs=3).describe()


def test_replaced_optimizer_settings_are_listed_and_it_cannot_step():
    model = _model()
    mine = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9, weight_decay=1e-4)  # --lr --momentum --wd
    with pytest.warns(RecipeWarning, match=r"plan.optimizer \(recipe 'fujitsu'\) replaces your SGD, whose "
                                           r"settings no longer apply: SGD -> LARS; lr=0.1 -> the schedule's "
                                           r"\(0 at step 0, peak .*\); momentum=0.9 -> 0.96; weight_decay=0.0001 "
                                           r"-> 5e-05 \(0 on biases and normalization parameters\)\. Step "
                                           r"plan.optimizer"):
        plan = prepare(RECIPES["fujitsu"], model, 512, 5120, epochs=9, replaces=mine)
    with pytest.raises(RuntimeError, match=r"this SGD was replaced by plan.optimizer.*step plan.optimizer instead"):
        mine.step()
    _silent(_steps, plan, model, 2, set_lr=True)  # the plan's optimizer steps as usual
    # goyal's momentum and Nesterov are not listed (the same); its weight decay spares biases and BN
    mine = torch.optim.SGD(_model().parameters(), lr=0.1, momentum=0.9, nesterov=True, weight_decay=1e-4)
    with pytest.warns(RecipeWarning, match=r"no longer apply: lr=0.1 -> the schedule's \(0.1 at step 0, peak "
                                           r"0.2; plan.set_lr\); weight_decay=0.0001 -> 0.0001 \(0 on biases "
                                           r"and normalization parameters\)\. Step"):
        prepare(RECIPES["goyal"], _model(), 512, 5120, epochs=9, replaces=mine)
    with pytest.raises(TypeError, match="replaces must be the torch.optim.Optimizer .* got dict"):
        prepare(RECIPES["goyal"], _model(), 512, 5120, epochs=9, replaces={"lr": 0.1})


def test_large_batch_rule_is_fujitsu_mnist1d_with_saturation_and_longer_warmup():
    rule, tuned = RECIPES["large-batch-mnist1d"], RECIPES["fujitsu-mnist1d"]
    assert (rule.lr_max, rule.warmup_epochs / rule.epochs) == (3.2, 0.4)
    assert _fields(rule, skip=("name", "source", "lr_max", "warmup_epochs")) == \
        _fields(tuned, skip=("name", "source", "lr_max", "warmup_epochs"))
    peaks = [prepare(rule, _model(), b, num_samples=500_000, epochs=5).schedule for b in (4096, 32768)]
    assert [lr_at(2.0, s, build_batch_table(rule, b)) for s, b in zip(peaks, (4096, 32768))] == \
        pytest.approx([3.2 / 3, 3.2 * 0.8])
    assert {bench_recipe.RULE.optimizer, bench_recipe.RULE_LAMB.optimizer, bench_recipe.RULE_SGD.optimizer} == \
        {"lars", "lamb", "sgd"}


def test_recipe_bench_jobs_give_the_same_runs(tmp_path, monkeypatch):
    monkeypatch.setenv("FLASHSGD_CACHE", str(tmp_path / "cache"))
    parser = argparse.ArgumentParser()
    bench_recipe.add_arguments(parser)
    rows = []
    for jobs in ("1", "2"):
        out = tmp_path / jobs
        args = parser.parse_args(["--epochs", "1", "--batches", "512", "--seeds", "0", "--num-samples", "1000",
                                  "--channels", "8", "--threads", "1", "--variants", "rule", "rule-sgd",
                                  "--jobs", jobs, "--out", str(out), "--json", str(out / "r.json")])
        assert bench_recipe.run(args) == 0
        runs = json.loads((out / "r.json").read_text())["runs"]
        rows.append([(r["variant"], r["batch"], r["seed"], r["final_train_loss"], r["acc_per_epoch"]) for r in runs])
        assert (out / "recipe_vs_batch.png").stat().st_size > 1000
    assert rows[0] == rows[1] and [r[0] for r in rows[0]] == ["baseline", "rule", "rule-sgd"]
