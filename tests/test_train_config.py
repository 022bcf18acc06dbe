"""flashsgd.train: config precedence and errors, models, data sharding, checkpoint errors (no training)."""

from __future__ import annotations

import dataclasses

import pytest
import torch

from flashsgd.cli import build_parser
from flashsgd.train.records import checkpoint as ckpt
from flashsgd.train import config as C
from flashsgd.train.cli import parse_config
from flashsgd import launch
from flashsgd.train.data import ShardedSampler, build_datasets
from flashsgd.train.data.images import center_crop, random_resized_crop
from flashsgd.train.models import MODELS, build_model


# ----------------------------------------------------------------------------------- config -------

def test_defaults_are_the_main_job():
    cfg = C.resolve()
    assert (cfg.run.workers, cfg.data.dataset, cfg.model.model) == (None, "mnist1d", "mnist1d_cnn")
    assert launch.local_ranks(cfg.run.workers, cfg.run.backend, gpus=0) == (4, "gloo", "")  # CPU: 4 ranks
    assert (cfg.optim.recipe, cfg.optim.global_batch, cfg.comm.algorithm) == ("fujitsu", 4096, "torus2d")


def test_precedence_defaults_toml_cli(tmp_path):
    path = tmp_path / "c.toml"
    path.write_text('[optim]\nglobal_batch = 8192\nepochs = 3\n[comm]\nalgorithm = "ring"\n[run]\nseed = 5\n')
    args = build_parser().parse_args(["train", "--config", str(path), "--comm", "gtopk",
                                      "--density", "0.05", "--no-nesterov"])
    cfg = parse_config(args)
    assert cfg.optim.global_batch == 8192 and cfg.optim.epochs == 3.0  # TOML over defaults
    assert cfg.comm.algorithm == "gtopk" and cfg.comm.density == 0.05  # CLI over TOML (--comm alias)
    assert cfg.optim.nesterov is False and cfg.run.seed == 5
    assert cfg.run.workers is None                                      # untouched default


def test_resolved_config_round_trips():
    cfg = C.resolve(cli={"grid": "4x1", "lr_per_ref": "0.2", "ref_batch": "512", "fail_at": ""})
    again = C.resolve(toml_text=C.dumps(cfg))
    assert dataclasses.asdict(again) == dataclasses.asdict(cfg)


@pytest.mark.parametrize("text, needle", [
    ("[optim]\nglobal_bach = 1\n", "unknown config key optim.global_bach; valid keys in [optim]: recipe"),
    ("[optimizer]\nx = 1\n", "unknown config section [optimizer]; valid sections: data, model"),
    ('[comm]\nalgorithm = "torus"\n', "'comm.algorithm': invalid value 'torus'; valid choices: native, "),
    ('[optim]\nrecipe = "lamb"\n', "valid choices: goyal, sony, fujitsu, fujitsu-mnist1d"),
    ('[optim]\nglobal_batch = "big"\n', "'optim.global_batch': expected int"),
    ('[optim]\nglobal_batch = 0\n', "optim.global_batch must be > 0"),
    ('[model]\nmodel = "resnet51"\n', "unknown model 'resnet51'; valid choices: mnist1d_cnn"),
    ('[run]\nfail_at = "1:2:boom"\n', "run.fail_at must look like RANK:STEP:MODE"),
    ('[run]\nprogress = 3\n', "'run.progress': expected true or false"),
    ("[optim\n", "invalid TOML"),
    ("[comm]\ndensity = 0.1\ndensity_warmup = 0.05\n", "comm.density_warmup must be in [comm.density, 1]"),
    ('[comm]\nselection = "fast"\n', "valid choices: auto, exact, sampled"),
    ('[run]\ntimeout_s = nan\n', "'run.timeout_s': expected a finite number, got nan"),
    ('[optim]\nepochs = inf\n', "'optim.epochs': expected a finite number, got inf"),
    ('[optim]\nlr_per_ref = -0.1\n', "optim.lr_per_ref must be in [0, inf), got -0.1"),
    ('[optim]\nmomentum = 1.0\n', "optim.momentum must be in [0, 1), got 1.0"),
    ('[optim]\nlr_max = 0\n', "optim.lr_max must be in (0, inf), got 0"),
    ('[optim]\nepochs = 2\nwarmup_epochs = 5\n', "optim.warmup_epochs (5) must be shorter than optim.epochs (2)"),
    ('[run]\nresume = "/nonexistent"\n', "run.resume: '/nonexistent' is not a checkpoint directory"),
])
def test_bad_config_names_key_and_choices(text, needle):
    with pytest.raises(ValueError) as err:
        C.resolve(toml_text=text)
    assert needle in str(err.value)


