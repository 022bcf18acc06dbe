"""Waits on peers with a deadline: every send, receive and collective wait of flashsgd's algorithms.

Gloo's point-to-point operations have no deadline of their own: ``isend``/``irecv`` then
``work.wait()`` blocks for as long as the peer stays silent (one stopped rank hung a whole run
for 589 s). ``work.wait(timeout=...)`` bounds each wait; on torch 2.13 Gloo then raises
``RuntimeError`` ("Timed out waiting 3000ms for recv operation to complete" for send/recv,
"Operation timed out!" for collectives), and a broken connection raises ``RuntimeError``
("Connection closed by peer"). :func:`wait_peer` turns those into
:class:`~flashsgd.comm.errors.PeerTimeout` / :class:`~flashsgd.comm.errors.PeerError` naming the
peer rank that was waited for, so the rank that stopped can be told from the ranks that waited.
The sends and receives themselves are issued by :func:`flashsgd.comm.p2p.exchange` (grouped, as
NCCL needs), which waits for each through :func:`wait_peer`.

NCCL is different: ``work.wait(timeout=...)`` there blocks the CPU thread until the GPU work is
done (torch's ``Work.wait`` docstring; ProcessGroupNCCL's ``synchronize`` with a timeout spins on
the host), where a plain ``work.wait()`` only makes the current stream wait and lets the host run
ahead. So for CUDA tensors on an NCCL group (:func:`grouped`) :func:`wait_collective` waits
without a deadline; the process group's own timeout and NCCL's watchdog bound it.

Example::

    >>> works = dist.batch_isend_irecv([op])          # in flashsgd.comm.p2p only
    >>> wait_peer(works[0], peer=1, timeout_s=10.0, where="ring all-reduce, all-gather step 0")
"""

from __future__ import annotations

import datetime
from typing import Any

import torch
import torch.distributed as dist

from flashsgd.comm.errors import PeerError, PeerTimeout


def _failure(exc: RuntimeError, peer: int | None, timeout_s: float, where: str,
             members: tuple[int, ...] = (), sending: bool = False) -> PeerError:
    rank = dist.get_rank()
    if "timed out" in str(exc).lower():
        return PeerTimeout(rank, peer, timeout_s, where, members, sending)
    return PeerError(rank, peer, where, str(exc).strip().splitlines()[-1] if str(exc) else repr(exc))


def wait_peer(work: Any, peer: int, timeout_s: float, where: str, sending: bool = False) -> None:
    """Wait for one ``isend``/``irecv`` with peer ``peer`` (a global rank) at most ``timeout_s``.

    Raises:
        PeerTimeout: nothing moved within ``timeout_s`` seconds.
        PeerError: the transport failed (e.g. the peer's connection closed).
    """
    try:
        work.wait(timeout=datetime.timedelta(seconds=timeout_s))
    except RuntimeError as exc:
        raise _failure(exc, peer, timeout_s, where, sending=sending) from exc


def grouped(tensor: torch.Tensor, group: Any) -> bool:
    """True where point-to-point operations must be grouped and collectives are native: a CUDA
    tensor on an NCCL group (also "cpu:gloo,cuda:nccl"). Gloo carrying CUDA tensors is not."""
    return tensor.is_cuda and "nccl" in str(dist.get_backend(group))


def wait_collective(work: Any, group: Any, timeout_s: float, where: str,
                    tensor: torch.Tensor | None = None) -> None:
    """Wait for a collective's work at most ``timeout_s``; a failure names the group's ranks
    (``peer=None``: a collective does not say which member was late). ``tensor`` (the collective's):
    a CUDA tensor on an NCCL group is waited for on the stream, without a host deadline (module
    docstring)."""
    try:
        if tensor is not None and grouped(tensor, group):
            work.wait()  # the current stream waits; the host goes on (the group's timeout bounds it)
        else:
            work.wait(timeout=datetime.timedelta(seconds=timeout_s))
    except RuntimeError as exc:
        members = tuple(dist.get_process_group_ranks(group or dist.group.WORLD))
        raise _failure(exc, None, timeout_s, where, members) from exc


def global_rank(group: Any, group_rank: int) -> int:
    """The global rank of ``group_rank`` in ``group`` (``None``: the default group)."""
    return group_rank if group is None else dist.get_global_rank(group, group_rank)
