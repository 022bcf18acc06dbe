"""What happens at 1,000s of GPUs: an alpha-beta-gamma simulator of data-parallel SGD iterations.

``network`` (cluster models and presets, link levels), ``costs`` / ``costs_sparse`` / ``costs_hier`` / ``costs_lowrank`` (closed-form
cost of each dense / sparse exchange), ``algorithms`` (the name -> cost registry, built from :mod:`flashsgd.exchanges`), ``workload`` (gradient sizes in backward order), ``engine`` (one iteration with bucket fusion and
overlap), ``calibrate`` (the ``local`` cluster fitted to a bench file), ``cli`` (``flashsgd simulate``).
See docs/simulator.md for the model, its assumptions and its validation.
"""
