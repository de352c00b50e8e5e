#!/usr/bin/env bash
# Builds the libFuzzer targets (fuzz/, docs/FUZZING.md) with clang into
# build-fuzz/ and runs each on a copy of its seed corpus for FUZZ_SECONDS.
#   scripts/fuzz.sh                      # every target, FUZZ_SECONDS (default 20) each
#   scripts/fuzz.sh link_frame jobspec   # only these targets
#   FUZZ_SECONDS=600 FUZZ_JOBS=1 scripts/fuzz.sh codec_decode
#   scripts/fuzz.sh --seeds              # rewrite fuzz/corpus/ with fuzz_seed_gen
#   scripts/fuzz.sh --check              # exit 0 when clang + libFuzzer can build, 3 when not
#   FUZZ_RUNS=1000000 scripts/fuzz.sh    # a fixed number of inputs per target instead of a time
# Before fuzzing, each target replays the reproducers committed under
# fuzz/crashes/<target>/ (fixed findings stay fixed; one that fails again
# counts as a crash).
# The last line is always `fuzz: N targets, M execs, K crashes`; the exit
# status is non-zero when K > 0, a target fails to build, or a run fails.
# Crash reproducers land in build-fuzz/crashes/<target>/ (rerun one with
# build-fuzz/fuzz/<target>_fuzz <file>). New inputs the runs find go to a
# temporary directory and are discarded: the committed corpora stay small.
# Env: FUZZ_SECONDS, FUZZ_RUNS, FUZZ_JOBS (targets run at once; default: cores, at
# most 2), FUZZ_BUILD_DIR (default build-fuzz), AQSWARM_BUILD_LOCK (the
# flock file every cmake/ninja call takes; default /tmp/aqswarm-build.lock).
set -uo pipefail
cd "$(dirname "$0")/.."
ROOT=$PWD
BUILD=${FUZZ_BUILD_DIR:-build-fuzz}
SECONDS_EACH=${FUZZ_SECONDS:-20}
RUNS=${FUZZ_RUNS:-}
LIMIT=(-max_total_time="$SECONDS_EACH")
[[ -n $RUNS ]] && LIMIT=(-runs="$RUNS")
LOCK=${AQSWARM_BUILD_LOCK:-/tmp/aqswarm-build.lock}
CORES=$(nproc 2>/dev/null || echo 2)
JOBS=${FUZZ_JOBS:-$((CORES < 2 ? CORES : 2))}

summary() { echo "fuzz: $1 targets, $2 execs, $3 crashes"; }

# clang with the libFuzzer runtime (Debian 12: clang + libclang-rt-14-dev).
check_toolchain() {
  command -v clang >/dev/null && command -v clang++ >/dev/null || { echo "fuzz: clang not found"; return 3; }
  local probe
  probe=$(mktemp -d)
  printf 'extern "C" int LLVMFuzzerTestOneInput(const unsigned char*, unsigned long) { return 0; }\n' >"$probe/p.cc"
  if ! clang++ -fsanitize=fuzzer,address,undefined "$probe/p.cc" -o "$probe/p" 2>"$probe/err"; then
    echo "fuzz: clang cannot link -fsanitize=fuzzer ($(head -n 1 "$probe/err")); install libclang-rt-14-dev"
    rm -rf "$probe"
    return 3
  fi
  rm -rf "$probe"
}

MODE=run
TARGETS=()
for a in "$@"; do
  case "$a" in
    --check) MODE=check ;;
    --seeds) MODE=seeds ;;
    -h|--help) sed -n '2,16p' "$0"; exit 0 ;;
    *) TARGETS+=("$a") ;;
  esac
done

if ! check_toolchain; then
  [[ $MODE == check ]] && exit 3
  summary 0 0 0
  exit 3
fi
[[ $MODE == check ]] && { echo "fuzz: clang with libFuzzer: ok"; exit 0; }

SAN="-fsanitize=fuzzer-no-link,address,undefined -fno-sanitize-recover=undefined -fno-sanitize=vptr"
FLAGS="$SAN -fno-omit-frame-pointer -gline-tables-only"
start=$(date +%s)
if [[ ! -f $BUILD/CMakeCache.txt ]]; then
  mkdir -p "$BUILD"
  GENERATOR=()
  command -v ninja >/dev/null && GENERATOR=(-G Ninja)
  if ! flock "$LOCK" cmake -S . -B "$BUILD" "${GENERATOR[@]}" -DAQSWARM_FUZZ=ON \
      -DCMAKE_C_COMPILER=clang -DCMAKE_CXX_COMPILER=clang++ -DCMAKE_BUILD_TYPE=Fuzz \
      -DCMAKE_C_FLAGS_FUZZ=-O1 -DCMAKE_CXX_FLAGS_FUZZ=-O1 \
      -DCMAKE_C_FLAGS="$FLAGS" -DCMAKE_CXX_FLAGS="$FLAGS" >"$BUILD/configure.log" 2>&1; then
    tail -n 30 "$BUILD/configure.log"
    echo "fuzz: configuring $BUILD failed (log: $BUILD/configure.log)"
    summary 0 0 0
    exit 1
  fi
