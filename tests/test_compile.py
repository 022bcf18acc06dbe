"""``run.compile`` (:func:`flashsgd.train.rank.compile_model`, issue 31): the compiled DDP model
compiles once for every batch size a run feeds it (the epoch's merged remainder batch,
``grad_accum`` micro-batches that differ by one sample, the 2-sample forward of
``rebuild_buckets`` after a resume), and a compiler failure at any compile, not only the first,
falls back to eager with one line, while an error of the model itself still raises.

Counted with Dynamo's own instruments, in a forked rank (a fresh Dynamo cache per test): its
recompile log (the ``TORCH_LOGS=recompiles`` artifact logger) and the graphs the backend is
handed (``aot_eager``: no C++ compiler; DDP under compile splits the graph at bucket
boundaries, DDPOptimizer, which is one compile of several graphs, not a recompile).
"""

from __future__ import annotations

import contextlib
import io
import logging

import pytest
import torch
import torch.distributed as dist
from torch import nn
from torch.nn.parallel import DistributedDataParallel as DDP

from flashsgd.comm.hooks import register_hook, rebuild_buckets
from flashsgd.train.data import ShardedSampler
from flashsgd.train.rank import CommTimer, compile_model
from flashsgd.train.step import TrainStep

FEATURES, CLASSES = 20, 5
FALLBACK = "[flashsgd] torch.compile failed"


class Net(nn.Module):
    """An MLP of ~5 MB with BatchNorm (batch statistics: its graph depends on the batch size);
    with 1 MB buckets DDP has several, so Dynamo's DDPOptimizer splits the graph. (A module of the
    test's own: Dynamo compiles a forward of torch's, a bare ``nn.Sequential``, only inlined into
    a traced frame, and DDP's forward graph-breaks before calling it.)"""

    def __init__(self, seed: int = 0) -> None:
        super().__init__()
        torch.manual_seed(seed)
        self.body = nn.Sequential(nn.Linear(FEATURES, 512), nn.BatchNorm1d(512), nn.ReLU(), nn.Linear(512, 1024),
                                  nn.ReLU(), nn.Linear(1024, 512), nn.ReLU(), nn.Linear(512, CLASSES))

    def forward(self, x):
        return self.body(x)


class Backend:
    """``aot_eager`` counting the graphs it compiles; raises once ``broken`` is set."""

    def __init__(self) -> None:
        self.graphs, self.broken = 0, False

    def __call__(self, gm, example_inputs):
        from torch._dynamo.backends.registry import lookup_backend

        if self.broken:
            raise RuntimeError("the backend broke")
        self.graphs += 1
        return lookup_backend("aot_eager")(gm, example_inputs)


class Recompiles(logging.Handler):
    """Dynamo's recompile log (``TORCH_LOGS=recompiles``): one record per recompile."""

    def __init__(self) -> None:
        super().__init__(logging.DEBUG)
        self.messages: list[str] = []
        torch._logging.set_logs(recompiles=True)
        logging.getLogger("torch._dynamo.guards.__recompiles").addHandler(self)

    def emit(self, record) -> None:
        self.messages.append(record.getMessage().splitlines()[-1].strip())


def _rank(grad_accum: int = 1, model: nn.Module | None = None):
    """(step, ddp, backend, recompiles, stdout): a compiled TrainStep on ``model`` with the ring hook."""
    ddp = DDP(model if model is not None else Net(), bucket_cap_mb=1)
    timer = CommTimer()
    register_hook(ddp, "ring", wrap=timer.wrap)
    backend, out = Backend(), io.StringIO()
    with contextlib.redirect_stdout(out):
        forward = compile_model(ddp, backend=backend)
    step = TrainStep(ddp, torch.optim.SGD(ddp.parameters(), lr=0.05), nn.CrossEntropyLoss(reduction="sum"),
                     timer, grad_accum=grad_accum, forward=forward)
    return step, ddp, backend, Recompiles(), out


def _batch(n: int, key: int):
    g = torch.Generator().manual_seed(key)
    x, y = torch.randn(n, FEATURES, generator=g), torch.randint(0, CLASSES, (n,), generator=g)
    return lambda: (x, y)


def _epochs(num_samples: int, global_batch: int, epochs: int, grad_accum: int = 1):
    """TrainSteps over ``epochs`` epochs of the trainer's sampler; (shard sizes, graphs after the
    first step, graphs at the end, recompiles)."""
    step, _, backend, recompiles, _ = _rank(grad_accum)
    sampler = ShardedSampler(num_samples, dist.get_rank(), dist.get_world_size(), seed=0)
    sizes, first = [], None
    for epoch in range(epochs):
        sampler.set_epoch(epoch, global_batch)
        for i, idx in enumerate(sampler):
            res = step(_batch(len(idx), 1000 * epoch + i), global_batch, step=len(sizes))
            assert not res.skipped
            sizes.append(len(idx))
            first = backend.graphs if first is None else first
    return sizes, first, backend.graphs, recompiles.messages


