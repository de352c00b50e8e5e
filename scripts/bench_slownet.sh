#!/usr/bin/env bash
# Runs `aqswarm bench slownet` (the AQ-SGD paper's Table 2 as ratios), then
# paired AQ-SGD vs DirectQ runs, copies the run into docs/data and redraws the
# docs: the slow-network section of docs/BENCHMARKS.md (between
# <!-- slownet:begin --> and <!-- slownet:end -->), docs/notebook/slownet_run.md
# and the two PNG plots. The statistics and the markdown are the Python
# package scripts/slownet_report (tests: scripts/tests/test_slownet_report.py).
#
#   scripts/bench_slownet.sh                 # full table (~40 min on 2 cores; $DEFAULT_ARGS below)
#   scripts/bench_slownet.sh --render        # redraw the docs from the committed docs/data only
#   JSON=/tmp/aqswarm-slownet/slownet.jsonl scripts/bench_slownet.sh   # redraw from an existing $OUT
#   JSON=$OUT/slownet.jsonl OUT=... MORE_PAIRED=4 scripts/bench_slownet.sh   # 4 more paired runs (~8 min each), then redraw
#   scripts/bench_slownet.sh --slownet_grid=false --slownet_bandwidths=100,10   # extra flags go to the bench
#
# Environment: AQSWARM (binary, default build/aqswarm), OUT (raw runs and the
# JSON, default /tmp/aqswarm-slownet), JSON (skip the run, use this file),
# RUN_NETNS=1 (root: also run deploy/netns/run_tc.sh and put its table in the docs;
# NETNS_PASSES, default 2, its passes),
# PAIRED=0 (skip the paired AQ-SGD vs DirectQ cells run after the table),
# PAIRED_RUNS (how many times to run them, default 2: their verdict moves
# from run to run more than one run's intervals say), MORE_PAIRED=N (with
# JSON: add N repeats of the paired run to that OUT, then redraw).
# Needs: python3, gnuplot (the plots; without it the docs are still redrawn).
set -euo pipefail
ROOT=$(cd "$(dirname "$0")/.." && pwd)
AQSWARM=${AQSWARM:-$ROOT/build/aqswarm}
OUT=${OUT:-/tmp/aqswarm-slownet}
DATA=$ROOT/docs/data
[[ ${PAIRED_RUNS:-2} =~ ^[1-9][0-9]*$ ]] || { echo "bench_slownet.sh: PAIRED_RUNS must be a positive integer" >&2; exit 2; }
command -v python3 >/dev/null || { echo "bench_slownet.sh: needs python3" >&2; exit 1; }
report() { PYTHONPATH="$ROOT/scripts${PYTHONPATH:+:$PYTHONPATH}" python3 -m slownet_report "$@"; }

