#!/usr/bin/env python3
"""Writes the reference fixtures under tests/fixtures/ with HF transformers.

Each fixture is a tiny random-weight model saved as
  config.json + model.safetensors   (what `--model-dir` loads)
  ids.json                          ({"prompt_ids": [...], "decode_ids": [...]})
  logits.npy                        (float32 [prompt + decode, vocab]: teacher-forced logits
                                     of the whole sequence, row i predicting token i + 1)

The weights are drawn with a large spread (std 0.2, norm weights in [0.5, 1.5]) so that a
wrong RoPE, mask or norm moves the logits far beyond the tests' tolerance (1e-4); the
script checks that it does and refuses to write a fixture otherwise.

Run with the pinned versions below (a venv with `pip install torch==2.15.0
transformers==5.23.0 safetensors numpy`):
    python3 scripts/make_fixtures.py              # every fixture
    python3 scripts/make_fixtures.py --only gemma3  # one (repeatable)
"""
import json
import shutil
import sys
from pathlib import Path

import numpy as np
import torch
import transformers
from transformers import (
    Gemma2Config,
    Gemma2ForCausalLM,
    Gemma3ForCausalLM,
    Gemma3TextConfig,
    GemmaConfig,
    GemmaForCausalLM,
    LlamaConfig,
    LlamaForCausalLM,
    MistralConfig,
    MistralForCausalLM,
    OPTConfig,
    OPTForCausalLM,
    Qwen2Config,
    Qwen2ForCausalLM,
)

ARCH = {
    "llama": (LlamaConfig, LlamaForCausalLM),
    "mistral": (MistralConfig, MistralForCausalLM),
    "qwen2": (Qwen2Config, Qwen2ForCausalLM),
    "gemma": (GemmaConfig, GemmaForCausalLM),
    "gemma2": (Gemma2Config, Gemma2ForCausalLM),
    "gemma3": (Gemma3TextConfig, Gemma3ForCausalLM),
    "opt": (OPTConfig, OPTForCausalLM),
}

PINNED = {"torch": "2.15.0", "transformers": "5.23.0"}
OUT = Path(__file__).resolve().parent.parent / "tests" / "fixtures"
TOL = 1e-4
PROMPT_LEN, DECODE_LEN = 23, 9


def check_versions():
    got = {"torch": torch.__version__.split("+")[0], "transformers": transformers.__version__}
    if got != PINNED and "--any-version" not in sys.argv:
        sys.exit(f"fixtures are pinned to {PINNED} but this is {got}; install those or pass --any-version")


def randomize(model, seed):
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "norm" in name:
                p.copy_(torch.rand(p.shape, generator=g) + 0.5)
            else:
                p.copy_(torch.randn(p.shape, generator=g) * 0.2)


def logits_of(model, ids, attention_mask=None):
    with torch.no_grad():
        # Explicit positions: OPT would otherwise derive them from a 2-D attention mask.
        pos = torch.arange(len(ids)).unsqueeze(0)
        out = model(input_ids=torch.tensor([ids]), attention_mask=attention_mask, position_ids=pos)
    return out.logits[0].float().numpy()


def build(cfg_kwargs, seed, arch="llama"):
    config_cls, model_cls = ARCH[arch]
    cfg = config_cls(**cfg_kwargs)
    cfg._attn_implementation = "eager"
    torch.manual_seed(seed)
    model = model_cls(cfg).eval().float()
    randomize(model, seed)
    if arch.startswith("gemma"):
        # Gemma stores w and applies 1 + w: store w so that the applied weight has the
        # same spread [0.5, 1.5] as the other fixtures' norms.
        with torch.no_grad():
            for n, p in model.named_parameters():
                if "norm" in n:
                    p.sub_(1.0)
    return cfg, model


