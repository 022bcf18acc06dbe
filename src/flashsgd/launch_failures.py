"""Which rank made a spawned job fail: the one that died or stopped responding, not the peers it broke.

When one rank of a synchronous data-parallel job dies, every peer waiting for it in a collective
fails too ("Connection closed by peer"); when one hangs, its peers time out. The first report to
reach the launcher is usually such a consequence. :func:`attribute` orders the failures so that
the cause comes first:

1. Ranks that exited without a result (killed, ``os._exit``, a crash in C code): the cause.
2. Ranks that raised an error of their own (not a communication failure): the cause.
3. Otherwise, ranks still alive and silent while their peers report communication failures: they
   stopped responding (a hang, ``kill -STOP``); a peer named by the errors (an exception's
   ``.peer`` rank, or "peer rank N" in its text) narrows the blame when several are silent.
4. The other failed ranks are summarised as consequences, grouped by their (shortened) error.

A worker describes its exception with :func:`describe_exception` (a plain dict, so it pickles);
the launcher turns the outcomes into one :class:`WorkerError` whose ``summary`` has one line per
cause and whose ``details`` carry every traceback.

Example::

    >>> err = attribute([RankOutcome(0, "raised", error="Connection closed by peer",
    ...                              comm=True), RankOutcome(1, "exited", exitcode=-9)])
    >>> str(err)
    'rank 1 exited with code -9 (SIGKILL); rank 0 then failed: Connection closed by peer'
"""

from __future__ import annotations

import dataclasses
import re
import signal
import traceback
from typing import Literal

# Text of a failed collective or store wait (Gloo, NCCL, c10d store, flashsgd.comm): a peer is gone
# or late. Checked on every exception of the chain, so wrappers that re-raise keep the diagnosis.
COMM_ERROR_TEXT = re.compile(
    r"connection (closed|reset|refused)|broken pipe|timed? ?out|no data from peer|peer rank \d+",
    re.IGNORECASE)
TIMEOUT_TEXT = re.compile(r"timed? ?out|deadline", re.IGNORECASE)
PEER_TEXT = re.compile(r"peer rank (\d+)")
SHORT_ERROR_CHARS = 200
OWN_ERROR_CHARS = 600  # a rank's own error (its advice included), clipped at a word boundary


class WorkerError(RuntimeError):
    """A spawned job failed; ``str(err)`` is :attr:`summary`.

    Attributes:
        summary: one line per cause, the cause first, then its consequences
            ("rank 1 exited with code -9 (SIGKILL); ranks 0,2,3 then failed: Connection closed by
            peer"); what a command line prints.
        details: the summary followed by every rank's traceback or exit status; what a log keeps.
        causes: the ranks blamed, ascending.
    """

    def __init__(self, summary: str, details: str = "", causes: tuple[int, ...] = ()):
        super().__init__(summary)
        self.summary = summary
        self.details = details or summary
        self.causes = tuple(causes)


@dataclasses.dataclass
class RankOutcome:
    """How one rank ended, as the launcher saw it.

    ``state``: ``ok`` (returned), ``raised`` (reported an exception), ``exited`` (the process ended
    without a result; ``exitcode`` says how), ``silent`` (still running when the job was stopped).
    ``error``/``traceback``/``comm``/``timeout``/``peer`` come from :func:`describe_exception`.
    """

    rank: int
    state: Literal["ok", "raised", "exited", "silent"]
    exitcode: int | None = None
    error: str = ""
    traceback: str = ""
    comm: bool = False
    timeout: bool = False
    peer: int | None = None


def _chain(exc: BaseException) -> list[BaseException]:
    """``exc`` and the exceptions it was raised from or during, outermost first."""
    seen: list[BaseException] = []
    while exc is not None and not any(exc is s for s in seen):
        seen.append(exc)
        exc = exc.__cause__ or exc.__context__
    return seen


def _first_line(exc: BaseException) -> str:
    text = str(exc).strip()
    return text.splitlines()[0] if text else ""


# torch.futures prefixes an error raised in a ``.then()`` callback with this, once per chained
# callback (a hook's future, then CommTimer's): "Got ...: RuntimeError: Got ...: PeerTimeout: ...".
CALLBACK_PREFIX = re.compile(r"(?:Got the following error when running the callback:\s*(?:[A-Z]\w*: )?)+")


def clip(text: str, limit: int) -> str:
    """``text`` cut to at most ``limit`` characters at a word boundary, ending in " ..." when cut."""
    if len(text) <= limit:
        return text
    cut = text[:limit - 4]
    space = cut.rfind(" ")
    if space > limit // 2:  # a word boundary not too far back; else cut inside a very long token
        cut = cut[:space]
    return cut.rstrip(" ,;:(") + " ..."


