"""`flashsgd bench scaling` (issue 14): link choice, reliability, the step model, and a --quick run."""

from __future__ import annotations

import argparse
import contextlib
import json
import math
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

from flashsgd.bench import scaling
from flashsgd.emulate import netns
from flashsgd.emulate.netns import EmulationUnavailable
from flashsgd.emulate.ranks import RankError
from flashsgd.sim import scaling as sim
from netns_helpers import needs_netns


def _args(**over) -> argparse.Namespace:
    p = argparse.ArgumentParser()
    scaling.add_arguments(p)
    ns = p.parse_args([])
    for k, v in over.items():
        setattr(ns, k, v)
    return ns


# ---- link choice and settings (no root) --------------------------------------------------------

def test_choose_rate_makes_dense_ring_take_r_times_compute():
    # 1 MB gradient on 8 ranks: 2 * 7/8 * 1e6 B = 1.75e6 B per link = 14e6 bit; in 2 x 0.5 s -> 14 Mbit/s
    assert scaling.choose_rate(1e6, 8, 0.5, 2.0) == 14_000_000
    assert scaling.ring_link_bytes(1e6, 2) == 1e6
    with pytest.raises(ValueError, match=">= 2 ranks"):
        scaling.choose_rate(1e6, 1, 0.5, 2.0)


def test_settings_defaults_quick_and_bad_values():
    spec = scaling.settings(_args())
    assert spec["nodes"] == [1, 2, 4, 8] and spec["comms"][0] == "noop"
    from flashsgd.comm.hooks import HOOKS

    assert set(spec["comms"]) == set(HOOKS.names()) | {"auto"}  # new hooks appear without a change here
    assert spec["comms"][-1] == "auto"  # train --comm auto's choice, measured beside them
    quick = scaling.settings(_args(quick=True))
    assert quick["nodes"] == [1, 2] and quick["iters"] < spec["iters"]
    assert scaling.settings(_args(comm="gtopk"))["comms"] == ["noop", "gtopk"]  # the ceiling added
    with pytest.raises(ValueError, match="warmup"):
        scaling.settings(_args(warmup=1))
    with pytest.raises(ValueError, match="hook"):
        scaling.settings(_args(comm="nosuchhook"))


def test_no_emulation_is_a_clear_message(monkeypatch, capsys):
    def unavailable():
        raise EmulationUnavailable("the emulated cluster needs root; running as uid 1000")

    monkeypatch.setattr(scaling, "check_available", unavailable)
    assert scaling.run(_args(quick=True)) == 2
    assert "cannot emulate a cluster here: the emulated cluster needs root" in capsys.readouterr().err


def test_link_follows_cpu_needs_the_chosen_rate(capsys):
    assert scaling.run(_args(link="100mbit", link_follows_cpu=True)) == 2
    assert "--link-follows-cpu scales the rate chosen by --comm-compute" in capsys.readouterr().err


# ---- reliability of the per-node-count loop (cluster and ranks faked) ---------------------------

class _FakeProgress:
    def __init__(self):
        self.file, self.seen, self.skipped = None, 0, 0
        self.bar = argparse.Namespace(total=0)

    def watch(self, file, label):
        self.file = file

    def poll(self):
        pass

    def running(self):
        return Path(str(self.file)).read_text().split()[-1]

    def skip(self, n):
        self.skipped += n


def _fake_jobs(monkeypatch, fail_on: str | None):
    """run_ranks writes one row per hook of the spec, or dies while running ``fail_on``."""
    built = []

    @contextlib.contextmanager
    def cluster(shape):
        built.append(shape)
        yield object()
        built.append("torn down")

    def run_ranks(cluster, command, log_dir, **kw):
        spec, out = json.loads(Path(command[-2]).read_text()), Path(command[-1])
        Path(str(out) + ".progress").write_text("\n".join(spec["comms"]) + "\n")
        if fail_on in spec["comms"]:
            Path(str(out) + ".progress").write_text(f"noop\n{fail_on}\n")
            raise RankError(f"rank 1 (node 1) exited with code 1; ... {fail_on} died")
        out.write_text(json.dumps({"rows": [{"comm": c, "step_s": [0.1]} for c in spec["comms"]]}))
        return 1.0

    monkeypatch.setattr(scaling, "emulated_cluster", cluster)
    monkeypatch.setattr(scaling, "run_ranks", run_ranks)
    return built