def sensitivity(name, cfg_kwargs, seed, ids, ref, perturb, arch="llama", weights=None):
    """Builds the same model with `perturb` applied to its config (or `weights` applied to
    its parameters) — what an implementation that ignored the feature would compute — and
    demands a large logit change."""
    kw = dict(cfg_kwargs)
    if perturb is not None:
        perturb(kw)
    _, other = build(kw, seed, arch)
    if weights is not None:
        with torch.no_grad():
            weights(other)
    diff = float(np.abs(logits_of(other, ids) - ref).max())
    if diff < 100 * TOL:
        sys.exit(f"{name}: perturbation changed logits by only {diff:.2e}; the fixture would not catch it")
    return diff


def causal_leak(model, ids, ref):
    """Logits with a mask that lets each token see the next one must differ."""
    n = len(ids)
    allowed = torch.tril(torch.ones(n, n), diagonal=1).bool()
    mask = torch.zeros(1, 1, n, n).masked_fill(~allowed, float("-inf"))
    diff = float(np.abs(logits_of(model, ids, mask) - ref).max())
    if diff < 100 * TOL:
        sys.exit(f"an off-by-one causal mask changed logits by only {diff:.2e}")
    return diff


def write(name, cfg, model, ids, logits, classic_spelling, checks):
    d = OUT / name
    if d.exists():
        shutil.rmtree(d)
    d.mkdir(parents=True)
    model.save_pretrained(d, safe_serialization=True)
    conf = json.loads((d / "config.json").read_text())
    if classic_spelling and "rope_parameters" in conf:
        # The pre-transformers-5 spelling: rope_theta / rope_scaling at the top level.
        params = conf.pop("rope_parameters", None) or {}
        conf["rope_theta"] = params.get("rope_theta", 10000.0)
        scaling = {k: v for k, v in params.items() if k != "rope_theta"}
        conf["rope_scaling"] = None if scaling.get("rope_type", "default") == "default" else scaling
    (d / "config.json").write_text(json.dumps(conf, indent=2, sort_keys=True) + "\n")
    for extra in ("generation_config.json",):
        (d / extra).unlink(missing_ok=True)
    P = PROMPT_LEN
    (d / "ids.json").write_text(json.dumps({"prompt_ids": ids[:P], "decode_ids": ids[P:]}) + "\n")
    np.save(d / "logits.npy", logits.astype(np.float32))
    (d / "CHECKS.txt").write_text(
        "".join(f"{k}: max |Δlogit| = {v:.3e}\n" for k, v in checks.items())
        + f"generated by scripts/make_fixtures.py with torch {torch.__version__}, transformers {transformers.__version__}\n"
    )
    print(f"{name}: {d} ({logits.shape[0]} rows × {logits.shape[1]} vocab); " + ", ".join(f"{k} {v:.2e}" for k, v in checks.items()))


BASE = dict(
    vocab_size=384,
    hidden_size=64,
    intermediate_size=112,
    num_hidden_layers=3,
    num_attention_heads=4,
    num_key_value_heads=2,
    max_position_embeddings=128,
    rms_norm_eps=1e-5,
    tie_word_embeddings=False,
)


def selected(name):
    only = [sys.argv[i + 1] for i, a in enumerate(sys.argv[:-1]) if a == "--only"]
    return not only or name in only


def fixture(name, cfg_kwargs, seed, classic_spelling, perturbations, arch="llama", weight_perturbations=None):
    if not selected(name):
        return
    cfg, model = build(cfg_kwargs, seed, arch)
    rng = np.random.default_rng(seed)
    ids = [int(x) for x in rng.integers(0, cfg.vocab_size, PROMPT_LEN + DECODE_LEN)]
    ref = logits_of(model, ids)
    checks = {"off-by-one causal mask": causal_leak(model, ids, ref)}
    for pname, fn in perturbations.items():
        checks[pname] = sensitivity(f"{name}/{pname}", cfg_kwargs, seed, ids, ref, fn, arch)
    for pname, fn in (weight_perturbations or {}).items():
        checks[pname] = sensitivity(f"{name}/{pname}", cfg_kwargs, seed, ids, ref, None, arch, fn)
    # Norm weights set to 1 (a norm that ignores its weight).
    _, plain = build(cfg_kwargs, seed, arch)
    with torch.no_grad():
        for n, p in plain.named_parameters():
            if "norm" in n:
                p.fill_(1.0)
    checks["norm weight ignored"] = float(np.abs(logits_of(plain, ids) - ref).max())
    if checks["norm weight ignored"] < 100 * TOL:
        sys.exit(f"{name}: norm weights do not matter")
    write(name, cfg, model, ids, ref, classic_spelling, checks)


