"""DDP hooks: training with each hook matches DDP's default; registry, options, state and errors.

Tolerance: the dense hooks sum and then divide by W, DDP's default divides each gradient by W and
then sums, in a different order; after 3 SGD steps on fp32 the parameters agree within
rtol 1e-5, atol 1e-6 (observed differences ~1e-8).
"""

import pickle
import subprocess
import sys

import pytest
import torch
# DDP's constructor imports torch._dynamo (~800 modules, seconds per process): import it once here,
# before the ranks are forked, instead of once per rank.
import torch._dynamo  # noqa: F401
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel as DDP

from flashsgd.comm.dense_hooks import DenseHookState
from flashsgd.comm import PeerTimeout
from flashsgd.comm.hook_common import CommThread, StatelessHookState
from flashsgd.comm.hooks import HOOKS, register_hook

STEPS = 3


def _net(dtype=torch.float32):
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(8, 32), torch.nn.ReLU(), torch.nn.Linear(32, 32),
                               torch.nn.ReLU(), torch.nn.Linear(32, 4)).to(dtype)


def _batch(rank, step):
    g = torch.Generator().manual_seed(100 * rank + step)
    return torch.randn(16, 8, generator=g), torch.randint(0, 4, (16,), generator=g)


def _train(name, options, ddp=True, as_view=False):
    """STEPS SGD steps on this rank's batches; returns the flat parameters and the hook state."""
    net = _net()
    model = DDP(net, bucket_cap_mb=0.002, gradient_as_bucket_view=as_view) if ddp else net
    state = register_hook(model, name, **options) if ddp else None
    opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    for step in range(STEPS):
        x, y = _batch(dist.get_rank(), step)
        opt.zero_grad()
        torch.nn.functional.cross_entropy(model(x), y).backward()
        opt.step()
    return torch.cat([p.detach().flatten() for p in net.parameters()]), state


def _hooks_match_default(cases):
    ref, _ = _train("native", {})
    out = {}
    for name, options, as_view in cases:
        params, state = _train(name, options, as_view=as_view)
        out[f"{name} {options} view={as_view}"] = (params - ref).abs().max().item(), \
            torch.allclose(params, ref, rtol=1e-5, atol=1e-6), state.state_dict(), \
            getattr(state, "buckets", None)
    # noop: no averaging, so each rank follows plain local SGD on its own batches.
    local, _ = _train("native", {}, ddp=False)
    noop, _ = _train("noop", {})
    out["noop == local SGD"] = torch.allclose(noop, local, rtol=1e-6, atol=1e-7)
    out["noop differs from DDP"] = not torch.allclose(noop, ref, rtol=1e-5, atol=1e-6) \
        if dist.get_world_size() > 1 else True
    return out


WORLD_CASES = {
    4: [("ring", {}, False), ("ring", {"threaded": False}, False), ("ring", {}, True),
        ("hierarchical", {"ranks_per_node": 2}, False),
        ("hierarchical", {"ranks_per_node": 1, "threaded": False}, False),
        ("torus2d", {"grid": "2x2"}, False), ("torus2d", {"grid": "4x1", "threaded": False}, True),
        ("torus2d", {"grid": "1x4"}, False)],
    3: [("ring", {}, False), ("hierarchical", {"threaded": False}, False),
        ("torus2d", {"grid": "1x3"}, False)],
    6: [("hierarchical", {"ranks_per_node": 3}, False),
        ("torus2d", {"grid": "2x3", "threaded": False}, False),
        ("torus2d", {"grid": "3x2"}, False)],
}


@pytest.mark.parametrize("world", sorted(WORLD_CASES))
def test_hooks_train_like_ddp_default(run_ranks, world):
    for result in run_ranks(_hooks_match_default, world, WORLD_CASES[world]):
        for key, value in result.items():
            if key.startswith("noop"):
                assert value, key
                continue
            max_diff, close, state_dict, buckets = value
            assert close, f"{key}: max |param - DDP default| = {max_diff}"
            assert state_dict == {} and buckets > STEPS, (key, buckets)  # > 1 bucket in some step


# ---------------------------------------------------------------------- registry and state ------

