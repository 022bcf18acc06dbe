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
4. Otherwise every failed rank failed waiting for another: when ranks of two or more nodes all
   timed out (no rank died, stopped or failed on its own), the connection between those nodes was
   lost (:func:`lost_connections`): the nodes blamed each other, neither is the cause.
5. The other failed ranks are summarised as consequences, grouped by their (shortened) error.

A full disk (ENOSPC or EDQUOT anywhere in a rank's exception chain, or "No space left on device" in
its text) leads the summary, with the path and the space left there (:func:`disk_full`): torch's
own report of the same failed write ("enforce fail at inline_container.cc ... unexpected pos")
says nothing of the cause, so it never comes first.

A worker describes its exception with :func:`describe_exception` (a plain dict, so it pickles),
a launcher that only has a rank's output with :func:`describe_log`; the launcher turns the outcomes
into one :class:`WorkerError` whose ``summary`` has one line per cause and whose ``details`` carry
every traceback.

Example::

    >>> err = attribute([RankOutcome(0, "raised", error="Connection closed by peer",
    ...                              comm=True), RankOutcome(1, "exited", exitcode=-9)])
    >>> str(err)
    'rank 1 exited with code -9 (SIGKILL); rank 0 then failed: Connection closed by peer'
"""

from __future__ import annotations

import dataclasses
import errno
import os
import re
import shutil
import signal
import traceback
from pathlib import Path
from typing import Literal

from flashsgd.fmt import size

# Text of a failed collective or store wait (Gloo, NCCL, c10d store, flashsgd.comm): a peer is gone
# or late. Checked on every exception of the chain, so wrappers that re-raise keep the diagnosis.
COMM_ERROR_TEXT = re.compile(
    r"connection (closed|reset|refused)|broken pipe|timed? ?out|no data from peer|peer rank \d+",
    re.IGNORECASE)
TIMEOUT_TEXT = re.compile(r"timed? ?out|deadline", re.IGNORECASE)
PEER_TEXT = re.compile(r"peer rank (\d+)")
TIMEOUT_S_TEXT = re.compile(r"within (\d+(?:\.\d+)?) s\b|waiting (\d+) ?ms\b")  # PeerTimeout's; Gloo's
DISK_FULL_ERRNOS = (errno.ENOSPC, errno.EDQUOT)
DISK_FULL_TEXT = re.compile(r"No space left on device|Disk quota exceeded")
TORCH_WRITE_TEXT = re.compile(r"inline_container\.cc|unexpected pos")  # torch.save's failed write
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
    The other fields come from :func:`describe_exception` (or :func:`describe_log`): ``peer`` the
    rank a failed wait named, ``members`` the ranks of a collective that named none, ``timeout_s``
    the deadline that passed, ``ranks_per_node`` the job's layout as the rank knew it (nodes are
    ``rank // ranks_per_node``), ``disk_full`` the full disk in words, or "".
    """

    rank: int
    state: Literal["ok", "raised", "exited", "silent"]
    exitcode: int | None = None
    error: str = ""
    traceback: str = ""
    comm: bool = False
    timeout: bool = False
    peer: int | None = None
    members: tuple[int, ...] = ()
    timeout_s: float | None = None
    ranks_per_node: int | None = None
    disk_full: str = ""


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


def _free_space(path: str | None) -> str:
    """"; 1.2 MiB free there now" for the filesystem of ``path`` (its nearest existing folder), or ""."""
    if not path:
        return ""
    folder = Path(path)
    while not folder.exists() and folder != folder.parent:
        folder = folder.parent
    try:
        return f"; {size(shutil.disk_usage(folder).free)} free there now"
    except OSError:
        return ""


def disk_full(exc: BaseException | str) -> str:
    """A full disk in ``exc``'s chain (or text), in words: the OS's error naming the path, and the
    space left on that filesystem ("[Errno 28] No space left on device: '/run/x.pt'; 0 B free there
    now"); "" when the failure is not a full disk (ENOSPC, EDQUOT)."""
    if isinstance(exc, str):
        line = next((ln for ln in exc.splitlines() if DISK_FULL_TEXT.search(ln)), "")
        if not line:
            return ""
        text = one_line(line[line.index("[Errno"):] if "[Errno" in line else DISK_FULL_TEXT.search(line)[0])
        path = re.search(r"(?:device|exceeded): '([^']+)'", text)
        return text + _free_space(path.group(1) if path else None)
    chain = _chain(exc)
    full = next((e for e in chain if isinstance(e, OSError) and e.errno in DISK_FULL_ERRNOS), None)
    if full is not None:
        return one_line(str(full)) + _free_space(full.filename if isinstance(full.filename, str) else None)
    return disk_full("\n".join(_first_line(e) for e in chain))


