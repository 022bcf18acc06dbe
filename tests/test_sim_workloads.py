"""The built-in transformer workloads: read torch-free from the package's JSON, which cannot drift
from transformers' module definitions (regenerated here on the meta device when transformers is
installed)."""

from __future__ import annotations

import importlib.util
import json
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

from flashsgd.sim.workload import PROFILES, WORKLOADS, get_workload

ROOT = Path(__file__).resolve().parents[1]


def _generator():
    spec = importlib.util.spec_from_file_location("make_workloads", ROOT / "benchmarks" / "make_workloads.py")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def test_the_json_is_what_transformers_defines():
    pytest.importorskip("torch")
    pytest.importorskip("transformers")
    gen = _generator()
    assert gen.render(gen.profiles()) == PROFILES.read_text(), \
        "src/flashsgd/sim/workload_profiles.json is stale: run benchmarks/make_workloads.py"


@pytest.mark.parametrize("name, params, tensors, unit", [
    ("bert-base", 110_106_428, 206, "sequences"), ("bert-large", 336_226_108, 398, "sequences"),
    ("gpt2", 124_439_808, 148, "sequences"), ("gpt2-medium", 354_823_168, 292, "sequences"),
    ("vit-b16", 86_567_656, 200, "images"), ("bert-large-seq512", 336_226_108, 398, "sequences")])
def test_published_sizes_and_units(name, params, tensors, unit):
    w = get_workload(name)
    assert (w.num_params, w.num_tensors, w.unit) == (params, tensors, unit)
    assert w.matrices is not None and np.all(w.matrices[:, 0] * w.matrices[:, 1] == w.numels)


def test_backward_shares_follow_flops_not_parameter_counts():
    w = get_workload("bert-large")
    share = dict(zip(w.tensor_names, w.backward_share))
    emb = share["bert.embeddings.word_embeddings.weight"]
    # by parameter count the word embedding (31.3M of 336M) would take ~9% of the backward
    assert w.numels[w.tensor_names.index("bert.embeddings.word_embeddings.weight")] / w.num_params > 0.09
    assert emb < 1e-3
    # the tied vocabulary projection runs first in backward: the MLM head's bias waits for it
    assert w.tensor_names[:3] == ("cls.seq_relationship.bias", "cls.seq_relationship.weight", "cls.predictions.bias")
    assert 0.08 < share["cls.predictions.bias"] < 0.10
    # the word embedding (tied to the decoder) is the last gradient: its last use is the first layer
    assert w.tensor_names[-1] == "bert.embeddings.word_embeddings.weight"
    # 6N per token: forward ~2 x (non-embedding params + the decoder's 31.3M) per token
    assert 0.6e9 < w.forward_flops / w.tokens_per_sample < 0.75e9


def test_a_longer_sequence_gives_attention_more_of_the_backward():
    short, long = get_workload("bert-large"), get_workload("bert-large-seq512")
    assert long.tokens_per_sample == 512 and np.array_equal(short.numels, long.numels)
    # attention's share grows with the length: the tensors ready right after an attention core
    i = short.tensor_names.index("bert.encoder.layer.23.attention.self.value.bias")
    assert long.backward_share[i] > short.backward_share[i]
    assert 4 < long.forward_flops / short.forward_flops < 4.5  # linear x4 plus the quadratic part


def test_every_built_in_is_torch_free():
    code = ("import sys; from flashsgd.sim.workload import WORKLOADS; [WORKLOADS.get(n)() for n in WORKLOADS]; "
            "bad = sorted(m for m in sys.modules if m in ('torch', 'transformers') or m.startswith('flashsgd.train')); "
            "assert not bad, bad")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    assert out.returncode == 0, out.stderr


def test_the_file_names_its_source():
    doc = json.loads(PROFILES.read_text())
    for name, m in doc["models"].items():
        assert name in WORKLOADS and m["source"] and m["config"]["class"] and m["transformers"]
