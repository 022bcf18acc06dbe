"""The step protocol between the training step and the stateful hooks (flashsgd.comm.hook_step):
a skipped step leaves no trace in any hook memory, memories and LARS layer norms are in true
gradient units whatever the loss scale, a NaN the sparse output hides still skips the step, a
non-finite memory is never checkpointed, and a state follows the device and dtype of its bucket."""

from __future__ import annotations

import copy

import pytest
import torch
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel as DDP

from ddp_helpers import flat_params, tiny_net
from flashsgd.comm.hooks import HOOKS, register_hook
from flashsgd.train.step import TrainStep

# every hook with memory across steps, with options that exercise it: several buckets, sampled
# selection's RNG, DGC momentum and clipping, LARS layer norms, PowerSGD's error and Q
STATEFUL = {
    "topk": dict(density=0.05, start_iter=2, layer_trust=True),
    "gtopk": dict(density=0.05, start_iter=2, momentum_correction=0.9, local_clip=5.0),
    "hgtopk": dict(density=0.05, start_iter=2, ranks_per_node=1, layer_trust=True),
    "powersgd": dict(matrix_approximation_rank=2, start_iter=2),
}
STATEFUL_THREADED = {**STATEFUL, "gtopk_threaded": dict(density=0.05, start_iter=2, threaded=True,
                                                        selection="threshold")}


def floating_tensors(state) -> list[torch.Tensor]:
    """Every floating tensor of a nested state dict (as flashsgd.comm.hook_common's, written out so
    that this file also runs against code without it)."""
    if isinstance(state, torch.Tensor):
        return [state] if state.is_floating_point() else []
    items = state.values() if isinstance(state, dict) else state if isinstance(state, (list, tuple)) else ()
    return [t for item in items for t in floating_tensors(item)]


def _batch(step: int):
    g = torch.Generator().manual_seed(1000 * step + dist.get_rank())
    return torch.randn(8, 20, generator=g), torch.randint(0, 5, (8,), generator=g)


def _model(hook: str, options: dict):
    ddp = DDP(tiny_net(), bucket_cap_mb=0.005)  # several buckets
    state = register_hook(ddp, hook.split("_")[0], **options)
    # no hook_state given: TrainStep finds it on ddp (test_the_step_finds_the_hook_state_on_ddp)
    step = TrainStep(ddp, torch.optim.SGD(ddp.parameters(), lr=0.05), torch.nn.CrossEntropyLoss(reduction="sum"))
    return ddp, state, step


def _comparable(state_dict: dict) -> dict:
    """A hook's state_dict without its traffic counters (a skipped step's bytes were sent)."""
    return {k: v for k, v in state_dict.items() if k not in ("stats", "total_numel_before_compression",
                                                               "total_numel_after_compression")}


def _assert_same(a, b, where: str) -> None:
    if isinstance(a, torch.Tensor):
        assert isinstance(b, torch.Tensor) and a.dtype == b.dtype and torch.equal(a, b), where
    elif isinstance(a, dict):
        assert a.keys() == b.keys(), f"{where}: keys {sorted(a)} != {sorted(b)}"
        for k in a:
            _assert_same(a[k], b[k], f"{where}.{k}")
    elif isinstance(a, (list, tuple)):
        assert len(a) == len(b), where
        for i, (x, y) in enumerate(zip(a, b)):
            _assert_same(x, y, f"{where}[{i}]")
    else:
        assert a == b, f"{where}: {a!r} != {b!r}"


def _skip_leaves_no_trace(hook: str, options: dict):
    """Run A: 6 steps with a skipped step (NaN loss on rank 0 only) after the third; run B: the
    same 6 steps without it. The skipped step's hook state_dict is bit-identical before and after,
    and the two runs end bit-identical (parameters and hook state)."""
    a_ddp, a_state, a_step = _model(hook, options)
    b_ddp, b_state, b_step = _model(hook, options)
    for s in range(6):
        if s == 3:
            before = _comparable(a_state.state_dict()), dict(getattr(a_state, "layer_norms", {}))
            res = a_step(lambda: _batch(99), 16, step=s, poison=dist.get_rank() == 0)
            assert res.skipped
            after = _comparable(a_state.state_dict()), dict(getattr(a_state, "layer_norms", {}))
            _assert_same(before, after, f"{hook} state and layer norms after the skipped step")
        for step, st in ((a_step, a_state), (b_step, b_state)):
            x, y = _batch(s)
            assert not step(lambda: (x, y), 16, step=s).skipped
    _assert_same(_comparable(a_state.state_dict()), _comparable(b_state.state_dict()), f"{hook} final state")
    _assert_same(dict(getattr(a_state, "layer_norms", {})), dict(getattr(b_state, "layer_norms", {})), "norms")
    assert all(torch.isfinite(t).all() for t in floating_tensors(a_state.state_dict()))
    return torch.equal(flat_params(a_ddp), flat_params(b_ddp))


