#!/usr/bin/env bash
# Kernel-shaped check of the user-space link shaping (root only).
#
# Runs the slownet benchmark's pipeline with each stage in its own network
# namespace, neighbours joined by a veth pair whose two ends each get a
# `tc qdisc ... tbf` at the link rate (so each direction is shaped, as the
# user-space shaping in stage/link_transport.cc, a FIFO wire per direction, does),
# and the job's own shaping switched off. Then runs the same job with
# `aqswarm pipeline` on 127.0.0.1 with user-space shaping at the same rate and
# compares samples/s over the same steady-state window.
#
#   sudo deploy/netns/run_tc.sh                      # 10 and 100 Mbit/s, fp32 and aqsgd fw3bw6
#   sudo BWS="10" MODES="fp32" deploy/netns/run_tc.sh
#   sudo TCP_CCS="cubic bbr" deploy/netns/run_tc.sh    # the tc runs under each congestion control
#
# Environment: AQSWARM (binary, default build/aqswarm), BWS (Mbit/s list),
# MODES (fp32 | directq:FW:BW | aqsgd:FW:BW), STAGES (4), SKIP (steps dropped,
# default 3), STEPS (timed steps, default 3), PASSES (each cell's runs, default 1),
# OUT (run dir, default a temp dir),
# TBF_LATENCY_MS (the tbf queue, default 500), TCP_CCS (TCP congestion controls
# for the namespaced stages, default the host's: a new namespace copies the
# host's net.ipv4.tcp_congestion_control when it is created, so the script sets
# the host's for the moment it creates the namespaces and puts it back at
# once; the user-space run on loopback is not shaped by TCP and runs once),
# and the model knobs SEQ (64) DMODEL (32) MB (8) M (128) VOCAB (256) LAYERS (4)
# HEADS (2): the same defaults as `aqswarm bench slownet`. Set OPENBLAS_CORETYPE
# as the bench does on CPUs OpenBLAS does not know (scripts/bench_slownet.sh
# passes the bench's).
#
# Addresses: 10.77.<link>.1 (upstream end) / 10.77.<link>.2 (downstream end),
# only inside the namespaces this script creates; all of them are removed on
# exit (trap EXIT), as are the stage processes it started.
# Needs: iproute2 (ip, tc) with sch_tbf; no netem (this kernel has none).
set -euo pipefail

if [[ $(id -u) -ne 0 ]]; then
  echo "run_tc.sh: needs root (network namespaces, veth, tc); run it with sudo" >&2
  exit 2
fi
for tool in ip tc; do
  command -v "$tool" >/dev/null || { echo "run_tc.sh: '$tool' not found (install iproute2)" >&2; exit 2; }
done

ROOT=$(cd "$(dirname "$0")/../.." && pwd)
AQSWARM=${AQSWARM:-$ROOT/build/aqswarm}
BWS=${BWS:-"10 100"}
MODES=${MODES:-"fp32 aqsgd:3:6"}
STAGES=${STAGES:-4}
SKIP=${SKIP:-3}
STEPS=${STEPS:-3}
PASSES=${PASSES:-1}
[[ $PASSES =~ ^[1-9][0-9]*$ ]] || { echo "run_tc.sh: PASSES must be a positive integer, got '$PASSES'" >&2; exit 2; }
TBF_LATENCY_MS=${TBF_LATENCY_MS:-500}
SEQ=${SEQ:-64}; DMODEL=${DMODEL:-32}; MB=${MB:-8}; M=${M:-128}; VOCAB=${VOCAB:-256}
LAYERS=${LAYERS:-4}; HEADS=${HEADS:-2}
HOST_CC=$(sysctl -n net.ipv4.tcp_congestion_control)
TCP_CCS=${TCP_CCS:-$HOST_CC}
SPE=1  # steps per epoch of the synthetic corpus (AQ-SGD FULL epoch 0 = step 0)
OUT=${OUT:-$(mktemp -d /tmp/aqswarm-netns.XXXXXX)}
PREFIX="aqsn$$"
[[ -x $AQSWARM ]] || { echo "run_tc.sh: $AQSWARM not built (cmake --build build --target aqswarm)" >&2; exit 1; }
mkdir -p "$OUT"
for cc in $TCP_CCS; do
  grep -qw -- "$cc" /proc/sys/net/ipv4/tcp_available_congestion_control || {
    echo "run_tc.sh: TCP congestion control '$cc' not available (have: $(cat /proc/sys/net/ipv4/tcp_available_congestion_control))" >&2
    exit 2
  }
