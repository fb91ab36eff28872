#!/usr/bin/env python3
"""kvpolicy against llama.cpp at the model sizes people run (issue 57): random-weight GGUFs of
real shapes (scripts/scale_gguf.py: Llama 3.2 1B, Llama 3 8B, Qwen2.5 1.5B / 7B, Mistral 7B;
Q4_0, Q8_0, a Q4_K_M-like mix), prefill, decode, peak RSS and load time on the same file, the
same ids, chunk, steps and threads, the two sides alternated (llama.cpp once per cell, with the
first policy; the other policies' rows share its runs), the best of `--runs` for speed and
load time and the median for peak RSS — and each decode rate as a share of the machine's memory
roofline (weight bytes a decode step reads ÷ the read bandwidth `examples/membw.rs` measures
with the same threads before each round of runs; the best probe of the whole run is the
denominator,
since a virtual machine's bandwidth moves between probes — 30 to 47 GB/s within minutes on the
2-core EPYC of bench-results/2026-11-27-cpu-scale.md).

kvpolicy: `kvbench --policies POLICY --kv-dtype f16 --context N --steps S --repeats 1` (chunks
of 256); llama.cpp: llama-cpp-python 0.3.36, `scripts/llamacpp_bench.py --flash-attn --kv-type
f16` (its default cache type). Peak RSS is each process's own (`ru_maxrss` from `wait4`), one
process per cell and run. Random weights make every logit a near-tie, so these files time speed
and memory only; exactness is tested on the real models and fixtures.

    python3 scripts/scale_bench.py                      # Llama 1B at 256 and 8B at 64, Q4_0
    python3 scripts/scale_bench.py --cells llama-1b:q4_0:256,qwen2.5-7b:q4_k_m:64 --runs 3
    python3 scripts/scale_bench.py --cells llama-1b:q4_0:32768 --policies 'full;headwise;auto:1GiB'

The GGUFs are written once under $KVPOLICY_CACHE/scale (default ~/.cache/kvpolicy/scale).
Prints a markdown table; `--out` writes every run as JSON.
"""
import argparse
import json
import os
import pathlib
import re
import statistics
import subprocess
import sys
import tempfile

import gguf

ROOT = pathlib.Path(__file__).resolve().parent.parent
CACHE = pathlib.Path(os.environ.get("KVPOLICY_CACHE", pathlib.Path.home() / ".cache" / "kvpolicy")) / "scale"
KVBENCH = ROOT / "target/release/examples/kvbench"
MEMBW = ROOT / "target/release/examples/membw"


def run(cmd, threads=None):
    """`cmd`'s stdout and its peak RSS in MiB (exits with its stderr if it fails)."""
    env = dict(os.environ, **({"RAYON_NUM_THREADS": str(threads)} if threads else {}))
    # stderr to a file (a child filling a second pipe while we drain the first would
    # block), stdout read to its end, then the child reaped with wait4 for its own rusage.
    with tempfile.TemporaryFile() as errf:
        p = subprocess.Popen([str(c) for c in cmd], stdout=subprocess.PIPE, stderr=errf, cwd=ROOT, env=env)
        out = p.stdout.read()
        _, status, usage = os.wait4(p.pid, 0)
        errf.seek(0)
        err = errf.read()
    code = os.waitstatus_to_exitcode(status)
    if code != 0:
        sys.exit(f"{' '.join(map(str, cmd))} failed ({code}):\n{err.decode()[-2000:]}")
    return out.decode(), usage.ru_maxrss / 1024.0


def model_file(python, shape, quant):
    """The cached GGUF of `shape` in `quant`, written first if missing."""
    CACHE.mkdir(parents=True, exist_ok=True)
    f = CACHE / f"{shape}.{quant}.gguf"
    if not f.exists():
        print(f"writing {f} …", file=sys.stderr, flush=True)
        subprocess.run([python, ROOT / "scripts/scale_gguf.py", "--shape", shape, "--quant", quant, "--out", f],
                       check=True)
    return f


def bytes_per_token(path):
    """Weight bytes a batch-1 decode step reads: every tensor but the embedding table (one row
    of it), which is read whole when it is also the output (tied)."""
    r = gguf.GGUFReader(str(path))
    sizes = {t.name: int(t.n_bytes) for t in r.tensors}
    total = sum(sizes.values())
    return total if "output.weight" not in sizes else total - sizes["token_embd.weight"]


def ours(gguf_path, context, steps, policy, threads):
    csv = ROOT / "target" / "scale-bench-row.csv"
    cmd = [KVBENCH, "--cpu", "--gguf", gguf_path, "--context", context, "--steps", steps, "--repeats", "1",
           "--policies", policy, "--no-stock", "--kv-dtype", "f16", "--csv", csv]
    out, rss = run(cmd, threads)
    head, row = [line.split(",") for line in csv.read_text().strip().splitlines()[:2]]
    r = dict(zip(head, row))
    load = re.search(r"^load: ([0-9.]+) s", out, re.M)
    return {"prefill_tok_s": float(r["prefill_tok_s"]), "decode_tok_s": float(r["decode_tok_s"]),
            "peak_rss_mib": rss, "load_s": float(load.group(1)) if load else None}


