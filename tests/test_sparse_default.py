"""The sparse exchanges' default density warm-up (issue 24): the rule, the user's override, and the
message for a run too short even with it. Plan-level only (no process starts): fast.

The rule is :class:`flashsgd.exchanges.DensityWarmup` (DGC's 0.25 -> density over
min(4 epochs, half the run)); measured in docs/sparse_accuracy.md ("The default warm-up").
"""

from __future__ import annotations

import json

import pytest

from flashsgd import exchanges as X
from flashsgd.train import config as C
from flashsgd.train.plan import build_plan

# the 1000-step goyal run of issue 24: 4 workers, global batch 256, 8 epochs of 32,000 samples
GOYAL_1000 = {"recipe": "goyal", "global_batch": 256, "epochs": 8.0, "workers": 4}
NUM_TRAIN = 32000


def plan_of(**cli):
    return build_plan(C.resolve(cli=cli), world=4, num_train=NUM_TRAIN, local_spawn=True, backend="gloo")


@pytest.mark.parametrize("algorithm", X.names("sparse"))
def test_the_plain_sparse_run_warms_up_by_default(algorithm):
    plan = plan_of(**GOYAL_1000, algorithm=algorithm, density=0.001)
    assert plan.total_steps == 1000 and plan.first_epoch_steps == 125
    # min(4 epochs = 500 steps, half of 1000 steps = 500)
    assert plan.hook_options["density_warmup"] == X.DENSITY_WARMUP_START == 0.25
    assert plan.hook_options["density_warmup_steps"] == 500
    warm = plan.density_warmup
    assert warm["default_length"] and warm["steps"] == 500 and warm["start"] == 0.25
    assert warm["coverage"] == pytest.approx(22.676, abs=1e-3) and warm["coverage"] >= X.MIN_COVERAGE
    assert plan.warnings == ()  # without the warm-up this run is warned (coverage 1.0)
    # visible where the run is described: the banner and plan.json, with the rule and its source
    assert "  warm-up     density 0.25 -> 0.001 (exponential) over 500 of 1000 steps = min(4 epochs, " \
           "0.5 x the run's steps), the default: DGC's warm-up scaled to the run (Lin et al. 2018" \
           in plan.describe()
    assert json.loads(json.dumps(plan.to_dict()))["density_warmup"]["rule"] == X.DensityWarmup().rule()


def test_the_default_length_scales_with_the_run():
    rule = X.DensityWarmup()
    # short runs: half the run; long runs: DGC's 4 epochs
    assert [rule.steps(total, 125) for total in (10, 600, 1000, 1250, 11250)] == [5, 300, 500, 500, 500]
    assert plan_of(**{**GOYAL_1000, "epochs": 6.0}, algorithm="gtopk").hook_options["density_warmup_steps"] == 375
    assert plan_of(**{**GOYAL_1000, "epochs": 90.0}, algorithm="gtopk").hook_options["density_warmup_steps"] == 500
    # the exponential decay of the default: DGC's 0.25, 0.063, 0.016, 0.004, 0.001 at epochs 0-4
    options = X.SparseOptions(density=0.001, **rule.options(0.001, 11250, 125))
    assert [round(options.density_at(125 * e), 4) for e in range(5)] == [0.25, 0.0629, 0.0158, 0.004, 0.001]
    # the derivation's closed form: W (s0 - d) / ln(s0 / d) per warm-up of W steps (0.045 W at 0.001)
    assert X.coverage(1000, options.__class__(density=0.001, **rule.options(0.001, 1000, 125))) == \
        pytest.approx(500 * (0.25 - 0.001) / __import__("math").log(250) + 500 * 0.001, rel=0.02)


def test_a_dense_run_is_unchanged():
    plan = plan_of(timeout_s=30)
    assert plan.config.comm.algorithm == "torus2d"
    assert plan.hook_options == {"ranks_per_node": 2, "grid": None, "timeout_s": 30.0}
    assert plan.density_warmup == {} and "warm-up" not in plan.describe()
    assert plan.to_dict()["density_warmup"] == {}


@pytest.mark.parametrize("given, start, steps", [
    ({"density_warmup": 0}, None, 0),                              # off
    ({"density_warmup": "none"}, None, 0),                         # off, as the command line says it
    ({"density_warmup_epochs": 0}, None, 0),                       # off by its length
    ({"density_warmup_epochs": 1}, 0.25, 125),                     # the user's length, DGC's start
    ({"density_warmup": 0.5}, 0.5, 500),                           # the user's start, the rule's length
    ({"density_warmup": 1.0, "density_warmup_epochs": 2.0}, 1.0, 250),
])
def test_an_explicit_setting_wins(given, start, steps):
    plan = plan_of(**GOYAL_1000, algorithm="gtopk", density=0.001, **given)
    assert plan.hook_options.get("density_warmup") == start
    assert plan.hook_options.get("density_warmup_steps", 0) == steps
    assert plan.density_warmup["steps"] == steps
    assert plan.density_warmup["default_length"] == (steps > 0 and "density_warmup_epochs" not in given)
    if not steps:
        assert "warm-up     none: off" in plan.describe()
        assert len(plan.warnings) == 1 and "no density warm-up" in plan.warnings[0]


