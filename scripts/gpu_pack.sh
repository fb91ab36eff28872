#!/usr/bin/env bash
# Builds the GPU check's binaries here (no GPU needed: CUDA 13.0 toolchain from PyPI) and packs
# them for scripts/gpu_run.sh: the five examples (one per architecture family, for
# policy_exactness.py), kvbench and the GPU tests' binary, stripped, in one xz archive
# (.device-bin/bins.tar.xz; the examples share most of their bytes, which a solid archive
# stores once — a GPU machine takes 64 MiB per send).
#
#   bash scripts/gpu_pack.sh            # CARGO_TARGET_DIR defaults to target/cuda
set -euo pipefail
cd "$(dirname "$0")/.."
export CARGO_TARGET_DIR=${CARGO_TARGET_DIR:-$PWD/target/cuda}
cargo fetch
eval "$(bash scripts/cuda-toolchain.sh)"
EX="llama mistral qwen gemma opt kvbench"
cargo build --release --features nccl $(printf -- '--example %s ' $EX)
TEST=$(cargo test --release --features nccl --test cuda --no-run --message-format=json |
  python3 -c 'import json,sys
for l in sys.stdin:
    m=json.loads(l)
    if m.get("reason")=="compiler-artifact" and m["target"]["name"]=="cuda" and m.get("executable"): print(m["executable"])')
STAGE=$(mktemp -d)
for e in $EX; do cp "$CARGO_TARGET_DIR/release/examples/$e" "$STAGE/"; done
cp "$TEST" "$STAGE/cuda-tests"
strip "$STAGE"/*
mkdir -p .device-bin
tar -C "$STAGE" -cf - . | xz -T1 --lzma2=preset=6,dict=256MiB > .device-bin/bins.tar.xz  # a window past one binary: the copies cost nothing (~13 MB, ~6 min)
rm -rf "$STAGE"
ls -l .device-bin/bins.tar.xz
