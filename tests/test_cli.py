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
                                  ["bench", "recipe", "--help"]])
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
