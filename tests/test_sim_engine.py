"""Workloads (ResNet-50 arithmetic, any nn.Module) and the iteration engine's invariants."""

import importlib
from dataclasses import replace

import numpy as np
import pytest
import torch

from flashsgd.sim.algorithms import SIMULATED, exchange_cost
from flashsgd.sim.costs import CommSetup
from flashsgd.sim.engine import SimConfig, bucket_bounds, simulate, sweep
from flashsgd.sim.network import CLUSTERS
from flashsgd.sim.workload import from_module, get_workload, resnet50, vgg16
from sim_helpers import exchange_only

ABCI = CLUSTERS.get("abci")


def test_resnet50_workload_has_161_tensors_and_25557032_params():
    w = resnet50()
    assert (w.num_tensors, w.num_params) == (161, 25_557_032)
    # backward order: the classifier's gradients are ready first, the stem's last
    assert w.tensor_names[:2] == ("fc.bias", "fc.weight") and w.tensor_names[-1] == "conv1.weight"
    assert w.numels[1] == 2048 * 1000
    assert w.backward_share.sum() == pytest.approx(1.0)


def test_vgg16_workload_matches_known_parameter_count():
    assert (vgg16().num_tensors, vgg16().num_params) == (32, 138_357_544)


def _gtopk_paper_vgg16():
    """The CIFAR-10 VGG-16 of Shi et al.'s code (hclhkbu/gtopkssgd, models/vgg.py), rebuilt here."""
    layers, cin = [], 3
    for v in (64, 64, "M", 128, 128, "M", 256, 256, 256, "M", 512, 512, 512, "M", 512, 512, 512, "M"):
        if v == "M":
            layers.append(torch.nn.MaxPool2d(2, 2))
        else:
            layers += [torch.nn.Conv2d(cin, v, 3, padding=1), torch.nn.BatchNorm2d(v), torch.nn.ReLU()]
            cin = v
    net = torch.nn.Module()
    net.features, net.fc = torch.nn.Sequential(*layers), torch.nn.Linear(512, 10)
    return net


def test_cifar10_workloads_of_the_gtopk_paper_match_their_models():
    vgg, res = get_workload("vgg16-cifar10"), get_workload("resnet20")
    assert (vgg.num_tensors, vgg.num_params) == (54, 14_728_266)
    assert (res.num_tensors, res.num_params) == (59, 269_722)
    ref = from_module(_gtopk_paper_vgg16())
    assert ref.tensor_names == vgg.tensor_names and ref.numels.tolist() == vgg.numels.tolist()
    assert ref.matrices.tolist() == vgg.matrices.tolist()
    from flashsgd.train.models import resnet20 as train_resnet20
    ref = from_module(train_resnet20())
    assert ref.tensor_names == res.tensor_names and ref.numels.tolist() == res.numels.tolist()
    # FLOP shares: a 3x3 conv of the last stage (64 ch at 8x8) costs as much as one of the first
    # (16 ch at 32x32): 2 x 64 x 64 x 9 x 64 = 2 x 16 x 16 x 9 x 1024
    share = dict(zip(res.tensor_names, res.backward_share))
    assert share["blocks.8.conv2.weight"] == pytest.approx(share["blocks.0.conv2.weight"])
    assert share["fc.bias"] == 0.0


def test_from_module_walks_parameters_in_reverse_registration_order():
    m = torch.nn.Sequential(torch.nn.Linear(3, 5), torch.nn.ReLU(), torch.nn.Linear(5, 2, bias=False))
    m[0].bias.requires_grad_(False)
    w = from_module(m)
    assert w.tensor_names == ("2.weight", "0.weight")
    assert w.numels.tolist() == [10, 15]


def test_builtin_resnet50_agrees_with_train_models():
    try:
        models = importlib.import_module("flashsgd.train.models")
        factory = models.resnet50
    except (ImportError, AttributeError) as exc:
        pytest.skip(f"flashsgd.train.models.resnet50 not available yet ({exc})")
    w = from_module(factory())
    assert w.numels.tolist() == resnet50().numels.tolist()


