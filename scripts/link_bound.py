#!/usr/bin/env python3
"""Exact offload against the link's bound: decode speed of `headwise`, `layer` and `auto`
over a simulated host-device link, as a share of what the link allows (bytes moved per
decoded token ÷ bandwidth), with the link's busy share of decode time.

Rows: SmolLM2-135M Q4_1 at 3.9K tokens and Gemma 3 270M Q4_K_M at 16K tokens (the default
models of the `llama` and `gemma` examples, fetched once; Gemma also through `--prompts-file`,
the batched path the server runs, one random prompt), and a synthetic 128K-token
history on SmolLM2-135M's shape with random weights (kvbench --synthetic-history). Each
run is its own process; bytes per token come from `--stats-out`'s decode counters.

    python3 scripts/link_bound.py                      # the table, 2 GB/s
    python3 scripts/link_bound.py --rows smollm2 --policies headwise --steps 8   # quick
    python3 scripts/link_bound.py --bin-dir /tmp/before --label before

A binary without the decode counters (an older build) gets its bytes per token from the
same run of the build in target/release (byte counts do not change between builds: the
tests assert them), so before/after tables share one bound.
"""
import argparse
import csv
import json
import os
import random
import subprocess
import tempfile

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
RELEASE = os.path.join(ROOT, "target", "release", "examples")


def last_line(proc):
    """The last line of a failed run's stderr, or its exit status when it printed nothing."""
    lines = proc.stderr.strip().splitlines()
    return lines[-1][:160] if lines else f"exit status {proc.returncode}"


def example_run(binary, context, steps, policy, bandwidth, tmp):
    """One `llama`/`gemma` run: its --stats-out as a dict."""
    stats = os.path.join(tmp, "stats.json")
    cmd = [binary, "--cpu", "--random-prompt", str(context), "--max-new-tokens",
           str(steps + 1), "--temperature", "0", "--policy", policy,
           "--link-bandwidth", bandwidth, "--stats-out", stats]
    proc = subprocess.run(cmd, capture_output=True, text=True)
    if proc.returncode != 0:
        return {"error": last_line(proc)}
    with open(stats) as f:
        st = json.load(f)
    return {
        "decode_tok_s": st["decode_tokens"] / max(st["decode_s"], 1e-9),
        "bytes_per_token": (st["decode_link_bytes"] / max(st["decode_tokens"], 1)
                            if "decode_link_bytes" in st else None),
        "utilization": st.get("link_utilization"),
    }


def batch_run(binary, context, steps, policy, bandwidth, tmp):
    """One `llama`/`gemma` run through `--prompts-file` (the batched path the server uses too)
    with one random prompt of `context` ids: decode bytes and link time from the per-step
    stats (`steps`: one entry per prefill chunk, then one per decode step)."""
    prompts = os.path.join(tmp, "prompts.jsonl")
    rng = random.Random(context)
    with open(prompts, "w") as f:
        f.write(json.dumps([rng.randrange(300, 32000) for _ in range(context)]) + "\n")
    stats = os.path.join(tmp, "stats.json")
    cmd = [binary, "--cpu", "--prompts-file", prompts, "--max-new-tokens", str(steps + 1),
           "--temperature", "0", "--policy", policy, "--link-bandwidth", bandwidth,
           "--stats-out", stats]
    proc = subprocess.run(cmd, capture_output=True, text=True)
    if proc.returncode != 0:
        return {"error": last_line(proc)}
    with open(stats) as f:
        st = json.load(f)
    per_step, n = st["steps"], st["decode_tokens"]
    start, end = per_step[len(per_step) - n - 1], per_step[-1]
    moved = sum(end[k] - start[k] for k in ("h2d_bytes", "d2h_bytes"))
    decode_s = max(st["decode_s"], 1e-9)
    return {
        "decode_tok_s": n / decode_s,
        "bytes_per_token": moved / max(n, 1),
        "utilization": (end["link_busy_s"] - start["link_busy_s"]) / decode_s,
    }


