#!/usr/bin/env python3
"""Writes GGUF files from the tiny HF fixtures, and llama.cpp's logits on them.

For each fixture (tests/fixtures/{llama_gqa,mistral,qwen2,gemma,gemma2,gemma3}) it writes
tests/fixtures/gguf/NAME.gguf the way llama.cpp's convert_hf_to_gguf.py names and
transforms the tensors — q/k rows permuted for the `llama` architecture (Llama, Mistral),
Gemma's RMSNorm weights stored with their `+ 1`, f32 throughout — with the architecture's
metadata and a placeholder SentencePiece vocabulary of the fixture's size (`<unk>`, `<s>`,
`</s>`, 256 byte tokens, then plain pieces). Then llama.cpp (llama-cpp-python) evaluates
the fixture's token ids on the file and the logits of every position are written to
tests/fixtures/gguf/NAME.logits.npy (float32 [tokens, vocab]).

For the Gemma family a second run writes NAME.f32gelu.logits.npy: llama.cpp's CPU backend
evaluates GeLU through a table indexed by the f16-rounded input and holding f16 outputs
(`GGML_GELU_FP16` in ggml-cpu), which moves these logits by 2e-3 to 6e-3 — all of the
difference from HF on `gemma`, traced tensor by tensor through llama.cpp's eval callback
(every tensor before the first `ffn_geglu` agrees to 1e-7, that one by f16 rounding). The
second run uses the same callback (`cb_eval`) to overwrite each `ffn_geglu-N` node, right
after llama.cpp computed it, with GeLU(gate)·up evaluated in f64 from llama.cpp's own gate
and up tensors; everything else is llama.cpp's f32 path unchanged. The number of nodes
replaced is checked against the layer count.

What llama.cpp does with these files is its own reading of the metadata, which is what the
test (`tests/gguf_fixtures.rs`) compares against: a Mistral GGUF has architecture `llama`
(no sliding window), Gemma 2/3 scale queries by head_dim^-1/2 and Gemma 3 slides on five
layers of six, whatever the HF config said.

Pinned: llama-cpp-python==0.3.36, gguf==0.19.0, torch/transformers as make_fixtures.py.
    python3 scripts/make_gguf_fixtures.py
"""
import ctypes
import json
import sys
from pathlib import Path

import gguf
import llama_cpp
import llama_cpp.llama as llama_high
import numpy as np
from safetensors.numpy import load_file

ROOT = Path(__file__).resolve().parent.parent
FIX = ROOT / "tests" / "fixtures"
OUT = FIX / "gguf"
ARCH = {"llama_gqa": "llama", "mistral": "llama", "qwen2": "qwen2", "gemma": "gemma", "gemma2": "gemma2", "gemma3": "gemma3"}


class GgmlTensor(ctypes.Structure):
    """The head of ggml's `struct ggml_tensor` (ggml.h) in the llama.cpp of llama-cpp-python 0.3.36."""

    _fields_ = [("type", ctypes.c_int), ("buffer", ctypes.c_void_p), ("ne", ctypes.c_int64 * 4),
                ("nb", ctypes.c_size_t * 4), ("op", ctypes.c_int), ("op_params", ctypes.c_int32 * 16),
                ("flags", ctypes.c_int32), ("src", ctypes.c_void_p * 10), ("view_src", ctypes.c_void_p),
                ("view_offs", ctypes.c_size_t), ("data", ctypes.c_void_p), ("name", ctypes.c_char * 64)]


def f32_view(ptr):
    """The data of a contiguous f32 tensor on the CPU backend, as a writable numpy view."""
    t = ctypes.cast(ptr, ctypes.POINTER(GgmlTensor)).contents
    if t.type != 0 or t.nb[0] != 4 or t.nb[1] != 4 * t.ne[0]:
        sys.exit(f"{t.name!r} is not a contiguous f32 tensor; the ggml_tensor layout changed?")
    n = t.ne[0] * t.ne[1] * t.ne[2] * t.ne[3]
    return t, np.ctypeslib.as_array(ctypes.cast(t.data, ctypes.POINTER(ctypes.c_float)), shape=(n,))


REPLACED = [0]


