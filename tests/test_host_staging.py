"""Gloo carrying CUDA buckets (several ranks on one GPU): every flashsgd hook but PowerSGD runs on a
host copy of the bucket (hook_common.ddp_hook) and gives what it gives on the host; PowerSGD
all-reduces the CUDA bucket through Gloo itself (torch's hook needs the bucket's own device).

Forced on CPU buckets here (``stages_on_host`` patched to say yes), so CI checks the plumbing: the
copy out, the exchange on the copy, the copy back, the Future; the ``gpu``-marked test runs the
real case where a GPU is present.
"""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel as DDP

from ddp_helpers import flat_params, tiny_net, train_steps
from flashsgd.comm import hook_common
from flashsgd.comm.hooks import register_hook

CASES = {"ring": {}, "torus2d": {}, "gtopk": {"density": 0.1}, "topk": {"density": 0.1},
         "powersgd": {}, "noop": {}}


def _params(name: str, staged: bool, device: str = "cpu") -> list[float]:
    if staged and device == "cpu":
        hook_common.stages_on_host = lambda buf: True  # this rank's process only
    model = tiny_net(0).to(device)
    ddp = DDP(model, bucket_cap_mb=0.01)  # several buckets
    register_hook(ddp, name, **CASES[name])
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    train_steps(model=ddp, opt=opt, steps=4)
    return flat_params(model).cpu().tolist()


def _both(name: str):
    return _params(name, staged=False), _params(name, staged=True)


@pytest.mark.parametrize("name", sorted(set(CASES) - {"powersgd"}))  # powersgd is never staged
def test_a_hook_on_a_host_copy_gives_what_it_gives_on_the_host(run_ranks, name):
    for plain, staged in run_ranks(_both, 2, name):
        assert staged == plain


def _cuda_vs_cpu(name: str):
    torch.cuda.set_device(0)
    return _params(name, staged=False), _params(name, staged=True, device="cuda")


@pytest.mark.gpu  # Gloo carries CUDA tensors; the ranks start with spawn (conftest.py)
@pytest.mark.parametrize("name", ["ring", "gtopk", "topk", "powersgd"])
def test_gloo_ranks_on_one_gpu_match_cpu_ranks(run_ranks, name):
    for cpu, cuda in run_ranks(_cuda_vs_cpu, 2, name):
        assert cuda == pytest.approx(cpu, rel=1e-5, abs=1e-6)
