#!/usr/bin/env bash
# The CLI's contract: version works, every command has --help, bad flags and
# unknown commands fail with a clear message and a non-zero exit.
set -u
bin="$1"
fail=0
check() {  # check NAME EXPECTED_RC GREP_PATTERN -- CMD...
  local name="$1" want="$2" pat="$3"; shift 4
  local out rc
  out=$("$@" 2>&1); rc=$?
  if [[ $rc -ne $want ]] || ! grep -q -- "$pat" <<<"$out"; then
    echo "FAIL $name: rc=$rc (want $want), output:"; echo "$out" | head -20; fail=1
  else
    echo "ok   $name"
  fi
}
check version 0 "aqswarm 0" -- "$bin" version
check top-help 0 "commands:" -- "$bin" --help
check no-args 2 "usage" -- "$bin"
check unknown-command 2 "unknown command" -- "$bin" frobnicate
check group-only 2 "choose one of" -- "$bin" bench
while read -r cmd; do
  # shellcheck disable=SC2086
  check "help:$cmd" 0 "usage: aqswarm $cmd" -- "$bin" $cmd --help
done < <("$bin" --help | awk '/^  [a-z]/{ if ($2 ~ /^[a-z]+$/ && $1 == "bench") print $1" "$2; else print $1 }')
# job show: the effective job, every default filled in; a bad job is refused with the field named.
root_dir="$(cd "$(dirname "$0")/../.." && pwd)"
check job-show 0 '"innerSteps": 4' -- "$bin" job show --job="$root_dir/examples/tiny_diloco.json"
check job-show-default 0 '"outerMomentum": 0.9' -- "$bin" job show --job="$root_dir/examples/tiny_diloco.json"
check job-show-missing 2 "--job is required" -- "$bin" job show
check job-show-bad 1 "job spec: data.tokenzier: no such field in DataSpec; did you mean 'tokenizer'?" -- \
  "$bin" job show --job=<(echo '{"data":{"tokenzier":"x"}}')
check bad-flag 2 "unknown flag" -- "$bin" bench compression --nope=1
check foreign-flag 2 "unknown flag" -- "$bin" bench compression --samples=3
check bad-value 1 "Illegal value" -- "$bin" bench compression --mib=lots
check extra-arg 2 "unexpected argument" -- "$bin" bench compression extra
check link-bad-shape 2 "must be ROWSxCOLS" -- "$bin" bench link --link_shape=64by32
check link-bad-store 1 "unknown store 'ssd'" -- "$bin" bench link --link_stores=ssd
check store-bad-backend 1 "bad store backend 'ssd'" -- "$bin" bench store --store_backends=ssd
check slownet-bad-schedule 1 "bad schedule in mode 'fp32@gpipe/3'" -- "$bin" bench slownet --slownet_modes=fp32@gpipe/3
check slownet-bad-store 1 "bad mode 'aqsgd:3:6:ssd'" -- "$bin" bench slownet --slownet_modes=aqsgd:3:6:ssd
check slownet-bad-dp-option 1 "bad DP option '+dpu' in mode 'fp32+dpu+dpu'" -- "$bin" bench slownet --slownet_modes=fp32+dpu+dpu
check link-bad-bits 1 "fw_bits in 2..8" -- "$bin" bench link --link_fw_bits=9
check link-bad-thrash 1 "thrash_bytes >= 0" -- "$bin" bench link --link_thrash_bytes=-1
# Plaintext servers only on loopback unless --insecure.
root="$(cd "$(dirname "$0")/../.." && pwd)"
# stage_launch NAME FIELDS: a launch file for `aqswarm stage --launch`
# (proto/stage.proto: FIELDS, a JSON object, and examples/tiny_aqsgd.json
# under "job"); prints its path.
launch_dir="${TMPDIR:-/tmp}/cli-smoke-launch-$$"
mkdir -p "$launch_dir"
stage_launch() {
  python3 -c 'import json, sys
launch = json.loads(sys.argv[3])
with open(sys.argv[2]) as f:
    launch["job"] = json.load(f)
with open(sys.argv[1], "w") as f:
    json.dump(launch, f)' "$launch_dir/$1.json" "$root/examples/tiny_aqsgd.json" "$2"
  echo "$launch_dir/$1.json"
}
check coordinator-plaintext-off-loopback 1 "pass --insecure" -- \
  "$bin" coordinator --job "$root/examples/tiny_aqsgd.json" --listen 0.0.0.0:0 --state_dir "${TMPDIR:-/tmp}/cli-smoke-coord-$$"
check stage-plaintext-off-loopback 1 "pass --insecure" -- \
  "$bin" stage --launch="$(stage_launch plaintext '{"stage": 3, "listen": "0.0.0.0:0"}')"
check peer-plaintext-off-loopback 1 "pass --insecure" -- \
  "$bin" peer --coordinator 127.0.0.1:1 --join_token x --name p --listen 0.0.0.0:7101 --advertise 127.0.0.1:7101 \
  --exchange_listen 127.0.0.1:7102 --work_dir "${TMPDIR:-/tmp}/cli-smoke-peer-$$"
# A tiny real run: epoch 1's rows are AQ-SGD deltas against the FULL epoch 0 at both stores.
check link-run 0 '"mode":"aqsgd","store":"memory".*"delta_rows":16,"full_rows":16' -- \
  "$bin" bench link --json --link_samples=16 --link_epochs=1 --repeats=1 --dir="${TMPDIR:-/tmp}"
