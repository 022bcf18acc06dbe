"""flashsgd inside the trainers people already use: PyTorch Lightning, Hugging Face Accelerate and
the Hugging Face Transformers Trainer.

Each trainer wraps the model in DDP itself, after its process group exists, and writes its own
checkpoints; a flashsgd hook needs both the group and the wrapped model when it is built, and its
state (error-feedback residuals) is per rank. These modules attach a hook at the right moment,
keep each rank's state in per-rank files beside the trainer's checkpoint, and drive a recipe's
LR per optimizer step (docs/integrations.md):

- :mod:`flashsgd.integrations.lightning`: ``FlashsgdHook`` (a Lightning Callback) and
  ``configure_optimizers`` (a recipe as Lightning's optimizer dict); needs ``lightning``.
- :mod:`flashsgd.integrations.accelerate`: ``attach_hook`` (after ``accelerator.prepare``) and
  ``recipe_optimizer``; needs ``accelerate``.
- :mod:`flashsgd.integrations.transformers`: ``FlashsgdCallback(...).attach(trainer)`` (the hook on
  ``trainer.model_wrapped``, its per-rank state inside each ``checkpoint-N/``); needs ``transformers``.
- :mod:`flashsgd.integrations.plan`: ``comm_from_plan`` (a ``flashsgd plan --json`` choice -> the
  hook, its options with the density warm-up in steps, DDP's bucket size); torch-free.
- :mod:`flashsgd.integrations.rank_state`, :mod:`flashsgd.integrations.recipe`: the pieces both
  trainers share (per-rank state files; :class:`~flashsgd.integrations.recipe.RecipeLR`).

Each hands its trainer's fp16 loss scaler to the hook (:mod:`flashsgd.comm.hook_step`).
Lightning, Accelerate and Transformers are optional (``pip install 'flashsgd[integrations]'``): nothing here is
imported by ``import flashsgd``, and only the trainer module you import needs its package.
"""
