"""DDP hook ``powersgd`` (flashsgd.comm.powersgd_hooks): torch's PowerSGD hook by name, its options,
and checkpoints through state_dict()/load_state_dict()."""

from __future__ import annotations

import copy
import io

import pytest
import torch
from torch import nn
from torch.nn.parallel import DistributedDataParallel as DDP

from flashsgd.comm.hooks import HOOKS, hook_options, register_hook
from flashsgd.exchanges import LowRankOptions


from ddp_helpers import flat_params as _params  # noqa: E402
from ddp_helpers import tiny_net as _net  # noqa: E402
from ddp_helpers import train_steps as _train  # noqa: E402


def test_registered_options_and_bad_input():
    assert "powersgd" in HOOKS
    assert hook_options("powersgd", matrix_approximation_rank=2, density=0.01, seed=3, timeout_s=9.0) == \
        LowRankOptions(matrix_approximation_rank=2, seed=3, timeout_s=9.0)
    net = nn.Linear(2, 2)
    for opts, word in (({"matrix_approximation_rank": 0}, "matrix_approximation_rank must be an integer >= 1"),
                       ({"start_iter": 1}, "start_iter must be an integer >= 2"),
                       ({"timeout_s": 0}, "timeout_s"), ({"density": 0.1}, "unknown option")):
        with pytest.raises(ValueError, match=word):
            register_hook(net, "powersgd", **opts)


def _body():
    # 1. it compresses (differs from dense after start_iter) and trains
    ref = DDP(_net())
    _train(ref, torch.optim.SGD(ref.parameters(), lr=0.1, momentum=0.9), 6)
    model = DDP(_net())
    state = register_hook(model, "powersgd", matrix_approximation_rank=2)
    opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    _train(model, opt, 3)
    assert state.powersgd.iter == 3, state.powersgd.iter
    assert state.powersgd.q_memory_dict, "nothing compressed"
    # 2. checkpoint round trip (torch.save, weights only) gives the same trajectory
    buf = io.BytesIO()
    torch.save({"hook": state.state_dict(), "model": model.module.state_dict(),
                "opt": opt.state_dict()}, buf)
    _train(model, opt, 3, first=3)
    buf.seek(0)
    ck = torch.load(buf, weights_only=True)
    fresh = _net(seed=5)
    fresh.load_state_dict(ck["model"])
    model_b = DDP(fresh)
    state_b = register_hook(model_b, "powersgd", matrix_approximation_rank=2)
    state_b.load_state_dict(ck["hook"])
    opt_b = torch.optim.SGD(model_b.parameters(), lr=0.1, momentum=0.9)
    opt_b.load_state_dict(copy.deepcopy(ck["opt"]))
    _train(model_b, opt_b, 3, first=3)
    assert torch.equal(_params(model), _params(model_b)), (_params(model) - _params(model_b)).abs().max()
    assert not torch.allclose(_params(model), _params(ref))
    return True


def test_powersgd_ddp_checkpoint(run_ranks):
    assert all(run_ranks(_body, 2))


def _many_buckets(steps: int):
    """PowerSGD over several DDP buckets on Gloo: every rank must issue the buckets' P and Q
    all-reduces in the same order (torch's hook chains them in Future callbacks)."""
    torch.manual_seed(0)
    net = nn.Sequential(*[m for _ in range(6) for m in (nn.Linear(64, 64), nn.ReLU())], nn.Linear(64, 5))
    model = DDP(net, bucket_cap_mb=0.02)  # ~5 buckets of 64 x 64 weights
    register_hook(model, "powersgd", matrix_approximation_rank=2)
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    for s in range(steps):
        g = torch.Generator().manual_seed(s)  # the same batch on every rank: the same update
        x, y = torch.randn(8, 64, generator=g), torch.randint(0, 5, (8,), generator=g)
        opt.zero_grad()
        nn.functional.cross_entropy(model(x), y).backward()
        opt.step()
    return _params(model).tolist()  # plain floats: no tensor crosses the process boundary


def test_powersgd_many_buckets_keeps_the_collective_order(run_ranks):
    a, b = run_ranks(_many_buckets, 2, 12, timeout_s=60)
    assert a == b


def _cpu_buckets_where_cuda_is_available():
    """CPU ranks on a machine with a GPU (made to look like one): torch's PowerSGD hook would call
    ``torch.cuda.synchronize(cpu)`` after each decompression (a ValueError on a GPU machine; on
    this CPU build an AssertionError) unless flashsgd's view of torch skips it."""
    torch.cuda.is_available = lambda: True  # this rank's process only
    model = DDP(_net())
    state = register_hook(model, "powersgd", matrix_approximation_rank=2)
    _train(model, torch.optim.SGD(model.parameters(), lr=0.1), 4)
    return state.powersgd.iter, bool(state.powersgd.q_memory_dict)


def test_cpu_buckets_train_where_cuda_is_available(run_ranks):
    """Found by the GPU check (H100): every powersgd run of CPU ranks on a GPU machine failed."""
    assert run_ranks(_cpu_buckets_where_cuda_is_available, 2) == [(4, True)] * 2
