#!/usr/bin/env python3
"""The Performance II table (docs/benchmarks.md, "CPU speed against llama.cpp"): kvpolicy's `full` against
llama.cpp (llama-cpp-python 0.3.36, flash attention on) on the same GGUF, the same prompt ids
and the same decode ids (kvbench's protocol: ids `(i * 7919 + 13) % vocab`, prefill in
chunks of 256, `--steps` decode steps), at each context, with both KV types: f32 (ours
`--kv-dtype f32`, llama.cpp `type_k/type_v` f32) and f16 (ours `--kv-dtype f16`, llama.cpp's
default; `--kv q8_0` adds both sides' q8_0 cache). Peak RSS is the kernel's (`ru_maxrss` of each measured process from `wait4`), one
process per cell, so a row's memory is that run's alone.

    python3 scripts/perf_table.py --python python3 --out bench-results/perf-table.json
    python3 scripts/perf_table.py --quick   # SmolLM2 Q4_1 at 512 only
    python3 scripts/perf_table.py --only Gemma:512   # one model's rows at one context

Models: the default SmolLM2-135M Q4_1 and its Q4_0 / Q5_0 / Q5_1 / Q8_0 requantizations
(scripts/requantize.py, llama.cpp's quantizer) at 512, 4K and 8K; Gemma 3 270M Q4_K_M at 512, 4K, 16K and 30K.
Prints a markdown table and writes every cell as JSON (`--out`).
"""
import argparse
import json
import os
import pathlib
import re
import subprocess
import sys

ROOT = pathlib.Path(__file__).resolve().parent.parent
CACHE = pathlib.Path(os.environ.get("KVPOLICY_CACHE", pathlib.Path.home() / ".cache" / "kvpolicy"))
SMOL = CACHE / "SmolLM2-135M-Instruct.Q4_1.gguf"
GEMMA = CACHE / "gemma-3-270m-q4_k_m.gguf"


def run(cmd):
    """`cmd` with its peak RSS (MiB): stdout, stderr."""
    p = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, cwd=ROOT)
    # Read the pipes to the end, then reap with wait4 to read the child's own rusage.
    out = p.stdout.read()
    err = p.stderr.read()
    _, status, usage = os.wait4(p.pid, 0)
    p.returncode = os.waitstatus_to_exitcode(status)
    if p.returncode != 0:
        sys.exit(f"{' '.join(map(str, cmd))} failed ({p.returncode}):\n{err.decode()[-2000:]}")
    return out.decode(), err.decode(), usage.ru_maxrss / 1024.0


def ours(gguf, context, steps, kv):
    csv = ROOT / "target" / "perf-table-row.csv"
    cmd = [ROOT / "target/release/examples/kvbench", "--cpu", "--gguf", gguf, "--context", str(context),
           "--steps", str(steps), "--repeats", "1", "--policies", "full", "--no-stock",
           "--kv-dtype", kv, "--csv", csv]
    _, _, rss = run(cmd)
    lines = csv.read_text().strip().splitlines()
    head, row = lines[0].split(","), lines[1].split(",")
    r = dict(zip(head, row))
    return {"prefill_tok_s": float(r["prefill_tok_s"]), "decode_tok_s": float(r["decode_tok_s"]),
            "peak_rss_mib": rss}


