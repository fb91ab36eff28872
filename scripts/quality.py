#!/usr/bin/env python3
"""Long-context quality of the approximate policies against `full` (issue 29).

Two measures, per model, context, policy and budget:

* RULER-style synthetic tasks (Hsieh et al., "RULER", 2024, §3: needle-in-a-haystack
  variants over the "noise" haystack), generated here deterministically: a single needle at
  depths 10/50/90% (`single_10`, `single_50`, `single_90`), four needles with different keys
  asking for one (`multikey`), four values under one key asking for all (`multivalue`).
  Scored by exact match of the generated answer (the first 7-digit number, or every value).
* Natural text (Python's own documentation, `pydoc_data.topics`, in sorted order),
  teacher-forced against `full`: mean and p99 KL(full ‖ policy) of the next-token
  distributions over `--kl-tokens` decode steps, and top-1 agreement.

Every run is one process of the model's example (`llama` for SmolLM2-135M, `gemma` for
Gemma 3 270M) with `--link-bandwidth` (2GB by default), reporting per policy the bytes moved
over the link per decoded token, the device KV peak and decode s/token from `--stats-out`.
Results are cached in `--results` (JSON; a rerun skips what is there), printed as Markdown
tables, and charted (accuracy against bytes moved per token) with `--chart`.

    cargo build --release --examples
    python3 scripts/quality.py --model smollm2 --contexts 4096,8000 \\
        --results bench-results/quality-smollm2.json --chart docs/quality-smollm2.svg
    python3 scripts/quality.py --model gemma3 --contexts 4096,16384,30000 \\
        --skip-failed-by-full ...

`full` is the reference: where it fails a task (these are small models) the table says so,
and a policy is judged by whether it answers what `full` answers.
"""
import argparse
import json
import math
import random
import re
import struct
import subprocess
import sys
import tempfile
from array import array
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
BINS = {"smollm2": "llama", "gemma3": "gemma"}
DEFAULT_POLICIES = (
    "full,headwise,sinks:sinks=16,window=640,"
    "quest:budget=256,quest:budget=512,quest:budget=1024,"
    "flexicache:budget=512,clo:budget=512"
)
NOISE = "The grass is green. The sky is blue. The sun is yellow. Here we go. There and back again."
INTRO = ("Some special magic numbers are hidden within the following text. Make sure to memorize "
         "it. I will quiz you about the numbers afterwards.\n")
WORDS = ("amber apple arrow basil beacon birch canyon cedar cobalt comet coral crimson delta "
         "ember falcon fern garnet glacier harbor hazel indigo iris jade juniper lagoon lantern "
         "maple meadow nectar onyx orchid pebble quartz raven saffron sierra spruce tangerine "
         "thistle topaz tulip umber velvet willow zephyr").split()
TASKS = ["single_10", "single_50", "single_90", "multikey", "multivalue"]


def split_policies(s):
    """Comma-separated specs whose settings also use commas: a piece with '=' but no ':'
    continues the previous spec."""
    out = []
    for piece in s.split(","):
        if out and "=" in piece and ":" not in piece:
            out[-1] += "," + piece
        else:
            out.append(piece)
    return out


def binary(model):
    return ROOT / "target" / "release" / "examples" / BINS[model]


def run(model, prompt, policy, new, tmp, link, extra=()):
    """One process: returns (ids json, stats json, stdout)."""
    pf, ids, stats = tmp / "prompt.txt", tmp / "ids.json", tmp / "stats.json"
    pf.write_text(prompt)
    cmd = [str(binary(model)), "--prompt-file", str(pf), "--policy", policy,
           "--max-new-tokens", str(new), "--ids-out", str(ids), "--stats-out", str(stats),
           "--temperature", "0", *extra]
    if link and policy != "full":
        cmd += ["--link-bandwidth", link]
    out = subprocess.run(cmd, capture_output=True, text=True)
    if out.returncode != 0:
        sys.exit(f"{' '.join(cmd[:6])} …: {out.stderr.strip()[-600:]}")
    return json.loads(ids.read_text()), json.loads(stats.read_text()), out.stdout


def token_count(model, text, tmp):
    ids, _, _ = run(model, text, "full", 1, tmp, None)
    return len(ids["prompt_ids"])


def calibrate(model, tmp):
    """Tokens of the prompt's fixed parts and of one haystack sentence."""
    a = token_count(model, INTRO + " ".join([NOISE] * 10), tmp)
    b = token_count(model, INTRO + " ".join([NOISE] * 30), tmp)
    per = (b - a) / 20
    return per, a - 10 * per


def needle(key, value):
    return f"One of the special magic numbers for {key} is: {value}."