def test_an_epoch_boundary_with_a_merged_remainder_compiles_once(run_ranks):
    # 33 samples, B 8, 2 workers: the 1 left over joins the last batch (9: shards 5 + 4)
    ranks = run_ranks(_epochs, 2, 33, 8, 2)
    assert [sizes for sizes, *_ in ranks] == [[4, 4, 4, 5] * 2, [4, 4, 4, 4] * 2]
    for _, first, graphs, recompiles in ranks:
        assert recompiles == [] and graphs == first > 0


def test_grad_accum_micro_batches_of_unequal_sizes_compile_once(run_ranks):
    # shards of 16 and 10 samples in 3 micro-batches: 6 5 5, then 4 3 3 (views at offsets > 0)
    sizes, first, graphs, recompiles = run_ranks(_epochs, 1, 42, 16, 1, 3)[0]
    assert sizes == [16, 16, 10]
    assert recompiles == [] and graphs == first > 0


def _rebuild_then_steps():
    step, ddp, backend, recompiles, _ = _rank()
    x, y = _batch(2, 7)()  # the worker's rebuild_buckets: two training samples, changes nothing
    rebuilt = rebuild_buckets(ddp, lambda: step.forward_loss(x, y))
    first = backend.graphs
    for i, n in enumerate([16, 16, 16, 9]):
        step(_batch(n, i), n, step=i)
    return rebuilt, first, backend.graphs, recompiles.messages


def test_the_resume_forward_of_two_samples_then_steps_compile_once(run_ranks):
    rebuilt, first, graphs, recompiles = run_ranks(_rebuild_then_steps, 1)[0]
    assert rebuilt and recompiles == [] and graphs == first > 0


class Switch(nn.Module):
    """A model whose Python attribute ``scale`` is in Dynamo's guards: changing it recompiles;
    ``fail`` makes its forward raise (an error of the model itself)."""

    def __init__(self) -> None:
        super().__init__()
        self.net, self.scale, self.fail = Net(), 1.0, False

    def forward(self, x):
        if self.fail:
            raise ValueError("the model's own error")
        return self.net(x) * self.scale


def _backend_fails_at_a_recompile():
    model = Switch()
    step, _, backend, recompiles, out = _rank(model=model)
    losses = [step(_batch(8, i), 8, step=i).loss for i in range(2)]
    compiled = backend.graphs
    backend.broken, model.scale = True, 0.5  # the next call recompiles, and the backend raises
    with contextlib.redirect_stdout(out):
        losses += [step(_batch(8, i), 8, step=i).loss for i in range(2, 5)]
    return compiled, len(recompiles.messages), out.getvalue().splitlines(), losses


def test_a_backend_failing_at_a_later_recompile_falls_back_to_eager(run_ranks):
    compiled, recompiles, lines, losses = run_ranks(_backend_fails_at_a_recompile, 1)[0]
    assert compiled > 0 and recompiles >= 1
    assert lines == ["[flashsgd] torch.compile failed (RuntimeError: the backend broke); "
                     "training the model eagerly (run.compile = false)"]
    assert len(losses) == 5 and all(map(torch.isfinite, torch.tensor(losses)))


def _model_error(when: str):
    model = Switch()
    step, _, _, _, out = _rank(model=model)
    x, y = _batch(8, 1)()
    if when != "first":
        step(_batch(8, 0), 8)
    if when == "shape":  # a wrong input: Dynamo's fake tensors see it first (TorchRuntimeError)
        x = torch.randn(8, FEATURES + 1)
    else:
        model.fail = True
    with contextlib.redirect_stdout(out):
        try:
            step(lambda: (x, y), 8)
        except Exception as exc:  # noqa: BLE001 - the test looks at what came out
            return type(exc).__name__, str(exc).splitlines()[0], out.getvalue()
    return None, "", out.getvalue()


@pytest.mark.parametrize("when", ["first", "later", "shape"])
def test_an_error_of_the_model_itself_still_raises(run_ranks, when):
    """At the first call (compiling) or a later one, the model's error, as eager raises it; no
    fallback line (the compiler did not fail)."""
    kind, message, printed = run_ranks(_model_error, 1, when)[0]
    expected = ("RuntimeError", "mat1 and mat2 shapes cannot be multiplied (8x21 and 20x512)") if when == "shape" \
        else ("ValueError", "the model's own error")
    assert (kind, message) == expected and FALLBACK not in printed