# Draws docs/slownet_throughput.png and docs/slownet_ratio.png from the
# gnuplot input that `slownet_report render --plot_data DIR` wrote into DIR.
plots() {
  local dir=$1 series=() i=0 s cmds2=() cmds3=() dash
  command -v gnuplot >/dev/null || { echo "bench_slownet.sh: no gnuplot; the plots are not redrawn" >&2; return 0; }
  mapfile -t series <"$dir/series.txt"
  for s in "${series[@]}"; do
    dash=1; [[ $s == 2x* ]] && dash=2
    cmds2+=("'$dir/slownet.dat' index $i using 1:2 with linespoints lw 2 dt $dash title '$s'")
    cmds3+=("'$dir/slownet.dat' index $i using 1:3 with linespoints lw 2 dt $dash title '$s'")
    i=$((i + 1))
  done
  local common="set terminal pngcairo size 1000,620 font 'sans,11';
set logscale x; set grid; set key outside right;
set xrange [7:14000]; set xtics ('10' 10, '100' 100, '300' 300, '1000' 1000, '500' 500, 'unshaped' 10000);
set xlabel 'link bandwidth (Mbit/s, each direction)'"
  (IFS=,
   gnuplot -e "$common; set output '$ROOT/docs/slownet_throughput.png';
     set ylabel 'samples/s'; set logscale y; set title 'aqswarm bench slownet: throughput vs link bandwidth';
     plot ${cmds2[*]}"
   gnuplot -e "$common; set output '$ROOT/docs/slownet_ratio.png';
     set ylabel 'ratio to unshaped fp32'; set yrange [0:*]; set title 'throughput / unshaped fp32 (paper Table 2 shape)';
     plot ${cmds3[*]}")
}

# Renders the docs from docs/data and draws the plots.
render() {
  local plotdir
  plotdir=$(mktemp -d)
  report render --data "$DATA" --plot_data "$plotdir"
  plots "$plotdir"
  rm -rf "$plotdir"
  echo "bench_slownet.sh: wrote docs/BENCHMARKS.md (slownet section), docs/notebook/slownet_run.md, docs/slownet_*.png"
}

if [[ ${1:-} == --render ]]; then
  render
  exit 0
fi

# The published table: the issue's modes and bandwidths under the default
# (adaptive) schedule, fp32 under the fixed 1F1B order and under GPipe as
# comparison columns, the grid at 0/100/10 Mbit/s, 3 passes of 4 timed steps
# (of 128 micro-batches) per cell. Arguments replace these.
DEFAULT_ARGS=(--slownet_modes=fp32,directq:3:6,aqsgd:3:6,aqsgd:4:8,fp32@1f1b,fp32@gpipe --slownet_grid_bandwidths=0,100,10
              --slownet_repeats=3 --slownet_steps=4)
(( $# > 0 )) || set -- "${DEFAULT_ARGS[@]}"
# AQ-SGD vs DirectQ at every bandwidth where both are CPU-bound (at 10 Mbit/s
# both sit at their link limits), after the table: the two back to back, each
# one pipeline run with its bandwidths interleaved step by step, in many short
# passes. The machine's speed moves in phases of seconds to tens of seconds,
# so many short windows estimate a difference better than a few long ones.
PAIRED_ARGS=(--json --slownet_out_dir="$OUT/runs_paired" --slownet_bandwidths=0,1000,500,300,100
             --slownet_modes=directq:3:6,aqsgd:3:6 --slownet_grid=false --slownet_steps=5 --slownet_repeats=8)

# How fast the machine is from second to second: CPU seconds of a fixed
# single-thread loop, 15 times (a JSON list). Same work every time, so the
# spread is the machine's (other tenants of its cores), not ours.
speed_probe() {
  python3 -c '
import json, time
out = []
for _ in range(15):
    t = time.process_time(); x = 0
    for i in range(1500000): x += i * i % 7
    out.append(round(time.process_time() - t, 4))
print(json.dumps(out))'
}

# The checkout's commit, "+local changes" when tracked files differ from it.
build_id() {
  local b
  b=$(git -C "$ROOT" rev-parse --short HEAD 2>/dev/null || echo "?")
  [[ -z $(git -C "$ROOT" status --porcelain --untracked-files=no 2>/dev/null) ]] || b+="+local changes"
  echo "$b"
}

# Paired run $1 (1: $OUT/paired.jsonl, k >= 2: $OUT/paired_repeat_k.jsonl), with
# its command and when it ran on which build (..._command, ..._when). A try
# that fails (a pipeline that errs, or hangs past its timeout) is said loudly,
# logged in $OUT/paired_failures (the docs list it) and run once more into
# its own directory; a second failure stops the script, keeping what ran.
paired_run() {
  local k=$1 base dir try d err when build rc args
  if (( k == 1 )); then base=$OUT/paired dir=$OUT/runs_paired; else base=$OUT/paired_repeat_$k dir=$OUT/runs_paired_$k; fi
  build=$(build_id)
  for try in 1 2; do
    d=$dir err=$base.stderr; (( try == 1 )) || d+=_retry err=${base}_retry.stderr
    args=("${PAIRED_ARGS[@]/#--slownet_out_dir=*/--slownet_out_dir=$d}")
    when=$(date -u +%Y-%m-%dT%H:%MZ)
    echo "${AQSWARM#"$ROOT"/} bench slownet ${args[*]}" >"${base}_command"
    echo "started $when, build $build" >"${base}_when"
    rc=0
    "$AQSWARM" bench slownet "${args[@]}" >"$base.jsonl.tmp" 2>"$err" || rc=$?
    cat "$err" >&2
    if (( rc == 0 )); then mv "$base.jsonl.tmp" "$base.jsonl"; return 0; fi
    rm -f "$base.jsonl.tmp"
    echo "paired run $k, try $try ($when, build $build): exit $rc: $(grep -v '^\s*$' "$err" | tail -n 1)" >>"$OUT/paired_failures"
    echo "bench_slownet.sh: PAIRED RUN $k FAILED (try $try, exit $rc; stderr: $err, stage logs under $d)" >&2
  done
  echo "bench_slownet.sh: paired run $k failed twice; stopping. The table is kept: redraw with JSON=$JSON OUT=$OUT $0" >&2
  exit 1
}

mkdir -p "$OUT"
CMD="${AQSWARM#"$ROOT"/} bench slownet --json --slownet_out_dir=$OUT/runs${*:+ $*}"
# MORE_PAIRED=N with JSON: N more repeats of the paired run into an existing
# $OUT (after its last one; 9 runs at most), then the docs are redrawn.
if [[ -n ${MORE_PAIRED:-} ]]; then
  [[ $MORE_PAIRED =~ ^[1-8]$ && -n ${JSON:-} && -f $OUT/paired.jsonl ]] ||
    { echo "bench_slownet.sh: MORE_PAIRED=1..8 needs JSON= and an OUT with a paired run (paired.jsonl)" >&2; exit 2; }
  [[ -x $AQSWARM ]] || { echo "bench_slownet.sh: build first: cmake --build build --target aqswarm" >&2; exit 1; }
  last=1
  for f in "$OUT"/paired_repeat_*.jsonl; do
    [[ -f $f ]] || continue
    k=${f##*_}; k=${k%.jsonl}
    [[ $k =~ ^[0-9]+$ ]] && (( k > last )) && last=$k
  done
  (( last + MORE_PAIRED <= 9 )) || { echo "bench_slownet.sh: $OUT has $last paired runs; 9 at most" >&2; exit 2; }
  for k in $(seq $((last + 1)) $((last + MORE_PAIRED))); do paired_run "$k"; done
fi
if [[ -z ${JSON:-} ]]; then
  [[ -x $AQSWARM ]] || { echo "bench_slownet.sh: build first: cmake --build build --target aqswarm" >&2; exit 1; }
  JSON=$OUT/slownet.jsonl
  uptime >"$OUT/uptime_start"
  build_id >"$OUT/build"
  speed_probe >"$OUT/probe_start"
  start=$(date +%s)
  "$AQSWARM" bench slownet --json --slownet_out_dir="$OUT/runs" "$@" >"$JSON.tmp"
  mv "$JSON.tmp" "$JSON"
  echo "$(( $(date +%s) - start ))" >"$OUT/wall_seconds"
  date -u +%Y-%m-%dT%H:%MZ >"$OUT/finished"
  # The links' two ends alone (no model, no transport): what AQ-SGD's
  # per-sample state costs in CPU, for the AQ-SGD vs DirectQ note.
  "$AQSWARM" bench link --json >"$OUT/link.jsonl" || rm -f "$OUT/link.jsonl"
  # AQ-SGD vs DirectQ in paired cells (PAIRED_ARGS): the table's 3 passes
  # cannot tell a 5% difference from the machine's noise.
  rm -f "$OUT"/paired.* "$OUT"/paired_*
  if [[ ${PAIRED:-1} != 0 ]]; then
    # Run 1's cells are the ones the notes detail; the rest repeat it.
    for k in $(seq 1 "${PAIRED_RUNS:-2}"); do paired_run "$k"; done
  fi
  echo "$CMD" >"$OUT/command"
  speed_probe >"$OUT/probe_end"
  uptime >"$OUT/uptime"
fi
# Kernel-shaping check (root only): RUN_NETNS=1 also runs deploy/netns/run_tc.sh;
# its summary goes into the docs.
if [[ ${RUN_NETNS:-0} == 1 ]]; then
  rm -rf "$OUT/netns"
  # The same OpenBLAS kernels as the bench's pipelines (see slownet_bench.cc).
  core=$(python3 -c 'import json,sys; print(json.loads(open(sys.argv[1]).readline()).get("blas_core",""))' "$JSON")
  case $core in Haswell|SkylakeX|Cooperlake|SapphireRapids) export OPENBLAS_CORETYPE=${OPENBLAS_CORETYPE:-$core} ;; esac
  # The tc runs under CUBIC and under BBR where the kernel has both (a fresh
  # namespace gets the host's default, often one of the two).
  ccs=""
  for cc in cubic bbr; do grep -qw "$cc" /proc/sys/net/ipv4/tcp_available_congestion_control && ccs+="$cc "; done
  OUT="$OUT/netns" AQSWARM="$AQSWARM" TCP_CCS="${TCP_CCS:-${ccs% }}" PASSES="${NETNS_PASSES:-2}" "$ROOT/deploy/netns/run_tc.sh" ||
    echo "bench_slownet.sh: netns check failed" >&2
fi
echo "bench_slownet.sh: results in $JSON"
# The published run's data goes beside the docs (docs/data/slownet*), then the
# docs are drawn from there.
report collect --out "$OUT" --json "$JSON" --data "$DATA"
render