def _timeout_seconds(exceptions: list[BaseException]) -> float | None:
    """The deadline a failed wait ran out of: a PeerTimeout's ``timeout_s``, or Gloo's "Timed out
    waiting 8000ms" / "within 8 s" in the text."""
    for e in exceptions:
        if isinstance(getattr(e, "timeout_s", None), (int, float)):
            return float(e.timeout_s)
    for e in exceptions:
        found = TIMEOUT_S_TEXT.search(str(e))
        if found:
            return float(found.group(1)) if found.group(1) else int(found.group(2)) / 1000
    return None


def _layout(chain: list[BaseException]) -> int | None:
    """Ranks per node as this rank knows it: an exception's ``ranks_per_node`` (a worker's topology),
    else ``FLASHSGD_RANKS_PER_NODE`` or torchrun's ``LOCAL_WORLD_SIZE``."""
    for e in chain:
        if isinstance(getattr(e, "ranks_per_node", None), int):
            return e.ranks_per_node
    for var in ("FLASHSGD_RANKS_PER_NODE", "LOCAL_WORLD_SIZE"):
        if os.environ.get(var, "").strip().isdigit():
            return int(os.environ[var])
    return None


def describe_exception(exc: BaseException) -> dict:
    """What a worker reports about ``exc``: the fields of :class:`RankOutcome` it can know.

    ``comm``: some exception of the chain is a failed collective or store wait (a
    ``torch.distributed.DistError``, an exception with an integer ``.peer``, or one whose text
    matches :data:`COMM_ERROR_TEXT`); ``timeout``: such a wait ran out of time (``timeout_s``: how
    long it waited, when said); ``peer``: the rank it waited for, when named; ``members``: the ranks
    of the collective, when no peer is named (:class:`flashsgd.comm.errors.PeerTimeout`);
    ``ranks_per_node``: :func:`_layout`; ``disk_full``: :func:`disk_full`; ``error``: ``Type: first
    line`` of the outermost exception, or the shortened innermost communication error when the
    failure is a communication failure, or the OS's error when the outermost is torch's report of
    a write that a full disk refused.
    """
    chain = _chain(exc)
    comm_excs = comm_failures(exc)
    peer = next((e.peer for e in chain if isinstance(getattr(e, "peer", None), int)), None)
    if peer is None:
        named = [m for e in chain for m in PEER_TEXT.findall(str(e))]
        peer = int(named[0]) if named else None
    members = next((tuple(e.members) for e in chain if getattr(e, "members", None)), ())
    timeout = any(isinstance(e, TimeoutError) or TIMEOUT_TEXT.search(_first_line(e))
                  for e in comm_excs)
    full = disk_full(exc)
    own = f"{type(exc).__name__}: {one_line(exc, OWN_ERROR_CHARS)}".rstrip(": ")
    if full and TORCH_WRITE_TEXT.search(own):  # torch's words for the failed write: the OS's instead
        os_error = next((e for e in chain if isinstance(e, OSError) and e.errno in DISK_FULL_ERRNOS), None)
        own = f"{type(os_error or exc).__name__}: {full.split('; ')[0]}"
    return {"error": shorten(_first_line(comm_excs[-1])) if comm_excs else own,
            "traceback": "".join(traceback.format_exception(exc)),
            "comm": bool(comm_excs), "timeout": timeout, "peer": peer, "members": members,
            "timeout_s": _timeout_seconds(comm_excs) if timeout else None,
            "ranks_per_node": _layout(chain), "disk_full": full}


EXCEPTION_LINE = re.compile(
    r"^(?:\[rank\d+\]:\s*)?((?:[A-Za-z_]\w*\.)*[A-Z]\w*(?:Error|Exception|Timeout|Interrupt|Exit)): ?(.*)$",
    re.MULTILINE)
"""The last line of a printed traceback ("RuntimeError: ..."), also with torch's "[rank3]: " prefix."""