def test_cli_bad_value_is_a_clean_error(capsys):
    assert build_parser().parse_args(["train", "--nonfinite", "ignore"])._run(
        build_parser().parse_args(["train", "--nonfinite", "ignore"])) == 2
    assert "valid choices: skip, stop" in capsys.readouterr().err


def test_recipe_checks_before_spawning(capsys):
    args = build_parser().parse_args(["train", "--epochs", "2", "--warmup-epochs", "5"])
    assert args._run(args) == 2
    assert "warmup_epochs" in capsys.readouterr().err


def test_integral_numbers_are_accepted():
    import numpy as np

    assert C.resolve(cli={"global_batch": np.int64(512)}).optim.global_batch == 512
    with pytest.raises(ValueError, match="expected an integer"):
        C.resolve(cli={"global_batch": 512.5})


# ----------------------------------------------------------------------------------- models -------

def test_resnet50_has_the_published_size():
    params = list(build_model("resnet50", 1000).parameters())
    assert len(params) == 161
    assert sum(p.numel() for p in params) == 25_557_032


def test_model_shapes_and_zero_gamma():
    assert sum(p.numel() for p in build_model("resnet18", 1000).parameters()) == 11_689_512
    m = build_model("resnet20", 10)
    assert m(torch.randn(2, 3, 32, 32)).shape == (2, 10)
    assert len([b for b in m.modules() if hasattr(b, "last_bn")]) == 9
    assert not any(isinstance(x, torch.nn.SyncBatchNorm) for x in m.modules())
    assert build_model("mnist1d_cnn", 10)(torch.randn(3, 40)).shape == (3, 10)
    with pytest.raises(ValueError, match="known: mnist1d_cnn"):
        build_model("vgg", 10)
    assert set(MODELS) == {"mnist1d_cnn", "resnet18", "resnet20", "resnet50"}


# ------------------------------------------------------------------------------------- data -------

@pytest.mark.parametrize("n, batch, world", [(100, 32, 4), (103, 32, 3), (10, 4, 3), (64, 64, 8),
                                             (50, 7, 2)])
def test_sharding_covers_each_sample_once_per_epoch(n, batch, world):
    perms = []
    for epoch in range(2):
        seen, per_step = [], None
        for rank in range(world):
            s = ShardedSampler(n, rank, world, seed=3)
            s.set_epoch(epoch, batch)
            shards = list(s)
            assert all(len(b) >= 1 for b in shards)
            seen += [i for b in shards for i in b.tolist()]
            sizes = [len(b) for b in shards]
            per_step = sizes if per_step is None else [a + b for a, b in zip(per_step, sizes)]
        assert sorted(seen) == list(range(n))                  # exactly once across workers
        assert per_step == s.global_sizes() and sum(per_step) == n
        perms.append(s._perm.tolist())
    assert perms[0] != perms[1]                                  # reshuffled every epoch


def test_sampler_batch_change_and_resume_position():
    s = ShardedSampler(100, 1, 2, seed=0)
    s.set_epoch(0, 10)
    assert [len(b) for b in s] == [5] * 10
    s.set_epoch(1, 40)                                           # batch-size control
    it = iter(s)
    first = [next(it) for _ in range(2)]
    state = s.state_dict()
    t = ShardedSampler(100, 1, 2, seed=0)
    t.load_state_dict(state)
    rest = list(t)
    full = ShardedSampler(100, 1, 2, seed=0)
    full.set_epoch(1, 40)
    assert [b.tolist() for b in first + rest] == [b.tolist() for b in full]
    with pytest.raises(ValueError, match="seed"):
        ShardedSampler(100, 1, 2, seed=9).load_state_dict(state)


def test_synthetic_and_imagefolder(tmp_path):
    d = build_datasets("synthetic", num_samples=20, image_shape="cifar")
    x, y = d.train.batch(torch.arange(5))
    assert x.shape == (5, 3, 32, 32) and d.num_classes == 10 and y.max() < 10
    from PIL import Image

    for c in ("cat", "dog"):
        (tmp_path / "train" / c).mkdir(parents=True)
        for i in range(3):
            arr = (torch.rand(40 + 7 * i, 50, 3) * 255).to(torch.uint8).numpy()
            Image.fromarray(arr).save(tmp_path / "train" / c / f"{i}.png")
    d = build_datasets("imagefolder", data_dir=str(tmp_path), image_size=24)
    assert d.num_classes == 2 and len(d.train) + len(d.test) == 6
    g = torch.Generator().manual_seed(0)
    x, y = d.train.batch(torch.arange(len(d.train)), train=True, key=3)
    assert x.shape == (len(d.train), 3, 24, 24) and x.abs().max() < 3.0
    img = torch.arange(3 * 30 * 40, dtype=torch.float32).view(3, 30, 40)
    assert random_resized_crop(img, 16, g).shape == (3, 16, 16)
    assert center_crop(img, 16).shape == (3, 16, 16)
    with pytest.raises(ValueError, match="no class subfolders"):
        build_datasets("imagefolder", data_dir=str(tmp_path / "train" / "cat"))


