"""Recipes: presets, the MNIST-1D-tuned variant, plan building, model tweaks, MNIST-1D data/model and
a tiny recipe bench run."""

import argparse
import dataclasses

import pytest
import torch
from torch import nn

from flashsgd.bench import recipe as bench_recipe
from flashsgd.optim import LARS, RECIPES, Recipe, prepare, tuned_variant
from flashsgd.optim.plan import apply_model_tweaks, build_batch_table, build_loss, build_optimizer
from flashsgd.optim.schedules import epoch_at_step, lr_at
from flashsgd.train.mnist1d import MNIST1DCNN, load_mnist1d


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
# recipe (train/config.py PROXY_TUNING, warmup given for 15 epochs; lr_per_256 is now lr_per_ref).
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
