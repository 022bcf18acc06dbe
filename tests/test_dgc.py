"""DGC corrections in the ``topk`` / ``gtopk`` hooks (flashsgd.comm.sparse.corrections): momentum
correction, momentum-factor masking, local clipping, their checkpoints and their bad input."""

from __future__ import annotations

import copy
import io

import pytest
import torch
import torch.distributed as dist
from torch import nn
from torch.nn.parallel import DistributedDataParallel as DDP

from flashsgd.comm.hooks import register_hook
from flashsgd.comm.sparse.corrections import (accumulate_velocity, check_momentum_owner,
                                              clip_local_, mask_momentum_)


from ddp_helpers import flat_params as _params  # noqa: E402
from ddp_helpers import tiny_net as _net  # noqa: E402
from ddp_helpers import train_steps as _train  # noqa: E402


def test_bad_options_name_the_value():
    net = nn.Linear(2, 2)
    for opts, word in (({"momentum_correction": 1.0}, "momentum_correction must be a momentum factor"),
                       ({"momentum_correction": -0.1}, "momentum_correction"),
                       ({"nesterov": True}, "nesterov=True needs momentum_correction > 0"),
                       ({"momentum_masking": "yes"}, "momentum_masking must be True or False"),
                       ({"local_clip": 0}, "local_clip must be None"),
                       ({"local_clip": float("inf")}, "local_clip"),
                       ({"momentum_corection": 0.9}, "unknown option.*momentum_corection.*momentum_correction")):
        with pytest.raises(ValueError, match=word):
            register_hook(net, "topk", **opts)


def test_momentum_owner_conflict():
    check_momentum_owner(0.9, 0.0)
    check_momentum_owner(0.0, 0.9)
    with pytest.raises(ValueError, match="momentum applied twice.*momentum_correction=0.9.*momentum=0.9"):
        check_momentum_owner(0.9, 0.9)


def test_correction_steps():
    g = torch.tensor([3.0, 4.0])
    assert torch.equal(clip_local_(g.clone(), None), g)
    torch.testing.assert_close(clip_local_(g.clone(), 1.0).norm(), torch.tensor(1.0))
    # heavy ball: u = m*u + g; v += u.  Nesterov (DGC's code): u = m*(u + g); v += u + g
    v0, u0 = torch.zeros(2), torch.ones(2)
    v, u = accumulate_velocity(v0, u0, g, 0.5)
    assert u.tolist() == [3.5, 4.5] and v.tolist() == [3.5, 4.5]
    assert v0.tolist() == [0.0, 0.0] and u0.tolist() == [1.0, 1.0]  # the step's memories: untouched
    v, u = accumulate_velocity(v0, u0, g, 0.5, nesterov=True)
    assert u.tolist() == [2.0, 2.5] and v.tolist() == [5.0, 6.5]
    mask_momentum_(u, torch.tensor([1]))
    assert u.tolist() == [2.0, 0.0]


def _equivalence_body():
    """Density 1.0, no masking: the hook's momentum == the optimizer's momentum (SGD, both forms),
    through DDP's bucket rebuild; a checkpoint into another bucket layout keeps the trajectory."""
    for nesterov in (False, True):
        ref = DDP(_net(), bucket_cap_mb=0.01)
        opt_ref = torch.optim.SGD(ref.parameters(), lr=0.1, momentum=0.9, nesterov=nesterov)
        _train(ref, opt_ref, 6)
        for hook in ("topk", "gtopk"):
            model = DDP(_net(), bucket_cap_mb=0.01)
            state = register_hook(model, hook, density=1.0, momentum_correction=0.9, nesterov=nesterov,
                                  momentum_masking=False)
            assert state.owns_momentum
            opt = torch.optim.SGD(model.parameters(), lr=0.1)
            _train(model, opt, 3)
            # checkpoint (through torch.save, weights only) into a model with other buckets
            buf = io.BytesIO()
            torch.save(state.state_dict(), buf)
            buf.seek(0)
            model_b = DDP(copy.deepcopy(model.module), bucket_cap_mb=0.004)
            state_b = register_hook(model_b, hook, density=1.0, momentum_correction=0.9,
                                    nesterov=nesterov, momentum_masking=False)
            state_b.load_state_dict(torch.load(buf, weights_only=True))
            opt_b = torch.optim.SGD(model_b.parameters(), lr=0.1)
            _train(model_b, opt_b, 3, first=3)
            assert state_b.residual_remaps >= 1
            torch.testing.assert_close(_params(model_b), _params(ref), rtol=1e-5, atol=1e-6)
    return True


@pytest.mark.parametrize("world", [2, 3])
def test_momentum_correction_is_momentum_sgd_at_density_one(run_ranks, world):
    assert all(run_ranks(_equivalence_body, world))


def _masking_body():
    """Masking zeroes the velocity exactly where the residual was emptied (the sent entries);
    without it the velocity survives there. Clipping bounds the applied gradient."""
    out = {}
    for masking in (True, False):
        model = DDP(_net(), bucket_cap_mb=0.01)
        state = register_hook(model, "topk", density=0.05, momentum_correction=0.9,
                              momentum_masking=masking)
        _train(model, torch.optim.SGD(model.parameters(), lr=0.1), 5)
        sent = [state.residuals[i] == 0 for i in state.residuals]
        out[masking] = [state.velocities[i][s] for i, s in zip(state.residuals, sent)]
    assert all(torch.all(v == 0) for v in out[True])
    assert any(torch.any(v != 0) for v in out[False])
    # local clipping: with density 1 every rank's clipped gradient is applied, so the
    # average gradient has norm <= the clip (one bucket: bucket_cap_mb large)
    model = DDP(_net())
    register_hook(model, "gtopk", density=1.0, local_clip=1e-3)
    x = torch.randn(16, 20)
    nn.functional.cross_entropy(model(x), torch.zeros(16, dtype=torch.long)).backward()
    norm = torch.cat([p.grad.flatten() for p in model.parameters()]).norm()
    assert 0 < norm <= 1e-3 * (1 + 1e-5), norm.item()
    return True


