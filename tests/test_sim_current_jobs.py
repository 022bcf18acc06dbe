"""Predictions for current jobs: compute rates by GPU x model x precision, the dgx-a100 preset,
cluster files checked against the link they name, Horovod's fusion schedule, published figures as
efficiency, and rates printed in the model's unit."""

from __future__ import annotations

import argparse

import numpy as np
import pytest

from flashsgd.sim import cli, plan_cli
from flashsgd.sim.cluster_file import load_cluster_text
from flashsgd.sim.compute_rates import MFU, PEAK_TFLOPS, RATES, derived
from flashsgd.sim.engine import SimConfig, fusion_cycles, simulate
from flashsgd.sim.link_kinds import check_link
from flashsgd.sim.network import CLUSTERS
from flashsgd.sim.published import to_efficiency
from flashsgd.sim.workload import get_workload


def _run(module, *argv):
    p = argparse.ArgumentParser()
    module.add_arguments(p)
    return module.run(p.parse_args(list(argv)))


def test_simulate_bert_large_on_dgx_h100_needs_no_rate_and_prints_sequences(capsys):
    assert _run(cli, "--cluster", "dgx-h100", "--gpus", "64", "--model", "bert-large", "--batch-per-gpu", "8",
                "--precision", "fp16") == 0
    out = capsys.readouterr().out
    assert ("compute rate: 1149 sequences/s/GPU [689.1-1493] (ASSUMPTION [ratio transfer]: the A100 row "
            "(NVIDIA's BERT README) x 1.98") in out
    assert "schedule: overlapped with backward" in out and "sequences/s [" in out and "images/s" not in out


def test_a_pair_nobody_published_gets_a_rate_derived_from_the_peak(capsys):
    assert _run(cli, "--cluster", "dgx-h100", "--gpus", "16", "--model", "bert-base", "--batch-per-gpu", "32",
                "--precision", "fp16") == 0
    assert "sequences/s/GPU [" in (out := capsys.readouterr().out) and "ASSUMPTION [unverified]: derived, 40%" in out


def test_cited_rates_name_their_source_and_bound_the_derivation():
    """GPT-2 on H100 (llm.c) sits inside the 25-55%-of-peak range: the derivation holds there; ViT-B/16
    (NVIDIA's JAX figures, 16% and 30% of the peak) falls below it on the H100, so a cited rate, not
    the derivation, is what a ViT prediction must use."""
    for key in ("h100/gpt2/fp16", "h100/gpt2-medium/fp16", "a100/gpt2/fp16", "a100/gpt2-medium/fp16",
                "a100/vit-b16/fp16", "h100/vit-b16/fp16", "h100/bert-large/fp16"):
        r = RATES[key]
        assert r.source and r.low < r.rate < r.high, key
    gpt2 = get_workload("gpt2")
    _, lo, hi = derived("h100", "fp16", gpt2.forward_flops)
    assert lo <= RATES["h100/gpt2/fp16"].rate <= hi
    _, lo, _ = derived("h100", "fp16", get_workload("vit-b16").forward_flops)
    assert RATES["h100/vit-b16/fp16"].high < lo


@pytest.mark.parametrize("model, unit", [("gpt2-medium", "sequences"), ("vit-b16", "images")])
def test_the_other_transformers_run_without_a_rate(model, unit, capsys):
    assert _run(cli, "--cluster", "dgx-h100", "--gpus", "64", "--model", model, "--batch-per-gpu", "8",
                "--precision", "fp16") == 0
    assert f"{unit}/s/GPU" in capsys.readouterr().out


def test_plan_names_the_published_rate_it_used(capsys):
    assert _run(plan_cli, "--cluster", "dgx-a100", "--gpus", "8", "--model", "bert-large", "--batch-per-gpu", "256",
                "--precision", "fp16", "--top", "1") == 0
    out = capsys.readouterr().out
    assert "compute rate: 580 sequences/s/GPU [348-609] (NVIDIA DeepLearningExamples PyTorch BERT README" in out
    assert "measured at batch 256)" in out and "compute (fp16) 580 sequences/s (348-609)" in out


