"""Rank 0's progress during `flashsgd train`: tqdm's bar on a terminal, a plain line every few
seconds anywhere else.

tqdm redraws its bar with carriage returns about ten times a second. Written to a file or a pipe
(a CI log, ``flashsgd train 2>&1 | tee log``, a batch job's stderr) those redraws are one line that
grows by ~100 bytes per redraw (12 KB for the default 120-step run). So :func:`progress_bar` gives
tqdm only when the stream is a terminal, and otherwise :class:`ProgressLines`: an ordinary line
every :data:`LINE_EVERY_S` seconds and one at the end, with what the bar shows (step of total,
rate, elapsed, time left, and the worker's postfix: epoch, loss, LR, last test accuracy).

Both have the calls the worker makes: ``update(n)``, ``set_postfix(refresh=..., **values)``,
``close()``.

Example::

    >>> import io
    >>> out, times = io.StringIO(), iter([0.0, 1.0, 6.0, 7.0, 8.0])
    >>> p = ProgressLines(total=4, file=out, every_s=5.0, clock=lambda: next(times))
    >>> for loss in ("2.30", "1.10", "0.70"):
    ...     p.set_postfix(loss=loss, refresh=False)
    ...     p.update(1)
    >>> p.close()
    >>> print(out.getvalue(), end="")
    step 2/4 (50%), 0.333 step/s, 6 s elapsed, ~6 s left | loss=1.10
    step 3/4 (75%), 0.375 step/s, 8 s elapsed, ~3 s left | loss=0.70
"""

from __future__ import annotations

import sys
import time
from typing import Any, Callable, TextIO

from flashsgd.fmt import number

LINE_EVERY_S = 5.0
"""Seconds between two progress lines when stderr is not a terminal."""


class ProgressLines:
    """tqdm's calls, written as one plain line every ``every_s`` seconds (and one at ``close``).

    Args:
        total: steps of the whole run; initial: steps already done (a resumed run);
        file: where the lines go (default: stderr); every_s: seconds between lines;
        clock: seconds, monotonic (default :func:`time.monotonic`; tests pass their own).
    """

    def __init__(self, total: int, initial: int = 0, file: TextIO | None = None,
                 every_s: float = LINE_EVERY_S, clock: Callable[[], float] = time.monotonic) -> None:
        self.total, self.n, self.initial = total, initial, initial
        self.file, self.every_s, self.clock = file, every_s, clock
        self.postfix: dict[str, Any] = {}
        self.t0 = self.last_t = clock()
        self.last_n = initial

    def update(self, n: int = 1) -> None:
        self.n += n
        now = self.clock()
        if now - self.last_t >= self.every_s:
            self._line(now)

    def set_postfix(self, refresh: bool = True, **values: Any) -> None:
        """Merged into the values shown (an evaluation's accuracy stays until the next one)."""
        self.postfix.update(values)

    def close(self) -> None:
        if self.n != self.last_n:
            self._line(self.clock())

    def _line(self, now: float) -> None:
        elapsed = now - self.t0
        rate = (self.n - self.initial) / elapsed if elapsed > 0 else 0.0
        left = f", ~{(self.total - self.n) / rate:.0f} s left" if rate > 0 and self.n < self.total else ""
        shown = ", ".join(f"{k}={v}" for k, v in self.postfix.items())
        print(f"step {self.n}/{self.total} ({100 * self.n // max(self.total, 1)}%), "
              f"{number(rate)} step/s, {elapsed:.0f} s elapsed{left}" + (f" | {shown}" if shown else ""),
              file=self.file or sys.stderr, flush=True)
        self.last_t, self.last_n = now, self.n


def progress_bar(total: int, initial: int = 0, stream: TextIO | None = None) -> Any:
    """tqdm's bar when ``stream`` (default: stderr) is a terminal, else :class:`ProgressLines`."""
    stream = stream or sys.stderr
    if stream.isatty():
        from tqdm import tqdm

        return tqdm(total=total, initial=initial, unit="step", dynamic_ncols=True, file=stream)
    return ProgressLines(total, initial, file=stream)
