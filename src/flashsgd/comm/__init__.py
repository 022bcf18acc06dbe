"""How gradients cross the network: topology, dense and sparse all-reduce, DDP hooks.

The errors a wait on a peer raises are importable from here: :class:`PeerError` and its
subclass :class:`PeerTimeout` (both ``RuntimeError``; ``.peer`` names the rank waited for).
"""

from flashsgd.comm.errors import PeerError, PeerTimeout

__all__ = ["PeerError", "PeerTimeout"]