# ------------------------------------------------------------------------------ checkpoints -------

def test_corrupt_and_mismatched_checkpoints(tmp_path):
    step_dir = tmp_path / "step-00000001"
    step_dir.mkdir()
    (step_dir / "shared.pt").write_bytes(b"not a checkpoint")
    with pytest.raises(ckpt.CheckpointError, match="corrupt"):
        ckpt.load(step_dir, 0, 1)
    meta = {"format": ckpt.FORMAT, "step": 1, "world_size": 2}
    torch.save({"meta": meta}, step_dir / "shared.pt")
    with pytest.raises(ckpt.CheckpointError, match="written by 2 workers, this run has 1"):
        ckpt.load(step_dir, 0, 1)
    with pytest.raises(ckpt.CheckpointError, match="does not match the model"):
        ckpt.load_model_state(torch.nn.Linear(2, 3), torch.nn.Linear(3, 3).state_dict(), "x")
    (tmp_path / "latest").write_text("step-00000009\n")
    with pytest.raises(ckpt.CheckpointError, match="does not exist"):
        ckpt.find_latest(tmp_path)


def test_sparse_hook_options_from_config():
    from flashsgd.train.plan import build_plan

    cfg = C.resolve(cli={"algorithm": "gtopk", "density": 0.001, "density_warmup": 0.25,
                         "density_warmup_epochs": 2.0, "selection": "exact", "global_batch": 1024,
                         "timeout_s": 30})
    plan = build_plan(cfg, world=4, num_train=8192, local_spawn=True, backend="gloo")
    assert plan.hook_options == {"density": 0.001, "density_warmup": 0.25, "density_warmup_steps": 16,
                                 "selection": "exact", "seed": 0, "timeout_s": 30.0}  # no node layout: gtopk's is flat
    dense = build_plan(C.resolve(cli={"timeout_s": 30}), world=4, num_train=8192, local_spawn=True, backend="gloo")
    assert dense.hook_options == {"ranks_per_node": 2, "grid": None, "timeout_s": 30.0}
    assert dense.grid == (2, 2) and dense.total_steps == 2 * 15


@pytest.mark.parametrize("cli, world, needle", [
    ({"grid": "3x3"}, 4, "config key comm.grid: grid 3x3 has 9 ranks but the world size is 4; valid grids: 1x4, 2x2, 4x1"),
    ({"grid": "banana"}, 4, "config key comm.grid: grid must look like 'XxY'"),
    ({"global_batch": 2}, 4, "optim.global_batch=2 gives a global batch of 2 for 4 workers"),
    ({"ranks_per_node": 3}, 4, "comm.ranks_per_node=3 must divide the world size 4; valid: 1, 2, 4"),
])
def test_plan_rejects_what_cannot_run_on_the_world(cli, world, needle):
    from flashsgd.train.plan import build_plan

    with pytest.raises(ValueError) as err:
        build_plan(C.resolve(cli=cli), world=world, num_train=8192, local_spawn=True, backend="gloo")
    assert needle in str(err.value)


def test_default_plan_uses_the_tuned_variant():
    from flashsgd.train.plan import build_plan

    plan = build_plan(C.resolve(), world=4, num_train=32000, local_spawn=True, backend="gloo")
    assert plan.recipe.name == "fujitsu-mnist1d" and plan.recipe.trust_coefficient == 0.02
    assert "fujitsu-mnist1d (the mnist1d-tuned variant of fujitsu)" in plan.describe()
    published = build_plan(C.resolve(cli={"proxy_tuning": False}), world=4, num_train=32000, local_spawn=True, backend="gloo")
    assert published.recipe.name == "fujitsu" and published.recipe.trust_coefficient == 0.0025


