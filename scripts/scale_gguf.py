#!/usr/bin/env python3
"""Writes random-weight GGUFs of real model shapes for speed benchmarks at scale
(scripts/scale_bench.py): Llama 3.2 1B, Llama 3 8B, Qwen2.5 1.5B / 7B, Mistral 7B, as Q4_0 or
Q8_0 — every matrix in that type, embedding and output included, as `llama-quantize --pure`
writes them (llama.cpp's default Q4_0 would keep the output, or a tied table, in Q6_K) — or a
Q4_K_M-like mix (Q4_K, with Q6_K for attention V, MLP down and the output or the tied table,
as llama.cpp's Q4_K_M keeps them).

The weights are random quantized blocks (uniform bytes, scales of a few thousandths), written
directly in their block layout — no f32 copy of an 8B model is ever made — with a placeholder
SentencePiece vocabulary of the shape's size, so llama.cpp and kvpolicy load the same file.
Random weights make every logit a near-tie: these files time speed and memory only; exactness
is tested on the real models and the fixtures.

Pinned: gguf==0.19.0 (PyPI).
    python3 scripts/scale_gguf.py --shape llama-1b --quant q4_0 --out /tmp/llama-1b.q4_0.gguf
"""
import argparse
import pathlib
import sys

import gguf
import numpy as np

# name: (architecture, layers, hidden, heads, kv heads, head dim, feed-forward, vocab, tied, qkv bias, rope theta)
SHAPES = {
    "llama-1b": ("llama", 16, 2048, 32, 8, 64, 8192, 128256, True, False, 500000.0),
    "llama-8b": ("llama", 32, 4096, 32, 8, 128, 14336, 128256, False, False, 500000.0),
    "qwen2.5-1.5b": ("qwen2", 28, 1536, 12, 2, 128, 8960, 151936, True, True, 1000000.0),
    "qwen2.5-7b": ("qwen2", 28, 3584, 28, 4, 128, 18944, 152064, False, True, 1000000.0),
    "mistral-7b": ("llama", 32, 4096, 32, 8, 128, 14336, 32000, False, False, 1000000.0),
}
Q = gguf.GGMLQuantizationType
QUANTS = {"q4_0": Q.Q4_0, "q8_0": Q.Q8_0, "q4_k_m": Q.Q4_K}
# Bytes per block and elements per block, and where each block's f16 scales sit (byte offsets).
LAYOUT = {Q.Q4_0: (18, 32, [0]), Q.Q8_0: (34, 32, [0]), Q.Q4_K: (144, 256, [0, 2]), Q.Q6_K: (210, 256, [208])}


