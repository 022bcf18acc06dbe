"""The per-rank building blocks of a run, shared by the worker and the benchmarks.

:class:`~flashsgd.train.worker.Worker` (``flashsgd train``), ``bench scaling``'s rank
(:mod:`flashsgd.bench.scaling_rank`) and ``bench train`` build a rank from these, in this order:
:func:`setup_process` (threads, determinism, device), :func:`load_data`, the model and the recipe's
optimizer, :func:`build_ddp` (DDP with per-worker BN buffers + the hook, timed by a
:class:`CommTimer`), :func:`compile_model` (``run.compile``), then
:class:`flashsgd.train.step.TrainStep` (precision, micro-batches, channels_last of the plan's
``execution``). Between epochs:
:func:`average_buffers` (Goyal et al. 2017: BN statistics are per worker while training) and
:func:`evaluate`. :func:`inject_fault` is the tests' fault injection.
"""

from __future__ import annotations

import os
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel as DDP

from flashsgd.train.config import TrainConfig, parse_fail_at
from flashsgd.train.data import Datasets, build_datasets
from flashsgd.train.ddp_wrap import wrap_ddp
from flashsgd.train.plan import RunPlan
from flashsgd.timing import Stamp, elapsed_s, reached, stamp
from flashsgd.train.step import TrainStep


class CommTimer:
    """Wraps the hook DDP calls and keeps, per bucket, a span from the hook call until its future
    completes: the whole exchange for synchronous, threaded and NCCL hooks alike (overlapped with
    backward when the hook is asynchronous, so the sum can exceed the exposed time). The spans are
    :func:`~flashsgd.timing.stamp` pairs: on CUDA two events, the second recorded by the future's
    callback on a stream that waits for the exchange's work, so the span is the exchange on the GPU
    (not the time to enqueue it) and taking it syncs nothing; :meth:`take` hands a step its spans.
    DDP's built-in all-reduce (``native``) registers no hook and is not measured."""

    def __init__(self) -> None:
        self.spans: list[tuple[Stamp, Stamp]] = []   # since the last take()
        self.unread: list[tuple[Stamp, Stamp]] = []  # handed out, not yet added to total_s
        self.total_s = 0.0                            # the spans read so far

    def wrap(self, hook):
        def timed(state, bucket):
            device = bucket.buffer().device
            start = stamp(device)

            def done(fut):  # runs when the exchange completes (CUDA: is enqueued; never blocks)
                self.spans.append((start, stamp(device)))
                return fut.value()

            return hook(state, bucket).then(done)
        return timed

    def take(self) -> tuple[tuple[Stamp, Stamp], ...]:
        """The spans of the buckets exchanged since the last call (one step's)."""
        spans, self.spans = tuple(self.spans), []
        self._read(wait=False)  # the earlier steps' spans that have passed: no CUDA event piles up
        self.unread.extend(spans)
        return spans

    def _read(self, wait: bool) -> None:
        keep = []
        for a, b in self.unread:
            if wait or reached(b):
                self.total_s += elapsed_s(a, b)
            else:
                keep.append((a, b))
        self.unread = keep

    @property
    def seconds(self) -> float:
        """Seconds of every exchange so far (on CUDA: waits until the last one has run)."""
        self._read(wait=True)
        return self.total_s + sum(elapsed_s(a, b) for a, b in self.spans)


@torch.no_grad()
def average_buffers(model: torch.nn.Module, inplace: bool = True) -> dict[str, torch.Tensor]:
    """Average the float buffers (BN running statistics) over workers; returns {name: average}.

    Training never reads them (BN uses batch statistics), so averaging before eval changes no
    parameter. ``inplace=False`` leaves the model's per-worker buffers untouched (checkpoints).
    """
    named = [(n, b) for n, b in model.named_buffers() if b.is_floating_point()]
    if not named:
        return {}
    flat = torch.cat([b.reshape(-1) for _, b in named])
    if dist.get_world_size() > 1:
        dist.all_reduce(flat)
        flat /= dist.get_world_size()
    avg = dict(zip([n for n, _ in named],
                   [t.view_as(b) for t, (_, b) in zip(flat.split([b.numel() for _, b in named]), named)]))
    if inplace:
        for n, b in named:
            b.copy_(avg[n])
    return avg