def test_the_old_rate_flag_still_works_and_the_new_one_is_the_same(capsys):
    for flag in ("--images-per-s", "--samples-per-s"):
        assert _run(cli, "--cluster", "abci", "--gpus", "8", "--model", "resnet50", flag, "900") == 0
        out = capsys.readouterr().out
        assert "900 images/s/GPU" in out and "given by --samples-per-s" in out


def test_published_rates_sit_inside_the_derived_range():
    """The MFU range holds the cited A100 BERT-large rates (a check of the assumption, not a fit)."""
    w = get_workload("bert-large")
    for prec in ("fp16", "fp32"):
        rate, lo, hi = derived("a100", prec, w.forward_flops)
        assert lo <= RATES[f"a100/bert-large/{prec}"].rate <= hi
    assert MFU[1] < MFU[0] < MFU[2] and set(PEAK_TFLOPS) >= {"h100", "a100", "v100"}


def test_dgx_a100_preset():
    c = CLUSTERS.get("dgx-a100")
    assert (c.ranks_per_node, c.intra.bandwidth_gbps, round(c.inter.bandwidth_gbps), c.device) == (8, 300.0, 192, "a100")
    assert c.assumed["intra.bandwidth_gbps"] == (240.0, 300.0) and c.assumed["inter.bandwidth_gbps"] == (150.0, 200.0)
    assert c.resnet50_images_per_s == {"fp16": 2470.0, "fp32": 938.0}


TOML = """name = "box"
ranks_per_node = 8
[intra]
bandwidth_gbit = {intra}
latency_us = 3.4
kind = "{kind}"
[inter]
bandwidth_gbit = 100
latency_us = 20
kind = "ethernet-100g"
{flow}
"""


def test_a_300_on_nvlink3_warns_of_the_unit_mix_up():
    c = load_cluster_text(TOML.format(intra=300, kind="nvlink3", flow=""), "f")
    assert any("likely GB/s written where the file wants Gbit/s (x8): 2400" in w for w in c.warnings)
    assert any("without a per-flow limit" in w for w in c.warnings)
    ok = load_cluster_text(TOML.format(intra=2400, kind="nvlink3", flow="flow_bandwidth_gbit = 10"), "f")
    assert ok.warnings == ()


def test_nvlink2s_marketed_total_is_named_even_inside_the_range():
    (w,) = check_link("intra", "nvlink2", 300.0)
    assert "marketed 300 GB/s total" in w and "1200" in w
    (w,) = check_link("inter", "ib-hdr", 200.0, nics=8)  # 8 HDR ports' 1600 Gbit/s written as 200 GB/s
    assert "(x8): 1600" in w


def test_wrong_level_and_unknown_kind_are_errors_naming_the_valid_ones():
    with pytest.raises(ValueError, match=r"put it under \[inter\]"):
        check_link("intra", "ib-ndr", 400.0)
    with pytest.raises(ValueError, match="intra.kind must be one of nvlink1"):
        load_cluster_text(TOML.format(intra=300, kind="nvlink9", flow=""), "f")


def test_errors_name_the_unit():
    with pytest.raises(ValueError, match=r"\(unit: Gbit/s per direction"):
        load_cluster_text(TOML.format(intra=-1, kind="nvlink3", flow=""), "f")


def test_fusion_cycles_cap_without_waiting():
    ends, when = fusion_cycles(np.array([0.2e-3, 0.4e-3, 1.1e-3, 1.2e-3]), np.array([2 ** 18] * 4), 4, 64.0, 1e-3)
    assert ends.tolist() == [2, 4] and np.allclose(when, [1e-3, 2e-3])
    ends, _ = fusion_cycles(np.array([0.2e-3] * 4), np.array([2 ** 18] * 4), 4, 1.5, 1e-3)  # 1 MiB each, cap 1.5
    assert ends.tolist() == [1, 2, 3, 4]


