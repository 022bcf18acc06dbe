"""flashsgd in a PyTorch Lightning DDP run: the gTop-k hook with its density warm-up, and a recipe.

    torchrun --standalone --nproc-per-node 2 examples/lightning_gtopk.py [OUT_DIR]
    python examples/lightning_gtopk.py [OUT_DIR]      # the same: Lightning starts the 2 processes

The three flashsgd lines are marked. CPU (Gloo) or GPU (NCCL): Lightning picks. The data are
synthetic (a random linear teacher), so it runs anywhere in seconds; Lightning's checkpoints go to
OUT_DIR (default ./lightning_gtopk) with each rank's hook state beside them (docs/integrations.md).
"""

import os
import sys

import lightning as L
import torch

from flashsgd.integrations.lightning import FlashsgdHook, configure_optimizers  # flashsgd 1/3

BATCH, STEPS_PER_EPOCH, EPOCHS = 32, 20, 10  # per-rank batch; 200 optimizer steps


class Teacher(L.LightningModule):
    def __init__(self, num_samples: int):
        super().__init__()
        self.num_samples = num_samples
        self.net = torch.nn.Sequential(torch.nn.Linear(32, 64), torch.nn.ReLU(), torch.nn.Linear(64, 10))

    def training_step(self, batch, batch_idx):
        loss = torch.nn.functional.cross_entropy(self.net(batch[0]), batch[1])
        self.log("loss", loss)
        return loss

    def configure_optimizers(self):  # SGD + Nesterov, linear scaling, warmup, step decay: per optimizer step
        return configure_optimizers(self, "goyal", global_batch=BATCH * self.trainer.world_size,  # flashsgd 2/3
                                    num_samples=self.num_samples)

    def on_train_epoch_end(self):
        if self.trainer.is_global_zero:
            print(f"epoch {self.current_epoch}: loss {self.trainer.callback_metrics['loss']:.4f}", flush=True)


def main(out_dir: str) -> None:
    ranks = int(os.environ.get("LOCAL_WORLD_SIZE", 2))
    n = STEPS_PER_EPOCH * BATCH * ranks
    gen = torch.Generator().manual_seed(0)
    x = torch.randn(n, 32, generator=gen)
    y = (x @ torch.randn(32, 10, generator=gen)).argmax(1)
    loader = torch.utils.data.DataLoader(torch.utils.data.TensorDataset(x, y), batch_size=BATCH, shuffle=True)
    torch.manual_seed(0)  # the same initial model on every rank
    trainer = L.Trainer(accelerator="auto", devices=ranks, strategy="ddp", max_epochs=EPOCHS, logger=False,
                        enable_progress_bar=False, enable_model_summary=False, default_root_dir=out_dir,
                        # gTop-k at density 0.1, warm-up 0.25 -> 0.1 over the first epoch
                        callbacks=[FlashsgdHook("gtopk", density=0.1, density_warmup=0.25,  # flashsgd 3/3
                                                density_warmup_epochs=1)])
    trainer.fit(Teacher(n), loader)


if __name__ == "__main__":
    main(sys.argv[1] if len(sys.argv) > 1 else "lightning_gtopk")
