"""``[comm]``'s exchange options are generated from the catalog (flashsgd.exchanges): every option is
a key, a flag and a hook option, with the catalog's type, default, choices and help."""

import dataclasses

import pytest

from flashsgd import exchanges as X
from flashsgd.train import config as C
from flashsgd.train.plan import build_plan


def _catalog_options() -> set[str]:
    """Every field of every options class in the catalog (walked here, not through the helpers)."""
    return {f.name for e in X.EXCHANGES.values() for f in dataclasses.fields(e.options)}


def _plan(cfg, world=4):
    return build_plan(cfg, world=world, num_train=32000, local_spawn=True, backend="gloo")


def _train_args(*flags):
    from flashsgd.cli import build_parser
    from flashsgd.train.cli import parse_config

    return parse_config(build_parser().parse_args(["train", *flags]))


def test_every_catalog_option_is_reachable_from_the_train_config():
    comm = {f.name for f in dataclasses.fields(C.CommConfig)}
    index = C.field_index()
    for name in _catalog_options():
        if name in comm:
            continue
        # the rest the plan derives, each from another section's key of the same name (a [comm] key
        # could not have it: flat names are unique, each is also a flag)
        assert name in C.DERIVED_OPTIONS, f"exchange option {name!r} has no [comm] key"
        section, key = C.DERIVED_OPTIONS[name].split(".")
        assert key == name and index[key][0] == section != "comm"
    assert set(C.DERIVED_OPTIONS) == _catalog_options() - comm


def test_generated_fields_are_the_catalog_union_minus_the_derived_and_hand_written():
    fields = {f.name: f for f in dataclasses.fields(C.CommConfig)}
    hand = {n for n, f in fields.items() if not f.metadata.get("exchange_option")}
    assert set(C.COMM_OPTION_KEYS) == _catalog_options() - set(C.DERIVED_OPTIONS) - hand
    assert {"threaded", "start_iter", "compiled", "density_warmup_mode", "min_compression_rate",
            "density_warmup_steps", "density", "selection", "node_split"} <= set(C.COMM_OPTION_KEYS)
    docs = C.field_docs(C.CommConfig)
    for name in C.COMM_OPTION_KEYS:
        f = fields[name]
        defaults = {e.options.__dataclass_fields__[name].default for e in X.EXCHANGES.values()
                    if name in e.option_names()}
        if len(defaults) > 1 or name in C.UNSET_BY_PLAN:
            assert f.default is None, name  # unset: each exchange's own / derived by the plan
        else:
            assert f.default == defaults.pop(), name  # the catalog's, read
        assert X.option_doc(name) in docs[name], name  # the help is the catalog's docstring
        valid = X.OPTION_CHOICES.get(name)
        assert (f.metadata["choices"]() if "choices" in f.metadata else None) == (list(valid) if valid else None)
    dense, sparse = (", ".join(n for n in X.names(f) if "threaded" in X.EXCHANGES[n].option_names()
                               and X.EXCHANGES[n].defaults()["threaded"] is v) for f, v in (("dense", True), ("sparse", False)))
    assert f"{dense}: True; {sparse}: False" in docs["threaded"]


def test_an_options_field_added_to_the_catalog_becomes_a_config_field(monkeypatch):
    @dataclasses.dataclass(frozen=True)
    class ToyOptions(X.SparseOptions):
        toy_level: str = "low"
        """How toy the exchange is."""

    toy = X.Exchange("toyk", "sparse", ToyOptions, "a toy", "-", "-", "topk")
    monkeypatch.setitem(X.EXCHANGES._items, "toyk", toy)
    monkeypatch.setitem(X.OPTION_CHOICES, "toy_level", ("low", "high"))
    made = dataclasses.dataclass(C._with_exchange_options(type("Comm", (), {"__annotations__": {}})))
    field = {f.name: f for f in dataclasses.fields(made)}["toy_level"]
    assert field.default == "low" and field.metadata["choices"]() == ["low", "high"]
    assert field.metadata["doc"] == "toyk: How toy the exchange is."


