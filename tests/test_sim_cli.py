"""`flashsgd simulate`: where the sweep's plot goes, and a command line that never imports torch."""

import argparse
import json
import os
import subprocess
import sys

from flashsgd.sim import cli

SWEEP = ("--cluster", "abci", "--sweep-gpus", "8,64", "--algorithm", "ring")


def run_cli(*argv):
    p = argparse.ArgumentParser()
    cli.add_arguments(p)
    return cli.run(p.parse_args(list(argv)))


def test_plot_goes_next_to_json_or_into_out_never_the_working_directory(tmp_path, monkeypatch, capsys):
    cwd = tmp_path / "cwd"
    cwd.mkdir()
    monkeypatch.chdir(cwd)
    assert run_cli(*SWEEP) == 0
    assert "no plot written: add --plot PATH, --out DIR or --json PATH" in capsys.readouterr().out
    js = tmp_path / "runs" / "eff.json"
    assert run_cli(*SWEEP, "--json", str(js)) == 0
    out = capsys.readouterr().out
    assert js.with_suffix(".png").stat().st_size > 10_000 and json.loads(js.read_text())["results"]
    assert f"wrote {js.with_suffix('.png')}" in out and f"wrote {js}" in out
    assert run_cli(*SWEEP, "--out", str(tmp_path / "figs")) == 0
    assert f"wrote {tmp_path / 'figs' / 'sim_sweep.png'}" in capsys.readouterr().out
    assert (tmp_path / "figs" / "sim_sweep.png").exists()
    assert os.listdir(cwd) == []  # nothing written where the command ran


def test_simulate_with_grid_and_calibration_never_imports_torch(tmp_path):
    bench = {"meta": {"world": 8, "grid": "2x4", "ranks_per_node": 8},
             "results": [{"algorithm": a, "size_bytes": s, "time_us": 10 + s / 1e3}
                         for a in ("ring", "torus2d") for s in (4096, 65536, 2**20, 2**24)]}
    path = tmp_path / "ar.json"
    path.write_text(json.dumps(bench))
    code = ("import sys; from flashsgd.cli import main\n"
            "assert main(['simulate', '--gpus', '1024', '--algorithm', 'torus2d', '--grid', '32x32']) == 0\n"
            f"assert main(['simulate', '--calibration', {str(path)!r}, '--gpus', '8', '--grid', '2x4',"
            " '--algorithm', 'torus2d', '--images-per-s', '100']) == 0\n"
            "assert 'torch' not in sys.modules, 'torch was imported'")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