def _spec(**over):
    return {**scaling.settings(_args(quick=True)), "subnet": "10.214.0.0/24", **over}


def test_a_failing_hook_is_reported_and_the_others_still_run(monkeypatch, tmp_path):
    built = _fake_jobs(monkeypatch, fail_on="ring")
    rows = scaling.run_node_count(_spec(), 2, 10**8, ["noop", "ring", "gtopk"], tmp_path, tmp_path,
                                  _FakeProgress(), 1e6)
    by = {r["comm"]: r for r in rows}
    assert "ring died" in by["ring"]["error"]
    assert by["noop"]["step_s"] and by["gtopk"]["step_s"]  # rerun without the failed hook
    assert all(r["nodes"] == 2 and r["world"] == 2 for r in rows)
    assert built[-1] == "torn down"


def test_a_link_too_slow_for_the_timeout_skips_with_the_reason(monkeypatch, tmp_path):
    _fake_jobs(monkeypatch, fail_on=None)
    progress = _FakeProgress()
    # 100 MB at 1 Mbit/s on 2 ranks: 800 s per all-reduce, over a 120 s timeout
    rows = scaling.run_node_count(_spec(timeout_s=120.0), 2, 10**6, ["noop", "ring", "topk"], tmp_path,
                                  tmp_path, progress, 100e6)
    by = {r["comm"]: r for r in rows}
    assert "step_s" in by["noop"]
    for c in ("ring", "topk"):
        assert "over the collective timeout --timeout-s 120 s" in by[c]["skipped"]
        assert "a dense all-reduce of 95.4 MiB at 1 Mbit/s" in by[c]["skipped"]  # 100e6 B, binary units
    assert progress.skipped == 2 * (_spec()["warmup"] + _spec()["iters"])


# ---- the step model (torch-free) ---------------------------------------------------------------

TRUE = {"c_msg": 300e-6, "link_factor": 1.1, "c_byte": 2e-9, "c_elem": 5e-9, "c_call": 1e-3,
        "c_sparse": 2e-3, "c_flop": 1e-9}
MATRICES = [[10, 64], [10, 1], [64, 576], [64, 1], [64, 1], [16, 27]]  # fc, bias, conv, bn, bn, conv1


def _rows_from_model(params: dict) -> list[dict]:
    """Rows whose steps the model gives exactly, for 1, 2, 4, 8 nodes x 1 and 4 x 2."""
    compute = {(1, 1): 0.05, (2, 1): 0.05, (4, 1): 0.1, (8, 1): 0.2, (4, 2): 0.2}
    rows = []
    for (n, r), t in compute.items():
        rows.append({"comm": "noop", "nodes": n, "ranks_per_node": r, "world": n * r, "step_s": [t],
                     "link_bps": 2e7, "bucket_bytes": [1048576, 30000]})
        for comm in ("native", "ring", "hierarchical", "torus2d", "topk", "gtopk", "hgtopk", "powersgd"):
            row = {"comm": comm, "nodes": n, "ranks_per_node": r, "world": n * r, "link_bps": 2e7,
                   "bucket_bytes": [1048576, 30000], "grid": [r, n], "matrices": MATRICES}
            x = sim._scaled_row(row, 0.001, {sim.setting(row): t / 0.05})
            row["step_s"] = [t + float(x @ np.array([params[p] for p in sim.PARAMS]))]
            rows.append(row)
    return rows


def test_fit_recovers_the_model_and_validates_on_other_shapes():
    rows = _rows_from_model(TRUE)
    f = sim.fit(rows, [(2, 1), (8, 1)], 0.001)
    preds = sim.predict(f, rows)
    assert sim.max_error(preds, "validation") < 1e-6 and sim.max_error(preds, "calibration") < 1e-6
    roles = {(p["comm"], p["nodes"], p["ranks_per_node"]): p["role"] for p in preds}
    assert roles["ring", 4, 1] == "validation" and roles["ring", 8, 1] == "calibration"
    assert roles["noop", 4, 2] == "input (compute)" and roles["gtopk", 1, 1] == "one rank"


