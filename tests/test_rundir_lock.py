"""rundir.lock between real processes: only the holder of the flock ever removes ``.lock`` or the
directory, and a lock taken on a ``.lock`` removed meanwhile is not a lock (issue 49 item 6).

Two real processes (fork) race on one directory. The interleavings that broke it are made certain,
not hoped for: a process is paused at its first ``fcntl.flock`` call (a profile hook: nothing of
the code under test is replaced) while the other takes the lock, and the holder waits between
taking the lock and its first write (the issue's gap) until the other process is done. One more
test races the two without a pause, many times over.
"""

from __future__ import annotations

import fcntl
import multiprocessing
import os
import sys
from pathlib import Path

from flashsgd.train.records import rundir

CTX = multiprocessing.get_context("fork")
WAIT_S = 60.0  # only a hang waits this long: every wait below is for an event the other side sets


def _pause_at_first_flock(reached, go_on) -> None:
    """In this process: at its first ``fcntl.flock`` call, set ``reached`` and wait for ``go_on``."""
    def profile(frame, event, arg):
        if event == "c_call" and arg is fcntl.flock:
            sys.setprofile(None)
            reached.set()
            go_on.wait(WAIT_S)
    sys.setprofile(profile)


def _locked_now(path: Path) -> bool:
    """Whether the file at ``path`` is flock-ed by someone (a new open file description conflicts
    with every other one, even in the same process)."""
    try:
        fd = os.open(path, os.O_RDWR)
    except FileNotFoundError:
        return False
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        return True
    finally:
        os.close(fd)
    return False


def _what_a_holder_sees(out: Path) -> dict[str, bool]:
    return {"dir": out.is_dir(), "lock file": (out / ".lock").is_file(),
            "lock file locked": _locked_now(out / ".lock")}


HELD = {"dir": True, "lock file": True, "lock file locked": True}


def _holder(out: Path, holding, release, results, write: bool = True) -> None:
    """Take the lock, say so, wait for ``release`` (the gap before the first write), then report
    what the holder sees and make its first write (or none: a start refused before writing)."""
    try:
        with rundir.lock(out):
            holding.set()
            release.wait(WAIT_S)
            seen = _what_a_holder_sees(out)
            if write:
                (out / "config.toml").write_text("the holder's first write\n")
        results.put(("holder", seen))
    except Exception as exc:  # noqa: BLE001 - reported to the test
        results.put(("holder", f"{type(exc).__name__}: {exc}"))


def _contender(out: Path, reached, go_on, results) -> None:
    """Take the lock, paused at the first flock call until ``go_on``; report what happened."""
    if reached is not None:
        _pause_at_first_flock(reached, go_on)
    try:
        with rundir.lock(out):
            results.put(("contender", _what_a_holder_sees(out)))
    except rundir.RunDirError as exc:
        results.put(("contender", f"refused: {exc}"))
    except Exception as exc:  # noqa: BLE001
        results.put(("contender", f"{type(exc).__name__}: {exc}"))


def _finish(*procs) -> None:
    for p in procs:
        p.join(WAIT_S)
        assert p.exitcode == 0, p


def _results(queue, n: int) -> dict[str, object]:
    return dict(queue.get(timeout=WAIT_S) for _ in range(n))


def test_a_refused_process_that_made_the_directory_removes_nothing(tmp_path):
    """Both see the directory as new: the refused one made it, the holder took the lock before
    the refused one's flock. The refused process used to remove the holder's .lock and directory."""
    out = tmp_path / "run"
    e = [CTX.Event() for _ in range(4)]
    reached, go_on, holding, release = e
    results = CTX.Queue()
    contender = CTX.Process(target=_contender, args=(out, reached, go_on, results))
    contender.start()
    assert reached.wait(WAIT_S)           # it made the directory and opened .lock
    assert out.is_dir()
    holder = CTX.Process(target=_holder, args=(out, holding, release, results))
    holder.start()
    assert holding.wait(WAIT_S)           # the holder has the lock, and has written nothing yet
    go_on.set()                           # the contender's flock: refused
    contender.join(WAIT_S)
    release.set()                         # the holder's gap is over: its first write
    _finish(contender, holder)
    seen = _results(results, 2)
    assert str(seen["contender"]).startswith("refused: run directory"), seen
    assert seen["holder"] == HELD, seen
    assert (out / "config.toml").is_file()


def test_a_lock_on_a_removed_lock_file_is_taken_again(tmp_path):
    """The other order: a process opened .lock, then its holder (a start refused before writing)
    removed it and the directory. Locking the removed file is no lock: the process takes the lock
    of the directory it makes again, and a third process is refused."""
    out = tmp_path / "run"
    reached, go_on, holding, release = (CTX.Event() for _ in range(4))
    results = CTX.Queue()
    holder = CTX.Process(target=_holder, args=(out, holding, release, results, False))
    holder.start()
    assert holding.wait(WAIT_S)
    contender = CTX.Process(target=_contender, args=(out, reached, go_on, results))
    contender.start()
    assert reached.wait(WAIT_S)           # the contender opened the holder's .lock
    release.set()                         # the holder leaves, having written nothing
    holder.join(WAIT_S)
    assert not out.exists()               # the holder removed its own directory
    go_on.set()
    _finish(holder, contender)
    seen = _results(results, 2)
    assert seen["contender"] == HELD, seen


def _racer(out: Path, barrier, reported, results) -> None:
    """One of two processes started together: the one that gets the lock keeps it until the other
    has reported, then says what it sees; the other says it was refused."""
    barrier.wait(WAIT_S)
    try:
        with rundir.lock(out):
            reported.wait(WAIT_S)
            results.put(_what_a_holder_sees(out))
            (out / "config.toml").write_text("first write\n")
    except rundir.RunDirError:
        results.put("refused")
        reported.set()
    except Exception as exc:  # noqa: BLE001
        results.put(f"{type(exc).__name__}: {exc}")
        reported.set()


def test_two_processes_started_together_never_share_a_directory(tmp_path):
    """No pause injected: two processes race on a new directory, 20 times. Exactly one holds it,
    and its .lock and directory stay (the pauses above make the failing orders certain)."""
    outcomes = []
    for trial in range(20):
        out = tmp_path / f"run{trial}"
        barrier, reported, results = CTX.Barrier(2), CTX.Event(), CTX.Queue()
        procs = [CTX.Process(target=_racer, args=(out, barrier, reported, results)) for _ in range(2)]
        for p in procs:
            p.start()
        seen = [results.get(timeout=WAIT_S) for _ in procs]
        _finish(*procs)
        outcomes.append(seen)
    assert all(HELD in o and "refused" in o for o in outcomes), outcomes
