"""GPU tests of the training step with the stateful hooks (all marked ``gpu``: skipped without CUDA;
run them with ``pytest -m gpu``): fp16 on CUDA with every compressing hook and LARS ``layer_trust``,
an injected gradient overflow that the scaler skips without touching any hook memory, and the host
synchronizations of one step counted by ``torch.cuda.set_sync_debug_mode``.

Ranks: NCCL with one rank (the CUDA path itself: NCCL cannot run two ranks on one GPU) and two Gloo
ranks sharing GPU 0 (CUDA buckets staged through the host, ``flashsgd.comm.hook_common.ddp_hook``).
"""

from __future__ import annotations


import pytest
import torch
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel as DDP

from ddp_helpers import tiny_net
from flashsgd.comm.hook_common import floating_tensors
from flashsgd.comm.hooks import register_hook
from flashsgd.train.step import TrainStep

pytestmark = pytest.mark.gpu

COMPRESSING = {
    "topk": dict(density=0.05, start_iter=2, layer_trust=True),
    "gtopk": dict(density=0.05, start_iter=2, layer_trust=True, selection="threshold"),
    "hgtopk": dict(density=0.05, start_iter=2, ranks_per_node=1, layer_trust=True),
    "powersgd": dict(matrix_approximation_rank=2, start_iter=2),
}
LAYOUTS = [("nccl", 1), ("gloo", 2)]


def _batch(step: int, device: torch.device):
    g = torch.Generator().manual_seed(1000 * step + dist.get_rank())
    x, y = torch.randn(8, 20, generator=g), torch.randint(0, 5, (8,), generator=g)
    return x.to(device), y.to(device)


def _cuda_step(hook: str, options: dict, precision: str):
    from flashsgd.optim.lars import LARS

    device = torch.device("cuda", 0)
    ddp = DDP(tiny_net().to(device), bucket_cap_mb=0.005)
    state = register_hook(ddp, hook, **options)
    opt = LARS(ddp.parameters(), lr=0.05, momentum=0.9)
    if options.get("layer_trust"):
        opt.grad_norm_source = state.grad_norms
    step = TrainStep(ddp, opt, torch.nn.CrossEntropyLoss(reduction="sum"), device=device, precision=precision,
                     hook_state=state)
    return ddp, state, step


def _memories(state) -> list[torch.Tensor]:
    if hasattr(state, "residuals"):
        return list(state.residuals.values()) + list(state.velocities.values())
    s = state.powersgd
    return [t for name in ("error_dict", "q_memory_dict") for t in getattr(s, name).values()]


def _fp16_run(hook: str, options: dict):
    """fp32 and fp16 runs of 6 steps; in the fp16 run rank 0's gradient overflows (an Inf in one
    entry, the loss finite) at step 4: skipped as the scaler's overflow, every hook memory as before."""
    out = {}
    for precision in ("fp32", "fp16"):
        ddp, state, step = _cuda_step(hook, options, precision)
        weight = ddp.module[2].weight
        for s in range(6):
            x, y = _batch(s, step.device)
            if precision == "fp16" and s == 4:
                before = [t.clone() for t in floating_tensors(state.state_dict())]
                handle = weight.register_hook(lambda g: g.index_fill(0, torch.tensor([0], device=g.device),
                                                                      float("inf"))) \
                    if dist.get_rank() == 0 else None
                res = step(lambda: (x, y), 8 * dist.get_world_size(), step=s)
                if handle is not None:
                    handle.remove()
                after = floating_tensors(state.state_dict())
                assert res.skipped and res.overflow, res
                assert len(before) == len(after) and all(torch.equal(a.cpu(), b.cpu()) for a, b in zip(before, after))
                continue
            res = step(lambda: (x, y), 8 * dist.get_world_size(), step=s)
            assert not res.skipped or res.overflow, res  # (the scaler's own early back-off may skip)
        memories = _memories(state)
        # NCCL: on the GPU; Gloo: the hook runs on a host copy of the bucket (HostBucket), so there
        # copy, except PowerSGD, whose all-reduces Gloo runs on the CUDA bucket itself
        on_gpu = "nccl" in str(dist.get_backend()) or hook == "powersgd"
        assert all(t.is_cuda == on_gpu for t in memories if t.numel()), "a memory on the wrong device"
        out[precision] = (torch.cat([t.flatten().float().cpu() for t in memories]).norm().item(),
                          torch.stack(list(getattr(state, "layer_norms", {0: torch.ones(())}).values())).norm().item())
    return out