def test_get_workload_errors_name_the_options():
    with pytest.raises(ValueError, match="unknown workload 'resnet5'.*package.module:factory"):
        get_workload("resnet5")
    with pytest.raises(ValueError, match="cannot load"):
        get_workload("torch.nn:NoSuchModel")


def test_module_without_parameters_is_rejected():
    with pytest.raises(ValueError, match="no trainable parameters"):
        get_workload("torch.nn:Identity")


def test_bucket_bounds_ddp_style_and_fixed_groups():
    numels = np.array([10, 10, 30, 5, 5, 40])  # fp32 bytes: 40, 40, 120, 20, 20, 160
    assert bucket_bounds(numels, 4, 100e-6, None).tolist() == [3, 6]  # close at >= 100 B
    assert bucket_bounds(numels, 4, 1e-9, None).tolist() == [1, 2, 3, 4, 5, 6]
    assert bucket_bounds(numels, 4, 1.0, None).tolist() == [6]
    assert bucket_bounds(numels, 4, 1.0, (1, 2, 3)).tolist() == [1, 3, 6]
    with pytest.raises(ValueError, match="sum to 5, need 6"):
        bucket_bounds(numels, 4, 1.0, (1, 4))
    assert simulate(resnet50(), ABCI, SimConfig("ring", 64, 1200.0, groups=(3, 21, 57, 80))).buckets == 4


@pytest.mark.parametrize("algo", SIMULATED.names())
def test_engine_invariants(algo):
    w = resnet50()
    for gpus in (1, 4, 64, 1024):
        for schedule in ("overlap", "after_backward"):
            r = simulate(w, ABCI, SimConfig(algo, gpus, 1200.0, precision="fp16", schedule=schedule))
            assert r.iteration_s >= r.compute_s
            assert r.exposed_comm_s >= 0
            assert 0 < r.efficiency <= 1
            assert r.images_per_s == pytest.approx(gpus * 32 / r.iteration_s)
            assert r.exposed_comm_s <= r.comm_s + 1e-12
        if gpus == 1:
            assert r.efficiency == 1.0 and r.comm_s == 0.0


def test_one_bucket_without_overlap_is_compute_plus_full_communication():
    w = resnet50()
    cfg = SimConfig("torus2d", 256, 1200.0, precision="fp16", bucket_mb=1e6, schedule="after_backward")
    r = simulate(w, exchange_only(ABCI), cfg)
    full = float(exchange_cost("torus2d", w.num_params * 2.0, CommSetup(256, ABCI, value_bytes=2)).total)
    assert r.buckets == 1
    assert r.iteration_s == pytest.approx(r.compute_s + full, rel=1e-12)


def test_overlap_never_hurts_and_hides_communication():
    w = resnet50()
    cfg = SimConfig("hierarchical", 256, 370.0, precision="fp32", bucket_mb=5.0)
    on, off = simulate(w, ABCI, cfg), simulate(w, ABCI, replace(cfg, schedule="after_backward"))
    assert on.iteration_s < off.iteration_s
    assert off.exposed_comm_s == pytest.approx(off.comm_s)


def test_sweep_covers_every_pair_and_bad_config_is_rejected():
    rs = sweep(resnet50(), ABCI, SimConfig("ring", 1, 1200.0, grid=(4, 16)), ["ring", "torus2d"], [8, 64])
    assert [(r.algorithm, r.gpus) for r in rs] == [("ring", 8), ("ring", 64), ("torus2d", 8), ("torus2d", 64)]
    with pytest.raises(ValueError, match="images_per_s"):
        SimConfig("ring", 8, 0.0)
    with pytest.raises(ValueError, match="precision"):
        SimConfig("ring", 8, 100.0, precision="bf8")
    with pytest.raises(ValueError, match="grid 4x200 does not match gpus=1024"):
        simulate(resnet50(), ABCI, SimConfig("torus2d", 1024, 1200.0, grid=(4, 200)))


