"""LAMB (You et al. 2019) and the optimizer catalog: the batched step equals the per-tensor formula,
exclusion, zero-norm guards, bad input, state_dict round trip; every catalog entry builds from a
recipe and the train config offers the names."""

from __future__ import annotations

import copy
import dataclasses
import math

import pytest
import torch
from torch import nn

from flashsgd.optim.lamb import LAMB
from flashsgd.optim.lars import param_groups
from flashsgd.optim.optimizers import OPTIMIZERS
from flashsgd.optim.recipes import RECIPES


def _reference(params, grads, state, lr, b1, b2, eps, wd, eta, adapted, t):
    """One LAMB step written out per tensor with Python floats for the norms (module docstring)."""
    out = []
    for i, (w, g) in enumerate(zip(params, grads)):
        m, v = state.setdefault(i, (torch.zeros_like(w), torch.zeros_like(w)))
        m = b1 * m + (1 - b1) * g
        v = b2 * v + (1 - b2) * g * g
        u = (m / (1 - b1 ** t)) / ((v / (1 - b2 ** t)).sqrt() + eps) + wd * w
        wn, un = w.norm().item(), u.norm().item()
        ratio = eta * wn / un if adapted and wn > 0 and un > 0 else 1.0
        state[i] = (m, v)
        out.append(w - lr * ratio * u)
    return out


def test_batched_step_equals_the_per_tensor_formula():
    gen = torch.Generator().manual_seed(0)
    shapes = [(8, 3, 3, 3), (16, 8), (10,)]
    params = [nn.Parameter(torch.randn(s, generator=gen, dtype=torch.float64)) for s in shapes]
    params[1].data.zero_()  # ||w|| = 0: ratio 1
    groups = [{"params": params[:2], "weight_decay": 0.01, "lars": True},
              {"params": params[2:], "weight_decay": 0.0, "lars": False}]
    opt = LAMB(groups, lr=0.01, betas=(0.9, 0.99), eps=1e-6, trust_coefficient=0.5)
    ref = [p.detach().clone() for p in params]
    states = [{}, {}]
    for t in range(1, 4):
        grads = [torch.randn(s, generator=gen, dtype=torch.float64) for s in shapes]
        for p, g in zip(params, grads):
            p.grad = g.clone()
        opt.step()
        ref[:2] = _reference(ref[:2], grads[:2], states[0], 0.01, 0.9, 0.99, 1e-6, 0.01, 0.5, True, t)
        ref[2:] = _reference(ref[2:], grads[2:], states[1], 0.01, 0.9, 0.99, 1e-6, 0.0, 0.5, False, t)
        for p, r in zip(params, ref):
            torch.testing.assert_close(p.detach(), r, rtol=1e-12, atol=1e-14)
    # an adapted tensor's update has norm lr * eta * ||w||: LARS's step size at the same lr and eta
    w = params[0].detach().clone()
    params[0].grad = torch.randn(shapes[0], generator=gen, dtype=torch.float64)
    opt.step()
    assert (params[0].detach() - w).norm().item() == pytest.approx(0.01 * 0.5 * w.norm().item(), rel=1e-9)


def test_state_dict_round_trip_reproduces_the_trajectory():
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(5, 4), nn.BatchNorm1d(4), nn.Linear(4, 2))
    x, y = torch.randn(16, 5), torch.randint(0, 2, (16,))

    def step(m, opt):
        opt.zero_grad()
        nn.functional.cross_entropy(m(x), y).backward()
        opt.step()

    opt = LAMB(param_groups(model, 0.01), lr=0.01)
    step(model, opt)
    twin = copy.deepcopy(model)
    twin_opt = LAMB(param_groups(twin, 0.01), lr=0.01)
    twin_opt.load_state_dict(copy.deepcopy(opt.state_dict()))
    for _ in range(3):
        step(model, opt)
        step(twin, twin_opt)
    assert all(torch.equal(a, b) for a, b in zip(model.parameters(), twin.parameters()))


@pytest.mark.parametrize("kwargs, name", [(dict(lr=-1.0), "lr"), (dict(betas=(1.0, 0.9)), "betas"),
                                          (dict(eps=0.0), "eps"), (dict(weight_decay=math.nan), "weight_decay"),
                                          (dict(trust_coefficient=0.0), "trust_coefficient")])
def test_bad_hyper_parameters_are_named(kwargs, name):
    with pytest.raises(ValueError, match=name):
        LAMB([nn.Parameter(torch.zeros(2))], **kwargs)


class _Reads:
    """A recipe that records which of its fields are read."""

    def __init__(self, recipe) -> None:
        self._recipe, self.read = recipe, set()

    def __getattr__(self, name):
        self.read.add(name)
        return getattr(self._recipe, name)


def test_every_catalog_optimizer_builds_its_class_reading_the_fields_it_declares():
    """The catalog is the one place: a recipe naming an entry builds the class the entry names
    (any name, hyphenated too), and the entry's ``reads`` are the optimizer fields its builder and
    its description read (so an unread override can be named: test_train_config)."""
    from flashsgd.optim.lars import LARS
    from flashsgd.optim.optimizers import layer_norm_optimizers, optimizer_fields
    from flashsgd.optim.plan import build_optimizer

    model = nn.Sequential(nn.Linear(3, 4), nn.BatchNorm1d(4), nn.Linear(4, 2))
    for name, entry in OPTIMIZERS.items():
        recipe = dataclasses.replace(RECIPES.get("fujitsu"), optimizer=name)
        opt = build_optimizer(recipe, model, 1024)
        assert type(opt) is entry.cls and issubclass(entry.cls, torch.optim.Optimizer), name
        model(torch.randn(8, 3)).square().mean().backward()
        opt.step()
        spy = _Reads(recipe)
        entry.build(list(opt.param_groups), spy, 0.1)
        entry.describe(spy)
        assert spy.read & set(optimizer_fields()) == set(entry.reads), name
        assert entry.summary and set(entry.unread()) == set(optimizer_fields()) - set(entry.reads)
        # layer norms go to grad_norm_source: an entry that takes them builds an optimizer that has one
        assert entry.layer_norms == hasattr(opt, "grad_norm_source"), name
    assert "lars" in layer_norm_optimizers() and OPTIMIZERS.get("lars").cls is LARS
    with pytest.raises(ValueError, match=f"optimizer must be one of {', '.join(OPTIMIZERS)}, got 'adam'"):
        dataclasses.replace(RECIPES.get("goyal"), optimizer="adam")


def test_the_train_config_offers_every_catalog_optimizer():
    from flashsgd.train import config as C
    from flashsgd.train.plan import build_plan

    plan = build_plan(C.resolve(cli={"optimizer": "lamb"}), 4, 32000, local_spawn=True, backend="gloo")
    assert plan.recipe.optimizer == "lamb" and "optimizer=lamb" in plan.recipe_source
    with pytest.raises(ValueError, match=f"valid choices: {', '.join(OPTIMIZERS)}"):
        C.resolve(cli={"optimizer": "adam"})
