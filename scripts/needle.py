#!/usr/bin/env python3
"""Needle in a haystack on Gemma 3 270M under every policy, through the `gemma` example.

Reads the needle prompts recorded by scripts/make_gemma3_refs.py (tests/fixtures/
gemma3_llamacpp.json: llama.cpp's token ids and greedy answer), runs each through
`target/release/examples/gemma` under each policy (one process per row, prompt ids passed
as a one-line .jsonl prompts file), and prints a Markdown table: prompt tokens, the answer,
whether it names the needle, whether the ids equal `full`'s and llama.cpp's, prefill
tokens/s, peak device KV and the process's peak RSS.

    cargo build --release --example gemma
    python3 scripts/needle.py [--runs needle_12k] [--policies full,layer,headwise:1,recompute,hybrid]
"""
import argparse
import json
import subprocess
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
REFS = ROOT / "tests" / "fixtures" / "gemma3_llamacpp.json"
BIN = ROOT / "target" / "release" / "examples" / "gemma"


def run(policy, prompt_ids, new, tmp):
    name, _, arg = policy.partition(":")
    prompts = tmp / "prompt.jsonl"
    prompts.write_text(json.dumps(prompt_ids) + "\n")
    ids, stats = tmp / "ids.json", tmp / "stats.json"
    cmd = [str(BIN), "--prompts-file", str(prompts), "--policy", name, "--max-new-tokens", str(new),
           "--ids-out", str(ids), "--stats-out", str(stats)]
    if arg:
        cmd += ["--head-group", arg] if name == "headwise" else ["--recompute-split", arg]
    out = subprocess.run(cmd, capture_output=True, text=True, check=True)
    got = json.loads(ids.read_text())[0]["generated_ids"]
    text = out.stdout.strip().split("] ", 1)[-1]
    return got, text, json.loads(stats.read_text())


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--runs", default="needle_3k,needle_12k")
    ap.add_argument("--policies", default="full,layer,headwise:1,recompute,hybrid")
    ap.add_argument("--new", type=int, default=8)
    a = ap.parse_args()
    refs = json.loads(REFS.read_text())
    answer = refs["needle"].split(" is ", 1)[1].rstrip(".")
    print("| prompt | tokens | policy | answer | needle | = full | = llama.cpp | prefill tok/s | peak device KV | peak RSS |")
    print("|---|---:|---|---|---|---|---|---:|---:|---:|")
    with tempfile.TemporaryDirectory() as d:
        tmp = Path(d)
        for want_run in a.runs.split(","):
            r = next(g for g in refs["greedy"] if g["name"] == want_run)
            full_ids = None
            for policy in a.policies.split(","):
                got, text, st = run(policy, r["prompt_ids"], a.new, tmp)
                full_ids = full_ids if full_ids is not None else got
                lc = r["generated_ids"][: len(got)]
                print(
                    f"| {want_run} | {len(r['prompt_ids'])} | `{policy}` | {text!r} | {'yes' if answer in text else 'NO'} "
                    f"| {'yes' if got == full_ids else 'NO'} | {'yes' if got == lc else 'NO'} "
                    f"| {st['prefill_tokens'] / max(st['prefill_s'], 1e-9):.0f} | {st['device_kv_peak_bytes'] / 2**20:.1f} MiB "
                    f"| {st.get('peak_rss_bytes', 0) / 2**20:.0f} MiB |",
                    flush=True,
                )


if __name__ == "__main__":
    main()