@pytest.mark.parametrize("hook", sorted(STATEFUL_THREADED))
def test_a_skipped_step_leaves_every_hook_memory_as_it_was(run_ranks, hook):
    assert run_ranks(_skip_leaves_no_trace, 2, hook, STATEFUL_THREADED[hook]) == [True, True]


def _found_on_ddp():
    ddp, state, step = _model("gtopk", STATEFUL["gtopk"])
    return step.hook_state is state


def test_the_step_finds_the_hook_state_on_ddp(run_ranks):
    """TrainStep without ``hook_state`` uses the state registered on the DDP model: the protocol
    cannot be forgotten by a caller."""
    assert run_ranks(_found_on_ddp, 2) == [True, True]


def _protocol_of_every_hook():
    missing = []
    for name in HOOKS:
        state = register_hook(DDP(tiny_net()), name)
        missing += [f"{name}: {type(state).__name__}.{m}" for m in ("begin_step", "nonfinite_inputs", "end_step")
                    if not callable(getattr(state, m, None))]
    return missing


def test_every_hook_state_speaks_the_step_protocol(run_ranks):
    """begin_step / nonfinite_inputs / end_step on the state of every hook of the catalog (the
    training step calls them on whatever hook it runs)."""
    assert run_ranks(_protocol_of_every_hook, 2) == [[], []]


def _scaled_run(hook: str, options: dict, scale: float | None):
    """4 steps by hand with the gradients multiplied by ``scale`` (as GradScaler does) and divided
    after the exchange; returns the unscaled gradients, the hook's memories and its layer norms."""
    ddp = DDP(tiny_net(), bucket_cap_mb=0.005)
    state = register_hook(ddp, hook, **options)
    opt = torch.optim.SGD(ddp.parameters(), lr=0.05)
    grads = []
    for s in range(4):
        x, y = _batch(s)
        opt.zero_grad()
        state.begin_step(None if scale is None else torch.tensor(scale))
        loss = torch.nn.functional.cross_entropy(ddp(x), y, reduction="sum")
        (loss * (scale or 1.0)).backward()
        for p in ddp.parameters():
            p.grad.div_(scale or 1.0)
        state.end_step(kept=True)
        grads.append(torch.cat([p.grad.flatten() for p in ddp.parameters()]))
        opt.step()
    norms = dict(getattr(state, "layer_norms", {}))
    return torch.stack(grads), _comparable(state.state_dict()), norms


def _scale_invariant(hook: str, options: dict):
    plain = _scaled_run(hook, options, None)
    scaled = _scaled_run(hook, options, 2.0 ** 16)
    _assert_same(plain[0], scaled[0], f"{hook} gradients")
    _assert_same(plain[1], scaled[1], f"{hook} memories")
    _assert_same(plain[2], scaled[2], f"{hook} layer norms")
    return True


@pytest.mark.parametrize("hook", sorted(STATEFUL))
def test_memories_and_layer_norms_are_in_true_gradient_units(run_ranks, hook):
    """fp16's loss scale (2^16, a power of two) is divided out before anything is kept: the
    residuals, velocities, PowerSGD error / Q and LARS's layer norms of a scaled run are bit for
    bit those of the unscaled run (they were 65,536x larger)."""
    assert run_ranks(_scale_invariant, 2, hook, STATEFUL[hook]) == [True, True]


def _hidden_nan():
    """A NaN in one gradient entry on rank 0 that a sparse exchange does not select (its output is
    finite everywhere): the step still skips, on both ranks, and no memory takes the NaN."""
    ddp, state, step = _model("gtopk", dict(density=0.01, start_iter=2, selection="threshold"))
    for s in range(3):
        x, y = _batch(s)
        assert not step(lambda: (x, y), 16, step=s).skipped
    weight = ddp.module[2].weight
    if dist.get_rank() == 0:
        weight.register_hook(lambda g: g.index_put((torch.tensor([0]), torch.tensor([0])), torch.tensor(float("nan"))))
    x, y = _batch(3)
    res = step(lambda: (x, y), 16, step=3)
    return res.skipped, all(torch.isfinite(t).all() for t in floating_tensors(state.state_dict()))


def test_a_nan_the_sparse_output_hides_still_skips_the_step(run_ranks):
    assert run_ranks(_hidden_nan, 2) == [(True, True), (True, True)]


