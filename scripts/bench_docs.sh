#!/usr/bin/env bash
# Reruns the component benchmarks and rewrites their sections of
# docs/BENCHMARKS.md (raw JSON lines in docs/data/). ~10 minutes.
set -euo pipefail
cd "$(dirname "$0")/.."
[[ -x build/aqswarm ]] || scripts/setup.sh
mkdir -p docs/data
run() {  # run NAME ARGS...
  local name="$1"; shift
  echo "== $name: build/aqswarm $*"
  build/aqswarm "$@" > "docs/data/$name.jsonl"
  echo "Run $(date -u +%Y-%m-%dT%H:%MZ), $(nproc) cores, load average $(cut -d' ' -f1-3 /proc/loadavg) at the end." \
    > "docs/data/$name.meta"
}
run compression bench compression --json --repeats 5
run store bench store --json
run link bench link --json --repeats 5
run scheduler bench scheduler --json
run allreduce bench allreduce --json --repeats 2
python3 scripts/render_benchmarks.py  # all sections; name some to rewrite only those
