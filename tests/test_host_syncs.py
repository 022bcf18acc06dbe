"""Host synchronizations of the training step (issue 31): the default step waits for the device
once, the read of the agreed [loss, samples, non-finite]; the sparse hooks' waits are counted.

On CPU the count is :func:`flashsgd.host_syncs.count_host_syncs`' (the calls that would wait on
CUDA); tests/test_gpu_step.py counts the same step on CUDA with torch's sync debug mode."""

from __future__ import annotations

import sys

import torch
import torch.distributed as dist

from flashsgd.exchanges import NODE_SPLITS
from flashsgd.host_syncs import count_host_syncs, watched


def test_the_counter_sees_what_would_wait_on_cuda_and_nothing_else():
    x = torch.randn(8)
    with count_host_syncs() as syncs:
        y = (x * 2 + 1).sum()                       # arithmetic: stays on the device
        torch.full((), 3.0, dtype=torch.float64)    # a fill: no copy
        _ = x[torch.arange(3)]                      # integer indexing: no size to read
        torch.repeat_interleave(x, torch.ones(8, dtype=torch.long), output_size=8)
    assert syncs.count == 0, syncs.calls
    with count_host_syncs() as syncs:
        y.item()
        x.tolist()
        bool(x[0] > 0)
        float(x[1])
        x.nonzero()
        _ = x[x > 0]                                # a boolean mask: its size is read
        torch.tensor(1.0, device=x.device)          # a blocking host-to-device copy on CUDA
        torch.repeat_interleave(x, torch.ones(8, dtype=torch.long))
    assert syncs.calls == ["item", "tolist", "__bool__", "__float__", "nonzero", "__getitem__", "tensor",
                           "repeat_interleave"]


def _count_default_step(extra: dict, steps: int = 3, unthreaded: bool = False):
    """Host syncs of each of ``steps`` steps (after 2 warm-up steps) of the default run's rank
    (MNIST-1D, the fujitsu recipe's LARS, the default exchange), as bench scaling builds it;
    ``unthreaded``: the hook exchanges on the calling thread (the one the counter watches)."""
    from flashsgd.train.config import resolve
    from flashsgd.train.data import ShardedSampler
    from flashsgd.train.data.loader import augmentation_key
    from flashsgd.train.plan import build_plan
    from flashsgd.train.rank import CommTimer, build_rank, load_data

    timed = CommTimer.wrap  # this forked rank's class: the hook runs where the counter cannot see
    CommTimer.wrap = lambda self, hook: timed(self, watched(hook))
    cfg = resolve(cli={"num_samples": 2000, "epochs": 2, "global_batch": 128, "progress": False, **extra})
    data = load_data(cfg)
    plan = build_plan(cfg, dist.get_world_size(), len(data.train), local_spawn=True, backend="gloo")
    parts = build_rank(plan, data, torch.device("cpu"))
    if unthreaded:
        parts.hook_state.comm = None
    sampler = ShardedSampler(plan.num_train, dist.get_rank(), dist.get_world_size(), cfg.run.seed)
    sampler.set_epoch(0, plan.batch_at(0))
    sizes, batches, key = sampler.global_sizes(), iter(sampler), augmentation_key(cfg.run.seed, 0)
    counts, calls = [], []
    for s in range(2 + steps):
        idx = next(batches)
        with count_host_syncs() as syncs:
            res = parts.step(lambda: data.train.batch(idx, True, key), sizes[s], lr=plan.lr_at(0.1), step=s)
        assert not res.skipped and res.total_s > 0 and res.forward_s > 0
        if s >= 2:
            counts.append(syncs.count)
            calls.append([f"{c} {w}" for c, w in zip(syncs.calls, syncs.sites)])
    return counts, calls, cfg.comm.algorithm


def test_on_cuda_only_torchs_sync_warnings_count_not_the_modes_prototype_notice(monkeypatch):
    """On CUDA the counter reads torch's warnings (``set_sync_debug_mode("warn")``). Torch's first
    ``set_sync_debug_mode`` of a process warns once that the mode "is a prototype feature and does not
    yet detect all synchronizing operations": counted as a sync on an H100 before (native 2 for 1).
    Torch's calls are stood in for on this CPU machine: the notice at the mode's switch, one real
    sync warning inside the block, and the warning's line recorded as its site."""
    import warnings

    monkeypatch.setattr(torch.cuda, "get_sync_debug_mode", lambda: 0)
    monkeypatch.setattr(torch.cuda, "set_sync_debug_mode", lambda mode: warnings.warn(
        "Synchronization debug mode is a prototype feature and does not yet detect all synchronizing "
        "operations (Triggered internally at Module.cpp)"))
    with count_host_syncs("cuda") as syncs:
        warnings.warn("called a synchronizing CUDA operation (Triggered internally at CUDAFunctions.cpp)")
        line = sys._getframe().f_lineno - 1
    assert syncs.calls == ["called a synchronizing CUDA operation (Triggered internally at CUDAFunctions.cpp)"]
    assert syncs.sites == [f"test_host_syncs.py:{line}"]