def make_task(task, context, cal, seed):
    """(prompt text, answers, new tokens) for `task` at about `context` tokens."""
    rng = random.Random(f"{task}-{context}-{seed}")
    per, fixed = cal
    keys = []
    while len(keys) < 4:
        k = f"{rng.choice(WORDS)}-{rng.choice(WORDS)}"
        if k not in keys:
            keys.append(k)
    values = [str(rng.randrange(1_000_000, 10_000_000)) for _ in range(4)]
    if task.startswith("single_"):
        depth = int(task.split("_")[1]) / 100
        needles = [(depth, needle(keys[0], values[0]))]
        asked, answers, many = keys[0], [values[0]], False
    elif task == "multikey":
        needles = [(d, needle(k, v)) for d, k, v in zip((0.2, 0.4, 0.6, 0.8), keys, values)]
        pick = rng.randrange(4)
        asked, answers, many = keys[pick], [values[pick]], False
    else:
        needles = [(d, needle(keys[0], v)) for d, v in zip((0.2, 0.4, 0.6, 0.8), values)]
        asked, answers, many = keys[0], values, True
    question = (f"\nWhat are all the special magic numbers for {asked} mentioned in the provided "
                f"text? The special magic numbers for {asked} mentioned in the provided text are"
                if many else
                f"\nWhat is the special magic number for {asked} mentioned in the provided text? "
                f"The special magic number for {asked} mentioned in the provided text is")
    reps = max(1, int((context - fixed - 60 - 20 * len(needles)) / per))
    hay = [NOISE] * reps
    for depth, text in sorted(needles, reverse=True):
        hay.insert(round(depth * reps), text)
    return INTRO + " ".join(hay) + question, answers, (40 if many else 12)


def score(text, answers):
    found = re.findall(r"\d{7}", text)
    if len(answers) == 1:
        return bool(found) and found[0] == answers[0]
    return all(a in found for a in answers)


def link_stats(stats):
    steps = max(stats.get("decode_tokens", 0), 1)
    return {
        # --stats-out flattens the decode's link counts into the top level.
        "bytes_per_token": stats.get("decode_link_bytes", 0) / steps,
        "decode_s_per_token": stats.get("decode_s", 0.0) / steps,
        "device_kv_peak_bytes": stats.get("device_kv_peak_bytes", 0),
        "lossy": bool(stats.get("lossy")),
        "prompt_tokens": stats.get("prefill_tokens", 0),
    }


def read_npy(path):
    """A float32 2-D .npy as (rows, cols, flat array)."""
    raw = Path(path).read_bytes()
    if raw[:6] != b"\x93NUMPY":
        sys.exit(f"{path} is not a .npy file")
    hl_size = 2 if raw[6] == 1 else 4
    hl = struct.unpack("<H" if hl_size == 2 else "<I", raw[8:8 + hl_size])[0]
    header = raw[8 + hl_size:8 + hl_size + hl].decode("latin1")
    if "'<f4'" not in header:
        sys.exit(f"{path}: not little-endian float32 ({header})")
    rows, cols = map(int, re.search(r"\((\d+),\s*(\d+)\)", header).groups())
    data = array("f")
    data.frombytes(raw[8 + hl_size + hl:])
    return rows, cols, data


def log_softmax(row):
    m = max(row)
    lse = m + math.log(sum(math.exp(x - m) for x in row))
    return [x - lse for x in row]


def kl_compare(ref_path, got_path, n):
    """Per decode row (the first n): KL(ref ‖ got) and whether the argmaxes agree."""
    r_rows, cols, ref = read_npy(ref_path)
    g_rows, g_cols, got = read_npy(got_path)
    if (g_rows, g_cols) != (r_rows, cols):
        sys.exit(f"logits shapes differ: {(r_rows, cols)} vs {(g_rows, g_cols)}")
    kls, agree = [], 0
    for i in range(min(n, r_rows)):
        p = log_softmax(ref[i * cols:(i + 1) * cols])
        q = log_softmax(got[i * cols:(i + 1) * cols])
        kls.append(max(0.0, sum(math.exp(a) * (a - b) for a, b in zip(p, q))))
        agree += p.index(max(p)) == q.index(max(q))
    kls.sort()
    p99 = kls[min(len(kls) - 1, math.ceil(0.99 * len(kls)) - 1)]
    return {"kl_mean": sum(kls) / len(kls), "kl_p99": p99, "top1": agree / len(kls)}


def natural_text():
    import pydoc_data.topics as topics
    text = " ".join(topics.topics[k] for k in sorted(topics.topics))
    return re.sub(r"\s+", " ", text)


