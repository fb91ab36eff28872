#!/usr/bin/env bash
# The whole GPU check, one bounded step after another (device time is short: every step has
# its own time limit, so one hang or failure does not spend the rest). Runs on a GPU machine
# over a copy of the repo, with binaries built here by `bash scripts/gpu_pack.sh`, which
# leaves them (stripped, xz-compressed: a GPU machine takes 64 MiB per send) in
# .device-bin/bins.tar.xz. Writes results under $OUT (default ./gpu-out).
#
# Usage: bash scripts/gpu_run.sh [CONTEXT] [STEPS] [STAGES]
#   CONTEXT  the long context of the 8B-shaped bench (default 32768)
#   STEPS    timed decode steps per run (default 8)
#   STAGES   any of tests,exact,bench,decode,scale,peer,long,ab,approx (default tests,exact,bench,decode:
#            their limits add up to 390 s, which fits one call of a GPU machine (600 s); all
#            seven add up to 710 s, so the rest go in a second call)
set -uo pipefail
OUT=${OUT:-gpu-out}; mkdir -p "$OUT"
CTX=${1:-32768}; STEPS=${2:-8}; STAGES=${3:-tests,exact,bench,decode}
B=/tmp/kvbin; mkdir -p "$B"
tar -xJf .device-bin/bins.tar.xz -C "$B" || { echo "no .device-bin/bins.tar.xz: run scripts/gpu_pack.sh first"; exit 1; }
NV=$(python3 -c "import nvidia,os;print(os.path.dirname(nvidia.__file__))" 2>/dev/null)
export LD_LIBRARY_PATH="$NV/cu13/lib:$NV/nccl/lib:${LD_LIBRARY_PATH:-}"
# The driver JIT-compiles candle's PTX at first use; a cache large enough for all of it lets
# later processes (the exactness runs) skip that.
export CUDA_CACHE_MAXSIZE=4294967296 PYTHONUNBUFFERED=1
nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv,noheader | tee "$OUT/gpu.txt"
t0=$SECONDS
step() { echo "== [$((SECONDS - t0)) s] $*"; }
want() { [[ ",$STAGES," == *",$1,"* ]]; }

# Peak GPU memory of a command: nvidia-smi sampled every 100 ms while it runs.
peak() {
  nvidia-smi --query-gpu=memory.used --format=csv,noheader,nounits -lms 100 > "$OUT/mem.raw" &
  local smi=$!
  "$@"; local rc=$?
  kill $smi; wait $smi 2>/dev/null
  echo "peak GPU memory used (nvidia-smi, MiB): $(sort -n "$OUT/mem.raw" | tail -1)"
  rm -f "$OUT/mem.raw"
  return $rc
}

# record FILE LIMIT CMD...: appends CMD's line, its output (cut at LIMIT seconds) and its exit
# status to $OUT/FILE.
record() {
  local file=$OUT/$1 limit=$2; shift 2
  echo "\$ $*" >> "$file"
  timeout "$limit" "$@" >> "$file" 2>&1
  echo "exit $?" >> "$file"
}

if want tests; then
  step "GPU tests: engine copies, pinned tier, every policy vs full (f32, bf16, vs CPU), zero-copy gather, approximate policies, one-rank NCCL group"
  timeout 120 "$B/cuda-tests" --test-threads 1 --nocapture > "$OUT/cuda-tests.log" 2>&1
  echo "cuda tests exit $?"
  grep -E "^test |zero-copy bandwidth|test result|panicked|Error" "$OUT/cuda-tests.log" | head -40
fi

if want exact; then
  step "exactness through the examples: every policy vs HF in f32, vs full in bf16, greedy ids (fixtures)"
  timeout 80 python3 scripts/policy_exactness.py "$B" --chunks 16 --jobs 12 --out "$OUT/exactness.md" > "$OUT/exactness.log" 2>&1
  echo "exactness exit $?"; grep -E "FAIL|failures|Error|error" "$OUT/exactness.log" | head -20
