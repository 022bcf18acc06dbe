"""flashsgd: large-minibatch, massively data-parallel synchronous SGD on PyTorch.

Words: one concept, one word (the README's glossary gives the flags and keys of each):

- **exchange**: how one DDP bucket's gradients become the same on every rank (``ring``,
  ``gtopk``, ``powersgd``, ...): one entry of :data:`flashsgd.exchanges.EXCHANGES`, the catalog
  that every other part reads. ``--comm NAME`` names an exchange, and so does the config key
  ``[comm] algorithm`` (that key keeps its older name, so config.toml files of earlier runs load;
  in code, a variable called ``algorithm`` holds an exchange's name).
- **family**: what an exchange sends: ``dense``, ``sparse``, ``lowrank`` or ``none``.
- **hook**: the DDP communication hook that runs an exchange inside DDP, one per exchange
  (:data:`flashsgd.comm.hooks.HOOKS`, :func:`flashsgd.comm.hooks.register_hook`).
- **all-reduce**: an exchange's function over a flat tensor, usable without DDP (the dense ones:
  :data:`flashsgd.comm.dense.DENSE`; the sparse ones: :mod:`flashsgd.comm.sparse`).
- **cost**: the simulator's alpha-beta-gamma function of an exchange
  (:data:`flashsgd.sim.algorithms.COSTS`); the **simulated** names are the exchanges and the
  simulator-only references (:data:`flashsgd.sim.algorithms.SIMULATED`).
- **recipe** (optimizer, schedule, loss, model tweaks), **plan** (a training run resolved before it
  starts: :class:`flashsgd.train.plan.RunPlan`; the planner's answer: ``CommPlan``), **step** (one
  optimizer step: :class:`flashsgd.train.step.TrainStep`).
"""

__version__ = "0.1.0"
