#!/usr/bin/env bash
# The whole test suite on a fresh clone, in one command (CI's `.ci/run` runs it too, so the
# README's command is the one CI proves):
#
#   bash scripts/test.sh              # installs what is missing, then runs every test
#   bash scripts/test.sh --deps-only  # installs what is missing, runs nothing
#   bash scripts/test.sh -- ARGS...   # arguments after `--` go to `cargo test` (e.g. `--test offload`)
#
# What it installs, only when missing:
#   - Open MPI and libclang (Debian/Ubuntu packages `libopenmpi-dev openmpi-bin libclang-dev`,
#     through apt-get: needs root or sudo) — `helix` across `mpirun` processes (feature `mpi`)
#     and the MPI bindings' build;
#   - the OpenAI Python client (`openai==3.57.0`, through pip) — the server's tests drive it.
# The models the tests use (SmolLM2-135M, Gemma 3 270M) are fetched from PyPI on first use.
set -euo pipefail
cd "$(dirname "$0")/.."

deps_only=0
cargo_args=()
while [ $# -gt 0 ]; do
  case "$1" in
    --deps-only) deps_only=1 ;;
    --) shift; cargo_args=("$@"); break ;;
    -h|--help) sed -n '2,14p' "$0" | sed 's/^# \{0,1\}//'; exit 0 ;;
    *) echo "scripts/test.sh: unknown argument '$1' (try --help)" >&2; exit 2 ;;
  esac
  shift
done

fail() { echo "scripts/test.sh: $*" >&2; exit 1; }

command -v cargo >/dev/null || fail "cargo not found: install Rust from https://rustup.rs, then run this again"
command -v python3 >/dev/null || fail "python3 not found: install Python 3 (apt-get install python3 python3-pip), then run this again"

# Installed when mpirun is missing, or (on Debian/Ubuntu, where dpkg can say) a package is.
if ! command -v mpirun >/dev/null \
  || { command -v dpkg >/dev/null && ! dpkg -s libopenmpi-dev libclang-dev >/dev/null 2>&1; }; then
  echo "installing Open MPI and libclang (apt-get: libopenmpi-dev openmpi-bin libclang-dev)"
  sudo=""
  if [ "$(id -u)" -ne 0 ]; then
    command -v sudo >/dev/null || fail "Open MPI and libclang are missing and installing them needs root: run as root, or install sudo, or run 'apt-get install libopenmpi-dev openmpi-bin libclang-dev' yourself"
    sudo="sudo"
  fi
  command -v apt-get >/dev/null || fail "Open MPI and libclang are missing and this system has no apt-get: install Open MPI (with its headers) and libclang with your package manager"
  $sudo apt-get update -qq
  $sudo env DEBIAN_FRONTEND=noninteractive apt-get install -y -qq libopenmpi-dev openmpi-bin libclang-dev >/dev/null
fi

# Any 3.57 or later: an older client lacks what the tests use; a newer one is left alone.
if ! python3 -c "import openai, sys; v = tuple(int(x) for x in openai.__version__.split('.')[:2]); sys.exit(v < (3, 57))" 2>/dev/null; then
  echo "installing the OpenAI Python client (pip: openai==3.57.0)"
  python3 -m pip install --quiet openai==3.57.0 2>/dev/null \
    || python3 -m pip install --quiet --break-system-packages openai==3.57.0 \
    || fail "could not install openai==3.57.0 with pip: install python3-pip, or run 'python3 -m pip install openai==3.57.0' yourself"
fi

[ "$deps_only" -eq 1 ] && exit 0
exec cargo test --workspace --release --features mpi "${cargo_args[@]}"