def synthetic_run(binary, context, steps, policy, bandwidth, tmp):
    """One kvbench run over a synthetic history on SmolLM2-135M's shape."""
    with open(os.path.join(ROOT, "scripts", "configs", "smollm2-135m.json")) as f:
        cfg = json.load(f)
    cfg["max_position_embeddings"] = context + steps + 1
    config = os.path.join(tmp, "smollm2-long.json")
    with open(config, "w") as f:
        json.dump(cfg, f)
    out = os.path.join(tmp, "kvbench.csv")
    cmd = [binary, "--cpu", "--random-weights", "--config", config, "--synthetic-history",
           "--context", str(context), "--steps", str(steps), "--repeats", "1",
           "--policies", policy, "--no-stock", "--link-bandwidth", bandwidth, "--csv", out]
    proc = subprocess.run(cmd, capture_output=True, text=True)
    if proc.returncode != 0:
        return {"error": last_line(proc)}
    with open(out) as f:
        row = next(r for r in csv.DictReader(f) if r["policy"] == policy)
    return {
        "decode_tok_s": float(row["decode_tok_s"]),
        "bytes_per_token": int(row["h2d_bytes_per_token"]) + int(row["d2h_bytes_per_token"]),
        "utilization": float(row["link_utilization"]) if "link_utilization" in row else None,
    }


# Each row: its model, binary, context, runner and `auto`'s budget there (the two streaming
# buffers and a 2,048-token prefill chunk's scratch first, then resident units: about half
# of the cache resident). A synthetic history cannot be stored into `auto` (it places units
# as they attend), so that row runs `full` instead: the compute's own bound, no link.
ROWS = {
    "smollm2": ("SmolLM2-135M Q4_1", "llama", 3900, example_run, "128MiB"),
    "gemma3": ("Gemma 3 270M Q4_K_M", "gemma", 16000, example_run, "192MiB"),
    "gemma3-batch": ("Gemma 3 270M Q4_K_M, --prompts-file", "gemma", 16000, batch_run, "192MiB"),
    "synthetic": ("SmolLM2-135M shape, synthetic", "kvbench", 131072, synthetic_run, None),
}


def bandwidth_bytes(text):
    units = {"GB": 1e9, "MB": 1e6, "KB": 1e3, "B": 1}
    for u, f in units.items():
        if text.upper().endswith(u):
            return float(text[: -len(u)]) * f
    return float(text)


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--bin-dir", default=RELEASE, help="where llama, gemma and kvbench are")
    ap.add_argument("--label", default="after", help="name of the build in the table")
    ap.add_argument("--rows", default="smollm2,gemma3,gemma3-batch,synthetic")
    ap.add_argument("--policies", default="headwise,layer,auto",
                    help="`auto` takes the row's budget; `auto:SIZE` a budget of its own")
    ap.add_argument("--steps", type=int, default=24, help="decode steps per run")
    ap.add_argument("--synthetic-steps", type=int, default=4)
    ap.add_argument("--bandwidth", default="2GB")
    args = ap.parse_args()
    bw = bandwidth_bytes(args.bandwidth)
    print(f"| build | model | context | policy | bytes/token | link bound tok/s | decode tok/s "
          f"| share of bound | link busy ÷ decode |")
    print("|---|---|---:|---|---:|---:|---:|---:|---:|")
    with tempfile.TemporaryDirectory() as tmp:
        for key in args.rows.split(","):
            name, exe, context, runner, budget = ROWS[key]
            steps = args.synthetic_steps if key == "synthetic" else args.steps
            for policy in args.policies.split(","):
                if policy == "auto":
                    policy = f"auto:{budget}" if budget else "full"
                r = runner(os.path.join(args.bin_dir, exe), context, steps, policy,
                           args.bandwidth, tmp)
                if "error" in r:
                    print(f"| {args.label} | {name} | {context} | {policy} | error: {r['error']} "
                          f"| | | | |", flush=True)
                    continue
                if r["bytes_per_token"] is None:
                    ref = runner(os.path.join(RELEASE, exe), context, steps, policy,
                                 args.bandwidth, tmp)
                    r["bytes_per_token"] = ref["bytes_per_token"]
                util = "–" if r["utilization"] is None else f"{r['utilization']:.2f}"
                if r["bytes_per_token"]:
                    bound = bw / r["bytes_per_token"]
                    bound_text, share = f"{bound:.2f}", f"{r['decode_tok_s'] / bound:.2f}"
                else:
                    bound_text, share = "– (no link)", "–"
                print(f"| {args.label} | {name} | {context} | {policy} "
                      f"| {(r['bytes_per_token'] or 0) / 1e6:.1f} MB | {bound_text} "
                      f"| {r['decode_tok_s']:.2f} | {share} | {util} |", flush=True)


if __name__ == "__main__":
    main()
