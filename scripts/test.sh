#!/usr/bin/env bash
# Runs setup (packages + build), then every test through ctest, then the
# fuzz targets (scripts/fuzz.sh, docs/FUZZING.md: FUZZ_SECONDS each, its own
# clang build in build-fuzz/) when clang with libFuzzer is installed.
#   scripts/test.sh               # all tests, then fuzzing
#   scripts/test.sh -L unit       # extra args go to ctest; no fuzzing unless AQSWARM_FUZZ=1
#   AQSWARM_FUZZ=0 scripts/test.sh   # all tests, no fuzzing
set -euo pipefail
cd "$(dirname "$0")/.."
scripts/setup.sh
cd build
ctest --output-on-failure --timeout 600 -j 2 "$@"
cd ..

fuzz=${AQSWARM_FUZZ:-}
[[ -z $fuzz ]] && fuzz=$(($# == 0 ? 1 : 0))
if [[ $fuzz != 1 ]]; then
  echo "test: fuzzing not run (ctest arguments given, or AQSWARM_FUZZ=0; AQSWARM_FUZZ=1 runs it)"
elif ! why=$(scripts/fuzz.sh --check); then
  echo "test: SKIPPING fuzzing: ${why} (scripts/setup.sh installs clang and libclang-rt-14-dev)"
else
  scripts/fuzz.sh
fi