def _poisoned_memory_not_checkpointed():
    ddp, state, step = _model("topk", dict(density=0.05, start_iter=2))
    for s in range(3):
        x, y = _batch(s)
        step(lambda: (x, y), 16, step=s)
    if dist.get_rank() == 1:
        idx = next(iter(state.residuals))
        state.residuals[idx] = state.residuals[idx].clone().fill_(float("inf"))
    try:
        step.check_parameters("after step 2", buffers=True, memories=state.state_dict())
    except FloatingPointError as exc:
        return str(exc)
    return None


def test_a_non_finite_hook_memory_is_never_checkpointed(run_ranks):
    """The check before every checkpoint (TrainStep.check_parameters with buffers) refuses a
    non-finite residual on any rank, on every rank alike, naming the hook's memories."""
    for message in run_ranks(_poisoned_memory_not_checkpointed, 2):
        assert message is not None and "topk hook's memories" in message and "not checkpointed" in message


def _follows_dtype(hook: str, options: dict, device: str):
    """A state saved by a float32 model on the CPU, loaded (as a checkpoint loads it: on the CPU)
    into a float64 model on ``device``: the next steps run, and the memories live on the bucket's
    device and dtype."""
    ddp, state, step = _model(hook, options)
    for s in range(4):
        x, y = _batch(s)
        step(lambda: (x, y), 16, step=s)
    saved = copy.deepcopy(state.state_dict())
    net = tiny_net().to(device=device, dtype=torch.float64)
    ddp2 = DDP(net, bucket_cap_mb=0.005)
    state2 = register_hook(ddp2, hook, **options)
    state2.load_state_dict(saved)
    step2 = TrainStep(ddp2, torch.optim.SGD(ddp2.parameters(), lr=0.05),
                      torch.nn.CrossEntropyLoss(reduction="sum"), device=torch.device(device))
    for s in range(4, 7):
        x, y = _batch(s)
        assert not step2(lambda: (x.double(), y), 16, step=s).skipped
    memories = [t for k, t in _memory_tensors(state2)]
    assert memories, "no memory kept"
    return {(str(t.device.type), t.dtype) for t in memories}


def _memory_tensors(state):
    if hasattr(state, "residuals"):
        return list(state.residuals.items()) + list(state.velocities.items())
    s = state.powersgd
    return [kv for name in ("error_dict", "p_memory_dict", "q_memory_dict") for kv in getattr(s, name).items()]


DEVICES = ["cpu"] + (["cuda"] if torch.cuda.is_available() else [])


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("hook", ["topk", "gtopk", "powersgd"])
def test_a_loaded_state_follows_the_buckets_device_and_dtype(run_ranks, hook, device):
    if device == "cuda":
        pytest.skip("CUDA: tests/test_gpu_hooks.py (spawned ranks)")
    for kinds in run_ranks(_follows_dtype, 2, hook, STATEFUL[hook], device):
        assert kinds == {(device, torch.float64)}


def _units_under(precision: str, hook: str, options: dict):
    """5 steps of the trainer's step at ``precision`` (fp16: GradScaler at 2^16) with LARS reading
    the hook's layer norms; the norms of the hook's memories and LARS's layer norms."""
    from flashsgd.optim.lars import LARS

    ddp = DDP(tiny_net(), bucket_cap_mb=0.005)
    state = register_hook(ddp, hook, **options)
    opt = LARS(ddp.parameters(), lr=0.05, momentum=0.9)
    if getattr(state.options if hasattr(state, "options") else None, "layer_trust", False):
        opt.grad_norm_source = state.grad_norms
    step = TrainStep(ddp, opt, torch.nn.CrossEntropyLoss(reduction="sum"), precision=precision)
    for s in range(5):
        x, y = _batch(s)
        assert not step(lambda: (x, y), 16, step=s).skipped
    memory = torch.cat([t.flatten() for _, t in _memory_tensors(state)]).norm().item()
    norms = torch.stack(list(getattr(state, "layer_norms", {0: torch.ones(())}).values())).norm().item()
    return memory, norms, step.scaler.get_scale() if step.scaler is not None else None


def _fp16_against_fp32(hook: str, options: dict):
    return _units_under("fp32", hook, options), _units_under("fp16", hook, options)


@pytest.mark.parametrize("hook", ["topk", "powersgd"])
def test_fp16_memories_and_trust_norms_match_fp32_through_the_step(run_ranks, hook):
    """Through TrainStep (the scaler's scale handed to the hook): under fp16 the error-feedback
    memory and LARS's layer norms are those of fp32 to fp16's precision (before: 65,536x)."""
    for (mem32, norms32, _), (mem16, norms16, scale) in run_ranks(_fp16_against_fp32, 2, hook, STATEFUL[hook]):
        assert scale is not None and scale >= 2.0 ** 10  # the gradients really were scaled
        assert mem16 == pytest.approx(mem32, rel=0.05), (mem16, mem32)
        assert norms16 == pytest.approx(norms32, rel=0.05), (norms16, norms32)
