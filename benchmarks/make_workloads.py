"""Write the simulator's built-in transformer workloads (src/flashsgd/sim/workload_profiles.json).

The simulator is torch-free, so the transformer workloads it offers (``bert-base``, ``bert-large``,
``gpt2``, ``gpt2-medium``, ``vit-b16``) are read from a JSON file this script writes from the real
module definitions: transformers' ``BertForPreTraining``, ``GPT2LMHeadModel`` and
``ViTForImageClassification`` with their published configurations, built on the meta device (no
weight is allocated) and run forward once on meta inputs to see which layer runs when.

Per model, the file holds:

* every trainable tensor in DDP's gradient order, with its size and its (rows, cols) as torch's
  PowerSGD hook views it. DDP fills its first step's buckets in the reverse of ``parameters()``
  registration (as every built-in workload orders them) and from the second step on rebuilds them
  in the order the gradients became ready (torch's reducer, ``_rebuild_buckets``): that order is
  used (Step 5), ties kept in reverse registration; tied weights once, where ``parameters()`` lists
  them. For BERT and GPT-2 the two orders differ only in their heads, for ViT inside every layer
  (its layer norms are registered after the attention and the MLP);
* each tensor's backward FLOPs per sample at the reference length, in two parts: ``bwd_flops``
  (matrix products, embeddings, norms: linear in the sequence length) and ``bwd_flops_attention``
  (the attention core: quadratic in it), so a reader can take the shares at another length;
* the forward FLOPs per sample at the reference sequence length, the sample's unit and the source.

FLOP model (derivations beside the arithmetic below):

1. Step 1, a matrix product (``Linear``, GPT-2's ``Conv1D``) of ``in x out`` over t tokens: forward
   ``2 in out t``; backward ``4 in out t`` (the input's gradient and the weight's, each as large as
   the forward).
2. Step 2, the attention core (no parameter): forward ``QK^T`` and ``AV``, ``2 s^2 d`` each per
   sequence (d = hidden size, all heads together), counted in full also for GPT-2's causal mask;
   backward twice that, ``8 s^2 d``.
3. Step 3, an embedding's backward is a scatter-add of the incoming gradient: ``t x dim`` additions,
   1 FLOP per element (nearly free; parameter counts would give BERT's word embedding ~9% of the
   backward). ViT's patch projection (a 16x16/16 convolution on the image): forward
   ``2 x 768 x 3 x 16 x 16 x 196``; backward only the weight's gradient (the image needs none), 1x.
4. Step 4, LayerNorm: ASSUMPTION 8 FLOPs per element in backward, the figure the CNN workloads give
   batch norm (flashsgd.sim.workload); other element-wise work (GELU, softmax, dropout, residual
   adds) is memory-bound and not counted.
5. Step 5, when a gradient is ready: backward runs the layers in the reverse of their forward order;
   a tensor's gradient is ready once the last layer that uses it has run its backward (a tied
   weight: its first use in forward). With ``R`` the backward FLOPs done when each tensor is ready,
   in the order they become ready, a tensor's share is ``R`` minus the previous tensor's (the
   running maximum of each part is taken, so the shares stay >= 0 whatever the order).

Run it after a change to transformers' definitions or to the model above; tests/test_sim_workloads.py
regenerates the file in memory and fails when it differs::

    .venv/bin/python benchmarks/make_workloads.py            # writes the file
    .venv/bin/python benchmarks/make_workloads.py --check    # exit 1 if the file is stale
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
OUT = ROOT / "src" / "flashsgd" / "sim" / "workload_profiles.json"

LAYERNORM_BWD_FLOPS_PER_ELEM = 8.0  # ASSUMPTION: as batch norm in flashsgd.sim.workload
EMBEDDING_BWD_FLOPS_PER_ELEM = 1.0  # one addition per element of the scatter-add

# name -> (transformers class, config class, config overrides (the published configuration),
#          sequence length or image size, unit, sample text, source)
MODELS = {
    "bert-base": ("BertForPreTraining", "BertConfig", {}, 128, "sequences",
                  "a sequence of 128 tokens (pre-training phase 1)",
                  "transformers BertForPreTraining, BertConfig() defaults = bert-base-uncased (Devlin et al. "
                  "2019: 12 layers, hidden 768, 12 heads, vocabulary 30,522)"),
    "bert-large": ("BertForPreTraining", "BertConfig",
                   {"hidden_size": 1024, "num_hidden_layers": 24, "num_attention_heads": 16,
                    "intermediate_size": 4096}, 128, "sequences",
                   "a sequence of 128 tokens (pre-training phase 1)",
                   "transformers BertForPreTraining, bert-large-uncased's config (Devlin et al. 2019: 24 "
                   "layers, hidden 1024, 16 heads, FFN 4096, vocabulary 30,522)"),
    "gpt2": ("GPT2LMHeadModel", "GPT2Config", {}, 1024, "sequences", "a sequence of 1,024 tokens",
             "transformers GPT2LMHeadModel, GPT2Config() defaults = gpt2 (124M: 12 layers, 768, 12 heads, "
             "context 1,024, vocabulary 50,257; LM head tied to the token embedding)"),
    "gpt2-medium": ("GPT2LMHeadModel", "GPT2Config", {"n_embd": 1024, "n_layer": 24, "n_head": 16}, 1024,
                    "sequences", "a sequence of 1,024 tokens",
                    "transformers GPT2LMHeadModel, gpt2-medium's config (350M: 24 layers, 1024, 16 heads)"),
    "vit-b16": ("ViTForImageClassification", "ViTConfig", {"num_labels": 1000}, 224, "images",
                "a 224x224 image (196 patches + the class token)",
                "transformers ViTForImageClassification, ViTConfig() defaults = ViT-B/16 (Dosovitskiy et al. "
                "2021: 12 layers, 768, 12 heads, MLP 3072, patch 16, 224x224) with a 1,000-class head"),
}
VARIANTS = {"bert-large-seq512": ("bert-large", 512, "a sequence of 512 tokens (pre-training phase 2)")}
"""Further built-ins: the same tensors at another sequence length (name -> (model, length, sample))."""

ATTENTION = {"BertSelfAttention": None, "GPT2Attention": "c_proj", "ViTAttention": "o_proj",
             "ViTSelfAttention": None}
"""Modules whose forward holds the attention core; the child it runs before (None: after the
module's own children, which are then the Q, K, V projections)."""


def _build(name: str):
    import torch
    import transformers

    cls_name, cfg_name, overrides, size, *_ = MODELS[name]
    config = getattr(transformers, cfg_name)(**overrides)
    with torch.device("meta"):
        model = getattr(transformers, cls_name)(config)
    if cfg_name == "ViTConfig":
        inputs = {"pixel_values": torch.zeros(1, 3, size, size, device="meta")}
    else:
        inputs = {"input_ids": torch.zeros(1, size, dtype=torch.long, device="meta")}
    return model, inputs, config


def _events(model, inputs) -> list[tuple[str, float, float, float, tuple[int, ...]]]:
    """The forward's layers in execution order: (module, forward FLOPs, backward FLOPs linear in
    the length, backward FLOPs of the attention core, ids of the parameters it uses), per sample."""
    import torch

    events: list = []
    hidden = model.config.hidden_size

    def leaf(mod, args, out):
        x = args[0]
        params = tuple(id(p) for p in mod.parameters(recurse=False))
        kind = type(mod).__name__
        if kind in ("Linear", "Conv1D"):
            fin = mod.in_features if kind == "Linear" else mod.weight.shape[0]
            fout = mod.out_features if kind == "Linear" else mod.weight.shape[1]
            tokens = x.numel() // fin
            fwd = 2.0 * fin * fout * tokens  # Step 1
            events.append((mod._fs_name, fwd, 2.0 * fwd, 0.0, params))
        elif kind == "Conv2d":  # ViT's patch projection: weight gradient only (Step 3)
            oh, ow = out.shape[-2:]
            fwd = 2.0 * mod.weight.numel() * oh * ow
            events.append((mod._fs_name, fwd, fwd, 0.0, params))
        elif kind == "Embedding":
            elems = x.numel() * mod.embedding_dim
            events.append((mod._fs_name, 0.0, EMBEDDING_BWD_FLOPS_PER_ELEM * elems, 0.0, params))
        elif kind == "LayerNorm":
            events.append((mod._fs_name, 0.0, LAYERNORM_BWD_FLOPS_PER_ELEM * x.numel(), 0.0, params))
        elif params:
            raise ValueError(f"no FLOP rule for {kind} ({mod._fs_name}), which has parameters")

    def own(mod, args, out):  # a container's own tensors (ViT's class token and position embedding):
        params = tuple(id(p) for p in mod.parameters(recurse=False))  # added to its output, 1 FLOP/elem
        events.append((mod._fs_name + ".<own>", 0.0, float(sum(p.numel() for p in mod.parameters(recurse=False))),
                       0.0, params))

    def core(mod, args, out=None):  # Step 2: QK^T and AV, 2 s^2 d each per sequence
        s = (args[0] if args else out).shape[-2]
        events.append((mod._fs_name + ".<attention>", 4.0 * s * s * hidden, 0.0, 8.0 * s * s * hidden, ()))

    handles = []
    for n, mod in model.named_modules():
        mod._fs_name = n
        if not list(mod.children()):
            handles.append(mod.register_forward_hook(leaf))
        elif any(True for _ in mod.parameters(recurse=False)):
            handles.append(mod.register_forward_hook(own))
        kind = type(mod).__name__
        if kind in ATTENTION:
            before = ATTENTION[kind]
            if before is None:
                handles.append(mod.register_forward_hook(lambda m, a, o: core(m, a, o[0] if isinstance(o, tuple) else o)))
            else:
                handles.append(getattr(mod, before).register_forward_pre_hook(
                    lambda m, a, parent=mod: core(parent, a)))
    with torch.no_grad():
        model(**inputs)
    for h in handles:
        h.remove()
    if not any(e[0].endswith("<attention>") for e in events):
        raise ValueError("no attention core seen: the ATTENTION table does not match this transformers version")
    return events


def profile(name: str) -> dict:
    """One model's entry of the JSON file (module docstring)."""
    model, inputs, config = _build(name)
    seq = inputs["pixel_values"].shape[-1] // config.patch_size if "pixel_values" in inputs else None
    positions = (seq * seq + 1) if seq else inputs["input_ids"].shape[-1]  # tokens per sample
    events = _events(model, inputs)
    named = list(model.named_parameters())  # tied weights once, at their first registration
    order = [(n, p) for n, p in named if p.requires_grad][::-1]  # DDP's gradient order
    # Step 5: backward runs the events in reverse; a tensor is ready when its last backward use ends.
    lin_done = att_done = 0.0
    ready: dict[int, tuple[int, float, float]] = {}
    for step, (_, _fwd, bwd_lin, bwd_att, params) in enumerate(reversed(events)):
        lin_done, att_done = lin_done + bwd_lin, att_done + bwd_att
        for pid in params:  # the last backward use (earliest in forward) wins
            ready[pid] = (step, lin_done, att_done)
    missing = [n for n, p in order if id(p) not in ready]
    if missing:
        raise ValueError(f"{name}: no layer used {missing[:3]} in forward")
    # DDP's order from the second step on: the order gradients became ready (ties: reverse registration)
    order = sorted(order, key=lambda np_: ready[id(np_[1])][0])
    r = [ready[id(p)][1:] for _, p in order]
    rows = []
    top = (0.0, 0.0)
    for (n, p), (f, q) in zip(order, r):
        f_max, q_max = max(top[0], f), max(top[1], q)  # the running maximum, in both parts
        rows.append({"name": n, "numel": p.numel(),
                     "matrix": [int(p.shape[0]), p.numel() // int(p.shape[0])] if p.dim() else [1, 1],
                     "bwd_flops": f_max - top[0], "bwd_flops_attention": q_max - top[1]})
        top = (f_max, q_max)
    cls_name, cfg_name, overrides, size, unit, sample, source = MODELS[name]
    return {"source": source, "class": cls_name, "config": {"class": cfg_name, **overrides},
            "transformers": __import__("transformers").__version__, "unit": unit, "sample": sample,
            "positions": positions, "forward_flops": sum(e[1] for e in events),
            "params": sum(p.numel() for _, p in order), "tensors": rows}


def profiles() -> dict:
    """Every model's entry, in :data:`MODELS` order, with the file's header."""
    return {"about": "written by benchmarks/make_workloads.py from transformers' module definitions on the "
                     "meta device; backward FLOPs per sample, in DDP's gradient order (its docstring)",
            "variants": {k: {"model": m, "positions": s, "sample": t} for k, (m, s, t) in VARIANTS.items()},
            "models": {name: profile(name) for name in MODELS}}


def render(doc: dict) -> str:
    return json.dumps(doc, indent=1) + "\n"


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--check", action="store_true", help="exit 1 if the file differs from a fresh one")
    args = ap.parse_args(argv)
    text = render(profiles())
    if args.check:
        same = OUT.exists() and OUT.read_text() == text
        print(f"{OUT}: {'up to date' if same else 'STALE: run benchmarks/make_workloads.py'}")
        return 0 if same else 1
    OUT.write_text(text)
    print(f"wrote {OUT}")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