def test_momentum_correction_moves_the_momentum_into_the_hook():
    from flashsgd.train.plan import build_plan

    cli = {"algorithm": "gtopk", "recipe": "goyal", "global_batch": 256, "epochs": 10.0,
           "momentum_correction": True, "density_warmup": 0.25, "density_warmup_epochs": 4.0}
    plan = build_plan(C.resolve(cli=cli), world=8, num_train=32000, local_spawn=True, backend="gloo")
    assert plan.recipe.momentum == 0.0 and plan.recipe.nesterov is False
    assert plan.hook_options["momentum_correction"] == 0.9 and plan.hook_options["nesterov"] is True
    assert plan.warnings == ()  # coverage with the warm-up is above the bound
    with pytest.raises(ValueError, match="comm.momentum_correction: hook 'ring' has no momentum correction"):
        build_plan(C.resolve(cli={**cli, "algorithm": "ring"}), world=8, num_train=32000, local_spawn=True, backend="gloo")
    with pytest.raises(ValueError, match="longer than the run"):
        build_plan(C.resolve(cli={**cli, "density_warmup_epochs": 11.0, "warmup_epochs": 1.0}),
                   world=8, num_train=32000, local_spawn=True, backend="gloo")


def test_momentum_correction_is_one_factor_in_the_config_the_plan_and_the_hook(tmp_path):
    """comm.momentum_correction is the hook's momentum factor (a float, 0: off) in the config, the
    flag, config.toml, plan.json and the hook; ``true`` (a bare flag, an older config.toml) is the
    recipe's momentum, as when the key was a switch."""
    from flashsgd.train.config.file import dumps_run_config
    from flashsgd.train.plan import build_plan

    base = {"algorithm": "gtopk", "recipe": "goyal", "global_batch": 256, "epochs": 10.0}
    old = C.resolve(toml_text='[optim]\nrecipe = "goyal"\n[comm]\nalgorithm = "gtopk"\nmomentum_correction = true\n')
    assert old.comm.momentum_correction == 0.9 and isinstance(old.comm.momentum_correction, float)
    assert C.resolve(toml_text="[comm]\nmomentum_correction = false\n").comm.momentum_correction == 0.0
    assert C.resolve(cli={**base, "momentum": 0.95, "momentum_correction": "true"}).comm.momentum_correction == 0.95
    bare = parse_config(build_parser().parse_args(["train", "--comm", "gtopk", "--momentum-correction"]))
    valued = parse_config(build_parser().parse_args(["train", "--comm", "gtopk", "--momentum-correction", "0.8"]))
    assert bare.comm.momentum_correction == 0.9 and valued.comm.momentum_correction == 0.8  # fujitsu-mnist1d: 0.9
    assert C.resolve(toml_text=dumps_run_config(valued)) == valued  # written as the factor, loads back
    plan = build_plan(C.resolve(cli={**base, "momentum_correction": 0.8}), world=8, num_train=32000,
                      local_spawn=True, backend="gloo")
    assert plan.hook_options["momentum_correction"] == 0.8 == plan.exchange_options.momentum_correction
    assert plan.recipe.momentum == 0.0 and plan.to_dict()["config"]["comm"]["momentum_correction"] == 0.8
    for bad in ("1.0", "-0.1"):
        with pytest.raises(ValueError, match="comm.momentum_correction must be a momentum factor in \\[0, 1\\)"):
            C.resolve(cli={**base, "momentum_correction": bad})


def test_the_plan_keeps_the_checked_options_object_the_hook_is_registered_with():
    from flashsgd.exchanges import EXCHANGES
    from flashsgd.train.plan import build_plan

    for name in ("torus2d", "ring", "gtopk", "hgtopk", "powersgd", "native"):
        plan = build_plan(C.resolve(cli={"algorithm": name}), 4, 32000, local_spawn=True, backend="gloo")
        options = plan.exchange_options
        assert isinstance(options, EXCHANGES[name].options), name
        # the shown dict and the object agree (the dict is plan.json's, the object register_hook's)
        assert options == EXCHANGES[name].options_from(**plan.hook_options), name
    auto = build_plan(C.resolve(cli={"algorithm": "auto"}), 4, 32000, local_spawn=True, backend="gloo")
    assert auto.exchange_options is None
    chosen = auto.with_comm(algorithm="gtopk", density=0.01)
    assert chosen.exchange_options == EXCHANGES["gtopk"].options_from(**chosen.hook_options)
    assert chosen.exchange_options.density == 0.01


