"""Point-to-point exchanges: every send and receive of flashsgd goes through :func:`exchange`.

An exchange is one round of messages: the sends and receives a rank posts together and then waits
for (a ring step, a butterfly swap, a direct all-gather). NCCL requires operations that must
progress together to be issued as one group (``ncclGroupStart``/``ncclGroupEnd``; torch:
``dist.batch_isend_irecv`` over ``dist.P2POp``): issued one by one, each send and each receive is
its own kernel on the communicator's stream, so a rank's receive can sit in front of its own send,
both peers wait in a receive, and after the timeout a healthy peer is blamed (NCCL User Guide,
"Point-to-point communication" and "Group calls"). So every round is issued here, and only here,
then waited for:

* NCCL (CUDA tensors on an NCCL group, also "cpu:gloo,cuda:nccl"): torch coalesces the round into
  one NCCL group and returns one work for it. It is waited with ``work.wait()``, which makes the
  current stream wait and does not block the CPU; ``work.wait(timeout=...)`` would block the CPU
  thread on NCCL. The wait is bounded by the process group's own timeout and NCCL's watchdog, not
  by ``timeout_s``: a silent peer is ended by the watchdog (``TORCH_NCCL_ASYNC_ERROR_HANDLING``,
  torch's default: the process is torn down after the group's timeout, and the launcher names the
  rank that died); only an error raised while issuing or waiting (with
  ``TORCH_NCCL_BLOCKING_WAIT=1``, for instance) becomes :class:`~flashsgd.comm.errors.PeerError`
  naming the round's peer (or ``peer=None`` when the round has several). CUDA tensors on a Gloo
  group are refused (ValueError): Gloo's send and receive read host memory only. torch's note on ``batch_isend_irecv``: the
  first p2p call on an NCCL group must involve all of its ranks, unless its communicator was
  created eagerly (``init_process_group(device_id=...)``) or by an earlier collective.
* Gloo: nothing to group (torch 2.13: ``supports_coalescing`` is False, and
  ``batch_isend_irecv`` there is a loop of ``isend``/``irecv`` in list order, one work each;
  checked on subgroups with ``group_peer``). So the round is issued as that loop directly: every
  receive, then every send, all before any wait (the same operations in the same order, without
  building ``P2POp`` objects, and seen by whatever wraps ``dist.isend``/``dist.irecv``, as
  ``tests/test_sim_pattern.py`` does to count bytes and rounds). Each work is waited for at most
  ``timeout_s`` by :func:`~flashsgd.comm.waits.wait_peer`, receives first: a silent peer raises
  :class:`~flashsgd.comm.errors.PeerTimeout` naming it.

Empty tensors are neither sent nor received (both sides know the sizes; Gloo rejects some empty
operations). All of a round's operations share one process group, except for a Gloo 2-rank ring,
which sends on one group and receives on its twin (:func:`flashsgd.comm.dense.duplex_groups`).

Cost of a round: one latency for all its messages, a + (bytes this rank sends) b through one
link; grouping adds no message.

Example::

    >>> right, left = (rank + 1) % world, (rank - 1) % world
    >>> exchange([(mine, right)], [(theirs, left)], group, timeout_s=10.0, where="ring step 0")
"""

from __future__ import annotations

from typing import Callable, Sequence, Union

import torch
import torch.distributed as dist
from torch.distributed import ProcessGroup

from flashsgd.comm.errors import PeerError
from flashsgd.comm.waits import global_rank, grouped, wait_peer

Message = tuple[torch.Tensor, int]
"""``(tensor, peer)``: a contiguous tensor to send, or to receive into, and the peer's rank in the
round's group (its group rank, not its global rank)."""

Groups = Union[ProcessGroup, None, tuple[Union[ProcessGroup, None], Union[ProcessGroup, None]]]
"""The round's process group (``None``: the default group), or ``(send group, receive group)``:
two groups with the same members (see the module docstring; Gloo only)."""


