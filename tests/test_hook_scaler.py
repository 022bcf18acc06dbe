"""A stateful hook inside a user's own torch AMP loop (issue 47): ``register_hook(..., scaler=scaler)``
is the one extra keyword; nothing else of flashsgd runs in the loop.

On 2 Gloo ranks with CPU autocast fp16 and ``torch.amp.GradScaler("cpu")``, for every stateful hook
(topk and hgtopk with LARS layer norms, gtopk with DGC's momentum correction and clipping, gtopk on
its communication thread, powersgd):

- the hook's memories (and layer norms) are those of the same loop in fp32 to within 1% (without
  ``scaler=`` they were 65,536x);
- an overflow injected on rank 1 only (the loss x 1e30, as in the issue) is skipped by GradScaler on
  both ranks (``optimizer.step`` not run, the parameters unchanged), the scale backs off on both,
  every hook memory is bit for bit what it was before the step, and the run ends within 0.05 of the
  same run without the overflow;
- without ``scaler=``, a non-finite step tells rank 0 once what to pass.
"""

from __future__ import annotations

import warnings

import pytest
import torch
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel as DDP

from ddp_helpers import flat_params, tiny_net
from flashsgd.comm.hooks import register_hook
from test_hook_step import STATEFUL_THREADED, _assert_same, _batch, _comparable, _memory_tensors

STEPS = 12
OVERFLOW_AT = 6


def _own_loop(hook: str, options: dict, fp16: bool, overflow_at: int | None = None):
    """The loop of torch's AMP recipe, with the hook registered by the library API. Returns the
    losses, the hook's memory norm and layer-norm norm, and what the overflow step did."""
    torch.manual_seed(0)
    ddp = DDP(tiny_net(), bucket_cap_mb=0.005)  # several buckets
    scaler = torch.amp.GradScaler("cpu", init_scale=2.0 ** 16) if fp16 else None
    state = register_hook(ddp, hook.split("_")[0], **options, scaler=scaler)
    opt = torch.optim.SGD(ddp.parameters(), lr=0.05)
    losses, seen = [], {}
    for s in range(STEPS):
        x, y = _batch(s % 4)
        opt.zero_grad()
        with torch.autocast("cpu", dtype=torch.float16, enabled=fp16):
            loss = torch.nn.functional.cross_entropy(ddp(x), y)
        if s == overflow_at and dist.get_rank() == 1:
            loss = loss * 1e30  # finite in fp32; its gradients overflow fp16 (rank 1 only)
        if s == overflow_at:
            seen["before"] = (_comparable(state.state_dict()), dict(getattr(state, "layer_norms", {})))
            seen["params"], seen["scale"] = flat_params(ddp), scaler.get_scale()
        if scaler is None:
            loss.backward()
            opt.step()
        else:
            scaler.scale(loss).backward()
            scaler.step(opt)
            scaler.update()
        if s == overflow_at:
            seen["after"] = (_comparable(state.state_dict()), dict(getattr(state, "layer_norms", {})))
            seen["unchanged"] = torch.equal(flat_params(ddp), seen["params"])
            seen["scale_after"] = scaler.get_scale()
        losses.append(loss.item() if s != overflow_at else float("nan"))
    memory = torch.cat([t.flatten().float() for _, t in _memory_tensors(state)]).norm().item()
    norms = getattr(state, "layer_norms", {})
    trust = torch.stack([n.float() for n in norms.values()]).norm().item() if norms else None
    return losses, memory, trust, seen


def _fp16_loop_checks(hook: str, options: dict):
    fp32 = _own_loop(hook, options, fp16=False)
    fp16 = _own_loop(hook, options, fp16=True)
    over = _own_loop(hook, options, fp16=True, overflow_at=OVERFLOW_AT)
    seen = over[3]
    _assert_same(seen["before"], seen["after"], f"{hook}: memories across the skipped step")
    return {"memory": (fp32[1], fp16[1]), "trust": (fp32[2], fp16[2]), "unchanged": seen["unchanged"],
            "scales": (seen["scale"], seen["scale_after"]), "final": (fp16[0][-1], over[0][-1])}


@pytest.mark.parametrize("hook", sorted(STATEFUL_THREADED))
def test_own_fp16_loop_with_scaler_keeps_true_units_and_skipped_steps(run_ranks, hook):
    for r in run_ranks(_fp16_loop_checks, 2, hook, STATEFUL_THREADED[hook]):
        (m32, m16), (t32, t16) = r["memory"], r["trust"]
        assert m16 == pytest.approx(m32, rel=0.01), f"memories fp16 {m16} vs fp32 {m32} (loss-scaled: 65,536x)"
        if t32 is not None:
            assert t16 == pytest.approx(t32, rel=0.01), f"layer norms fp16 {t16} vs fp32 {t32}"
        assert r["unchanged"], "GradScaler did not skip optimizer.step on the overflow"
        assert r["scales"] == (2.0 ** 16, 2.0 ** 15), f"the scale did not back off on this rank: {r['scales']}"
        clean, skipped = r["final"]
        assert abs(clean - skipped) <= 0.05, f"final loss {skipped} vs {clean} without the overflow"


def _nan_without_scaler():
    torch.manual_seed(0)
    ddp = DDP(tiny_net(), bucket_cap_mb=0.005)
    state = register_hook(ddp, "gtopk", density=0.05, start_iter=2)
    opt = torch.optim.SGD(ddp.parameters(), lr=0.05)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        for s in range(6):
            x, y = _batch(s)
            opt.zero_grad()
            loss = torch.nn.functional.cross_entropy(ddp(x), y)
            if s in (3, 4) and dist.get_rank() == 1:
                loss = loss * float("nan")
            loss.backward()
            if torch.isfinite(torch.cat([p.grad.flatten() for p in ddp.parameters()])).all():
                opt.step()  # the loop skips a non-finite step itself: the hook puts its memories back
        state.state_dict()
    finite = all(torch.isfinite(t).all() for _, t in _memory_tensors(state))
    return [str(w.message) for w in caught if "scaler=scaler" in str(w.message)], finite


def test_a_nonfinite_step_without_a_scaler_says_what_to_pass_once(run_ranks):
    (msgs0, finite0), (msgs1, finite1) = run_ranks(_nan_without_scaler, 2)
    assert len(msgs0) == 1 and "register_hook(ddp, 'gtopk', ..., scaler=scaler)" in msgs0[0], msgs0
    assert msgs1 == []  # rank 0 only
    assert finite0 and finite1  # the NaN never reached a memory, on either rank


def test_a_scaler_that_is_not_one_is_refused():
    with pytest.raises(TypeError, match="a loss scaler is a torch.amp.GradScaler .* got float"):
        register_hook(object(), "gtopk", scaler=65536.0)