@torch.no_grad()
def evaluate(model: torch.nn.Module, split, rank: int, world: int, device: torch.device,
             chunk: int = 1024, workers: int = 0, autocast: torch.dtype | None = None,
             channels_last: bool = False) -> tuple[float, float]:
    """(accuracy %, mean loss) on ``split``, each rank scoring a contiguous shard (image folders
    decoded by ``workers`` DataLoader processes, in chunks of at most 256 images, handed over as
    uint8 or encoded files and normalized on ``device``, in ``channels_last`` when asked:
    :func:`flashsgd.train.data.loader.eval_batches`). The forward runs under the training step's
    autocast (``autocast``: :data:`flashsgd.train.step.PRECISIONS`' dtype, None: fp32), the loss
    in fp32. The sums stay on the device until the one all-reduce (no host sync per chunk)."""
    from flashsgd.train.data.loader import eval_batches, streams

    model.eval()
    n = len(split)
    lo, hi = rank * n // world, (rank + 1) * n // world
    stats = torch.zeros(3, dtype=torch.float64, device=device)
    chunk = min(chunk, 256) if streams(split) else chunk
    for x, y in eval_batches(split, lo, hi, chunk, workers, device=device, channels_last=channels_last):
        if channels_last and x.dim() == 4:  # as the step does (a no-op for image folders: made so)
            x = x.contiguous(memory_format=torch.channels_last)
        with torch.autocast(device.type, dtype=autocast, enabled=autocast is not None):
            out = model(x)
        stats[0] += (out.argmax(1) == y).sum()
        stats[1] += len(y)
        stats[2] += torch.nn.functional.cross_entropy(out.float(), y, reduction="sum")
    model.train()
    dist.all_reduce(stats)
    return 100.0 * stats[0].item() / stats[1].item(), stats[2].item() / stats[1].item()


def inject_fault(spec: str, rank: int, step: int) -> bool:
    """Debug (tests): at ``step`` on ``rank`` exit the process, hang, or return True (NaN loss).

    Only in the first attempt of a torchrun elastic group (TORCHELASTIC_RESTART_COUNT 0/unset).
    """
    if not spec or os.environ.get("TORCHELASTIC_RESTART_COUNT", "0") != "0":
        return False
    r, s, mode = parse_fail_at(spec)
    if r != rank or s != step:
        return False
    if mode == "exit":
        print(f"[flashsgd] fault injection: rank {rank} exits at step {step}", flush=True)
        os._exit(17)
    if mode == "hang":
        print(f"[flashsgd] fault injection: rank {rank} hangs at step {step}", flush=True)
        time.sleep(10 ** 6)
    return mode == "nan"