fi
# Only the fuzz targets and what they link: no torch library is compiled.
if ! flock "$LOCK" cmake --build "$BUILD" --target aqswarm_fuzz -j "$CORES" >"$BUILD/fuzz-build.log" 2>&1; then
  grep -E "error|FAILED" "$BUILD/fuzz-build.log" | head -n 30
  echo "fuzz: building the fuzz targets failed (log: $BUILD/fuzz-build.log)"
  summary 0 0 0
  exit 1
fi
echo "fuzz: build took $(($(date +%s) - start)) s"

if [[ $MODE == seeds ]]; then
  rm -rf fuzz/corpus.new
  "$BUILD/fuzz/fuzz_seed_gen" fuzz/corpus.new || exit 1
  rm -rf fuzz/corpus && mv fuzz/corpus.new fuzz/corpus
  du -sh fuzz/corpus
  exit 0
fi

mapfile -t ALL <"$BUILD/fuzz/targets.txt"
if ((${#TARGETS[@]} == 0)); then
  for t in "${ALL[@]}"; do [[ -n $t ]] && TARGETS+=("${t%_fuzz}"); done
fi
WORK=$(mktemp -d "${TMPDIR:-/tmp}/aqswarm-fuzz.XXXXXX")
trap 'chmod -R u+w "$WORK" 2>/dev/null; rm -rf "$WORK"' EXIT
mkdir -p "$BUILD/crashes"
export LSAN_OPTIONS="suppressions=$ROOT/fuzz/lsan.supp${LSAN_OPTIONS:+:$LSAN_OPTIONS}"

# Runs one target; writes its exec count and status to $WORK/<target>.result.
run_target() {
  local t=$1 bin="$BUILD/fuzz/$1_fuzz"
  local seeds="$WORK/$t/seeds" found="$WORK/$t/new" crashes="$BUILD/crashes/$t"
  rm -rf "$crashes"
  mkdir -p "$seeds" "$found" "$crashes"
  if [[ ! -x $bin ]]; then
    echo "0 missing" >"$WORK/$t.result"
    return
  fi
  [[ -d fuzz/corpus/$t ]] && cp -r "fuzz/corpus/$t/." "$seeds/"
  chmod -R a-w "$seeds"
  # Committed reproducers first: each must now run clean.
  if compgen -G "fuzz/crashes/$t/*" >/dev/null; then
    if ! timeout -k 10 300 "$bin" -runs=1 -rss_limit_mb=2048 -malloc_limit_mb=1024 fuzz/crashes/"$t"/* \
        >"$WORK/$t.log" 2>&1; then
      cp "$WORK/$t.log" "$BUILD/crashes/$t.log"
      echo "0 regression" >"$WORK/$t.result"
      return
    fi
  fi
  # libFuzzer writes new inputs into the first directory only.
  # -rss_limit_mb: a parser that allocates what the input claims is a finding.
  local wall=$((SECONDS_EACH + 120))
  [[ -n $RUNS ]] && wall=86400
  timeout -k 10 "$wall" "$bin" "$found" "$seeds" "${LIMIT[@]}" \
    -print_final_stats=1 -rss_limit_mb=2048 -malloc_limit_mb=1024 -timeout=25 -max_len=65536 \
    -artifact_prefix="$crashes/" >"$WORK/$t.log" 2>&1
  local rc=$?
  local execs
  execs=$(grep -o 'stat::number_of_executed_units: *[0-9]*' "$WORK/$t.log" | grep -o '[0-9]*$' | tail -n 1)
  cp "$WORK/$t.log" "$BUILD/crashes/$t.log"
  echo "${execs:-0} $rc" >"$WORK/$t.result"
}

for t in "${TARGETS[@]}"; do
  while (($(jobs -rp | wc -l) >= JOBS)); do wait -n; done
  run_target "$t" &
done
wait

total_execs=0
crashed=0
failed=0
for t in "${TARGETS[@]}"; do
  read -r execs rc <"$WORK/$t.result"
  total_execs=$((total_execs + execs))
  if [[ $rc == missing ]]; then
    echo "fuzz: $t: no binary $BUILD/fuzz/${t}_fuzz"
    failed=1
    continue
  fi
  if [[ $rc == regression ]]; then
    crashed=$((crashed + 1))
    echo "fuzz: $t: CRASH on a committed reproducer in fuzz/crashes/$t/ (log: $BUILD/crashes/$t.log):"
    grep -E "Running: |ERROR: |runtime error|SUMMARY" "$BUILD/crashes/$t.log" | tail -n 4 | sed 's/^/  /'
    continue
  fi
  artifacts=$(find "$BUILD/crashes/$t" -type f 2>/dev/null | wc -l)
  if ((rc != 0 || artifacts > 0)); then
    crashed=$((crashed + 1))
    echo "fuzz: $t: CRASH (exit $rc) after $execs execs; reproducers in $BUILD/crashes/$t/:"
    grep -E "ERROR: |runtime error|SUMMARY|==ERROR|Test unit written" "$BUILD/crashes/$t.log" | head -n 8 | sed 's/^/  /'
  else
    echo "fuzz: $t: $execs execs in $(grep -o 'Done [0-9]* runs in [0-9]* second' "$WORK/$t.log" | grep -o '[0-9]* second' | tail -n 1)s, $(grep -o 'cov: [0-9]*' "$WORK/$t.log" | tail -n 1), clean"
  fi
done
echo "fuzz: total $(($(date +%s) - start)) s (build + runs)"
summary "${#TARGETS[@]}" "$total_execs" "$crashed"
((crashed == 0 && failed == 0))
