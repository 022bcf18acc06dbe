"""Check 1 of `flashsgd bench gpu`: every DDP hook of the catalog on the device's gradient buckets,
each compared with a reference computed without it.

Per world (Gloo with 2 and 4 ranks on one GPU, NCCL with 1 rank; ``--device cpu``: Gloo CPU ranks)
and per case of :func:`hook_cases` (every exchange of :data:`flashsgd.exchanges.EXCHANGES`, the
threaded variant of each that has the option, ``hgtopk`` with each node split, and the sparse
exchanges once more at density 0.05):

1. A small conv net (6 parameter tensors, 5,418 parameters; 2 KiB DDP buckets, so several
   buckets), the same weights on every rank, on the device; DDP with the hook registered (every
   wait on a peer bounded by ``timeout_s``).
2. :data:`PASSES` backward passes (the hooks' dense start, ``DENSE_ITERATIONS``, then one
   compressed pass), each on this rank's own batch, no optimizer step (the weights stay).
3. The reference of each pass, from a copy of the net without DDP:

   - ``dense`` (native, ring, hierarchical, torus2d; topk / gtopk / hgtopk at density 1.0, where a
     sparse exchange sends everything): the local gradients summed by one ``dist.all_reduce``, / W;
   - ``local`` (noop): this rank's own gradient;
   - ``mass`` (topk / gtopk / hgtopk at density 0.05; powersgd): dense passes as ``dense``; on the
     compressed pass error feedback conserves the gradient (Lin et al. 2018, Shi et al. 2019;
     Vogels et al. 2019, whose error memory torch's ``powerSGD_hook`` keeps per bucket as the
     local input minus the decompressed average):
     ``W x result + sum over ranks of the new residual == sum over ranks of (gradient + old
     residual)``, element by element.

4. Verdict: max |result - reference| / max |reference| over the passes and ranks <= :data:`TOLERANCE`
   (the summation orders differ), every rank without error, and a compressing exchange must have
   compressed (sparse bucket exchanges counted by its state, a residual left at density < 1;
   PowerSGD's Q memories and a non-zero error memory).

A case that kills a rank (a crash in C code) or hangs ends its world's job; the cases after it
run in a new job (:func:`run_hooks`), so one broken hook costs one row, not the check.
"""

from __future__ import annotations

import copy
import math
from dataclasses import dataclass
import torch
import torch.distributed as dist
from torch import nn
from torch.nn.parallel import DistributedDataParallel as DDP

from flashsgd.bench.gpu_common import (COLLECTIVE_TIMEOUT_S, GpuSettings, first_line, rank_device, record,
                                       run_job, verdict)
from flashsgd.exchanges import DENSE_ITERATIONS, EXCHANGES, NODE_SPLITS, SELECTIONS

PASSES = DENSE_ITERATIONS + 1
"""Backward passes per case: the exchanges' dense start, then one compressed pass."""

TOLERANCE = 1e-5
"""Max |result - reference| / max |reference|: fp32 sums in another order differ by ~1e-7."""

MASS_DENSITY = 0.05
"""Density of the error-feedback cases (k = 5% of each bucket: a residual is left)."""

BUCKET_MB = 2 / 1024
"""DDP bucket cap of the check's net, MiB (2 KiB: the 5,418 parameters fill several buckets)."""

PEER_TIMEOUT_S = 30.0
"""The hooks' ``timeout_s``: a wait on a peer longer than this raises (seconds; every case's
exchange of a 5,418-parameter net takes milliseconds), so a hook stuck on one rank costs its case
half a minute, not the job's collective timeout."""

HOOK_WORLDS = (2, 4)
"""Gloo ranks sharing one GPU (NCCL cannot put two ranks on one device)."""

_SHOWN = ("density", "selection", "node_split", "threaded")  # options named in a case's label


@dataclass(frozen=True)
class HookCase:
    """One hook with one set of options, and what it is compared with."""

    hook: str
    options: tuple[tuple[str, object], ...]
    reference: str
    """dense | local | mass (see the module docstring, Step 3)."""

    @property
    def label(self) -> str:
        shown = [f"{k}={v}" for k, v in self.options if k in _SHOWN]
        return " ".join([self.hook, *shown])


def _case(hook: str, reference: str, **options) -> HookCase:
    return HookCase(hook, tuple(options.items()), reference)