def test_registry_names_and_unknown_hook():
    assert {"native", "noop", "ring", "hierarchical", "torus2d"} <= set(HOOKS.names())
    with pytest.raises(ValueError, match="unknown DDP communication hook 'torus'; known: native, noop, "
                                         "ring, hierarchical, torus2d"):
        register_hook(object(), "torus")


@pytest.mark.parametrize("name, options, message", [
    ("torus2d", {"grd": "2x2"}, "hook 'torus2d' got unknown option\\(s\\) grd; valid: timeout_s, "
                                "ranks_per_node, grid, threaded"),
    ("native", {"grid": "2x2"}, "hook 'native' got unknown option\\(s\\) grid; valid: timeout_s"),
    ("noop", {"threaded": True}, "valid: timeout_s"),
    ("native", {"timeout_s": float("nan")}, "timeout_s must be a finite number of seconds > 0, got nan"),
])
def test_unknown_options_list_valid_ones(name, options, message):
    with pytest.raises(ValueError, match=message):
        register_hook(object(), name, **options)


@pytest.mark.parametrize("name", list(HOOKS))
def test_a_model_not_wrapped_in_ddp_is_a_type_error_saying_what_it_needs(name):
    # on a bare module every hook used to fail deep inside with an AttributeError
    with pytest.raises(TypeError, match=r"register_hook needs a torch.nn.parallel.DistributedDataParallel "
                                        r"model, got torch.nn.modules.container.Sequential; wrap it: DDP\(model\)"):
        register_hook(_net(), name)


def test_stateless_state_dict_round_trip():
    state = StatelessHookState("noop")
    assert state.state_dict() == {}
    state.load_state_dict({})
    with pytest.raises(ValueError, match="hook 'noop' has no state; got keys \\['residual'\\]"):
        state.load_state_dict({"residual": 1})
    assert not hasattr(state, "__dict__")  # __slots__


def _bad_registrations():
    errors = {}
    model = DDP(_net())
    for key, call in {
        "grid": lambda: register_hook(model, "torus2d", grid="3x3"),
        "ranks_per_node": lambda: register_hook(model, "hierarchical", ranks_per_node=3),
        "threaded": lambda: register_hook(model, "ring", threaded="yes"),
        "dtype": lambda: register_hook(DDP(_net(torch.float64)), "ring"),
    }.items():
        try:
            call()
            errors[key] = "no error"
        except ValueError as exc:
            errors[key] = str(exc)
    # a dense state pickles without its process groups and keeps working after unpickling
    state = register_hook(DDP(_net()), "torus2d", grid="2x2")
    clone = pickle.loads(pickle.dumps(state))
    errors["pickled"] = (clone.name, clone.options.grid, clone.topology is None, type(clone) is DenseHookState)
    return errors


def test_bad_registrations_raise_value_error(run_ranks):
    for errors in run_ranks(_bad_registrations, 4):
        assert "grid 3x3 has 9 ranks but the world size is 4; valid grids: 1x4, 2x2, 4x1" in errors["grid"]
        assert "ranks_per_node=3 (from argument) must divide the world size 4" in errors["ranks_per_node"]
        assert "threaded must be True or False, got 'yes'" in errors["threaded"]
        assert "parameter '0.weight' is torch.float64; supported dtypes: float32, float16, bfloat16" \
            in errors["dtype"]
        assert errors["pickled"] == ("torus2d", "2x2", True, True)


def test_hook_modules_import_one_way():
    # hooks.py fills the registry from dense_hooks and sparse_hooks; neither imports hooks.py back.
    code = ("import sys, flashsgd.comm.dense_hooks, flashsgd.comm.sparse.hooks; "
            "assert 'flashsgd.comm.hooks' not in sys.modules, 'cycle'")
    subprocess.run([sys.executable, "-c", code], check=True)
    from flashsgd.exchanges import names

    assert HOOKS.names() == names()  # one hook per catalog entry, in its order


def test_comm_thread_fails_fast_after_a_failure():
    # After one failed call the ranks' collective sequences differ: later calls must not run.
    thread, ran = CommThread(), []
    first = thread.submit(lambda: (_ for _ in ()).throw(PeerTimeout(0, 1, 2.0, "ring all-reduce")))
    second = thread.submit(lambda: ran.append(1))
    for fut in (first, second):
        with pytest.raises(RuntimeError, match="PeerTimeout: rank 0: no data from peer rank 1"):
            fut.wait()
    assert ran == []
