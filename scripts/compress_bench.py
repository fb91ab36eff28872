#!/usr/bin/env python3
"""What `kvpolicy-compress` costs in quality and saves in bytes, on SmolLM2-135M (issue 35).

From the default GGUF (SmolLM2-135M-Instruct Q4_1, 30 layers, 3 KV heads of 64) the script
writes, with target/release/kvpolicy-compress:

* `original` — the GGUF dequantized to f32 with nothing merged (the reference: every row
  below differs from it by the conversion alone, not by quantized kernels);
* `heads 3→1 svd` (calibrated on data/text/calibration-licences.txt) and `heads 3→1 mean`;
* `MLKV m=15 / 10 / 6` — that many of the 30 layers keep K/V projections.

and measures each, teacher-forced with the `llama` example under `full`, on
data/text/eval-licences.txt (GPL-3, GPL-2, LGPL-2.1, GFDL-1.3, MPL-2.0: 26K tokens) in
windows of `--window` tokens: perplexity, and against `original` the mean KL(original ‖
converted) of the next-token distributions and top-1 agreement. KV bytes per token come
from config.json (2 × KV layers × KV heads × head_dim × 4 bytes, f32); `headwise`'s decode
traffic from a run over a random 8,000-token prompt and 5 decode steps (`--stats-out`:
`decode_link_bytes`, both directions, per decode step).

    cargo build --release --examples && cargo build --release
    python3 scripts/compress_bench.py --out bench-results/2026-11-26-cpu-compress.md

Needs numpy and the `tokenizers` package (pip). Conversions and results are cached under
`--work` (default: target/compress-bench); a rerun skips what is there.
"""
import argparse
import json
import math
import subprocess
import sys
import time
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parent.parent
BIN = ROOT / "target" / "release"
GGUF = Path.home() / ".cache" / "kvpolicy" / "SmolLM2-135M-Instruct.Q4_1.gguf"
MODELS = [
    ("original", ["--kv-heads", "3"]),
    ("heads 3→1 svd", ["--kv-heads", "1", "--method", "svd", "--calibration", str(ROOT / "data/text/calibration-licences.txt")]),
    ("heads 3→1 mean", ["--kv-heads", "1", "--method", "mean"]),
    ("MLKV m=15", ["--kv-layers", "15"]),
    ("MLKV m=10", ["--kv-layers", "10"]),
    ("MLKV m=6", ["--kv-layers", "6"]),
]


def sh(cmd):
    t = time.time()
    out = subprocess.run([str(c) for c in cmd], capture_output=True, text=True)
    if out.returncode != 0:
        sys.exit(f"{' '.join(map(str, cmd[:8]))} …: {out.stderr.strip()[-800:]}")
    return out, time.time() - t


def slug(name):
    return "".join(c if c.isalnum() else "_" for c in name)


def convert(work, name, args):
    d = work / slug(name)
    if not (d / "config.json").is_file():
        _, s = sh([BIN / "kvpolicy-compress", "--gguf", GGUF, "--out", d, *args])
        print(f"converted {name} in {s:.0f}s", file=sys.stderr)
    return d


def read_npy(path):
    a = np.load(path, mmap_mode="r")
    return np.asarray(a, dtype=np.float64)


def log_softmax(x):
    m = x.max(axis=1, keepdims=True)
    return x - m - np.log(np.exp(x - m).sum(axis=1, keepdims=True))


def window_logits(d, ids, tmp):
    out = tmp / "logits.npy"
    sh([BIN / "examples" / "llama", "--model-dir", d, "--prompt-ids", ",".join(map(str, ids)),
        "--max-new-tokens", "1", "--policy", "full", "--dump-logits", out])
    return log_softmax(read_npy(out)[: len(ids) - 1])


def kv_bytes_per_token(d):
    c = json.loads((d / "config.json").read_text())
    layers = c.get("num_key_value_layers", c["num_hidden_layers"])
    return 2 * layers * c["num_key_value_heads"] * c["head_dim"] * 4