def describe_log(text: str) -> dict | None:
    """:func:`describe_exception` for a rank known only by its output (an emulated cluster's rank
    log): the exceptions its tracebacks end with, the innermost first as Python prints a chain;
    None when it printed none (it was killed, or exited on its own)."""
    found = [(m.group(1), m.group(2).strip()) for m in EXCEPTION_LINE.finditer(text)]
    if not found:
        return None
    comm_lines = [msg for name, msg in found if COMM_ERROR_TEXT.search(msg)]
    name, msg = found[-1]
    own = f"{name.rsplit('.', 1)[-1]}: {one_line(msg, OWN_ERROR_CHARS)}".rstrip(": ")
    full = disk_full("\n".join(msg for _, msg in found))
    if full and TORCH_WRITE_TEXT.search(own):
        own = f"OSError: {full.split('; ')[0]}"
    peers = [int(p) for _, msg in found for p in PEER_TEXT.findall(msg)]
    timeout = any(TIMEOUT_TEXT.search(m) for m in comm_lines)
    seconds = next((TIMEOUT_S_TEXT.search(m) for m in comm_lines if TIMEOUT_S_TEXT.search(m)), None)
    return {"error": shorten(comm_lines[0]) if comm_lines else own,
            "traceback": text[-4000:], "comm": bool(comm_lines), "timeout": timeout,
            "peer": peers[0] if peers else None,
            "timeout_s": (float(seconds.group(1)) if seconds.group(1) else int(seconds.group(2)) / 1000)
            if timeout and seconds else None, "disk_full": full}


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
                  others: list[RankOutcome], ranks_per_node: int | None = None) -> str:
    waited = [o for o in comm if o.timeout]
    how = [f"{_ranks(waited)} timed out waiting"] if waited else []
    how += _grouped([o for o in comm if not o.timeout], lambda o: f"then failed: {o.error}")
    if others:
        how.append(f"{_ranks(others)} still running")
    return f"{_whole_nodes(causes, ranks_per_node) or _ranks(causes)} stopped responding ({'; '.join(how)}; killed)"


