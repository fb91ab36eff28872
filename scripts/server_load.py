#!/usr/bin/env python3
"""Load test of kvpolicy-server against llama.cpp's server (issue 31), loopback only.

`--clients` concurrent clients (32) each send `--requests` (8) streamed, greedy completion
requests of mixed lengths (prompts of 16 to 640 tokens of generated text, 8 to 48 new
tokens), drawn from `--prompts` distinct prompts. For kvpolicy-server (run with
`--batch-invariant`) every response must equal that prompt's response run alone first,
one request at a time; none may fail. Reported per server: requests ok / failed,
responses differing from the solo run, p50 and p99 time to first token (first streamed
piece), aggregate generated tokens per second over the load's wall time, and the server's
peak RSS (`VmHWM`). llama.cpp's server (`python3 -m llama_cpp.server`, llama-cpp-python
0.3.36 with its `[server]` extra, the same GGUF, the same 2 threads) gets the same clients
in the same run.

    cargo build --release -p kvpolicy-server
    python3 scripts/server_load.py --results bench-results/server-load.json

`--mix` picks the requests (issue 54): `stories` (the above), `shared-prefix` (every prompt a
~2,000-token shared system prompt and a distinct question), or `long` (distinct prompts of
~1,500 tokens), `grow` (prompts just short of a device growth step, for preemption).
`--kv-budget BYTES` gives kvpolicy-server one memory budget for every
request together (`--device-kv-budget`; with `--policy headwise` and friends also
`--host-kv-budget` and a disk tier under `--disk-dir`), and the table then says how full its
pools got and how many requests were preempted, by mode (`/metrics`; `--preemption-mode
recompute|swap` picks it, swap writing under `--disk-dir`); llama.cpp's server gets a
context of the same bytes of f16 K/V (`--n_ctx`), so both hold equal K/V memory.

Every run is bounded: `--timeout` seconds per request and a count fixed by the flags.
"""
import argparse
import json
import os
import random
import statistics
import subprocess
import sys
import threading
import time
import urllib.request
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
GGUF = Path.home() / ".cache" / "kvpolicy" / "SmolLM2-135M-Instruct.Q4_1.gguf"
WORDS = ("river stone lantern meadow copper orchard winter harbor velvet signal garden "
         "thunder maple circuit canyon ember silver window shadow compass").split()


def make_prompts(n, seed, mix="stories"):
    """`n` prompts of the `mix` (a token is roughly a word here)."""
    if mix == "shared-prefix":
        rng = random.Random(seed)
        system = " ".join(rng.choice(WORDS) for _ in range(2000))
        return [{"prompt": f"Notes: {system}.\nQuestion {i}: which word comes after "
                           f"{rng.choice(WORDS)} in note {rng.randint(1, 99)}? Answer:",
                 "max_tokens": rng.choice([16, 24, 32])} for i in range(n)]
    if mix == "grow":
        # Token ids 10-24 short of 1,024 (a multiple of `full`'s 256-token growth step) and 48
        # new tokens: every request grows past what it was admitted with while it decodes, so
        # requests admitted together under a tight device budget preempt one another.
        rng = random.Random(seed)
        return [{"prompt": [100 + rng.randrange(4000) for _ in range(1014 - 2 * (i % 8))],
                 "max_tokens": 48} for i in range(n)]
    if mix == "long":
        rng = random.Random(seed)
        return [{"prompt": f"Story {i}: " + " ".join(rng.choice(WORDS) for _ in range(1500))
                           + f". The end of story {i} is", "max_tokens": 16} for i in range(n)]
    rng = random.Random(seed)
    out = []
    for i in range(n):
        words = rng.randint(12, 600)
        body = " ".join(rng.choice(WORDS) for _ in range(words))
        out.append({"prompt": f"Story {i}: {body}. The end of story {i} is",
                    "max_tokens": rng.choice([8, 16, 24, 32, 48])})
    return out


def start(cmd, ready, env=None):
    """Starts a server; waits until `ready()` answers. Returns the process."""
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                            env=env)
    lines = []

    def drain():
        for line in proc.stdout:
            lines.append(line)
    threading.Thread(target=drain, daemon=True).start()
    deadline = time.time() + 300
    while time.time() < deadline:
        if proc.poll() is not None:
            sys.exit(f"{cmd[0]} exited: {''.join(lines)[-2000:]}")
        url = ready(lines)
        if url:
            try:
                urllib.request.urlopen(url + "/v1/models", timeout=5).read()
                return proc, url
            except OSError:
                pass
        time.sleep(0.5)
    proc.kill()
    sys.exit(f"{cmd[0]} did not start: {''.join(lines)[-2000:]}")


def peak_rss(pid):
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmHWM:"):
            return int(line.split()[1]) * 1024
    return 0