def test_grad_accum_exchanges_once_after_the_last_micro_batch():
    """Two tensors of 1000 fp32, one bucket each, backward shares 1:1, T1 = 1 s (forward 1/3). A
    2-rank ring with alpha 0.1 s takes d ~ 0.2 s per bucket. N = 1: ready at 2/3 and 1 s, the
    second exchange ends at max(1, 2/3 + d) + d. N = 2: micro-batches of 0.5 s, the last one's
    backward (1/3 s) runs from 2/3: ready at 5/6 and 1 s, end max(1, 5/6 + d) + d."""
    from flashsgd.sim.network import ClusterModel, Link
    from flashsgd.sim.workload import Workload

    w = Workload("two", np.array([1000, 1000]), np.array([1.0, 1.0]))
    slow = ClusterModel("slow", 1, Link(0.1, 1.0), Link(0.1, 1.0))
    d = float(exchange_cost("ring", 4000.0, CommSetup(2, slow)).total)
    assert 0.2 < d < 0.21
    cfg = SimConfig("ring", 2, 4.0, batch_per_gpu=4, bucket_mb=1e-6)
    one, two = simulate(w, slow, cfg), simulate(w, slow, replace(cfg, grad_accum=2))
    assert one.iteration_s == pytest.approx(max(1.0, 2 / 3 + d) + d, rel=1e-12)
    assert two.iteration_s == pytest.approx(max(1.0, 5 / 6 + d) + d, rel=1e-12)
    assert (one.comm_s, one.buckets) == (two.comm_s, two.buckets) == (2 * d, 2)  # one exchange per step
    after = simulate(w, slow, replace(cfg, grad_accum=2, schedule="after_backward"))
    assert after.iteration_s == pytest.approx(1.0 + 2 * d, rel=1e-12)
    assert (two.grad_accum, after.schedule) == (2, "after_backward")


def test_grad_accum_at_the_same_micro_batch_amortises_the_exchange():
    """ResNet-50 on 1 GbE, 32 GPUs, micro-batch 32: N micro-batches per exchange make T1 N-fold and
    leave the exchange as it was, so with one bucket after backward the step is N T1 + c exactly."""
    w, gbe = resnet50(), exchange_only(CLUSTERS.get("1gbe"))
    full = float(exchange_cost("native", w.num_params * 4.0, CommSetup(32, gbe)).total)
    effs = []
    for n in (1, 2, 4, 8):
        r = simulate(w, gbe, SimConfig("native", 32, 200.0, batch_per_gpu=32 * n, grad_accum=n,
                                       bucket_mb=1e6, schedule="after_backward"))
        assert r.compute_s == pytest.approx(0.16 * n) and r.iteration_s == pytest.approx(0.16 * n + full, rel=1e-12)
        effs.append(r.efficiency)
    assert effs == sorted(effs) and effs[-1] > 4 * effs[0]
    with pytest.raises(ValueError, match=r"grad_accum must be an int in \[1, batch_per_gpu=32\]"):
        SimConfig("ring", 8, 100.0, grad_accum=33)
    with pytest.raises(ValueError, match="schedule must be one of overlap, after_backward"):
        SimConfig("ring", 8, 100.0, schedule="later")


def test_the_trainer_schedule_follows_the_catalog_threaded_option():
    from flashsgd.exchanges import EXCHANGES, names
    from flashsgd.sim.workload import trainer_schedule

    for name in names():
        fields = EXCHANGES.get(name).options.__dataclass_fields__
        threaded = fields["threaded"].default if "threaded" in fields else True
        assert trainer_schedule(name) == ("overlap" if threaded else "after_backward")
    assert [trainer_schedule(n) for n in ("native", "torus2d", "gtopk", "hgtopk", "powersgd")] == \
        ["overlap", "overlap", "after_backward", "after_backward", "overlap"]
    assert trainer_schedule("gtopk", threaded=True) == "overlap"
    assert trainer_schedule("ring", threaded=False) == "after_backward"
    with pytest.raises(ValueError, match="'gtopk_tree' is simulator-only"):
        trainer_schedule("gtopk_tree")


