"""The planner charges the compressing hooks' compute on the cluster's device class
(flashsgd.sim.device_costs), so it never picks compression whose compute exceeds the exchange time it
saves; the dgx-h100 preset keeps a dense exchange, 1gbe a sparse one."""

from __future__ import annotations

import dataclasses
import json
import subprocess
import sys

import pytest

from flashsgd.exchanges import EXCHANGES, SELECTION_BY_DEVICE
from flashsgd.sim import planner
from flashsgd.sim.device_costs import DEVICES, RESNET50_ELEMS
from flashsgd.sim.network import CLUSTERS, DEVICE_INPUTS, on_device, with_input
from flashsgd.sim.workload import resnet50


def plan_json(tmp_path, *args: str) -> dict:
    out = tmp_path / "plan.json"
    r = subprocess.run([sys.executable, "-m", "flashsgd", "plan", *args, "--json", str(out)],
                       capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stderr
    return json.loads(out.read_text())


def test_every_preset_names_a_device_class_and_takes_its_costs():
    for name in CLUSTERS.names():
        c = CLUSTERS.get(name)
        d = DEVICES.get(c.device)
        assert c.selection == d.selection() == SELECTION_BY_DEVICE[d.device_type]  # what "auto" runs there
        assert {k: getattr(c, k) for k in DEVICE_INPUTS} == {k: d.costs()[k] for k in DEVICE_INPUTS}
        assert c.gamma_s_per_byte == d.gamma_s_per_byte
        for k in DEVICE_INPUTS:  # each cost an assumption with its class's range
            assert c.assumed[k] == d.ranges()[k]


def test_every_device_class_is_ranged_and_sourced():
    for d in DEVICES.values():
        for r in [*d.select_s_per_elem.values(), d.exchange_fixed_s, d.lowrank_s_per_elem, d.flop_s]:
            assert 0 < r.low <= r.value <= r.high and r.source
    # H100: the measured exact selection, 0.810-0.848 ms per ResNet-50 gradient (docs/gpu.md)
    h = DEVICES.get("h100").select("exact")
    assert (h.low * RESNET50_ELEMS * 1e3, h.high * RESNET50_ELEMS * 1e3) == pytest.approx((0.810, 0.848))
    # the derived classes are slower per element, by their memory bandwidth
    v = DEVICES.get("v100").select("exact")
    assert v.value / h.value == pytest.approx(DEVICES.get("h100").memory_gbps / DEVICES.get("v100").memory_gbps)


def test_unknown_device_and_selection_are_named():
    with pytest.raises(ValueError, match="unknown device class 'tpu'.*h100"):
        on_device(CLUSTERS.get("1gbe"), "tpu")
    with pytest.raises(ValueError, match="selection must be one of auto, exact, sampled, threshold"):
        DEVICES.get("cpu").selection("fastest")


def test_dgx_h100_at_64_gpus_keeps_a_dense_exchange(tmp_path):
    doc = plan_json(tmp_path, "--cluster", "dgx-h100", "--gpus", "64", "--model", "resnet50")
    choice = doc["choice"]["algorithm"]
    assert not EXCHANGES.get(choice).compresses, doc["explain"]
    # the compressing candidates were ranked, with their compute charged
    sparse = [p for p in doc["ranked"] if EXCHANGES.get(p["algorithm"]).family == "sparse"]
    assert sparse and all(p["compression_s"] > 0 for p in sparse)


def test_1gbe_still_picks_a_sparse_exchange_and_gtopk_over_dense_and_powersgd(tmp_path):
    doc = plan_json(tmp_path, "--cluster", "1gbe", "--gpus", "32", "--model", "resnet50", "--steps", "50000")
    assert doc["choice"]["algorithm"] in planner.SPARSE
    c = CLUSTERS.get("1gbe")
    p = planner.make_plan(resnet50(), c, gpus=32, batch_per_gpu=32, images_per_s=200.0, steps=50_000,
                          algorithms=planner.DENSE + ("gtopk",) + planner.LOWRANK)
    assert p.choice.candidate.algorithm == "gtopk"


def test_the_compression_cost_follows_the_device_class(tmp_path):
    args = ("--cluster", "1gbe", "--gpus", "32", "--model", "resnet50", "--steps", "50000", "--top", "20")
    gpu, cpu = plan_json(tmp_path, *args), plan_json(tmp_path, *args, "--device", "cpu")

    def gtopk(doc):
        return next(p for p in doc["ranked"] if p["algorithm"] == "gtopk" and p["bucket_mb"] == 128.0
                    and p["density"] == 0.001)

    assert "exact on gtx1080ti" in gpu["cluster"] and "sampled on cpu" in cpu["cluster"]  # auto, by device
    assert gtopk(cpu)["compression_s"] > 2 * gtopk(gpu)["compression_s"]
    # the selection share of it: ResNet-50's elements x each class's cost of the selection it runs
    sel = {n: DEVICES.get(n).select().value * RESNET50_ELEMS for n in ("gtx1080ti", "cpu")}
    assert gtopk(cpu)["compression_s"] - gtopk(gpu)["compression_s"] > sel["cpu"] - sel["gtx1080ti"]
    # --selection names what the hooks run: exact on the CPU is torch.topk, ten times sampled
    exact = plan_json(tmp_path, *args, "--device", "cpu", "--selection", "exact")
    assert gtopk(exact)["compression_s"] > 5 * gtopk(cpu)["compression_s"]


def test_plan_refuses_compression_that_costs_more_than_it_saves():
    # 32 ranks on a 10x faster link than 1gbe's (1.11 GB/s): with its compression free a compressing
    # exchange wins; on CPUs running torch.topk (exact, ~10 ns per element) it costs more than the
    # exchange time it saves, and a dense exchange is chosen.
    fast = with_input(with_input(CLUSTERS.get("1gbe"), "inter.bandwidth_gbps", 1.11), "intra.bandwidth_gbps", 1.11)
    charged = on_device(fast, "cpu", "exact")
    free = dataclasses.replace(charged, **{k: 0.0 for k in DEVICE_INPUTS})
    kw = dict(gpus=32, batch_per_gpu=32, images_per_s=200.0, steps=50_000)
    assert planner.make_plan(resnet50(), free, **kw).choice.candidate.compresses
    plan = planner.make_plan(resnet50(), charged, **kw)
    assert not plan.choice.candidate.compresses
    dense = plan.best_dense()
    for p in plan.ranked:
        if p.candidate.compresses and p.step_s >= dense.step_s:  # every one it passed over
            assert p.compression_s > planner.compression_saving(p, dense)
    assert "costs more than the exchange time it saves" in plan.explain()


def test_plan_cli_device_errors(tmp_path):
    r = subprocess.run([sys.executable, "-m", "flashsgd", "plan", "--cluster", "1gbe", "--gpus", "8",
                        "--device", "tpu"], capture_output=True, text=True, timeout=120)
    assert r.returncode != 0 and "invalid choice: 'tpu'" in r.stderr and "h100" in r.stderr
