"""`flashsgd bench allreduce`: option parsing, a tiny real run, and the JSON schema others parse."""

import argparse
import json
import re

import pytest

from flashsgd.bench import allreduce
from flashsgd.bench.common import (ALLREDUCE_COLUMNS, bandwidths, bus_factor, check_memory,
                                   format_header, format_row, human_size, parse_size, parse_sizes,
                                   ranks_on_this_host)
from flashsgd.cli import main as cli_main
from ports import free_port

RESULT_KEYS = {"algorithm", "size_bytes", "count", "dtype", "time_us", "time_us_min", "time_us_max",
               "algbw_gbps", "busbw_gbps", "ratio_to_native"}
META_KEYS = {"world", "grid", "ranks_per_node", "backend", "torch", "host", "cpu_count", "python",
             "iters", "warmup", "command", "timestamp"}


def _args(*argv):
    parser = argparse.ArgumentParser()
    allreduce.add_arguments(parser)
    return parser.parse_args(list(argv))


def test_sizes_parse_lists_and_ranges():
    assert parse_size("4K") == 4096 and parse_size("128M") == 128 * 2**20 and parse_size("100") == 100
    assert parse_sizes("4K:64K") == [4096, 8192, 16384, 32768, 65536]
    assert parse_sizes("4K:64K:4,1M,4K") == [4096, 16384, 65536, 2**20]
    assert human_size(16 * 2**20) == "16M" and human_size(1000) == "1000"
    for bad, message in [("4Q", "size '4Q' must be a positive integer"), ("0", "positive integer"),
                         ("64K:4K", "need START <= END"), ("4K:1M:1", "FACTOR >= 2"), (",", "names no size")]:
        with pytest.raises(ValueError, match=message):
            parse_sizes(bad)


def test_bandwidth_convention_matches_nccl_tests():
    assert bus_factor("allreduce", 8) == pytest.approx(2 * 7 / 8)
    assert bus_factor("all_gather", 4) == pytest.approx(3 / 4)
    algbw, busbw = bandwidths(10**9, 2.0, bus_factor("allreduce", 8))
    assert algbw == pytest.approx(0.5) and busbw == pytest.approx(0.875)
    row = {"size_bytes": 4096, "count": 1024, "dtype": "float32", "algorithm": "ring", "time_us": 12.5,
           "algbw_gbps": 0.3, "busbw_gbps": 0.5, "ratio_to_native": None}
    line = format_row(row, ALLREDUCE_COLUMNS)
    assert len(line) == len(format_header(ALLREDUCE_COLUMNS)) and line.rstrip().endswith("-")


@pytest.mark.parametrize("argv, message", [
    (["--workers", "8", "--grid", "3x3"], "grid 3x3 has 9 ranks but the world size is 8; valid grids: "
                                        "1x8, 2x4, 4x2, 8x1"),
    (["--workers", "6", "--ranks-per-node", "4"], "--ranks-per-node 4 must divide the world size 6; "
                                                  "valid: 1, 2, 3, 6"),
    (["--comm", "ring,tree"], "--comm 'ring,tree': unknown tree; known: native, ring"),
    (["--comm", "ring,ring"], "lists a name twice"),
    (["--comm", "topk"], "unknown topk; known: native, ring, hierarchical, torus2d"),
    (["--dtype", "float64"], "--dtype 'float64' is not supported; valid: float32"),
    (["--sizes", "2", "--dtype", "float32"], "2 B is smaller than one float32 element"),
    (["--iters", "0"], "--iters must be >= 1"),
    (["--workers", "0"], "--workers must be an integer >= 1"),
    (["--timeout-s", "0"], "--timeout-s must be a finite number of seconds > 0"),
    (["--workers", "8", "--sizes", "4K,100G"], "--sizes 100G: 8 ranks x 2 buffers of 100 GiB = 1600 GiB, "
                                             "more than the "),
])
def test_bad_options_are_clear_errors(argv, message, capsys):
    with pytest.raises(ValueError, match=re.escape(message)):
        allreduce.config_from_args(_args(*argv))
    assert cli_main(["bench", "allreduce", *argv]) == 2  # one line on stderr, no traceback
    err = capsys.readouterr().err
    assert err.startswith("flashsgd bench: error: ") and message in err and "Traceback" not in err