def test_off_survives_the_written_config():
    cfg = C.resolve(cli={**GOYAL_1000, "algorithm": "gtopk", "density_warmup": "none"})
    assert cfg.comm.density_warmup == 0.0  # TOML has no null: `none` is written as 0
    again = C.resolve(toml_text=C.dumps(cfg))
    assert again.comm.density_warmup == 0.0 and again.comm.density_warmup_epochs is None
    default = C.resolve(toml_text=C.dumps(C.resolve(cli={"algorithm": "gtopk"})))
    assert default.comm.density_warmup == 0.25 and default.comm.density_warmup_epochs is None


def test_bad_warmups_name_what_is_valid():
    with pytest.raises(ValueError, match=r"comm.density_warmup must be in \[comm.density, 1\] = \[0.1, 1\] "
                                         r"or 0 \(no warm-up\), got 0.05"):
        C.resolve(cli={"algorithm": "gtopk", "density": 0.1, "density_warmup": 0.05})
    with pytest.raises(ValueError, match="comm.density_warmup_epochs must be >= 0"):
        C.resolve(cli={"algorithm": "gtopk", "density_warmup_epochs": -1})
    with pytest.raises(ValueError, match="longer than the run"):
        plan_of(**GOYAL_1000, algorithm="gtopk", density_warmup_epochs=9)
    with pytest.raises(ValueError, match="density warm-up start"):
        X.DensityWarmup(start=1.5)
    with pytest.raises(ValueError, match="density warm-up epochs must be >= 0"):
        X.DensityWarmup(epochs=-2)
    # the default start under a higher density is no warm-up, and no error
    plan = plan_of(**GOYAL_1000, algorithm="topk", density=0.5)
    assert "density_warmup" not in plan.hook_options and plan.warnings == ()
    assert "none (its start 0.25 is not above the density 0.5)" in plan.describe()


def test_a_run_too_short_even_with_the_warm_up_says_what_would_work():
    plan = plan_of(algorithm="gtopk")  # the default run: 120 steps of 4096, default density 0.001
    assert plan.total_steps == 120 and plan.hook_options["density_warmup_steps"] == 32  # 4 epochs < half
    (warning,) = plan.warnings
    assert "at most 1.2 times" in warning and "density warm-up 0.25 -> 0.001 over 32 steps" in warning
    assert warning.endswith("for >= 20: --density >= 0.16, or --epochs >= 2366 at density 0.001 (about "
                            "18922 steps), each with this warm-up rule")
    # what it names works, and is the least that does (density to 2 significant digits)
    assert plan_of(algorithm="gtopk", density=0.16).warnings == ()
    assert len(plan_of(algorithm="gtopk", density=0.15).warnings) == 1
    assert plan_of(algorithm="gtopk", epochs=2366.0).warnings == ()
    assert len(plan_of(algorithm="gtopk", epochs=2365.0).warnings) == 1
    # without a warm-up the remedy is computed without one
    (off,) = plan_of(**GOYAL_1000, algorithm="gtopk", density_warmup=0).warnings
    assert off.endswith("for >= 20: --density >= 0.021, or --epochs >= 161 at density 0.001 (about "
                        "20002 steps)")
    # a run too short for any density says so
    (tiny,) = plan_of(algorithm="gtopk", num_samples=40000, global_batch=4096, epochs=2.0).warnings
    assert "no density is enough in 16 steps" in tiny


def test_comm_auto_choices_keep_their_own_warm_up():
    plan = plan_of(**GOYAL_1000)
    chosen = plan.with_comm(algorithm="gtopk", density=0.01, density_warmup=0.25, density_warmup_epochs=3.2)
    assert chosen.hook_options["density_warmup_steps"] == 400 and not chosen.density_warmup["default_length"]
    risky = plan.with_comm(algorithm="gtopk", density=0.01, density_warmup=None)  # accuracy_risk any
    assert "density_warmup" not in risky.hook_options and risky.density_warmup["steps"] == 0


def test_remedy_searches_are_exact():
    rule = X.DensityWarmup()

    def at_density(d):
        return X.SparseOptions(density=d, **rule.options(d, 120, 8))

    d = X.density_for_coverage(120, at_density)
    assert d == 0.16 and X.coverage(120, at_density(0.16)) >= X.MIN_COVERAGE > X.coverage(120, at_density(0.15))
    assert X.density_for_coverage(15, at_density) is None  # 13 sparse steps cannot send anything 20 times

    def at_steps(n):
        return X.SparseOptions(density=0.01, **rule.options(0.01, n, 8))

    n = X.steps_to_coverage(at_steps, 120)
    assert X.coverage(n, at_steps(n)) >= X.MIN_COVERAGE > X.coverage(n - 1, at_steps(n - 1))
    assert X.steps_to_coverage(at_steps, 5000) == 5000  # already enough