@llama_cpp.ggml_backend_sched_eval_callback
def exact_gelu(ptr, ask, _user):
    """Asks for each `ffn_geglu-N` node and overwrites it with GeLU(gate)·up in f64."""
    t = ctypes.cast(ptr, ctypes.POINTER(GgmlTensor)).contents
    if ask:
        return t.name.startswith(b"ffn_geglu-")
    gate_t, gate = f32_view(t.src[0])
    up_t, up = f32_view(t.src[1])
    if not (gate_t.name.startswith(b"ffn_gate-") and up_t.name.startswith(b"ffn_up-")):
        sys.exit(f"{t.name!r} has sources {gate_t.name!r}, {up_t.name!r}; expected ffn_gate-N, ffn_up-N")
    x = gate.astype(np.float64)
    y = 0.5 * x * (1.0 + np.tanh(np.sqrt(2.0 / np.pi) * (x + 0.044715 * x**3))) * up.astype(np.float64)
    f32_view(ptr)[1][:] = y.astype(np.float32)
    REPLACED[0] += 1
    return True


def llamacpp_logits(path, seq, callback=None):
    """llama.cpp's logits at every position of `seq` (f32 KV cache, 2 threads)."""
    default_params = llama_high.llama_cpp.llama_context_default_params

    def with_callback():
        p = default_params()
        if callback is not None:
            p.cb_eval = callback
        return p

    llama_high.llama_cpp.llama_context_default_params = with_callback
    try:
        # f32 KV cache: llama.cpp's default f16 cache alone moves these logits by ~0.02.
        llm = llama_cpp.Llama(model_path=str(path), n_ctx=128, n_batch=128, logits_all=True, n_threads=2,
                              type_k=0, type_v=0, verbose=False)
        llm.eval(seq)
        return np.array(llm.scores[: len(seq)], dtype=np.float32)
    finally:
        llama_high.llama_cpp.llama_context_default_params = default_params


