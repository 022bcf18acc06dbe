"""prepare() and RecipeSetup: run length, stepping past the end, loader checks, explicit model tweaks,
integral numbers."""

import dataclasses
import warnings

import numpy as np
import pytest
import torch
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

from flashsgd.optim import RECIPES, RecipeWarning, Schedule, as_int, prepare, scaled_lr, steps_per_epoch


class BasicBlock(nn.Module):
    """Named as torchvision's block: prepare() finds its last BN as ``bn2``."""

    def __init__(self, width=4):
        super().__init__()
        self.conv1, self.bn1 = nn.Conv1d(width, width, 3, padding=1, bias=False), nn.BatchNorm1d(width)
        self.conv2, self.bn2 = nn.Conv1d(width, width, 3, padding=1, bias=False), nn.BatchNorm1d(width)

    def forward(self, x):
        return torch.relu(x + self.bn2(self.conv2(torch.relu(self.bn1(self.conv1(x))))))


def _model():
    torch.manual_seed(0)
    return nn.Sequential(nn.Conv1d(1, 4, 3, padding=1), nn.BatchNorm1d(4), BasicBlock(), BasicBlock(),
                         nn.Flatten(), nn.Linear(4 * 8, 10))


def _no_warnings(fn, *args, **kwargs):
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        return fn(*args, **kwargs)


# Run length (forgetting .for_epochs(n) used to plan 90 epochs silently)

def test_prepare_epochs_rescales_the_recipe():
    plan = _no_warnings(prepare, RECIPES["goyal"], _model(), 512, 1000, epochs=9)
    assert plan.recipe == RECIPES["goyal"].for_epochs(9)
    assert plan.schedule == RECIPES["goyal"].for_epochs(9).schedule() and plan.epochs == 9
    same = _no_warnings(prepare, RECIPES["goyal"].for_epochs(9), _model(), 512, 1000, epochs=9)
    assert same.recipe == plan.recipe


def test_prepare_warns_when_the_preset_length_is_implicit():
    with pytest.warns(RecipeWarning, match="recipe 'fujitsu' plans 90 epochs.*epochs=N"):
        plan = prepare(RECIPES["fujitsu"], _model(), 512, 1000)
    assert plan.epochs == 90
    _no_warnings(prepare, RECIPES["fujitsu"], _model(), 512, 1000, epochs=90)  # asked for: silent
    _no_warnings(prepare, RECIPES["fujitsu"].for_epochs(15), _model(), 512, 1000)
    _no_warnings(prepare, RECIPES["fujitsu-mnist1d"], _model(), 512, 1000)  # a 15-epoch recipe


@pytest.mark.parametrize("epochs", [0, -1.0, float("nan"), float("inf")])
def test_prepare_rejects_bad_epochs(epochs):
    with pytest.raises(ValueError, match="epochs must be a finite number > 0"):
        prepare(RECIPES["goyal"], _model(), 512, 1000, epochs=epochs)


# Steps per epoch (drop_last of the plan vs the loader)

def test_stepping_past_the_end_warns_once():
    plan = prepare(RECIPES["fujitsu-mnist1d"], _model(), 32, 100, drop_last=True, epochs=2)
    assert plan.total_steps() == 2 * 3
    _no_warnings(lambda: [plan.set_lr(s) for s in range(6)])
    end_lr = plan.lr_at_step(5)
    with pytest.warns(RecipeWarning, match=r"step 6 is past the plan's end \(6 steps.*drop_last=True"):
        assert plan.set_lr(6) <= end_lr
    _no_warnings(plan.set_lr, 7)  # once per plan


def test_check_loader_catches_a_drop_last_mismatch():
    data = TensorDataset(torch.zeros(100, 1))
    plan = prepare(RECIPES["fujitsu-mnist1d"], _model(), 32, 100, drop_last=False, epochs=2)
    plan.check_loader(DataLoader(data, batch_size=32), epoch=1)  # 4 batches, as planned
    plan.check_loader(np.int64(4))
    with pytest.raises(ValueError, match=r"gives 3 batches in epoch 0, the plan expects 4 .*"
                                         r"drop_last=False.*prepare\(\.\.\., drop_last=True\)"):
        plan.check_loader(DataLoader(data, batch_size=32, drop_last=True))


def test_check_loader_follows_the_batch_table():
    recipe = dataclasses.replace(RECIPES["fujitsu-mnist1d"].for_epochs(2), batch_fractions=((0, 0.5), (1, 1.0)))
    plan = prepare(recipe, _model(), 64, 320, epochs=2)
    plan.check_loader(10, epoch=0)  # 320 / 32
    plan.check_loader(5, epoch=1)  # 320 / 64
    assert plan.steps_in_epoch(0) == steps_per_epoch(320, 32) and plan.total_steps() == 15


