"""The README as a script: every shell command in its ```bash blocks runs as written.

Which blocks run (an HTML comment on the line before a block, invisible on GitHub):

- no marker: every command of the block runs, in README order, in one fresh temporary directory
  (:func:`test_readme_runs_as_written`, marked slow: about 5 min on 2 cores); later commands read
  what earlier ones wrote under ``runs/``, as a reader following the README would;
- ``<!-- readme-test: root (REASON) -->``: the same, in a fresh directory of its own, as root
  (the emulated cluster: network namespaces and tc; about 3 min); skipped with the reason where
  the test is neither root nor allowed ``sudo -n``;
- ``<!-- readme-test: skip (REASON) -->``: never run here (GPUs, a cluster, the test suite itself).

Every command of every block, skipped ones included, is also checked without running it (fast,
default run): it is one the test knows (``flashsgd ...``, ``.venv/bin/flashsgd ...``, ``sudo
.venv/bin/flashsgd ...``, ``bash scripts/...``, ``.venv/bin/python ...``, ``python examples/...``,
``torchrun ...``), every ``flashsgd`` command line (also after ``torchrun ... -m flashsgd`` and
after ``bench emulate ... --``) is accepted by the CLI's own parser and ``train``'s flags resolve to
a valid config, every script and example it names exists, and every command that runs states how
long it takes ("about N s" / "about N min", on the command's line or its continuation). The
:data:`QUICK` commands also run in the default test run.

How a command runs (no shell; ``a && b`` is two commands, the second only after the first worked):

1. in the fresh directory, with ``.venv`` and ``examples`` linked there from the checkout and the
   checkout's ``.venv/bin`` first on PATH (as after ``source .venv/bin/activate``); MNIST-1D's
   cache (``~/.cache/flashsgd``) is the user's, as for a reader;
2. ``bash scripts/...`` runs in the checkout: the set-up script installs this checkout into its
   ``.venv`` (it changes to its own checkout first; a copy elsewhere would reinstall the venv);
3. ``sudo`` is dropped when the test already runs as root;
4. the flags of :data:`EXTRA_FLAGS` are appended to the commands they name - the one place where
   the test runs a README command at a smaller size than written, each entry with its reason;
5. it must exit 0 within ``max(300 s, 10 x`` the time the README states).

Example::

    .venv/bin/python -m pytest -q tests/test_readme.py              # the checks, QUICK commands
    .venv/bin/python -m pytest -q -m slow tests/test_readme.py      # every runnable command
"""

from __future__ import annotations

import argparse
import contextlib
import io
import os
import re
import shlex
import shutil
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
README = ROOT / "README.md"

EXTRA_FLAGS: dict[str, tuple[list[str], str]] = {
    "flashsgd bench scaling": (
        ["--nodes", "2,8", "--comm", "noop,native,ring,topk,gtopk", "--warmup", "2", "--iters", "3",
         "--batch", "16"],
        "the full sweep (1-8 nodes, every hook) takes about 9 min; this keeps the 2x1 and 8x1 rows "
        "that the README's next command calibrates on (>= 7 rows of modelled hooks): about 1.5 min"),
    "flashsgd bench emulate": (
        ["--iters", "3", "--warmup", "1"],
        "appended after `--`, so the emulated cluster's allreduce takes 3 timed calls per size "
        "instead of 10 (its 100 MiB messages on 1 Gbit/s links are what take the README's 3 min)"),
}
"""README command prefix (after ``sudo`` and ``.venv/bin/``) -> (flags the test appends, why)."""

QUICK = ("flashsgd simulate --cluster abci", "flashsgd plan --cluster 1gbe")
"""Commands that also run in the default (fast) test run: torch-free, under a second each, and
reading nothing an earlier command wrote."""

MARKER = re.compile(r"<!-- readme-test: (?P<kind>skip|root) \((?P<reason>[^)]+)\) -->")
KNOWN = re.compile(r"^(sudo \.venv/bin/flashsgd |\.venv/bin/flashsgd |flashsgd |bash scripts/\S+ |"
                   r"\.venv/bin/python |python examples/\S+ |torchrun )")
