"""flashsgd's pieces in a plain PyTorch DDP loop: a flashsgd hook and a large-batch recipe.

    torchrun --standalone --nproc-per-node 2 examples/train_ddp.py [OUT_DIR]

One process per rank (Gloo on CPUs, NCCL on GPUs). The data are synthetic (a random linear
teacher), so the script runs anywhere in a few seconds; swap in your own model and loader.
"""

import os
import sys

import torch
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel as DDP

from flashsgd.comm.hooks import register_hook
from flashsgd.optim import RECIPES, prepare


def main(out_dir: str | None = None, steps_per_epoch: int = 20, epochs: int = 5, batch_per_rank: int = 32) -> None:
    cuda = torch.cuda.is_available()
    dist.init_process_group("nccl" if cuda else "gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    device = torch.device("cuda", int(os.environ.get("LOCAL_RANK", 0))) if cuda else torch.device("cpu")
    if cuda:
        torch.cuda.set_device(device)

    torch.manual_seed(0)  # the same initial model on every rank
    model = torch.nn.Sequential(torch.nn.Linear(32, 64), torch.nn.ReLU(), torch.nn.Linear(64, 10)).to(device)
    global_batch = batch_per_rank * world
    # the recipe at this global batch and run length: SGD + Nesterov, linear scaling, warmup, step decay, loss
    setup = prepare(RECIPES["goyal"], model, global_batch, num_samples=steps_per_epoch * global_batch,
                    epochs=epochs)
    ddp = DDP(model, device_ids=[device.index] if cuda else None)
    # gTop-k with error feedback and DGC's density warm-up (0.25 -> 0.01 over the first epoch)
    hook = register_hook(ddp, "gtopk", density=0.01, density_warmup=0.25, density_warmup_steps=steps_per_epoch)

    teacher = torch.randn(32, 10, generator=torch.Generator().manual_seed(1))
    data = torch.Generator().manual_seed(100 + rank)  # this rank's shard of the stream
    step = 0
    for epoch in range(setup.epochs):
        for _ in range(setup.steps_in_epoch(epoch)):
            x = torch.randn(batch_per_rank, 32, generator=data)
            y = (x @ teacher).argmax(1)
            setup.set_lr(step)  # a pure function of the global step
            loss = setup.loss_fn(ddp(x.to(device)), y.to(device))
            setup.optimizer.zero_grad()
            loss.backward()  # the hook exchanges the gradients
            setup.optimizer.step()
            step += 1
        if rank == 0:
            print(f"epoch {epoch}: loss {loss.item():.4f}, lr {setup.optimizer.param_groups[0]['lr']:.4g}", flush=True)
    if out_dir:  # the sparse hook's residuals are per rank: one file per rank
        os.makedirs(out_dir, exist_ok=True)
        torch.save({"model": model.state_dict(), "optimizer": setup.optimizer.state_dict(),
                    "hook": hook.state_dict()}, os.path.join(out_dir, f"rank{rank}.pt"))
    dist.destroy_process_group()


if __name__ == "__main__":
    main(sys.argv[1] if len(sys.argv) > 1 else None)
