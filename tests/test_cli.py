"""The `flashsgd` entry point: subcommands, help, lazy imports and clear errors."""

import subprocess
import sys

import pytest

from flashsgd.cli import COMMANDS, main
from flashsgd.registry import Registry


@pytest.mark.parametrize("argv", [["--help"], ["train", "--help"], ["bench", "--help"],
                                  ["simulate", "--help"], ["bench", "allreduce", "--help"],
                                  ["bench", "sparse", "--help"], ["bench", "lars", "--help"],
                                  ["bench", "train", "--help"], ["bench", "emulate", "--help"],
                                  ["bench", "recipe", "--help"], ["bench", "scaling", "--help"],
                                  ["plan", "--help"], ["compare", "--help"]])
def test_help_of_every_command(argv, capsys):
    with pytest.raises(SystemExit) as exit_info:
        main(argv)
    assert exit_info.value.code == 0
    assert "usage: flashsgd" in capsys.readouterr().out


def test_unknown_command_names_the_valid_ones(capsys):
    with pytest.raises(SystemExit) as exit_info:
        main(["trian"])
    assert exit_info.value.code == 2
    err = capsys.readouterr().err
    assert "invalid choice: 'trian'" in err and all(name in err for name in COMMANDS)


def test_simulate_does_not_import_torch():
    code = ("import sys; from flashsgd.cli import main; "
            "main(['simulate', '--cluster', '1gbe', '--gpus', '8', '--model', 'resnet50', "
            "'--comm', 'gtopk']); assert 'torch' not in sys.modules, 'torch was imported'")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    assert out.returncode == 0, out.stderr


def test_registry_refuses_duplicates_and_lists_known_names():
    reg = Registry("widget")
    reg.add("a", 1)
    with pytest.raises(ValueError, match="widget 'a' is already registered"):
        reg.add("a", 2)
    with pytest.raises(ValueError, match="unknown widget 'b'; known: a"):
        reg.get("b")


def test_bad_value_is_a_one_line_error_not_a_traceback(capsys):
    assert main(["bench", "lars", "--reps", "0"]) == 2
    err = capsys.readouterr().err
    assert err.startswith("flashsgd bench: error:") and "reps" in err and "Traceback" not in err


# ---- one spelling per concept (issue 21) ------------------------------------------------------

RETIRED = ("--world", "--algorithm", "--algorithms", "--hooks", "--timeout", "--rpn", "--lpn", "--local-ranks")
COMMAND_PATHS = {"train", "bench allreduce", "bench sparse", "bench train", "bench scaling", "bench emulate",
                 "bench lars", "bench recipe", "simulate", "plan", "compare", "emulate.probe"}
OVERRIDES = {  # (command, flag): why its default is not the catalog's
    ("train", "--timeout-s"): "the run's collective deadline (300 s), not the hooks' 'the process group's'",
    ("train", "--nesterov"): "the optimizer's Nesterov (the recipe's), which the sparse hooks follow",
    ("train", "--density-warmup"): "a run warms up by default (DGC's 0.25, its length known); a hook does not",
    ("train", "--density-warmup-steps"): "unset: the length from --density-warmup-epochs (or its default "
                                         "rule); a hook's 0 is no warm-up",
    ("bench allreduce", "--timeout-s"): "the launch's deadline (1800 s)",
    ("bench sparse", "--timeout-s"): "the launch's deadline (1800 s)",
    ("bench emulate", "--timeout-s"): "the deadline per launch on the emulated cluster (900 s)",
    ("bench scaling", "--timeout-s"): "the collective timeout of one scaling row (120 s)",
    ("bench scaling", "--ranks-per-node"): "the emulated cluster's shape N x R (1), not 'detected'",
    ("bench sparse", "--selection"): "threshold: the selection the bench measures (and --fuse compiles)",
    ("plan", "--selection"): "unset: the cluster keeps its device class's own (auto there); a value re-prices it",
    ("bench sparse", "--bucket-mb"): "8 MiB: 4-5 buckets of the --hook MLP",
}


def _parsers():
    """(command path, parser) of every leaf subcommand, and the emulated cluster's probe."""
    import argparse

    from flashsgd.cli import build_parser
    from flashsgd.emulate.probe import build_parser as probe_parser

    def walk(parser, path):
        subs = [a for a in parser._actions if isinstance(a, argparse._SubParsersAction)]
        if not subs:
            yield " ".join(path), parser
        for name, sub in (subs[0].choices.items() if subs else ()):
            yield from walk(sub, path + [name])

    return [*walk(build_parser(), []), ("emulate.probe", probe_parser())]


def _shown_default(action):
    """The default a flag shows: its value, or the '(default: X)' of its help where the parser
    suppresses it (`train` reads defaults from its config)."""
    import argparse
    import ast
    import re

    if action.default is not argparse.SUPPRESS:
        return action.default
    m = re.search(r"\(default: ([^)]*)\)", " ".join((action.help or "").split()))
    if m is None:
        return argparse.SUPPRESS
    try:
        return ast.literal_eval(m.group(1))
    except (ValueError, SyntaxError):
        return m.group(1)


def test_one_spelling_per_concept_and_the_catalogs_defaults():
    import dataclasses
    import re

    from flashsgd.exchanges import BUCKET_MB, EXCHANGES, option_default

    catalog = {"bucket_mb": BUCKET_MB}
    for name in {f.name for e in EXCHANGES.values() for f in dataclasses.fields(e.options)}:
        try:
            catalog[name] = option_default(name)
        except KeyError:  # no single default (threaded: dense True, sparse False): no flag can show one
            pass
    parsers = _parsers()
    assert COMMAND_PATHS <= {path for path, _ in parsers}
    retired = re.compile(r"(?<![\w-])(" + "|".join(map(re.escape, RETIRED)) + r")(?![\w-])")
    used, problems = set(), []
    for path, parser in parsers:
        flags = [s for a in parser._actions for s in a.option_strings]
        problems += [f"{path}: retired flag {f}" for f in flags if f in RETIRED]
        problems += [f"{path} --help: mentions {m}" for m in sorted(set(retired.findall(parser.format_help())))]
        for action in parser._actions:
            flag = next((s for s in action.option_strings if s.startswith("--")), None)
            if flag is None or action.dest not in catalog or action.dest == "help":
                continue
            if (path, flag) in OVERRIDES:
                used.add((path, flag))
                continue
            shown = _shown_default(action)
            if shown != catalog[action.dest]:
                problems.append(f"{path} {flag}: default {shown!r}, the catalog's is {catalog[action.dest]!r}")
    assert not problems, "\n".join(problems)
    assert used == set(OVERRIDES), f"overrides listed for no flag: {set(OVERRIDES) - used}"


@pytest.mark.parametrize("argv", [["train", "--timeout", "5"], ["train", "--lr", "0.1"],
                                  ["bench", "scaling", "--timeout", "5"],
                                  ["simulate", "--algorithm", "ring"], ["bench", "allreduce", "--world", "2"]])
def test_retired_spellings_are_refused_not_abbreviated(argv, capsys):
    with pytest.raises(SystemExit) as exit_info:
        main(argv)
    assert exit_info.value.code == 2 and "unrecognized arguments" in capsys.readouterr().err


def test_bench_train_refuses_a_bad_model_before_any_worker_starts(capfd):
    """Issue 33 item 4: a 16-line traceback after spawning the workers, before."""
    from flashsgd.cli import main

    assert main(["bench", "train", "--model", "nope", "--workers", "2", "--comm", "native"]) == 2
    err = capfd.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "unknown model 'nope'; valid choices:" in err[0], err