# Model tweaks: an explicit, recorded step

def test_model_tweaks_are_recorded_and_described():
    recipe = dataclasses.replace(RECIPES["goyal"], bn_momentum=0.3)
    model = _model()
    plan = prepare(recipe, model, 512, 1000, epochs=9)
    assert plan.model_tweaks == ["bn_momentum=0.3 on 5 BatchNorm layers", "zero gamma of 2 last BNs"]
    assert "model_tweaks=[bn_momentum=0.3 on 5 BatchNorm layers; zero gamma of 2 last BNs]" in plan.describe()
    assert torch.count_nonzero(model[2].bn2.weight) == 0 and torch.count_nonzero(model[2].bn1.weight) == 4


def test_model_tweaks_false_changes_nothing():
    recipe = dataclasses.replace(RECIPES["goyal"], bn_momentum=0.3)
    model = _model()
    before = {k: v.clone() for k, v in model.state_dict().items()}
    plan = prepare(recipe, model, 512, 1000, epochs=9, model_tweaks=False)
    assert plan.model_tweaks == [] and "model_tweaks=[none]" in plan.describe()
    assert all(torch.equal(before[k], v) for k, v in model.state_dict().items())
    assert [m.momentum for m in model.modules() if isinstance(m, nn.BatchNorm1d)] == [0.1] * 5


def test_zero_init_without_residual_blocks_says_so():
    model = nn.Sequential(nn.Linear(3, 3), nn.BatchNorm1d(3))
    plan = prepare(RECIPES["goyal"], model, 512, 1000, epochs=9)
    assert plan.model_tweaks == ["zero gamma of 0 last BNs (no residual block with a last BN found)"]


def test_prepare_defaults_give_the_same_training_as_the_explicit_steps():
    """Defaults (model_tweaks=True) = tweaks applied by hand, then the optimizer: same weights."""
    recipe = RECIPES["goyal"].for_epochs(3)
    x, y = torch.randn(64, 1, 8), torch.randint(0, 10, (64,))
    weights = []
    for explicit in (False, True):
        model = _model()
        if explicit:
            from flashsgd.optim.plan import apply_model_tweaks
            apply_model_tweaks(recipe, model)
            plan = prepare(recipe, model, 32, 64, model_tweaks=False)
        else:
            plan = prepare(recipe, model, 32, 64)
        for step in range(4):
            plan.set_lr(step)
            plan.optimizer.zero_grad()
            plan.loss_fn(model(x[step % 2 * 32:][:32]), y[step % 2 * 32:][:32]).backward()
            plan.optimizer.step()
        weights.append(torch.cat([p.detach().flatten() for p in model.parameters()]))
    assert torch.equal(weights[0], weights[1])


# Integral numbers

def test_integral_numbers_are_accepted():
    plan = prepare(RECIPES["fujitsu-mnist1d"], _model(), np.int64(512), np.int64(1000), epochs=np.int64(15))
    ref = prepare(RECIPES["fujitsu-mnist1d"], _model(), 512, 1000, epochs=15)
    assert (plan.table, plan.schedule, plan.num_samples) == (ref.table, ref.schedule, ref.num_samples)
    assert type(plan.num_samples) is int and type(plan.table.final_batch) is int
    assert plan.lr_at_step(np.int64(3)) == ref.lr_at_step(3)
    assert scaled_lr(0.1, np.int64(8192), ref_batch=np.int32(256)) == pytest.approx(3.2)
    assert scaled_lr(0.1, torch.tensor(8192)) == pytest.approx(3.2)
    s = Schedule(ref_batch=np.int64(128))
    assert s.ref_batch == 128 and type(s.ref_batch) is int
    r = dataclasses.replace(RECIPES["goyal"], ref_batch=np.int64(512))
    assert type(r.ref_batch) is int and r.schedule().ref_batch == 512


@pytest.mark.parametrize("value", [512.0, "512", True, None, 0, -4])
def test_non_integral_global_batch_is_refused_by_name(value):
    with pytest.raises(ValueError, match="global_batch must be an integer >= 1"):
        prepare(RECIPES["goyal"], _model(), value, 1000, epochs=9)
    if value is not None:  # num_samples=None: the dataset size comes later (plan.set_num_samples)
        with pytest.raises(ValueError, match="num_samples must be an integer >= 1"):
            prepare(RECIPES["goyal"], _model(), 512, value, epochs=9)


def test_as_int():
    assert as_int("n", np.int16(7)) == 7 and as_int("step", 0, minimum=0) == 0
    with pytest.raises(ValueError, match=r"n must be an integer >= 1, got 2.5 \(float\)"):
        as_int("n", 2.5)