def test_masking_and_clipping(run_ranks):
    assert all(run_ranks(_masking_body, 2))


def test_run_checks_conflicts_and_step_count_bound():
    from flashsgd.comm.sparse.checks import check_optimizer_momentum, check_sparse_run
    from flashsgd.exchanges import MIN_COVERAGE, CommonOptions, SparseOptions, coverage

    with pytest.raises(ValueError, match="warm-up lasts 500 steps, longer than the run \\(120 steps\\)"):
        check_sparse_run("gtopk", SparseOptions(density=0.01, density_warmup=0.25, density_warmup_steps=500),
                         total_steps=120)
    with pytest.raises(ValueError, match="momentum applied twice"):
        check_sparse_run("gtopk", SparseOptions(density=0.5, momentum_correction=0.9), 1000,
                         optimizer_momentum=0.9)
    assert check_sparse_run("torus2d", CommonOptions(), 10) == []
    # the bound: density * numel per step for gtopk, and the same (measured, not P times) for topk
    assert coverage(1002, SparseOptions(density=0.001)) == pytest.approx(1.0)
    assert coverage(12, SparseOptions(density=0.01, density_warmup=1.0, density_warmup_steps=4)) == \
        pytest.approx(0.01 ** 0.5 + 0.01 ** 0.75 + 8 * 0.01)  # steps 2, 3 of the warm-up, then 8 at 0.01
    (warning,) = check_sparse_run("gtopk", SparseOptions(density=0.001), 1002)
    # coverage = (steps - start_iter) x density >= 20 needs 20000 sparse steps after the 2 dense ones
    assert "at most 1 time (" in warning and f">= {int(MIN_COVERAGE / 0.001) + 2} steps" in warning
    assert check_sparse_run("topk", SparseOptions(density=0.001), 1002) == [warning.replace("gtopk", "topk")]
    assert check_sparse_run("gtopk", SparseOptions(density=0.1), 1002) == []
    # a hook that owns the momentum refuses an optimizer with momentum
    net = nn.Linear(2, 2)

    class Owner:
        owns_momentum, momentum = True, 0.9
    check_optimizer_momentum(Owner(), torch.optim.SGD(net.parameters(), lr=0.1))
    with pytest.raises(ValueError, match="optimizer has momentum=0.9"):
        check_optimizer_momentum(Owner(), torch.optim.SGD(net.parameters(), lr=0.1, momentum=0.9))


def _layer_trust_body():
    """layer_trust: per-parameter sqrt(mean_r ||g_r||^2) of the local gradients, on every rank;
    LARS's trust ratio uses them instead of the sparse aggregate's norms."""
    from flashsgd.optim.lars import LARS, param_groups

    rank, world = dist.get_rank(), dist.get_world_size()
    plain = _net()
    model = DDP(_net(), bucket_cap_mb=0.01)
    state = register_hook(model, "gtopk", density=0.01, layer_trust=True)
    opt = LARS(param_groups(model.module, 1e-4), lr=0.1, momentum=0.9, trust_coefficient=0.02)
    opt.grad_norm_source = state.grad_norms
    _train(model, opt, 3)
    with torch.no_grad():
        for p_plain, p in zip(plain.parameters(), model.module.parameters()):
            p_plain.copy_(p)
    g = torch.Generator().manual_seed(1000 * 3 + rank)
    x, y = torch.randn(16, 20, generator=g), torch.randint(0, 5, (16,), generator=g)
    nn.functional.cross_entropy(plain(x), y).backward()
    expected = torch.stack([p.grad.square().sum() for p in plain.parameters()])
    dist.all_reduce(expected)
    opt.zero_grad()
    nn.functional.cross_entropy(model(x), y).backward()
    params = list(model.module.parameters())
    torch.testing.assert_close(state.grad_norms(params), (expected / world).sqrt(), rtol=1e-5, atol=1e-7)
    sparse_norms = torch.stack([p.grad.norm() for p in params])
    assert torch.all(sparse_norms < state.grad_norms(params))  # the sparse aggregate's are smaller
    assert state.grad_norms([torch.zeros(1)]) is None  # a tensor the hook does not know
    opt.step()
    return True


def test_layer_trust_norms(run_ranks):
    assert all(run_ranks(_layer_trust_body, 2))


def test_lars_grad_norm_source():
    from flashsgd.optim.lars import LARS, param_groups

    def run(source):
        net = _net()
        opt = LARS(param_groups(net, 1e-4), lr=0.5, momentum=0.9, trust_coefficient=0.02)
        opt.grad_norm_source = source(net) if source else None
        for s in range(3):
            x = torch.randn(8, 20, generator=torch.Generator().manual_seed(s))
            opt.zero_grad()
            net(x).square().mean().backward()
            opt.step()
        return _params(net)

    base = run(None)
    own_norms = run(lambda net: lambda params: torch.stack([p.grad.norm() for p in params]))
    unknown = run(lambda net: lambda params: None)
    doubled = run(lambda net: lambda params: 2 * torch.stack([p.grad.norm() for p in params]))
    torch.testing.assert_close(own_norms, base)
    assert torch.equal(unknown, base)
    assert not torch.allclose(doubled, base)  # the source sets the trust ratio
