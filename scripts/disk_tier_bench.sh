#!/usr/bin/env bash
# The disk tier's table (issue "beyond host memory"): a 2-layer SmolLM2-shaped model (random
# weights) at CONTEXT tokens, `full` against `headwise:1` with one layer and with both layers
# of KV in files under DIR (--host-kv-budget), plus the disk's own read rate from dd (direct
# I/O, so the page cache does not answer) for comparison. The disk tier reads with O_DIRECT
# (`--disk-io direct`, the default) and, last, through the page cache (`--disk-io buffered`).
#
#   scripts/disk_tier_bench.sh [CONTEXT] [DIR] [synthetic]
#
# (defaults: 32768, a temporary directory). With `synthetic`, each context is filled with
# random K/V stored without attention (kvbench --synthetic-history) instead of a prefill:
# the decode timing at contexts whose prefill would take hours on a CPU (512K).
set -euo pipefail
cd "$(dirname "$0")/.."
context=${1:-32768}
dir=${2:-$(mktemp -d)}
history=()
[ "${3:-}" = synthetic ] && history=(--synthetic-history)
mkdir -p "$dir"
cfg=$(mktemp --suffix .json)
trap 'rm -f "$cfg" "$dir/dd.test"' EXIT
cat > "$cfg" <<JSON
{"model_type": "llama", "hidden_size": 576, "intermediate_size": 1536, "num_hidden_layers": 2,
 "num_attention_heads": 9, "num_key_value_heads": 3, "vocab_size": 49152, "rms_norm_eps": 1e-5,
 "rope_theta": 100000.0, "max_position_embeddings": 1048576, "tie_word_embeddings": true}
JSON
echo "== dd on $dir (1 GiB, direct I/O)"
dd if=/dev/zero of="$dir/dd.test" bs=1M count=1024 oflag=direct 2>&1 | tail -1
dd if="$dir/dd.test" of=/dev/null bs=1M iflag=direct 2>&1 | tail -1
rm -f "$dir/dd.test"
cargo build --release --example kvbench
# One layer's KV at this context: 2 (K, V) x 3 heads x 64 x 4 bytes per token.
layer=$(( context * 2 * 3 * 64 * 4 ))
run() {
  ./target/release/examples/kvbench --random-weights --config "$cfg" --cpu --context "$context" \
    --steps 8 --repeats 1 --no-stock --prefill-chunk 2048 --disk-dir "$dir" "${history[@]}" "$@"
}
echo "== --host-kv-budget $(( layer + layer / 2 )): one layer in RAM, one on disk ($layer bytes each)"
run --policies full,headwise:1 --host-kv-budget $(( layer + layer / 2 ))
echo "== no --host-kv-budget: both layers on disk, direct reads (the default)"
run --policies headwise:1
echo "== both layers on disk, --disk-io buffered (through the page cache)"
run --policies headwise:1 --disk-io buffered