def test_the_default_step_has_exactly_one_host_sync(run_ranks):
    # on the old step: 4 .item() reads, a host-to-device scalar copy, 6 synchronizing clocks on CUDA
    for counts, calls, algorithm in run_ranks(_count_default_step, 2, {}):
        assert counts == [1, 1, 1], (algorithm, calls)
        assert calls[0][0].startswith("tolist step.py:"), calls


def test_the_dense_hooks_add_no_host_sync_on_the_calling_thread(run_ranks):
    # unthreaded: the hook's own calls run on the thread the counter watches
    for algorithm in ("ring", "torus2d"):
        for counts, calls, _ in run_ranks(_count_default_step, 2, {"algorithm": algorithm}, 2, True):
            assert counts == [1, 1], (algorithm, calls)


def _count_cuda_path(cases: dict[str, dict]):
    from flashsgd.host_syncs import as_if_cuda

    with as_if_cuda():  # the code path of CUDA buckets, on this CPU: what it would wait for on a GPU
        return {name: _count_default_step(extra, 3, True) for name, extra in cases.items()}


CUDA_PATH_CASES = {"topk": {}, "gtopk": {}, **{f"hgtopk-{split}": {"node_split": split} for split in NODE_SPLITS}}


def test_the_compressing_hooks_cuda_path_waits_for_nothing(run_ranks):
    """Issue 48: inside topk, gtopk and hgtopk (every node step) at the default selection (``auto``,
    which the CUDA path resolves to exact), no call would wait for the GPU, at 3 ranks (gTop-k's fold-in and
    fold-out) and 4 (a butterfly of 2 rounds): every step counts exactly the step's own read
    (``tolist`` of the agreed [loss, samples, flag]), but the first sparse step, which also runs the
    size check of each bucket once (one exchange of 3 integers per bucket: a tensor made from
    Python integers, and its rows read). Before: 16 at
    2 ranks and 24 at 4 with gtopk (the merges' masks, ``nonzero``, sizes read with ``int``, the
    counted indices by mask; tests/test_host_syncs.py at eefc2b2)."""
    cases = {name: {"algorithm": name.split("-")[0], "density": 0.05, "density_warmup": 0, **extra} for name, extra in CUDA_PATH_CASES.items()}
    for world in (3, 4):
        for name, (counts, calls, _) in run_ranks(_count_cuda_path, world, cases)[0].items():
            first, *rest = calls
            assert rest == [["tolist " + first[-1].split(" ", 1)[1]]] * 2, (name, world, calls)
            size_checks = [c.split()[0] for c in first[:-1]]  # once per bucket: 3 integers made, read
            assert sorted(set(size_checks)) in ([], ["tensor", "tolist"]) and \
                size_checks.count("tensor") == size_checks.count("tolist"), (name, world, calls)


def test_the_sparse_hooks_host_syncs_are_counted(run_ranks):
    """The sparse exchanges read sizes on the host (a selection's count, a merge's length): counted
    here and stated in docs/training.md ("Host synchronizations"); printed with ``-s``."""
    for algorithm in ("topk", "gtopk"):
        extra = {"algorithm": algorithm, "density": 0.05, "density_warmup": 0}
        counts, calls, _ = run_ranks(_count_default_step, 2, extra, 2, True)[0]
        print(f"{algorithm}: {counts} host syncs per step at 2 ranks: {calls}")
        assert 1 <= min(counts) and max(counts) <= 40, (algorithm, calls)


def _count_powersgd_cuda_path():
    """:func:`_count_default_step` with powersgd (rank 2) on the code path of CUDA buckets, with
    ``torch.cuda.synchronize`` counted too: this rank's process claims CUDA (as a GPU machine's
    ranks see it), so a hook that waits for the device after each bucket (torch's PowerSGD hook
    did: ``if torch.cuda.is_available(): torch.cuda.synchronize(device)``) shows here."""
    from flashsgd import host_syncs

    def synchronize(device=None):
        if host_syncs._ACTIVE:
            host_syncs._ACTIVE[-1].calls.append("synchronize")
            host_syncs._ACTIVE[-1].sites.append(host_syncs._caller())

    torch.cuda.is_available = lambda: True  # this rank's process only
    torch.cuda.synchronize = synchronize
    with host_syncs.as_if_cuda():
        return _count_default_step({"algorithm": "powersgd", "matrix_approximation_rank": 2}, 3, True)


def test_powersgds_cuda_path_waits_for_nothing(run_ranks):
    """PowerSGD (flashsgd.comm.lowrank, batched per bucket): its steps, the first compressed one
    (Q drawn on the host and copied without a wait) and the warm-started ones after it, count
    exactly the step's own read (``tolist`` of the agreed [loss, samples, flag]), at 2 and 3 ranks,
    no device-wide synchronization either. The hook runs on the calling thread here (the thread
    the counter watches). Torch's hook, inside the module before, also counted 1 here: its
    per-bucket ``synchronize`` was skipped for CPU buckets, and torch's sync debug mode does not
    flag it on a GPU either (0 in docs/gpu.md's H200 table); what it cost was the CPU waiting for
    the GPU at every bucket."""
    for world in (2, 3):
        for counts, calls, algorithm in run_ranks(_count_powersgd_cuda_path, world):
            assert algorithm == "powersgd" and counts == [1, 1, 1], (world, calls)
            assert all(c[0].startswith("tolist step.py:") for c in calls), (world, calls)
