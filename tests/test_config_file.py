"""The run directory's config.toml lists the keys the run reads and loads back to the same config
(flashsgd.train.config.file, flashsgd.train.records.rundir)."""

from __future__ import annotations

import inspect
import sys

import pytest
import torch

from flashsgd.train.records import rundir
from flashsgd.train.config import resolve
from flashsgd.train.config.file import applies, dumps_run_config, unread_keys

if sys.version_info >= (3, 11):
    import tomllib
else:  # pragma: no cover
    import tomli as tomllib

SPARSE_KEYS = ("density", "density_warmup_epochs", "selection", "threshold_tolerance",
               "threshold_every", "momentum_masking", "layer_trust", "node_split")

CONFIGS = [
    {},                                                             # torus2d on MNIST-1D
    {"image_size": 128, "density": 0.01, "channels_last": True},    # set, though torus2d/mnist1d never read them
    {"dataset": "synthetic", "image_shape": "cifar", "model": "resnet20", "algorithm": "gtopk",
     "density": 0.01, "density_warmup": 0.25, "selection": "threshold", "grid": "2x2"},
    {"dataset": "imagefolder", "data_dir": "/some/images", "image_size": 160, "model": "resnet18",
     "algorithm": "hgtopk", "node_split": "slices", "channels": 16, "data_workers": 2},
    {"algorithm": "powersgd", "matrix_approximation_rank": 2, "num_samples": 2000},
    {"algorithm": "auto", "accuracy_risk": "any", "density": 0.01},
    {"algorithm": "native", "precision": "bf16", "grad_accum": 2},
]


@pytest.mark.parametrize("cli", CONFIGS)
def test_the_file_loads_back_to_the_same_config(cli):
    cfg = resolve(cli=cli)
    assert resolve(toml_text=dumps_run_config(cfg)) == cfg


def test_torus2d_mnist1d_lists_no_image_or_sparse_key():
    doc = tomllib.loads(dumps_run_config(resolve(cli={"algorithm": "torus2d"})))
    assert set(doc["data"]) == {"dataset", "num_samples", "data_dir", "data_seed"}
    assert not set(doc["comm"]) & set(SPARSE_KEYS + ("matrix_approximation_rank", "accuracy_risk"))
    assert set(doc["comm"]) == {"algorithm", "bucket_mb"}
    assert "channels" in doc["model"] and "channels_last" not in doc["run"]


def test_a_set_key_the_run_does_not_read_is_kept_under_a_comment():
    text = dumps_run_config(resolve(cli={"image_size": 128, "density": 0.01}))
    data, comm = text.split("[data]")[1].split("[model]")[0], text.split("[comm]")[1].split("[run]")[0]
    assert "# set, but not read by dataset mnist1d:\nimage_size = 128" in data
    assert "# set, but not read by exchange torus2d:\ndensity = 0.01" in comm


def test_which_keys_each_exchange_reads():
    gtopk = resolve(cli={"algorithm": "gtopk"})
    assert all(applies(gtopk, "comm", k) for k in SPARSE_KEYS if k != "node_split")
    assert not applies(gtopk, "comm", "node_split") and not applies(gtopk, "comm", "grid")
    assert applies(resolve(cli={"algorithm": "hgtopk"}), "comm", "node_split")
    assert applies(resolve(cli={"algorithm": "torus2d"}), "comm", "grid")
    assert not applies(resolve(cli={"algorithm": "ring"}), "comm", "grid")  # its options class has it
    auto = resolve(cli={"algorithm": "auto"})
    assert unread_keys(auto) == [k for k in unread_keys(auto) if not k.startswith("comm.")]
    assert "comm.matrix_approximation_rank" not in unread_keys(resolve(cli={"algorithm": "powersgd"}))


def test_keys_said_unread_do_not_change_the_data_or_the_model(tmp_path):
    """The table against the code that reads it: changing a key said not to apply changes nothing."""
    from flashsgd.train.data import build_datasets
    from flashsgd.train.data.images import write_jpeg_folder
    from flashsgd.train.models import build_model

    folder = write_jpeg_folder(tmp_path / "img", classes=2, per_class=3, size=(48, 40))
    base = {"mnist1d": dict(num_samples=1000, data_dir=str(tmp_path / "cache")),
            "synthetic": dict(num_samples=100), "imagefolder": dict(data_dir=str(folder), image_size=32)}
    other = dict(num_samples=200, data_dir=str(tmp_path / "elsewhere"), image_shape="cifar",
                 image_size=24, data_seed=7)
    for dataset, kw in base.items():
        cfg = resolve(cli={"dataset": dataset, **kw})
        unread = [k.split(".")[1] for k in unread_keys(cfg) if k.startswith("data.") and k in
                  {f"data.{o}" for o in other}]
        assert unread, dataset
        ref = build_datasets(dataset, **{**_data_args(cfg)})
        changed = build_datasets(dataset, **{**_data_args(cfg), **{k: other[k] for k in unread}})
        idx = torch.arange(2)
        assert ref.description == changed.description, (dataset, unread)
        for a, b in zip(ref.train.batch(idx, train=False), changed.train.batch(idx, train=False)):
            assert torch.equal(a, b), (dataset, unread)
    resnet = resolve(cli={"model": "resnet20"})
    assert not applies(resnet, "model", "channels")
    n = [sum(p.numel() for p in build_model("resnet20", 10, channels=c).parameters()) for c in (8, 32)]
    assert n[0] == n[1]
    assert applies(resolve(), "model", "channels")


