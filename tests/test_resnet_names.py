"""The built-in ResNets have torchvision's parameter names, shapes and order; checkpoints of the
earlier names (``last_bn``, ``shortcut``) still load and resume.

``data/torchvision_resnet_state_dict.txt`` is torchvision's resnet18/resnet50 state_dict (keys and
shapes, in order) derived from ``torchvision/models/resnet.py``; torchvision itself does not import
on this machine's CPU torch, so the load round trip with real torchvision skips where it does not.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from torch import nn

from flashsgd.optim.plan import _last_bn_of_residual_blocks
from flashsgd.train.records import checkpoint as ckpt
from flashsgd.train.models import build_model

DATA = Path(__file__).parent / "data" / "torchvision_resnet_state_dict.txt"


def _torchvision_keys() -> dict[str, list[tuple[str, tuple[int, ...]]]]:
    """{model: [(key, shape), ...]} from the data file."""
    models, current = {}, None
    for line in DATA.read_text().splitlines():
        if not line or line.startswith("#"):
            continue
        if line.startswith("["):
            current = models.setdefault(line.strip("[]"), [])
            continue
        key, shape = line.split()
        current.append((key, () if shape == "-" else tuple(int(s) for s in shape.split(","))))
    return models


def _old_names(state: dict) -> dict:
    """``state`` in flashsgd's earlier names (what a checkpoint written before the rename holds):
    ``downsample`` was ``shortcut``; a block's last BN (``bn3``, or ``bn2`` without a ``conv3``)
    was ``last_bn``."""
    def old(key: str) -> str:
        parts = key.split(".")
        for i, part in enumerate(parts):
            has_conv3 = ".".join(parts[:i] + ["conv3", "weight"]) in state
            if part == "downsample":
                parts[i] = "shortcut"
            elif part == "bn3" or (part == "bn2" and not has_conv3):
                parts[i] = "last_bn"
        return ".".join(parts)
    return {old(k): v for k, v in state.items()}


@pytest.mark.parametrize("name", ["resnet18", "resnet50"])
def test_state_dict_keys_shapes_and_order_are_torchvisions(name):
    expected = _torchvision_keys()[name]
    assert len(expected) == {"resnet18": 122, "resnet50": 320}[name]
    state = build_model(name, 1000).state_dict()
    assert [(k, tuple(v.shape)) for k, v in state.items()] == expected


@pytest.mark.parametrize("name", ["resnet18", "resnet50"])
def test_convs_have_torchvisions_stride_padding_and_no_bias(name):
    """What a state_dict does not show: torchvision's conv3x3 (padding 1), conv1x1 (padding 0), the
    7x7 stem (stride 2, padding 3), every conv without bias; the stride of a stage's first block on
    conv1 of a BasicBlock and on conv2 (the 3x3) of a Bottleneck ("v1.5"), and on its downsample."""
    model = build_model(name, 1000)
    strided = {"conv1"} | {f"layer{i}.0.{c}" for i in (2, 3, 4)
                           for c in ("conv1" if name == "resnet18" else "conv2", "downsample.0")}
    for key, conv in model.named_modules():
        if isinstance(conv, nn.Conv2d):
            k = conv.kernel_size[0]
            assert conv.bias is None and conv.padding == (k // 2, k // 2), key
            assert conv.stride == ((2, 2) if key in strided else (1, 1)), key
    assert {k for k, m in model.named_modules() if isinstance(m, nn.Conv2d) and m.stride == (2, 2)} == strided
    pool = model.maxpool
    assert (pool.kernel_size, pool.stride, pool.padding) == (3, 2, 1)


@pytest.mark.parametrize("name,blocks,last", [("resnet18", 8, "bn2"), ("resnet50", 16, "bn3"),
                                              ("resnet20", 9, "bn2")])
def test_last_bn_is_a_property_of_bn2_or_bn3(name, blocks, last):
    """Goyal et al.'s zero-gamma finds the last BN of every block; ``last_bn`` registers no name."""
    model = build_model(name, 10)
    found = _last_bn_of_residual_blocks(model)
    assert len(found) == blocks
    assert {id(bn) for bn in found} == {id(getattr(m, last)) for m in model.modules() if hasattr(m, "last_bn")}
    assert not any("last_bn" in k or "shortcut" in k for k in model.state_dict())


def test_torchvision_resnet50_loads_strictly_and_back():
    """Where torchvision imports (GPU images): its resnet50 weights in flashsgd's resnet50 with
    strict=True give the same logits, and flashsgd's weights load back into torchvision's."""
    tv = pytest.importorskip("torchvision", exc_type=ImportError)
    torch.manual_seed(0)
    theirs, ours = tv.models.resnet50().eval(), build_model("resnet50", 1000).eval()
    ours.load_state_dict(theirs.state_dict(), strict=True)
    x = torch.randn(2, 3, 64, 64)
    with torch.no_grad():
        assert torch.allclose(ours(x), theirs(x), rtol=1e-4, atol=1e-5)
    back = tv.models.resnet50()
    back.load_state_dict(ours.state_dict(), strict=True)
    assert all(torch.equal(a, b) for a, b in zip(back.state_dict().values(), ours.state_dict().values()))


