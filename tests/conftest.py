"""The one shared harness for multi-process tests: ``run_ranks(fn, world, *args)``, and the ``gpu`` marker.

It spawns ``world`` ranks on Gloo over loopback through :func:`flashsgd.launch.spawn` (the same
launcher the CLI uses), with a progress deadline so that a hang fails the test instead of the CI run
(a stall: no rank used the CPU for ``STALL_S``; not a wall-clock deadline, which load exceeds), and
returns the per-rank results. ``fork`` is used for speed (the workers inherit imported torch), so
``fn`` may be any module-level function of a test file.

CUDA and fork (issue 30): a process forked after its parent touched CUDA cannot use CUDA ("Cannot
re-initialize CUDA in forked subprocess"), and torch's default ``torch.cuda.is_available()``
already does (``cudaGetDeviceCount`` initialises the driver). So:

1. ``PYTORCH_NVML_BASED_CUDA_CHECK=1`` is set here, before any test module is imported: the
   availability checks of skip decorators and parameter lists ask NVML instead, which leaves
   CUDA untouched (torch's documented fork-safe check; ``torch.cuda.device_count`` asks NVML too).
2. A test marked ``@pytest.mark.gpu`` needs CUDA: it is skipped (one reason line) where CUDA is
   not available, and ``run_ranks`` starts its ranks with ``spawn`` (a fresh interpreter: CUDA
   works in the ranks whatever this process did before). ``backend="nccl"`` spawns too.
   Select the GPU tests with ``pytest -m gpu``.
"""

from __future__ import annotations

import os

os.environ.setdefault("PYTORCH_NVML_BASED_CUDA_CHECK", "1")  # Step 1: before anything asks torch.cuda

import pytest  # noqa: E402
import torch  # noqa: E402
import torch._dynamo  # noqa: E402,F401  DDP imports it (~800 modules): once here, not in every forked rank

from flashsgd.launch import spawn  # noqa: E402

# GNU OpenMP (torch's intra-op pool) does not survive a fork: a rank forked after this process ran a
# parallel region hangs in its own first one (flashsgd.launch.one_thread), and a test that passed
# alone hung when an earlier test in the same process had computed on two threads. The test
# process itself computes on one thread, so the pool never starts here; the ranks it forks set
# their own threads (flashsgd.train.rank.setup_process) and start theirs safely.
torch.set_num_threads(1)

STALL_S = float(os.environ.get("FLASHSGD_TEST_TIMEOUT", "120"))
"""A job whose ranks use no CPU for this long is hung (every rank waiting): it fails. Not a wall-clock
deadline: a loaded machine (load 12-50 on 2 cores) slows a job many times over, and a test must not
fail for being slow (issue 33: four tests did)."""
LOADED_TIMEOUT_S = 900.0
"""The process group's collective deadline when a test does not set one: a rank may wait this long
for a peer that a loaded machine starves (a compile on 2 cores at load 25 takes minutes); a real
hang is the stall above, found far sooner."""
HARD_DEADLINE_S = 3600.0
"""The last resort: a job that keeps computing without end (a loop) fails after this long."""
NO_CUDA = "needs CUDA (a test marked gpu; select them with: pytest -m gpu)"


def _run_ranks(fn, world, *args, timeout_s=None, env=None, backend="gloo", start_method=None,
               cuda=False):
    if start_method is None:  # Step 2: ranks that use CUDA start from a fresh interpreter
        start_method = "spawn" if cuda or backend == "nccl" else "fork"
    return spawn(fn, world, args, backend=backend, timeout_s=timeout_s or LOADED_TIMEOUT_S,
                 deadline_s=HARD_DEADLINE_S, stall_s=STALL_S, start_method=start_method, env=env)


def pytest_collection_modifyitems(config, items):
    """Step 2: a ``gpu`` test is skipped cleanly where CUDA is not available (NVML's answer)."""
    gpu = [item for item in items if item.get_closest_marker("gpu")]
    if gpu and not torch.cuda.is_available():
        for item in gpu:
            item.add_marker(pytest.mark.skip(reason=NO_CUDA))


@pytest.fixture
def run_ranks(request):
    """``run_ranks(fn, world, *args, timeout_s=None, env=None, backend="gloo", start_method=None)
    -> [result of rank 0, 1, ...]``.

    ``timeout_s``: the process group's collective deadline (a test of timeouts sets its own;
    None: :data:`LOADED_TIMEOUT_S`). A hang fails the test after :data:`STALL_S` seconds without
    CPU use by any rank (``spawn(stall_s=...)``), not after a fixed wall time.

    ``start_method`` None: ``spawn`` for a test marked ``gpu`` or ``backend="nccl"`` (``fn`` and
    ``args`` must then be importable / picklable: module-level functions of a test file are),
    ``fork`` otherwise.
    """
    marked = request.node.get_closest_marker("gpu") is not None

    def run(fn, world, *args, cuda=marked, **kwargs):
        return _run_ranks(fn, world, *args, cuda=cuda, **kwargs)

    return run