def stream(url, req, timeout):
    """One streamed greedy completion: (text, seconds to first piece, pieces, error)."""
    body = json.dumps({"prompt": req["prompt"], "max_tokens": req["max_tokens"],
                       "temperature": 0, "stream": True, "model": "m",
                       "stream_options": {"include_usage": True}}).encode()
    r = urllib.request.Request(url + "/v1/completions", data=body,
                               headers={"Content-Type": "application/json"})
    start = time.time()
    first, text, tokens, counted = None, [], 0, None
    try:
        with urllib.request.urlopen(r, timeout=timeout) as resp:
            for raw in resp:
                line = raw.decode().strip()
                if not line.startswith("data: "):
                    continue
                data = line[6:]
                if data == "[DONE]":
                    break
                chunk = json.loads(data)
                if "error" in chunk:
                    return "".join(text), first, tokens, str(chunk["error"])
                if chunk.get("usage"):
                    counted = chunk["usage"]["completion_tokens"]
                if not chunk.get("choices"):
                    continue
                piece = chunk["choices"][0].get("text") or ""
                if piece:
                    if first is None:
                        first = time.time() - start
                    text.append(piece)
                    tokens += 1
    except Exception as e:  # noqa: BLE001 - every failure is counted, whatever its kind
        return "".join(text), first, tokens, repr(e)
    # Pieces are tokens unless text was held back; the usage, where sent, is exact.
    return "".join(text), first, counted if counted is not None else tokens, None


def load(url, prompts, clients, per_client, seed, timeout):
    """`clients` threads × `per_client` requests; returns per-request results and wall time."""
    rng = random.Random(seed)
    plan = [[rng.randrange(len(prompts)) for _ in range(per_client)] for _ in range(clients)]
    results = []
    lock = threading.Lock()

    def client(picks):
        for i in picks:
            text, ttft, tokens, err = stream(url, prompts[i], timeout)
            with lock:
                results.append({"prompt": i, "text": text, "ttft": ttft, "tokens": tokens,
                                "error": err})
    threads = [threading.Thread(target=client, args=(p,)) for p in plan]
    t0 = time.time()
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    return results, time.time() - t0


def pool_metrics(url):
    """The pools' peaks and budgets and the preemptions from kvpolicy-server's /metrics."""
    out = {}
    text = urllib.request.urlopen(url + "/metrics", timeout=10).read().decode()
    for line in text.splitlines():
        for name in ("kvpolicy_kv_peak_bytes", "kvpolicy_kv_budget_bytes",
                     "kvpolicy_num_preemptions_total", "kvpolicy_prefix_cache_bytes",
                     "kvpolicy_prefix_cache_restored_tokens_total"):
            if line.startswith(name + "{") or line.startswith(name + " "):
                out[line.split(" ")[0]] = float(line.split(" ")[1])
    return out


