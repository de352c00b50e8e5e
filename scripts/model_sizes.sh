#!/usr/bin/env bash
# Measures the per-stage memory and step time of an example job (default
# examples/gpt2_124m.json) on K local stage processes, once per precision,
# and renders the table into docs/MODELS.md (scripts/model_sizes_table.py).
#
#   scripts/model_sizes.sh                                   # cpu, fp32 and bf16, 4 steps
#   scripts/model_sizes.sh --device cuda:0 --precision bf16 --out /tmp/sizes --no_doc
#
# Flags (defaults in brackets):
#   --job FILE          the job [examples/gpt2_124m.json]
#   --device D          cpu | cuda:N [cpu]
#   --precision P       fp32 | bf16 | fp16; repeat for several [fp32 bf16]
#   --steps N           maxSteps; the table's medians leave out the first step [4]
#   --stages K          pipeline stages [4]
#   --seq_len T, --micro_batch B, --micro_batches M, --threads N
#                       override the job's [cpu: 128, 1, 4, 1 (K processes share
#                       the cores); cuda: the job's seq_len, 1, 8, 4]
#   --out DIR           runs and the rendered table [runs/model_sizes]
#   --no_doc            leave docs/MODELS.md alone (the table is DIR/table.md)
# Exits 1 when a run failed (the table then says which and why).
#
# The job is copied into DIR/<precision>/job.json with those overrides and with
# evaluation off (evalEverySteps 0, evalBatches 1); then
#   build/aqswarm pipeline --job DIR/<precision>/job.json --out_dir DIR/<precision>/run --stages K
# On a shared machine run it under the build lock so no compile runs meanwhile:
#   flock /tmp/aqswarm-build.lock scripts/model_sizes.sh
set -euo pipefail
cd "$(dirname "$0")/.."
job=examples/gpt2_124m.json device=cpu steps=4 stages=4 out=runs/model_sizes doc=1
seq_len="" micro_batch="" micro_batches="" threads=""
precisions=()
while [[ $# -gt 0 ]]; do
  case $1 in
    --job) job=$2; shift 2 ;;
    --device) device=$2; shift 2 ;;
    --precision) precisions+=("$2"); shift 2 ;;
    --steps) steps=$2; shift 2 ;;
    --stages) stages=$2; shift 2 ;;
    --seq_len) seq_len=$2; shift 2 ;;
    --micro_batch) micro_batch=$2; shift 2 ;;
    --micro_batches) micro_batches=$2; shift 2 ;;
    --threads) threads=$2; shift 2 ;;
    --out) out=$2; shift 2 ;;
    --no_doc) doc=0; shift ;;
    -h|--help) sed -n '2,26p' "$0"; exit 0 ;;
    *) echo "model_sizes.sh: unknown flag $1 (see --help)" >&2; exit 2 ;;
  esac
done
[[ ${#precisions[@]} -gt 0 ]] || precisions=(fp32 bf16)
if [[ $device == cpu ]]; then
  : "${seq_len:=128}" "${micro_batch:=1}" "${micro_batches:=4}" "${threads:=1}"
else
  : "${micro_batch:=1}" "${micro_batches:=8}" "${threads:=4}"
fi
bin=${AQSWARM_BIN:-build/aqswarm}
[[ -x $bin ]] || { echo "model_sizes.sh: no $bin (build it: scripts/setup.sh)" >&2; exit 1; }
mkdir -p "$out"
cmdline="scripts/model_sizes.sh --job $job --device $device $(printf -- '--precision %s ' "${precisions[@]}")--steps $steps --stages $stages"
[[ -n $seq_len ]] && cmdline+=" --seq_len $seq_len"
cmdline+=" --micro_batch $micro_batch --micro_batches $micro_batches --threads $threads"

runs=() failed=0
for p in "${precisions[@]}"; do
  dir=$out/$p
  rm -rf "$dir"
  mkdir -p "$dir"
  python3 - "$job" "$dir/job.json" "$p" "$device" "$steps" "$seq_len" "$micro_batch" "$micro_batches" "$threads" <<'EOF'
import json, sys
src, dst, precision, device, steps, seq_len, mb, mbs, threads = sys.argv[1:]
job = json.load(open(src))
job["precision"] = precision
job["device"] = device
job["maxSteps"] = int(steps)
job["evalEverySteps"] = 0
job["evalBatches"] = 1
if seq_len:
    job["model"]["seqLen"] = int(seq_len)
job["microBatchSize"] = int(mb)
job["microBatchesPerStep"] = int(mbs)
job["threads"] = int(threads)
json.dump(job, open(dst, "w"), indent=1)
EOF
  echo "== $p: $bin pipeline --job $dir/job.json --out_dir $dir/run --stages $stages"
  t0=$(date +%s) start=$(date -u +%Y-%m-%dT%H:%MZ)
  if "$bin" pipeline --job "$dir/job.json" --out_dir "$dir/run" --stages "$stages" > "$dir/pipeline.log" 2>&1; then
    echo "   done in $(( $(date +%s) - t0 )) s"
  else
    rc=$? failed=1
    echo "   FAILED after $(( $(date +%s) - t0 )) s (exit $rc); the tail of $dir/pipeline.log:" >&2
    tail -15 "$dir/pipeline.log" >&2
  fi
  echo "$start $(( $(date +%s) - t0 ))" > "$dir/when.txt"
  runs+=("$p=$dir")
done

machine="$(nproc) cores ($(lscpu 2>/dev/null | sed -n 's/^Model name: *//p' | head -1)), $(( $(awk '/MemTotal/ {print $2}' /proc/meminfo) / 1048576 )) GiB RAM"
if [[ $device != cpu ]] && command -v nvidia-smi >/dev/null; then
  machine+=", $(nvidia-smi --query-gpu=name --format=csv,noheader | head -1)"
fi
build=$(git rev-parse --short HEAD 2>/dev/null || echo "?")
[[ -z $(git status --porcelain --untracked-files=no 2>/dev/null) ]] || build+=" + local changes"
args=(--job "$out/${precisions[0]}/job.json" --name "$job" --device "$device" --machine "$machine" --build "$build"
      --command "$cmdline" --load "$(cut -d' ' -f1-3 /proc/loadavg)" --out "$out/table.md")
[[ $doc == 1 ]] && args+=(--doc docs/MODELS.md)
python3 scripts/model_sizes_table.py "${args[@]}" "${runs[@]}"
exit $failed
