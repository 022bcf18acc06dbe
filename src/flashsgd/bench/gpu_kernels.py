"""Checks 2 and 3 of `flashsgd bench gpu`: top-k selection and the LARS step on the device.

Both run in one rank (NCCL on CUDA, Gloo with ``--device cpu``) so that
:func:`flashsgd.timing.time_ops` times them as every benchmark does: warm-up calls excluded, the
compared functions interleaved with a rotating order, the device synchronized before each clock
read, the median over the repetitions with min and max.

Check 2, selection (the sparse hooks' Step 2, :mod:`flashsgd.comm.sparse.select`; the same
functions ``flashsgd bench sparse --selection-speed`` times): a random fp32 gradient of
``settings.numel`` elements on the device (ResNet-50's 25,557,032), per density ``torch.add`` over
it (the unit of one memory pass), ``torch.topk(|x|)`` (the baseline) and the exact, sampled and
threshold selections (threshold with and without the kept threshold). Reported: time, speed-up
over ``torch.topk``, passes, and agreement with ``torch.topk``: the same multiset of selected
magnitudes (the target: the selections return the exact top-k, up to ties) and the share of
torch.topk's indices found.

Check 3, LARS (:class:`flashsgd.optim.lars.LARS`, You et al. 2017 with Fujitsu's batched norms,
Yamazaki et al. 2019): one step over the model's parameters (ResNet-50: 161 tensors, 25.6M
parameters; biases and BN excluded from adaptation as in the recipes) beside
``torch.optim.SGD(foreach=True)`` with momentum over the same groups (the plain step every
trainer has); reported: both step times and their ratio (no target: LARS reads each tensor
twice more for its norms). Agreement: one LARS step from the same weights and gradients equals
the per-tensor loop of ``flashsgd bench lars`` (:func:`flashsgd.bench.lars.loop_lars_step`)
within :data:`LARS_TOLERANCE`.
"""

from __future__ import annotations

import copy

import torch
import torch.distributed as dist

from flashsgd.bench.gpu_common import GpuSettings, first_line, rank_device, record, verdict
from flashsgd.timing import Timing, time_ops

LARS_TOLERANCE = 1e-5
"""Max |LARS - loop| / max |weight| after one step (fp32; the same math in another order)."""

SELECT_HEADER = (f"{'method':<16} {'density':>8} {'k':>9} {'ms':>9} {'min..max ms':>19} {'x topk':>7} "
                 f"{'passes':>7} {'same':>5} {'indices':>8}  result")
LARS_HEADER = f"{'step':<16} {'ms':>9} {'min..max ms':>19} {'x sgd':>7} {'max rel diff':>13}  result"


def _ms(t: Timing) -> dict:
    return {"ms": t.median_s * 1e3, "min_ms": t.min_s * 1e3, "max_ms": t.max_s * 1e3, "reps": t.reps,
            "times_ms": [s * 1e3 for s in t.times_s]}


def _spread(row: dict) -> str:
    return f"{row['ms']:9.3f} {row['min_ms']:9.3f}..{row['max_ms']:<9.3f}"


# ---------------------------------------------------------------------------- selection ------

def _methods(x: torch.Tensor, k: int) -> dict:
    """name -> call: the pass unit, the baseline, and the selections (bench sparse's table)."""
    from flashsgd.bench.sparse import selection_methods

    return selection_methods(x, k)


def _agreement(picked, reference) -> tuple[bool, float]:
    """(same multiset of |values| as the reference, share of the reference's indices picked)."""
    values, indices = picked
    ref_values, ref_indices = reference
    same = values.numel() == ref_values.numel() and torch.equal(
        values.abs().sort().values, ref_values.abs().sort().values)
    mask = torch.zeros(max(int(ref_indices.max()) + 1, int(indices.max()) + 1), dtype=torch.bool,
                       device=indices.device)
    mask[ref_indices] = True
    return bool(same), mask[indices].sum().item() / ref_indices.numel()


def select_rows(settings: GpuSettings, device: torch.device, progress: str) -> list[dict]:
    """Check 2 for every density of ``settings`` (rows printed by rank 0 as measured)."""
    from flashsgd.comm.sparse.select import k_from_density

    g = torch.Generator(device=device).manual_seed(0)
    x = torch.randn(settings.numel, device=device, generator=g)  # (numel,) fp32, on the device
    _say(SELECT_HEADER)
    rows = []
    for density in settings.densities:
        k = k_from_density(settings.numel, density)
        methods = _methods(x, k)
        top = torch.topk(x.abs(), k, sorted=False)
        reference = (x[top.indices], top.indices)
        agree = {name: _agreement(fn(), reference) for name, fn in methods.items()
                 if name not in ("add (1 pass)", "torch.topk")}
        timings = dict(zip(methods, time_ops(list(methods.values()), settings.steps, settings.warmup,
                                             device=device)))
        unit, base = timings["add (1 pass)"].median_s, timings["torch.topk"].median_s
        for name, t in timings.items():
            same, share = agree.get(name, (None, None))
            row = {"check": "select", "method": name, "density": density, "k": k, "numel": settings.numel,
                   **_ms(t), "speedup_vs_topk": base / t.median_s if name != "add (1 pass)" else None,
                   "passes": t.median_s / unit, "same_magnitudes": same, "index_share": share,
                   "passed": same, "error": None}
            rows.append(row)
            record(progress, row, format_select(row))
    return rows


