#!/bin/bash
# Whether a change to the tree trains bit-identically: runs the same tiny
# jobs with two aqswarm binaries and compares every step, eval and done
# event with its timing fields left out (loss, grad norm, param and tied
# hashes per stage and pipeline), and each run's job.json byte for byte.
#
#   cp build/aqswarm /tmp/aqswarm-before      # before the change
#   ... change, rebuild ...
#   scripts/bit_identity.sh /tmp/aqswarm-before build/aqswarm [OUT_DIR]
#
# Jobs (from examples/tiny_*.json): aqsgd; dp (QuantizedAdam), tied dp,
# delayed-update dp; diloco, tied diloco; aqsgd with 1f1b, tiled first
# visits, midtread, rotation all, tiles along tokens, tiled gradients, int8
# m(xi) in memory; aqsgd with gpipe, bf16, fixed-point first visits, fp32
# m(xi); tiled links with fp16 and dynamic loss scaling; llama. About 2
# minutes per binary on 2 cores. Exit 0 when every job is identical.
set -euo pipefail
cd "$(dirname "$0")/.."
[ $# -ge 2 ] || { sed -n 2,16p "$0"; exit 2; }
before=$(realpath "$1"); after=$(realpath "$2"); out=${3:-$(mktemp -d /tmp/bit-identity.XXXXXX)}
mkdir -p "$out/jobs"
python3 - "$out/jobs" <<'PY'
import json, sys
out = sys.argv[1]
ex = lambda n: json.load(open(f"examples/{n}.json"))
jobs = {"aqsgd": ex("tiny_aqsgd"), "dp": ex("tiny_dp"), "diloco_tied": ex("tiny_diloco")}
t = ex("tiny_dp"); t["model"]["tieEmbeddings"] = True; jobs["dp_tied"] = t
d = ex("tiny_diloco"); d["model"]["tieEmbeddings"] = False; jobs["diloco"] = d
u = ex("tiny_dp"); u["dp"]["delayedUpdate"] = True; jobs["dp_delayed"] = u
a = ex("tiny_aqsgd"); a.update(schedule="1f1b", maxSteps=6)
a["compression"].update(firstVisit="tiled", tileGrid="midtread", rotation="all", tileAlong="tokens",
                        bwCodec="tiled", mPrecision="int8", store="memory")
jobs["aqsgd_1f1b_tiled"] = a
b = ex("tiny_aqsgd"); b.update(schedule="gpipe", maxSteps=6, precision="bf16")
b["compression"].update(firstVisit="fixed_point", rotation="none", mPrecision="fp32")
jobs["aqsgd_gpipe_bf16"] = b
c = ex("tiny_aqsgd"); c.update(maxSteps=6, stages=2, precision="fp16")
c["optimizer"]["lossScale"] = "dynamic"; c["compression"] = {"mode": "tiled", "fwBits": 4, "bwBits": 6}
jobs["tiled_fp16"] = c
l = ex("tiny_aqsgd"); l.update(maxSteps=6, stages=2); l["model"].update(family="llama", nKvHead=2)
jobs["llama"] = l
for name, job in jobs.items():
    json.dump(job, open(f"{out}/{name}.json", "w"), indent=1)
PY
for side in before after; do
  bin=$before; [ $side = after ] && bin=$after
  for job in "$out"/jobs/*.json; do
    name=$(basename "$job" .json)
    rm -rf "${out:?}/$side/$name"; mkdir -p "$out/$side"
    if ! "$bin" pipeline --job "$job" --out_dir "$out/$side/$name" > "$out/$side/$name.log" 2>&1; then
      echo "bit_identity: $side binary failed on $name: $out/$side/$name.log" >&2
      exit 1
    fi
  done
done
python3 - "$out" <<'PY'
import json, os, sys
out = sys.argv[1]
timing = ("seconds", "bytes", "faults", "switches", "busy", "mbps", "rss", "cpu", "per_s", "time")
def events(path):
    rows = []
    for line in open(path):
        kind, e = next(iter(json.loads(line).items()))
        if kind in ("step", "eval", "done"):
            rows.append((kind, json.dumps({k: v for k, v in e.items()
                                           if not isinstance(v, dict) and not any(t in k for t in timing)},
                                          sort_keys=True)))
    return sorted(rows)
bad = 0
for name in sorted(n for n in os.listdir(f"{out}/jobs")):
    name = name[:-5]
    a, b = (events(f"{out}/{s}/{name}/events.jsonl") for s in ("before", "after"))
    same_job = open(f"{out}/before/{name}/job.json").read() == open(f"{out}/after/{name}/job.json").read()
    ok = a == b and len(a) > 0
    print(f"{name:20s} {len(a):3d} events {'identical' if ok else 'DIFFER'}; job.json {'same' if same_job else 'differs'}")
    if not ok:
        bad += 1
        for x, y in zip(a, b):
            if x != y:
                print("  before", x[1]); print("  after ", y[1]); break
print(f"bit_identity: {'every job identical' if bad == 0 else f'{bad} jobs differ'} ({out})")
sys.exit(1 if bad else 0)
PY
