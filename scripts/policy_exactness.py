#!/usr/bin/env python3
"""Checks every policy against `full` (and `full` against HF) through the example binary,
on whatever device the binary runs on — used on GPU machines, where there is no Rust.

    python3 scripts/policy_exactness.py BIN_DIR [--cpu] [--out FILE.md] [--chunks 1,5,16,64] [--jobs N]

BIN_DIR holds the example binaries (llama, mistral, qwen, gemma, opt: each runs its own
architectures), e.g. target/release/examples. Runs go N at a time (default 1; a GPU machine's cores and one GPU take several).
For each fixture in tests/fixtures and each prefill chunk: in f32, every policy × head group
vs the HF logits (tolerance 1e-4: the exactness claim); in bf16, every policy vs bf16 `full`,
within twice bf16 `full`'s own distance e from the HF f32 logits (a policy that regenerates
K/V rounds its matmuls in another order, a second bf16 computation as far from HF as `full`
is: by the triangle inequality |policy − full| ≤ 2e — a measured precision, not a constant;
e itself must stay ≤ 1, bf16's error on these fixtures being 0.07–0.56: a broken bf16 path in
`full` would widen every bound); and greedy ids of 16
sampled tokens (f32) equal to `full`'s. A run that fails is a FAIL row with its error; the
others still run. Exits non-zero on any failure.
"""
import json
import subprocess
import sys
import tempfile
from concurrent.futures import ThreadPoolExecutor
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


def example_for(model_type):
    """The example binary that runs `model_type` (crates/cli/src/runner.rs, example_for)."""
    return {"mistral": "mistral", "qwen2": "qwen", "gemma": "gemma", "gemma2": "gemma", "gemma3": "gemma", "gemma3_text": "gemma", "opt": "opt"}.get(model_type, "llama")


def opt(name, default):
    return sys.argv[sys.argv.index(name) + 1] if name in sys.argv else default


def main():
    bin_dir = Path(sys.argv[1])
    extra = ["--cpu"] if "--cpu" in sys.argv else []
    out = opt("--out", None)
    chunks = opt("--chunks", "1,5,16,64").split(",")
    pool = ThreadPoolExecutor(int(opt("--jobs", "1")))
    tmp = Path(tempfile.mkdtemp())
    counter = iter(range(1 << 30))

    def logits(bin_, args):
        """Runs the binary with `args`, returns the logits it dumps."""
        f = tmp / f"{next(counter)}.npy"
        run(bin_, args + ["--dump-logits", str(f)])
        return np.load(f)

    def greedy(bin_, args):
        f = tmp / f"{next(counter)}.json"
        run(bin_, args + ["--ids-out", str(f)])
        return json.loads(f.read_text())["generated_ids"]

    # Every run is submitted first, then the table is assembled in order from the results.
    fixtures = []
    for fx in sorted(p for p in FIX.iterdir() if (p / "config.json").is_file()):
        ids = json.loads((fx / "ids.json").read_text())
        cfg = json.loads((fx / "config.json").read_text())
        # MHA configs (OPT, llama_mha) leave the KV heads out: as many as the query heads.
        nkv = cfg.get("num_key_value_heads") or cfg["num_attention_heads"]
        bin_ = str(bin_dir / example_for(cfg.get("model_type", "llama")))
        p_ids = ",".join(map(str, ids["prompt_ids"]))
        d_ids = ",".join(map(str, ids["decode_ids"]))
        base = ["--model-dir", str(fx), "--prompt-ids", p_ids] + extra
        pols = [(pol, flags) for pol, flags in POLICIES if usable(flags, nkv)]
        runs = {
            (dtype, chunk): [
                (label(pol, flags), pool.submit(logits, bin_, base + ["--decode-ids", d_ids, "--dtype", dtype, "--prefill-chunk", chunk, "--policy", pol] + flags))
                for pol, flags in pols
            ]
            for dtype in ["f32", "bf16"]
            for chunk in chunks
        }
        gen = [
            (label(pol, flags), pool.submit(greedy, bin_, base + ["--dtype", "f32", "--max-new-tokens", "16", "--policy", pol] + flags))
            for pol, flags in pols
        ]
        fixtures.append((fx, runs, gen))

    header = "| fixture | policy | dtype | chunk | comparison | max abs diff | result |\n|---|---|---|---|---|---:|---|"
    print(header, flush=True)
    lines, failures = [], 0

    def emit(line):
        """A table row, also printed as it comes (a run cut short still shows its rows)."""
        lines.append(line)
        print(line, flush=True)

    def result(fut, what):
        """The run's result, or None after a FAIL row naming its error."""
        nonlocal failures
        try:
            return fut.result()
        except Exception as e:  # a failed run is a row, not the end of the report
            failures += 1
            emit(f"| {what} | run failed: {str(e).splitlines()[-1][:200]} | - | FAIL |")
            return None

    for fx, runs, gen in fixtures:
        hf = np.load(fx / "logits.npy")
        for (dtype, chunk), results in runs.items():
            ref, tol = None, 1e-4
            for name, fut in results:
                l = result(fut, f"{fx.name} | {name} | {dtype} | {chunk}")
                if l is None:
                    if ref is None and dtype == "bf16":
                        break  # no bf16 `full` to compare with
                    continue
                if dtype == "f32":
                    d, what = float(np.abs(l - hf).max()), "vs HF f32"
                elif ref is None:
                    ref = l
                    e = float(np.abs(l - hf).max())
                    tol = 2 * e
                    ok = e <= 1.0
                    failures += not ok
                    emit(f"| {fx.name} | {name} | bf16 | {chunk} | vs HF f32: e ≤ 1 (tolerance 2e) | {e:.2e} | {'ok' if ok else 'FAIL'} |")
                    continue
                else:
                    d, what = float(np.abs(l - ref).max()), "vs full bf16"
                ok = d <= tol
                failures += not ok
                emit(f"| {fx.name} | {name} | {dtype} | {chunk} | {what} | {d:.2e} | {'ok' if ok else 'FAIL'} |")
        ids = {name: result(fut, f"{fx.name} | {name} | f32 | greedy 16") for name, fut in gen}
        same = ids.get("full") is not None and all(v == ids["full"] for v in ids.values())
        failures += not same
        emit(f"| {fx.name} | all policies | f32 | greedy 16 | ids equal full | {len(ids)} policies | {'ok' if same else 'FAIL'} |")
    table = header + "\n" + "\n".join(lines)
    print(f"failures: {failures}")
    if out:
        Path(out).write_text(table + f"\n\nfailures: {failures}\n")
    sys.exit(1 if failures else 0)


if __name__ == "__main__":
    main()