def format_select(row: dict) -> str:
    speed = "-" if row["speedup_vs_topk"] is None else f"{row['speedup_vs_topk']:.2f}"
    same = "-" if row["same_magnitudes"] is None else ("yes" if row["same_magnitudes"] else "no")
    share = "-" if row["index_share"] is None else f"{row['index_share']:.4f}"
    return (f"{row['method']:<16} {row['density']:>8g} {row['k']:>9d} {_spread(row)} {speed:>7} "
            f"{row['passes']:>7.2f} {same:>5} {share:>8}  {verdict(row['passed'])}")


# --------------------------------------------------------------------------------- LARS ------

def _groups(model: torch.nn.Module) -> list[dict]:
    """The recipes' groups (torch.optim.SGD ignores the ``lars`` key)."""
    from flashsgd.optim.lars import param_groups

    return param_groups(model, weight_decay=5e-5, exclude_bias_and_norm=True)


def lars_rows(settings: GpuSettings, device: torch.device, progress: str) -> list[dict]:
    """Check 3: LARS vs foreach SGD over the model's parameters, and LARS vs the loop."""
    from flashsgd.bench.lars import loop_lars_step
    from flashsgd.optim.lars import LARS
    from flashsgd.train.models import build_model

    from flashsgd.bench.gpu_common import MODEL_INPUTS

    torch.manual_seed(0)
    base = build_model(settings.model, MODEL_INPUTS[settings.model][1]).to(device)
    g = torch.Generator(device=device).manual_seed(1)
    grads = [torch.randn(p.shape, device=device, generator=g) * 1e-3 for p in base.parameters()]
    nets = [copy.deepcopy(base) for _ in range(3)]  # LARS, loop, SGD: each its own weights and state
    for net in nets:
        for p, grad in zip(net.parameters(), grads):
            p.grad = grad.clone()
    hp = dict(lr=0.1, momentum=0.9, trust_coefficient=0.001, eps=1e-9)
    lars = LARS(_groups(nets[0]), **hp)
    loop_groups = [dict(group, params=list(params)) for group, params in zip(
        lars.param_groups, _positions(lars.param_groups, nets[0], nets[1]))]
    lars.step()  # Step: agreement, from identical weights and gradients
    loop_lars_step(loop_groups, {})
    w_lars = torch.cat([p.detach().flatten() for p in nets[0].parameters()])
    w_loop = torch.cat([p.detach().flatten() for p in nets[1].parameters()])
    diff = ((w_lars - w_loop).abs().max() / w_loop.abs().max()).item()
    sgd = torch.optim.SGD(_groups(nets[2]), lr=hp["lr"], momentum=hp["momentum"], foreach=True)
    t_lars, t_sgd = time_ops([lars.step, sgd.step], settings.steps, settings.warmup, device=device)
    n = sum(p.numel() for p in base.parameters())
    tensors = len(list(base.parameters()))
    common = {"check": "lars", "model": settings.model, "params": n, "tensors": tensors, "error": None}
    rows = [{**common, "step": "lars", **_ms(t_lars), "ratio_to_sgd": t_lars.median_s / t_sgd.median_s,
             "rel_diff_vs_loop": diff, "tolerance": LARS_TOLERANCE, "passed": diff <= LARS_TOLERANCE},
            {**common, "step": "sgd (foreach)", **_ms(t_sgd), "ratio_to_sgd": 1.0, "rel_diff_vs_loop": None,
             "tolerance": None, "passed": None}]
    _say(f"# {settings.model}: {tensors} parameter tensors, {n:,} parameters, fp32")
    _say(LARS_HEADER)
    for row in rows:
        record(progress, row, format_lars(row))
    return rows


def _positions(groups: list[dict], model: torch.nn.Module, twin: torch.nn.Module) -> list[list]:
    """The parameters of ``twin`` at the positions ``groups`` hold in ``model`` (group by group)."""
    where = {id(p): i for i, p in enumerate(model.parameters())}
    twins = list(twin.parameters())
    return [[twins[where[id(p)]] for p in g["params"]] for g in groups]


def format_lars(row: dict) -> str:
    diff = "-" if row["rel_diff_vs_loop"] is None else f"{row['rel_diff_vs_loop']:.1e}"
    return (f"{row['step']:<16} {_spread(row)} {row['ratio_to_sgd']:>7.2f} {diff:>13}  "
            f"{verdict(row['passed'])}")


# ---------------------------------------------------------------------------------- rank ------

def _say(line: str) -> None:
    if dist.get_rank() == 0:
        print(line, flush=True)


def kernels_rank(settings: GpuSettings, checks: tuple[str, ...], progress: str) -> list[dict]:
    """Checks 2 and 3 (those named in ``checks``) in this rank, each finished row printed and
    recorded in ``progress`` (:func:`~flashsgd.bench.gpu_common.record`); a check that raises is
    one failed row."""
    device = rank_device(settings)
    rows = []
    for name, fn in (("select", select_rows), ("lars", lars_rows)):
        if name not in checks:
            continue
        _say(f"\n## {name}: " + {"select": f"top-k selection of {settings.numel:,} fp32 elements vs torch.topk",
                                 "lars": "LARS step vs foreach momentum SGD"}[name]
             + f" (median of {settings.steps} interleaved calls after {settings.warmup} warm-up)")
        try:
            rows += fn(settings, device, progress)
        except Exception as exc:  # noqa: BLE001 - one failed check is a row, the other still runs
            rows.append({"check": name, "passed": False, "error": f"{type(exc).__name__}: {first_line(exc)}"})
            record(progress, rows[-1], f"FAIL: {rows[-1]['error']}")
    return rows