done

PIDS=()
cleanup() {
  sysctl -qw net.ipv4.tcp_congestion_control="$HOST_CC" 2>/dev/null || true
  for pid in "${PIDS[@]}"; do kill "$pid" 2>/dev/null || true; done
  for s in $(seq 0 $((STAGES - 1))); do ip netns del "${PREFIX}-$s" 2>/dev/null || true; done
}
trap cleanup EXIT

# ---------------------------------------------------------------- topology
# ns <prefix>-s holds stage s; veth l joins ns l (10.77.l.1) and ns l+1 (10.77.l.2).
make_topology() {  # bandwidth congestion-control
  local bw=$1 cc=$2
  cleanup
  sysctl -qw net.ipv4.tcp_congestion_control="$cc"
  for s in $(seq 0 $((STAGES - 1))); do
    ip netns add "${PREFIX}-$s"
  done
  sysctl -qw net.ipv4.tcp_congestion_control="$HOST_CC"
  for s in $(seq 0 $((STAGES - 1))); do
    ip -n "${PREFIX}-$s" link set lo up
    local got
    got=$(ip netns exec "${PREFIX}-$s" sysctl -n net.ipv4.tcp_congestion_control)
    [[ $got == "$cc" ]] || { echo "run_tc.sh: namespace got TCP congestion control '$got', not '$cc'" >&2; exit 1; }
  done
  # tbf: burst = one 4 ms tick of the rate (>= 16 KiB; tbf segments larger GSO
  # packets). Keep it small: the user-space bucket gives no burst credit at all,
  # and a 128 KiB burst let AQ-SGD's small bursty frames through at 1.7x the
  # user-space rate at 10 Mbit/s. Queue up to TBF_LATENCY_MS (default 500 ms).
  local burst=$(( bw * 1000000 / 8 / 250 ))
  (( burst < 16384 )) && burst=16384
  for l in $(seq 0 $((STAGES - 2))); do
    local a="${PREFIX}-$l" b="${PREFIX}-$((l + 1))"
    ip link add "sn${l}u$$" netns "$a" type veth peer name "sn${l}d$$" netns "$b"
    ip -n "$a" addr add "10.77.$l.1/24" dev "sn${l}u$$"
    ip -n "$b" addr add "10.77.$l.2/24" dev "sn${l}d$$"
    ip -n "$a" link set "sn${l}u$$" up
    ip -n "$b" link set "sn${l}d$$" up
    ip netns exec "$a" tc qdisc add dev "sn${l}u$$" root tbf rate "${bw}mbit" burst "$burst" latency "${TBF_LATENCY_MS}ms"
    ip netns exec "$b" tc qdisc add dev "sn${l}d$$" root tbf rate "${bw}mbit" burst "$burst" latency "${TBF_LATENCY_MS}ms"
  done
}

# ---------------------------------------------------------------- job
write_job() {  # file mode bandwidth(0 = none)
  local file=$1 mode=$2 bw=$3 link=${2%%:*} fw=0 bwb=0
  if [[ $mode == *:* ]]; then IFS=: read -r link fw bwb <<<"$mode"; fi
  local train=$(( MB * M * SPE ))
  local samples=$(( (train + 1) * 100 / 98 + 2 ))
  cat >"$file" <<EOF
{"name": "netns-check", "seed": 1,
 "model": {"vocabSize": $VOCAB, "seqLen": $SEQ, "dModel": $DMODEL, "nLayer": $LAYERS, "nHead": $HEADS},
 "data": {"syntheticTokens": $(( samples * SEQ + 1 )), "validationFraction": 0.02},
 "optimizer": {"lr": 1e-4, "gradClip": 1.0},
 "microBatchSize": $MB, "microBatchesPerStep": $M, "maxSteps": $(( SKIP + STEPS )), "epochs": 100,
 "compression": {"mode": "$link", "fwBits": $(( fw > 0 ? fw : 4 )), "bwBits": $(( bwb > 0 ? bwb : 8 )), "warmupEpochs": 0},
 "shaping": {"bandwidthMbps": $bw},
 "stages": $STAGES, "dataParallel": 1, "threads": 1, "evalEverySteps": 0, "evalBatches": 1}
EOF
}