def hook_cases(world: int) -> list[HookCase]:
    """Every exchange of the catalog, with the variants named in the module docstring."""
    rpn = 2 if world > 2 and world % 2 == 0 else 1  # two levels to work with where the world allows
    cases = []
    for name, exchange in EXCHANGES.items():
        names = exchange.option_names()
        base = {"timeout_s": PEER_TIMEOUT_S}
        if "ranks_per_node" in names:
            base["ranks_per_node"] = rpn
        variants = [{"node_split": s} for s in NODE_SPLITS] if "node_split" in names else [{}]
        if "threaded" in names:
            variants.append({"threaded": not exchange.defaults()["threaded"]})
        if exchange.family == "sparse":
            cases += [_case(name, "dense", density=1.0, **base, **v) for v in variants]
            mass = ([{"node_split": s} for s in NODE_SPLITS] if "node_split" in names
                    else [{"selection": s} for s in SELECTIONS])
            cases += [_case(name, "mass", density=MASS_DENSITY, **base, **v) for v in mass]
        else:
            reference = {"none": "local", "lowrank": "mass"}.get(exchange.family, "dense")
            cases += [_case(name, reference, **base, **v) for v in variants]
    return cases


# ----------------------------------------------------------------------------- one rank ------

def _net(device: torch.device) -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Conv2d(3, 16, 3, padding=1), nn.ReLU(), nn.Conv2d(16, 32, 3, padding=1),
                         nn.ReLU(), nn.AdaptiveAvgPool2d(1), nn.Flatten(), nn.Linear(32, 10)).to(device)


def _ddp(net: nn.Module, device: torch.device) -> DDP:
    return DDP(net, bucket_cap_mb=BUCKET_MB, device_ids=[device.index] if device.type == "cuda" else None)