def test_layer_trust_without_an_optimizer_that_takes_layer_norms_is_warned_and_off():
    """comm.layer_trust costs one all-reduce per bucket and feeds only an optimizer with layer norms:
    with another optimizer the plan warns (naming the optimizers that take them) and the hook
    computes none; as every key a run does not read (config.toml keeps it under a comment)."""
    from flashsgd.train.config.file import dumps_run_config
    from flashsgd.train.plan import build_plan

    def plan_of(**cli):
        return build_plan(C.resolve(cli={"algorithm": "gtopk", "layer_trust": True, **cli}), 4, 32000,
                          local_spawn=True, backend="gloo")

    lars = plan_of()  # fujitsu-mnist1d: LARS
    assert lars.exchange_options.layer_trust and not any("layer_trust" in w for w in lars.warnings)
    for optimizer in ("sgd", "lamb"):
        plan = plan_of(optimizer=optimizer)
        assert not plan.exchange_options.layer_trust and "layer_trust" not in plan.hook_options
        assert (f"config key comm.layer_trust is set but not read by optimizer {optimizer}, which takes no "
                f"layer norms (those that do: lars; no norms are exchanged): ignored") in plan.warnings
    goyal = plan_of(recipe="goyal")  # the recipe's optimizer decides when optim.optimizer is unset
    assert not goyal.exchange_options.layer_trust
    cfg = C.resolve(cli={"algorithm": "gtopk", "layer_trust": True, "optimizer": "sgd"})
    text = dumps_run_config(cfg)
    assert "# set, but not read by optimizer sgd, which takes no layer norms" in text
    assert C.resolve(toml_text=text) == cfg


def test_an_optimizer_override_the_run_optimizer_does_not_read_is_warned():
    from flashsgd.train.config.file import applies
    from flashsgd.train.plan import build_plan

    def warnings_of(**cli):
        return build_plan(C.resolve(cli=cli), 4, 32000, local_spawn=True, backend="gloo").warnings

    assert ("config key optim.trust_coefficient is set but not read by optimizer sgd (read by lars, lamb): "
            "ignored") in warnings_of(optimizer="sgd", trust_coefficient=0.01)
    assert "config key optim.nesterov is set but not read by optimizer lamb (read by sgd, lars): ignored" \
        in warnings_of(optimizer="lamb", nesterov=True)
    assert not any("optim." in w for w in warnings_of(trust_coefficient=0.01, nesterov=True))  # LARS reads them
    assert not any("optim." in w for w in warnings_of(recipe="goyal", optimizer="lamb"))  # the recipe's: not set
    # with momentum correction the hook reads the momentum and its Nesterov form, whatever the optimizer
    mc = C.resolve(cli={"algorithm": "gtopk", "optimizer": "lamb", "nesterov": True, "momentum_correction": 0.9})
    assert applies(mc, "optim", "nesterov") and applies(mc, "optim", "momentum")


def test_optimizer_and_dataset_help_are_the_catalog_entries(capsys):
    from flashsgd.optim.optimizers import OPTIMIZERS
    from flashsgd.train.data.catalog import DATASETS

    docs = {**C.field_docs(C.OptimConfig), **C.field_docs(C.DataConfig)}
    for entry in [*OPTIMIZERS.values(), *DATASETS.values()]:
        key = "optimizer" if entry.name in OPTIMIZERS else "dataset"
        assert f"{entry.name}: {entry.summary}" in docs[key], entry.name


def test_sparse_runs_below_the_step_count_bound_are_warned():
    from flashsgd.train.plan import build_plan

    plan = build_plan(C.resolve(cli={"algorithm": "gtopk", "density": 0.01}), world=4, num_train=32000,
                      local_spawn=True, backend="gloo")
    assert len(plan.warnings) == 1 and "step-count bound" in plan.warnings[0]
    assert "WARNING" in plan.describe()
    assert build_plan(C.resolve(), world=4, num_train=32000, local_spawn=True, backend="gloo").warnings == ()


def test_the_imagenet_preset_sits_between_the_defaults_and_the_users_values(tmp_path):
    cfg = C.resolve(cli={"data_dir": str(tmp_path)}, preset="imagenet-goyal")
    assert (cfg.model.model, cfg.optim.recipe, cfg.data.dataset, cfg.run.precision) == \
        ("resnet50", "goyal", "imagefolder", "bf16")
    assert cfg.run.channels_last and cfg.comm.algorithm == "native" and cfg.optim.global_batch == 256
    toml = tmp_path / "c.toml"
    toml.write_text('[optim]\nglobal_batch = 8192\n[run]\nprecision = "fp16"\n')
    cfg = C.resolve(toml, {"data_dir": str(tmp_path), "precision": "fp32"}, preset="imagenet-goyal")
    assert cfg.optim.global_batch == 8192 and cfg.run.precision == "fp32"  # TOML > preset, flag > TOML
    with pytest.raises(ValueError, match="--preset 'imagenet' is unknown; valid: imagenet-goyal"):
        C.resolve(preset="imagenet")
    with pytest.raises(ValueError, match="data.data_dir is required"):  # the one value it needs
        C.resolve(preset="imagenet-goyal")