def test_fit_needs_noop_and_enough_rows():
    rows = [r for r in _rows_from_model(TRUE) if r["comm"] != "noop"]
    with pytest.raises(ValueError, match="noop"):
        sim.fit(rows, [(2, 1)], 0.001)
    with pytest.raises(ValueError, match=">= 7 measured rows"):
        sim.fit([r for r in _rows_from_model(TRUE) if r["comm"] in ("noop", "ring")], [(2, 1)], 0.001)


def test_simulate_calibrate_cli_is_torch_free(tmp_path):
    path = tmp_path / "scaling.json"
    path.write_text(json.dumps({"meta": {"density": 0.001, "matrices": MATRICES}, "rows": _rows_from_model(TRUE)}))
    code = ("import sys; from flashsgd.cli import main; rc = main(['simulate', '--calibrate', sys.argv[1], "
            "'--calibrate-on', '2x1,8x1', '--json', sys.argv[2]]); "
            "assert 'torch' not in sys.modules, 'simulate imported torch'; sys.exit(rc)")
    out = subprocess.run([sys.executable, "-c", code, str(path), str(tmp_path / "fit.json")],
                         capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    assert "validation rows 0.0%" in out.stdout and "c_msg" in out.stdout
    report = json.loads((tmp_path / "fit.json").read_text())
    assert report["calibration_shapes"] == [[2, 1], [8, 1]]
    assert abs(report["params"]["link_factor"] - 1.1) < 1e-6
    assert abs(report["params"]["c_flop"] - 1e-9) < 1e-12


# ---- the real thing ----------------------------------------------------------------------------

@needs_netns
@pytest.mark.slow  # ~34 s with every hook; the emulated path runs by default in the flow-capped test below
def test_quick_run_on_an_emulated_cluster(tmp_path):
    out = tmp_path / "quick.json"
    proc = subprocess.run([sys.executable, "-m", "flashsgd", "bench", "scaling", "--quick", "--json", str(out)],
                          capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    doc = json.loads(out.read_text())
    rows = {(r["comm"], r["nodes"]): r for r in doc["rows"]}
    for comm in scaling.default_comms():  # every hook has a row at both node counts, measured here
        for n in (1, 2):
            assert rows[comm, n]["step_ms"] > 0, rows[comm, n]
    assert rows["noop", 2]["efficiency"] == 1.0 and rows["native", 2]["exposed_comm_ms"] is not None
    assert rows["gtopk", 2]["compression_ms"] > 0
    assert doc["meta"]["link_bps"] > 0 and "--comm-compute 2" in proc.stderr
    assert all(len(r["loadavg"]) == 3 for r in doc["rows"])
    assert out.with_suffix(".png").exists()
    assert "samples/s" in proc.stdout and "2x1" in proc.stdout


def test_auto_verdict_compares_the_choice_with_the_best_measured_hook():
    from flashsgd.bench.scaling_report import auto_verdicts

    def row(comm, step, **extra):
        return {"comm": comm, "nodes": 4, "ranks_per_node": 2, "step_s": [step] * 3, **extra}

    chosen = {"label": "gtopk density 0.001, 4 MB buckets", "explain": "why"}
    rows = [row("noop", 0.1), row("native", 0.5), row("gtopk", 0.2), row("auto", 0.21, chosen=chosen),
            {"comm": "topk", "nodes": 4, "ranks_per_node": 2, "skipped": "no"}]
    (v,) = auto_verdicts(rows)
    assert v["best_comm"] == "gtopk" and v["ratio"] == pytest.approx(1.05) and v["chosen"] == chosen["label"]


def test_calibrate_on_every_shape_says_no_validation_rows_not_nan(tmp_path, capsys):
    """Every multi-rank shape calibrates: the validation error is of no rows, said in words."""
    from flashsgd.sim.scaling_cli import run_calibration

    path = tmp_path / "scaling.json"
    path.write_text(json.dumps({"meta": {"density": 0.001, "matrices": MATRICES}, "rows": _rows_from_model(TRUE)}))
    report = run_calibration([str(path)], "2x1,4x1,8x1,4x2", None)
    out = capsys.readouterr().out
    assert math.isnan(report["max_error"]["validation"])
    assert "validation rows none (no modelled row outside the calibration shapes)" in out
    assert "nan" not in out


def test_table_header_and_verdicts_never_contradict_their_numbers():
    """Gradient size in MiB, a ratio just over auto's target is not printed as the target, a
    validation error of no rows is 'none', one iteration is '1 step'."""
    from flashsgd.bench.scaling_report import AUTO_TARGET, format_table, summarize

    meta = {"model": "resnet20", "params": 272_474, "grad_bytes": 2 ** 20, "batch": 32, "recipe": "goyal",
            "link_bps": 2e7, "comm_compute": 0, "cpus": 2, "loadavg_start": [1.0], "loadavg_end": [1.0],
            "iters": 1, "warmup": 1, "elapsed_s": 10.0}

    def row(comm, step, **extra):
        return {"comm": comm, "nodes": 2, "ranks_per_node": 1, "world": 2, "step_s": [step],
                "link_bps": 2e7, "loadavg": [1.0], **extra}

    chosen = {"label": "ring, 25 MiB buckets", "explain": "why"}
    rows = summarize([row("noop", 0.1), row("gtopk", 0.2),
                      row("auto", 0.2 * (AUTO_TARGET + 0.0004), chosen=chosen)], 32)
    sim = {"params": {}, "calibration_shapes": [[2, 1]], "max_error_calibration": 0.01,
           "max_error_validation": math.nan, "describe": "(model)"}
    text = format_table({"meta": meta, "rows": rows, "simulator": sim})
    assert "1 MiB gradient" in text and "median of 1 step after" in text
    assert f"= 1.1004x (target <= {AUTO_TARGET:.2f})" in text
    assert "validation none (no other shape)" in text and "nan" not in text


# ---- --flow-rate and --grad-accum (issue 25) ---------------------------------------------------

@pytest.mark.parametrize("text, link, bps", [("1/4", 100_000_000, 25_000_000), ("25mbit", 100_000_000, 25_000_000),
                                              ("100mbit", 100_000_000, 100_000_000), ("1/1", 10**9, 10**9),
                                              (None, 10**9, None)])
def test_flow_rate_is_a_rate_or_a_fraction_of_the_link(text, link, bps):
    assert netns.parse_flow_rate(text, link) == bps


@pytest.mark.parametrize("text, match", [
    ("200mbit", r"--flow-rate 200mbit \(200 Mbit/s\) is above the link rate \(100 Mbit/s\).*fraction of it such as 1/4"),
    ("5/4", r"a fraction of the link must be in \(0, 1\], such as 1/4"),
    ("0/4", r"a fraction of the link must be in \(0, 1\]"),
    ("fast", r"--flow-rate: link rate must look like '1gbit'.*or a fraction of the link such as 1/4"),
    ("1/10000", r"--flow-rate 1/10000 at a 100 Mbit/s link: link rate must be at least 100kbit"),
])
def test_flow_rate_refuses_what_cannot_be_a_flows_cap(text, match):
    with pytest.raises(ValueError, match=match):
        netns.parse_flow_rate(text, 100_000_000)


def test_flow_rate_and_grad_accum_errors_exit_2_before_building_anything(capsys):
    assert scaling.run(_args(link="100mbit", flow_rate="200mbit")) == 2
    assert "is above the link rate (100 Mbit/s)" in capsys.readouterr().err
    assert scaling.run(_args(flow_rate="11gbit")) == 2  # --comm-compute: no flow above 10gbit either
    assert "--flow-rate 11gbit (11000 Mbit/s) is above the link rate" in capsys.readouterr().err
    assert scaling.run(_args(link="100mbit", grad_accum=0)) == 2
    assert "--grad-accum must be >= 1, got 0" in capsys.readouterr().err


def test_flow_rate_above_the_rate_comm_compute_chose_is_a_clear_exit_2(monkeypatch, capsys):
    monkeypatch.setattr(scaling, "check_available", lambda: None)

    # measure()'s own --comm-compute path, its probe faked: the chosen link is 10 Mbit/s
    monkeypatch.setattr(scaling, "noop_probe", lambda spec, n, work, log_dir, progress: {"noop_median_s": 0.1})
    monkeypatch.setattr(scaling, "choose_rate", lambda *a: 10_000_000)

    def never(*a, **k):
        raise AssertionError("nothing is measured with a flow rate above the chosen link")

    monkeypatch.setattr(scaling, "run_node_count", never)
    assert scaling.run(_args(flow_rate="25mbit", quick=True)) == 2
    assert "--flow-rate 25mbit (25 Mbit/s) is above the link rate (10 Mbit/s)" in capsys.readouterr().err


def test_a_value_error_while_measuring_is_not_reported_as_a_usage_error(monkeypatch):
    """Only ChosenLinkError is a usage error (exit 2); any other ValueError is a bug and propagates."""
    monkeypatch.setattr(scaling, "check_available", lambda: None)

    def broken(spec, args, work, log_dir):
        raise ValueError("a bug in a rank's JSON")

    monkeypatch.setattr(scaling, "measure", broken)
    with pytest.raises(ValueError, match="a bug in a rank's JSON"):
        scaling.run(_args(link="100mbit", quick=True))


def test_rows_record_the_flow_cap_and_accumulation_and_the_cluster_gets_the_cap(monkeypatch, tmp_path):
    built = _fake_jobs(monkeypatch, fail_on=None)
    spec = _spec(flow_rate="1/4", grad_accum=4)
    rows = scaling.run_node_count(spec, 2, 100_000_000, ["noop", "ring"], tmp_path, tmp_path, _FakeProgress(), 1e6)
    assert {(r["flow_bps"], r["grad_accum"], r["link_bps"]) for r in rows} == {(25_000_000, 4, 100_000_000)}
    assert built[0].flow_rate_bps == 25_000_000 and built[0].rate_bps == 100_000_000
    rows = scaling.run_node_count(_spec(), 2, 100_000_000, ["noop"], tmp_path, tmp_path, _FakeProgress(), 1e6)
    assert rows[0]["flow_bps"] is None and rows[0]["grad_accum"] == 1 and built[2].flow_rate_bps is None


def test_the_timeout_skip_counts_the_flow_cap(monkeypatch, tmp_path):
    _fake_jobs(monkeypatch, fail_on=None)
    # 10 MB on 2 ranks: 1e7 B x 8 = 80 Mbit over the ring's one flow: 0.8 s at 100 Mbit/s, 80 s at 1 Mbit/s
    assert scaling.wire_s("ring", 10e6, 2, 2, 100_000_000, None) == pytest.approx(0.8)
    assert scaling.wire_s("ring", 10e6, 2, 2, 100_000_000, 1_000_000) == pytest.approx(80.0)
    rows = scaling.run_node_count(_spec(timeout_s=60.0, flow_rate="1mbit"), 2, 100_000_000, ["noop", "ring"],
                                  tmp_path, tmp_path, _FakeProgress(), 10e6)
    assert "at 100 Mbit/s (one flow at most 1 Mbit/s) takes ~80 s" in rows[0]["skipped"]


def test_grad_accum_is_the_trainers_accumulation_of_full_micro_batches():
    """K micro-batches of --batch per rank: the trainer's global batch K x batch x W, optim.grad_accum K
    (its TrainStep splits each shard into K, no_sync on the first K-1)."""
    from flashsgd.bench.scaling_rank import run_config
    from flashsgd.train.config import resolve
    from flashsgd.train.plan import build_plan

    spec = {**_spec(grad_accum=4, batch=8), "out_dir": "/tmp/unused"}
    cfg = resolve(cli=run_config(spec, "ring", 2))
    assert cfg.optim.grad_accum == 4 and cfg.optim.global_batch == 8 * 2 * 4
    plan = build_plan(cfg, 2, cfg.data.num_samples, local_spawn=False)
    assert plan.execution["micro_batch_per_worker"] == [8]


def test_samples_per_s_and_the_header_count_accumulation_and_the_flow_cap():
    from flashsgd.bench.scaling_report import format_table, summarize

    def row(comm, step):
        return {"comm": comm, "nodes": 2, "ranks_per_node": 2, "world": 4, "step_s": [step], "link_bps": 1e8,
                "flow_bps": 25_000_000, "grad_accum": 4, "loadavg": [1.0]}

    rows = summarize([row("noop", 0.5), row("ring", 1.0)], 16)
    assert rows[1]["samples_per_s"] == pytest.approx(16 * 4 * 4 / 1.0)  # batch x K x W / step
    assert rows[1]["efficiency"] == pytest.approx(0.5) and rows[0]["efficiency_vs_1node"] == pytest.approx(1.0)
    meta = {"model": "resnet20", "params": 1000, "grad_bytes": 4000, "batch": 16, "recipe": "goyal",
            "link_bps": 1e8, "comm_compute": None, "cpus": 2, "loadavg_start": [1.0], "loadavg_end": [1.0],
            "iters": 3, "warmup": 2, "elapsed_s": 1.0, "grad_accum": 4, "flow_bps": 25_000_000, "flow_rate": "1/4"}
    head = format_table({"meta": meta, "rows": rows}).splitlines()[0]
    assert "batch 16/rank x 4 micro-batches per exchange (--grad-accum 4)" in head
    assert "link 100.000 Mbit/s, one TCP flow at most 25.000 Mbit/s (--flow-rate 1/4)" in head


def _count_exchanges(grad_accum: int) -> dict:
    """One rank: the bench's trainer for ring at ``grad_accum``; hook calls and forwards per step."""
    import torch.distributed as dist

    from flashsgd.bench import scaling_rank
    from flashsgd.train import rank as train_rank
    from flashsgd.train.config import resolve

    calls = {"hook": 0, "forward": 0}
    wrap = train_rank.CommTimer.wrap

    def counting(self, hook):
        timed = wrap(self, hook)

        def count(state, bucket):
            calls["hook"] += 1
            return timed(state, bucket)
        return count

    train_rank.CommTimer.wrap = counting
    spec = {**_spec(grad_accum=grad_accum, batch=4, model="mnist1d_cnn", dataset="mnist1d", channels=8),
            "out_dir": "/tmp/unused"}
    data = train_rank.load_data(resolve(cli=scaling_rank.run_config(spec, "noop", dist.get_world_size())))
    trainer = scaling_rank.build(spec, "ring", data)
    trainer.model.register_forward_pre_hook(lambda *a: calls.__setitem__("forward", calls["forward"] + 1))
    trainer.step()  # DDP's first step (buckets rebuilt after it)
    before = dict(calls)
    trainer.step()
    return {k: calls[k] - before[k] for k in calls} | {"buckets": len(trainer.bucket_bytes())}


@pytest.mark.parametrize("k", [1, 3])
def test_a_step_of_k_micro_batches_exchanges_once(run_ranks, k):
    out = run_ranks(_count_exchanges, 2, k)[0]
    assert out["forward"] == k and out["hook"] == out["buckets"] >= 1


@pytest.mark.slow  # 16 s
@needs_netns
def test_a_flow_capped_accumulating_run_on_an_emulated_cluster(tmp_path):
    """2 nodes, noop and ring, flow = link / 4, 2 micro-batches: the rows and the header say so and
    the ring's one flow per NIC is slowed by the cap (~18 s on the 2-core VM at load 6)."""
    out = tmp_path / "flow.json"
    proc = subprocess.run([sys.executable, "-m", "flashsgd", "bench", "scaling", "--nodes", "2", "--comm", "noop,ring",
                           "--link", "100mbit", "--flow-rate", "1/4", "--grad-accum", "2", "--warmup", "2",
                           "--iters", "2", "--batch", "8", "--json", str(out)],
                          capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "x 2 micro-batches per exchange (--grad-accum 2)" in proc.stdout
    assert "one TCP flow at most 25.000 Mbit/s (--flow-rate 1/4)" in proc.stdout
    doc = json.loads(out.read_text())
    assert doc["meta"]["flow_bps"] == 25_000_000 and doc["meta"]["grad_accum"] == 2
    rows = {r["comm"]: r for r in doc["rows"]}
    assert {(r["flow_bps"], r["grad_accum"]) for r in rows.values()} == {(25_000_000, 2)}
    # the ring's bytes on the link: 2 (W-1)/W x S over one flow; at the link rate they would take a
    # quarter of the time the cap gives them: more than half the capped time proves the cap
    wire_at_flow = scaling.ring_link_bytes(doc["meta"]["grad_bytes"], 2) * 8 / 25e6
    assert rows["ring"]["split_s"]["hook"] > 0.5 * wire_at_flow


# ---- rows that contradict their noop baseline (issue 33 item 7) --------------------------------

def _timed(comm: str, steps: list[float], nodes: int = 2) -> dict:
    return {"comm": comm, "nodes": nodes, "ranks_per_node": 1, "world": nodes, "step_s": steps,
            "link_bps": 2e7, "loadavg": [6.0]}


def test_a_row_faster_than_its_noop_beyond_both_spreads_contradicts_it():
    # the noop slowed by load for its whole measurement (200..250 ms), the hook's row not (100..120 ms):
    # its slowest step beats the noop's fastest, so every pairing of steps says efficiency > 100%
    ev = sim.baseline_contradiction([0.10, 0.11, 0.12], [0.20, 0.22, 0.25])
    assert ev["row_max_ms"] == pytest.approx(120.0) and ev["noop_min_ms"] == pytest.approx(200.0)
    assert ev["margin_ms"] == pytest.approx(80.0) and ev["efficiency_at_least"] == pytest.approx(200 / 120)
    assert "baseline slowed by load more than this row; rerun on a quiet machine" in ev["why"]


@pytest.mark.parametrize("row, noop", [
    ([0.0990, 0.0995, 0.1010], [0.098, 0.100, 0.102]),  # efficiency 100.5%, spreads overlap: noise
    ([0.10, 0.11, 0.20], [0.20, 0.22, 0.25]),           # median 183%, but its slowest step ties the noop's fastest
    ([0.30, 0.31], [0.20, 0.21]),                       # an ordinary row: slower than the noop
])
def test_a_row_within_the_spread_of_its_noop_is_noise_not_a_contradiction(row, noop):
    assert sim.baseline_contradiction(row, noop) is None


def test_summarize_marks_the_row_in_the_json_and_keeps_noise_as_measured():
    from flashsgd.bench.scaling_report import summarize

    rows = summarize([_timed("noop", [0.20, 0.22, 0.25]), _timed("ring", [0.10, 0.11, 0.12]),
                      _timed("gtopk", [0.20, 0.21, 0.26]), _timed("native", [0.40, 0.41, 0.45])], 32)
    by = {r["comm"]: r for r in rows}
    assert by["ring"]["contradicts_baseline"] is True and by["ring"]["efficiency"] == pytest.approx(2.0)
    assert by["ring"]["contradiction"]["noop_min_ms"] == pytest.approx(200.0)
    # gtopk: median 210 ms < noop 220 ms (efficiency 104.8%), but within the spreads: kept, unclamped
    assert by["gtopk"]["contradicts_baseline"] is False and "contradiction" not in by["gtopk"]
    assert by["gtopk"]["exposed_comm_ms"] == pytest.approx(-10.0)
    assert by["native"]["contradicts_baseline"] is False and by["noop"]["contradicts_baseline"] is False


def test_the_table_marks_the_row_and_says_why():
    from flashsgd.bench.scaling_report import format_table, summarize

    rows = summarize([_timed("noop", [0.20, 0.22, 0.25]), _timed("ring", [0.10, 0.11, 0.12]),
                      _timed("gtopk", [0.20, 0.21, 0.26])], 32)
    meta = {"model": "resnet20", "params": 1000, "grad_bytes": 4000, "batch": 32, "recipe": "goyal",
            "link_bps": 2e7, "comm_compute": None, "cpus": 2, "loadavg_start": [6.0], "loadavg_end": [6.0],
            "iters": 3, "warmup": 2, "elapsed_s": 1.0}
    sim_fit = {"params": {}, "calibration_shapes": [[2, 1]], "max_error_calibration": 0.01,
               "max_error_validation": math.nan, "describe": "(model)",
               "exclusion_note": "excluded 1 row faster than their noop step beyond the spread of both "
                                 "(baseline slowed by load): ring 2x1"}
    lines = format_table({"meta": meta, "rows": rows, "simulator": sim_fit}).splitlines()
    ring = next(line for line in lines if " ring " in line)
    gtopk = next(line for line in lines if " gtopk " in line)
    assert "200.0%!" in ring and "104.8% " in gtopk and "!" not in gtopk
    text = "\n".join(lines)
    assert "# !: faster than the noop step at the same shape beyond the spread of both (1 row)" in text
    assert "#   2x1 ring: slowest step 120.0 ms < the noop's fastest 200.0 ms: baseline slowed by load" in text
    assert "exposed < 0 (eff > 100%) without !: within the min..max" in text
    assert "; excluded 1 row faster than their noop step" in text


def _rows_with_a_contradiction() -> list[dict]:
    """The exact model's rows, with ring at 8x1 (a calibration shape) measured at 10 ms against a
    200 ms noop: a row no exchange cost can explain."""
    rows = _rows_from_model(TRUE)
    ring = next(r for r in rows if r["comm"] == "ring" and r["nodes"] == 8)
    ring["step_s"] = [0.010]
    return rows


def test_the_fit_ignores_a_row_that_contradicts_its_noop_and_says_so():
    rows = _rows_with_a_contradiction()
    f = sim.fit(rows, [(2, 1), (8, 1)], 0.001)
    assert f.excluded == (("ring", 8, 1),) and ("ring", 8, 1) not in f.calibration
    assert "excluded 1 row faster than their noop step beyond the spread of both" in f.exclusion_note()
    preds = sim.predict(f, rows)
    # the other rows still determine the true parameters exactly; the marked row is in neither error
    assert sim.max_error(preds, "calibration") < 1e-6 and sim.max_error(preds, "validation") < 1e-6
    role = {(p["comm"], p["nodes"], p["ranks_per_node"]): p["role"] for p in preds}
    assert role["ring", 8, 1] == "contradicts noop" and role["ring", 4, 1] == "validation"
    assert sim.fit(_rows_from_model(TRUE), [(2, 1), (8, 1)], 0.001).excluded == ()


def test_bench_and_simulate_report_the_excluded_rows(tmp_path, capsys):
    from flashsgd.bench.scaling_report import simulate_rows
    from flashsgd.sim.scaling_cli import run_calibration

    rows = _rows_with_a_contradiction()
    fit, preds = simulate_rows([{k: v for k, v in r.items() if k != "matrices"} for r in rows], 0.001, MATRICES)
    assert fit["excluded"] == [{"comm": "ring", "nodes": 8, "ranks_per_node": 1}]
    assert fit["max_error_calibration"] < 1e-6 and "excluded 1 row" in fit["exclusion_note"]
    path = tmp_path / "scaling.json"
    path.write_text(json.dumps({"meta": {"density": 0.001, "matrices": MATRICES}, "rows": rows}))
    report = run_calibration([str(path)], "2x1,8x1", None)
    assert report["excluded"] == [{"comm": "ring", "nodes": 8, "ranks_per_node": 1}]
    out = capsys.readouterr().out
    assert "excluded 1 row faster than their noop step beyond the spread of both (baseline slowed by load): " \
           "ring 8x1; role 'contradicts noop' below, in neither error" in out
    assert report["max_error"]["calibration"] < 1e-6