@pytest.mark.parametrize("flags, expected", [
    (["--comm", "gtopk", "--threaded", "--start-iter", "5", "--compiled", "--density-warmup-mode", "linear"],
     {"threaded": True, "start_iter": 5, "compiled": True, "density_warmup_mode": "linear"}),
    (["--comm", "powersgd", "--min-compression-rate", "3", "--start-iter", "4"],
     {"min_compression_rate": 3.0, "start_iter": 4}),
    (["--comm", "torus2d", "--no-threaded"], {"threaded": False}),
    (["--comm", "hgtopk", "--node-split", "slices", "--threshold-every", "3", "--selection", "threshold"],
     {"node_split": "slices", "threshold_every": 3, "selection": "threshold"}),
])
def test_new_flags_arrive_in_the_plans_hook_options(flags, expected):
    plan = _plan(_train_args(*flags))
    assert {k: plan.hook_options.get(k) for k in expected} == expected
    options = X.EXCHANGES[plan.config.comm.algorithm].make_options(**{
        k: v for k, v in plan.hook_options.items() if X.EXCHANGES[plan.config.comm.algorithm].reads(k)})
    assert {k: getattr(options, k) for k in expected} == expected  # what the hook is built with
    assert all(f"'{k}': {v!r}" in plan.describe() for k, v in expected.items())  # the banner shows them


def test_toml_keys_of_the_new_options():
    cfg = C.resolve(toml_text='[comm]\nalgorithm = "gtopk"\nthreaded = true\nstart_iter = 3\n'
                              'density_warmup_mode = "linear"\ncompiled = true\n')
    assert (cfg.comm.threaded, cfg.comm.start_iter, cfg.comm.density_warmup_mode, cfg.comm.compiled) == \
        (True, 3, "linear", True)
    hook = _plan(cfg).hook_options
    assert hook["threaded"] is True and hook["start_iter"] == 3 and hook["compiled"] is True


def test_threaded_unset_keeps_each_exchanges_own_default():
    readers = X.option_readers("threaded")
    assert len(set(readers.values())) == 2  # dense True, sparse False: no one default
    for name, default in readers.items():
        plan = _plan(C.resolve(cli={"algorithm": name}))
        assert "threaded" not in plan.hook_options
        assert X.EXCHANGES[name].options_from(**plan.hook_options).threaded is default
        flipped = _plan(C.resolve(cli={"algorithm": name, "threaded": not default}))
        assert flipped.hook_options["threaded"] is (not default)


def test_default_runs_show_the_same_hook_options():
    # the banner and plan.json of the default run, and the switches left out at their defaults
    assert _plan(C.resolve()).hook_options == {"ranks_per_node": 2, "grid": None, "timeout_s": 300.0}
    gtopk = _plan(C.resolve(cli={"algorithm": "gtopk"}))
    assert list(gtopk.hook_options) == ["density", "selection", "seed", "timeout_s", "density_warmup",
                                        "density_warmup_steps"]
    assert _plan(C.resolve(cli={"algorithm": "powersgd"})).hook_options == {"seed": 0, "timeout_s": 300.0}
    # a switch set to its default is not shown either (the hook gets the same value)
    assert _plan(C.resolve(cli={"algorithm": "gtopk", "start_iter": 2})).hook_options == gtopk.hook_options


def test_density_warmup_steps_and_epochs_together_are_refused():
    with pytest.raises(ValueError, match=r"comm.density_warmup_epochs \(2\) and comm.density_warmup_steps "
                                         r"\(10\) both set"):
        C.resolve(cli={"algorithm": "gtopk", "density_warmup_epochs": 2.0, "density_warmup_steps": 10})
    with pytest.raises(ValueError, match="comm.density_warmup_epochs.*comm.density_warmup_steps"):
        C.resolve(toml_text="[comm]\ndensity_warmup_epochs = 0\ndensity_warmup_steps = 0\n")