def llamacpp(python, gguf, context, steps, kv):
    cmd = [python, ROOT / "scripts/llamacpp_bench.py", "--gguf", gguf, "--context", str(context),
           "--steps", str(steps), "--repeats", "1", "--threads", str(os.cpu_count()), "--chunk", "256",
           "--flash-attn", "--kv-type", kv]
    out, _, rss = run(cmd)
    t = json.loads(out)
    return {"prefill_tok_s": t["prefill_tok_s"], "decode_tok_s": t["decode_tok_s"], "peak_rss_mib": rss}


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--python", default=sys.executable, help="a Python with llama-cpp-python==0.3.36")
    ap.add_argument("--steps", type=int, default=16, help="decode steps per cell")
    ap.add_argument("--out", type=pathlib.Path, help="write every cell as JSON here")
    ap.add_argument("--quick", action="store_true", help="SmolLM2 Q4_1 at 512 only")
    ap.add_argument("--skip-build", action="store_true", help="use the built kvbench as it is")
    ap.add_argument("--kv", default="f32,f16", help="KV types, comma-separated (f32, f16, bf16, q8_0): "
                    "ours --kv-dtype, llama.cpp's cache type")
    ap.add_argument("--only", metavar="TEXT:CONTEXT", help="the rows of models whose name contains TEXT "
                    "at CONTEXT only (e.g. Gemma:512)")
    a = ap.parse_args()
    if not a.skip_build:
        subprocess.run(["cargo", "build", "--release", "--example", "kvbench", "--example", "llama"], cwd=ROOT,
                       check=True)
    # Fetches the default models once (no-ops when cached).
    for ex, ids in [("llama", "1"), ("gemma", "2")]:
        subprocess.run(["cargo", "run", "-q", "--release", "--example", ex, "--", "--prompt-ids", ids,
                        "--max-new-tokens", "1"], cwd=ROOT, capture_output=True)
    req = ROOT / "target" / "cpu-speed"
    req.mkdir(parents=True, exist_ok=True)
    models = [("SmolLM2-135M Q4_1", SMOL, [512, 4096, 8000])]
    if not a.quick:
        for kind in ["q4_0", "q5_0", "q5_1", "q8_0"]:
            f = req / f"smollm2.{kind}.gguf"
            if not f.exists():
                subprocess.run([a.python, ROOT / "scripts/requantize.py", SMOL, f, kind], check=True,
                               capture_output=True)
            models.append((f"SmolLM2-135M {kind.upper()}", f, [512, 4096, 8000]))
        models.append(("Gemma 3 270M Q4_K_M", GEMMA, [512, 4096, 16384, 30000]))
    else:
        models[0] = (models[0][0], SMOL, [512])
    if a.only:
        text, n = a.only.rsplit(":", 1)
        models = [(m, f, [int(n)]) for m, f, c in models if text in m and int(n) in c]
    cells = []
    print("| model | context | KV | kvpolicy prefill / decode tok/s, peak RSS | llama.cpp | prefill ratio | decode ratio | RSS ratio |")
    print("|---|---:|---|---|---|---:|---:|---:|")
    for name, gguf, contexts in models:
        for n in contexts:
            for kv in a.kv.split(","):
                o = ours(gguf, n, a.steps, kv)
                l = llamacpp(a.python, gguf, n, a.steps, kv)
                cell = {"model": name, "gguf": str(gguf.name), "context": n, "kv": kv, "kvpolicy": o, "llama_cpp": l}
                cells.append(cell)
                print(f"| {name} | {n} | {kv} | {o['prefill_tok_s']:.1f} / {o['decode_tok_s']:.2f}, {o['peak_rss_mib']:.0f} MiB "
                      f"| {l['prefill_tok_s']:.1f} / {l['decode_tok_s']:.2f}, {l['peak_rss_mib']:.0f} MiB "
                      f"| {o['prefill_tok_s'] / l['prefill_tok_s']:.2f} | {o['decode_tok_s'] / l['decode_tok_s']:.2f} "
                      f"| {o['peak_rss_mib'] / l['peak_rss_mib']:.2f} |", flush=True)
    if a.out:
        cpu = re.search(r"model name\s*:\s*(.*)", pathlib.Path("/proc/cpuinfo").read_text())
        a.out.write_text(json.dumps({"cpu": cpu.group(1) if cpu else None, "threads": os.cpu_count(),
                                     "steps": a.steps, "cells": cells}, indent=1) + "\n")


if __name__ == "__main__":
    main()