def summarize(name, results, wall, rss, solo=None):
    ok = [r for r in results if r["error"] is None]
    ttfts = sorted(r["ttft"] for r in ok if r["ttft"] is not None)
    pct = lambda q: ttfts[min(len(ttfts) - 1, int(q * len(ttfts)))] if ttfts else float("nan")
    differ = None
    if solo is not None:
        differ = sum(1 for r in ok if r["text"] != solo[r["prompt"]])
    return {"server": name, "requests": len(results), "ok": len(ok),
            "failed": len(results) - len(ok), "differ_from_solo": differ,
            "ttft_p50_s": pct(0.5), "ttft_p99_s": pct(0.99),
            "tokens": sum(r["tokens"] for r in ok), "wall_s": wall,
            "tokens_per_s": sum(r["tokens"] for r in ok) / wall, "peak_rss_bytes": rss,
            "errors": sorted({r["error"] for r in results if r["error"]})[:5]}


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--gguf", default=str(GGUF))
    ap.add_argument("--clients", type=int, default=32)
    ap.add_argument("--requests", type=int, default=8, help="per client")
    ap.add_argument("--prompts", type=int, default=32, help="distinct prompts")
    ap.add_argument("--max-batch", type=int, default=16)
    ap.add_argument("--policy", default="full")
    ap.add_argument("--seed", type=int, default=1)
    ap.add_argument("--timeout", type=float, default=900)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--no-llamacpp", action="store_true")
    ap.add_argument("--mix", choices=["stories", "shared-prefix", "long", "grow"], default="stories")
    ap.add_argument("--kv-budget", help="one K/V budget for all requests, e.g. 192MiB")
    ap.add_argument("--disk-dir", help="kvpolicy-server's disk tier (with --kv-budget and an "
                                       "offloading policy: the host budget's overflow)")
    ap.add_argument("--ctx-size", type=int, help="kvpolicy-server's --ctx-size (tokens)")
    ap.add_argument("--preemption-mode", choices=["recompute", "swap"],
                    help="kvpolicy-server's --preemption-mode (swap: preempted requests' K/V "
                         "written under --disk-dir; its default with --disk-dir)")
    ap.add_argument("--prefix-cache", help="kvpolicy-server's prefix cache directory (its "
                                           "RAM tier --prefix-cache-ram is the same bytes as "
                                           "--kv-budget when given)")
    ap.add_argument("--prefix-cache-ram", help="kvpolicy-server's prefix cache in RAM only, "
                                               "this many bytes (e.g. 80MiB): live requests "
                                               "share its chunks by reference")
    ap.add_argument("--n-ctx", type=int, default=8192,
                    help="llama.cpp's context (tokens); with --kv-budget, its bytes' worth")
    ap.add_argument("--results", help="JSON to write")
    a = ap.parse_args()
    prompts = make_prompts(a.prompts, a.seed, a.mix)
    budget_flags = []
    if a.kv_budget:
        budget_flags = ["--device-kv-budget", a.kv_budget]
        if a.disk_dir:
            budget_flags += ["--disk-dir", a.disk_dir, "--host-kv-budget", a.kv_budget]
    if a.ctx_size:
        budget_flags += ["--ctx-size", str(a.ctx_size)]
    if a.preemption_mode:
        budget_flags += ["--preemption-mode", a.preemption_mode]
    if a.prefix_cache:
        budget_flags += ["--prefix-cache", a.prefix_cache]
        if a.kv_budget and not a.prefix_cache_ram:
            budget_flags += ["--prefix-cache-ram", a.kv_budget]
    if a.prefix_cache_ram:
        budget_flags += ["--prefix-cache-ram", a.prefix_cache_ram]
    rows = []
    binary = ROOT / "target" / "release" / "kvpolicy-server"
    if not binary.is_file():
        sys.exit(f"{binary} is missing: cargo build --release -p kvpolicy-server")
    env = dict(os.environ, RAYON_NUM_THREADS=str(a.threads))
    proc, url = start([str(binary), "--cpu", "--port", "0", "--gguf", a.gguf, "--policy",
                       a.policy, "--batch-invariant", "--max-batch", str(a.max_batch),
                       "--max-queue", str(a.clients * 2)] + budget_flags,
                      lambda lines: next((l.split("listening on ")[1].split()[0]
                                          for l in lines if "listening on" in l), None), env)
    try:
        solo = []
        for i, p in enumerate(prompts):
            text, _, _, err = stream(url, p, a.timeout)
            if err:
                sys.exit(f"solo run of prompt {i} failed: {err}")
            solo.append(text)
        results, wall = load(url, prompts, a.clients, a.requests, a.seed, a.timeout)
        budget = f", KV budget {a.kv_budget}" if a.kv_budget else ""
        budget += ", prefix cache" if a.prefix_cache else ""
        budget += f", preemption {a.preemption_mode}" if a.preemption_mode else ""
        budget += (f", prefix cache RAM {a.prefix_cache_ram}" if a.prefix_cache_ram else "")
        rows.append(summarize(f"kvpolicy-server ({a.policy}, --batch-invariant, "
                              f"--max-batch {a.max_batch}{budget})", results, wall,
                              peak_rss(proc.pid), solo))
        rows[-1]["pools"] = pool_metrics(url)
    finally:
        proc.terminate()
        proc.wait(timeout=60)
    if not a.no_llamacpp:
        port = 18000 + os.getpid() % 1000
        proc, url = start([sys.executable, "-m", "llama_cpp.server", "--model", a.gguf,
                           "--port", str(port), "--host", "127.0.0.1", "--n_ctx", str(a.n_ctx),
                           "--n_threads", str(a.threads), "--n_threads_batch", str(a.threads),
                           # Its default cancels a running stream when a new request arrives.
                           "--interrupt_requests", "False"],
                          lambda lines: f"http://127.0.0.1:{port}", env)
        try:
            results, wall = load(url, prompts, a.clients, a.requests, a.seed, a.timeout)
            rows.append(summarize("llama.cpp server (llama-cpp-python 0.3.36)", results, wall,
                                  peak_rss(proc.pid)))
        finally:
            proc.terminate()
            proc.wait(timeout=60)
    print("| server | requests | ok | failed | ≠ solo | TTFT p50 s | TTFT p99 s | tokens/s | "
          "wall s | peak RSS MiB |")
    print("|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|")
    for r in rows:
        differ = "-" if r["differ_from_solo"] is None else r["differ_from_solo"]
        print(f"| {r['server']} | {r['requests']} | {r['ok']} | {r['failed']} | {differ} | "
              f"{r['ttft_p50_s']:.2f} | {r['ttft_p99_s']:.2f} | {r['tokens_per_s']:.1f} | "
              f"{r['wall_s']:.0f} | {r['peak_rss_bytes'] / 2**20:.0f} |")
    for r in rows:
        if r.get("pools"):
            print(f"{r['server']}: " + ", ".join(f"{k} = {v:.0f}" for k, v in
                                                 sorted(r["pools"].items())))
    if a.results:
        Path(a.results).write_text(json.dumps(rows, indent=1) + "\n")
    bad = [r for r in rows if r["failed"] or r["differ_from_solo"]]
    if any(r["server"].startswith("kvpolicy") for r in bad):
        sys.exit("kvpolicy-server lost, failed or changed responses under load")


if __name__ == "__main__":
    main()