def _check_json(path, world, grid, algorithms, sizes):
    doc = json.loads(path.read_text())
    assert META_KEYS <= set(doc["meta"])
    assert doc["meta"]["world"] == world and doc["meta"]["grid"] == grid
    assert doc["meta"]["backend"] == "gloo"
    rows = doc["results"]
    assert [(r["size_bytes"], r["algorithm"]) for r in rows] == [(s, a) for s in sizes for a in algorithms]
    for r in rows:
        assert set(r) == RESULT_KEYS  # exactly these keys: the simulator's calibration parses them
        assert r["count"] * 4 == r["size_bytes"] and r["dtype"] == "float32"
        assert 0 < r["time_us_min"] <= r["time_us"] <= r["time_us_max"]
        assert r["algbw_gbps"] == pytest.approx(r["size_bytes"] / r["time_us"] / 1e3)
        assert r["busbw_gbps"] == pytest.approx(r["algbw_gbps"] * 2 * (world - 1) / world)
        if r["algorithm"] == "native":
            assert r["ratio_to_native"] == 1.0
        native = next(n for n in rows if n["algorithm"] == "native" and n["size_bytes"] == r["size_bytes"])
        assert r["ratio_to_native"] == pytest.approx(native["time_us"] / r["time_us"])
    return doc


def test_tiny_run_prints_rows_and_writes_json(tmp_path, capfd):
    path = tmp_path / "out" / "ar.json"
    code = allreduce.run(_args("--workers", "4", "--ranks-per-node", "2", "--grid", "2x2", "--sizes", "4K,12K",
                               "--comm", "torus2d,native,ring,hierarchical", "--iters", "3",
                               "--warmup", "1", "--json", str(path)))
    assert code == 0
    out = capfd.readouterr().out
    assert "algbw" in out and "busbw" in out and "x native" in out
    assert len([line for line in out.splitlines() if "float32" in line and "torus2d" in line]) == 2
    doc = _check_json(path, 4, "2x2", ["native", "torus2d", "ring", "hierarchical"], [4096, 12288])
    assert doc["meta"]["ranks_per_node"] == 2 and doc["meta"]["iters"] == 3


def test_runs_under_an_env_rendezvous(tmp_path, monkeypatch, capfd):
    """The torchrun / emulated-cluster path: RANK, WORLD_SIZE, MASTER_* set, no spawning."""
    port = free_port()
    for key, value in {"RANK": "0", "WORLD_SIZE": "1", "LOCAL_WORLD_SIZE": "1",
                       "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(port)}.items():
        monkeypatch.setenv(key, value)
    path = tmp_path / "env.json"
    assert allreduce.run(_args("--workers", "8", "--sizes", "4K", "--comm", "native,ring",
                               "--iters", "2", "--warmup", "0", "--json", str(path))) == 0
    doc = _check_json(path, 1, "1x1", ["native", "ring"], [4096])  # WORLD_SIZE wins over --workers
    assert doc["meta"]["launcher"] == "torchrun/env"


def test_memory_check_counts_every_rank_on_the_host(monkeypatch):
    check_memory(2**30, 4, 2, 8 * 2**30, "test memory")  # exactly fits
    with pytest.raises(ValueError, match=re.escape(
            "--sizes 1G: 4 ranks x 2 buffers of 1 GiB = 8 GiB, more than the 7 GiB of "
            "test memory; the largest size that fits is about 896 MiB")):
        check_memory(2**30, 4, 2, 7 * 2**30, "test memory")
    for key in ("RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT", "FLASHSGD_EMULATED"):
        monkeypatch.delenv(key, raising=False)
    assert ranks_on_this_host(8) == 8  # spawned locally: all ranks here
    for key, value in {"RANK": "0", "WORLD_SIZE": "8", "LOCAL_WORLD_SIZE": "2",
                       "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": "1"}.items():
        monkeypatch.setenv(key, value)
    assert ranks_on_this_host(8) == 2  # torchrun: this node's ranks
    monkeypatch.setenv("FLASHSGD_EMULATED", "4x2@1000000000bit")
    assert ranks_on_this_host(8) == 8  # emulated nodes are namespaces of this one machine