def _data_args(cfg) -> dict:
    d = cfg.data
    return dict(num_samples=d.num_samples, data_dir=d.data_dir, image_shape=d.image_shape,
                image_size=d.image_size, data_seed=d.data_seed)


def test_resume_ignores_keys_neither_run_reads_and_compares_the_rest(tmp_path):
    old = resolve(cli={"out": str(tmp_path), "algorithm": "torus2d", "image_size": 128})
    (tmp_path / "config.toml").write_text(dumps_run_config(old))
    (tmp_path / "summary.json").write_text("{}")  # the run completed steps: changes are refused
    # what the file says is what the run was: nothing changed
    assert rundir.config_changes(rundir._saved_config(tmp_path)[0], old) == []
    # keys the run does not read: no change that matters
    same = resolve(cli={"out": str(tmp_path), "algorithm": "torus2d", "density": 0.5, "image_shape": "cifar"})
    assert rundir.config_changes(rundir._saved_config(tmp_path)[0], same) == []
    assert rundir.decide(same, target_steps=10).kind == "fresh"  # no checkpoint: not refused
    # a key the run reads, or a key one of the two runs reads: refused, named
    with pytest.raises(rundir.RunDirError, match="data.num_samples: 40000 -> 2000"):
        rundir.decide(resolve(cli={"out": str(tmp_path), "num_samples": 2000}), target_steps=10)
    with pytest.raises(rundir.RunDirError, match="comm.algorithm: 'torus2d' -> 'gtopk'; comm.density"):
        rundir.decide(resolve(cli={"out": str(tmp_path), "algorithm": "gtopk", "density": 0.5}), 10)


def test_doctest():
    import doctest

    from flashsgd.train.config import file as config_file

    assert doctest.testmod(config_file).failed == 0


def test_a_key_set_but_not_read_by_the_exchange_is_named_in_the_plan():
    """Issue 33 item 4: ``--comm ring --grid 4x1`` was accepted silently (the grid is torus2d's)."""
    from flashsgd.train.plan import build_plan

    plan = build_plan(resolve(cli={"algorithm": "ring", "grid": "4x1"}), 4, 32000, local_spawn=True,
                      backend="gloo")
    assert "config key comm.grid is set but not read by exchange ring: ignored" in plan.warnings
    assert "WARNING     config key comm.grid" in plan.describe()
    torus = build_plan(resolve(cli={"algorithm": "torus2d", "grid": "4x1"}), 4, 32000, local_spawn=True,
                       backend="gloo")
    assert not any("comm.grid" in w for w in torus.warnings)


def test_the_dataset_catalog_is_what_the_config_and_the_plan_read():
    """Issue 34 item 2: one entry per dataset; the config's choices, the keys config.toml keeps,
    channels_last and the data-workers rule come from it."""
    from flashsgd.train.data.catalog import DATASETS, dataset_keys
    from flashsgd.train.plan import build_plan

    with pytest.raises(ValueError, match="valid choices: mnist1d, synthetic, imagefolder"):
        resolve(cli={"dataset": "cifar10"})
    for name, entry in DATASETS.items():
        cfg = resolve(cli={"dataset": name, **({"data_dir": "/tmp/x"} if name == "imagefolder" else {})})
        assert {k for k in dataset_keys() if applies(cfg, "data", k)} == set(entry.reads), name
        assert applies(cfg, "run", "channels_last") == entry.images
        # the loader and its description are functions of the [data] config whole (no name lookup)
        params = [list(inspect.signature(fn).parameters) for fn in (entry.load, entry.describe)]
        assert params == [["d"], ["d"]], name
    plan = build_plan(resolve(cli={"dataset": "synthetic", "image_shape": "cifar", "num_samples": 4096,
                                   "data_workers": 2, "channels_last": True, "model": "resnet20"}),
                      4, 4096, local_spawn=True, backend="gloo")
    assert plan.execution["data_workers"] == 0 and plan.execution["channels_last"]
    assert "data_workers ignored: synthetic is in memory" in plan.execution["notes"]
