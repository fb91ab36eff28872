#!/usr/bin/env python3
"""The peer of kvbench's GPU rows: HF transformers (eager PyTorch, SDPA attention) on the same
random-weight config, bf16 on the GPU, timed as kvbench times (prefill in chunks of
`--chunk` tokens, then `--steps` greedy decode steps, each step synchronised; median s/token),
with its KV cache on the GPU (`DynamicCache`) and offloaded to the host
(`DynamicCache(offloading=True)`: each layer's K/V copied in before its attention).

    python3 scripts/hf_gpu_peer.py scripts/configs/llama3-8b.json --context 4096 32768

Random weights make speed, not output, meaningful. A 512-token run comes first, untimed (cuBLAS
and the allocator warm up). Prints a Markdown table.
"""
import argparse
import json
import statistics
import time

import torch
from transformers import DynamicCache, LlamaConfig, LlamaForCausalLM


def timed(fn):
    torch.cuda.synchronize()
    t = time.perf_counter()
    out = fn()
    torch.cuda.synchronize()
    return out, time.perf_counter() - t


def cache(cfg, offload):
    try:
        return DynamicCache(config=cfg, offloading=offload)
    except TypeError:  # an older signature
        from transformers import OffloadedCache

        return OffloadedCache() if offload else DynamicCache()


def run(model, cfg, context, chunk, steps, offload):
    torch.manual_seed(0)
    ids = torch.randint(0, cfg.vocab_size, (1, context), device="cuda")
    kv = cache(cfg, offload)
    torch.cuda.reset_peak_memory_stats()

    def prefill():
        out = None
        for i in range(0, context, chunk):
            out = model(input_ids=ids[:, i : i + chunk], past_key_values=kv, use_cache=True, logits_to_keep=1)
        return out

    with torch.inference_mode():
        out, pre_s = timed(prefill)
        tok = out.logits[:, -1:].argmax(-1)
        per = []
        for _ in range(steps):
            out, s = timed(lambda: model(input_ids=tok, past_key_values=kv, use_cache=True, logits_to_keep=1))
            tok = out.logits[:, -1:].argmax(-1)
            per.append(s)
    return context / pre_s, statistics.median(per), torch.cuda.max_memory_allocated()


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("config")
    ap.add_argument("--context", type=int, nargs="+", default=[4096, 32768])
    ap.add_argument("--chunk", type=int, default=2048)
    ap.add_argument("--steps", type=int, default=8)
    a = ap.parse_args()
    cfg = LlamaConfig(**json.load(open(a.config)))
    cfg._attn_implementation = "sdpa"
    torch.manual_seed(0)
    t = time.perf_counter()
    with torch.device("cuda"):
        torch.set_default_dtype(torch.bfloat16)
        model = LlamaForCausalLM(cfg).eval()
    print(f"HF transformers, random weights for {a.config}, bf16, sdpa, on {torch.cuda.get_device_name()}; init {time.perf_counter() - t:.1f} s")
    run(model, cfg, 512, a.chunk, 2, False)  # warm-up, not reported
    print("| context | cache | prefill tok/s | decode tok/s | s/token | peak GPU memory (torch) |")
    print("|---:|---|---:|---:|---:|---:|")
    for c in a.context:
        for offload in (False, True):
            try:
                pre, s, peak = run(model, cfg, c, a.chunk, a.steps, offload)
                name = "offloaded" if offload else "on the GPU"
                print(f"| {c} | {name} | {pre:.1f} | {1 / s:.2f} | {s:.4f} | {peak / 2**30:.2f} GiB |", flush=True)
            except Exception as e:  # one failing row must not hide the others
                print(f"| {c} | {'offloaded' if offload else 'on the GPU'} | failed: {type(e).__name__}: {e} |", flush=True)


if __name__ == "__main__":
    main()
