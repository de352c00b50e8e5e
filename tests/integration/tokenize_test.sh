#!/usr/bin/env bash
# `aqswarm tokenize` with the real binary against the committed transformers.js
# reference ids (tests/data/tokenizer/, scripts/gen_tokenizer_reference.sh):
# every committed text through --jsonl, for Llama-3 and Qwen3, with added
# tokens as text (default) and with --added_tokens; plain lines; --decode
# round trips; bad input exits non-zero with a message.
# usage: tokenize_test.sh AQSWARM_BINARY SOURCE_DIR   (~3 s)
set -euo pipefail
bin="$1"
src="$2"
data="${AQSWARM_DATA_DIR:-$src/data}"
ref="$src/tests/data/tokenizer"
fail() { echo "FAIL: $*"; exit 1; }
for f in llama3/tokenizer.json qwen3/tokenizer.json; do
  [[ -f "$data/$f" ]] || fail "$data/$f missing: run scripts/fetch_data.sh"
done
dir=$(mktemp -d "${TMPDIR:-/tmp}/aqswarm_tokenize_XXXXXX")
trap 'rm -rf "$dir"' EXIT

n_texts=$(grep -c . "$ref/texts.jsonl")
((n_texts >= 60)) || fail "only $n_texts reference texts"
for family in llama3 qwen3; do
  # Reference lines are {"name":...,"ids":[...],"ids_ordinary":[...]}.
  sed 's/.*"ids_ordinary":\(\[[^]]*\]\)}$/\1/' "$ref/$family.jsonl" > "$dir/$family.ordinary"
  sed 's/.*"ids":\(\[[^]]*\]\),"ids_ordinary".*/\1/' "$ref/$family.jsonl" > "$dir/$family.added"
  "$bin" tokenize --tokenizer "$data/$family" --jsonl < "$ref/texts.jsonl" > "$dir/$family.out"
  diff -u "$dir/$family.ordinary" "$dir/$family.out" > "$dir/diff" || { head -20 "$dir/diff"; fail "$family ids differ"; }
  "$bin" tokenize --tokenizer "$data/$family/tokenizer.json" --jsonl --added_tokens < "$ref/texts.jsonl" > "$dir/$family.out2"
  diff -u "$dir/$family.added" "$dir/$family.out2" > "$dir/diff" || { head -20 "$dir/diff"; fail "$family --added_tokens ids differ"; }
  [[ $(wc -l < "$dir/$family.out") == "$n_texts" ]] || fail "$family: expected $n_texts lines"
  echo "ok: $family, $n_texts texts"
done

# Plain lines: the newline is not part of the text.
printf 'Hello, world!\n<|begin_of_text|>Hi\n' > "$dir/plain.txt"
"$bin" tokenize --tokenizer "$data/llama3" < "$dir/plain.txt" > "$dir/plain.ids"
[[ "$(sed -n 1p "$dir/plain.ids")" == "[9906,11,1917,0]" ]] || fail "Hello, world! -> $(sed -n 1p "$dir/plain.ids")"
grep -q 128000 "$dir/plain.ids" && fail "<|begin_of_text|> in text became the special token"
"$bin" tokenize --tokenizer "$data/llama3" --decode < "$dir/plain.ids" > "$dir/plain.back"
cmp "$dir/plain.txt" "$dir/plain.back" || fail "--decode did not give the lines back"
# --decode --jsonl gives the texts back as JSON strings.
"$bin" tokenize --tokenizer "$data/qwen3" --decode --jsonl < "$dir/qwen3.out" > "$dir/qwen3.texts"
[[ "$(sed -n 1p "$dir/qwen3.texts")" == '"Hello, world!"' ]] || fail "decode --jsonl: $(sed -n 1p "$dir/qwen3.texts")"

# Bad input: a clear error and a non-zero exit.
if echo 'not ids' | "$bin" tokenize --tokenizer "$data/qwen3" --decode 2> "$dir/err"; then fail "bad --decode input accepted"; fi
grep -q "JSON array" "$dir/err" || fail "unclear error: $(cat "$dir/err")"
if echo x | "$bin" tokenize --tokenizer "$dir/nothing" 2> "$dir/err"; then fail "missing tokenizer accepted"; fi
grep -q "no such file" "$dir/err" || fail "unclear error: $(cat "$dir/err")"
echo "PASS"