def test_stragglers_and_step_overhead_grow_the_step_with_scale_and_spare_one_gpu():
    """Issue 35: a synchronous step waits for the slowest of P ranks (the expected maximum of P
    normal compute times, Blom's formula) and pays the per-step overhead; one GPU pays neither."""
    from dataclasses import replace
    from flashsgd.sim.engine import expected_max_normal, straggler_factor

    assert straggler_factor(1, 0.05) == 1.0 and straggler_factor(64, 0.0) == 1.0
    assert straggler_factor(2, 1.0) == pytest.approx(1 + 1 / np.sqrt(np.pi), abs=1e-6)  # E[max of 2] = 1/sqrt(pi)
    e = [straggler_factor(p, 0.01) - 1 for p in (2, 32, 1024, 4096)]
    assert e == sorted(e) and e[2] == pytest.approx(0.01 * expected_max_normal(1024))
    # E[max of 3] = 3 / (2 sqrt(pi)) exactly; E[max of 5] = 1.16296 (tables)
    assert (expected_max_normal(3), expected_max_normal(5)) == (pytest.approx(0.846284, abs=1e-5),
                                                                pytest.approx(1.162964, abs=1e-5))
    base = exchange_only(CLUSTERS.get("abci"))
    shaky = replace(base, jitter_cv=0.01, step_overhead_s=1e-3)
    cfg = SimConfig("native", 1024, 370.0)
    calm, slow = simulate(resnet50(), base, cfg), simulate(resnet50(), shaky, cfg)
    assert slow.straggler_s == pytest.approx(calm.compute_s * (straggler_factor(1024, 0.01) - 1))
    for r in (calm, slow):  # the parts add up (the stretched backward hides more of the exchange)
        assert r.iteration_s == pytest.approx(r.compute_s + r.straggler_s + r.exposed_comm_s + r.step_overhead_s)
    assert slow.step_overhead_s == 1e-3 and slow.iteration_s > calm.iteration_s + 1e-3
    assert slow.compute_s == calm.compute_s and slow.efficiency < calm.efficiency
    one = simulate(resnet50(), shaky, replace(cfg, gpus=1))
    assert one.straggler_s == one.step_overhead_s == 0.0 and one.efficiency == pytest.approx(1.0)


def test_a_cluster_file_states_the_step_costs_and_defaults_to_their_ranges():
    from flashsgd.sim.cluster_file import load_cluster_text, to_toml
    from flashsgd.sim.network import STEP_RANGES
    from sim_helpers import LAB

    given = load_cluster_text(LAB + "[costs]\nstep_overhead_us = 250.0\njitter_percent = 2.5\n", "lab")
    assert (given.step_overhead_s, given.jitter_cv) == (pytest.approx(250e-6), pytest.approx(0.025))
    assert "step_overhead_s" not in given.assumed and "jitter_cv" not in given.assumed  # given: measured
    default = load_cluster_text(LAB, "lab")
    assert (default.step_overhead_s, default.jitter_cv) == (0.0, pytest.approx(0.015))  # STEP_STATED
    assert {k: default.assumed[k] for k in STEP_RANGES} == STEP_RANGES  # not given: the presets' ranges
    back = load_cluster_text(to_toml(default), "round trip")
    for k, bounds in STEP_RANGES.items():
        assert back.assumed[k] == pytest.approx(bounds)
    with pytest.raises(ValueError, match=r"lab: costs.jitter_percent must be a finite number >= 0 and <= 99"):
        load_cluster_text(LAB + "[costs]\njitter_percent = 150.0\n", "lab")
