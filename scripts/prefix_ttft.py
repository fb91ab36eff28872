#!/usr/bin/env python3
"""Time to first token with the prefix cache (issue 30): one ~8K-token document asked
different questions, with nothing cached, cold (computing and storing the chunks), from
host RAM (a second prompt in the same process) and from files (a new process, no RAM tier,
chunks read with O_DIRECT); against the restore bandwidth, the disk's own direct-read rate
(`dd iflag=direct` over the same chunk files).

Every run is one process of the model's example (`llama` for SmolLM2-135M, `gemma` for
Gemma 3 270M) on its default GGUF, with `--stats-out`: the time to first token is the
run's `prefill_s` — the restore and the prefill of what is not restored, which ends with the
first token's logits (model loading is not in it). Each timing is the median of
`--repeats` runs. With a cache, a GGUF model on the CPU prefills in passes of one chunk
(256 tokens), since its numbers for a token depend on the pass it shares (docs/reuse.md,
"Reusing K/V across requests"); the run from disk is compared (max |difference| of its
decode logits) with a fresh run in such passes — which it must equal bit for bit — and,
for scale, with the fresh run at the default prefill chunk; the run from RAM (a prompts
file, which has no logits output) by its generated ids.

    cargo build --release --examples
    python3 scripts/prefix_ttft.py --model smollm2 --results bench-results/prefix-ttft.json
    python3 scripts/prefix_ttft.py --model gemma3 --results bench-results/prefix-ttft.json
"""
import argparse
import json
import re
import shutil
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from quality import binary, natural_text, read_npy  # noqa: E402

ROOT = Path(__file__).resolve().parent.parent
QUESTIONS = [
    " Question: which topic does the text above describe first? Answer:",
    " Question: name one Python statement the text explains. Answer:",
    " Question: what does the last paragraph say? Answer:",
]


def example(model, args, tmp, tag):
    """One process; returns (ids json, stats json)."""
    ids, stats = tmp / f"{tag}.ids.json", tmp / f"{tag}.stats.json"
    cmd = [str(binary(model)), "--temperature", "0", "--ids-out", str(ids),
           "--stats-out", str(stats), *args]
    out = subprocess.run(cmd, capture_output=True, text=True)
    if out.returncode != 0:
        sys.exit(f"{' '.join(cmd[:8])} …: {out.stderr.strip()[-800:]}")
    return json.loads(ids.read_text()), json.loads(stats.read_text())


def document(model, tokens, tmp):
    """Natural text of about `tokens` tokens, one line (no newlines)."""
    text = natural_text()
    sample = tmp / "sample.txt"
    sample.write_text(text[:8000])
    ids, _ = example(model, ["--prompt-file", str(sample), "--max-new-tokens", "1"], tmp, "cal")
    per_char = len(ids["prompt_ids"]) / 8000
    doc = text[: int(0.9 * tokens / per_char)]
    # Once more on the document itself: the rate varies along the text.
    sample.write_text(doc)
    ids, _ = example(model, ["--prompt-file", str(sample), "--max-new-tokens", "1"], tmp, "cal")
    return doc[: int(len(doc) * tokens / len(ids["prompt_ids"]))]


def max_diff(a, b):
    ra, ca, x = read_npy(a)
    rb, cb, y = read_npy(b)
    if (ra, ca) != (rb, cb):
        sys.exit(f"logits shapes differ: {(ra, ca)} vs {(rb, cb)}")
    return max(abs(p - q) for p, q in zip(x, y))


