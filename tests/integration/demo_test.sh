#!/usr/bin/env bash
# The README's first command, `scripts/demo.sh`, run as a user would (setup,
# coordinator, 4 peers, training, summary): it must exit 0 and its loss must
# fall. Its logs go to a temporary directory, not runs/swarm-demo, and it
# uses its own ports.
#   demo_test.sh SOURCE_DIR
set -uo pipefail
src=$1
tmp=$(mktemp -d "${TMPDIR:-/tmp}/aqswarm_demo_test.XXXXXX")
trap 'rm -rf "$tmp"' EXIT
AQSWARM_DEMO_RUN="$tmp/run" AQSWARM_DEMO_PORT=${AQSWARM_DEMO_TEST_PORT:-27400} \
  bash "$src/scripts/demo.sh" > "$tmp/out.txt" 2>&1
rc=$?
fail() {
  echo "FAIL: $*"; echo "--- demo output (last 40 lines):"; tail -40 "$tmp/out.txt"
  for f in "$tmp"/run/*.log; do [[ -s $f ]] && { echo "--- $f"; tail -5 "$f"; }; done
  exit 1
}
[[ $rc == 0 ]] || fail "scripts/demo.sh exited with $rc"
# The summary's last line: "loss 10.8481 (step 0) -> 3.0347 (step 79); curve: ..."
line=$(grep -E '^loss [0-9.]+ \(step 0\) -> [0-9.]+ \(step [0-9]+\)' "$tmp/out.txt" | tail -n 1)
[[ -n $line ]] || fail "no final loss line"
read -r first last < <(sed -E 's/^loss ([0-9.]+) \(step 0\) -> ([0-9.]+).*/\1 \2/' <<< "$line")
awk -v a="$first" -v b="$last" 'BEGIN { exit !(b < 0.5 * a) }' || fail "loss did not fall by half: $line"
grep -q "bytes on the wire per link" "$tmp/out.txt" || fail "no bytes-on-the-wire summary"
echo "ok: $line"
