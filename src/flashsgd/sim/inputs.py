"""One check of an exchange option's value, read by every command that takes the option (torch-free).

The rule of each option is written once, in its options class in :mod:`flashsgd.exchanges`
(``density`` in (0, 1], ``matrix_approximation_rank`` >= 1, ``node_split`` one of leader, slices,
sparse, ...). :func:`check_option` runs every options class that has the option, so `flashsgd
train` (its ``[comm]`` keys, :func:`flashsgd.train.config.validate`) and `flashsgd simulate`
(:class:`flashsgd.sim.engine.SimConfig`, built before anything is printed) refuse the same values
in the same words. The GPU count's rule is :meth:`flashsgd.sim.network.ClusterModel.check_gpus`,
read by `flashsgd simulate`, `flashsgd plan` and every cost model.

Example::

    >>> check_option("matrix_approximation_rank", 0)
    Traceback (most recent call last):
    ValueError: matrix_approximation_rank must be an integer >= 1, got 0
"""

from __future__ import annotations

from typing import Any

from flashsgd.exchanges import EXCHANGES


def check_option(name: str, value: Any) -> None:
    """ValueError (the options class's message, starting with ``name``) unless every options class
    of the catalog that has option ``name`` takes ``value``."""
    for options in dict.fromkeys(e.options for e in EXCHANGES.values() if e.reads(name)):
        options(**{name: value})