STATED = re.compile(r"about (\d+(?:\.\d+)?) (s|min)\b")


@dataclass
class Command:
    """One logical command line of a README block (continuation lines joined)."""

    text: str          # as written, without its comment
    comment: str       # the comment on its lines (times, notes)
    line: int          # README line number where it starts
    kind: str          # "run", "root" or "skip" (the block's marker)
    reason: str = ""

    def parts(self) -> list[list[str]]:
        """argv of each command of ``a && b``."""
        words, parts = shlex.split(self.text), [[]]
        for w in words:
            if w == "&&":
                parts.append([])
            else:
                parts[-1].append(w)
        return parts

    def stated_s(self) -> float | None:
        m = STATED.search(self.comment)
        return None if m is None else float(m.group(1)) * (60 if m.group(2) == "min" else 1)


def readme_commands(text: str) -> list[Command]:
    """Every command of every ```bash block of ``text``, with its block's marker."""
    lines, commands, i = text.splitlines(), [], 0
    while i < len(lines):
        if lines[i].strip() != "```bash":
            i += 1
            continue
        marker = MARKER.fullmatch(lines[i - 1].strip()) if i > 0 else None
        kind, reason = (marker["kind"], marker["reason"]) if marker else ("run", "")
        i += 1
        pending: Command | None = None
        while lines[i].strip() != "```":
            raw = lines[i]
            code, _, comment = _split_comment(raw)
            if pending is not None:  # a continuation line, or a comment continuing the command's
                pending.text += " " + code.strip()
                pending.comment += " " + comment
                if not code.rstrip().endswith("\\"):
                    pending.text = pending.text.replace("\\ ", " ").strip()
                    commands.append(pending)
                    pending = None
            elif code.strip():
                cmd = Command(code.strip(), comment, i + 1, kind, reason)
                if code.rstrip().endswith("\\"):
                    pending = cmd
                else:
                    commands.append(cmd)
            elif comment and commands and commands[-1].line >= _block_start(lines, i) and raw[:1] == " ":
                commands[-1].comment += " " + comment  # an indented comment line: the command's note
            i += 1
        i += 1
    return commands


def _block_start(lines: list[str], i: int) -> int:
    while lines[i].strip() != "```bash":
        i -= 1
    return i + 1


def _split_comment(line: str) -> tuple[str, str, str]:
    """``code``, ``#``, ``comment`` of a shell line (a ``#`` that starts a word, outside quotes)."""
    quote = None
    for j, ch in enumerate(line):
        if quote:
            quote = None if ch == quote else quote
        elif ch in "'\"":
            quote = ch
        elif ch == "#" and (j == 0 or line[j - 1].isspace()):
            return line[:j], "#", line[j + 1:].strip()
    return line, "", ""


def normalized(argv: list[str]) -> list[str]:
    """argv without ``sudo`` and with ``.venv/bin/X`` as ``X`` (for EXTRA_FLAGS and QUICK)."""
    argv = argv[1:] if argv[:1] == ["sudo"] else argv
    return [argv[0].removeprefix(".venv/bin/"), *argv[1:]] if argv else argv


def _matches(argv: list[str], prefix: str) -> bool:
    return " ".join(normalized(argv)).startswith(prefix)


def flashsgd_argvs(argv: list[str]) -> list[list[str]]:
    """The ``flashsgd`` command lines inside one argv: itself, after ``torchrun ... -m flashsgd``,
    and a ``bench emulate`` command's inner benchmark."""
    argv = normalized(argv)
    if argv[:1] == ["torchrun"] and "-m" in argv and argv[argv.index("-m") + 1] == "flashsgd":
        argv = ["flashsgd", *argv[argv.index("-m") + 2:]]
    if argv[:1] != ["flashsgd"]:
        return []
    found = [argv[1:]]
    if argv[1:3] == ["bench", "emulate"] and "--" in argv:
        found.append(["bench", *argv[argv.index("--") + 1:]])
    return found


