"""flashsgd in a Hugging Face Accelerate loop: the gTop-k hook with its density warm-up, and a recipe.

    ACCELERATE_USE_CPU=1 torchrun --standalone --nproc-per-node 2 examples/accelerate_gtopk.py [STATE_DIR]
    accelerate launch --cpu --num_processes 2 examples/accelerate_gtopk.py [STATE_DIR]   # the same

The three flashsgd lines are marked. The data are synthetic (a random linear teacher), so it runs
anywhere in seconds. At the end ``accelerator.save_state(STATE_DIR)`` (default ./accelerate_gtopk)
writes Accelerate's checkpoint and each process's hook state in STATE_DIR/flashsgd_hook/
(``accelerator.load_state(STATE_DIR)`` after the same set-up resumes it exactly; docs/integrations.md).
"""

import sys

import torch
from accelerate import Accelerator

from flashsgd.integrations.accelerate import attach_hook, recipe_optimizer  # flashsgd 1/3

BATCH, STEPS_PER_EPOCH, EPOCHS = 32, 20, 10  # per-process batch; 200 optimizer steps


def main(state_dir: str) -> None:
    accelerator = Accelerator()
    n = STEPS_PER_EPOCH * BATCH * accelerator.num_processes
    gen = torch.Generator().manual_seed(0)
    x = torch.randn(n, 32, generator=gen)
    y = (x @ torch.randn(32, 10, generator=gen)).argmax(1)
    loader = torch.utils.data.DataLoader(torch.utils.data.TensorDataset(x, y), batch_size=BATCH, shuffle=True)
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(32, 64), torch.nn.ReLU(), torch.nn.Linear(64, 10))
    # the goyal recipe at this global batch: SGD + Nesterov, linear scaling, warmup, step decay; an LR
    # scheduler right however often Accelerate steps it
    optimizer, scheduler, setup = recipe_optimizer(model, "goyal", global_batch=BATCH * accelerator.num_processes,  # flashsgd 2/3
                                                   num_samples=n, epochs=EPOCHS)
    model, optimizer, loader, scheduler = accelerator.prepare(model, optimizer, loader, scheduler)
    # gTop-k at density 0.1, warm-up 0.25 -> 0.1 over the first epoch; checked against the run length
    attach_hook(accelerator, model, "gtopk", density=0.1, density_warmup=0.25,  # flashsgd 3/3
                density_warmup_steps=STEPS_PER_EPOCH, total_steps=setup.total_steps())
    for epoch in range(EPOCHS):
        for xb, yb in loader:
            loss = setup.loss_fn(model(xb), yb)
            accelerator.backward(loss)
            optimizer.step()
            scheduler.step()
            optimizer.zero_grad()
        accelerator.print(f"epoch {epoch}: loss {loss.item():.4f}, lr {scheduler.get_last_lr()[0]:.4g}")
    accelerator.save_state(state_dir)


if __name__ == "__main__":
    main(sys.argv[1] if len(sys.argv) > 1 else "accelerate_gtopk")