def exchange(sends: Sequence[Message], recvs: Sequence[Message], group: Groups, timeout_s: float,
             where: str, *, on_recv: Callable[[int], None] | None = None) -> None:
    """Send and receive one round of messages, issued together, then wait for all of them.

    1. Drop empty tensors (both sides know the sizes: nothing to move).
    2. Issue the round: on NCCL one ``dist.batch_isend_irecv`` of ``P2POp``, receives first; on
       Gloo ``dist.irecv`` for each receive, then ``dist.isend`` for each send (module docstring).
    3. Wait: on Gloo each receive in order (then ``on_recv(i)``), then each send, each at most
       ``timeout_s``; on NCCL the round's work without a CPU deadline (module docstring), then
       ``on_recv(i)`` for every receive.

    Several messages to the same peer in the same direction are matched in list order on both
    sides. Cost: a + (bytes sent) b, one latency for the whole round.

    Args:
        sends: ``(tensor, peer)`` to send, peer a rank of the send group.
        recvs: ``(tensor, peer)`` to receive into, peer a rank of the receive group.
        group: the round's process group, or ``(send group, receive group)`` (:data:`Groups`).
        timeout_s: deadline of each wait on a peer, seconds (Gloo).
        where: algorithm and step, named in errors (e.g. ``"ring all-reduce, all-gather step 0"``).
        on_recv: called with the index in ``recvs`` of each receive once its data is there, in
            order (e.g. to add a segment while the next ones are in flight); empty receives count
            as there at once.

    Raises:
        PeerTimeout: a peer sent (or took) nothing within ``timeout_s`` (names it; Gloo).
        PeerError: the transport failed (a connection closed; on NCCL only an error raised while
            issuing or waiting: a silent peer is ended by NCCL's watchdog).
        ValueError: ``(send group, receive group)`` differ on NCCL (one NCCL group call needs one
            communicator), or CUDA tensors on a Gloo group.

    Example::

        >>> exchange([(send, peer)], [(recv, peer)], group, 10.0, "gtopk all-reduce, butterfly round 0")
    """
    send_group, recv_group = group if isinstance(group, tuple) else (group, group)
    # Step 1
    to_recv = [(i, t, p) for i, (t, p) in enumerate(recvs) if t.numel()]
    to_send = [(t, p) for t, p in sends if t.numel()]
    # Step 2
    recv_works: dict[int, object] = {}
    send_works: list = []
    first = to_recv[0][1] if to_recv else to_send[0][0] if to_send else None
    if first is not None and grouped(first, recv_group if to_recv else send_group):
        _grouped_round(to_recv, to_send, send_group, recv_group, where)  # and its Step 3
    elif first is not None and first.is_cuda:
        raise ValueError(f"{where}: CUDA tensors on a {dist.get_backend(recv_group if to_recv else send_group)} "
                         "group: Gloo sends and receives host memory only; stage the bucket through the host "
                         "(flashsgd.comm.hook_common.HostBucket) or use an NCCL group")
    else:  # Gloo: exactly what batch_isend_irecv does there, one work per operation
        recv_works = {i: dist.irecv(t, group=recv_group, group_src=p) for i, t, p in to_recv}
        send_works = [dist.isend(t, group=send_group, group_dst=p) for t, p in to_send]
    # Step 3
    for i, (_, peer) in enumerate(recvs):
        if i in recv_works:
            wait_peer(recv_works[i], global_rank(recv_group, peer), timeout_s, where)
        if on_recv is not None:
            on_recv(i)
    for (_, peer), work in zip(to_send, send_works):
        wait_peer(work, global_rank(send_group, peer), timeout_s, where, sending=True)


def _grouped_round(to_recv: list, to_send: list, send_group: ProcessGroup | None,
                   recv_group: ProcessGroup | None, where: str) -> None:
    """Steps 2-3 on NCCL: one ``batch_isend_irecv`` (one NCCL group call), receives first, and
    its work waited for on the current stream."""
    if to_recv and to_send and (send_group or dist.group.WORLD) is not (recv_group or dist.group.WORLD):
        raise ValueError(f"{where}: an NCCL round needs one process group for its sends and receives")
    ops = [dist.P2POp(dist.irecv, t, group=recv_group, group_peer=p) for _, t, p in to_recv]
    ops += [dist.P2POp(dist.isend, t, group=send_group, group_peer=p) for t, p in to_send]
    _wait_round(ops, where)


def _wait_round(ops: list, where: str) -> None:
    """NCCL: issue the round and wait for its work(s) on the current stream; an error raised while
    issuing or waiting names the peer when the round has one (``op.peer`` is the global rank)."""
    try:
        for work in dist.batch_isend_irecv(ops):
            work.wait()  # stream wait; bounded by the group's timeout and NCCL's watchdog
    except RuntimeError as exc:
        peers = sorted({op.peer for op in ops})
        detail = str(exc).strip().splitlines()[-1] if str(exc) else repr(exc)
        raise PeerError(dist.get_rank(), peers[0] if len(peers) == 1 else None, where,
                        f"{detail} (peers {peers})") from exc


def gather_from_peers(msg: torch.Tensor, group: ProcessGroup | None, timeout_s: float,
                      where: str) -> torch.Tensor:
    """All-gather equal-length flat messages: ``(P, len)``, row r from group rank r.

    On NCCL: the native ``all_gather_into_tensor`` into the ``(P, len)`` output (a ring inside
    NCCL, (P-1) a + (P-1) m b, bounded by the group's timeout). Elsewhere, by direct exchange: every
    rank sends ``msg`` to and receives a row from each of the other P - 1 ranks in one round
    (:func:`exchange`), so a missing rank is named by every other rank (in a ring, only its
    neighbour could see it). Cost: a + (P-1) m b through one link, the bytes of a ring all-gather
    with one latency instead of P - 1.

    Args:
        msg: this rank's flat message, the same length on every rank.
        group: process group (``None``: the default group).
        timeout_s: deadline of each wait on a peer, seconds (Gloo).
        where: algorithm and step, named in errors.

    Example::

        >>> rows = gather_from_peers(torch.tensor([k, numel]), group, 10.0, "size check")  # (P, 2)
    """
    rank, world = dist.get_rank(group), dist.get_world_size(group)
    out = msg.new_empty(world, msg.numel())  # (P, len)
    if grouped(msg, group):
        dist.all_gather_into_tensor(out.view(-1), msg.view(-1), group=group)  # the (P * len) form
        return out
    out[rank] = msg
    peers = [p for p in range(world) if p != rank]
    exchange([(msg, p) for p in peers], [(out[p], p) for p in peers], group, timeout_s, where)
    return out
