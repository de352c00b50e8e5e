#!/usr/bin/env bash
# Reruns the component benchmarks (link, compression, store, allreduce,
# scheduler, coordinator) into docs/data/NAME.jsonl, writes one line per run into
# docs/data/NAME.meta (build, time, cores, load) and redraws their sections of
# docs/BENCHMARKS.md with scripts/render_benchmarks.py. ~12 minutes on 2 cores.
set -euo pipefail
cd "$(dirname "$0")/.."
[[ -x build/aqswarm ]] || scripts/setup.sh
mkdir -p docs/data
build=$(git rev-parse --short HEAD 2>/dev/null || echo "?")
[[ -z $(git status --porcelain --untracked-files=no 2>/dev/null) ]] || build+="+local changes"
run() {  # run NAME ARGS...
  local name="$1"; shift
  echo "== $name: build/aqswarm $*"
  build/aqswarm "$@" > "docs/data/$name.jsonl"
  echo "build $build, $(date -u +%Y-%m-%dT%H:%MZ), $(nproc) cores, load average $(cut -d' ' -f1-3 /proc/loadavg) at the end." \
    > "docs/data/$name.meta"
}
run compression bench compression --json --repeats 5
run store bench store --json
run link bench link --json --repeats 5
run scheduler bench scheduler --json
run allreduce bench allreduce --json --repeats 2
run coordinator bench coordinator --json
python3 scripts/render_benchmarks.py compression store link scheduler allreduce coordinator
