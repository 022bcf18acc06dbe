"""Errors of flashsgd's communication algorithms that name the peer rank at fault.

A rank that waits for a peer (a ring neighbour, a butterfly partner, a rank of a gather) and gets
nothing within the deadline raises :class:`PeerTimeout`; a wait that fails because the peer's
connection broke (the peer died) raises :class:`PeerError`. Both carry ``rank`` (this rank),
``peer`` (the global rank waited for; ``None`` inside a collective, where the late rank is unknown)
and ``where`` (algorithm and step), so a launcher can blame the rank that stopped instead of the
ones that timed out waiting for it. Torch-free, so the names import anywhere.

Example::

    >>> err = PeerTimeout(0, 1, 10.0, "ring all-reduce, reduce-scatter step 2")
    >>> str(err)
    'rank 0: no data from peer rank 1 within 10 s (ring all-reduce, reduce-scatter step 2)'
"""

from __future__ import annotations


class PeerError(RuntimeError):
    """A wait on peer rank ``peer`` failed (its connection broke); the message names both ranks.

    Args:
        rank: this process's global rank.
        peer: the global rank that was waited for, or ``None`` (a collective: any member).
        where: algorithm and step, e.g. ``"gtopk all-reduce, butterfly round 1"``.
        detail: the transport's own message.
    """

    def __init__(self, rank: int, peer: int | None, where: str, detail: str) -> None:
        self.rank, self.peer, self.where, self.detail = rank, peer, where, detail
        who = f"peer rank {peer}" if peer is not None else "a peer"
        super().__init__(f"rank {rank}: lost {who} ({where}): {detail}")

    def __reduce__(self):  # pickle with the constructor's arguments, not the formatted message
        return type(self), (self.rank, self.peer, self.where, self.detail)


class PeerTimeout(PeerError, TimeoutError):
    """Peer rank ``peer`` did not send (or take) data within ``timeout_s`` seconds: it hung,
    stopped, or never called the algorithm. Also a :class:`TimeoutError`.

    Args:
        rank: this process's global rank.
        peer: the global rank that was waited for, or ``None`` (a collective: any member).
        timeout_s: the deadline that passed, in seconds.
        where: algorithm and step.
        members: for ``peer=None``, the ranks of the collective (named in the message).
        sending: the wait was for a send to complete (the peer did not receive), not a receive.
    """

    def __init__(self, rank: int, peer: int | None, timeout_s: float, where: str,
                 members: tuple[int, ...] = (), sending: bool = False) -> None:
        self.rank, self.peer, self.where, self.timeout_s = rank, peer, where, timeout_s
        self.members, self.sending, self.detail = tuple(members), sending, ""
        if peer is None:
            who = f"ranks {', '.join(map(str, members))} did not all take part"
        elif sending:
            who = f"peer rank {peer} did not receive our data"
        else:
            who = f"no data from peer rank {peer}"
        RuntimeError.__init__(self, f"rank {rank}: {who} within {timeout_s:g} s ({where})")

    def __reduce__(self):
        return type(self), (self.rank, self.peer, self.timeout_s, self.where, self.members,
                            self.sending)
