#!/usr/bin/env bash
# Where AQ-SGD's CPU goes beyond DirectQ's: runs the slownet bench's 1x4
# pipeline (unshaped) for directq fw3bw6 and aqsgd fw3bw6 alternately, each
# under `perf record`, and prints the symbols whose share of the CPU samples
# differs most between the two modes (mean over runs, in per mille of all
# samples, steps 40%-90% of each run's time: past start-up and AQ-SGD's FULL
# epoch, before shutdown). Shares, not times: the 2 cores' speed moves by
# +-10% from run to run, the split of a run's CPU between symbols much less.
#
#   scripts/perf_link_modes.sh               # 4 runs of each mode, ~3 minutes
#   RUNS=6 STEPS=20 scripts/perf_link_modes.sh
#   SYMBOLS=_int_malloc,unlink_chunk scripts/perf_link_modes.sh  # only these
#   ANALYZE=1 SYMBOLS=... scripts/perf_link_modes.sh  # the last runs again, no new ones
#
# Needs perf (linux-perf) and a build (build/aqswarm). Work files: $OUT
# (default /tmp/aqswarm-perf-link-modes). Timed runs hold
# /tmp/aqswarm-bench.lock (flock), as timed benchmark runs should.
set -euo pipefail
ROOT=$(cd "$(dirname "$0")/.." && pwd)
AQSWARM=${AQSWARM:-$ROOT/build/aqswarm}
OUT=${OUT:-/tmp/aqswarm-perf-link-modes}
RUNS=${RUNS:-4}
STEPS=${STEPS:-14}
[[ $RUNS =~ ^[1-9][0-9]*$ ]] || { echo "perf_link_modes.sh: RUNS must be a positive integer" >&2; exit 2; }
[[ $STEPS =~ ^[1-9][0-9]*$ ]] || { echo "perf_link_modes.sh: STEPS must be a positive integer" >&2; exit 2; }
command -v perf >/dev/null || { echo "perf_link_modes.sh: needs perf (apt install linux-perf)" >&2; exit 2; }
[[ -x $AQSWARM ]] || { echo "perf_link_modes.sh: no $AQSWARM (build first)" >&2; exit 2; }
if [[ ${ANALYZE:-0} == 0 ]]; then
  rm -rf "$OUT" && mkdir -p "$OUT"

  for mode in directq aqsgd; do
    cat >"$OUT/$mode.json" <<EOF
{"name": "perf-$mode", "stages": 4, "dataParallel": 1, "threads": 1, "seed": 1,
 "epochs": 1000, "maxSteps": $STEPS, "evalBatches": 1, "evalEverySteps": 0,
 "microBatchSize": 8, "microBatchesPerStep": 128, "schedule": "adaptive",
 "model": {"vocabSize": 256, "seqLen": 64, "dModel": 32, "nLayer": 4, "nHead": 2},
 "data": {"syntheticTokens": 67009, "validationFraction": 0.02},
 "optimizer": {"lr": 0.0001, "gradClip": 1.0},
 "compression": {"mode": "$mode", "fwBits": 3, "bwBits": 6, "mPrecision": "fp16", "store": "rocksdb", "warmupEpochs": 0}}
EOF
  done

  for r in $(seq 1 "$RUNS"); do
    order="directq aqsgd"; ((r % 2)) || order="aqsgd directq"
    for mode in $order; do
      echo "perf_link_modes.sh: run $r $mode" >&2
      flock /tmp/aqswarm-bench.lock perf record -q -F 499 -o "$OUT/$mode-$r.data" -- \
        "$AQSWARM" pipeline --job="$OUT/$mode.json" --out_dir="$OUT/run-$mode-$r" >"$OUT/$mode-$r.out" 2>&1 ||
        { echo "perf_link_modes.sh: $mode run $r failed, see $OUT/$mode-$r.out" >&2; exit 1; }
    done
  done
fi
for mode in directq aqsgd; do
  for r in $(seq 1 "$RUNS"); do
    [[ -f $OUT/$mode-$r.data ]] || { echo "perf_link_modes.sh: no $OUT/$mode-$r.data (run without ANALYZE=1 first, with the same RUNS)" >&2; exit 2; }
  done
done

python3 - "$OUT" "$RUNS" "${SYMBOLS:-}" <<'EOF'
import collections, subprocess, sys
out, runs, only = sys.argv[1], int(sys.argv[2]), [s for s in sys.argv[3].split(",") if s]
share = {}
for mode in ("directq", "aqsgd"):
    total = collections.Counter()
    for r in range(1, runs + 1):
        rep = subprocess.run(["perf", "report", "-i", f"{out}/{mode}-{r}.data", "--no-children", "-g", "none",
                              "--sort", "dso,sym", "--stdio", "-F", "sample,dso,sym", "--time", "40%-90%"],
                             capture_output=True, text=True, check=True).stdout
        counts = {}
        for line in rep.splitlines():
            if line.startswith("#") or not line.strip():
                continue
            n, key = line.split(None, 1)
            counts[" ".join(key.split())[:100]] = int(n)
        n_all = sum(counts.values())
        for k, v in counts.items():
            total[k] += 1000.0 * v / n_all / runs
    share[mode] = total
d, a = share["directq"], share["aqsgd"]
keys = sorted(set(d) | set(a), key=lambda k: a[k] - d[k], reverse=True)
if only:
    keys = [k for k in keys if any(s in k for s in only)]
else:
    keys = keys[:25] + keys[-8:]
print(f"per mille of CPU samples, mean of {runs} runs each (steps 40%-90% of each run)")
print(f"{'directq':>8} {'aqsgd':>8} {'diff':>7}  symbol")
for k in keys:
    print(f"{d[k]:8.2f} {a[k]:8.2f} {a[k] - d[k]:+7.2f}  {k}")
EOF
