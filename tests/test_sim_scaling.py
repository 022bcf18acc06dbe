"""The calibrated step model (flashsgd.sim.scaling) on rows with a per-flow cap (`bench scaling
--flow-rate`) and gradient accumulation (`--grad-accum`), and the committed files it must still
predict as before (torch-free)."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest

from flashsgd.sim import scaling as sim
from flashsgd.sim.network import Link

ROOT = Path(__file__).resolve().parents[1]
BASELINE = json.loads((ROOT / "tests/data/sim_scaling_baseline.json").read_text())
MIB = 1 << 20


def _row(comm: str, nodes: int = 4, rpn: int = 2, **extra) -> dict:
    return {"comm": comm, "nodes": nodes, "ranks_per_node": rpn, "world": nodes * rpn,
            "link_bps": 100_000_000, "bucket_bytes": [4 * MIB], **extra}


# ---- the committed measurements predict exactly what they did --------------------------------

@pytest.mark.parametrize("case", BASELINE["cases"], ids=lambda c: "+".join(Path(f).stem for f in c["files"]))
def test_committed_files_predict_as_before(case, monkeypatch):
    monkeypatch.chdir(ROOT)  # the files are named relative to the repository, as in docs/scaling.md
    docs = [sim.load_scaling(f) for f in case["files"]]
    rows = [r for d in docs for r in d.rows]
    assert all(r["grad_accum"] == 1 and r["flow_bps"] is None for r in rows)  # old files: the defaults
    shapes = [tuple(s) for s in case["calibrate_on"]] if case["calibrate_on"] else \
        sim.default_calibration_shapes(docs[0].rows)
    preds = sim.predict(sim.fit(rows, shapes, docs[0].meta["density"]), rows)
    assert [p["predicted_s"] for p in preds] == pytest.approx(case["predicted_s"], rel=1e-12)


# ---- the design rows under a per-flow cap ------------------------------------------------------

def _b(row: dict) -> float:
    return sim.design(row, 0.001)[sim.PARAMS.index("link_factor")]


@pytest.mark.parametrize("comm, flows, factor", [
    ("ring", 1, 4.0),          # one flow per NIC, capped at a quarter of the link: 4 x the link time
    ("native", 1, 4.0),        # taken to be the ring
    ("torus2d", 2, 2.0),       # 2x4 grid on 4x2: two cross-node rings per NIC, each at 1/4: half the link
    ("hierarchical", 2, 2.0),  # one cross-node ring per local rank
])
def test_flow_cap_multiplies_the_link_bytes_by_link_over_flow_rate_shared(comm, flows, factor):
    """B_eff / B = max(flows, link / flow) / flows (Link.flow_beta), on 4x2 with flow = link / 4."""
    grid = {"grid": [2, 4]} if comm == "torus2d" else {}
    free, capped = _row(comm, **grid), _row(comm, flow_bps=25_000_000, **grid)
    assert _b(capped) == pytest.approx(factor * _b(free), rel=1e-12)
    # the factor is Link.flow_beta's: flows sharing a link whose one flow may carry a quarter of it
    link = Link(0.0, 1.0, flow_gbps=0.25)
    assert link.flow_beta(flows) / (flows * link.beta_s_per_byte) == pytest.approx(factor)
    # only the wire term changes: messages, CPU bytes, calls are the same with or without the cap
    others = [i for i, p in enumerate(sim.PARAMS) if p != "link_factor"]
    assert np.allclose(sim.design(capped, 0.001)[others], sim.design(free, 0.001)[others])


def test_torus_link_time_is_three_sevenths_of_the_ring_under_the_cap():
    """The simulator's figure (docs/simulator.md, 4x2 at a quarter of the link): torus 6/8 n x 4
    beta vs ring 14/8 n x 4 beta."""
    ring, torus = _row("ring", flow_bps=25_000_000), _row("torus2d", grid=[2, 4], flow_bps=25_000_000)
    assert _b(torus) / _b(ring) == pytest.approx(3 / 7, rel=1e-12)


def test_a_cap_at_the_link_rate_changes_nothing():
    assert _b(_row("ring", flow_bps=100_000_000)) == pytest.approx(_b(_row("ring")), rel=1e-12)


# ---- rows of several settings fitted together --------------------------------------------------

TRUE = {"c_msg": 300e-6, "link_factor": 1.1, "c_byte": 2e-9, "c_elem": 5e-9, "c_call": 1e-3,
        "c_sparse": 2e-3, "c_flop": 0.0}
COMMS = ("native", "ring", "hierarchical", "torus2d", "topk", "gtopk", "hgtopk")


def _rows(settings: dict) -> list[dict]:
    """Rows the model gives exactly: {(nodes, rpn, grad_accum, flow_bps): compute per micro-batch}
    (a step of K micro-batches computes K times as long; its exchange is one)."""
    rows = []
    base = min(settings.items(), key=lambda kv: kv[0][0] * kv[0][1])[1]
    for (n, r, accum, flow), micro in settings.items():
        t = micro * accum
        extra = {"grad_accum": accum, "flow_bps": flow, "link_bps": 20_000_000, "bucket_bytes": [MIB, 30000]}
        rows.append({**_row("noop", n, r, **extra), "step_s": [t]})
        for comm in COMMS:
            row = _row(comm, n, r, grid=[r, n], **extra)
            x = sim._scaled_row(row, 0.001, {sim.setting(row): micro / base})
            row["step_s"] = [t + float(x @ np.array([TRUE[p] for p in sim.PARAMS]))]
            rows.append(row)
    return rows


SETTINGS = {(1, 2, 1, None): 0.05, (2, 2, 1, None): 0.08, (4, 2, 1, None): 0.16,
            (2, 2, 1, 5_000_000): 0.08, (4, 2, 1, 5_000_000): 0.16,
            (2, 2, 4, None): 0.07, (4, 2, 4, None): 0.15}


def test_each_row_is_matched_with_its_own_settings_noop_and_the_fit_recovers_the_model():
    rows = _rows(SETTINGS)
    f = sim.fit(rows, [(1, 2), (4, 2)], 0.001)
    assert f.params == pytest.approx(TRUE, abs=1e-12)
    preds = sim.predict(f, rows)
    assert sim.max_error(preds, "validation") < 1e-9 and sim.max_error(preds, "calibration") < 1e-9
    # 2x2 validates in every setting; s(N) per micro-batch: accumulation's 4x compute is not a 4x slowdown
    roles = {(p["comm"], p["nodes"], p["grad_accum"], p["flow_bps"]): p["role"] for p in preds}
    assert roles["ring", 2, 4, None] == roles["ring", 2, 1, 5_000_000] == "validation"
    assert roles["ring", 4, 4, None] == "calibration"
    assert f.share[(2, 2, 4, None, None)] == pytest.approx(0.07 / 0.05)
    assert f.compute[(2, 2, 4, None, None)] == pytest.approx(0.28)
    text = f.describe()
    assert "2x2 accum 4: 280.0 ms (s=1.40)" in text and "4x2 flow 5 Mbit/s: 160.0 ms (s=3.20)" in text


def test_a_setting_without_its_noop_row_is_not_predicted_from_another():
    rows = [r for r in _rows(SETTINGS) if not (r["comm"] == "noop" and r["grad_accum"] == 4 and r["nodes"] == 2)]
    preds = sim.predict(sim.fit(rows, [(1, 2), (4, 2)], 0.001), rows)
    p = next(p for p in preds if p["comm"] == "ring" and p["nodes"] == 2 and p["grad_accum"] == 4)
    assert p["role"] == "no noop row at this shape" and p["predicted_s"] is None


def test_two_files_with_the_same_shape_keep_their_own_compute(tmp_path):
    """A re-run of the same settings in another file: each row is matched with its own file's noop."""
    a = _rows({(1, 2, 1, None): 0.05, (4, 2, 1, None): 0.16})
    b = _rows({(1, 2, 1, None): 0.05, (4, 2, 1, None): 0.20})
    paths = []
    for name, rows in (("a.json", a), ("b.json", b)):
        (tmp_path / name).write_text(json.dumps({"meta": {"density": 0.001}, "rows": rows}))
        paths.append(str(tmp_path / name))
    pooled = [r for p in paths for r in sim.load_scaling(p).rows]
    f = sim.fit(pooled, [(4, 2)], 0.001)
    preds = sim.predict(f, pooled)
    # matched by shape alone, a's 4x2 rows would take b's compute (200 ms) and miss by ~40 ms
    assert sim.max_error(preds, "calibration") < 1e-9
    assert "4x2 (a.json): 160.0 ms (s=3.20), 4x2 (b.json): 200.0 ms (s=4.00)" in f.describe()