def random_blocks(rng, rows, cols, kind):
    """`rows` rows of `cols` elements as random blocks of `kind` (a uint8 array)."""
    size, elems, scales = LAYOUT[kind]
    if cols % elems:
        sys.exit(f"{cols} columns are not whole {kind.name} blocks of {elems}")
    blocks = rng.integers(0, 256, size=(rows * cols // elems, size), dtype=np.uint8)
    for at in scales:
        d = (rng.random(len(blocks), dtype=np.float32) * 0.004 + 0.001).astype(np.float16)
        blocks[:, at:at + 2] = d.view(np.uint8).reshape(-1, 2)
    return blocks.reshape(rows, -1)


def vocab(writer, n):
    """A placeholder SentencePiece vocabulary of `n` tokens (<unk>, <s>, </s>, bytes, pieces)."""
    tokens = ["<unk>", "<s>", "</s>"] + [f"<0x{b:02X}>" for b in range(256)]
    tokens += [f"\u2581t{i}" for i in range(n - len(tokens))]
    writer.add_tokenizer_model("llama")
    writer.add_token_list(tokens[:n])
    writer.add_token_scores([0.0] * 3 + [0.0] * 256 + [-float(i) for i in range(n - 259)])
    writer.add_token_types([2, 3, 3] + [6] * 256 + [1] * (n - 259))
    writer.add_unk_token_id(0)
    writer.add_bos_token_id(1)
    writer.add_eos_token_id(2)
    writer.add_add_bos_token(False)


def write(shape, quant, out, seed=0):
    arch, layers, hidden, heads, kv_heads, head_dim, ff, n_vocab, tied, bias, theta = SHAPES[shape]
    main = QUANTS[quant]
    # Q4_K_M keeps attention V, MLP down and the output in Q6_K (llama.cpp's mix, simplified:
    # every layer rather than half of them).
    big = Q.Q6_K if quant == "q4_k_m" else main
    rng = np.random.default_rng(seed)
    tmp = out.with_name(out.name + ".partial")
    wr = gguf.GGUFWriter(str(tmp), arch)
    wr.add_name(f"random {shape} {quant}")
    wr.add_context_length(131072 if arch == "llama" else 32768)
    wr.add_embedding_length(hidden)
    wr.add_block_count(layers)
    wr.add_feed_forward_length(ff)
    wr.add_head_count(heads)
    wr.add_head_count_kv(kv_heads)
    wr.add_key_length(head_dim)
    wr.add_value_length(head_dim)
    wr.add_layer_norm_rms_eps(1e-5 if arch == "llama" else 1e-6)
    wr.add_rope_freq_base(theta)
    if arch == "llama":
        wr.add_rope_dimension_count(head_dim)
    wr.add_file_type({"q4_0": gguf.LlamaFileType.MOSTLY_Q4_0, "q8_0": gguf.LlamaFileType.MOSTLY_Q8_0,
                      "q4_k_m": gguf.LlamaFileType.MOSTLY_Q4_K_M}[quant])
    vocab(wr, n_vocab)

    def weight(name, rows, cols, kind):
        wr.add_tensor(name, random_blocks(rng, rows, cols, kind), raw_dtype=kind)

    def norm(name, n):
        wr.add_tensor(name, (1.0 + 0.01 * rng.standard_normal(n)).astype(np.float32))

    # A tied table is also the output: Q6_K in the Q4_K_M mix, as llama.cpp makes it.
    weight("token_embd.weight", n_vocab, hidden, big if tied else main)
    norm("output_norm.weight", hidden)
    if not tied:
        weight("output.weight", n_vocab, hidden, big)
    for i in range(layers):
        p = f"blk.{i}."
        norm(p + "attn_norm.weight", hidden)
        norm(p + "ffn_norm.weight", hidden)
        weight(p + "attn_q.weight", heads * head_dim, hidden, main)
        weight(p + "attn_k.weight", kv_heads * head_dim, hidden, main)
        weight(p + "attn_v.weight", kv_heads * head_dim, hidden, big)
        weight(p + "attn_output.weight", hidden, heads * head_dim, main)
        if bias:
            for b, n in (("q", heads), ("k", kv_heads), ("v", kv_heads)):
                wr.add_tensor(p + f"attn_{b}.bias", (0.01 * rng.standard_normal(n * head_dim)).astype(np.float32))
        weight(p + "ffn_gate.weight", ff, hidden, main)
        weight(p + "ffn_up.weight", ff, hidden, main)
        weight(p + "ffn_down.weight", hidden, ff, big)
    try:
        wr.write_header_to_file()
        wr.write_kv_data_to_file()
        wr.write_tensors_to_file()
        wr.close()
        tmp.rename(out)
    finally:
        tmp.unlink(missing_ok=True)


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--shape", choices=sorted(SHAPES), required=True, help="the model shape")
    ap.add_argument("--quant", choices=sorted(QUANTS), required=True, help="the weights' format")
    ap.add_argument("--out", type=pathlib.Path, required=True, help="the GGUF to write (replaced whole)")
    ap.add_argument("--seed", type=int, default=0, help="the random generator's seed")
    a = ap.parse_args()
    if not a.out.parent.is_dir():
        sys.exit(f"--out {a.out}: its directory does not exist; create it first")
    write(a.shape, a.quant, a.out, a.seed)
    print(f"wrote {a.out} ({a.out.stat().st_size / 1e9:.2f} GB)")


if __name__ == "__main__":
    main()
