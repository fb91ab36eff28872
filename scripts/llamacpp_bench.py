#!/usr/bin/env python3
"""Times llama.cpp (llama-cpp-python) on a GGUF with kvbench's protocol, so that kvbench's
`--llamacpp` row is measured in the same run, on the same file, ids, threads and steps as
its `full` row.

Protocol (as examples/kvbench/sweep.rs `measure`): prompt ids `(i * 7919 + 13) % vocab` for
i < context, prefilled in batches of `--chunk`; then `--steps` decode steps of one token
each, ids continuing the same formula; the KV cache is cleared between repeats. Prefill and
decode tokens per second are the medians over `--repeats`. llama.cpp's KV cache is f32
(`type_k/type_v = 0`) like kvpolicy's on the CPU, unless `--kv-type` says f16 (its default),
bf16 or q8_0 (`--cache-type-k/v q8_0`; a quantized V cache needs `--flash-attn`).

Prints one JSON object: {"prefill_tok_s": …, "decode_tok_s": …, "load_s": …, "llama_cpp_python": …}
(`load_s`: the seconds `Llama(...)` took to load the file and make its context).

Pinned: llama-cpp-python==0.3.36.
    python3 scripts/llamacpp_bench.py --gguf F --context 512 --steps 64 --repeats 3 --threads 2
"""
import argparse
import json
import statistics
import sys
import time

import llama_cpp

PINNED = "0.3.36"
# ggml's type ids (ggml.h `enum ggml_type`) of the KV cache types compared.
GGML_TYPES = {"f32": 0, "f16": 1, "q8_0": 8, "bf16": 30}


def ids(n, offset, vocab):
    return [((i + offset) * 7919 + 13) % vocab for i in range(n)]


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--gguf", required=True, help="the GGUF file")
    ap.add_argument("--context", type=int, required=True, help="prompt tokens before the timed steps")
    ap.add_argument("--steps", type=int, required=True, help="timed decode steps")
    ap.add_argument("--repeats", type=int, default=3, help="runs (medians reported)")
    ap.add_argument("--threads", type=int, required=True, help="threads for prefill and decode")
    ap.add_argument("--chunk", type=int, default=256, help="prefill batch (tokens per pass)")
    ap.add_argument("--kv-type", choices=sorted(GGML_TYPES), default="f32",
                    help="llama.cpp's KV cache type (f16 is its own default)")
    ap.add_argument("--f16-kv", action="store_true", help="the same as --kv-type f16")
    ap.add_argument("--flash-attn", action="store_true", help="llama.cpp's flash attention on (off unless given)")
    ap.add_argument("--any-version", action="store_true", help="allow another llama-cpp-python version")
    a = ap.parse_args()
    if llama_cpp.__version__ != PINNED and not a.any_version:
        sys.exit(f"pinned to llama-cpp-python {PINNED}, this is {llama_cpp.__version__}")
    t = GGML_TYPES["f16" if a.f16_kv else a.kv_type]
    kv = {"type_k": t, "type_v": t}
    started = time.perf_counter()
    llm = llama_cpp.Llama(model_path=a.gguf, n_ctx=a.context + a.steps + 1, n_batch=max(a.chunk, 1),
                          n_ubatch=max(a.chunk, 1), n_threads=a.threads, n_threads_batch=a.threads,
                          verbose=False, flash_attn=a.flash_attn, **kv)
    load_s = time.perf_counter() - started
    vocab = llm.n_vocab()
    prompt, steps = ids(a.context, 0, vocab), ids(a.steps, a.context, vocab)
    pre, dec = [], []
    for _ in range(max(a.repeats, 1)):
        llm.reset()
        llm._ctx.kv_cache_clear()
        t = time.perf_counter()
        llm.eval(prompt)
        pre.append(a.context / (time.perf_counter() - t))
        t = time.perf_counter()
        for tok in steps:
            llm.eval([tok])
        dec.append(a.steps / (time.perf_counter() - t))
    print(json.dumps({"prefill_tok_s": statistics.median(pre), "decode_tok_s": statistics.median(dec),
                      "load_s": load_s,
                      "llama_cpp_python": llama_cpp.__version__}))


if __name__ == "__main__":
    main()
