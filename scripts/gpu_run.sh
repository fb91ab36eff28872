#!/usr/bin/env bash
# Runs on a GPU machine over a copy of the repo, with binaries built here by
#   CARGO_TARGET_DIR=… cargo build --release --features nccl --example llama --example kvbench
#   CARGO_TARGET_DIR=… cargo test --release --features nccl --test cuda --no-run
# and copied (stripped) into .device-bin/ (the test binary as .device-bin/cuda-tests). Writes results under $OUT (default ./gpu-out).
# Usage: bash scripts/gpu_run.sh [CONTEXT] [STEPS]
set -uo pipefail
OUT=${OUT:-gpu-out}; mkdir -p "$OUT"
CTX=${1:-32768}; STEPS=${2:-4}
B=.device-bin
NV=$(python3 -c "import nvidia,os;print(os.path.dirname(nvidia.__file__))" 2>/dev/null)
export LD_LIBRARY_PATH="$NV/cu13/lib:$NV/nccl/lib:${LD_LIBRARY_PATH:-}"
nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv,noheader | tee "$OUT/gpu.txt"
echo "== GPU tests (engine copies, pinned tier, every policy vs full in f32 and bf16, one-rank NCCL group)"
"$B/cuda-tests" --test-threads 1 > "$OUT/cuda-tests.log" 2>&1
echo "cuda tests exit $?"; tail -3 "$OUT/cuda-tests.log"
echo "== zero-copy page gather (CLO) vs the copy engine on the same pages"
"$B/cuda-tests" zero_copy_gathers --nocapture --test-threads 1 2>&1 | grep -E "zero-copy bandwidth|test result|panicked" | tee "$OUT/zero-copy.txt"
echo "== exactness (fixtures, every policy vs full, f32 vs HF)"
python3 scripts/policy_exactness.py "$B/llama" --out "$OUT/exactness.md" > "$OUT/exactness.log" 2>&1
echo "exactness exit $?"; tail -3 "$OUT/exactness.log"
echo "== Llama-3-8B-shaped, random bf16 weights on the GPU, ${CTX} tokens of context" | tee "$OUT/bench.txt"
for p in full layer headwise:1 headwise:auto; do
  nvidia-smi --query-gpu=memory.used --format=csv,noheader,nounits -lms 100 > "$OUT/mem.raw" &
  SMI=$!
  cmd="$B/kvbench --random-weights --config scripts/configs/llama3-8b.json --context $CTX --steps $STEPS --repeats 1 --policies $p --prefill-chunk 2048 --bandwidth-mib 2048"
  echo "\$ $cmd" >> "$OUT/bench.txt"
  $cmd >> "$OUT/bench.txt" 2>&1; echo "exit $?" >> "$OUT/bench.txt"
  kill $SMI; wait $SMI 2>/dev/null
  echo "$p peak GPU memory used (nvidia-smi, MiB): $(sort -n "$OUT/mem.raw" | tail -1)" | tee -a "$OUT/mem.txt"
done
rm -f "$OUT/mem.raw"
cat "$OUT/bench.txt"
