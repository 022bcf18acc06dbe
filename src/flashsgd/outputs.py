"""Output paths checked before any work: a bad one is one line naming the flag (exit 2), never a
traceback after a benchmark or a run has spent its time (torch-free); and :func:`write_json`, the
writer of a JSON output file.

A subcommand declares each output flag with :func:`add_output` (a file such as ``--json``, or a
directory such as ``--out``); :func:`flashsgd.cli.main` calls :func:`check_args` right after
parsing, so every declared output is checked by the same rule before the subcommand runs.
``flashsgd train`` checks ``run.out`` (a config key, also settable from TOML) with
:func:`check_output` when it starts.

The rule (:func:`check_output`):

1. The path is not empty, and is not an existing directory (a file output) or an existing
   non-directory (a directory output).
2. The nearest existing ancestor of the folder that will hold it is a directory in which a file can
   be created (probed with a temporary file, removed at once): missing folders below it are created
   by the writer later, as every writer here does.

Example::

    >>> check_output("/proc/x/y.json", "--json")                  # doctest: +SKIP
    ValueError: --json /proc/x/y.json: cannot create files in /proc (No such file or directory)
"""

from __future__ import annotations

import argparse
import json
import os
import tempfile
from pathlib import Path
from typing import Any, Literal

Kind = Literal["file", "dir"]
_DEST = "_flashsgd_outputs"  # namespace attribute: ((dest, flag, kind), ...) of the chosen parser


def add_output(parser: argparse.ArgumentParser, flag: str, kind: Kind = "file",
               **kwargs: Any) -> argparse.Action:
    """``parser.add_argument(flag, **kwargs)``, declared as an output checked by :func:`check_args`."""
    action = parser.add_argument(flag, **kwargs)
    declared = parser.get_default(_DEST) or ()
    parser.set_defaults(**{_DEST: (*declared, (action.dest, flag, kind))})
    return action


def check_args(args: argparse.Namespace) -> None:
    """Step 1-2 for every output the chosen (sub)command declared with :func:`add_output` and was given."""
    for dest, flag, kind in getattr(args, _DEST, ()):
        value = getattr(args, dest, None)
        if value is not None:
            check_output(value, flag, kind)


def check_output(path: str | os.PathLike, flag: str, kind: Kind = "file") -> None:
    """Steps 1-2 for one output; ValueError (one line naming ``flag``) when it cannot be written."""
    text = os.fspath(path)
    what = "a file" if kind == "file" else "a directory"
    if not text.strip():  # Step 1
        raise ValueError(f"{flag} is empty; name {what}")
    full = Path(os.path.abspath(text))
    if kind == "file" and full.is_dir():
        raise ValueError(f"{flag} {text}: is a directory; name a file")
    if kind == "dir" and full.exists() and not full.is_dir():
        raise ValueError(f"{flag} {text}: is a file, not a directory; name a directory")
    if kind == "file" and full.exists() and not os.access(full, os.W_OK):
        raise ValueError(f"{flag} {text}: the file exists and is not writable")
    base = full if kind == "dir" else full.parent  # Step 2
    while not base.exists() and not base.is_symlink():
        base = base.parent
    if not base.is_dir():
        raise ValueError(f"{flag} {text}: {base} is not a directory, so nothing can be written below it")
    try:
        fd, probe = tempfile.mkstemp(prefix=".flashsgd-write-check-", dir=base)
    except OSError as exc:
        raise ValueError(f"{flag} {text}: cannot create files in {base} "
                         f"({exc.strerror or type(exc).__name__})") from None
    os.close(fd)
    os.unlink(probe)


def write_json(path: str | os.PathLike, doc: Any, indent: int = 2) -> None:
    """``doc`` as indented JSON and a final newline, in ``path`` (missing folders created)."""
    Path(path).parent.mkdir(parents=True, exist_ok=True)
    Path(path).write_text(json.dumps(doc, indent=indent) + "\n")