# Local spawn layout (flashsgd.train.plan.build_plan): one node on GPUs, emulated nodes on CPUs

def _run_plan(world, backend=None, **cli):
    from flashsgd.train.config import resolve
    from flashsgd.train.plan import build_plan

    return build_plan(resolve(cli={"workers": world, "global_batch": 1024, **cli}), world=world, num_train=32000,
                      local_spawn=True, backend=backend)


@pytest.mark.parametrize("world", [1, 2, 3, 4, 8])
def test_local_ranks_per_node_is_one_node_over_nccl_and_emulated_pairs_over_gloo(world):
    from flashsgd.train.plan import local_ranks_per_node

    assert local_ranks_per_node(world, "nccl") == world
    assert local_ranks_per_node(world, "gloo") == (2 if world % 2 == 0 else 1)


@pytest.mark.parametrize("algorithm", ["torus2d", "hierarchical", "hgtopk"])
def test_eight_gpus_are_one_node_of_eight_ranks(algorithm):
    """An 8-GPU machine (NCCL) is 1 node x 8: torus2d's grid is 8x1 (its cross-node stage has one
    rank), hierarchical and hgtopk get ranks_per_node 8; the banner says so."""
    plan = _run_plan(8, "nccl", algorithm=algorithm, density=0.01)
    assert (plan.backend, plan.ranks_per_node, plan.grid) == ("nccl", 8, (8, 1))
    assert plan.describe().splitlines()[0] == "flashsgd train | world 8 (8 ranks/node, grid 8x1) | backend nccl"
    if algorithm != "torus2d":
        assert plan.hook_options["ranks_per_node"] == 8
    assert plan.to_dict()["ranks_per_node"] == 8 and plan.to_dict()["backend"] == "nccl"


def test_cpu_ranks_keep_their_emulated_nodes_of_two():
    plan = _run_plan(8, "gloo")
    assert (plan.backend, plan.ranks_per_node, plan.grid) == ("gloo", 2, (2, 4))
    assert plan.describe().splitlines()[0] == "flashsgd train | world 8 (2 ranks/node, grid 2x4) | backend gloo"


@pytest.mark.parametrize("cli, rpn, grid", [({"ranks_per_node": 2}, 2, (2, 4)), ({"grid": "2x4"}, 8, (2, 4)),
                                            ({"ranks_per_node": 4, "grid": "4x2"}, 4, (4, 2))])
def test_the_users_layout_wins_over_nccl_one_node(cli, rpn, grid):
    plan = _run_plan(8, "nccl", **cli)
    assert (plan.ranks_per_node, plan.grid) == (rpn, grid)


def test_under_torchrun_the_backend_plays_no_part(monkeypatch):
    from flashsgd.train.config import resolve
    from flashsgd.train.plan import build_plan

    monkeypatch.setenv("LOCAL_WORLD_SIZE", "4")
    plan = build_plan(resolve(cli={"global_batch": 1024}), world=8, num_train=32000, local_spawn=False,
                      backend="nccl")
    assert (plan.backend, plan.ranks_per_node, plan.grid) == (None, 4, (4, 2))


@pytest.mark.parametrize("gpus, workers, backend, expect", [
    (8, None, "auto", ("nccl", 8)),   # one rank per GPU: one node
    (8, 4, "auto", ("nccl", 4)),      # ranks fit on the GPUs: one node of 4
    (2, 8, "auto", ("gloo", 2)),      # more ranks than GPUs: CPU ranks, emulated nodes
    (8, 8, "gloo", ("gloo", 2)),      # asked for CPU ranks
    (0, 4, "auto", ("gloo", 2)),      # no GPU (this machine, CI): today's CPU plan
])
def test_the_plan_follows_the_backend_the_launcher_picks(monkeypatch, gpus, workers, backend, expect):
    """Without ``backend=`` the plan asks :func:`flashsgd.launch.local_ranks`, the launcher's rule
    (the GPUs stood in for by torch.cuda's answers)."""
    import torch.distributed as dist

    from flashsgd import launch
    from flashsgd.train.config import resolve
    from flashsgd.train.plan import build_plan

    monkeypatch.setattr(torch.cuda, "is_available", lambda: gpus > 0)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: gpus)
    monkeypatch.setattr(dist, "is_nccl_available", lambda: True)
    world, chosen, _ = launch.local_ranks(workers, backend)
    cfg = resolve(cli={"workers": workers, "backend": backend, "global_batch": 1024})
    plan = build_plan(cfg, world=world, num_train=32000, local_spawn=True)
    assert (plan.backend, plan.ranks_per_node) == expect and chosen == expect[0]