def check_flags(args: list[str]) -> str | None:
    """None if the CLI accepts ``flashsgd ARGS`` (and ``train``'s values make a valid config),
    else the error it prints. ``--config FILE`` is not read: the file may come from an earlier
    command."""
    from flashsgd.cli import COMMANDS, build_parser

    command = next((a for a in args if not a.startswith("-")), None)
    err = io.StringIO()
    try:
        with contextlib.redirect_stderr(err):
            parsed = build_parser((command,) if command in COMMANDS else ()).parse_args(args)
    except SystemExit:
        return err.getvalue().strip().splitlines()[-1]
    if command == "train":
        from flashsgd.train import cli as train_cli

        try:
            train_cli.parse_config(argparse.Namespace(**{**vars(parsed), "config": None}))
        except ValueError as exc:
            return f"flashsgd train: error: {exc}"
    return None


def problems(commands: list[Command]) -> list[str]:
    """What makes the README not a script: unknown commands, bad flags, missing files or times."""
    found = []
    for c in commands:
        where = f"README.md:{c.line}: {c.text}"
        for argv in c.parts():
            if not argv or not KNOWN.match(" ".join(argv) + " "):
                found.append(f"{where}: not a command the README test knows how to run "
                             f"(known: {KNOWN.pattern}); mark its block skip with a reason if it cannot run")
                continue
            if argv[0] == "sudo" and c.kind != "root":
                found.append(f"{where}: sudo outside a block marked <!-- readme-test: root (REASON) -->")
            for arg in argv:
                if arg.startswith(("scripts/", "examples/")) and not (ROOT / arg).exists():
                    found.append(f"{where}: {arg} does not exist")
            for args in flashsgd_argvs(argv):
                error = check_flags(args)
                if error:
                    found.append(f"{where}: {error}")
        if c.kind != "skip" and c.stated_s() is None:
            found.append(f"{where}: says nothing of how long it takes (a comment with 'about N s' "
                         "or 'about N min' on a 2-core laptop)")
    return found


def run_commands(commands: list[Command], workdir: Path, log: list[str]) -> None:
    """Steps 1-5 of the module docstring, in order; the first failure fails with its output."""
    workdir.mkdir(parents=True, exist_ok=True)
    for name in (".venv", "examples"):
        if (ROOT / name).exists() and not (workdir / name).exists():
            (workdir / name).symlink_to(ROOT / name)
    bin_dir = ROOT / ".venv" / "bin" if (ROOT / ".venv" / "bin").is_dir() else Path(sys.executable).parent
    env = {**os.environ, "PATH": f"{bin_dir}{os.pathsep}{os.environ.get('PATH', '')}",
           "PYTHONUNBUFFERED": "1"}
    for c in commands:
        for argv in c.parts():
            if argv[0] == "sudo" and os.geteuid() == 0:
                argv = argv[1:]                                                    # Step 3
            for prefix, (flags, _why) in EXTRA_FLAGS.items():
                if _matches(argv, prefix):
                    argv = [*argv, *flags]                                         # Step 4
            cwd = ROOT if argv[0] == "bash" and argv[1:2] and argv[1].startswith("scripts/") else workdir  # Step 2
            limit = max(300.0, 10 * (c.stated_s() or 30.0))                       # Step 5
            t0 = time.monotonic()
            try:
                out = subprocess.run(argv, cwd=cwd, env=env, capture_output=True, text=True, timeout=limit)
            except subprocess.TimeoutExpired as exc:
                pytest.fail(f"README.md:{c.line}: {shlex.join(argv)} did not finish in {limit:.0f} s "
                            f"(README says about {c.stated_s()} s)\n{(exc.stdout or '')[-3000:]}")
            took = time.monotonic() - t0
            log.append(f"{took:7.1f} s  (README: {c.stated_s()} s)  {shlex.join(argv)}")
            if out.returncode != 0:
                pytest.fail(f"README.md:{c.line}: `{shlex.join(argv)}` exited {out.returncode} in "
                            f"{cwd}\n--- stdout\n{out.stdout[-3000:]}\n--- stderr\n{out.stderr[-3000:]}")


def _commands() -> list[Command]:
    return readme_commands(README.read_text())