def dd_rate(files):
    """Bytes per second of `dd iflag=direct` over `files` (all read, times summed)."""
    total_b, total_s = 0, 0.0
    for f in files:
        out = subprocess.run(["dd", f"if={f}", "of=/dev/null", "bs=4M", "iflag=direct"],
                             capture_output=True, text=True)
        m = re.search(r"(\d+) bytes .* copied, ([\d.e-]+) s", out.stderr)
        if not m:
            sys.exit(f"dd: {out.stderr.strip()}")
        total_b += int(m.group(1))
        total_s += float(m.group(2))
    return total_b / total_s


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--model", choices=["smollm2", "gemma3"], default="smollm2")
    ap.add_argument("--tokens", type=int, default=8000,
                    help="document length in tokens (about; SmolLM2 has 8,192 positions)")
    ap.add_argument("--new", type=int, default=4, help="tokens generated per question")
    ap.add_argument("--policy", default="full")
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--cache-dir", type=Path, default=ROOT / "target" / "prefix-ttft",
                    help="the prefix cache's directory (on the disk to measure; emptied first)")
    ap.add_argument("--results", type=Path, help="JSON file the row is added to")
    a = ap.parse_args()

    with tempfile.TemporaryDirectory() as t:
        tmp = Path(t)
        doc = document(a.model, a.tokens, tmp)
        q1, q2 = (tmp / "q1.txt", tmp / "q2.txt")
        q1.write_text(doc + QUESTIONS[0])
        q2.write_text(doc + QUESTIONS[1])
        both = tmp / "both.txt"
        both.write_text(doc + QUESTIONS[0] + "\n" + doc + QUESTIONS[1] + "\n")
        base = ["--policy", a.policy, "--max-new-tokens", str(a.new)]
        logits = ["--decode-logits-only", "--dump-logits"]
        cache = ["--prefix-cache", str(a.cache_dir)]
        times = {"none": [], "cold": [], "ram": [], "disk": []}
        fresh_ids = None
        restored = {}
        for r in range(a.repeats):
            ids, s = example(a.model, base + ["--prompt-file", str(q2), *logits, str(tmp / "fresh.npy")], tmp, "fresh")
            times["none"].append(s["prefill_s"])
            fresh_ids, prompt_tokens = ids["generated_ids"], s["prefill_tokens"]
            shutil.rmtree(a.cache_dir, ignore_errors=True)
            _, s = example(a.model, base + cache + ["--prompt-file", str(q1)], tmp, "cold")
            times["cold"].append(s["prefill_s"])
            ids, s = example(a.model, base + ["--prompts-file", str(both), "--prefix-cache-ram", "4GiB"], tmp, "ram")
            req = s["prefix_cache"]["requests"][1]
            times["ram"].append(req["prefill_s"])
            restored["ram"] = req["from_ram_tokens"]
            ram_ids = ids[1]["generated_ids"]
            ids, s = example(a.model, base + cache + ["--prefix-cache-ram", "0", "--prompt-file", str(q2), *logits, str(tmp / "disk.npy")], tmp, "disk")
            disk_ids = ids["generated_ids"]
            req = s["prefix_cache"]["requests"][0]
            times["disk"].append(req["prefill_s"])
            restored["disk"] = req["from_disk_tokens"]
            restore_s = req["restore_s"]
        # What the cached runs must equal: a fresh run in passes of one chunk.
        ids, _ = example(a.model, base + ["--prompt-file", str(q2), "--prefill-chunk", "256", *logits, str(tmp / "same.npy")], tmp, "same")
        same_ids = ids["generated_ids"]
        files = sorted(a.cache_dir.glob("*.kvc"))
        chunk_file = files[0].stat().st_size
        chunk_tokens = 256
        disk_bytes = restored["disk"] // chunk_tokens * chunk_file
        row = {
            "model": a.model,
            "policy": a.policy,
            "prompt_tokens": prompt_tokens,
            "restored_tokens_ram": restored["ram"],
            "restored_tokens_disk": restored["disk"],
            "ttft_s": {k: statistics.median(v) for k, v in times.items()},
            "ttft_runs_s": times,
            "ram_ids_equal_fresh_256": ram_ids == same_ids,
            "disk_ids_equal_fresh_256": disk_ids == same_ids,
            "disk_ids_equal_fresh_default": disk_ids == fresh_ids,
            "disk_vs_fresh_256_max_abs_diff": max_diff(tmp / "same.npy", tmp / "disk.npy"),
            "disk_vs_fresh_default_max_abs_diff": max_diff(tmp / "fresh.npy", tmp / "disk.npy"),
            "disk_restore_bytes": disk_bytes,
            "disk_restore_bytes_per_s": disk_bytes / restore_s,
            "dd_direct_bytes_per_s": dd_rate(files),
        }
    t = row["ttft_s"]
    print(f"| model | prompt tokens | TTFT none | cold (storing) | from RAM | ÷ | from disk | ÷ | "
          f"restore GB/s | dd direct GB/s | disk vs fresh in 256-token passes: max Δlogit | "
          f"vs fresh at the default chunk | ids = fresh (RAM, disk) |")
    print("|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---|")
    print(f"| {a.model} | {prompt_tokens} | {t['none']:.2f} s | {t['cold']:.2f} s | "
          f"{t['ram']:.3f} s | {t['none'] / t['ram']:.0f}× | {t['disk']:.3f} s | "
          f"{t['none'] / t['disk']:.0f}× | {row['disk_restore_bytes_per_s'] / 1e9:.2f} | "
          f"{row['dd_direct_bytes_per_s'] / 1e9:.2f} | {row['disk_vs_fresh_256_max_abs_diff']:.2g} | "
          f"{row['disk_vs_fresh_default_max_abs_diff']:.2g} | "
          f"{row['ram_ids_equal_fresh_256']}, {row['disk_ids_equal_fresh_256']} |")
    if a.results:
        old = json.loads(a.results.read_text()) if a.results.exists() else {}
        old[f"{a.model}|{a.policy}|{a.tokens}"] = row
        a.results.write_text(json.dumps(old, indent=1, sort_keys=True) + "\n")


if __name__ == "__main__":
    main()