def test_old_file_rows_load_with_one_micro_batch_and_no_cap(tmp_path):
    rows = [{k: v for k, v in r.items() if k not in ("grad_accum", "flow_bps")}
            for r in _rows({(2, 2, 1, None): 0.05})]
    (tmp_path / "old.json").write_text(json.dumps({"meta": {"density": 0.001}, "rows": rows}))
    loaded = sim.load_scaling(tmp_path / "old.json").rows
    assert {(r["grad_accum"], r["flow_bps"]) for r in loaded} == {(1, None)}


def test_simulate_calibrate_prints_each_rows_setting(tmp_path, capsys):
    from flashsgd.sim.scaling_cli import run_calibration

    path = tmp_path / "scaling.json"
    path.write_text(json.dumps({"meta": {"density": 0.001}, "rows": _rows(SETTINGS)}))
    report = run_calibration([str(path)], "1x2,4x2", None)
    out = capsys.readouterr().out
    assert "setting" in out.splitlines()[out.splitlines().index(next(
        line for line in out.splitlines() if line.lstrip().startswith("shape")))]
    assert any("ring" in line and "accum 4" in line for line in out.splitlines())
    assert any("ring" in line and "flow 5 Mbit/s" in line for line in out.splitlines())
    assert report["max_error"]["validation"] < 1e-9


def test_files_pooled_in_one_fit_keep_their_own_density(tmp_path):
    """Sparse rows of a file run at --density 0.01 are modelled at 0.01 even when the first file
    pooled with it ran at 0.001 (the fit's default density applies only to rows without one)."""
    row = _row("gtopk", bucket_bytes=[16 * MIB], step_s=[0.5])
    paths = []
    for name, density in (("d001.json", 0.001), ("d01.json", 0.01)):
        (tmp_path / name).write_text(json.dumps({"meta": {"density": density}, "rows": [dict(row)]}))
        paths.append(tmp_path / name)
    low, high = (sim.load_scaling(p).rows[0] for p in paths)
    assert (low["density"], high["density"]) == (0.001, 0.01)
    b = sim.PARAMS.index("link_factor")
    # the fit's density argument (the first file's) does not override a row's own
    assert sim.design(high, 0.001)[b] == pytest.approx(sim.design(dict(row), 0.01)[b])
    assert sim.design(high, 0.001)[b] > 5 * sim.design(low, 0.001)[b]  # ~10x the pairs on the wire