def _can_be_root() -> str | None:
    """None if root blocks can run here, else why not."""
    if os.geteuid() != 0 and (shutil.which("sudo") is None
                              or subprocess.run(["sudo", "-n", "true"], capture_output=True).returncode != 0):
        return "not root and no password-less sudo"
    missing = [tool for tool in ("ip", "tc") if shutil.which(tool) is None]
    return f"{', '.join(missing)} missing (scripts/install_iproute2.sh)" if missing else None


# ------------------------------------------------------------------------------ fast checks ----
def test_readme_commands_are_known_parse_and_state_their_time():
    commands = _commands()
    assert len(commands) >= 15, [c.text for c in commands]
    found = problems(commands)
    assert not found, "\n".join(found)


def test_markers_are_well_formed_and_precede_a_block():
    lines = README.read_text().splitlines()
    for i, line in enumerate(lines):
        if "readme-test" in line:
            assert MARKER.fullmatch(line.strip()), f"README.md:{i + 1}: {line!r} (valid: {MARKER.pattern})"
            assert lines[i + 1].strip() == "```bash", f"README.md:{i + 1}: a marker must be right before ```bash"


def test_extra_flags_and_quick_name_readme_commands():
    argvs = [argv for c in _commands() for argv in c.parts()]
    for prefix in [*EXTRA_FLAGS, *QUICK]:
        assert any(_matches(argv, prefix) for argv in argvs), f"{prefix!r} is in no README command"
    for c in _commands():
        if any(_matches(argv, q) for q in QUICK for argv in c.parts()):
            assert c.kind == "run" and c.stated_s() <= 5, c
            assert "runs/" not in c.text, f"a QUICK command reads nothing earlier commands wrote: {c.text}"


def test_quick_commands_run(tmp_path):
    quick = [c for c in _commands() if any(_matches(a, q) for q in QUICK for a in c.parts())]
    assert len(quick) == len(QUICK)
    log: list[str] = []
    run_commands(quick, tmp_path, log)
    print("\n".join(log))


def test_the_checks_catch_a_broken_readme():
    """A misspelt flag, a bad value, a missing example, an unmarked sudo, a command with no time."""
    broken = """
```bash
flashsgd train --densty 0.01 --out runs/a      # about 20 s
flashsgd train --comm gtopkk --out runs/b      # about 20 s
flashsgd plan --cluster 1gbe --gpus 32 \\
              --model resnet50 --stepz 5       # about 1 s
torchrun --standalone --nproc-per-node 2 examples/nothing.py   # about 5 s
sudo .venv/bin/flashsgd bench lars             # about 15 s
flashsgd bench lars
make everything                                # about 1 s
```
"""
    found = problems(readme_commands(broken))
    expected = ["unrecognized arguments: --densty", "comm.algorithm", "unrecognized arguments: --stepz",
                "examples/nothing.py does not exist", "sudo outside a block", "says nothing of how long",
                "not a command the README test knows"]
    for text in expected:
        assert any(text in p for p in found), (text, found)
    assert len(found) == len(expected), found


def test_a_failing_command_fails_the_run(tmp_path):
    c = readme_commands("```bash\nflashsgd plan --cluster nowhere --gpus 8   # about 1 s\n```\n")
    with pytest.raises(pytest.fail.Exception, match=r"exited 2"):
        run_commands(c, tmp_path, [])


# ------------------------------------------------------------------------------ the script ----
@pytest.mark.slow
@pytest.mark.timeout(3600)
def test_readme_runs_as_written(tmp_path):
    """Every unmarked block, in README order, in one fresh directory (about 5 min on 2 cores)."""
    log: list[str] = []
    try:
        run_commands([c for c in _commands() if c.kind == "run"], tmp_path, log)
    finally:
        print("\n".join(log))


@pytest.mark.slow
@pytest.mark.timeout(3600)
def test_readme_root_blocks_run_as_written(tmp_path):
    """The emulated-cluster blocks, in order, in a fresh directory of their own (about 3 min)."""
    why_not = _can_be_root()
    if why_not:
        pytest.skip(f"root blocks: {why_not}")
    log: list[str] = []
    try:
        run_commands([c for c in _commands() if c.kind == "root"], tmp_path, log)
    finally:
        print("\n".join(log))
