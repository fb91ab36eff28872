#!/usr/bin/env bash
# The CPU speed table (issue "CPU speed"): `full` against llama.cpp in the same kvbench run,
# on the default SmolLM2-135M Q4_1 GGUF and on its Q4_0 and Q8_0 requantizations (llama.cpp's
# quantizer, scripts/requantize.py), 512-token prompt of fixed ids, 64 decode steps, medians
# of 3, the machine's thread count (RAYON_NUM_THREADS to change it) — plus Gemma 3 270M.
#
#   scripts/cpu_speed.sh PYTHON [OUTDIR]
# PYTHON: an interpreter with llama-cpp-python==0.3.36; OUTDIR (default target/cpu-speed):
# the requantized files and one CSV per model.
set -euo pipefail
python=${1:?usage: scripts/cpu_speed.sh PYTHON [OUTDIR]}
out=${2:-target/cpu-speed}
root=$(cd "$(dirname "$0")/.." && pwd)
mkdir -p "$out"
cache=${KVPOLICY_CACHE:-${XDG_CACHE_HOME:-$HOME/.cache}/kvpolicy}
q41="$cache/SmolLM2-135M-Instruct.Q4_1.gguf"
cd "$root"
cargo build --release --example kvbench --example llama --example gemma
# Fetches the default models once (no-ops when cached).
./target/release/examples/llama --prompt-ids 1 --max-new-tokens 1 > /dev/null 2>&1
./target/release/examples/gemma --prompt-ids 2 --max-new-tokens 1 > /dev/null 2>&1
for kind in q4_0 q8_0; do
  [ -f "$out/smollm2.$kind.gguf" ] ||
    "$python" scripts/requantize.py "$q41" "$out/smollm2.$kind.gguf" "$kind" > "$out/requantize-$kind.log" 2>&1 ||
    { cat "$out/requantize-$kind.log"; exit 1; }
done
run() {
  echo "## $1"
  ./target/release/examples/kvbench --cpu --gguf "$2" --context 512 --steps 64 --repeats 3 \
    --policies full --no-stock --llamacpp "$python" --csv "$out/$1.csv"
}
run smollm2-q4_1 "$q41"
run smollm2-q4_0 "$out/smollm2.q4_0.gguf"
run smollm2-q8_0 "$out/smollm2.q8_0.gguf"
run gemma3-270m "$cache/gemma-3-270m-q4_k_m.gguf"
