#!/usr/bin/env bash
# Fine-tune -> export -> generate -> fine-tune again, with the real binary:
#   aqswarm pipeline (2 stages, tied embeddings) keeps each stage's final state,
#   aqswarm export writes a Hugging Face directory, aqswarm generate continues
#   a prompt from it (greedy and seeded sampling reproducible), and a second
#   job with model.initFrom = that directory starts at the trained loss.
# usage: hf_roundtrip_test.sh AQSWARM_BINARY SOURCE_DIR   (~10 s on 2 cores)
set -euo pipefail
bin="$1"
data="$2/data"
[[ -f "$data/gpt2/encoder.json" ]] || { echo "GPT-2 tokenizer files missing: run scripts/fetch_data.sh"; exit 1; }
dir=$(mktemp -d "${TMPDIR:-/tmp}/aqswarm_hf_XXXXXX")
trap 'rm -rf "$dir"' EXIT
mkdir -p "$dir/corpus"
head -c 9000 "$(ls "$data"/sotu/*.txt | sort | head -1)" > "$dir/corpus/small.txt"
job() {  # job NAME EXTRA_MODEL_FIELDS
  cat > "$dir/$1.json" <<JSON
{"name":"$1","seed":5,
 "model":{"seqLen":32,"dModel":32,"nLayer":3,"nHead":2,"tieEmbeddings":true$2},
 "data":{"corpus":"$dir/corpus","tokenizer":"$data/gpt2","cacheDir":"$dir/cache"},
 "optimizer":{"lr":0.003,"warmupSteps":2,"gradClip":1.0},
 "microBatchSize":4,"microBatchesPerStep":2,"epochs":1,"maxSteps":5,
 "compression":{"mode":"fp32"},"stages":2,"evalEverySteps":0,"evalBatches":1,
 "device":"${AQSWARM_TEST_DEVICE:-cpu}"}
JSON
}
first_loss() { awk -F, 'NR==2{print $3}' "$1/metrics.csv"; }
fail() { echo "FAIL: $*"; exit 1; }

job base ""
"$bin" pipeline --job="$dir/base.json" --out_dir="$dir/run" > "$dir/run.out" 2>&1 || { cat "$dir/run.out"; fail "pipeline"; }
ls "$dir"/run/checkpoints/stage-{0,1}/state-5.ckpt > /dev/null || fail "no final state per stage"
"$bin" export --run "$dir/run" --out "$dir/model" || fail "export"
for f in config.json model.safetensors encoder.json vocab.bpe vocab.json merges.txt; do
  [[ -s "$dir/model/$f" ]] || fail "export wrote no $f"
done
grep -q '"GPT2LMHeadModel"' "$dir/model/config.json" || fail "config.json architectures"
echo "ok   pipeline + export"

prompt="Fellow citizens of the Senate"
g1=$("$bin" generate --model "$dir/model" --prompt "$prompt" --max_tokens 8) || fail "generate"
g2=$("$bin" generate --model "$dir/model" --prompt "$prompt" --max_tokens 8)
[[ "$g1" == "$prompt"* ]] || fail "generate does not start with the prompt: $g1"
[[ "$g1" == "$g2" ]] || fail "greedy differs between runs: '$g1' vs '$g2'"
s1=$("$bin" generate --model "$dir/model" --prompt "$prompt" --max_tokens 8 --temperature 1 --top_k 50 --seed 7)
s2=$("$bin" generate --model "$dir/model" --prompt "$prompt" --max_tokens 8 --temperature 1 --top_k 50 --seed 7)
[[ "$s1" == "$s2" ]] || fail "seeded sampling differs: '$s1' vs '$s2'"
echo "ok   generate: $g1"

# The exported model as the start of another job: its first loss is the
# trained model's, well below a fresh model's.
job tuned ",\"initFrom\":\"$dir/model\""
"$bin" pipeline --job="$dir/tuned.json" --out_dir="$dir/tuned" > "$dir/tuned.out" 2>&1 || { cat "$dir/tuned.out"; fail "pipeline from initFrom"; }
fresh=$(first_loss "$dir/run") tuned=$(first_loss "$dir/tuned")
awk -v f="$fresh" -v t="$tuned" 'BEGIN{exit !(t < f - 0.05)}' || fail "initFrom: first loss $tuned not below the fresh $fresh"
echo "ok   initFrom: first loss $tuned (fresh model: $fresh)"
# A job that does not match the directory fails, naming the field.
job wrong ",\"initFrom\":\"$dir/model\",\"nHead\":4"
sed -i 's/"nHead":2,//' "$dir/wrong.json"
if "$bin" pipeline --job="$dir/wrong.json" --out_dir="$dir/wrong" > "$dir/wrong.out" 2>&1; then fail "mismatched initFrom accepted"; fi
grep -q "n_head" "$dir/wrong.out" || { cat "$dir/wrong.out"; fail "the mismatch does not name n_head"; }
echo "ok   mismatched initFrom names n_head"

# A 2-stage Llama (grouped-query attention, tied embeddings) computing in
# bf16: it trains, exports as LlamaForCausalLM and generates from the export.
job llama ",\"family\":\"llama\",\"nKvHead\":1"
sed -i 's/"stages":2,/"stages":2,"precision":"bf16",/' "$dir/llama.json"
"$bin" pipeline --job="$dir/llama.json" --out_dir="$dir/llama" > "$dir/llama.out" 2>&1 || { cat "$dir/llama.out"; fail "llama bf16 pipeline"; }
grep -q "tied copies identical" "$dir/llama.out" || { cat "$dir/llama.out"; fail "llama: tied copies not reported identical"; }
"$bin" export --run "$dir/llama" --out "$dir/llama-model" || fail "llama export"
grep -q '"LlamaForCausalLM"' "$dir/llama-model/config.json" || fail "llama config.json architectures"
gl=$("$bin" generate --model "$dir/llama-model" --prompt "$prompt" --max_tokens 8) || fail "llama generate"
[[ "$gl" == "$prompt"* && "$gl" != "$prompt" ]] || fail "llama generate printed no continuation: $gl"
echo "ok   llama bf16: pipeline + export + generate: $gl"