def one_line(exc: BaseException | str, limit: int = 300) -> str:
    """The first line of an error, without torch's repeated "Got the following error when running
    the callback: " prefixes (the innermost error is the cause), clipped at a word boundary."""
    text = exc if isinstance(exc, str) else _first_line(exc)
    first = text.strip().splitlines()[0] if text.strip() else ""
    return clip(CALLBACK_PREFIX.sub("", first).strip(), limit)


def comm_failures(exc: BaseException) -> list[BaseException]:
    """The exceptions of ``exc``'s chain that are failed collectives or store waits (a peer is gone
    or late): a ``torch.distributed.DistError``, an exception with an integer ``.peer``, or one
    whose text matches :data:`COMM_ERROR_TEXT`. Empty: ``exc`` is not a communication failure."""
    import torch.distributed as dist

    return [e for e in _chain(exc) if isinstance(e, dist.DistError) or isinstance(
        getattr(e, "peer", None), int) or COMM_ERROR_TEXT.search(_first_line(e))]


def shorten(message: str) -> str:
    """A communication error without source locations, addresses and advice (groups equal causes).

    ``[.../gloo/transport/tcp/pair.cc:553] Connection closed by peer [127.0.0.1]:44957. This is
    typically caused by ...`` -> ``Connection closed by peer``.
    """
    text = CALLBACK_PREFIX.sub("", message.strip())                      # torch's callback prefixes
    text = re.sub(r"\[[^\]\s]*\.\w+:\d+\]\s*", "", text)                  # [file.cc:line]
    text = re.sub(r"\s*\[[0-9a-fA-F.:]+\]:\d+", "", text)               # [addr]:port
    text = re.split(r"\.\s", text, maxsplit=1)[0].rstrip(".")           # first sentence
    return one_line(text, SHORT_ERROR_CHARS)


def describe_exception(exc: BaseException) -> dict:
    """What a worker reports about ``exc``: the fields of :class:`RankOutcome` it can know.

    ``comm``: some exception of the chain is a failed collective or store wait (a
    ``torch.distributed.DistError``, an exception with an integer ``.peer``, or one whose text
    matches :data:`COMM_ERROR_TEXT`); ``timeout``: such a wait ran out of time; ``peer``: the rank
    it waited for, when named; ``error``: ``Type: first line`` of the outermost exception, or the
    shortened innermost communication error when the failure is a communication failure.
    """
    chain = _chain(exc)
    comm_excs = comm_failures(exc)
    peer = next((e.peer for e in chain if isinstance(getattr(e, "peer", None), int)), None)
    if peer is None:
        named = [m for e in chain for m in PEER_TEXT.findall(str(e))]
        peer = int(named[0]) if named else None
    timeout = any(isinstance(e, TimeoutError) or TIMEOUT_TEXT.search(_first_line(e))
                  for e in comm_excs)
    own = f"{type(exc).__name__}: {one_line(exc, OWN_ERROR_CHARS)}".rstrip(": ")
    return {"error": shorten(_first_line(comm_excs[-1])) if comm_excs else own,
            "traceback": "".join(traceback.format_exception(exc)),
            "comm": bool(comm_excs), "timeout": timeout, "peer": peer}


def _ranks(outcomes: list[RankOutcome]) -> str:
    ranks = sorted(o.rank for o in outcomes)
    return ("rank " if len(ranks) == 1 else "ranks ") + ",".join(map(str, ranks))


def _exit_text(code: int | None) -> str:
    if code is not None and code < 0:
        try:
            return f"exited with code {code} ({signal.Signals(-code).name})"
        except ValueError:
            pass
    return f"exited with code {code}"


def _grouped(outcomes: list[RankOutcome], text) -> list[str]:
    """One ``"<ranks> <text(o)>"`` per distinct text, in order of the lowest rank."""
    groups: dict[str, list[RankOutcome]] = {}
    for o in sorted(outcomes, key=lambda o: o.rank):
        groups.setdefault(text(o), []).append(o)
    return [f"{_ranks(g)} {t}" for t, g in groups.items()]


def _consequences(failed: list[RankOutcome], silent: list[RankOutcome]) -> str:
    """``ranks 0,2 then failed: X; rank 3 then stopped (killed)``: what the cause brought down."""
    parts = _grouped(failed, lambda o: f"then failed: {o.error}")
    if silent:
        parts.append(f"{_ranks(silent)} still running (killed)")
    return "; ".join(parts)


def _hang_causes(silent: list[RankOutcome], comm: list[RankOutcome]) -> list[RankOutcome]:
    """Step 3: the silent ranks the peers' errors name, else every silent rank."""
    named = {o.peer for o in comm if o.peer is not None}
    return [o for o in silent if o.rank in named] or silent


