"""Numbers in messages, formatted once: counts with their noun, values next to a threshold, sizes,
percentages. Every message a user reads takes its numbers from here, so none says "sent only 20.00
times (< 20)" (19.998 rounded up to the threshold it fails), "at most 0.0 times" (0.024),
"nan%" (a share of nothing), "1.05 MB" for a 1 MiB message, or "1 steps".

Torch-free and import-free (the bottom of the import graph, beside :mod:`flashsgd.exchanges`).

Rules:

1. :func:`plural`: ``1 step``, ``0 steps``, ``2 steps``, ``0.024 times`` (a real count as rule 2
   writes it).
2. :func:`number`: ``digits`` significant digits (never an exponent, trailing zeros dropped), and
   more where fewer would round a value onto or across the threshold it is compared with
   (``than``): the printed number is on the same side of ``than`` as the value.
3. :func:`size`: bytes in binary units (KiB, MiB, GiB: 2**10, 2**20, 2**30), the unit of DDP's
   ``bucket_cap_mb`` and of :data:`flashsgd.exchanges.BUCKET_MB`, and of ``bench allreduce
   --sizes 1M`` (nccl-tests' binary K/M/G); :func:`mib` for a table column.
4. :func:`percent`: a fraction as a percentage (rule 2's threshold too); None or NaN (the worst
   error of no rows, a share of zero steps) is written ``missing``; :func:`share` of part / whole
   says ``0 of 0`` instead of dividing by zero.
5. :func:`table`: rows of cells under their headers, each column as wide as its widest cell.

Example::

    >>> number(19.998, than=20), number(0.024), number(2001.4), size(2 ** 20), plural(1, "step")
    ('19.998', '0.024', '2001', '1 MiB', '1 step')
    >>> percent(float("nan"), missing="none"), share(0, 0)
    ('none', 'n/a (0 of 0)')
"""

from __future__ import annotations

import math
from typing import Iterable, Optional, Sequence

_BINARY = (("GiB", 2 ** 30), ("MiB", 2 ** 20), ("KiB", 2 ** 10))
_MAX_DIGITS = 17  # a double has at most 17 significant decimal digits


def plural(n: float, word: str, plural_word: Optional[str] = None, than: Optional[float] = None) -> str:
    """``n`` and ``word``, in the plural (``plural_word``, default ``word + "s"``) unless ``n`` is
    written ``1``; an int as it is, a float as :func:`number` writes it (with ``than``):
    ``plural(1, "step")`` -> ``1 step``, ``plural(0.024, "time")`` -> ``0.024 times``."""
    text = str(n) if isinstance(n, int) else number(n, than=than)
    return f"{text} {word if text == '1' else (plural_word or word + 's')}"


def _fixed(value: float, digits: int) -> str:
    """``value`` to ``digits`` significant digits in fixed notation, trailing zeros dropped."""
    if value == 0 or not math.isfinite(value):
        return "0" if value == 0 else str(value)
    decimals = max(0, digits - 1 - math.floor(math.log10(abs(value))))
    text = f"{value:.{decimals}f}"
    if "." in text:
        text = text.rstrip("0").rstrip(".")
    return "0" if text == "-0" else text


def _side(a: float, b: float) -> int:
    return (a > b) - (a < b)


def number(value: float, than: Optional[float] = None, digits: int = 3) -> str:
    """Rule 2: ``value`` with ``digits`` significant digits, more when needed so that the text
    compares with ``than`` as ``value`` does (19.998 vs 20 -> ``19.998``, not ``20.00``).

    NaN and infinities are written as Python writes them (``nan``, ``inf``).
    """
    value = float(value)
    if not math.isfinite(value):
        return str(value)
    for d in range(max(1, digits), _MAX_DIGITS + 1):
        text = _fixed(value, d)
        if than is None or _side(float(text), than) == _side(value, than):
            return text
    return repr(value)


def size(n_bytes: float, digits: int = 3) -> str:
    """Rule 3: ``n_bytes`` in the largest binary unit it fills: ``512 B``, ``4 KiB``, ``1 MiB``,
    ``32 MiB`` (33.6e6 bytes), ``1.5 GiB``."""
    for unit, scale in _BINARY:
        if abs(n_bytes) >= scale:
            return f"{number(n_bytes / scale, digits=digits)} {unit}"
    return f"{number(n_bytes, digits=digits)} B"


def mib(n_bytes: float) -> float:
    """Bytes in MiB (2**20 bytes), for a table column headed in MiB."""
    return n_bytes / 2 ** 20


def percent(fraction: Optional[float], digits: int = 1, than: Optional[float] = None,
            missing: str = "-") -> str:
    """Rule 4: ``0.25`` -> ``25.0%`` (``digits`` decimals, more when needed to stay on ``value``'s
    side of ``than``, a fraction too); None or NaN -> ``missing``."""
    if fraction is None or (isinstance(fraction, float) and math.isnan(fraction)):
        return missing
    value = 100.0 * fraction
    if not math.isfinite(value):
        return f"{value}%"
    for d in range(digits, _MAX_DIGITS + 1):
        text = f"{value:.{d}f}"
        if than is None or _side(float(text), 100.0 * than) == _side(value, 100.0 * than):
            return text + "%"
    return f"{value!r}%"


def share(part: float, whole: float, digits: int = 1, missing: Optional[str] = None) -> str:
    """``part / whole`` as :func:`percent`; ``whole == 0`` -> ``missing`` (default
    ``n/a (0 of 0)``, with the part and the whole)."""
    if whole == 0:
        return missing if missing is not None else f"n/a ({number(part)} of {number(whole)})"
    return percent(part / whole, digits)


def span(lo: float, hi: float, fmt: str) -> str:
    """A range ``lo-hi`` in ``fmt``; one value when both ends print alike (``span(1.0, 1.04, ".1f")``
    is ``"1.0"``). Bracket it where it follows a value: ``f"[{span(...)}]"``."""
    a, b = format(lo, fmt), format(hi, fmt)
    return a if a == b else f"{a}-{b}"


def table(rows: Iterable[Sequence[object]], columns: Sequence[str], align: str = "<",
          gap: int = 2, missing: str = "-") -> str:
    """Rule 5: ``columns`` (the headers) over ``rows`` (cells: text, or anything ``str`` writes;
    None is ``missing``), each column as wide as its widest cell, ``gap`` spaces apart, no
    trailing spaces. ``align``: ``"<"`` (left) or ``">"`` (right), one for every column or one
    letter per column.

    >>> print(table([["ring", 97.1], ["gtopk density=0.01", None]], ["setting", "acc %"], "<>"))
    setting             acc %
    ring                 97.1
    gtopk density=0.01      -
    """
    lines = [list(columns)] + [[missing if c is None else str(c) for c in row] for row in rows]
    widths = [max(len(line[i]) for line in lines) for i in range(len(columns))]
    sides = align * len(columns) if len(align) == 1 else align
    return "\n".join((" " * gap).join(f"{c:{a}{w}}" for c, a, w in zip(line, sides, widths)).rstrip()
                     for line in lines)