# "step step_seconds" lines: stage 0's JSON step lines, or a run's metrics.csv.
# The stages' event lines are read with scripts/aqswarm_events.py (proto/events.proto).
EVENTS=(python3 "$(cd "$(dirname "$0")/../.." && pwd)/scripts/aqswarm_events.py" fields)
steps_from_jsonl() { "${EVENTS[@]}" step step step_seconds -- "$@"; }
steps_from_csv() { awk -F, 'FNR > 1 { print $1, $5 }' "$@"; }
# samples/s at the median step time over the steps >= SKIP on stdin (pooled
# over passes: the bench's estimator, which a slow second in one pass moves less
# than a mean does).
median_sps() {
  awk -v skip="$SKIP" '$1 >= skip { print $2 }' | sort -g |
    awk -v per=$(( MB * M )) '{ v[NR] = $1 } END {
      if (!NR) { print "nan"; exit }
      m = (NR % 2) ? v[(NR + 1) / 2] : (v[NR / 2] + v[NR / 2 + 1]) / 2
      printf "%.1f", per / m }'
}

# CPU seconds per timed step, summed over the stages (their step lines'
# cpu_seconds: the process's own time, which includes the kernel's TCP/IP
# work done in its context), for one run.
cpu_per_step() {  # step-line files of one run...
  "${EVENTS[@]}" step step cpu_seconds -- "$@" |
    awk -v skip="$SKIP" '$1 >= skip { t += $2; if (!($1 in seen)) { seen[$1] = 1; n++ } } END { if (n) printf "%.3f", t / n; else print "nan" }'
}
mean() { awk '{ t += $1; n++ } END { if (n) printf "%.3f", t / n; else print "nan" }'; }
ratio() { awk -v a="$1" -v b="$2" 'BEGIN { if (b > 0) printf "%.2f", a / b; else print "nan" }'; }
# Bytes the qdisc of link 0's forward end has sent (L2 frames: TCP/IP headers,
# ACKs and retransmissions included).
qdisc_sent() {
  ip netns exec "${PREFIX}-0" tc -s qdisc show dev "sn0u$$" | awk '/Sent/ && !done { print $2; done = 1 }'  # reads to the end: no SIGPIPE under pipefail
}
# Bytes the application sent on link 0 forward (stage 0's fw_bytes, every step).
app_fw_bytes() {
  "${EVENTS[@]}" step fw_bytes -- "$1" | awk '{ t += $1 } END { printf "%d", t }'
}

# ---------------------------------------------------------------- runs
run_netns() {  # dir
  local dir=$1 next="" line port
  PIDS=()
  for s in $(seq $((STAGES - 1)) -1 0); do
    local listen="127.0.0.1:0"
    (( s > 0 )) && listen="10.77.$((s - 1)).2:0"
    # The stage's launch (proto/stage.proto's StageLaunch, the job under "job").
    python3 -c 'import json, sys
job, out, stage, store, listen, nxt = sys.argv[1:]
with open(job) as f:
    launch = {"job": json.load(f), "stage": int(stage), "pipeline": 0, "storeDir": store,
              "listen": listen, "linkTimeout": "300s"}
if nxt:
    launch["next"] = {"stageLinkAddress": nxt}
with open(out, "w") as f:
    json.dump(launch, f)' "$dir/job.json" "$dir/launch-$s.json" "$s" "$dir/store-$s" "$listen" "$next"
    ip netns exec "${PREFIX}-$s" "$AQSWARM" stage --launch="$dir/launch-$s.json" >"$dir/stage-$s.jsonl" \
      2>"$dir/stage-$s.log" &
    PIDS+=($!)
    for _ in $(seq 1 600); do
      line=$(grep -m1 '^{"listening"' "$dir/stage-$s.jsonl" 2>/dev/null || true)
      [[ -n $line ]] && break
      kill -0 "${PIDS[-1]}" 2>/dev/null || { echo "stage $s died:"; tail "$dir/stage-$s.log"; return 1; }
      sleep 0.1
    done
    [[ -n $line ]] || { echo "stage $s did not start"; return 1; }
    port=$("${EVENTS[@]}" listening port -- "$dir/stage-$s.jsonl" | head -1)
    (( s > 0 )) && next="10.77.$((s - 1)).2:$port"
  done
  local rc=0
  for pid in "${PIDS[@]}"; do wait "$pid" || rc=1; done
  PIDS=()
  return $rc
}

