"""A recipe of one's own in a plain PyTorch DDP loop: LARS, warm-up, decay and batch-size control.

    torchrun --standalone --nproc-per-node 2 examples/custom_recipe.py

One process per rank (Gloo on CPUs, NCCL on GPUs); gradients cross with flashsgd's 2D-Torus
all-reduce hook; the optimizer (LARS), the LR schedule, the batch size of each epoch and the loss
come from the recipe below. The data are synthetic (labels from a random linear teacher), so the
script runs anywhere in seconds: swap in your own model and dataset.
"""

import os

import torch
import torch.distributed as dist
from torch import nn
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import DataLoader, DistributedSampler, TensorDataset

from flashsgd.comm.hooks import register_hook
from flashsgd.optim import Recipe, prepare

EPOCHS = 6
GLOBAL_BATCH = 512  # the FINAL global batch: batch-size control runs the first epochs below it

# Every length is in epochs of this run (epochs=EPOCHS): prepare() has nothing to rescale.
MY_RECIPE = Recipe(
    name="my-lars", optimizer="lars", epochs=EPOCHS,
    lr_per_ref=0.4, ref_batch=256,              # peak LR 0.4 per 256 samples, scaled with the batch
    momentum=0.9, nesterov=True,
    weight_decay=5e-4, exclude_bias_and_norm=True,  # no decay, no LARS adaptation on bias and BN
    warmup_epochs=1.0, warmup_start_factor=0.0,  # linear warm-up from 0 over the first epoch
    decay="poly", power=2.0,                    # then (1 - progress)^2 down to 0
    batch_fractions=((0, 0.5), (2, 1.0)),       # half the final batch for epochs 0-1, then all of it
    label_smoothing=0.1, trust_coefficient=0.02,  # LARS eta
    source="examples/custom_recipe.py: an illustration, not tuned",
)


def synthetic(n: int, seed: int) -> TensorDataset:
    """``n`` samples of 32 features, labelled by a fixed random linear teacher (10 classes)."""
    teacher = torch.randn(32, 10, generator=torch.Generator().manual_seed(1))  # one for train and test
    x = torch.randn(n, 32, generator=torch.Generator().manual_seed(seed))
    return TensorDataset(x, (x @ teacher).argmax(1))


def main() -> None:
    cuda = torch.cuda.is_available()
    dist.init_process_group("nccl" if cuda else "gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    device = torch.device("cuda", int(os.environ.get("LOCAL_RANK", 0))) if cuda else torch.device("cpu")
    if cuda:
        torch.cuda.set_device(device)

    torch.manual_seed(0)  # the same initial model on every rank
    model = nn.Sequential(nn.Linear(32, 128), nn.BatchNorm1d(128), nn.ReLU(), nn.Linear(128, 10)).to(device)
    # 1. The recipe at this global batch: LARS over parameter groups, schedule, batch table, loss.
    #    The optimizer exists before the dataset does; the dataset size is given in step 3.
    plan = prepare(MY_RECIPE, model, GLOBAL_BATCH, epochs=EPOCHS)
    # 2. DDP and a flashsgd hook (every rank, before the first backward); the grid is 1 x world
    ddp = DDP(model, device_ids=[device.index] if cuda else None)
    register_hook(ddp, "torus2d", grid=f"1x{world}")
    # 3. The data: its size sets the plan's steps per epoch at each batch size
    train, test = synthetic(8192, seed=2), synthetic(2048, seed=3)
    plan.set_num_samples(len(train))
    if rank == 0:
        print(plan.describe(), flush=True)  # global batch per epoch, peak LR, warm-up, decay, ...

    sampler = DistributedSampler(train, num_replicas=world, rank=rank, shuffle=True, seed=0)
    step = 0
    for epoch in range(plan.epochs):
        sampler.set_epoch(epoch)
        batch = plan.batch_at(epoch)  # batch-size control: this epoch's global batch
        loader = DataLoader(train, batch_size=batch // world, sampler=sampler, drop_last=plan.drop_last)
        plan.check_loader(loader, epoch)  # the loader gives the steps the schedule counts on
        ddp.train()
        for x, y in loader:
            lr = plan.set_lr(step)  # the LR of this global step: warm-up, decay, scaled to `batch`
            loss = plan.loss_fn(ddp(x.to(device)), y.to(device))  # label smoothing from the recipe
            plan.optimizer.zero_grad(set_to_none=True)
            loss.backward()  # the hook averages the gradients over the ranks
            plan.optimizer.step()
            step += 1
        if rank == 0:
            model.eval()
            with torch.no_grad():
                acc = (model(test.tensors[0].to(device)).argmax(1) == test.tensors[1].to(device)).float().mean()
            print(f"epoch {epoch}: batch {batch}, lr {lr:.4g}, loss {loss.item():.4f}, "
                  f"test accuracy {100 * acc.item():.1f}%", flush=True)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