def test_horovods_fp16_is_no_worse_than_fp32():
    """A 64 MiB DDP bucket swallows fp16 ResNet-50 whole (no overlap); Horovod's threshold only caps."""
    c = CLUSTERS.get("abci")
    w = get_workload("resnet50")
    eff = {p: simulate(w, c, SimConfig("native", 128, 200.0, batch_per_gpu=64, precision=p, bucket_mb=64.0,
                                       schedule="horovod")).efficiency for p in ("fp16", "fp32")}
    assert eff["fp16"] >= eff["fp32"]


def test_published_figures_as_efficiency(capsys):
    assert to_efficiency("weak-scaling", 7.91, 8) == pytest.approx(0.98875)
    assert to_efficiency("speedup", 30.37, 256, base_gpus=8) == pytest.approx(0.9490625)
    assert to_efficiency("weak-scaling-percent", 95, 64) == 0.95
    with pytest.raises(ValueError, match="--samples-per-s"):
        to_efficiency("throughput", 4591, 8)
    assert _run(cli, "--to-efficiency", "throughput", "4591", "--gpus", "8", "--samples-per-s", "580") == 0
    assert "scaling efficiency 98.94%" in capsys.readouterr().out


_NODE = """
name = "lab"
ranks_per_node = 8
{top}
[intra]
bandwidth_gbit = 2400.0
latency_us = 3.4
[inter]
bandwidth_gbit = 1600.0
latency_us = 14.0
{costs}
"""


def _file(top="", costs=""):
    return load_cluster_text(_NODE.format(top=top, costs=costs), "lab.toml")


def test_a_cluster_file_names_its_gpu_and_gets_the_presets_costs_for_it():
    from flashsgd.sim.network import device_fields, device_ranges
    c = _file('device = "a100"')
    a100 = device_fields("a100")
    assert c.device == "a100" and c.selection == a100["selection"] == "exact"
    for field in ("gamma_s_per_byte", "select_s_per_elem", "exchange_fixed_s", "lowrank_s_per_elem", "flop_s"):
        assert getattr(c, field) == a100[field], field
    for field, bounds in device_ranges("a100").items():
        assert c.assumed[field] == bounds, field
    assert _file('device = "a100"\nselection = "sampled"').selection == "sampled"
    assert _file().device == ""  # none named: the V100-class defaults, no device


def test_the_files_own_costs_win_over_the_devices():
    from flashsgd.sim.network import device_fields
    c = _file('device = "a100"', "[costs]\nselect_ns_per_elem = 0.2\nexchange_fixed_us = 300.0\n"
              "exchange_fixed_us_range = [100.0, 900.0]")
    assert c.select_s_per_elem == pytest.approx(0.2e-9) and "select_s_per_elem" not in c.assumed  # measured
    assert c.exchange_fixed_s == pytest.approx(300e-6)
    assert c.assumed["exchange_fixed_s"] == pytest.approx((100e-6, 900e-6))
    assert c.gamma_s_per_byte == device_fields("a100")["gamma_s_per_byte"]  # not given: the device's


def test_device_selection_and_backend_are_checked_with_the_valid_names():
    with pytest.raises(ValueError, match=r"lab.toml: device must be one of h100, a100, v100.*got 'a10'"):
        _file('device = "a10"')
    with pytest.raises(ValueError, match="selection needs device"):
        _file('selection = "exact"')
    with pytest.raises(ValueError, match="selection must be one of auto, exact, sampled, threshold, got 'top'"):
        _file('device = "h100"\nselection = "top"')
    with pytest.raises(ValueError, match="backend must be one of nccl, gloo .*got 'mpi'"):
        _file('backend = "mpi"')
    assert _file('backend = "gloo"').backend == "gloo" and _file().backend == "nccl"


