#!/usr/bin/env bash
# Convergence study (not a CI test): pre-trains the same small GPT from scratch
# with each link/optimizer configuration on the State of the Union corpus and
# writes $OUT/table.md (table) and docs/convergence-<study>.png (curves).
#
#   scripts/convergence.sh pipeline    # 4 stages, fp32 / aqsgd / directq
#   scripts/convergence.sh dp          # 2 stages x 2 replicas, QuantizedAdam
#                                      # (and the -dpu rows: dp.delayedUpdate)
#   scripts/convergence.sh finetune    # pre-train a tied GPT on the
#                                      # 18th-19th century speeches, export it,
#                                      # fine-tune it on 4 stages on the
#                                      # post-1946 ones: fp32 / aqsgd / directq
#                                      # links (and from scratch, for scale)
#
# Scale knobs (environment), defaults sized for a 2-core machine:
#   CORPUS_FILES=12   first N speeches of data/sotu (sorted by name)
#   EPOCHS=5 SEQ=64 DMODEL=128 LAYERS=4 HEADS=4 MB=8 M=2 LR=0.003
#   BETA1= BETA2=     Adam's betas (unset: the job default, 0.9 and 0.999)
#   DP_WARMUP=0       dp study: QuantizedAdam warm-up steps (0 = a fifth of the
#                     estimated steps; the estimate can exceed the steps run)
#   DP_VARIANCE=raise_at_bound  dp study: dp.frozenVariance (or fixed)
#   DP_REFRESH=4      dp study: dp.varianceRefreshSteps (0 = never)
#   AQSWARM_BIN=build/aqswarm   the binary to run (e.g. another build dir's)
#   ONLY="name ..."   run only these configurations (diagnostics: the plot goes
#                     to $OUT, not docs/)
#   REUSE="name ..."  keep these configurations' finished runs in $OUT instead
#                     of rerunning them (deterministic baselines: the dp study's
#                     adamw-fp32 reproduces bit for bit); the job must be unchanged
#   OUT=runs/convergence-<study>   where jobs, logs, metrics and the table go
#   finetune study: PRE_FILES=24 PRE_EPOCHS=4 (the pre-training run: the first
#   PRE_FILES speeches, one stage, fp32), FT_FILES=12 (the fine-tuning corpus:
#   the first FT_FILES speeches from 1946 on); EPOCHS, LR as above (LR defaults
#   to 0.001 there)
set -euo pipefail
cd "$(dirname "$0")/.."
study="${1:-pipeline}"
CORPUS_FILES="${CORPUS_FILES:-12}"
EPOCHS="${EPOCHS:-5}"; SEQ="${SEQ:-64}"; DMODEL="${DMODEL:-128}"; LAYERS="${LAYERS:-4}"; HEADS="${HEADS:-4}"
LR_SET="${LR:-}"
MB="${MB:-8}"; M="${M:-2}"; LR="${LR:-0.003}"; BETA1="${BETA1:-}"; BETA2="${BETA2:-}"
DP_WARMUP="${DP_WARMUP:-0}"; DP_VARIANCE="${DP_VARIANCE:-raise_at_bound}"; DP_REFRESH="${DP_REFRESH:-4}"
AQSWARM_BIN="${AQSWARM_BIN:-build/aqswarm}"; ONLY="${ONLY:-}"; REUSE="${REUSE:-}"
out="${OUT:-runs/convergence-$study}"
mkdir -p "$out/corpus" docs
[[ -x "$AQSWARM_BIN" ]] || { [[ "$AQSWARM_BIN" == build/aqswarm ]] && scripts/setup.sh; }
[[ -x "$AQSWARM_BIN" ]] || { echo "no binary at $AQSWARM_BIN" >&2; exit 1; }
rm -f "$out"/corpus/*.txt
# (no `| head`: with pipefail, head closing the pipe early can fail the script)
mapfile -t speeches < <(ls data/sotu/*.txt | sort)
INIT=""  # finetune: the exported pre-trained model every fine-tuning job starts from
WARMUP_EPOCHS=1
if [[ "$study" == finetune ]]; then
  PRE_FILES="${PRE_FILES:-24}"; PRE_EPOCHS="${PRE_EPOCHS:-4}"; FT_FILES="${FT_FILES:-12}"
  [[ -n "$LR_SET" ]] || LR=0.001
  WARMUP_EPOCHS=0  # AQ-SGD sends first visits whole anyway; a fine-tune sees few epochs
  mkdir -p "$out/pre-corpus"
  rm -f "$out"/pre-corpus/*.txt
  cp "${speeches[@]:0:$PRE_FILES}" "$out/pre-corpus/"
  mapfile -t modern < <(ls data/sotu/*.txt | sort | awk -F/ '{split($NF, y, "_"); if (y[1] >= 1946) print}')
  cp "${modern[@]:0:$FT_FILES}" "$out/corpus/"
  pre_spe=$(( $(cat "$out"/pre-corpus/*.txt | wc -c) * 95 / 100 / 43 * 10 / SEQ / (MB * M) ))
  cat > "$out/pretrain.json" <<JSON
{"name":"pretrain","seed":3,
 "model":{"seqLen":$SEQ,"dModel":$DMODEL,"nLayer":$LAYERS,"nHead":$HEADS,"tieEmbeddings":true},
 "data":{"corpus":"$out/pre-corpus","tokenizer":"data/gpt2","cacheDir":"$out/pre-cache"},
 "optimizer":{"lr":0.003,"minLr":0.0003,"warmupSteps":50,"totalSteps":$(( pre_spe * PRE_EPOCHS )),"weightDecay":0.01,"gradClip":1.0},
 "microBatchSize":$MB,"microBatchesPerStep":$M,"epochs":$PRE_EPOCHS,"stages":1,"threads":2,
 "evalEverySteps":$(( pre_spe > 0 ? pre_spe : 1 )),"evalBatches":16}
JSON
  if [[ " $REUSE " == *" pretrain "* && -f "$out/pretrained/model.safetensors" ]]; then
    echo "== pretrain: reusing $out/pretrained"
  else
    echo "== pretrain ($(( pre_spe * PRE_EPOCHS )) steps planned, one stage)"
    "$AQSWARM_BIN" pipeline --job "$out/pretrain.json" --out_dir "$out/pretrain" > "$out/pretrain.log" 2>&1 || {
      echo "pre-training failed:"; tail -20 "$out/pretrain.log"; exit 1; }
    tail -2 "$out/pretrain.log"
    rm -rf "$out/pretrained"
    "$AQSWARM_BIN" export --run "$out/pretrain" --out "$out/pretrained"
  fi
  INIT="$(realpath "$out/pretrained")"
else
  cp "${speeches[@]:0:$CORPUS_FILES}" "$out/corpus/"
fi

job() {  # job NAME MODE FW BW STAGES DP DPOPT [dpu]
  local name="$1" mode="$2" fw="$3" bw="$4" stages="$5" dp="$6" dpopt="$7" dpx=""
  [[ "$dpopt" != quantized_adam ]] || dpx=",\"frozenVariance\":\"$DP_VARIANCE\",\"varianceRefreshSteps\":$DP_REFRESH"
  [[ "${8:-}" != dpu ]] || dpx="$dpx,\"delayedUpdate\":true"
  local betas="" model_x=""
  [[ -z "$INIT" ]] || model_x=",\"tieEmbeddings\":true"
  [[ -z "$INIT" || "${9:-}" == scratch ]] || model_x="$model_x,\"initFrom\":\"$INIT\""
  [[ -z "$BETA1" ]] || betas="$betas,\"beta1\":$BETA1"
  [[ -z "$BETA2" ]] || betas="$betas,\"beta2\":$BETA2"
  cat > "$out/$name.json" <<JSON
{"name":"$name","seed":7,
 "model":{"seqLen":$SEQ,"dModel":$DMODEL,"nLayer":$LAYERS,"nHead":$HEADS$model_x},
 "data":{"corpus":"$out/corpus","tokenizer":"data/gpt2","cacheDir":"$out/cache"},
 "optimizer":{"lr":$LR,"minLr":0.0003,"warmupSteps":50,"totalSteps":STEPS,"weightDecay":0.01,"gradClip":1.0$betas},
 "microBatchSize":$MB,"microBatchesPerStep":$M,"epochs":$EPOCHS,
 "compression":{"mode":"$mode","fwBits":$fw,"bwBits":$bw,"warmupEpochs":$WARMUP_EPOCHS,"mPrecision":"fp16"},
 "stages":$stages,"dataParallel":$dp,
 "dp":{"optimizer":"$dpopt","warmupSteps":WARM,"bits":4,"bucketSize":512$dpx},
 "threads":1,"evalEverySteps":EVAL,"evalBatches":16}
JSON
}

if [[ "$study" == pipeline ]]; then
  configs=("fp32 fp32 8 8" "aqsgd-fw2bw4 aqsgd 2 4" "aqsgd-fw3bw6 aqsgd 3 6" "aqsgd-fw4bw8 aqsgd 4 8"
           "directq-fw2bw4 directq 2 4" "directq-fw3bw6 directq 3 6")
  stages=4; dp=1
elif [[ "$study" == finetune ]]; then
  configs=("fp32 fp32 8 8" "aqsgd-fw3bw6 aqsgd 3 6" "aqsgd-fw2bw4 aqsgd 2 4" "directq-fw2bw4 directq 2 4"
           "fp32-scratch fp32 8 8 adamw - scratch")
  stages=4; dp=1
else
  configs=("adamw-fp32 fp32 8 8 adamw" "qadam4-fp32 fp32 8 8 quantized_adam"
           "aqsgd-fw3bw6-qadam4 aqsgd 3 6 quantized_adam" "directq-fw3bw6-qadam4 directq 3 6 quantized_adam"
           "adamw-fp32-dpu fp32 8 8 adamw dpu" "aqsgd-fw3bw6-qadam4-dpu aqsgd 3 6 quantized_adam dpu")
  stages=2; dp=2
fi
if [[ -n "$ONLY" ]]; then
  kept=()
  for c in "${configs[@]}"; do [[ " $ONLY " == *" ${c%% *} "* ]] && kept+=("$c"); done
  configs=("${kept[@]}")
fi

for c in "${configs[@]}"; do
  read -r name mode fw bw dpopt dpu from <<<"$c"
  [[ ! -f "$out/$name.json" ]] || mv "$out/$name.json" "$out/$name.json.prev"
  job "$name" "$mode" "$fw" "$bw" "$stages" "$dp" "${dpopt:-adamw}" "${dpu:-}" "${from:-}"
done
# Steps per epoch from a dry count: tokens / seq / (MB*M*DP), 95% train.
tokens=$(cat "$out"/corpus/*.txt | wc -c)  # bytes; refined below from the first run's metrics
first=1
for c in "${configs[@]}"; do
  read -r name _ <<<"$c"
  if [[ $first == 1 ]]; then
    # Probe: one step to learn steps/epoch? Simpler: estimate from bytes (~4.3 bytes/token).
    spe=$(( tokens * 95 / 100 / 43 * 10 / SEQ / (MB * M * dp) ))
    total=$(( spe * EPOCHS ))
    warm=$(( DP_WARMUP > 0 ? DP_WARMUP : total / 5 ))
    eval_every=$(( spe / 2 > 0 ? spe / 2 : 1 ))
    first=0
  fi
  sed -i "s/STEPS/$total/; s/WARM/$warm/; s/EVAL/$eval_every/" "$out/$name.json"
  if [[ " $REUSE " == *" $name "* ]]; then
    if [[ -f "$out/$name/metrics.csv" && -f "$out/$name/seconds" ]] && cmp -s "$out/$name.json" "$out/$name.json.prev"; then
      echo "== $name: reusing the finished run in $out/$name (same job)"; continue
    fi
    echo "REUSE=$name: no finished run of the same job in $out" >&2; exit 1
  fi
  echo "== $name ($total steps planned)"
  start=$(date +%s)
  "$AQSWARM_BIN" pipeline --job "$out/$name.json" --out_dir "$out/$name" > "$out/$name.log" 2>&1 || {
    echo "run $name failed:"; tail -20 "$out/$name.log"; exit 1; }
  echo "$(( $(date +%s) - start ))" > "$out/$name/seconds"
  tail -3 "$out/$name.log"
done

# Table: final train loss (mean of the last 10 steps), final validation loss,
# forward bytes per sample per link, wall time.
png="docs/convergence-$study.png"
[[ -z "$ONLY" ]] || png="$out/convergence-$study.png"
python3 - "$out" "$study" "$stages" "$dp" "$png" "${configs[@]}" <<'PY'
import csv, json, os, sys
out, study, stages, dp, png = sys.argv[1], sys.argv[2], int(sys.argv[3]), int(sys.argv[4]), sys.argv[5]
names = [c.split()[0] for c in sys.argv[6:]]
rows = []
for n in names:
    m = list(csv.DictReader(open(f"{out}/{n}/metrics.csv")))
    log = open(f"{out}/{n}.log").read().splitlines()
    vals = [float(l.split()[-1]) for l in log if l.strip().startswith("eval")]
    train = sum(float(r["loss"]) for r in m[-10:]) / min(10, len(m))
    job = json.load(open(f"{out}/{n}.json"))
    samples = job["microBatchSize"] * job["microBatchesPerStep"]
    fw = [sum(float(r[f"fw_bytes_link{l}"]) for r in m) / (len(m) * samples) for l in range(stages - 1)]
    dpb = [sum(float(r.get(f"dp_bytes_stage{s}", 0) or 0) for r in m) / len(m) for s in range(stages)] if dp > 1 else []
    rows.append((n, len(m), float(m[0]["loss"]), train, vals[-1] if vals else float("nan"), sum(fw) / max(len(fw), 1),
                 sum(dpb) / max(len(dpb), 1) if dpb else 0.0, int(open(f"{out}/{n}/seconds").read())))
base = rows[0][4]
with open(f"{out}/table.md", "w") as f:
    f.write("| run | steps | first train loss | final train loss | final val loss | val vs first row | fw bytes/sample/link | dp bytes/step/replica | wall s |\n|---|---|---|---|---|---|---|---|---|\n")
    for n, steps, tr0, tr, va, fwb, dpb, s in rows:
        f.write(f"| {n} | {steps} | {tr0:.4f} | {tr:.4f} | {va:.4f} | {100*(va-base)/base:+.2f}% | {fwb/1e3:.1f} kB | {dpb/1e6:.2f} MB | {s} |\n")
# gnuplot data: step, val loss per run (from logs) and train loss
with open(f"{out}/plot.gp", "w") as g:
    g.write(f'set terminal pngcairo size 1000,600\nset output "{png}"\n')
    g.write('set xlabel "step"\nset ylabel "train loss (10-step mean)"\nset key top right\nset grid\n')
    plots = []
    for n in names:
        m = list(csv.DictReader(open(f"{out}/{n}/metrics.csv")))
        with open(f"{out}/{n}/smooth.dat", "w") as d:
            for i in range(len(m)):
                w = m[max(0, i - 9): i + 1]
                d.write(f"{m[i]['step']} {sum(float(r['loss']) for r in w)/len(w)}\n")
        plots.append(f'"{out}/{n}/smooth.dat" using 1:2 with lines lw 2 title "{n}"')
    g.write("plot " + ", ".join(plots) + "\n")
print(open(f"{out}/table.md").read())
PY
gnuplot "$out/plot.gp"
echo "table: $out/table.md  plot: $png"
