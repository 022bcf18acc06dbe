"""`local` calibration from a bench JSON file, and the `flashsgd simulate` command.

The bench file used here is a SYNTHETIC FIXTURE generated in the test from known parameters plus
deterministic +-3% noise; it is not a measurement. Real validation lives in docs/simulator.md.
"""

import argparse
import json
import math

import numpy as np
import pytest

from flashsgd.sim import cli
from flashsgd.sim.calibrate import calibrate, design_row, fit, load_bench, validate
from flashsgd.sim.algorithms import exchange_cost
from flashsgd.sim.costs import CommSetup
from flashsgd.sim.network import ClusterModel, Link

ALPHA, BW_GBPS, GAMMA = 50e-6, 1.0, 0.0


def write_fixture(path, noise=0.03, algorithms=("native", "ring", "hierarchical", "torus2d")):
    link = Link(ALPHA, BW_GBPS)
    truth = ClusterModel("truth", 8, link, link, gamma_s_per_byte=GAMMA)
    results, i = [], 0
    for algo in algorithms + ("noop",):
        for size in [4096 * 4 ** j for j in range(8)]:  # 4 KiB .. 64 MiB
            i += 1
            grid = (2, 4) if algo == "torus2d" else None
            t = 1e-6 if algo == "noop" else float(
                exchange_cost(algo, size, CommSetup(8, truth, grid=grid)).total)
            results.append({"algorithm": algo, "size_bytes": size, "count": size // 4, "dtype": "float32",
                            "time_us": t * 1e6 * (1 + noise * math.sin(i))})
    meta = {"world": 8, "grid": [2, 4], "ranks_per_node": 8, "backend": "gloo", "host": "fixture"}
    path.write_text(json.dumps({"meta": meta, "results": results}))
    return path


def test_joint_fit_recovers_known_parameters(tmp_path):
    f = calibrate(write_fixture(tmp_path / "ar.json"))
    alpha, beta, _ = f.params["*"]
    assert alpha == pytest.approx(ALPHA, rel=0.1)
    assert 1 / beta / 1e9 == pytest.approx(BW_GBPS, rel=0.05)
    assert f.rms_rel_error < 0.04 and f.max_rel_error < 0.08
    assert f.cluster.name == "local" and f.cluster.ranks_per_node == 8


def test_noise_free_fit_is_exact_and_noop_is_skipped(tmp_path):
    bench = load_bench(write_fixture(tmp_path / "ar.json", noise=0.0))
    assert bench.skipped == ["noop"]
    for mode in ("joint", "per-algorithm"):
        assert fit(bench, mode).max_rel_error < 1e-6


def test_grid_may_be_a_string_as_the_bench_writes_it(tmp_path):
    p = write_fixture(tmp_path / "ar.json")
    doc = json.loads(p.read_text())
    doc["meta"]["grid"] = "2x4"
    p.write_text(json.dumps(doc))
    assert load_bench(p).grid == (2, 4)


def test_design_row_reproduces_the_cost_function(tmp_path):
    bench = load_bench(write_fixture(tmp_path / "ar.json"))
    row = design_row("ring", 1e6, bench)
    # 2(P-1) steps, 2(P-1)/P n bytes, (P-1)/P n reduced, P = 8
    np.testing.assert_allclose(row, [14, 1.75e6, 0.875e6], rtol=1e-9)


def test_validation_predicts_held_out_sizes(tmp_path):
    bench = load_bench(write_fixture(tmp_path / "ar.json"))
    v = validate(bench, "per-algorithm")
    held = {r["size_bytes"] for r in v.rows}
    assert held and not held & set(v.fit_sizes)
    assert v.max_error() < 0.1


@pytest.mark.parametrize("doc,match", [
    ({"results": []}, "'meta', 'results'"),
    ({"meta": {"world": 1}, "results": []}, "meta.world"),
    ({"meta": {"world": 8}, "results": [{"algorithm": "ring"}]}, r"results\[0\] needs"),
    ({"meta": {"world": 8}, "results": [{"algorithm": "noop", "size_bytes": 4, "time_us": 1}]},
     "no results for modelled algorithms"),
    ({"meta": {"world": 8, "grid": "3x3"}, "results": []}, "grid 3x3 has 9 ranks but the world size is 8"),
    ({"meta": {"world": 8, "grid": [2, 2, 2]}, "results": []}, r"meta.grid must be .*\[2, 2, 2\]"),
    ({"meta": {"world": 8, "grid": "big"}, "results": []}, "meta.grid must be"),
])
def test_malformed_bench_files_are_rejected(tmp_path, doc, match):
    p = tmp_path / "bad.json"
    p.write_text(json.dumps(doc))
    with pytest.raises(ValueError, match=match):
        load_bench(p)
    with pytest.raises(ValueError, match="does not exist"):
        load_bench(tmp_path / "missing.json")