def main():
    check_versions()
    torch.set_default_dtype(torch.float32)

    def theta(kw):
        kw["rope_parameters"] = dict(kw.get("rope_parameters") or {"rope_type": "default"})
        kw["rope_parameters"]["rope_theta"] = 5000.0

    fixture(
        "llama_gqa",
        dict(BASE, rope_parameters={"rope_type": "default", "rope_theta": 10000.0}),
        seed=1,
        classic_spelling=True,
        perturbations={"rope theta halved": theta},
    )

    llama3 = {
        "rope_type": "llama3",
        "rope_theta": 10000.0,
        "factor": 8.0,
        "low_freq_factor": 1.0,
        "high_freq_factor": 4.0,
        "original_max_position_embeddings": 16,
    }

    def no_scaling(kw):
        kw["rope_parameters"] = {"rope_type": "default", "rope_theta": 10000.0}

    fixture(
        "llama3_rope",
        dict(BASE, num_key_value_heads=1, head_dim=24, rope_parameters=llama3),
        seed=2,
        classic_spelling=False,
        perturbations={"llama3 scaling dropped": no_scaling, "rope theta halved": theta},
    )

    # Multi-head attention (KV heads = query heads): the shape where partial recompute pays
    # (one token's X is half its K+V), used by the recompute traffic tests.
    fixture(
        "llama_mha",
        dict(BASE, num_key_value_heads=4, rope_parameters={"rope_type": "default", "rope_theta": 10000.0}),
        seed=3,
        classic_spelling=True,
        perturbations={"rope theta halved": theta},
    )

    def no_window(kw):
        kw["sliding_window"] = None

    def zero(pattern):
        def f(model):
            for n, p in model.named_parameters():
                if pattern in n:
                    p.zero_()
        return f

    def norm_minus_one(model):
        # What a norm applying `w` instead of Gemma's `1 + w` computes.
        for n, p in model.named_parameters():
            if "norm" in n:
                p.sub_(1.0)

    # Mistral: GQA and a sliding window of 8 over 32 tokens.
    fixture(
        "mistral",
        dict(BASE, sliding_window=8, rope_parameters={"rope_type": "default", "rope_theta": 10000.0}),
        seed=4,
        classic_spelling=True,
        arch="mistral",
        perturbations={"sliding window ignored": no_window},
    )
    # Qwen2: q/k/v biases, a large RoPE base, tied embeddings.
    fixture(
        "qwen2",
        dict(BASE, tie_word_embeddings=True, rope_parameters={"rope_type": "default", "rope_theta": 1000000.0}),
        seed=5,
        classic_spelling=True,
        arch="qwen2",
        perturbations={"rope theta 1e4 instead of 1e6": lambda kw: kw.update(rope_parameters={"rope_type": "default", "rope_theta": 10000.0})},
        weight_perturbations={"q/k/v biases dropped": zero("_proj.bias")},
    )
    # Gemma: MQA, head_dim (24) independent of hidden/heads, GeLU-tanh, 1 + w norms,
    # sqrt(hidden)-scaled tied embeddings.
    gemma = dict(BASE, num_key_value_heads=1, head_dim=24, tie_word_embeddings=True, rope_parameters={"rope_type": "default", "rope_theta": 10000.0})
    fixture(
        "gemma",
        gemma,
        seed=6,
        classic_spelling=True,
        arch="gemma",
        perturbations={},
        weight_perturbations={"norm applies w, not 1 + w": norm_minus_one},
    )
    # Gemma 2: soft-caps small enough to bite, query_pre_attn_scalar ≠ head_dim, window 8
    # on even layers, sandwich norms.
    gemma2 = dict(
        gemma,
        num_key_value_heads=2,
        attn_logit_softcapping=2.0,
        final_logit_softcapping=5.0,
        query_pre_attn_scalar=16,
        sliding_window=8,
    )
    fixture(
        "gemma2",
        gemma2,
        seed=7,
        classic_spelling=True,
        arch="gemma2",
        perturbations={
            "attention soft-cap dropped": lambda kw: kw.update(attn_logit_softcapping=None),
            "final soft-cap dropped": lambda kw: kw.update(final_logit_softcapping=None),
            "sliding window ignored": lambda kw: kw.update(sliding_window=4096),
            "query_pre_attn_scalar ignored (head_dim)": lambda kw: kw.update(query_pre_attn_scalar=24),
        },
        weight_perturbations={"norm applies w, not 1 + w": norm_minus_one},
    )

    # Gemma 3: q/k RMSNorm per head, window 8 on the local layers (layers 0, 1, 3; layer 2
    # global), a local RoPE base (1e4) different from the global one (1e6, linearly scaled
    # ×4), query_pre_attn_scalar ≠ head_dim, sandwich norms, no soft-caps.
    gemma3 = dict(
        gemma,
        num_hidden_layers=4,
        num_key_value_heads=2,
        query_pre_attn_scalar=16,
        sliding_window=8,
        layer_types=["sliding_attention", "sliding_attention", "full_attention", "sliding_attention"],
        rope_parameters={
            "full_attention": {"rope_type": "linear", "rope_theta": 1000000.0, "factor": 4.0},
            "sliding_attention": {"rope_type": "default", "rope_theta": 10000.0},
        },
    )

    def rope3(full=None, sliding=None):
        def f(kw):
            p = {k: dict(v) for k, v in kw["rope_parameters"].items()}
            if full is not None:
                p["full_attention"] = full
            if sliding is not None:
                p["sliding_attention"] = sliding
            kw["rope_parameters"] = p
        return f

    def qk_norm_dropped(model):
        for layer in model.model.layers:
            layer.self_attn.q_norm = torch.nn.Identity()
            layer.self_attn.k_norm = torch.nn.Identity()

    fixture(
        "gemma3",
        gemma3,
        seed=9,
        classic_spelling=False,
        arch="gemma3",
        perturbations={
            "sliding window ignored": lambda kw: kw.update(sliding_window=4096),
            "query_pre_attn_scalar ignored (head_dim)": lambda kw: kw.update(query_pre_attn_scalar=24),
            "local rope base = global": rope3(sliding={"rope_type": "default", "rope_theta": 1000000.0}),
            "global rope scaling dropped": rope3(full={"rope_type": "default", "rope_theta": 1000000.0}),
            "every layer global": lambda kw: kw.update(layer_types=["full_attention"] * 4),
        },
        weight_perturbations={"norm applies w, not 1 + w": norm_minus_one, "q/k norm dropped": qk_norm_dropped},
    )

    def offset_dropped(model):
        # Position p reading row p instead of p + 2: shift the table down by two rows.
        t = model.model.decoder.embed_positions.weight
        t.copy_(torch.roll(t, shifts=2, dims=0))

    # OPT: learned positions at offset 2, LayerNorm with bias, ReLU MLP, biases, MHA.
    fixture(
        "opt",
        dict(
            vocab_size=384,
            hidden_size=64,
            ffn_dim=112,
            num_hidden_layers=3,
            num_attention_heads=4,
            max_position_embeddings=128,
            do_layer_norm_before=True,
            word_embed_proj_dim=64,
            pad_token_id=1,
        ),
        seed=8,
        classic_spelling=False,
        arch="opt",
        perturbations={},
        weight_perturbations={"position offset 2 dropped": offset_dropped, "biases dropped": zero(".bias")},
    )


if __name__ == "__main__":
    main()
