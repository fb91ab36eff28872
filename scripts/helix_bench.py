#!/usr/bin/env python3
"""Helix bench: KV-parallel decoding (`--policy helix:local=full`) under 1, 2 and 4 ranks of
`mpirun` on this machine, and the arithmetic for Llama-3-8B at 1M tokens over 8 ranks.

Runs the `llama` example (built with `--features mpi`) on a 2-layer SmolLM2-135M-shaped
model with random f32 weights and 262,144 positions (scripts/configs/smollm2-135m.json),
a random prompt of CONTEXT tokens and 8 teacher-forced decode steps. Per rank count it
prints: every rank's share and KV bytes (the runner's `--stats-out` "ranks"), prefill
tok/s, decode s/token, time in collectives per decode token, the bytes one decode token's
all-gather brings each rank per layer, and whether rank 0's logits equal the 1-rank run's.
What is measured and what is arithmetic is said in the table.

    cargo build --release --features mpi --examples
    python3 scripts/helix_bench.py                          # 128K; 1, 2, 4 ranks
    python3 scripts/helix_bench.py --context 16384 --ranks 1,2   # quick

Needs Python 3, numpy, Open MPI's mpirun.
"""
import argparse
import json
import os
import subprocess
import sys
import tempfile

import numpy as np

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def config(tmp, layers):
    with open(os.path.join(ROOT, "scripts", "configs", "smollm2-135m.json")) as f:
        c = json.load(f)
    c["max_position_embeddings"] = 262_144
    c["num_hidden_layers"] = layers
    path = os.path.join(tmp, f"smollm2-135m-{layers}l-long.json")
    with open(path, "w") as f:
        json.dump(c, f)
    return path, c


def run(args, cfg, ranks, tmp):
    stats = os.path.join(tmp, f"stats-{ranks}.json")
    logits = os.path.join(tmp, f"logits-{ranks}.npy")
    # Not bound to a core each (Open MPI's default for 2 ranks or fewer), and the machine's
    # cores split between the ranks (at least one thread each).
    threads = max(1, (os.cpu_count() or 1) // ranks)
    cmd = ["mpirun", "--allow-run-as-root", "--oversubscribe", "--bind-to", "none",
           "-x", f"RAYON_NUM_THREADS={threads}", "-np", str(ranks),
           args.bin, "--cpu", "--random-weights", "--config", cfg, "--seed", "7",
           "--policy", f"helix:local={args.local}", "--random-prompt", str(args.context),
           "--decode-ids", ",".join(str(100 + i) for i in range(args.steps)),
           "--stats-out", stats, "--dump-logits", logits, "--decode-logits-only"]
    subprocess.run(cmd, check=True, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
    with open(stats) as f:
        s = json.load(f)
    return s, np.load(logits)


def mib(b):
    return f"{b / 2**20:.1f} MiB"


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--bin", default=os.path.join(ROOT, "target", "release", "examples", "llama"))
    ap.add_argument("--context", type=int, default=131_072)
    ap.add_argument("--ranks", default="1,2,4")
    ap.add_argument("--layers", type=int, default=2)
    ap.add_argument("--steps", type=int, default=8)
    ap.add_argument("--local", default="full")
    ap.add_argument("--out", help="append the table to this file too")
    args = ap.parse_args()
    lines = []

    def emit(line):
        print(line, flush=True)
        lines.append(line)

    with tempfile.TemporaryDirectory() as tmp:
        cfg, c = config(tmp, args.layers)
        emit(f"measured: {args.layers}-layer SmolLM2-135M shape, {args.context} prompt tokens, "
             f"{args.steps} teacher-forced decode steps, helix:local={args.local}, f32, "
             f"{os.cpu_count()} CPU cores split between the ranks (one thread each at least)")
        emit("")
        emit("| ranks | KV per rank (device, measured) | tokens per rank | prefill tok/s | decode s/token | "
             "collectives s/token | all-gather bytes per decode token per layer | logits vs 1 rank |")
        emit("|---:|---|---|---:|---:|---:|---:|---|")
        base = None
        for ranks in [int(r) for r in args.ranks.split(",")]:
            s, logits = run(args, cfg, ranks, tmp)
            per = s.get("ranks") or [{"device_kv_bytes": s["device_kv_bytes"],
                                      "share_tokens": s["policy_metrics"]["share_tokens"]["value"]}]
            m = s["policy_metrics"]
            steps = max(s["decode_tokens"], 1)
            if base is None:
                base = logits
            diff = float(np.abs(logits - base).max())
            emit(f"| {ranks} | {', '.join(mib(r['device_kv_bytes']) for r in per)} | "
                 f"{', '.join(str(int(r['share_tokens'])) for r in per)} | "
                 f"{s['prefill_tokens'] / s['prefill_s']:.1f} | {s['decode_s'] / steps:.4f} | "
                 f"{m['decode_collective_s']['value'] / steps:.4f} | "
                 f"{int(m['decode_bytes_per_layer_token']['value'])} | max abs diff {diff:.2e} |")
        # Arithmetic, not measured: Llama-3-8B at 1M tokens over 8 ranks.
        with open(os.path.join(ROOT, "scripts", "configs", "llama3-8b.json")) as f:
            l3 = json.load(f)
        layers, kvh, heads = l3["num_hidden_layers"], l3["num_key_value_heads"], l3["num_attention_heads"]
        d = l3.get("head_dim", l3["hidden_size"] // heads)
        tokens, ranks, f16 = 1 << 20, 8, 2
        kv = 2 * layers * kvh * d * f16 * tokens
        gather = ranks * heads * (d + 1) * 4
        emit("")
        emit(f"arithmetic (not measured): Llama-3-8B ({layers} layers, {heads} heads over {kvh} KV heads of {d}), "
             f"1M tokens, f16 KV, {ranks} ranks: KV {kv / 2**30:.0f} GiB in all, {kv / ranks / 2**30:.0f} GiB per rank; "
             f"each decode token's all-gathers bring every rank {gather} B per layer, "
             f"{gather * layers / 2**20:.2f} MiB per token over {layers} layers (f32 partials), "
             f"against {kv / tokens * tokens / ranks / 2**30:.0f} GiB of KV each rank reads per token.")
    if args.out:
        with open(args.out, "a") as f:
            f.write("\n".join(lines) + "\n")


if __name__ == "__main__":
    sys.exit(main())
