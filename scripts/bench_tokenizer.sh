#!/usr/bin/env bash
# Tokens/second on one core: the C++ tokenizer (`aqswarm tokenize --stats`)
# against the JavaScript reference (transformers.js, @lenml/tokenizers 3.7.2)
# on the same texts, in the same run. Both encode each corpus file as one text
# with added tokens as ordinary text, both are pinned to CPU 0 (taskset), and
# both time encoding alone (not loading the tokenizer or printing ids); the
# JavaScript side gets a warm-up pass over the first file for its JIT. The
# token counts of the two must agree (a 10 MB correctness check too).
#
# usage: scripts/bench_tokenizer.sh [FAMILY...]     (default: llama3 qwen3)
#   RUNS=3 CORPUS='data/sotu/*.txt' AQSWARM_BIN=build/aqswarm
# Needs node and a built aqswarm; fetches the reference library like
# scripts/gen_tokenizer_reference.sh does. Prints one line per run and, per
# family, the median (min..max) of each side and the ratio of the medians.
set -euo pipefail
cd "$(dirname "$0")/.."

RUNS="${RUNS:-3}"
BIN="${AQSWARM_BIN:-build/aqswarm}"
DATA_DIR="${AQSWARM_DATA_DIR:-$PWD/data}"
FAMILIES=("$@")
((${#FAMILIES[@]})) || FAMILIES=(llama3 qwen3)
# shellcheck disable=SC2206
FILES=(${CORPUS:-$DATA_DIR/sotu/*.txt})

die() { echo "bench_tokenizer: ERROR: $*" >&2; exit 1; }
[[ -x "$BIN" ]] || die "$BIN missing: /work/build.sh aqswarm (or set AQSWARM_BIN)"
[[ -f "${FILES[0]}" ]] || die "no corpus files (${FILES[0]}): run scripts/fetch_data.sh"
command -v node >/dev/null || die "node not found"
LIB_MAIN="$(scripts/gen_tokenizer_reference.sh --lib)"
PIN=()
command -v taskset >/dev/null && PIN=(taskset -c 0)

TMP="$(mktemp -d "${TMPDIR:-/tmp}/aqswarm-benchtok.XXXXXX")"
trap 'rm -rf "$TMP"' EXIT
# Each file as one JSON string per line, for `aqswarm tokenize --jsonl`.
node -e 'const fs = require("fs");
  for (const f of process.argv.slice(1)) console.log(JSON.stringify(fs.readFileSync(f, "utf8")));' \
  "${FILES[@]}" > "$TMP/corpus.jsonl"
bytes=$(cat "${FILES[@]}" | wc -c)
echo "corpus: ${#FILES[@]} files, $bytes bytes; $RUNS runs; pinned: ${PIN[*]:-no}; $(nproc) cores"

field() { sed -n "s/.*$1=\([0-9.]*\).*/\1/p" "$2"; }
stats() {  # median (min..max) of the numbers on stdin
  sort -n | awk '{v[NR]=$1} END {m = NR % 2 ? v[(NR+1)/2] : (v[NR/2]+v[NR/2+1])/2;
    printf "%.0f (%.0f..%.0f, spread %.1f%%)", m, v[1], v[NR], m ? 100*(v[NR]-v[1])/m : 0}'
}

for family in "${FAMILIES[@]}"; do
  [[ -f "$DATA_DIR/$family/tokenizer.json" ]] || die "$DATA_DIR/$family/tokenizer.json missing"
  : > "$TMP/cpp.$family"; : > "$TMP/js.$family"
  for ((run = 1; run <= RUNS; run++)); do
    "${PIN[@]}" "$BIN" tokenize --tokenizer "$DATA_DIR/$family" --jsonl --stats < "$TMP/corpus.jsonl" \
      > /dev/null 2> "$TMP/cpp.out"
    "${PIN[@]}" node scripts/gen_tokenizer_reference.mjs bench "$LIB_MAIN" "$DATA_DIR/$family" "${FILES[@]}" \
      > "$TMP/js.out"
    cpp_tokens=$(field tokens "$TMP/cpp.out"); js_tokens=$(field tokens "$TMP/js.out")
    [[ "$cpp_tokens" == "$js_tokens" ]] || die "$family: C++ made $cpp_tokens tokens, the reference $js_tokens"
    cpp_rate=$(field tokens_per_second "$TMP/cpp.out"); js_rate=$(field tokens_per_second "$TMP/js.out")
    echo "$cpp_rate" >> "$TMP/cpp.$family"; echo "$js_rate" >> "$TMP/js.$family"
    echo "$family run $run: tokens=$cpp_tokens  C++ $cpp_rate tok/s  JS $js_rate tok/s" \
         " ratio $(awk -v a="$cpp_rate" -v b="$js_rate" 'BEGIN{printf "%.1f", a/b}')x"
  done
  cpp_med=$(stats < "$TMP/cpp.$family"); js_med=$(stats < "$TMP/js.$family")
  echo "$family: C++ $cpp_med tok/s; JS reference $js_med tok/s;" \
       "ratio of medians $(awk -v a="${cpp_med%% *}" -v b="${js_med%% *}" 'BEGIN{printf "%.1f", a/b}')x"
done
