#!/usr/bin/env bash
# The CUDA 13.0 build toolchain, from PyPI, for compiling `--features cuda` on a machine
# without a GPU (CI, and development here). Prints the environment to export:
#
#   eval "$(bash scripts/cuda-toolchain.sh [DIR])"      # DIR defaults to ~/.cache/kvpolicy-cuda13
#
# What it installs, and why:
# - nvcc, NVVM, the CRT headers, the runtime, CCCL 13.0: candle's kernels and ours are built
#   to PTX with nvcc; 13.0 because the GPU machines' driver is CUDA 13.0 and a newer nvcc
#   emits PTX that driver refuses.
# - cuBLAS, cuRAND, NVRTC 13.0: candle (cudarc, dynamic linking) links them at build time.
# - libcuda.so: the driver is not on PyPI, so a link-time stand-in with SONAME libcuda.so.1
#   is compiled, one function per driver entry point cudarc declares, each returning
#   CUDA_ERROR_STUB_LIBRARY (34). On a GPU machine the real driver is loaded at run time.
# - libnccl.so (feature `nccl`): likewise a link-time stand-in with NCCL's SONAME
#   libnccl.so.2, every entry point cudarc declares returning ncclSystemError (2); on a GPU
#   machine the real one comes from PyPI's nvidia-nccl-cu13 (PyTorch's CUDA wheels install it).
set -euo pipefail
DIR=${1:-$HOME/.cache/kvpolicy-cuda13}
PY=$DIR/venv/bin/python
if [ ! -x "$PY" ]; then
  python3 -m venv "$DIR/venv" >&2
  "$DIR/venv/bin/pip" install --quiet --disable-pip-version-check \
    nvidia-cuda-nvcc==13.0.88 nvidia-nvvm==13.0.88 nvidia-cuda-crt==13.0.88 \
    nvidia-cuda-runtime==13.0.96 nvidia-cuda-cccl==13.0.85 \
    nvidia-cublas==13.0.2.14 nvidia-curand==10.4.0.35 nvidia-cuda-nvrtc==13.0.88 >&2
fi
CU=$(echo "$DIR"/venv/lib/python3*/site-packages/nvidia/cu13)
[ -x "$CU/bin/nvcc" ] || { echo "nvcc missing under $CU" >&2; exit 1; }
# The wheels ship versioned sonames only; the linker looks for the plain names.
for lib in cublas cublasLt cudart nvrtc; do ln -sf "lib$lib.so.13" "$CU/lib/lib$lib.so"; done
ln -sf libcurand.so.10 "$CU/lib/libcurand.so"
STUB=$DIR/libcuda-stub
# stub LIB SONAME SYS PATTERN CODE: $STUB/LIB.so, one function per entry point cudarc
# declares in its SYS bindings (names matching PATTERN), each returning CODE.
stub() {
  [ -s "$STUB/$1.so" ] && return
  mkdir -p "$STUB"
  local syms
  syms=$(ls -d "${CARGO_HOME:-$HOME/.cargo}"/registry/src/*/cudarc-*/src/"$3"/sys/mod.rs 2>/dev/null | sort -V | tail -1)
  [ -n "$syms" ] || { echo "cudarc's sources are not fetched yet: run 'cargo fetch' first" >&2; exit 1; }
  {
    echo "/* Link-time stand-in for $2; every entry point returns $5. */"
    grep -o "fn $4[A-Za-z0-9_]*\s*(" "$syms" | sed -e 's/^fn //' -e 's/\s*($//' | sort -u |
      while read -r f; do echo "int $f(void) { return $5; }"; done
  } > "$STUB/$1.c"
  cc -shared -fPIC -Wl,-soname,"$2" -o "$STUB/$1.so" "$STUB/$1.c"
}
stub libcuda libcuda.so.1 driver cu 34      # CUDA_ERROR_STUB_LIBRARY
stub libnccl libnccl.so.2 nccl 'p\?nccl' 2  # ncclSystemError
cat <<ENV
export PATH="$CU/bin:\$PATH"
export CUDA_ROOT="$CU" CUDA_HOME="$CU" CUDA_PATH="$CU"
export CUDA_COMPUTE_CAP=\${CUDA_COMPUTE_CAP:-90}
export CUDARC_CUDA_VERSION=13000
export LIBRARY_PATH="$CU/lib:$STUB\${LIBRARY_PATH:+:\$LIBRARY_PATH}"
ENV