def _whole_nodes(outcomes: list[RankOutcome], ranks_per_node: int | None) -> str:
    """``node 1 (ranks 2,3)`` when ``outcomes`` are every rank of some nodes (of several), else ""."""
    if not ranks_per_node:
        return ""
    ranks = {o.rank for o in outcomes}
    nodes = sorted({r // ranks_per_node for r in ranks})
    whole = ranks == {r for n in nodes for r in range(n * ranks_per_node, (n + 1) * ranks_per_node)}
    if not whole or ranks_per_node < 2:
        return ""
    return _and([_node(n, ranks_per_node) for n in nodes])


def _rank_list(ranks) -> str:
    """``0,1`` or ``0-7``: ranks, with a run of three or more written as a range."""
    ranks, parts = sorted(ranks), []
    for r in ranks:
        if parts and parts[-1][1] == r - 1:
            parts[-1][1] = r
        else:
            parts.append([r, r])
    return ",".join(f"{a}" if a == b else f"{a},{b}" if b == a + 1 else f"{a}-{b}" for a, b in parts)


def _node(n: int, ranks_per_node: int) -> str:
    return f"node {n} (ranks {_rank_list(range(n * ranks_per_node, (n + 1) * ranks_per_node))})"


def _and(items: list[str]) -> str:
    return items[0] if len(items) == 1 else ", ".join(items[:-1]) + " and " + items[-1]


def _waited_node(o: RankOutcome, ranks_per_node: int) -> int | None:
    """The one other node whose ranks ``o``'s failed wait was for (its ``peer``, else the other
    members of its collective), or None: unnamed, inside its own node, or several nodes."""
    waited = {o.peer} if o.peer is not None else set(o.members) - {o.rank}
    nodes = {p // ranks_per_node for p in waited}
    mine = o.rank // ranks_per_node
    return nodes.pop() if len(nodes) == 1 and mine not in nodes else None


def lost_connections(outcomes: list[RankOutcome], ranks_per_node: int | None) -> str | None:
    """The network partition a job's failures describe, in words, or None when they describe none.

    A node cut off for good fails every rank within the timeout, each side waiting for the other:
    each blames a rank of the other node, and neither is the cause. Steps:

    1. No rank died (``exited``), stopped (``silent``: a one-sided stall is a stop there, not a
       link) or raised an error of its own; every failed rank failed waiting for a peer.
    2. Ranks of two or more nodes timed out (each side stopped hearing from the other); the
       others lost a peer that had (a connection closed, a wait inside the node).
    3. The cut: the links the waits name (a peer, or a collective's members, on one other node);
       none named (Gloo's own collectives name no peer) with two nodes: the link between them;
       with more: the network between them all. A node in every named link was cut off from the
       others.

    Example: ranks 0-3 at 2 ranks per node, each timed out waiting for rank ``(r + 2) % 4`` ->
    "the connection between node 0 (ranks 0,1) and node 1 (ranks 2,3) was lost or stalled beyond
    the 10 s timeout: ranks of both nodes timed out waiting for each other, and none died, stopped
    or failed on its own".
    """
    failed = [o for o in outcomes if o.state != "ok"]
    if not failed or not ranks_per_node or ranks_per_node < 1:
        return None
    if any(o.state != "raised" or not o.comm for o in failed):                       # Step 1
        return None
    node = lambda r: r // ranks_per_node  # noqa: E731
    timed = {node(o.rank) for o in failed if o.timeout}
    if len(timed) < 2:                                                                # Step 2
        return None
    links = {tuple(sorted((node(o.rank), far))) for o in failed
             if (far := _waited_node(o, ranks_per_node)) is not None}                 # Step 3
    nodes = sorted({n for link in links for n in link} or {node(o.rank) for o in failed})
    seconds = max((o.timeout_s for o in failed if o.timeout_s), default=None)
    stalled = f"lost or stalled beyond the {seconds:g} s timeout" if seconds else "lost or stalled beyond the timeout"
    why = (f"ranks of {'both nodes' if len(timed) == 2 == len(nodes) else f'{len(timed)} nodes'} timed "
           "out waiting for each other, and none died, stopped or failed on its own")
    hub = [n for n in nodes if all(n in link for link in links)]
    if len(nodes) == 2:
        return f"the connection between {_and([_node(n, ranks_per_node) for n in nodes])} was {stalled}: {why}"
    if len(links) > 1 and len(hub) == 1:  # one node cut off from the others
        others = _and([_node(n, ranks_per_node) for n in nodes if n != hub[0]])
        return f"the connections of {_node(hub[0], ranks_per_node)} to {others} were {stalled}: {why}"
    named = _and([_node(n, ranks_per_node) for n in nodes])
    if links:
        pairs = ", ".join(f"{a}-{b}" for a, b in sorted(links))
        return f"the connections between {named} (links {pairs}) were {stalled}: {why}"
    return f"the network between {named} was {stalled}: {why}"


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


def _common_layout(outcomes: list[RankOutcome]) -> int | None:
    """The ranks per node the ranks reported, when they agree."""
    layouts = {o.ranks_per_node for o in outcomes if o.ranks_per_node}
    return layouts.pop() if len(layouts) == 1 else None


def attribute(outcomes: list[RankOutcome], reason: str = "", ranks_per_node: int | None = None) -> WorkerError:
    """Steps 1-5: the error for a failed job, its cause first (a full disk before everything).

    Args:
        outcomes: one per rank (ranks that returned may be omitted).
        reason: why the launcher stopped when no rank failed (a passed deadline); it heads the
            summary then, followed by the ranks still running.
        ranks_per_node: the job's layout, when it spans nodes (default: what the ranks reported,
            when they agree): ranks of two nodes that all timed out on each other lead with the
            lost connection (:func:`lost_connections`), and a whole node that stopped is named.
    """
    rpn = ranks_per_node or _common_layout(outcomes)
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
        summary = _hang_summary(causes, comm, others, rpn)
    else:  # Step 4: only communication failures, nobody silent
        causes = comm
        summary = "\n".join(_grouped(comm, lambda o: f"failed: {o.error}"))
        cut = lost_connections(outcomes, rpn)
        if cut:  # no rank is the cause: the link between the nodes is
            causes, summary = [], f"{cut}\n{summary}"
    disk = sorted((o for o in outcomes if o.disk_full), key=lambda o: o.rank)
    if disk:  # the cause, before any rank's words for it
        summary = f"out of disk space ({_ranks(disk)}): {disk[0].disk_full}\n{summary}"
    return WorkerError(summary, _details(summary, outcomes), tuple(sorted(o.rank for o in causes)))
