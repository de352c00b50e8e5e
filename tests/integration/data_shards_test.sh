#!/usr/bin/env bash
# Bring your own data, with the real binary: `aqswarm data prepare` turns .txt
# files and a .jsonl file into Llama-3 token shards (the same bytes for any
# thread count), `aqswarm data identify` prints the hashes prepare printed,
# a 2-stage Llama job pinned to those hashes trains from the shards and its
# loss falls, and wrong hashes, a wrong tokenizer and a bad .jsonl line are
# refused with the reason.
# usage: data_shards_test.sh AQSWARM_BINARY SOURCE_DIR   (~20 s on 2 cores)
set -euo pipefail
bin="$1"
data="$2/data"
[[ -f "$data/llama3/tokenizer.json" ]] || { echo "Llama-3 tokenizer missing: run scripts/fetch_data.sh"; exit 1; }
dir=$(mktemp -d "${TMPDIR:-/tmp}/aqswarm_shards_XXXXXX")
trap 'rm -rf "$dir"' EXIT
fail() { echo "FAIL: $*"; exit 1; }

mkdir -p "$dir/texts"
for f in $(ls "$data"/sotu/*.txt | sort | head -12); do cp "$f" "$dir/texts/"; done
printf '{"text": "A document from a JSON line."}\n{"text": "And another, with \\"quotes\\" and \\u00e9."}\n' > "$dir/extra.jsonl"

prep() {  # prep OUT THREADS
  "$bin" data prepare --input="$dir/texts,$dir/extra.jsonl" --tokenizer="$data/llama3" --out="$1" \
    --val_fraction=0.1 --shard_tokens=8000 --threads="$2"
}
prep "$dir/prepared" 2 > "$dir/prepare.out" 2>&1 || { cat "$dir/prepare.out"; fail "data prepare"; }
grep -q '14 documents' "$dir/prepare.out" || { cat "$dir/prepare.out"; fail "expected 14 documents"; }
prep "$dir/prepared1" 1 > /dev/null 2>&1 || fail "data prepare --threads=1"
for f in "$dir"/prepared/*; do cmp -s "$f" "$dir/prepared1/$(basename "$f")" || fail "$(basename "$f") differs with 1 thread"; done
[[ $(ls "$dir"/prepared/shard-*.bin | wc -l) -gt 3 ]] || fail "expected several shards"
dataset=$(sed -n 's/.*"datasetHash": "\([0-9a-f]*\)".*/\1/p' "$dir/prepare.out")
tokenizer=$(sed -n 's/.*"tokenizerHash": "\([0-9a-f]*\)".*/\1/p' "$dir/prepare.out")
[[ ${#dataset} == 16 && ${#tokenizer} == 16 ]] || { cat "$dir/prepare.out"; fail "prepare printed no hashes"; }
"$bin" data identify --corpus="$dir/prepared" --tokenizer="$data/llama3" > "$dir/identify.out" || fail "identify"
grep -q "\"datasetHash\": \"$dataset\", \"tokenizerHash\": \"$tokenizer\"" "$dir/identify.out" \
  || fail "identify printed $(cat "$dir/identify.out"), prepare $dataset $tokenizer"
echo "ok   data prepare (same bytes for 1 and 2 threads) + identify: $dataset $tokenizer"

job() {  # job NAME DATASET_HASH
  cat > "$dir/$1.json" <<JSON
{"name":"$1","seed":3,
 "model":{"family":"llama","vocabSize":128256,"seqLen":64,"dModel":32,"nLayer":2,"nHead":2,"nKvHead":1,"tieEmbeddings":true},
 "data":{"corpus":"$dir/prepared","tokenizer":"$data/llama3","datasetHash":"$2","tokenizerHash":"$tokenizer"},
 "optimizer":{"lr":0.01,"warmupSteps":2,"gradClip":1.0},
 "microBatchSize":4,"microBatchesPerStep":2,"epochs":1,"maxSteps":12,
 "compression":{"mode":"aqsgd","fwBits":3,"bwBits":6,"warmupEpochs":0},"stages":2,"threads":1,
 "evalEverySteps":0,"evalBatches":1,"device":"${AQSWARM_TEST_DEVICE:-cpu}"}
JSON
}
job train "$dataset"
"$bin" pipeline --job="$dir/train.json" --out_dir="$dir/run" > "$dir/run.out" 2>&1 || { tail -20 "$dir/run.out"; fail "pipeline from shards"; }
first=$(awk -F, 'NR==2{print $3}' "$dir/run/metrics.csv")
last=$(awk -F, 'END{print $3}' "$dir/run/metrics.csv")
awk -v a="$first" -v b="$last" 'BEGIN{exit !(b < a - 0.5)}' || fail "loss did not fall: $first -> $last"
echo "ok   a 2-stage Llama job trains from the shards: loss $first -> $last"

job wrong 0123456789abcdef
if "$bin" pipeline --job="$dir/wrong.json" --out_dir="$dir/run-wrong" > "$dir/wrong.out" 2>&1; then fail "wrong datasetHash trained"; fi
grep -q "dataset hash $dataset differs from the job's 0123456789abcdef" "$dir/wrong.out" "$dir"/run-wrong/*.log 2>/dev/null \
  || { tail -5 "$dir/wrong.out"; fail "wrong datasetHash: no reason given"; }
if "$bin" data identify --corpus="$dir/prepared" --tokenizer="$data/gpt2" > "$dir/tok.out" 2>&1; then fail "wrong tokenizer accepted"; fi
grep -q "was tokenized by tokenizer $tokenizer" "$dir/tok.out" || { cat "$dir/tok.out"; fail "wrong tokenizer: no reason"; }
printf '{"text": "fine"}\n{"text": 3}\n' > "$dir/bad.jsonl"
if "$bin" data prepare --input="$dir/bad.jsonl" --tokenizer="$data/llama3" --out="$dir/bad" > "$dir/bad.out" 2>&1; then
  fail "a bad .jsonl line was accepted"
fi
grep -q "bad.jsonl:2: field 'text' is number" "$dir/bad.out" || { cat "$dir/bad.out"; fail "bad line: no FILE:LINE"; }
echo "ok   wrong hashes, a wrong tokenizer and a bad .jsonl line are refused with the reason"
