#!/usr/bin/env python3
"""Writes the MLKV reference fixtures (issue 35) under tests/fixtures/mlkv_*/ with HF transformers.

MLKV (Zuhri et al., arXiv 2406.09297 §3; its code: github.com/zaydzuhri/pythia-mlkv): only
`m` of the `L` layers project K/V — layers 0 and floor((i + 1) · L / m) for i < m - 1 — and
every other layer attends, with its own queries, over the cache of the nearest KV layer below
it. transformers has no such model, so the reference runs HF's own modules (LlamaModel,
MistralModel, Qwen2Model: their attention, RoPE, masks and sliding windows untouched) with a
cache whose `update` hands a reading layer the K/V its owner layer produced in the same pass
instead of the reader's own: the only change MLKV makes to the forward pass.

Each fixture is written like scripts/make_fixtures.py's (config.json with
`num_key_value_layers`, model.safetensors without the reading layers' k_proj/v_proj, ids.json,
logits.npy of the whole teacher-forced sequence, CHECKS.txt), and is refused unless ignoring
the sharing (every layer its own K/V) and reading layer 0's cache instead of the owner's both move the logits
far beyond the tests' tolerance.

Run with the pinned versions of make_fixtures.py (torch 2.15.0, transformers 5.23.0):
    python3 scripts/make_mlkv_fixtures.py
"""
import json
import sys
from pathlib import Path

import numpy as np
import torch
import transformers
from safetensors.torch import load_file, save_file

sys.path.insert(0, str(Path(__file__).resolve().parent))
import make_fixtures as mf  # noqa: E402


def kv_layers(L, m):
    """MLKV's placement (pythia-mlkv's convert_to_mlkv.py)."""
    return [0] + [int((i + 1) * (L / m)) for i in range(m - 1)]


def owners(L, m):
    kv = set(kv_layers(L, m))
    out, last = [], 0
    for i in range(L):
        if i in kv:
            last = i
        out.append(last)
    return out


class SharedCache(transformers.DynamicCache):
    """A DynamicCache under which a reading layer attends over its owner's K/V."""

    def __init__(self, owner_of, **kw):
        super().__init__(**kw)
        self.owner_of = owner_of
        self.made = {}

    def update(self, key_states, value_states, layer_idx, cache_kwargs=None):
        owner = self.owner_of[layer_idx]
        if owner == layer_idx:
            out = super().update(key_states, value_states, layer_idx, cache_kwargs)
            # What the owner attends over in this pass (a sliding-window layer keeps less).
            self.made[layer_idx] = out
            return out
        return self.made[owner]


def shared_logits(model, ids, owner_of):
    with torch.no_grad():
        cache = SharedCache(owner_of, config=model.config)
        out = model(
            input_ids=torch.tensor([ids]),
            position_ids=torch.arange(len(ids)).unsqueeze(0),
            past_key_values=cache,
            use_cache=True,
        )
    return out.logits[0].float().numpy()


def fixture(name, arch, cfg_kwargs, m, seed):
    if not mf.selected(name):
        return
    L = cfg_kwargs["num_hidden_layers"]
    owner_of = owners(L, m)
    cfg, model = mf.build(dict(cfg_kwargs, num_key_value_layers=m), seed, arch)
    rng = np.random.default_rng(seed)
    ids = [int(x) for x in rng.integers(0, cfg.vocab_size, mf.PROMPT_LEN + mf.DECODE_LEN)]
    ref = shared_logits(model, ids, owner_of)
    checks = {
        "sharing ignored (every layer its own K/V)": float(np.abs(mf.logits_of(model, ids) - ref).max()),
        "every reader on layer 0's cache instead of its owner's": float(
            np.abs(shared_logits(model, ids, [i if o == i else 0 for i, o in enumerate(owner_of)]) - ref).max()
        ),
    }
    for k, v in checks.items():
        if v < 100 * mf.TOL:
            sys.exit(f"{name}: {k} changed logits by only {v:.2e}; the fixture would not catch it")
    mf.write(name, cfg, model, ids, ref, True, checks)
    d = mf.OUT / name
    weights = load_file(d / "model.safetensors")
    for i, o in enumerate(owner_of):
        if o != i:
            for p in ("k_proj", "v_proj"):
                for t in ("weight", "bias"):
                    weights.pop(f"model.layers.{i}.self_attn.{p}.{t}", None)
    save_file(weights, d / "model.safetensors", metadata={"format": "pt"})
    conf = json.loads((d / "config.json").read_text())
    assert conf.get("num_key_value_layers") == m, conf
    with open(d / "CHECKS.txt", "a") as f:
        f.write(f"MLKV: {m} of {L} layers project K/V (layers {kv_layers(L, m)}); owners {owner_of}; "
                f"written by scripts/make_mlkv_fixtures.py\n")


def main():
    mf.check_versions()
    torch.set_default_dtype(torch.float32)
    rope = {"rope_type": "default", "rope_theta": 10000.0}
    # Llama: 5 layers, 2 KV layers (0 and 2): groups of 2 and 3.
    fixture("mlkv_llama", "llama", dict(mf.BASE, num_hidden_layers=5, rope_parameters=rope), m=2, seed=21)
    # Mistral: sliding window 8 over 32 tokens, 3 KV layers of 5 (0, 1, 3).
    fixture("mlkv_mistral", "mistral", dict(mf.BASE, num_hidden_layers=5, sliding_window=8, rope_parameters=rope), m=3, seed=22)
    # Qwen2: q/k/v biases, tied embeddings, 2 KV layers of 4 (0, 2).
    fixture(
        "mlkv_qwen2",
        "qwen2",
        dict(mf.BASE, num_hidden_layers=4, tie_word_embeddings=True, rope_parameters={"rope_type": "default", "rope_theta": 1000000.0}),
        m=2,
        seed=23,
    )


if __name__ == "__main__":
    main()
