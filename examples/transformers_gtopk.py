"""flashsgd in a Hugging Face Transformers Trainer: the gTop-k hook with its density warm-up, checkpoints, a resume.

    torchrun --standalone --nproc-per-node 2 examples/transformers_gtopk.py [OUT_DIR [STOP_STEP]]

The two flashsgd lines are marked. A tiny BERT (2 layers, hidden 32) built from its config, on
synthetic sequences (the label: is the first token in the lower half of the vocabulary), so it runs
anywhere in seconds and downloads nothing; ``use_cpu=True``: Gloo on the CPUs (without it on GPUs:
NCCL). The Trainer writes OUT_DIR/checkpoint-N (default ./transformers_gtopk) every epoch, with each
rank's hook state inside it (checkpoint-N/flashsgd_hook/rank<r>.pt). Given STOP_STEP, the run stops
after the checkpoint of that step, as a preempted job would; the same command without it resumes
from the last checkpoint (``resume_from_checkpoint=True``), the hook from its saved residuals: the
run ends as an uninterrupted one does, bit for bit (losses and weights).
Needs transformers >= 4.47 (``average_tokens_across_devices``); the integration itself 4.44.
"""

import os
import sys

import torch
from transformers import (BertConfig, BertForSequenceClassification, Trainer, TrainerCallback,
                          TrainingArguments)
from transformers.trainer_utils import get_last_checkpoint

from flashsgd.integrations.transformers import FlashsgdCallback  # flashsgd 1/2

BATCH, STEPS_PER_EPOCH, EPOCHS, SEQ, VOCAB = 16, 20, 4, 12, 64  # per-rank batch; 80 optimizer steps on 2 ranks


class StopAt(TrainerCallback):
    """Stands in for a preemption: training stops once the checkpoint of step ``stop`` is written."""

    def __init__(self, stop: int):
        self.stop = stop

    def on_save(self, args, state, control, **kwargs):
        control.should_training_stop = state.global_step >= self.stop


def main(out_dir: str, stop: int | None) -> None:
    args = TrainingArguments(output_dir=out_dir, use_cpu=True, per_device_train_batch_size=BATCH,
                             num_train_epochs=EPOCHS, learning_rate=3e-3, warmup_steps=STEPS_PER_EPOCH,
                             save_strategy="epoch", logging_strategy="epoch", report_to="none",
                             disable_tqdm=True, ddp_find_unused_parameters=False,  # every parameter is used
                             average_tokens_across_devices=False)  # BERT's loss is a batch mean: not x ranks
    n = BATCH * STEPS_PER_EPOCH * args.world_size
    gen = torch.Generator().manual_seed(0)
    ids = torch.randint(0, VOCAB, (n, SEQ), generator=gen)
    data = [{"input_ids": x, "labels": (x[0] < VOCAB // 2).long()} for x in ids]
    torch.manual_seed(0)
    model = BertForSequenceClassification(BertConfig(
        vocab_size=VOCAB, hidden_size=32, num_hidden_layers=2, num_attention_heads=2, intermediate_size=64,
        max_position_embeddings=SEQ, num_labels=2))
    trainer = Trainer(model=model, args=args, train_dataset=data, callbacks=[StopAt(stop)] if stop else [])
    # gTop-k at density 0.1, warm-up 0.25 -> 0.1 over the first epoch; its state in every checkpoint
    FlashsgdCallback("gtopk", density=0.1, density_warmup=0.25, density_warmup_epochs=1).attach(trainer)  # flashsgd 2/2
    last = get_last_checkpoint(out_dir) if os.path.isdir(out_dir) else None
    if last and args.process_index == 0:
        print(f"resuming from {last}", flush=True)
    trainer.train(resume_from_checkpoint=last is not None)  # True: the last checkpoint of out_dir
    if args.process_index == 0:
        for log in trainer.state.log_history:
            if "loss" in log:
                print(f"epoch {log['epoch']:.0f}: loss {log['loss']:.4f}", flush=True)


if __name__ == "__main__":
    main(sys.argv[1] if len(sys.argv) > 1 else "transformers_gtopk", int(sys.argv[2]) if len(sys.argv) > 2 else None)