def kl_run(a, results, tmp, policies):
    text = natural_text()
    sample = text[:8000]
    ratio = len(sample) / token_count(a.model, sample, tmp)
    ctx = text[: int(a.kl_context * ratio * 0.97)]
    cont = text[len(ctx): len(ctx) + int(a.kl_tokens * ratio * 3)]
    ids, _, _ = run(a.model, cont, "full", 1, tmp, None)
    decode = ids["prompt_ids"][1: a.kl_tokens + 1]
    extra = ["--decode-ids", ",".join(map(str, decode)), "--decode-logits-only"]
    ref = tmp / "full.npy"
    run(a.model, ctx, "full", len(decode), tmp, None, [*extra, "--dump-logits", str(ref)])
    for policy in policies:
        key = f"kl|{a.kl_context}|{policy}"
        if key in results or policy == "full":
            continue
        got = tmp / "got.npy"
        _, stats, _ = run(a.model, ctx, policy, len(decode), tmp, a.link,
                          [*extra, "--dump-logits", str(got)])
        results[key] = {**kl_compare(ref, got, len(decode)), **link_stats(stats)}
        save(a, results)
        print(f"  kl {policy}: {results[key]}", file=sys.stderr)


def save(a, results):
    Path(a.results).write_text(json.dumps(results, indent=1, sort_keys=True) + "\n")


def fmt_bytes(b):
    for unit in ("B", "KiB", "MiB", "GiB"):
        if b < 1024 or unit == "GiB":
            return f"{b:.0f} {unit}" if unit == "B" else f"{b:.2f} {unit}"
        b /= 1024


def tables(a, results, policies):
    out = []
    for ctx in a.contexts:
        out.append(f"\n### {a.model} at {ctx} tokens (link {a.link})\n")
        out.append("| policy | " + " | ".join(TASKS) + " | answers full's | link bytes/token "
                   "| device KV peak | decode s/token |")
        out.append("|---|" + "---|" * len(TASKS) + "---:|---:|---:|---:|")
        full = {t: results.get(f"{ctx}|{t}|full", {}).get("correct") for t in TASKS}
        for policy in policies:
            cells = [results.get(f"{ctx}|{t}|{policy}") for t in TASKS]
            if not any(cells):
                continue
            marks = ["-" if c is None else ("yes" if c["correct"] else "no") for c in cells]
            want = [t for t in TASKS if full.get(t)]
            kept = sum(1 for t, c in zip(TASKS, cells) if c and c["correct"] and full.get(t))
            done = [c for c in cells if c]
            mean = lambda k: sum(c[k] for c in done) / len(done)
            out.append(f"| `{policy}` | " + " | ".join(marks) + f" | {kept}/{len(want)} | "
                       f"{fmt_bytes(mean('bytes_per_token'))} | "
                       f"{fmt_bytes(mean('device_kv_peak_bytes'))} | "
                       f"{mean('decode_s_per_token'):.4f} |")
        out.append("\n`-`: not run (with `--skip-failed-by-full`, a task `full` fails).")
    kl = [(p, results.get(f"kl|{a.kl_context}|{p}")) for p in policies]
    if any(r for _, r in kl):
        out.append(f"\n### {a.model}: natural text at {a.kl_context} tokens, "
                   f"{a.kl_tokens} teacher-forced tokens, against full\n")
        out.append("| policy | mean KL | p99 KL | top-1 agreement | link bytes/token |")
        out.append("|---|---:|---:|---:|---:|")
        for p, r in kl:
            if r:
                out.append(f"| `{p}` | {r['kl_mean']:.5f} | {r['kl_p99']:.5f} | "
                           f"{r['top1']:.3f} | {fmt_bytes(r['bytes_per_token'])} |")
    return "\n".join(out)