def _fp16_every_hook():
    """:func:`_fp16_run` for every compressing hook, in one spawned job (the GPU check's test step
    has minutes, and each spawn starts CUDA and NCCL)."""
    return {hook: _fp16_run(hook, options) for hook, options in COMPRESSING.items()}


@pytest.mark.parametrize("backend,world", LAYOUTS)
def test_fp16_on_cuda_keeps_memories_and_trust_norms_in_true_units(run_ranks, backend, world):
    for per_hook in run_ranks(_fp16_every_hook, world, backend=backend):
        for hook, out in per_hook.items():
            (mem32, norms32), (mem16, norms16) = out["fp32"], out["fp16"]
            # fp16 skipped one more step (the overflow): the memories are of the same size, not equal
            # (before the hooks were told the loss scale: 65,536x)
            assert mem16 == pytest.approx(mem32, rel=0.5), (hook, out)
            assert norms16 == pytest.approx(norms32, rel=0.5), (hook, out)


def _count_syncs(hook: str, options: dict):
    """Host synchronizations of one training step after warm-up, by
    :func:`flashsgd.host_syncs.count_host_syncs` (torch's ``set_sync_debug_mode('warn')`` on CUDA:
    a warning at each implicit one: ``.item()``, ``nonzero``, a blocking copy)."""
    from flashsgd.host_syncs import count_host_syncs

    ddp, state, step = _cuda_step(hook, options, "bf16")
    for s in range(WARMUP_STEPS):
        x, y = _batch(s, step.device)
        step(lambda: (x, y), 8 * dist.get_world_size(), step=s)
    x, y = _batch(WARMUP_STEPS, step.device)
    torch.cuda.synchronize()
    with count_host_syncs(step.device) as syncs:
        step(lambda: (x, y), 8 * dist.get_world_size(), step=WARMUP_STEPS)
    return syncs.count, syncs.sites


WARMUP_STEPS = 11
"""Steps before the counted one: outside the first 10 iterations, in which DDP's runtime-stats
logger reads its CUDA timing events (torch's ``Reducer::should_collect_runtime_stats``). On an H100
every step from 10 on counted 1 (native, torch's ``allreduce_hook``, torus2d); the 2 once counted
for ``native`` here was torch's one-time "prototype" notice of the sync debug mode, which
:func:`flashsgd.host_syncs.count_host_syncs` now leaves out."""
SYNC_CASES = {"native": {}, "torus2d": {}, "topk": dict(density=0.05, start_iter=2, selection="threshold")}


def _count_every_hook():
    return {hook: _count_syncs(hook, options) for hook, options in SYNC_CASES.items()}


def test_host_synchronizations_of_one_step_are_counted(run_ranks):
    """The default step waits once (the agreed [loss, samples, non-finite]; issue 31: 11-12
    before); the sparse selection's data-dependent shapes add theirs (printed for docs/gpu.md with
    ``-s``; the CPU count of the same step: tests/test_host_syncs.py)."""
    (counts,) = run_ranks(_count_every_hook, 1, backend="nccl")
    for hook, (syncs, sites) in counts.items():
        print(f"{hook}: {syncs} host synchronizations in one bf16 step (NCCL, 1 rank) at {sites}")
    assert counts["native"][0] == counts["torus2d"][0] == 1, counts
    assert 1 <= counts["topk"][0] <= 60, counts