def _grads(model: nn.Module, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    """The flat gradient of one backward pass (through DDP and its hook, if ``model`` is one)."""
    model.zero_grad(set_to_none=True)
    nn.functional.cross_entropy(model(x), y).backward()
    return torch.cat([p.grad.detach().flatten() for p in model.parameters()])


def _per_param(memories: dict, layouts: dict, params: list[torch.Tensor]) -> torch.Tensor:
    """Per-bucket flat memories (a sparse hook's residuals, PowerSGD's errors) flat in parameter
    order, zeros where none is kept. ``layouts``: bucket index -> ((position, numel or shape), ...)
    in buffer order, as the hook states record them."""
    per_param = {}
    for idx, flat in memories.items():
        offset = 0
        for pos, size in layouts[idx]:
            numel = size if isinstance(size, int) else math.prod(size)
            per_param[pos] = flat[offset:offset + numel]
            offset += numel
    # (Gloo on CUDA: a sparse hook keeps its residuals on the host, hook_common.HostBucket)
    return torch.cat([per_param[i].detach().flatten().to(p.device) if i in per_param else torch.zeros_like(p).flatten()
                      for i, p in enumerate(params)])


def _residuals(hook: str, state, params: list[torch.Tensor]) -> torch.Tensor:
    """What the hook kept back for later steps: the sparse residuals or PowerSGD's error feedback."""
    if EXCHANGES[hook].family == "lowrank":
        return _per_param(state.powersgd.error_dict, state.layouts, params)
    return _per_param(state.residuals, state.layouts, params)


def _summed(t: torch.Tensor) -> torch.Tensor:
    t = t.clone()
    dist.all_reduce(t)
    return t


def _run_case(case: HookCase, device: torch.device) -> tuple[float, bool]:
    """Steps 1-3 on this rank: (max relative difference over the passes, compressed)."""
    from flashsgd.comm.hooks import register_hook

    rank, world = dist.get_rank(), dist.get_world_size()
    options = dict(case.options)
    plain = _net(device)
    ddp = _ddp(copy.deepcopy(plain), device)
    state = register_hook(ddp, case.hook, **options)                                    # Step 1
    params = list(ddp.module.parameters())
    worst, residual = 0.0, None
    for i in range(PASSES):                                                             # Step 2
        g = torch.Generator(device=device).manual_seed(1000 * rank + i)
        x = torch.randn(8, 3, 8, 8, device=device, generator=g)
        y = torch.randint(0, 10, (8,), device=device, generator=g)
        if case.reference == "mass":
            residual = _residuals(case.hook, state, params)
        got, local = _grads(ddp, x, y), _grads(plain, x, y)
        if case.reference == "local":                                                   # Step 3
            want = local
        elif case.reference == "mass" and i == PASSES - 1:
            got = got * world + _summed(_residuals(case.hook, state, params))
            want = _summed(local + residual)
        else:
            want = _summed(local) / world
        worst = max(worst, ((got - want).abs().max() / want.abs().max().clamp_min(1e-30)).item())
    return worst, _compressed(case, state, params)


def _compresses(hook: str) -> bool:
    return hook in EXCHANGES and EXCHANGES[hook].compresses


def _compressed(case: HookCase, state, params: list[torch.Tensor]) -> bool:
    """Step 4's evidence that a compressing exchange compressed (True for the others)."""
    family = EXCHANGES[case.hook].family
    if family == "sparse":
        left = case.reference != "mass" or bool(_residuals(case.hook, state, params).abs().sum() > 0)
        return state.sparse_buckets > 0 and left
    if family == "lowrank":
        return len(state.powersgd.q_memory_dict) > 0 and bool(_residuals(case.hook, state, params).abs().sum() > 0)
    return True


def hooks_rank(cases: list[HookCase], settings: GpuSettings, progress: str) -> list[dict]:
    """Every case on this rank; rank 0 prints each row as it is measured and records it in
    ``progress`` (:func:`~flashsgd.bench.gpu_common.record`: kept when a later case kills the job)."""
    device = rank_device(settings)
    if device.type == "cpu":
        torch.set_num_threads(1)  # a 5,418-parameter net: a thread pool costs more than it saves
    world, backend = dist.get_world_size(), dist.get_backend()
    rows = []
    for case in cases:
        try:
            diff, compressed = _run_case(case, device)
            error = "" if diff == diff else "non-finite gradients"  # NaN != NaN
        except Exception as exc:  # noqa: BLE001 - a failed case is a row; the next case still runs
            diff, compressed, error = 0.0, False, f"{type(exc).__name__}: {first_line(exc)}"
        flags = torch.tensor([0.0 if error else diff, 0.0 if compressed else 1.0],  # (worst diff, not compressed)
                             dtype=torch.float64, device=device)
        dist.all_reduce(flags, op=dist.ReduceOp.MAX)                                    # Step 4
        errors = [None] * world
        dist.all_gather_object(errors, error)
        failed = "; ".join(f"rank {r}: {e}" for r, e in enumerate(errors) if e)
        row = {"check": "hooks", "world": world, "backend": backend, "device": str(device),
               "case": case.label, "hook": case.hook, "options": dict(case.options),
               "reference": case.reference, "rel_diff": None if failed else flags[0].item(),
               "tolerance": TOLERANCE, "error": failed or None,
               "compressed": flags[1].item() == 0.0 if _compresses(case.hook) else None}
        row["passed"] = not failed and row["rel_diff"] <= TOLERANCE and row["compressed"] is not False
        rows.append(row)
        record(progress, row, format_row(row))
    return rows


# ------------------------------------------------------------------------------ launcher ------

HEADER = (f"{'ranks':>5} {'backend':>7}  {'hook (options)':<38} {'reference':<9} {'max rel diff':>12} "
          f"{'tol':>7} {'compressed':>10}  result")


def format_row(row: dict) -> str:
    diff = "-" if row.get("rel_diff") is None else f"{row['rel_diff']:.1e}"
    line = (f"{row['world']:>5} {row['backend']:>7}  {row['case']:<38} {row['reference']:<9} {diff:>12} "
            f"{row['tolerance']:>7.0e} {_yes_no(row.get('compressed')):>10}  {verdict(row['passed'])}")
    return line + (f"  ({row['error']})" if row.get("error") else "")


def _yes_no(value: bool | None) -> str:
    return "-" if value is None else ("yes" if value else "no")


def run_hooks(settings: GpuSettings, worlds: tuple[int, ...]) -> list[dict]:
    """Check 1: the cases of every world (Gloo on one GPU; NCCL at world 1), rows printed as measured.

    A job that fails (a rank crashed or hung) keeps the rows its rank 0 finished, records the case
    it was running as failed with the launcher's diagnosis, and restarts with the cases after it.
    """
    runs = [(w, "gloo") for w in worlds] + [(1, "nccl" if settings.cuda else "gloo")]
    rows: list[dict] = []
    for world, backend in runs:
        if backend == "nccl" and not dist.is_nccl_available():
            rows.append({**_failed_row(hook_cases(1)[0], 1, backend, settings, "torch is built without NCCL"),
                         "case": "(every hook)", "passed": None})
            print(format_row(rows[-1]), flush=True)
            continue
        rows += _run_world(world, backend, settings)
    return rows


def _run_world(world: int, backend: str, settings: GpuSettings) -> list[dict]:
    pending, rows = hook_cases(world), []
    while pending:
        done, error = run_job(hooks_rank, world, (pending, settings), settings, backend,
                              deadline_s=len(pending) * 2 * COLLECTIVE_TIMEOUT_S)
        rows += done
        if error is not None:  # the case after the finished ones broke the job
            rows.append(_failed_row(pending[len(done)], world, backend, settings, f"the job failed: {error}"))
            print(format_row(rows[-1]), flush=True)
            done = done + [rows[-1]]
        pending = pending[len(done):]
    return rows


def _failed_row(case: HookCase, world: int, backend: str, settings: GpuSettings, error: str) -> dict:
    return {"check": "hooks", "world": world, "backend": backend, "device": settings.device,
            "case": case.label, "hook": case.hook, "options": dict(case.options),
            "reference": case.reference, "rel_diff": None, "tolerance": TOLERANCE, "compressed": None,
            "error": error, "passed": False}

