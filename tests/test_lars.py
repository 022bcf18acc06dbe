"""LARS: the step equals the formula, exclusion, zero-norm guards, bad input, state_dict round trip."""

import copy

import pytest
import torch
from torch import nn

from flashsgd.bench.lars import RESNET50_PARAMS, RESNET50_TENSORS, loop_lars_step, resnet50_shapes
from flashsgd.optim.lars import LARS, param_groups


def _params(seed=0):
    g = torch.Generator().manual_seed(seed)
    w = nn.Parameter(torch.randn(3, 4, generator=g, dtype=torch.float64))
    b = nn.Parameter(torch.randn(3, generator=g, dtype=torch.float64))
    return w, b, g


def _formula(w, grad, v, lr, m, wd, eta, eps, nesterov=False, clip=False):
    """The LARS step written out with Python floats (module docstring)."""
    wn, gn = w.norm().item(), grad.norm().item()
    ratio = eta * wn / (gn + wd * wn + eps) if wn > 0 and gn > 0 else 1.0
    if clip:
        ratio = min(ratio / lr, 1.0)
    u = ratio * (grad + wd * w)
    v = m * v + u
    return w - lr * (u + m * v if nesterov else v), v


@pytest.mark.parametrize("nesterov, clip", [(False, False), (True, False), (False, True)])
def test_step_equals_formula(nesterov, clip):
    w, b, gen = _params()
    lr, m, wd, eta, eps = 0.5, 0.9, 1e-2, 0.02, 1e-9
    opt = LARS([{"params": [w], "lars": True}, {"params": [b], "lars": False, "weight_decay": 0.0}],
               lr=lr, momentum=m, weight_decay=wd, trust_coefficient=eta, eps=eps,
               nesterov=nesterov, clip=clip)
    ew, eb = w.detach().clone(), b.detach().clone()
    vw, vb = torch.zeros_like(ew), torch.zeros_like(eb)
    for _ in range(3):
        w.grad = torch.randn(w.shape, generator=gen, dtype=w.dtype)
        b.grad = torch.randn(b.shape, generator=gen, dtype=b.dtype)
        ew, vw = _formula(ew, w.grad, vw, lr, m, wd, eta, eps, nesterov, clip)
        vb = m * vb + b.grad  # excluded: ratio 1, no decay
        eb = eb - lr * (b.grad + m * vb if nesterov else vb)
        opt.step()
        torch.testing.assert_close(w.detach(), ew, rtol=1e-12, atol=1e-12)
        torch.testing.assert_close(b.detach(), eb, rtol=1e-12, atol=1e-12)
    assert clip or not torch.allclose(w.detach(), ew + 1.0)  # sanity: tensors were compared


def test_lr_outside_buffer_equals_paper_form_with_momentum_correction():
    """v_inside = lr_t * v_outside: the LR-inside form with Goyal's correction gives the same w."""
    w, _, gen = _params(1)
    m, wd, eta = 0.9, 1e-3, 0.01
    opt = LARS([w], lr=1.0, momentum=m, weight_decay=wd, trust_coefficient=eta, eps=0.0)
    pw, pv, lr_prev = w.detach().clone(), torch.zeros(w.shape, dtype=w.dtype), None
    for lr in [0.1, 0.4, 0.8, 0.8, 0.2, 0.05]:  # warmup then decay
        w.grad = torch.randn(w.shape, generator=gen, dtype=w.dtype)
        opt.param_groups[0]["lr"] = lr
        opt.step()
        local = eta * pw.norm() / (w.grad.norm() + wd * pw.norm())
        corr = 1.0 if lr_prev is None else lr / lr_prev  # momentum correction (Goyal sec. 2.2)
        pv = m * corr * pv + lr * local * (w.grad + wd * pw)
        pw = pw - pv
        lr_prev = lr
        torch.testing.assert_close(w.detach(), pw, rtol=1e-10, atol=1e-12)


