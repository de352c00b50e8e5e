#!/usr/bin/env bash
# The aqswarm demo. For now: the compression benchmark (the first capability
# that has landed); later the full local swarm (`aqswarm demo`).
set -euo pipefail
cd "$(dirname "$0")/.."
scripts/setup.sh >/dev/null
exec build/aqswarm bench compression --mib "${AQSWARM_DEMO_MIB:-16}" "$@"