def _hang_summary(causes: list[RankOutcome], comm: list[RankOutcome],
                  others: list[RankOutcome]) -> str:
    waited = [o for o in comm if o.timeout]
    how = [f"{_ranks(waited)} timed out waiting"] if waited else []
    how += _grouped([o for o in comm if not o.timeout], lambda o: f"then failed: {o.error}")
    if others:
        how.append(f"{_ranks(others)} still running")
    return f"{_ranks(causes)} stopped responding ({'; '.join(how)}; killed)"


def lost_connections(waited: dict[int, int | None], ranks_per_node: int) -> str | None:
    """The network partition a job's failures describe, in words, or None when they describe none.

    ``waited``: every failed rank -> the peer rank it timed out waiting for (None: it died, raised
    an error of its own, or named no peer). A partition is when every failed rank timed out on a
    peer of another node, and ranks on both sides of a cut failed (one side waiting on a silent
    other side is a stop there, not a lost link): the two nodes then blame each other, and neither
    is the cause. Example: ``{0: 2, 1: 3, 2: 0, 3: 1}`` at 2 ranks per node -> "the connection between
    node 0 (ranks 0,1) and node 1 (ranks 2,3) was lost: every failed rank timed out waiting for a
    rank of the other node, and none died or failed on its own".
    """
    if not waited or ranks_per_node < 1 or any(p is None for p in waited.values()):
        return None
    node = lambda r: r // ranks_per_node  # noqa: E731
    links = {tuple(sorted((node(r), node(p)))) for r, p in waited.items()}
    if any(a == b for a, b in links):
        return None  # a wait inside a node: a rank stopped, not a link
    sides = {node(r) for r in waited}
    if not all(a in sides and b in sides for a, b in links):
        return None  # one side waited on a node none of whose ranks failed: that node stopped
    ranks = lambda n: ",".join(str(r) for r in range(n * ranks_per_node, (n + 1) * ranks_per_node))  # noqa: E731
    named = " and ".join(f"node {a} (ranks {ranks(a)})" for a in sorted({n for link in links for n in link}))
    which = "the connection between" if len(links) == 1 else "the connections between"
    pairs = "" if len(links) == 1 else " (" + ", ".join(f"{a}-{b}" for a, b in sorted(links)) + ")"
    return (f"{which} {named}{pairs} {'was' if len(links) == 1 else 'were'} lost: every failed rank "
            "timed out waiting for a rank of the other node, and none died or failed on its own")


def _details(summary: str, outcomes: list[RankOutcome]) -> str:
    sections = [summary]
    for o in sorted(outcomes, key=lambda o: o.rank):
        if o.state == "raised":
            sections.append(f"--- rank {o.rank} raised:\n{o.traceback.rstrip()}")
        elif o.state == "exited":
            sections.append(f"--- rank {o.rank} {_exit_text(o.exitcode)} without a result")
        elif o.state == "silent":
            sections.append(f"--- rank {o.rank} was still running and was killed")
    return "\n\n".join(sections)


def attribute(outcomes: list[RankOutcome], reason: str = "", ranks_per_node: int | None = None) -> WorkerError:
    """Steps 1-4: the error for a failed job, its cause first.

    Args:
        outcomes: one per rank (ranks that returned may be omitted).
        reason: why the launcher stopped when no rank failed (a passed deadline); it heads the
            summary then, followed by the ranks still running.
        ranks_per_node: the job's layout, when it spans nodes: ranks of two nodes that all timed
            out on each other lead with the lost connection (:func:`lost_connections`).
    """
    by_state = {s: [o for o in outcomes if o.state == s] for s in ("raised", "exited", "silent")}
    comm = [o for o in by_state["raised"] if o.comm]
    # Steps 1-2
    causes = sorted(by_state["exited"] + [o for o in by_state["raised"] if not o.comm],
                    key=lambda o: o.rank)
    if causes:
        lines = _grouped(by_state["exited"], lambda o: _exit_text(o.exitcode)) + _grouped(
            [o for o in causes if o.state == "raised"], lambda o: f"failed: {o.error}")
        follow = _consequences(comm, by_state["silent"])
        summary = "\n".join([lines[0] + (f"; {follow}" if follow else ""), *lines[1:]])
    elif reason:
        causes = by_state["silent"]
        summary = f"{reason}; {_ranks(causes)} still running (killed)" if causes else reason
    elif by_state["silent"] and comm:  # Step 3
        causes = _hang_causes(by_state["silent"], comm)
        others = [o for o in by_state["silent"] if o not in causes]
        summary = _hang_summary(causes, comm, others)
    else:  # only communication failures, nobody silent: name the waited-for peer when known
        causes = comm
        summary = "\n".join(_grouped(comm, lambda o: f"failed: {o.error}"))
        cut = lost_connections({o.rank: o.peer if o.timeout else None for o in comm}, ranks_per_node or 0)
        if cut:
            summary = f"{cut}\n{summary}"
    return WorkerError(summary, _details(summary, outcomes), tuple(sorted(o.rank for o in causes)))
