#!/usr/bin/env python3
"""Long-context bench: prefill tok/s, decode s/token, peak process RSS (measured by the
kernel through GNU time), device KV peak and step-scratch peak, per policy and context.

Runs the `llama` example on a SmolLM2-135M-shaped model with random f32 weights and
262,144 positions (scripts/configs/smollm2-135m.json with max_position_embeddings raised),
and on a 2-layer variant of it for the longest context. Each run is a separate process,
so its peak RSS is its own. Rows print as they finish (a markdown table), and with --out
they are appended to a file as well.

    cargo build --release --examples
    python3 scripts/long_context_bench.py                       # 8K, 16K, 32K; 2 layers at 128K
    python3 scripts/long_context_bench.py --contexts 8192 --two-layer 0 --steps 4   # quick
    # an older build of the example (before a change), same prompts where they fit a command line:
    python3 scripts/long_context_bench.py --bin /tmp/before/llama --label before --prefill-chunk 1024

Needs only Python 3 and /usr/bin/time (GNU time).
"""
import argparse
import json
import os
import subprocess
import sys
import tempfile
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
# A single command-line argument may not exceed 128 KiB on Linux (MAX_ARG_STRLEN).
MAX_ARG = 120_000


def configs(tmp, layers_small):
    with open(os.path.join(ROOT, "scripts", "configs", "smollm2-135m.json")) as f:
        base = json.load(f)
    base["max_position_embeddings"] = 262_144
    full = os.path.join(tmp, "smollm2-135m-long.json")
    with open(full, "w") as f:
        json.dump(base, f)
    small = dict(base, num_hidden_layers=layers_small)
    two = os.path.join(tmp, f"smollm2-135m-long-{layers_small}l.json")
    with open(two, "w") as f:
        json.dump(small, f)
    return full, two, base["vocab_size"]


def policy_flags(p):
    if ":" in p:
        name, group = p.split(":", 1)
        return ["--policy", name, "--head-group", group]
    return ["--policy", p]


def run(args, config, vocab, context, policy, tmp):
    stats = os.path.join(tmp, "stats.json")
    ids = os.path.join(tmp, "ids.json")
    prompt = ",".join(str((i * 7919 + 11) % vocab) for i in range(context))
    cmd = [args.bin, "--cpu", "--random-weights", "--config", config, "--seed", "7"]
    if len(prompt) < MAX_ARG:
        cmd += ["--prompt-ids", prompt]
    else:
        cmd += ["--random-prompt", str(context)]
    cmd += ["--max-new-tokens", str(args.steps), "--temperature", "0"]
    cmd += ["--stats-out", stats, "--ids-out", ids]
    if args.prefill_chunk is not None:
        cmd += ["--prefill-chunk", str(args.prefill_chunk)]
    cmd += policy_flags(policy)
    timed = ["/usr/bin/time", "-f", "%M %e"] + cmd
    start = time.time()
    proc = subprocess.run(timed, capture_output=True, text=True, timeout=args.timeout)
    wall = time.time() - start
    if proc.returncode != 0:
        return {"error": proc.stderr.strip().splitlines()[-2:] if proc.stderr else proc.returncode}
    rss_kib, _ = proc.stderr.strip().splitlines()[-1].split()
    with open(stats) as f:
        st = json.load(f)
    with open(ids) as f:
        gen = json.load(f)["generated_ids"]
    return {
        "prefill_tok_s": st["prefill_tokens"] / max(st["prefill_s"], 1e-9),
        "decode_s_tok": st["decode_s"] / max(st["decode_tokens"], 1),
        "rss": int(rss_kib) * 1024,
        "kv_peak": st["device_kv_peak_bytes"],
        "scratch": st.get("device_scratch_peak_bytes"),
        "host_kv": st["host_kv_bytes"],
        "wall": wall,
        "ids": gen,
    }


def mib(b):
    return "–" if b is None else f"{b / 2**20:.1f} MiB"


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--bin", default=os.path.join(ROOT, "target", "release", "examples", "llama"))
    ap.add_argument("--label", default="after", help="name of the build in the table")
    ap.add_argument("--contexts", default="8192,16384,32768")
    ap.add_argument("--policies", default="full,layer,headwise:1")
    ap.add_argument("--two-layer", type=int, default=131_072,
                    help="context for the 2-layer variant (0: skip)")
    ap.add_argument("--two-layer-policies", default="full,headwise:1")
    ap.add_argument("--steps", type=int, default=8, help="decode steps")
    ap.add_argument("--prefill-chunk", type=int, default=None,
                    help="pass --prefill-chunk (default: the example's own default)")
    ap.add_argument("--timeout", type=int, default=3600, help="seconds per run")
    ap.add_argument("--out", help="also append the rows to this file")
    args = ap.parse_args()

    head = ("| build | model | context | policy | prefill tok/s | decode s/token | peak RSS "
            "| device KV peak | step scratch peak | host KV | greedy ids |")
    rule = "|---|---|---:|---|---:|---:|---:|---:|---:|---:|---|"
    out = open(args.out, "a") if args.out else None

    def emit(line):
        print(line, flush=True)
        if out:
            out.write(line + "\n")
            out.flush()

    emit(head)
    emit(rule)
    with tempfile.TemporaryDirectory() as tmp:
        full, two, vocab = configs(tmp, 2)
        plan = [("30 layers", full, int(c), p) for c in args.contexts.split(",") if c
                for p in args.policies.split(",")]
        if args.two_layer:
            plan += [("2 layers", two, args.two_layer, p)
                     for p in args.two_layer_policies.split(",")]
        first_ids = {}
        for model, config, context, policy in plan:
            r = run(args, config, vocab, context, policy, tmp)
            if "error" in r:
                emit(f"| {args.label} | {model} | {context} | {policy} | error: {r['error']} "
                     "| | | | | | |")
                continue
            key = (model, context)
            same = first_ids.setdefault(key, r["ids"]) == r["ids"]
            emit(f"| {args.label} | {model} | {context} | {policy} | {r['prefill_tok_s']:.1f} "
                 f"| {r['decode_s_tok']:.3f} | {mib(r['rss'])} | {mib(r['kv_peak'])} "
                 f"| {mib(r['scratch'])} | {mib(r['host_kv'])} "
                 f"| {'same as first' if same else 'DIFFERENT'} |")
    if out:
        out.close()
    return 0


if __name__ == "__main__":
    sys.exit(main())
