"""Shared inputs of the simulator and planner tests."""

LAB = """
name = "lab"
nodes = 4
ranks_per_node = 2
[intra]
bandwidth_gbit = 100.0
latency_us = 5.0
[inter]
bandwidth_gbit = 1.0
latency_us = 50.0
"""
"""A 4-node x 2-rank cluster file: 100 Gbit/s, 5 us inside a node; 1 Gbit/s, 50 us between nodes."""


def exchange_only(cluster):
    """``cluster`` without the step's costs beyond the exchange (its stated jitter, slowdown under
    overlap and overheads, :data:`flashsgd.sim.network.STEP_STATED`, set to 0): for the tests of the
    exchange's and the timeline's own arithmetic."""
    from dataclasses import replace

    from flashsgd.sim.network import STEP_STATED

    return replace(cluster, **{key: 0.0 for key in STEP_STATED})
