"""Shared by the scripts that record llama.cpp references (make_llamacpp_refs.py,
make_gemma3_refs.py): the pinned llama-cpp-python version, the cached model path, the
texts every vocabulary is checked on, tokenization and greedy decoding.

Pinned: llama-cpp-python==0.3.36 (built from source: `CMAKE_ARGS=-DGGML_NATIVE=OFF pip
install llama-cpp-python==0.3.36`).
"""
import hashlib
import json
import os
import sys
from pathlib import Path

import llama_cpp
import numpy as np

PINNED = "0.3.36"
FIXTURES = Path(__file__).resolve().parent.parent / "tests" / "fixtures"

# Plain texts tokenized by every reference script, before each model's chat-formatted one.
PLAIN_TEXTS = [
    ("The capital of France is", False),
    ("Hello, world! 12345 numbers and 3.14159", False),
    ("  leading spaces\nand newlines\n\n\ttabs", False),
    ("unicode: café naïve 日本語 🙂 — done", False),
    ("don't you'll I'M we've", False),
]


def check_pinned():
    """Exits unless this is the pinned llama-cpp-python (or --any-version was given)."""
    if llama_cpp.__version__ != PINNED and "--any-version" not in sys.argv:
        sys.exit(f"references are pinned to llama-cpp-python {PINNED}, this is {llama_cpp.__version__}")


def model_path(file_name):
    """The GGUF named on the command line, else the kvpolicy cache's copy of `file_name`."""
    args = [a for a in sys.argv[1:] if not a.startswith("--")]
    if args:
        return Path(args[0])
    cache = os.environ.get("KVPOLICY_CACHE") or os.path.join(
        os.environ.get("XDG_CACHE_HOME") or os.path.expanduser("~/.cache"), "kvpolicy"
    )
    return Path(cache) / file_name


def sha256(path):
    """The file's SHA-256, recorded beside the references."""
    return hashlib.sha256(Path(path).read_bytes()).hexdigest()


def tokenizations(llm, texts):
    """llama.cpp's ids of each (text, parse_special) with a BOS."""
    return [{"text": t, "special": s, "ids": llm.tokenize(t.encode(), add_bos=True, special=s)} for t, s in texts]


def greedy(llm, ids, n):
    """llama.cpp's greedy continuation of `ids`: at most `n` tokens, stopping after EOS."""
    llm.reset()
    out = []
    for tok in llm.generate(ids, top_k=1, top_p=1.0, temp=0.0, repeat_penalty=1.0, reset=True):
        out.append(int(tok))
        if len(out) == n or tok == llm.token_eos():
            break
    return out


def margins(llm, prompt, ids):
    """Teacher-forced along `ids` after `prompt`: at each step, llama.cpp's logit of ids[i]
    minus its best other logit (positive where ids[i] is its greedy choice)."""
    llm.reset()
    llm.eval(prompt)
    out = []
    for tok in ids:
        # The last evaluated token's logits (llama-cpp-python keeps no scores without
        # logits_all, and logits_all over a 12K-token prompt would take gigabytes).
        row = np.ctypeslib.as_array(llm._ctx.get_logits(), shape=(llm.n_vocab(),)).astype(np.float64)
        chosen = row[tok]
        row[tok] = -np.inf
        out.append(round(float(chosen - row.max()), 6))
        llm.eval([tok])
    return out


def write_json(out, script, record):
    """Writes `record` (with its generator line first) to `out`."""
    body = {"generator": f"scripts/{script}, llama-cpp-python {llama_cpp.__version__}", **record}
    out.write_text(json.dumps(body, indent=1) + "\n")
    print(f"wrote {out}")
