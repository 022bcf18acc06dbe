"""benchmarks/validate_published.py on docs/data/published_scaling.toml: every row has a source, a
cluster that loads and a prediction with a range (not that the published numbers are met: that is
the table in docs/simulator.md, "Validation against published figures")."""

from __future__ import annotations

import importlib.util
import json
import math
from pathlib import Path

from flashsgd.sim.cluster_file import load_cluster

ROOT = Path(__file__).resolve().parents[1]


def _script():
    spec = importlib.util.spec_from_file_location("validate_published", ROOT / "benchmarks" / "validate_published.py")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def test_every_row_has_a_source_a_cluster_and_a_ranged_prediction(tmp_path, capsys):
    mod = _script()
    rows = mod.load_rows()
    assert len(rows) >= 15 + 4  # >= 15 new measurements, and the earlier table's rows
    assert sum(r.get("new", True) for r in rows) >= 15
    assert len({r["id"] for r in rows}) == len(rows)
    for r in rows:
        assert r["source"].strip() and r["published_text"].strip(), r["id"]
        load_cluster(mod._cluster_spec(r["cluster"]))  # raises if the file or preset does not load
    report = mod.main(["--json", str(tmp_path / "published.json")])
    out = capsys.readouterr().out
    table = [line for line in out.splitlines() if line.startswith("| ")]
    assert len(table) == len(rows) + 1  # the header, then a line per row
    assert "optimistic on" in out and "inside the printed range" in out and "4 -> 32 nodes" in out
    assert json.loads((tmp_path / "published.json").read_text())["summary"] == json.loads(
        json.dumps(report["summary"]))
    for res in report["rows"]:
        lo, hi = res["range"]
        assert math.isfinite(res["predicted"]) and res["predicted"] > 0, res["id"]
        assert lo <= res["predicted"] <= hi, res["id"]
        assert res["assumed"], res["id"]  # every cluster has assumed inputs, so a range is printed
        assert isinstance(res["inside"], bool) and isinstance(res["optimistic"], bool)
    s = report["summary"]
    assert s["all"]["rows"] == len(rows)
    assert "gtopk_dense_drop" in s


def test_measurement_spread_widens_the_published_value_not_the_target():
    mod = _script()
    row = {"published": 1.01, "kind": "efficiency_relative"}
    pred = {"predicted": 0.994, "range": (0.987, 0.9994)}
    strict = mod.judge(row, pred)
    assert not strict["inside"] and not strict["within_spread"]  # no spread stated: the same
    wide = mod.judge({**row, "measurement_spread": 0.0083}, pred)  # 1.01 x (1 - 0.0083) = 1.0016
    assert not wide["inside"] and not wide["within_spread"]
    wider = mod.judge({**row, "measurement_spread": 0.011}, pred)  # 0.9989 <= 0.9994
    assert not wider["inside"] and wider["within_spread"] and wider["optimistic"] is False
    s = mod.summary([{"id": "x", "new": True, "group": "g", **mod.judge({**row, "measurement_spread": 0.011}, pred)}])
    assert s["groups"]["g"] == {**s["all"]} and s["all"]["inside"] == 0 and s["all"]["within_spread"] == 1