def test_a_file_that_names_its_gpu_gets_the_published_rate_without_device(tmp_path, capsys):
    path = tmp_path / "lab.toml"
    path.write_text(_NODE.format(top='device = "a100"', costs=""))
    assert _run(plan_cli, "--cluster", str(path), "--gpus", "16", "--model", "bert-large", "--batch-per-gpu", "256",
                "--precision", "fp16", "--top", "1") == 0
    out = capsys.readouterr().out
    assert "compute rate: 580 sequences/s/GPU [348-609] (NVIDIA DeepLearningExamples PyTorch BERT README" in out
    assert "native on NCCL (ring or tree)" in out


def test_device_and_backend_survive_a_round_trip():
    from flashsgd.sim.cluster_file import to_toml
    c = _file('device = "h100"\nbackend = "gloo"')
    back = load_cluster_text(to_toml(c), "round trip")
    assert (back.device, back.selection, back.backend) == (c.device, c.selection, "gloo")
    assert back.select_s_per_elem == pytest.approx(c.select_s_per_elem)


def test_plan_device_overrides_the_files_device():
    from flashsgd.sim.plan_cli import device_cluster
    c = device_cluster(_file('device = "a100"'), "h100", None)
    assert (c.device, c.selection) == ("h100", "exact")
    assert device_cluster(_file('device = "a100"'), None, None).device == "a100"


def test_simulate_takes_the_rate_from_the_files_device_and_names_the_key_when_there_is_none(tmp_path, capsys):
    path = tmp_path / "lab.toml"
    argv = ("--cluster", str(path), "--gpus", "16", "--model", "bert-large", "--batch-per-gpu", "256",
            "--precision", "fp16")
    path.write_text(_NODE.format(top='device = "a100"', costs=""))
    assert _run(cli, *argv) == 0
    assert "compute rate: 580 sequences/s/GPU [348-609] (NVIDIA DeepLearningExamples" in capsys.readouterr().out
    path.write_text(_NODE.format(top="", costs=""))
    with pytest.raises(ValueError, match=r"names no device class \(a preset does; a cluster file: "
                                         r"device = \"NAME\", h100, a100, v100"):
        _run(cli, *argv)


def test_plan_selection_alone_keeps_the_files_device():
    from flashsgd.sim.network import device_fields
    from flashsgd.sim.plan_cli import device_cluster
    c = device_cluster(_file('device = "a100"'), None, "sampled")
    assert (c.device, c.selection) == ("a100", "sampled")
    assert c.select_s_per_elem == device_fields("a100", "sampled")["select_s_per_elem"]


@pytest.mark.parametrize("name, device", [("dgxa100", "a100"), ("dgx1-v100", "v100"), ("dgx2-v100", "v100"),
                                          ("dell-c4140-v100pcie-edr", "v100")])
def test_the_published_clusters_name_their_gpu_and_keep_their_stated_costs(name, device):
    import tomllib
    from pathlib import Path

    from flashsgd.sim.cluster_file import load_cluster
    from flashsgd.sim.network import device_fields, device_ranges
    path = Path(__file__).resolve().parents[1] / "docs" / "data" / "published" / f"{name}.toml"
    costs = tomllib.loads(path.read_text())["costs"]
    c = load_cluster(str(path))
    assert c.device == device
    ours = device_fields(device)
    assert c.gamma_s_per_byte == pytest.approx(costs["reduce_ns_per_byte"] * 1e-9)  # stated: the file's
    assert c.gamma_s_per_byte != ours["gamma_s_per_byte"] and "gamma_s_per_byte" not in c.assumed
    assert c.select_s_per_elem == ours["select_s_per_elem"]  # not stated: the device's, and its range
    assert c.assumed["select_s_per_elem"] == device_ranges(device)["select_s_per_elem"]