def chart(a, results, policies, path):
    """SVG: per context, the share of the tasks `full` answers that a policy answers too,
    against link bytes per token (log)."""
    pts = []
    for ctx in a.contexts:
        for policy in policies:
            cells = [results.get(f"{ctx}|{t}|{policy}") for t in TASKS]
            done = [c for c in cells if c]
            # Judged against full: the tasks full answers.
            want = [c for t, c in zip(TASKS, cells)
                    if c and results.get(f"{ctx}|{t}|full", {}).get("correct")]
            if not done or not want:
                continue
            acc = sum(c["correct"] for c in want) / len(want)
            b = sum(c["bytes_per_token"] for c in done) / len(done)
            pts.append((ctx, policy, max(b, 1.0), acc))
    if not pts:
        return
    w, h, pad = 720, 420, 60
    lo = math.log10(min(p[2] for p in pts))
    hi = math.log10(max(p[2] for p in pts)) + 1e-9
    x = lambda b: pad + (math.log10(b) - lo) / max(hi - lo, 1e-9) * (w - 2 * pad)
    y = lambda acc: h - pad - acc * (h - 2 * pad)
    colors = ["#1f77b4", "#d62728", "#2ca02c", "#9467bd", "#ff7f0e", "#8c564b"]
    s = [f'<svg xmlns="http://www.w3.org/2000/svg" width="{w}" height="{h}" font-family="sans-serif" font-size="11">',
         f'<rect width="{w}" height="{h}" fill="white"/>',
         f'<text x="{w/2}" y="18" text-anchor="middle" font-size="13">{a.model}: share of full&#8217;s answers kept vs bytes moved per token (log scale; link {a.link})</text>',
         f'<line x1="{pad}" y1="{h-pad}" x2="{w-pad}" y2="{h-pad}" stroke="black"/>',
         f'<line x1="{pad}" y1="{pad}" x2="{pad}" y2="{h-pad}" stroke="black"/>',
         f'<text x="{w/2}" y="{h-15}" text-anchor="middle">link bytes per decoded token (1 B for full: nothing moves)</text>',
         f'<text x="15" y="{h/2}" transform="rotate(-90 15 {h/2})" text-anchor="middle">share of full&#8217;s answers kept</text>']
    for acc in (0, 0.5, 1):
        s.append(f'<text x="{pad-8}" y="{y(acc)+4}" text-anchor="end">{acc:.1f}</text>')
    for e in range(math.floor(lo), math.ceil(hi) + 1):
        if lo - 1e-9 <= e <= hi + 1e-9:
            s.append(f'<text x="{x(10**e)}" y="{h-pad+16}" text-anchor="middle">1e{e}</text>')
    for i, ctx in enumerate(a.contexts):
        c = colors[i % len(colors)]
        s.append(f'<text x="{w-pad}" y="{pad+14*i}" text-anchor="end" fill="{c}">{ctx} tokens</text>')
        for (pc, policy, b, acc) in pts:
            if pc == ctx:
                s.append(f'<circle cx="{x(b):.1f}" cy="{y(acc):.1f}" r="4" fill="{c}"/>')
                s.append(f'<text x="{x(b)+6:.1f}" y="{y(acc)-6-8*i:.1f}" fill="{c}" font-size="9">{policy}</text>')
    s.append("</svg>")
    Path(path).write_text("\n".join(s) + "\n")


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--model", choices=sorted(BINS), default="smollm2")
    ap.add_argument("--contexts", default="4096,8000")
    ap.add_argument("--tasks", default=",".join(TASKS))
    ap.add_argument("--policies", default=DEFAULT_POLICIES)
    ap.add_argument("--link", default="2GB", help="--link-bandwidth of every non-full run")
    ap.add_argument("--seed", type=int, default=1)
    ap.add_argument("--kl-context", type=int, default=0, help="natural-text context (0: skip)")
    ap.add_argument("--kl-tokens", type=int, default=64)
    ap.add_argument("--results", required=True, help="JSON cache of every cell")
    ap.add_argument("--chart", help="SVG to write")
    ap.add_argument("--table-only", action="store_true")
    ap.add_argument("--skip-failed-by-full", action="store_true",
                    help="run no other policy on a task `full` fails (its cells show '-')")
    a = ap.parse_args()
    a.contexts = [int(c) for c in a.contexts.split(",")]
    policies = split_policies(a.policies)
    if not binary(a.model).is_file():
        sys.exit(f"{binary(a.model)} is missing: cargo build --release --examples")
    results = json.loads(Path(a.results).read_text()) if Path(a.results).is_file() else {}
    with tempfile.TemporaryDirectory() as d:
        tmp = Path(d)
        if not a.table_only:
            cal = calibrate(a.model, tmp)
            for ctx in a.contexts:
                for task in a.tasks.split(","):
                    prompt, answers, new = make_task(task, ctx, cal, a.seed)
                    for policy in policies:
                        key = f"{ctx}|{task}|{policy}"
                        if key in results:
                            continue
                        ref = results.get(f"{ctx}|{task}|full")
                        if a.skip_failed_by_full and ref and not ref["correct"]:
                            continue
                        ids, stats, stdout = run(a.model, prompt, policy, new, tmp, a.link)
                        text = stdout.strip()
                        results[key] = {"correct": score(text, answers), "answer": text[-160:],
                                        "want": answers, **link_stats(stats)}
                        save(a, results)
                        print(f"{key}: {results[key]['correct']} {text[-60:]!r}", file=sys.stderr)
            if a.kl_context:
                kl_run(a, results, tmp, policies)
    print(tables(a, results, policies))
    if a.chart:
        chart(a, results, policies, a.chart)


if __name__ == "__main__":
    main()