# ------------------------------------------------------------------- old checkpoints -------
def test_legacy_key_map_renames_only_the_earlier_names():
    for name in ("resnet18", "resnet50", "resnet20"):
        new = build_model(name, 10).state_dict()
        old = _old_names(new)
        assert any(".last_bn." in k for k in old), name
        mapping = ckpt.legacy_key_map(old)
        assert [mapping.get(k, k) for k in old] == list(new), name
    # states without a last_bn key (torchvision's, the mnist1d model's, this version's) are untouched
    for state in (build_model("resnet50", 10).state_dict(), build_model("mnist1d_cnn", 10).state_dict(),
                  {"shortcut.0.weight": torch.zeros(1)}):
        assert ckpt.legacy_key_map(state) == {}


def test_load_model_state_renames_an_old_state_with_one_note(capsys):
    model = build_model("resnet50", 10)
    source = build_model("resnet50", 10)
    old = _old_names(source.state_dict())
    ckpt.load_model_state(model, old, "step-00000004")
    assert all(torch.equal(a, b) for a, b in zip(model.state_dict().values(), source.state_dict().values()))
    lines = capsys.readouterr().out.splitlines()
    assert len(lines) == 1 and "checkpoint step-00000004 has flashsgd's earlier ResNet names" in lines[0]
    assert "renamed to torchvision's (last_bn -> bn2/bn3, shortcut -> downsample)" in lines[0]
    ckpt.load_model_state(model, source.state_dict(), "x")  # current names: no note
    assert capsys.readouterr().out == ""
    with pytest.raises(ckpt.CheckpointError, match="does not match the model"):
        ckpt.load_model_state(build_model("resnet18", 10), old, "x")


def _rewrite_with_old_names(target: Path) -> None:
    """Turn a checkpoint directory into one written before the rename (model and rank buffers)."""
    shared = torch.load(target / "shared.pt", weights_only=True)
    names = _old_names(shared["model"])
    rename = dict(zip(shared["model"], names))
    shared["model"] = names
    torch.save(shared, target / "shared.pt")
    for path in target.glob("rank-*.pt"):
        local = torch.load(path, weights_only=True)
        local["buffers"] = {rename[k]: v for k, v in local["buffers"].items()}
        torch.save(local, path)
    assert any(".last_bn." in k for k in names) and any(".last_bn." in k for k in local["buffers"])


def test_load_renames_the_model_and_each_ranks_bn_statistics(tmp_path, capsys):
    """:func:`ckpt.load` / :func:`ckpt.load_all_ranks` of an old checkpoint: shared model and every
    rank's own BN statistics (``buffers``) in the new names, one note (not one per rank file)."""
    state = build_model("resnet20", 10).state_dict()
    target = tmp_path / "step-00000004"
    target.mkdir()
    meta = {"format": ckpt.FORMAT, "step": 4, "world_size": 2}
    torch.save({"meta": meta, "model": state}, target / "shared.pt")
    for r in range(2):
        buffers = {k: v + r for k, v in state.items() if "running" in k}
        torch.save({"meta": meta, "buffers": buffers}, target / f"rank-{r:05d}.pt")
    _rewrite_with_old_names(target)
    shared, local = ckpt.load(target, 1, 2)
    assert list(shared["model"]) == list(state)
    assert list(local["buffers"]) == [k for k in state if "running" in k]
    assert torch.equal(local["buffers"]["blocks.8.bn2.running_mean"], state["blocks.8.bn2.running_mean"] + 1)
    assert capsys.readouterr().out.count("has flashsgd's earlier ResNet names: 45 keys renamed") == 1
    shared, ranks = ckpt.load_all_ranks(target)
    assert all(list(r["buffers"]) == list(local["buffers"]) for r in ranks)
    assert capsys.readouterr().out.count("earlier ResNet names") == 1


@pytest.mark.slow
def test_an_old_run_resumes_exactly(tmp_path, capfd):
    """A resnet20 run whose checkpoint has the earlier names resumes to the uninterrupted run's
    parameters, bit for bit (2 workers: each rank's own BN statistics are renamed too)."""
    from flashsgd.train import config as C
    from flashsgd.train.trainer import train

    def cfg(out, **cli):
        base = dict(dataset="synthetic", image_shape="cifar", model="resnet20", num_samples=128,
                    epochs=2.0, global_batch=32, workers=2, deterministic=True, seed=3,
                    checkpoint_every=100, algorithm="ring", progress=False, out=str(out))
        return C.resolve(cli={**base, **cli})

    train(cfg(tmp_path / "a"))
    train(cfg(tmp_path / "b", max_steps=3))
    (target,) = [p for p in (tmp_path / "b" / "checkpoints").iterdir() if p.name.startswith("step-")]
    _rewrite_with_old_names(target)
    capfd.readouterr()
    train(cfg(tmp_path / "b"))
    printed = capfd.readouterr().out
    assert printed.count("has flashsgd's earlier ResNet names") == 1, printed

    def final(out):
        latest = (out / "checkpoints" / "latest").read_text().strip()
        return torch.load(out / "checkpoints" / latest / "shared.pt", weights_only=True)["model"]

    a, b = final(tmp_path / "a"), final(tmp_path / "b")
    assert list(a) == list(b) and all(torch.equal(a[k], b[k]) for k in a)