def test_density_warmup_steps_set_replaces_the_epochs_rule():
    plan = _plan(C.resolve(cli={"algorithm": "gtopk", "density_warmup_steps": 10}))
    assert plan.hook_options["density_warmup"] == 0.25 and plan.hook_options["density_warmup_steps"] == 10
    assert "10 step(s), as set (comm.density_warmup_steps)" in plan.density_warmup["text"]
    assert not plan.density_warmup["default_length"]
    off = _plan(C.resolve(cli={"algorithm": "gtopk", "density_warmup_steps": 0}))
    assert "density_warmup" not in off.hook_options and off.density_warmup["steps"] == 0
    assert "off (comm.density_warmup_steps set to 0)" in off.density_warmup["text"]
    dense = _plan(C.resolve(cli={"density_warmup_steps": 10}))  # torus2d does not read it: a warning
    assert any("comm.density_warmup_steps is set but not read by exchange torus2d" in w for w in dense.warnings)


@pytest.mark.parametrize("cli, needle", [
    ({"start_iter": 1}, "config key comm.start_iter must be an integer >= 2"),  # torus2d does not read it
    ({"algorithm": "powersgd", "min_compression_rate": 0}, "config key comm.min_compression_rate must be > 0"),
    ({"density_warmup_mode": "cubic"}, "'comm.density_warmup_mode': invalid value 'cubic'; valid choices: "
                                       "exponential, linear"),
    ({"threaded": "maybe"}, "'comm.threaded': expected true or false"),
    ({"density": 0}, "config key comm.density must be a number in (0, 1]"),
    ({"local_clip": -1.0}, "config key comm.local_clip must be None (off) or a gradient norm > 0"),
    ({"threshold_every": 0}, "config key comm.threshold_every must be an integer >= 1"),
    ({"matrix_approximation_rank": 0}, "config key comm.matrix_approximation_rank must be an integer >= 1"),
    ({"density_warmup_steps": -1}, "config key comm.density_warmup_steps must be an integer >= 0"),
])
def test_bad_values_name_the_key_and_what_is_valid(cli, needle):
    with pytest.raises(ValueError) as err:
        C.resolve(cli=cli)
    assert needle in str(err.value)


def test_unknown_comm_key_lists_the_generated_keys():
    with pytest.raises(ValueError) as err:
        C.resolve(toml_text="[comm]\nthread = true\n")
    assert "unknown config key comm.thread; valid keys in [comm]:" in str(err.value)
    assert "threaded" in str(err.value) and "start_iter" in str(err.value)
    for derived in C.DERIVED_OPTIONS:  # set from another section: no [comm] key
        with pytest.raises(ValueError, match=f"unknown config key comm.{derived};"):
            C.resolve(toml_text=f"[comm]\n{derived} = 1\n")


def test_config_toml_written_before_the_generated_keys_still_loads():
    # [comm] of a gtopk run's config.toml as written before the exchange options were generated
    old = ('[comm]\nalgorithm = "gtopk"\ndensity = 0.001\ndensity_warmup = 0.25\nmomentum_correction = false\n'
           'momentum_masking = true\nlayer_trust = false\nselection = "sampled"\nthreshold_tolerance = 0.25\n'
           'threshold_every = 8\nbucket_mb = 25.0\n')
    # its selection was the default then; it stays what the run trained with (the default is now auto)
    assert C.resolve(toml_text=old) == C.resolve(cli={"algorithm": "gtopk", "selection": "sampled"})
    from flashsgd.train.config.file import dumps_run_config

    for flags in ({"algorithm": "gtopk", "threaded": True, "start_iter": 4}, {"algorithm": "torus2d", "threaded": False},
                  {"algorithm": "gtopk", "density_warmup_steps": 7}):
        cfg = C.resolve(cli=flags)
        assert C.resolve(toml_text=dumps_run_config(cfg)) == cfg  # and what this run writes loads back