def test_batched_equals_per_parameter_loop():
    torch.manual_seed(0)
    shapes = [(8, 3, 3, 3), (8,), (8,), (16, 8, 1, 1), (16,), (10, 16), (10,)]

    def groups():
        gen = torch.Generator().manual_seed(0)
        ps = [nn.Parameter(torch.randn(s, generator=gen) * 0.1) for s in shapes]
        for i, p in enumerate(ps):
            p.grad = torch.randn(p.shape, generator=torch.Generator().manual_seed(i)) * 1e-2
        hp = dict(lr=0.3, momentum=0.9, trust_coefficient=0.01, eps=1e-9)
        return [dict(params=[p for p in ps if p.ndim > 1], weight_decay=1e-3, lars=True, **hp),
                dict(params=[p for p in ps if p.ndim == 1], weight_decay=0.0, lars=False, **hp)]

    ga, gb = groups(), groups()
    opt, state = LARS(ga), {}
    for _ in range(3):
        opt.step()
        loop_lars_step(gb, state)
    for a, b in zip(ga, gb):
        for pa, pb in zip(a["params"], b["params"]):
            torch.testing.assert_close(pa, pb, rtol=1e-6, atol=1e-7)


def test_param_groups_exclude_bias_and_norm():
    model = nn.Sequential(nn.Conv1d(1, 4, 3, bias=True), nn.BatchNorm1d(4), nn.Flatten(),
                          nn.Linear(8, 2), nn.LayerNorm(2))
    groups = param_groups(model, weight_decay=1e-4)
    main, excl = groups
    assert main["weight_decay"] == 1e-4 and main["lars"] is True
    assert excl["weight_decay"] == 0.0 and excl["lars"] is False
    assert {id(p) for p in main["params"]} == {id(model[0].weight), id(model[3].weight)}
    assert len(excl["params"]) == 6  # conv bias, BN w/b, linear bias, LN w/b
    everything = param_groups(model, weight_decay=1e-4, exclude_bias_and_norm=False)
    assert len(everything) == 1 and len(everything[0]["params"]) == 8
    # torch.optim.SGD accepts the same groups (the extra "lars" key is kept, ignored)
    torch.optim.SGD(groups, lr=0.1, momentum=0.9)


def test_excluded_group_is_momentum_sgd():
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 3), nn.BatchNorm1d(3))
    ref = copy.deepcopy(model)
    opt = LARS(param_groups(model, 1e-3), lr=0.1, momentum=0.9, trust_coefficient=0.01)
    sgd = torch.optim.SGD([p for n, p in ref.named_parameters() if p.ndim == 1], lr=0.1, momentum=0.9)
    x = torch.randn(16, 4)
    for _ in range(3):
        for mod, o in ((model, opt), (ref, sgd)):
            o.zero_grad()
            mod(x).square().mean().backward()
            o.step()
    for (n, p), q in zip(model.named_parameters(), ref.parameters()):
        if p.ndim == 1:
            torch.testing.assert_close(p, q)


def test_zero_norm_guards():
    w = nn.Parameter(torch.zeros(3, 3))  # ||w|| = 0 (e.g. zero-init layer)
    u = nn.Parameter(torch.ones(3, 3))   # ||g|| = 0 (unused layer)
    opt = LARS([w, u], lr=0.5, momentum=0.0, weight_decay=1e-4, trust_coefficient=1e-3)
    w.grad = torch.full((3, 3), 2.0)
    u.grad = torch.zeros(3, 3)
    opt.step()
    assert torch.isfinite(w).all() and torch.isfinite(u).all()
    torch.testing.assert_close(w.detach(), torch.full((3, 3), -1.0))  # ratio 1: w - lr * g
    torch.testing.assert_close(u.detach(), torch.full((3, 3), 1.0 - 0.5 * 1e-4))  # ratio 1: decay only


@pytest.mark.parametrize("kwargs, name", [
    (dict(lr=-0.1), "lr"),
    (dict(trust_coefficient=0.0), "trust_coefficient"),
    (dict(trust_coefficient=-1e-3), "trust_coefficient"),
    (dict(momentum=1.0), "momentum"),
    (dict(weight_decay=-1.0), "weight_decay"),
    (dict(eps=-1.0), "eps"),
    (dict(momentum=0.0, nesterov=True), "nesterov"),
])
def test_bad_hyper_parameters(kwargs, name):
    with pytest.raises(ValueError, match=name):
        LARS([nn.Parameter(torch.ones(2))], **kwargs)


