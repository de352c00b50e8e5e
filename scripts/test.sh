#!/usr/bin/env bash
# Runs setup (packages + build), then every test through ctest.
#   scripts/test.sh               # all tests
#   scripts/test.sh -L unit       # extra args go to ctest
set -euo pipefail
cd "$(dirname "$0")/.."
scripts/setup.sh
cd build
ctest --output-on-failure --timeout 600 -j 2 "$@"
