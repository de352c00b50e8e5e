#!/usr/bin/env bash
# The aqswarm demo: a coordinator and 4 peer daemons on this machine form a
# 2-stage x 2-pipeline swarm, links shaped to 100 Mbit/s + 5 ms, and train a
# small GPT on State of the Union speeches with AQ-SGD (3-bit activation
# deltas forward, 6-bit gradients back) and DiLoCo (each pipeline takes 16
# AdamW steps on its own, then the replicas all-reduce their 4-bit
# pseudo-gradients, zstd-coded, and take an outer Nesterov step). One line per
# step; at the end, bytes on the wire vs fp32 links and a float32 all-reduce
# every step (about 115x fewer in all), and a loss curve.
# Ctrl-C stops every process (peers leave the swarm); runs start clean.
#   scripts/demo.sh            # the swarm demo (~2-4 minutes)
#   scripts/demo.sh pipeline   # 4 local stage processes without a coordinator
#   scripts/demo.sh bench      # the compression benchmark
# AQSWARM_DEMO_PORT (default 17400) is the first of the ports it uses; AQSWARM_DEMO_RUN
# (default runs/swarm-demo) is where the swarm demo writes its logs (removed first).
set -euo pipefail
cd "$(dirname "$0")/.."
scripts/setup.sh >/dev/null
A=build/aqswarm
# A small corpus (the first 3 speeches) so epochs are short and deltas start early.
mkdir -p runs/demo-corpus
# (A glob, sorted like `sort`: with pipefail, `ls | sort | head` failed the demo with SIGPIPE, 141, now
# and then, when head closed the pipe before sort's second write.)
speeches=(data/sotu/*.txt)
cp "${speeches[@]:0:3}" runs/demo-corpus/
case "${1:-}" in
  bench) exec $A bench compression --mib "${AQSWARM_DEMO_MIB:-16}" ;;
  pipeline) shift; exec $A pipeline --job examples/demo.json --out_dir runs/demo "$@" ;;
esac

RUN=${AQSWARM_DEMO_RUN:-runs/swarm-demo}
BASE=${AQSWARM_DEMO_PORT:-17400}
rm -rf "$RUN"
mkdir -p "$RUN"
pids=()
cleanup() {
  trap - INT TERM EXIT
  ((${#pids[@]})) && kill -TERM "${pids[@]}" 2>/dev/null || true
  wait 2>/dev/null || true
}
trap cleanup EXIT
trap 'echo; echo "demo: stopping (peers leave the swarm)"; exit 130' INT TERM

# Mutual TLS on every connection, as a real swarm runs: a CA for this run and
# a certificate per process (on one machine they share a directory; on many,
# each machine gets ca.pem and only its own key, docs/SECURITY.md).
TLS="$RUN/tls"
$A certs init --tls_dir "$TLS" > /dev/null
for n in coordinator admin peer1 peer2 peer3 peer4; do
  $A certs issue --tls_dir "$TLS" --name "$n" --ip 127.0.0.1 > /dev/null
done
$A coordinator --job examples/swarm_demo.json --listen "127.0.0.1:$BASE" --state_dir "$RUN/coord" \
  --tls_dir "$TLS" --name coordinator --lease_s 5 --metrics_listen "127.0.0.1:$((BASE + 90))" > "$RUN/coordinator.out" 2> "$RUN/coordinator.log" &
pids+=($!)
# Its first line says it is serving (polled: up to 30 s on a busy machine).
for _ in $(seq 300); do [[ -s "$RUN/coordinator.out" ]] && break; sleep 0.1; done
[[ -s "$RUN/coordinator.out" ]] || { echo "demo: the coordinator did not start; see $RUN/coordinator.log" >&2; exit 1; }
for i in 1 2 3 4; do
  TOKEN=$($A certs token --tls_dir "$TLS" --swarm swarm-demo --peer "peer$i" 2>/dev/null)
  $A peer --coordinator "127.0.0.1:$BASE" --join_token "$TOKEN" --name "peer$i" --tls_dir "$TLS" \
    --listen "127.0.0.1:$((BASE + 10 * i))" --exchange_listen "127.0.0.1:$((BASE + 10 * i + 1))" \
    --work_dir "$RUN/peer$i" --metrics_listen "127.0.0.1:$((BASE + 90 + i))" \
    > "$RUN/peer$i.out" 2> "$RUN/peer$i.log" &
  pids+=($!)
done
echo "swarm: coordinator 127.0.0.1:$BASE + 4 peers (2 stages x 2 pipelines), mutual TLS, links 100 Mbit/s + 5 ms"
echo "metrics: http://127.0.0.1:$((BASE + 90))/metrics (coordinator), " \
     "http://127.0.0.1:$((BASE + 91))..$((BASE + 94))/metrics (peers' stages)"
echo "status:  $A status --coordinator 127.0.0.1:$BASE --tls_dir $TLS --name admin      logs: $RUN/"
python3 scripts/swarm_demo.py "$RUN" 4 96