def setup_process(plan: RunPlan) -> torch.device:
    """Step 1: intra-op threads (cores shared by this node's ranks), determinism, device."""
    r = plan.config.run
    local_world = int(os.environ.get("LOCAL_WORLD_SIZE", plan.world))
    torch.set_num_threads(r.threads or max(1, (os.cpu_count() or 1) // local_world))
    torch.use_deterministic_algorithms(r.deterministic)
    torch.backends.cudnn.benchmark = bool(plan.execution.get("cudnn_benchmark", False))  # the plan's choice
    if dist.get_backend() == "nccl":
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device("cpu")


def build_ddp(plan: RunPlan, model: torch.nn.Module, device: torch.device, timer: CommTimer):
    """Step 2 (second half): DDP with per-worker BN buffers, the hook; returns (ddp, state, topology)."""
    from flashsgd.comm.hooks import register_hook
    from flashsgd.comm.topology import get_topology

    c = plan.config.comm
    topo = get_topology(ranks_per_node=plan.ranks_per_node, grid=c.grid, timeout_s=plan.config.run.timeout_s)
    ddp = wrap_ddp(model, device, c.bucket_mb)
    if plan.exchange_options is None:  # --comm auto resolves the exchange (and its options) first
        raise ValueError(f"the plan of exchange {c.algorithm!r} has no options object: resolve --comm auto first")
    state = register_hook(ddp, c.algorithm, plan.exchange_options, wrap=timer.wrap)  # checked by the plan
    return ddp, state, topo


class _CompiledOrEager:
    """``torch.compile(ddp)`` that compiles once for every batch size of a run, and runs ``ddp``
    itself for good once compiling fails, at the first compile or at any later one.

    Dynamo specializes a graph to its input's sizes: a size that changes recompiles, and only then
    becomes dynamic (automatic dynamic shapes), the storage offset with it (0/1-specialized:
    ``2 <= offset``, one more graph for offset 0). A run changes the shard size: the epoch's last
    batch (a merged remainder), ``grad_accum`` micro-batches that differ by one sample (views of
    the shard, at offsets > 0 after the first), the 2-sample forward of
    :func:`~flashsgd.comm.hooks.rebuild_buckets` after a resume. So, on each call:

    1. Dim 0 (the batch) is marked dynamic (``maybe_mark_dynamic``) before the call: the first
       compile makes the graph that every later batch size >= 2 and every micro-batch reuses (the
       graph automatic dynamic shapes reached only after a recompile; its first input is at offset
       0, which leaves the offset free). Every other dim stays static. Sizes 0 and 1 stay
       specialized (torch's default; ``backed_size_oblivious`` would lift it but is experimental):
       a 1-sample shard (a last remainder of W..2W-1 samples gives some) compiles one more graph,
       once per run. A model that needs a fixed batch size still compiles, one graph per size
       (``maybe``: no error).
    2. A call that raises is run again eagerly on the same input: when eager succeeds, the
       failure was the compiler's (``BackendCompilerFailed``, ``InductorError``, DDPOptimizer's
       assertions, a ``TorchRuntimeError`` of Dynamo's own), at the first compile or a later
       recompile: one line on rank 0 (:func:`_compile_fallback`) and ``ddp`` from then on; when
       eager raises too, that is the model's own error, raised as eager raises it (no line). A
       collective's failure and out-of-memory propagate at once (no second try). What ran before
       the failing graph runs twice on that call (DDP's pre-forward; with graph breaks inside the
       model, its first part: BN statistics). A backward graph compiled lazily (at
       ``loss.backward()``) fails outside this call and is not caught here.
    """

    def __init__(self, compiled, eager) -> None:
        self.fn, self.eager = compiled, eager

    def __call__(self, x):
        if self.fn is self.eager:
            return self.eager(x)
        if isinstance(x, torch.Tensor) and x.dim() > 0:                                # Step 1
            torch._dynamo.maybe_mark_dynamic(x, 0)
        try:
            return self.fn(x)
        except (dist.DistError, torch.OutOfMemoryError):                              # Step 2
            raise
        except Exception as exc:  # noqa: BLE001 - the compiler's when eager succeeds (below)
            failure = exc
        out = self.eager(x)  # the model's own error raises here, as itself
        _compile_fallback(failure)
        self.fn = self.eager
        return out


def _compile_fallback(exc: BaseException) -> None:
    """The one line on rank 0 that says the run goes on eagerly, naming the compiler's error (the
    backend's own exception, not Dynamo's wrapper of it)."""
    while getattr(exc, "inner_exception", None) is not None:  # BackendCompilerFailed, InductorError
        exc = exc.inner_exception
    if not dist.is_initialized() or dist.get_rank() == 0:
        reason = (str(exc).strip().splitlines() or [""])[0][:160]
        print(f"[flashsgd] torch.compile failed ({type(exc).__name__}: {reason}); "
              "training the model eagerly (run.compile = false)", flush=True)


def compile_model(ddp: torch.nn.Module, backend=None):
    """``run.compile``: what the step calls on its input, ``torch.compile(ddp)`` (DDP wrapped, so
    its buckets and the hook stay; TorchDynamo's DDPOptimizer splits the graph at bucket
    boundaries, which is one compile, not a recompile) with the batch dimension dynamic from the
    first call, or ``ddp`` itself with one line on rank 0 when compiling fails, at the call or at
    any compile of a forward (:class:`_CompiledOrEager`). ``backend``: torch.compile's (None: its
    default, inductor; the tests use ``aot_eager``, which needs no C++ compiler)."""
    try:
        return _CompiledOrEager(torch.compile(ddp, **({} if backend is None else {"backend": backend})), ddp)
    except Exception as exc:  # noqa: BLE001
        _compile_fallback(exc)
        return ddp


@dataclass
class RankParts:
    """What one rank trains with (:func:`build_rank`)."""

    plan: RunPlan
    """The run plan (``--comm auto``: with the exchange chosen at start-up)."""
    model: torch.nn.Module
    optimizer: torch.optim.Optimizer
    loss_fn: torch.nn.Module
    model_tweaks: list[str]
    timer: CommTimer
    ddp: DDP
    hook_state: Any
    topology: Any
    step: TrainStep
    auto: dict | None = None
    """``--comm auto``'s record (measurements, choice), None otherwise."""


def build_rank(plan: RunPlan, data: Datasets, device: torch.device, *, out: Path | None = None,
               resume_from: Path | None = None) -> RankParts:
    """Step 2 for one rank: the model (same seed on every rank), the recipe's tweaks and optimizer
    (:mod:`flashsgd.optim.plan`'s builders over the plan's rescaled recipe: the plan already holds
    the schedule and the batch table), the summed loss (Goyal et al.: divided by the global batch
    in the step), ``--comm auto``'s choice, DDP + hook timed by a :class:`CommTimer`, the momentum
    and trust-ratio wiring of the sparse hooks, and the :class:`TrainStep`."""
    from flashsgd.comm.sparse.checks import check_optimizer_momentum
    from flashsgd.optim.optimizers import OPTIMIZERS
    from flashsgd.optim.plan import apply_model_tweaks, build_optimizer
    from flashsgd.train.models import build_model

    cfg = plan.config
    torch.manual_seed(cfg.run.seed)
    model = build_model(cfg.model.model, data.num_classes, cfg.model.channels).to(device)
    execution = plan.execution
    if execution.get("channels_last"):  # 4-D image inputs only (the plan's note otherwise)
        model = model.to(memory_format=torch.channels_last)
    tweaks = apply_model_tweaks(plan.recipe, model)
    optimizer = build_optimizer(plan.recipe, model, cfg.optim.global_batch)
    loss_fn = torch.nn.CrossEntropyLoss(label_smoothing=plan.recipe.label_smoothing, reduction="sum")
    auto = None
    if cfg.comm.algorithm == "auto":  # measure, plan, and run the choice (flashsgd.train.auto)
        from flashsgd.train.auto import resolve_auto

        plan, auto = resolve_auto(plan, model, optimizer, data, device, loss_fn, out, resume_from=resume_from)
    timer = CommTimer()
    ddp, hook_state, topology = build_ddp(plan, model, device, timer)
    check_optimizer_momentum(hook_state, optimizer)  # momentum applied once, not twice
    if getattr(getattr(hook_state, "options", None), "layer_trust", False) \
            and OPTIMIZERS.get(plan.recipe.optimizer).layer_norms:
        optimizer.grad_norm_source = hook_state.grad_norms  # trust ratios from dense norms
    step = TrainStep(ddp, optimizer, loss_fn, timer, device, nonfinite=plan.config.run.nonfinite,
                     max_skipped=plan.config.run.max_skipped,
                     precision=execution.get("precision", "fp32"), grad_accum=execution.get("grad_accum", 1),
                     channels_last=bool(execution.get("channels_last")),
                     forward=compile_model(ddp) if execution.get("compile") else None, hook_state=hook_state)
    return RankParts(plan, model, optimizer, loss_fn, tweaks, timer, ddp, hook_state, topology, step, auto)


def load_data(cfg: TrainConfig) -> Datasets:
    """The run's datasets (MNIST-1D is generated once and cached; see flashsgd.train.data)."""
    return build_datasets(cfg.data)