def run_cli(*argv):
    p = argparse.ArgumentParser()
    cli.add_arguments(p)
    return cli.run(p.parse_args(list(argv)))


def test_cli_breakdown_sweep_json_and_plot(tmp_path, capsys):
    assert run_cli("--cluster", "abci", "--gpus", "1024", "--comm", "torus2d", "--grid", "4x256",
                   "--precision", "fp16") == 0
    out = capsys.readouterr().out
    assert "exposed comm" in out and "efficiency" in out
    js, png = tmp_path / "s.json", tmp_path / "s.png"
    assert run_cli("--sweep-gpus", "8,64,512", "--comm", "ring,gtopk,torus2d",
                   "--json", str(js), "--plot", str(png)) == 0
    doc = json.loads(js.read_text())
    pairs = [(r["algorithm"], r["gpus"]) for r in doc["results"]]
    assert pairs[:3] == [("ring", 8), ("ring", 64), ("ring", 512)]
    assert len(doc["results"]) == 9 and png.stat().st_size > 10_000


def test_cli_local_calibration_and_validation(tmp_path, capsys):
    ar = write_fixture(tmp_path / "ar.json")
    assert run_cli("--calibration", str(ar), "--validate", "--fit", "per-algorithm") == 0
    assert "max |error| for messages >= 1 MiB" in capsys.readouterr().out
    assert run_cli("--cluster", "local", "--calibration", str(ar), "--gpus", "8", "--comm", "ring",
                   "--images-per-s", "100") == 0
    assert "cluster local" in capsys.readouterr().out


def test_cli_predicts_a_second_run_from_the_first(tmp_path, capsys):
    a = write_fixture(tmp_path / "a.json", noise=0.0)
    b = write_fixture(tmp_path / "b.json", noise=0.03)
    js = tmp_path / "p.json"
    assert run_cli("--calibration", str(a), "--predict", str(b), "--json", str(js)) == 0
    rows = json.loads(js.read_text())["prediction"]["rows"]
    assert len(rows) == 32  # 4 algorithms x 8 sizes, the no-op skipped
    # noise-free truth predicts the noisy run within its +-3% noise
    assert max(abs(r["rel_error"]) for r in rows) < 0.031
    assert "max |error| for messages >= 1 MiB" in capsys.readouterr().out
    doc = json.loads(b.read_text())
    doc["meta"]["ranks_per_node"] = 4
    b.write_text(json.dumps(doc))
    with pytest.raises(ValueError, match="ranks_per_node/grid"):
        run_cli("--calibration", str(a), "--predict", str(b))
    with pytest.raises(ValueError, match="--predict needs --calibration"):
        run_cli("--predict", str(b))


def test_cli_bad_inputs(tmp_path):
    with pytest.raises(ValueError, match="unknown simulated exchange 'rign'"):
        run_cli("--comm", "rign")
    with pytest.raises(ValueError, match="unknown cluster preset"):
        run_cli("--cluster", "nope")
    with pytest.raises(ValueError, match="grid 4x100 has 400 ranks but the world size is 1024; valid grids"):
        run_cli("--gpus", "1024", "--comm", "torus2d", "--grid", "4x100")
    with pytest.raises(ValueError, match="grid must look like 'XxY'"):
        run_cli("--gpus", "8", "--grid", "banana")
    with pytest.raises(ValueError, match="--grid '4x4' fits none of --sweep-gpus 8,64"):
        run_cli("--sweep-gpus", "8,64", "--grid", "4x4")
    with pytest.raises(ValueError, match="--samples-per-s is required"):
        run_cli("--model", "vgg16")


def test_cli_calibration_conflicts_with_a_preset(tmp_path):
    ar = write_fixture(tmp_path / "ar.json")
    with pytest.raises(ValueError, match="builds the 'local' cluster, not 'abci'"):
        run_cli("--cluster", "abci", "--calibration", str(ar))
    with pytest.raises(ValueError, match="--validate needs --calibration"):
        run_cli("--validate")