# Columns: the namespaces' TCP congestion control; samples/s under tc and in
# user space (at the median step time, all passes pooled), their ratio, and
# the ratio pass by pass; CPU seconds
# per step of all stages under each (the kernel's TCP/IP path over veth costs
# CPU that loopback with 64 KiB segments does not, on the same 2 cores as the
# model); bytes link 0's forward qdisc sent per application byte (headers,
# ACKs of the other direction's data, retransmissions).
# Every pass runs every cell once (user space, then tc under each congestion
# control); the summary pools each cell's timed steps over the passes.
for pass in $(seq 1 "$PASSES"); do
  for bw in $BWS; do
    for mode in $MODES; do
      d="$OUT/${mode//:/_}-${bw}mbit"
      u="$d/user-p$pass"
      mkdir -p "$u"
      write_job "$u/job.json" "$mode" "$bw"
      "$AQSWARM" pipeline --job="$u/job.json" --out_dir="$u/run" >"$u/pipeline.out" 2>&1 ||
        { echo "run_tc.sh: user-space run failed, see $u" >&2; exit 1; }
      echo "pass $pass $mode $bw Mbit/s user space: $(steps_from_csv "$u/run/metrics.csv" | median_sps) samples/s"
      for cc in $TCP_CCS; do
        make_topology "$bw" "$cc"
        t="$d/tc-$cc-p$pass"
        mkdir -p "$t"
        write_job "$t/job.json" "$mode" 0
        sent0=$(qdisc_sent)
        run_netns "$t" || { echo "run_tc.sh: netns run failed, logs in $t" >&2; exit 1; }
        echo "$(( $(qdisc_sent) - sent0 )) $(app_fw_bytes "$t/stage-0.jsonl")" >"$t/wire_app_bytes"
        echo "pass $pass $mode $bw Mbit/s tc ($cc): $(steps_from_jsonl "$t/stage-0.jsonl" | median_sps) samples/s"
      done
    done
  done
done

printf '%-16s %8s %6s %16s %16s %8s %16s %10s %10s %10s\n' mode Mbit/s "tcp cc" "tc tbf samp/s" "user-space samp/s" \
  "tc/user" "tc/user by pass" "tc CPU/st" "user CPU/st" "wire/app" | tee "$OUT/summary.txt"
for bw in $BWS; do
  for mode in $MODES; do
    d="$OUT/${mode//:/_}-${bw}mbit"
    user_sps=$(steps_from_csv "$d"/user-p*/run/metrics.csv | median_sps)
    user_cpu=$(for u in "$d"/user-p*; do cpu_per_step "$u/run/events.jsonl"; echo; done | mean)
    for cc in $TCP_CCS; do
      tc_sps=$(steps_from_jsonl "$d"/tc-"$cc"-p*/stage-0.jsonl | median_sps)
      tc_cpu=$(for t in "$d"/tc-"$cc"-p*; do cpu_per_step "$t"/stage-*.jsonl; echo; done | mean)
      by_pass=$(for pass in $(seq 1 "$PASSES"); do
                  ratio "$(steps_from_jsonl "$d/tc-$cc-p$pass/stage-0.jsonl" | median_sps)" \
                        "$(steps_from_csv "$d/user-p$pass/run/metrics.csv" | median_sps)"; echo; done | paste -sd, -)
      wire_app=$(cat "$d"/tc-"$cc"-p*/wire_app_bytes | awk '{ w += $1; a += $2 } END { if (a > 0) printf "%.3f", w / a; else print "nan" }')
      printf '%-16s %8s %6s %16s %16s %8s %16s %10s %10s %10s\n' "$mode" "$bw" "$cc" "$tc_sps" "$user_sps" \
        "$(ratio "$tc_sps" "$user_sps")" "$by_pass" "$tc_cpu" "$user_cpu" "$wire_app" | tee -a "$OUT/summary.txt"
    done
  done
done
# Unshaped reference over the same namespaces with no qdisc would need another
# topology; the bench's unshaped cells give it.
echo "runs in $OUT (stage JSON lines: */tc-*-p*/stage-*.jsonl)"