fi

BENCH="$B/kvbench --random-weights --config scripts/configs/llama3-8b.json --repeats 1 --prefill-chunk 2048"
if want bench; then
  step "Llama-3-8B-shaped, random bf16 weights, 4096 tokens: every exact policy" | tee "$OUT/bench.txt"
  peak record bench.txt 100 $BENCH --context 4096 --steps "$STEPS" --bandwidth-mib 2048 \
    --policies full,layer,headwise:1,headwise:auto,recompute,auto:1GiB >> "$OUT/bench.txt"
  tail -30 "$OUT/bench.txt"
fi

if want decode; then
  step "Llama-3-8B-shaped, decode after $CTX tokens of synthetic history (no prefill): full, layer, headwise:1" | tee "$OUT/decode.txt"
  peak record decode.txt 90 $BENCH --synthetic-history --context "$CTX" --steps "$STEPS" \
    --bandwidth-mib 2048 --policies full,layer,headwise:1 >> "$OUT/decode.txt"
  tail -12 "$OUT/decode.txt"
fi

if want scale; then
  step "full's decode by context (synthetic history): how attention's cost grows with the keys" | tee "$OUT/scale.txt"
  record scale.txt 60 $BENCH --synthetic-history --context 512,4096,32768 --steps "$STEPS" --policies full
  tail -8 "$OUT/scale.txt"
fi

if want peer; then
  step "peer: HF transformers (eager PyTorch, SDPA), same config, cache on the GPU and offloaded" | tee "$OUT/peer.txt"
  record peer.txt 150 python3 scripts/hf_gpu_peer.py scripts/configs/llama3-8b.json --context 4096 "$CTX" --steps "$STEPS"
  tail -12 "$OUT/peer.txt"
fi

if want long; then
  for p in full headwise:1; do
    step "Llama-3-8B-shaped, $CTX tokens, $p" | tee -a "$OUT/long.txt"
    peak record long.txt 55 $BENCH --context "$CTX" --steps "$STEPS" --policies "$p" >> "$OUT/long.txt"
    tail -12 "$OUT/long.txt"
  done
fi
if want ab && [[ -x "$B/kvbench-base" ]]; then
  # Before/after on the same warm machine: kvbench-base is kvbench built from the commit before
  # a change (packed beside it by hand, see the bench-results note that used it), alternated.
  BASE=${BENCH/#"$B/kvbench"/"$B/kvbench-base"}
  for round in 1 2; do
    for bin in base new; do
      cmd=$BENCH; [[ $bin == base ]] && cmd=$BASE
      step "A/B round $round, $bin: 4,096 tokens, full and the streaming policies" | tee -a "$OUT/ab.txt"
      record ab.txt 60 $cmd --context 4096 --steps "$STEPS" --bandwidth-mib 2048 \
        --policies full,layer,headwise:auto,recompute
      tail -8 "$OUT/ab.txt" | grep -E "^\| (full|layer|headwise|recompute)" 
    done
  done
  for bin in base new; do
    cmd=$BENCH; [[ $bin == base ]] && cmd=$BASE
    step "A/B $bin: decode after $CTX tokens of synthetic history: layer, headwise:1" | tee -a "$OUT/ab.txt"
    record ab.txt 90 $cmd --synthetic-history --context "$CTX" --steps "$STEPS" \
      --bandwidth-mib 2048 --policies layer,headwise:1
    tail -5 "$OUT/ab.txt"
  done
fi

if want approx; then
  step "hybrid and the approximate policies (lossy: speed only; they take no synthetic history), 4,096 tokens" | tee "$OUT/approx.txt"
  record approx.txt 80 $BENCH --context 4096 --steps "$STEPS" --bandwidth-mib 2048 \
    --policies full,hybrid,quest,flexicache,clo
  tail -20 "$OUT/approx.txt"
fi
step "done"