def headwise_decode(d, tmp):
    stats = tmp / "stats.json"
    sh([BIN / "examples" / "llama", "--model-dir", d, "--random-prompt", "8000", "--max-new-tokens", "5",
        "--policy", "headwise", "--stats-out", stats, "--temperature", "0"])
    s = json.loads(stats.read_text())
    return s["decode_link_bytes"] / max(1, s["decode_tokens"])


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--window", type=int, default=2048)
    ap.add_argument("--work", type=Path, default=ROOT / "target" / "compress-bench")
    ap.add_argument("--out", type=Path)
    a = ap.parse_args()
    from tokenizers import Tokenizer

    a.work.mkdir(parents=True, exist_ok=True)
    dirs = {name: convert(a.work, name, args) for name, args in MODELS}
    tok = Tokenizer.from_file(str(dirs["original"] / "tokenizer.json"))
    text = (ROOT / "data/text/eval-licences.txt").read_text()
    ids = tok.encode(text, add_special_tokens=False).ids
    W = a.window
    windows = [ids[i:i + W] for i in range(0, len(ids) - W + 1, W)]
    results_path = a.work / f"results-{W}.json"
    res = json.loads(results_path.read_text()) if results_path.exists() else {}
    tmp = a.work / "tmp"
    tmp.mkdir(exist_ok=True)
    for wi, win in enumerate(windows):
        key = f"w{wi}"
        if all(key in res.get(n, {}) for n, _ in MODELS):
            continue
        ref = window_logits(dirs["original"], win, tmp)
        target = np.array(win[1:])
        for name, _ in MODELS:
            if key in res.get(name, {}):
                continue
            lp = ref if name == "original" else window_logits(dirs[name], win, tmp)
            nll = float(-lp[np.arange(len(target)), target].sum())
            p = np.exp(ref)
            kl = float((p * (ref - lp)).sum(axis=1).sum())
            top1 = int((ref.argmax(axis=1) == lp.argmax(axis=1)).sum())
            res.setdefault(name, {})[key] = {"nll": nll, "kl": kl, "top1": top1, "n": len(target)}
            results_path.write_text(json.dumps(res, indent=1))
        print(f"window {wi + 1}/{len(windows)} done", file=sys.stderr)
    for name, _ in MODELS:
        if "headwise_decode_bytes" not in res[name]:
            res[name]["headwise_decode_bytes"] = headwise_decode(dirs[name], tmp)
            results_path.write_text(json.dumps(res, indent=1))
            print(f"headwise at 8K: {name}", file=sys.stderr)
    rows = []
    base_kv = kv_bytes_per_token(dirs["original"])
    for name, _ in MODELS:
        r = res[name]
        ws = [v for k, v in r.items() if k.startswith("w") and isinstance(v, dict)]
        n = sum(w["n"] for w in ws)
        ppl = math.exp(sum(w["nll"] for w in ws) / n)
        kv = kv_bytes_per_token(dirs[name])
        rows.append(f"| {name} | {ppl:.2f} | {sum(w['kl'] for w in ws) / n:.4f} | "
                    f"{100 * sum(w['top1'] for w in ws) / n:.1f}% | {kv:,} ({kv / base_kv:.3f}) | "
                    f"{r['headwise_decode_bytes'] / 2**20:.1f} MiB |")
    table = "\n".join([
        f"Teacher-forced on data/text/eval-licences.txt: {len(windows)} windows of {W} tokens "
        f"({len(windows) * (W - 1):,} predictions); `full`, f32, CPU.",
        "",
        "| model | perplexity | mean KL vs original | top-1 vs original | KV bytes / token (× original) | headwise host↔device bytes per decode step at 8K |",
        "|---|---|---|---|---|---|",
        *rows,
    ])
    print(table)
    if a.out:
        a.out.write_text(table + "\n")


if __name__ == "__main__":
    main()