def permute(w, n_head):
    """convert_hf_to_gguf.py's LlamaModel.permute: HF's rotate-half rows to adjacent pairs."""
    return w.reshape(n_head, 2, w.shape[0] // n_head // 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


def vocab(writer, n):
    tokens, scores, types = ["<unk>", "<s>", "</s>"], [0.0, 0.0, 0.0], [2, 3, 3]
    for b in range(256):
        tokens.append(f"<0x{b:02X}>")
        scores.append(0.0)
        types.append(6)
    i = 0
    while len(tokens) < n:
        tokens.append(f"\u2581t{i}")
        scores.append(-float(i))
        types.append(1)
        i += 1
    writer.add_tokenizer_model("llama")
    writer.add_token_list(tokens[:n])
    writer.add_token_scores(scores[:n])
    writer.add_token_types(types[:n])
    writer.add_unk_token_id(0)
    writer.add_bos_token_id(1)
    writer.add_eos_token_id(2)
    writer.add_add_bos_token(False)


def write(name):
    d = FIX / name
    cfg = json.loads((d / "config.json").read_text())
    w = load_file(d / "model.safetensors")
    arch = ARCH[name]
    gemma = arch.startswith("gemma")
    nh, nkv = cfg["num_attention_heads"], cfg.get("num_key_value_heads") or cfg["num_attention_heads"]
    hd = cfg.get("head_dim") or cfg["hidden_size"] // nh
    path = OUT / f"{name}.gguf"
    wr = gguf.GGUFWriter(str(path), arch)
    wr.add_context_length(cfg["max_position_embeddings"])
    wr.add_embedding_length(cfg["hidden_size"])
    wr.add_block_count(cfg["num_hidden_layers"])
    wr.add_feed_forward_length(cfg["intermediate_size"])
    wr.add_head_count(nh)
    wr.add_head_count_kv(nkv)
    wr.add_key_length(hd)
    wr.add_value_length(hd)
    wr.add_layer_norm_rms_eps(cfg.get("rms_norm_eps", 1e-6))
    rope = cfg.get("rope_parameters") or {}
    rope = rope.get("full_attention", rope)
    wr.add_rope_freq_base(rope.get("rope_theta") or cfg.get("rope_theta") or 10000.0)
    if arch == "llama":
        wr.add_rope_dimension_count(hd)
    if rope.get("rope_type") == "linear":
        wr.add_rope_scaling_type(gguf.RopeScalingType.LINEAR)
        wr.add_rope_scaling_factor(rope["factor"])
    if arch in ("gemma2", "gemma3"):
        wr.add_sliding_window(cfg["sliding_window"])
    if arch == "gemma2":
        wr.add_attn_logit_softcapping(cfg["attn_logit_softcapping"])
        wr.add_final_logit_softcapping(cfg["final_logit_softcapping"])
    vocab(wr, cfg["vocab_size"])

    def t(gname, x):
        wr.add_tensor(gname, np.ascontiguousarray(x.astype(np.float32)))

    def norm(x):
        return x + 1.0 if gemma else x

    t("token_embd.weight", w["model.embed_tokens.weight"])
    t("output_norm.weight", norm(w["model.norm.weight"]))
    if "lm_head.weight" in w and not cfg.get("tie_word_embeddings"):
        t("output.weight", w["lm_head.weight"])
    for i in range(cfg["num_hidden_layers"]):
        p = f"model.layers.{i}."
        q, k = w[p + "self_attn.q_proj.weight"], w[p + "self_attn.k_proj.weight"]
        if arch == "llama":
            q, k = permute(q, nh), permute(k, nkv)
        t(f"blk.{i}.attn_q.weight", q)
        t(f"blk.{i}.attn_k.weight", k)
        t(f"blk.{i}.attn_v.weight", w[p + "self_attn.v_proj.weight"])
        t(f"blk.{i}.attn_output.weight", w[p + "self_attn.o_proj.weight"])
        for b in ("q", "k", "v"):
            if p + f"self_attn.{b}_proj.bias" in w:
                t(f"blk.{i}.attn_{b}.bias", w[p + f"self_attn.{b}_proj.bias"])
        t(f"blk.{i}.attn_norm.weight", norm(w[p + "input_layernorm.weight"]))
        if arch in ("gemma2", "gemma3"):
            t(f"blk.{i}.post_attention_norm.weight", norm(w[p + "post_attention_layernorm.weight"]))
            t(f"blk.{i}.ffn_norm.weight", norm(w[p + "pre_feedforward_layernorm.weight"]))
            t(f"blk.{i}.post_ffw_norm.weight", norm(w[p + "post_feedforward_layernorm.weight"]))
        else:
            t(f"blk.{i}.ffn_norm.weight", norm(w[p + "post_attention_layernorm.weight"]))
        if arch == "gemma3":
            t(f"blk.{i}.attn_q_norm.weight", norm(w[p + "self_attn.q_norm.weight"]))
            t(f"blk.{i}.attn_k_norm.weight", norm(w[p + "self_attn.k_norm.weight"]))
        t(f"blk.{i}.ffn_gate.weight", w[p + "mlp.gate_proj.weight"])
        t(f"blk.{i}.ffn_up.weight", w[p + "mlp.up_proj.weight"])
        t(f"blk.{i}.ffn_down.weight", w[p + "mlp.down_proj.weight"])
    wr.write_header_to_file()
    wr.write_kv_data_to_file()
    wr.write_tensors_to_file()
    wr.close()

    ids = json.loads((d / "ids.json").read_text())
    seq = ids["prompt_ids"] + ids["decode_ids"]
    logits = llamacpp_logits(path, seq)
    np.save(OUT / f"{name}.logits.npy", logits)
    print(f"{name}: {path.name} ({arch}), llama.cpp logits {logits.shape}")
    if gemma:
        REPLACED[0] = 0
        exact = llamacpp_logits(path, seq, exact_gelu)
        if REPLACED[0] != cfg["num_hidden_layers"]:
            sys.exit(f"{name}: replaced {REPLACED[0]} GeLU nodes, expected one per layer ({cfg['num_hidden_layers']})")
        np.save(OUT / f"{name}.f32gelu.logits.npy", exact)
        print(f"{name}: llama.cpp with f32 GeLU differs from its table GeLU by {np.abs(exact - logits).max():.2e}")


def main():
    if llama_cpp.__version__ != "0.3.36" and "--any-version" not in sys.argv:
        sys.exit(f"pinned to llama-cpp-python 0.3.36, this is {llama_cpp.__version__}")
    OUT.mkdir(exist_ok=True)
    for name in ARCH:
        write(name)


if __name__ == "__main__":
    main()
