#!/usr/bin/env python3
"""Checks every policy against `full` (and `full` against HF) through the example binary,
on whatever device the binary runs on — used on GPU machines, where there is no Rust.

    python3 scripts/policy_exactness.py BIN [--cpu] [--out FILE.md]

For each fixture in tests/fixtures: f32 `full` vs the HF logits (tolerance 1e-4); then in
bf16, every policy × head group × prefill chunk vs bf16 `full` (tolerance 2e-2), and greedy
ids of 16 sampled tokens equal to `full`'s. Exits non-zero on any failure.
"""
import json
import subprocess
import sys
import tempfile
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parent.parent
FIX = ROOT / "tests" / "fixtures"
# (policy, extra flags); `recompute:16` and hybrid's 1:1 ratio force regeneration on GQA fixtures too.
POLICIES = [
    ("full", []),
    ("layer", []),
    ("headwise", ["--head-group", "1"]),
    ("headwise", ["--head-group", "2"]),
    ("headwise", ["--head-group", "auto"]),
    ("recompute", []),
    ("recompute", ["--recompute-split", "16"]),
    ("hybrid", []),
    ("hybrid", ["--kv-act-ratio", "0.5", "--block-size", "4"]),
]


def usable(flags, nkv):
    """A fixed head group must divide the KV heads."""
    return not (flags[:1] == ["--head-group"] and flags[1] != "auto" and nkv % int(flags[1]) != 0)


def label(pol, flags):
    return pol + (f":{flags[1]}" if flags else "")


def run(bin_, args):
    r = subprocess.run([bin_] + args, capture_output=True, text=True)
    if r.returncode != 0:
        raise RuntimeError(f"{' '.join(args)}\n{r.stderr}")
    return r


def main():
    bin_ = sys.argv[1]
    extra = ["--cpu"] if "--cpu" in sys.argv else []
    out = sys.argv[sys.argv.index("--out") + 1] if "--out" in sys.argv else None
    lines, failures = [], 0
    tmp = Path(tempfile.mkdtemp())
    for fx in sorted(p for p in FIX.iterdir() if (p / "config.json").is_file()):
        ids = json.loads((fx / "ids.json").read_text())
        nkv = json.loads((fx / "config.json").read_text()).get("num_key_value_heads")
        p_ids = ",".join(map(str, ids["prompt_ids"]))
        d_ids = ",".join(map(str, ids["decode_ids"]))
        base = ["--model-dir", str(fx), "--prompt-ids", p_ids] + extra
        hf = np.load(fx / "logits.npy")
        run(bin_, base + ["--decode-ids", d_ids, "--dtype", "f32", "--dump-logits", str(tmp / "f32.npy")])
        d = float(np.abs(np.load(tmp / "f32.npy") - hf).max())
        ok = d <= 1e-4
        failures += not ok
        lines.append(f"| {fx.name} | full | f32 | all | vs HF | {d:.2e} | {'ok' if ok else 'FAIL'} |")
        for chunk in ["1", "5", "16", "64"]:
            ref = None
            for pol, flags in POLICIES:
                if not usable(flags, nkv):
                    continue
                a = base + ["--decode-ids", d_ids, "--dtype", "bf16", "--prefill-chunk", chunk, "--policy", pol] + flags
                run(bin_, a + ["--dump-logits", str(tmp / "l.npy")])
                l = np.load(tmp / "l.npy")
                name = label(pol, flags)
                if ref is None:
                    ref = l
                    d = float(np.abs(l - hf).max())
                    lines.append(f"| {fx.name} | {name} | bf16 | {chunk} | vs HF f32 (info) | {d:.2e} | - |")
                    continue
                d = float(np.abs(l - ref).max())
                ok = d <= 2e-2
                failures += not ok
                lines.append(f"| {fx.name} | {name} | bf16 | {chunk} | vs full bf16 | {d:.2e} | {'ok' if ok else 'FAIL'} |")
        greedy = {}
        for pol, flags in POLICIES:
            if not usable(flags, nkv):
                continue
            a = base + ["--dtype", "bf16", "--max-new-tokens", "16", "--policy", pol, "--ids-out", str(tmp / "ids.json")] + flags
            run(bin_, a)
            greedy[label(pol, flags)] = json.loads((tmp / "ids.json").read_text())["generated_ids"]
        same = all(v == greedy["full"] for v in greedy.values())
        failures += not same
        lines.append(f"| {fx.name} | all policies | bf16 | greedy 16 | ids equal full | {len(greedy)} policies | {'ok' if same else 'FAIL'} |")
    table = "| fixture | policy | dtype | chunk | comparison | max abs diff | result |\n|---|---|---|---|---|---:|---|\n" + "\n".join(lines)
    print(table)
    print(f"failures: {failures}")
    if out:
        Path(out).write_text(table + f"\n\nfailures: {failures}\n")
    sys.exit(1 if failures else 0)


if __name__ == "__main__":
    main()