def test_bad_group_hyper_parameter():
    with pytest.raises(ValueError, match="trust_coefficient"):
        LARS([{"params": [nn.Parameter(torch.ones(2))], "trust_coefficient": 0.0}])
    with pytest.raises(ValueError, match="weight_decay"):
        param_groups(nn.Linear(2, 2), weight_decay=-1.0)


def _train(model, opt, steps, seed):
    gen = torch.Generator().manual_seed(seed)
    for _ in range(steps):
        x = torch.randn(32, 6, generator=gen)
        opt.zero_grad()
        nn.functional.cross_entropy(model(x), (x[:, 0] > 0).long()).backward()
        opt.step()


def test_state_dict_round_trip_reproduces_trajectory():
    def make():
        torch.manual_seed(0)
        model = nn.Sequential(nn.Linear(6, 8), nn.BatchNorm1d(8), nn.ReLU(), nn.Linear(8, 2))
        return model, LARS(param_groups(model, 1e-4), lr=0.5, momentum=0.9, nesterov=True,
                           trust_coefficient=0.02)

    model, opt = make()
    _train(model, opt, 4, seed=1)
    saved_model, saved_opt = copy.deepcopy(model.state_dict()), copy.deepcopy(opt.state_dict())
    _train(model, opt, 4, seed=2)

    model2, opt2 = make()
    model2.load_state_dict(saved_model)
    opt2.load_state_dict(saved_opt)
    assert all("momentum_buffer" in s for s in opt2.state.values())
    _train(model2, opt2, 4, seed=2)
    for a, b in zip(model.state_dict().values(), model2.state_dict().values()):
        torch.testing.assert_close(a, b, rtol=0, atol=0)


def test_resnet50_shapes_list():
    shapes = resnet50_shapes()
    assert len(shapes) == RESNET50_TENSORS == 161
    assert sum(torch.Size(s).numel() for _, s in shapes) == RESNET50_PARAMS == 25_557_032
    assert sum(len(s) == 1 for _, s in shapes) == 107  # biases + BN: excluded from LARS


def test_written_out_ratios_give_the_same_update_bit_for_bit(monkeypatch):
    """CUDA's form of the per-tensor ratios (written out to each tensor's shape and strides, so the
    foreach ops fuse) equals the 0-d form element by element, channels_last tensors included."""
    from flashsgd.optim import lars as lars_module

    ratio = torch.tensor([0.5, 2.0, 3.0])
    tensors = [torch.randn(4, 3, 2, 2).contiguous(memory_format=torch.channels_last), torch.randn(5, 3),
               torch.randn(7)]
    out = lars_module.per_tensor(ratio, tensors, fused=True)
    for r, o, t in zip(ratio, out, tensors):
        assert o.shape == t.shape and o.stride() == t.stride() and bool((o == r).all())
    assert lars_module.per_tensor(ratio, [t.t() for t in tensors[1:2]] + tensors[2:], fused=True)[0].dim() == 0

    def run(fused):
        monkeypatch.setattr(lars_module, "per_tensor", lambda r, ts: _per_tensor(r, ts, fused=fused))
        gen = torch.Generator().manual_seed(0)
        ps = [nn.Parameter(torch.randn(s, generator=gen)) for s in [(8, 3, 3, 3), (10, 16), (10,)]]
        opt = LARS(ps, lr=0.3, momentum=0.9, weight_decay=1e-3, trust_coefficient=0.01, nesterov=True)
        for step in range(3):
            for i, p in enumerate(ps):
                p.grad = torch.randn(p.shape, generator=torch.Generator().manual_seed(10 * step + i))
            opt.step()
        return torch.cat([p.detach().reshape(-1) for p in ps])

    _per_tensor = lars_module.per_tensor
    assert torch.equal(run(True), run(False))