check link-run-cold 0 '"mode":"aqsgd","store":"memory".*"thrash_bytes":65536.*"delta_rows":16' -- \
  "$bin" bench link --json --link_samples=16 --link_epochs=1 --repeats=1 --link_thrash_bytes=65536 --dir="${TMPDIR:-/tmp}"
# The DiLoCo example (2 x 2, tied embeddings): the launcher fails the run if
# the replicas' anchors or a pipeline's tied copies ever differ.
diloco_out="${TMPDIR:-/tmp}/cli-smoke-diloco-$$"
check tiny-diloco 0 "step    15 .*replicas identical  tied copies identical" -- \
  bash -c 'cd "$1" && "$2" pipeline --job examples/tiny_diloco.json --out_dir "$3"' _ "$root" "$bin" "$diloco_out"
rm -rf "$diloco_out"
check version-arg 2 "no arguments" -- "$bin" version x
# --dry_run (every command): flags are checked, nothing runs (a coordinator
# without --job would otherwise fail), bad flags and values still fail.
check dry-run 0 "dry run: flags accepted" -- "$bin" coordinator --listen=0.0.0.0:7000 --dry_run
check dry-run-bad-flag 2 "unknown flag" -- "$bin" coordinator --nope=1 --dry_run
check dry-run-bad-value 1 "Illegal value" -- "$bin" bench compression --mib=lots --dry_run
# aqswarm peer refuses unusable options before contacting anyone.
peer=("$bin" peer --coordinator=127.0.0.1:1 --join_token=t --name=p --work_dir="${TMPDIR:-/tmp}/aqswarm_smoke_peer_$$")
check peer-no-token 1 "join_token is required" -- "$bin" peer --coordinator=127.0.0.1:1 --name=p --work_dir=/tmp/x
check peer-port-0 1 "fixed port" -- "${peer[@]}" --listen=127.0.0.1:0 --exchange_listen=127.0.0.1:7002
check peer-any-addr 1 "advertise is needed" -- "${peer[@]}" --listen=0.0.0.0:7001 --exchange_listen=127.0.0.1:7002
check peer-keep 1 "keep_checkpoints" -- "${peer[@]}" --listen=127.0.0.1:7001 --exchange_listen=127.0.0.1:7002 --keep_checkpoints=1
check peer-probe-bytes 1 "probe_bytes" -- "${peer[@]}" --listen=127.0.0.1:7001 --exchange_listen=127.0.0.1:7002 --probe_bytes=99999999
check coord-probe-age 1 "probe_max_age_s" -- "$bin" coordinator --job=/nonexistent.json --state_dir=/nonexistent --probe_max_age_s=-1
check coord-probes 1 "probes_per_heartbeat" -- "$bin" coordinator --job=/nonexistent.json --state_dir=/nonexistent --probes_per_heartbeat=65
check stage-negative-start 1 "start_step must be" -- "$bin" stage --launch="$(stage_launch start '{"startStep": -1}')"
check stage-negative-uplink 1 "uplink_mbps must be" -- "$bin" stage --launch="$(stage_launch uplink '{"uplinkMbps": -5}')"
check stage-dial-previous 1 "needs previous.stage_link_address" -- "$bin" stage --launch="$(stage_launch dial-previous \
  '{"stage": 1, "next": {"stageLinkAddress": "127.0.0.1:1"}, "previous": {"reversed": true}}')"
# The launch is the stage's only input: the old per-field flags are gone,
# and a missing, malformed or misspelled launch is refused naming the problem.
check stage-no-launch 1 "--launch is required" -- "$bin" stage
check stage-old-flag 2 "unknown flag" -- "$bin" stage --job="$root/examples/tiny_aqsgd.json" --stage=1
check stage-missing-launch 1 "cannot read /nonexistent/launch.json" -- "$bin" stage --launch=/nonexistent/launch.json
check stage-unknown-field 1 "nextStage" -- "$bin" stage --launch="$(stage_launch unknown '{"nextStage": 1}')"
check stage-bad-job 1 "microBatchSise" -- "$bin" stage --launch="$(stage_launch bad-job '{"stage": 3}' \
  | xargs -I{} python3 -c 'import json,sys; l=json.load(open(sys.argv[1])); l["job"]["microBatchSise"]=2; json.dump(l,open(sys.argv[1],"w")); print(sys.argv[1])' {})"
check peer-uplink 1 "emulate_uplink_mbps" -- "${peer[@]}" --listen=127.0.0.1:7001 --exchange_listen=127.0.0.1:7002 --emulate_uplink_mbps=-1
check coord-replan-gain 1 "replan_min_gain" -- "$bin" coordinator --job=/nonexistent.json --state_dir=/nonexistent --replan_min_gain=1.5
check coord-replan-interval 1 "replan_interval_s" -- "$bin" coordinator --job=/nonexistent.json --state_dir=/nonexistent --replan_interval_s=0
check coord-replan-hold 1 "replan_hold_s" -- "$bin" coordinator --job=/nonexistent.json --state_dir=/nonexistent --replan_hold_s=-1
check coord-replan-backoff 1 "replan_backoff_s must be in" -- "$bin" coordinator --job=/nonexistent.json --state_dir=/nonexistent --replan_backoff_s=301
check coord-reach 1 "reachability_timeout_s" -- "$bin" coordinator --job=/nonexistent.json --state_dir=/nonexistent --reachability_timeout_s=9
check swarmsim-grid 1 "STAGESxPIPELINES" -- "$bin" bench swarmsim --swarmsim_grid=8
check swarmsim-sizes 1 "bad peer count" -- "$bin" bench swarmsim --swarmsim_sizes=0
rm -rf "${TMPDIR:-/tmp}/aqswarm_smoke_peer_$$" "$launch_dir"
exit $fail