def llamacpp(python, gguf_path, context, steps, threads):
    out, rss = run([python, ROOT / "scripts/llamacpp_bench.py", "--gguf", gguf_path, "--context", context,
                    "--steps", steps, "--repeats", "1", "--threads", threads, "--chunk", "256",
                    "--flash-attn", "--kv-type", "f16"])
    t = json.loads(out)
    return {"prefill_tok_s": t["prefill_tok_s"], "decode_tok_s": t["decode_tok_s"], "peak_rss_mib": rss,
            "load_s": t["load_s"]}


def summary(runs):
    """Best speed and load time, median peak RSS over `runs`."""
    return {"prefill_tok_s": max(r["prefill_tok_s"] for r in runs),
            "decode_tok_s": max(r["decode_tok_s"] for r in runs),
            "peak_rss_mib": statistics.median(r["peak_rss_mib"] for r in runs),
            "load_s": min((r["load_s"] for r in runs if r["load_s"] is not None), default=None)}


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--python", default=sys.executable, help="a Python with llama-cpp-python==0.3.36 and gguf")
    ap.add_argument("--cells", default="llama-1b:q4_0:256,llama-8b:q4_0:64",
                    help="SHAPE:QUANT:CONTEXT, comma-separated (shapes and quants: scripts/scale_gguf.py)")
    ap.add_argument("--policies", default="full",
                    help="kvbench policy specs separated by ';' (each its own row): full;headwise;auto:1GiB")
    ap.add_argument("--steps", type=int, default=16, help="decode steps per run")
    ap.add_argument("--runs", type=int, default=3, help="runs per side, alternated")
    ap.add_argument("--threads", type=int, default=os.cpu_count(), help="threads, both sides")
    ap.add_argument("--skip-build", action="store_true", help="use the built kvbench and membw as they are")
    ap.add_argument("--out", type=pathlib.Path, help="write every run as JSON here")
    a = ap.parse_args()
    if not a.skip_build:
        subprocess.run(["cargo", "build", "--release", "--example", "kvbench", "--example", "membw"], cwd=ROOT,
                       check=True)
    probes = []

    def probe():
        out, _ = run([MEMBW, "--threads", a.threads])
        probes.append(json.loads(out)["read_gb_s"])
        return max(probes)

    probe()
    cells = []
    for spec in a.cells.split(","):
        shape, quant, context = spec.split(":")
        f = model_file(a.python, shape, quant)
        per_token = bytes_per_token(f)
        theirs = []  # llama.cpp's runs of this cell: measured with the first policy, then shared
        for n, policy in enumerate(a.policies.split(";")):
            mine = []
            for i in range(a.runs):
                probe()
                sides = [lambda: mine.append(ours(f, context, a.steps, policy, a.threads))]
                if n == 0:
                    sides.append(lambda: theirs.append(llamacpp(a.python, f, context, a.steps, a.threads)))
                for side in sides if i % 2 == 0 else sides[::-1]:
                    side()
            o, t = summary(mine), summary(theirs)
            print(f"{shape} {quant} {context} {policy}: decode {o['decode_tok_s']:.2f} vs {t['decode_tok_s']:.2f} "
                  "tok/s", file=sys.stderr, flush=True)
            cells.append({"shape": shape, "quant": quant, "context": int(context), "policy": policy,
                          "file_bytes": f.stat().st_size, "decode_bytes_per_token": per_token,
                          "kvpolicy": mine, "llama_cpp": theirs, "best": {"kvpolicy": o, "llama_cpp": t}})
    # Every cell's roofline from the best probe of the whole run (printed below).
    best = max(probes)
    seconds = lambda v: "–" if v is None else f"{v:.2f} s"
    print("| shape | quant | context | policy | kvpolicy prefill / decode tok/s, RSS, load | llama.cpp "
          "| prefill ratio | decode ratio | RSS ratio | decode ÷ roofline (ours / llama.cpp) |")
    print("|---|---|---:|---|---|---|---:|---:|---:|---|")
    for c in cells:
        c["roofline_tok_s"] = roofline = best * 1e9 / c["decode_bytes_per_token"]
        o, t = c["best"]["kvpolicy"], c["best"]["llama_cpp"]
        print(f"| {c['shape']} | {c['quant']} | {c['context']} | {c['policy']} "
              f"| {o['prefill_tok_s']:.1f} / {o['decode_tok_s']:.2f}, {o['peak_rss_mib']:.0f} MiB, {seconds(o['load_s'])} "
              f"| {t['prefill_tok_s']:.1f} / {t['decode_tok_s']:.2f}, {t['peak_rss_mib']:.0f} MiB, {seconds(t['load_s'])} "
              f"| {o['prefill_tok_s'] / t['prefill_tok_s']:.2f} | {o['decode_tok_s'] / t['decode_tok_s']:.2f} "
              f"| {o['peak_rss_mib'] / t['peak_rss_mib']:.2f} "
              f"| {o['decode_tok_s'] / roofline:.2f} / {t['decode_tok_s'] / roofline:.2f} |")
    print(f"\nmemory read bandwidth: {best:.2f} GB/s, the best of {len(probes)} probes "
          f"({min(probes):.2f} the least; {a.threads} threads, examples/membw.rs) — the roofline's denominator")
    if a.out:
        cpu = re.search(r"model name\s*:\s*(.*)", pathlib.Path("/proc/cpuinfo").read_text())
        a.out.write_text(json.dumps({"cpu": cpu.group(1) if cpu else None, "threads": a.threads,
                                     "read_gb_s": max(probes), "read_gb_s_probes": probes, "steps": a.steps, "runs": a.runs, "cells": cells},
                                    indent=1) + "\n")


if __name__ == "__main__":
    main()
