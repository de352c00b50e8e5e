#!/usr/bin/env bash
# Runs `aqswarm bench slownet` (the AQ-SGD paper's Table 2 as ratios), keeps
# its JSON, draws the PNG plots with gnuplot and rewrites the slow-network
# section of docs/BENCHMARKS.md (between <!-- slownet:begin --> and
# <!-- slownet:end -->; the rest of the file is left alone).
#
#   scripts/bench_slownet.sh                 # full table (~15-20 min on 2 cores)
#   JSON=/tmp/aqswarm-slownet/slownet.jsonl scripts/bench_slownet.sh   # redo plots + docs only
#   scripts/bench_slownet.sh --slownet_grid=false --slownet_bandwidths=100,10   # extra flags go to the bench
#
# Environment: AQSWARM (binary, default build/aqswarm), OUT (raw runs and the
# JSON, default /tmp/aqswarm-slownet), JSON (skip the run, use this file),
# RUN_NETNS=1 (root: also run deploy/netns/run_tc.sh and put its table in the docs).
# Needs: gnuplot, python3.
set -euo pipefail
ROOT=$(cd "$(dirname "$0")/.." && pwd)
AQSWARM=${AQSWARM:-$ROOT/build/aqswarm}
OUT=${OUT:-/tmp/aqswarm-slownet}
DOC=$ROOT/docs/BENCHMARKS.md
for tool in gnuplot python3; do
  command -v "$tool" >/dev/null || { echo "bench_slownet.sh: needs $tool" >&2; exit 1; }
done
mkdir -p "$OUT" "$ROOT/docs"

CMD="build/aqswarm bench slownet --json --slownet_out_dir=$OUT/runs${*:+ $*}"
if [[ -z ${JSON:-} ]]; then
  [[ -x $AQSWARM ]] || { echo "bench_slownet.sh: build first: cmake --build build --target aqswarm" >&2; exit 1; }
  JSON=$OUT/slownet.jsonl
  start=$(date +%s)
  "$AQSWARM" bench slownet --json --slownet_out_dir="$OUT/runs" "$@" >"$JSON.tmp"
  mv "$JSON.tmp" "$JSON"
  echo "$(( $(date +%s) - start ))" >"$OUT/wall_seconds"
  echo "$CMD" >"$OUT/command"
  uptime >"$OUT/uptime"
fi
[[ -f $OUT/command ]] && CMD=$(cat "$OUT/command")  # when only redrawing
# Kernel-shaping check (root only): RUN_NETNS=1 also runs deploy/netns/run_tc.sh;
# its summary goes into the docs section.
if [[ ${RUN_NETNS:-0} == 1 ]]; then
  rm -rf "$OUT/netns"
  OUT="$OUT/netns" AQSWARM="$AQSWARM" "$ROOT/deploy/netns/run_tc.sh" || echo "bench_slownet.sh: netns check failed" >&2
fi
echo "bench_slownet.sh: results in $JSON"

# ------------------------------------------------- data files + markdown
python3 - "$JSON" "$OUT" "$DOC" "$CMD" <<'PY'
import json, math, os, re, sys
path, out, doc, cmd = sys.argv[1:5]
cells = [json.loads(l) for l in open(path) if l.strip()]
wall = open(os.path.join(out, "wall_seconds")).read().strip() if os.path.exists(os.path.join(out, "wall_seconds")) else "?"
load = open(os.path.join(out, "uptime")).read().strip() if os.path.exists(os.path.join(out, "uptime")) else ""
UNSHAPED_X = 10000  # where "unshaped" sits on the log axis

def bwname(b): return "unshaped" if b == 0 else f"{b:g}"
def f(v, fmt="{:.1f}"): return "-" if v is None or (isinstance(v, float) and math.isinf(v)) else fmt.format(v)

series = {}
for c in cells:
    series.setdefault((c["grid"], c["label"]), []).append(c)
# gnuplot data: one block per series (x, samples/s, ratio), blank lines between.
names = []
with open(os.path.join(out, "slownet.dat"), "w") as d:
    for (grid, label), cs in series.items():
        names.append(f"{grid} {label}")
        d.write(f"# {grid} {label}\n")
        for c in sorted(cs, key=lambda c: -(c["bandwidth_mbps"] or UNSHAPED_X)):
            x = c["bandwidth_mbps"] or UNSHAPED_X
            d.write(f"{x} {c['samples_per_s']:.3f} {c['ratio_vs_fp32_unshaped']:.4f}\n")
        d.write("\n\n")
with open(os.path.join(out, "series.txt"), "w") as s:
    s.write("\n".join(names) + "\n")

m = cells[0]["model"]
one = [c for c in cells if c["dp"] == 1]
grid = [c for c in cells if c["dp"] > 1]
def get(cs, label, b):
    for c in cs:
        if c["label"] == label and c["bandwidth_mbps"] == b: return c
    return None

def table(cs):
    rows = ["| grid | mode | link Mbit/s | samples/s | ratio vs fp32 unshaped | compute-only limit | wire limit | GPipe link limit | achieved / min(compute, wire) | achieved / min(compute, GPipe) | fw B/sample | bw B/sample | DP B/step | samples/s of each pass |",
            "|---|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---|"]
    for c in cs:
        rows.append("| {} | {} | {} | {} | {} | {} | {} | {} | {} | {} | {:.0f} | {:.0f} | {:.0f} | {} |".format(
            c["grid"], c["label"], bwname(c["bandwidth_mbps"]), f(c["samples_per_s"]),
            f(c["ratio_vs_fp32_unshaped"], "{:.3f}"), f(c["compute_limit_samples_per_s"]),
            f(c["link_limit_samples_per_s"]), f(c["gpipe_link_limit_samples_per_s"]),
            f(c["achieved_vs_min_limits"], "{:.2f}"), f(c["achieved_vs_min_gpipe_limits"], "{:.2f}"),
            c["fw_bytes_per_sample"], c["bw_bytes_per_sample"], c["dp_bytes_per_step"],
            " / ".join(f"{x:.0f}" for x in c.get("samples_per_s_passes") or [])))
    return "\n".join(rows)

def pivot(cs, key="samples_per_s", fmt="{:.0f}"):
    labels = list(dict.fromkeys(c["label"] for c in cs))
    bws = sorted({c["bandwidth_mbps"] for c in cs}, key=lambda b: -(b or UNSHAPED_X))
    rows = ["| link | " + " | ".join(labels) + " |", "|---|" + "---:|" * len(labels)]
    for b in bws:
        vals = []
        for l in labels:
            c = get(cs, l, b)
            vals.append(f(c[key], fmt) if c else "")
        rows.append(f"| {bwname(b)} | " + " | ".join(vals) + " |")
    return "\n".join(rows)

# Targets (the paper's shape).
targets = []
bws = sorted({c["bandwidth_mbps"] for c in one if c["bandwidth_mbps"] > 0})
if bws:
    slow = bws[0]
    a, p = get(one, "aqsgd fw3bw6", slow), get(one, "fp32", slow)
    if a and p:
        r = a["samples_per_s"] / p["samples_per_s"]
        targets.append((f"At the slowest link ({slow:g} Mbit/s) AQ-SGD fw3bw6 >= 5x fp32 samples/s", f"{r:.2f}x", r >= 5))
for lab in ("aqsgd fw3bw6", "aqsgd fw4bw8"):
    a, u = get(one, lab, 100), get(one, lab, 0)
    if a and u:
        r = a["samples_per_s"] / u["samples_per_s"]
        targets.append((f"{lab} at 100 Mbit/s >= 85% of its own unshaped throughput", f"{100*r:.0f}%", r >= 0.85))
worst = None
for b in sorted({c["bandwidth_mbps"] for c in one}, key=lambda b: -(b or UNSHAPED_X)):
    a, d = get(one, "aqsgd fw3bw6", b), get(one, "directq fw3bw6", b)
    if a and d:
        r = a["samples_per_s"] / d["samples_per_s"] - 1
        if worst is None or abs(r) > abs(worst[1]): worst = (b, r)
if worst:
    targets.append(("AQ-SGD fw3bw6 within 5% of DirectQ fw3bw6 at every bandwidth",
                    f"worst {100*worst[1]:+.0f}% at {bwname(worst[0])}", abs(worst[1]) <= 0.05))
shaped = [c for c in cells if c["bandwidth_mbps"] > 0]
if shaped:
    ok_w = sum(1 for c in shaped if c["achieved_vs_min_limits"] >= 0.9)
    ok_g = sum(1 for c in shaped if c["achieved_vs_min_gpipe_limits"] >= 0.9)
    targets.append(("achieved >= 0.9 x min(compute, wire limit), shaped cells", f"{ok_w}/{len(shaped)}", ok_w == len(shaped)))
    targets.append(("achieved >= 0.9 x min(compute, GPipe link limit), shaped cells", f"{ok_g}/{len(shaped)}", ok_g == len(shaped)))

fp32u = get(one, "fp32", 0)
demand = fp32u["samples_per_s"] * fp32u["fw_bytes_per_sample"] * 8 / 1e6 if fp32u else float("nan")

md = []
md.append("## Slow networks: AQ-SGD Table 2 as ratios (`aqswarm bench slownet`)")
md.append("")
md.append("Generated by `scripts/bench_slownet.sh` (do not edit by hand: it rewrites this section). "
          f"Command: `{cmd}`; total wall time {wall} s. Load when it finished: `{load}` "
          "(2 cores shared with other work: absolute numbers are noisy, the ratios compare cells of one run).")
md.append("")
md.append("**Setup.** Each cell is one `aqswarm pipeline` run: "
          f"{cells[0]['stages']} stage processes on 127.0.0.1 (and a {grid[0]['grid'] if grid else '2x4'} grid with data parallelism), "
          f"GPT with vocab {m['vocab']}, seq_len {m['seq_len']}, d_model {m['d_model']}, {m['n_layer']} layers (one per stage), "
          f"{m['n_head']} heads; micro-batch {m['micro_batch']} samples x {m['micro_batches']} micro-batches per step "
          f"(GPipe), {m['threads']} intra-op thread per stage, synthetic tokens. Links are shaped in user space "
          "(per-direction token bucket in `peer/link_transport.cc`, also on the DP exchange). The corpus holds one step "
          "per epoch so AQ-SGD's FULL epoch 0 is skipped; samples/s = samples / sum of stage 0's `step_seconds` over "
          f"{cells[0]['steps_timed']} timed steps, best of {len(cells[0].get('samples_per_s_passes') or [1])} passes over the whole table (1x4: from epoch {one[0]['first_timed_epoch'] if one else '?'}; "
          f"grid: from epoch {grid[0]['first_timed_epoch'] if grid else '?'}, see the DP note below).")
md.append("")
md.append("**Scaling argument.** The paper's GPT2-1.5B on 8 V100 stages runs 3.8 sequences/s unshaped with 6.55 MB of fp32 "
          "activations per sequence per link direction (1024 x 1600 x 4 B): each link direction must carry "
          "3.8 x 6.55 MB = 25 MB/s = 199 Mbit/s for fp32 to keep up, so fp32 is link-bound below a few hundred Mbit/s "
          "(GPipe does not overlap a link's forward and backward traffic: ~400 Mbit/s of demand) and AQ-SGD fw3bw6 "
          "(~10x fewer bytes forward, 5.3x backward) stays compute-bound down to ~100 Mbit/s. What sets the shape is "
          "the ratio (fp32 bytes per sample) x (unshaped samples/s) / bandwidth, i.e. FLOPs per activation byte over the "
          "device's FLOP rate. A transformer block does >= 72 d + 12 s FLOPs (fw+bw) per activation byte it ships; a CPU "
          "core here is ~300x slower than a V100, so the same ratio needs a ~300x smaller block per stage: one layer of "
          f"d_model {m['d_model']}, seq_len {m['seq_len']}, and a vocab small enough that the LM head is not the bottleneck. "
          f"Measured here: unshaped fp32 pushes {demand:.0f} Mbit/s per link direction (paper: 199), i.e. this setup's "
          f"curve is the paper's shifted left by ~{199/demand:.1f}x in bandwidth (our 10 Mbit/s is the paper's "
          f"~{10*199/demand:.0f} Mbit/s). Going smaller does not help on this machine: per-op overhead and memory-bound "
          "element-wise kernels dominate below d_model ~32 (d_model 16 measured the same Mbit/s), and AQ-SGD rows must "
          "hold >= 1024 values (seq_len x d_model) or the codec sends them raw (see notes).")
md.append("")
md.append("**Limits.** compute-only = samples/s of the same mode and grid with unshaped links (loopback moves "
          "~1 GB/s: < 2 ms per step of residual transfer; it keeps the mode's encode/decode/store work, which is compute). "
          "wire limit = bandwidth / bytes per sample of the busiest link direction (each direction has its own token "
          "bucket) and, with DP, of the busiest DP sender. GPipe link limit = samples per step / [(M + K - 2) x (t_fw + t_bw) "
          "+ DP bytes x 8 / B], t = bytes per micro-batch x 8 / B on the busiest link: the runner's GPipe schedule flushes "
          "every step (all forwards, all backwards, optimizer), so a link's two directions are never busy at the same time, "
          "and a micro-batch crosses K - 1 store-and-forward links. The wire limit is what an overlapping schedule could "
          "reach; the GPipe limit is what this schedule can.")
md.append("")
md.append("### samples/s (1 x 4 pipeline)")
md.append("")
md.append(pivot(one))
md.append("")
md.append("### ratio to unshaped fp32 (paper Table 2 as ratios: fp32 3.8 -> 0.5 = 0.13, AQ-SGD fw3bw6 4.0 -> 3.4 = 0.89 of the fp32 10 Gbit/s baseline 3.8)")
md.append("")
md.append(pivot(one, "ratio_vs_fp32_unshaped", "{:.3f}"))
md.append("")
if grid:
    md.append(f"### {grid[0]['grid']} grid with QuantizedAdam (samples/s, all pipelines; ratio base = the grid's unshaped fp32)")
    md.append("")
    md.append(pivot(grid))
    md.append("")
md.append("### Targets")
md.append("")
md.append("| target | measured | met |")
md.append("|---|---:|---|")
for t, v, ok in targets:
    md.append(f"| {t} | {v} | {'yes' if ok else '**no**'} |")
md.append("")
md.append("![samples/s vs link bandwidth](slownet_throughput.png)")
md.append("![ratio to unshaped fp32](slownet_ratio.png)")
md.append("")
md.append("### All cells, with limits")
md.append("")
md.append(table(cells))
md.append("")
md.append("### Notes")
md.append("")
md.append("- **GPipe flush.** With fp32 on slow links the achieved throughput sits at ~0.4-0.5 of the wire limit but ~0.95 of "
          "the GPipe link limit: forward and backward traffic of one link never overlap because every step ends with a "
          "flush (all backwards, global-norm commit, optimizer step) before the next step's forwards. An interleaved "
          "schedule (1F1B across steps, or starting step n+1's forwards during step n's backwards) would be needed to "
          "reach the wire limit.")
md.append("- **Noise.** Cells at >= 100 Mbit/s are compute-bound, and the 2 cores are shared with other jobs: "
          "their passes differ by up to ~30% (last column), more than the differences between modes, so ratios "
          "above 1, achieved/min(limits) above 1, and the AQ-SGD vs DirectQ gap there are load noise, not effects. "
          "Link-bound cells (10 Mbit/s) repeat within ~1-2%.")
md.append("- **CPU is the accelerator here.** Quantizing, dequantizing, checksumming and the RocksDB store of m(xi) run "
          "on the same 2 cores as the model, so they are not hidden as they would be behind a GPU; near the crossover "
          "(10 Mbit/s for the compressed modes) compute and link time then add up partly instead of overlapping "
          "(achieved ~0.8 of min(compute, GPipe link limit)).")
md.append("- **DP with AQ-SGD.** The sample plan deals every epoch's permutation round-robin to the D pipelines, so a "
          "pipeline keeps meeting samples it never sent on its link (about half of them in epoch 1 with D = 2) and "
          "AQ-SGD sends those FULL; the grid is timed from a later epoch. At this model size the DP exchange is small "
          "(tens of kB per step), so QuantizedAdam barely changes throughput, unlike the paper's 1.5B-parameter model.")
md.append("- **Small rows.** The codec sends tensors under 1024 values raw fp32 (`kDefaultMinCompressElements`); AQ-SGD "
          "encodes per-sample rows of seq_len x d_model values, so rows below 1024 values silently go uncompressed (and "
          "larger than the FULL fp16 rows). seq_len x d_model = "
          f"{m['seq_len'] * m['d_model']} here.")
md.append("- **Kernel shaping check.** `deploy/netns/run_tc.sh` (root) runs the same pipeline across network namespaces "
          "joined by veth pairs with `tc tbf` on both ends and compares samples/s to the user-space shaping.")
netns = os.path.join(out, "netns", "summary.txt")
if os.path.exists(netns):
    md.append("")
    md.append("### Kernel shaping (`deploy/netns/run_tc.sh`: namespaces + veth + `tc tbf`) vs user-space shaping")
    md.append("")
    md.append("Same job, stage 0 step_seconds over the same window; one run each, so expect the noise above.")
    md.append("")
    md.append("```")
    md.append(open(netns).read().rstrip())
    md.append("```")
section = "\n".join(md) + "\n"

begin, end = "<!-- slownet:begin -->", "<!-- slownet:end -->"
text = open(doc).read() if os.path.exists(doc) else "# Benchmarks\n"
block = f"{begin}\n{section}{end}"
if begin in text and end in text:
    text = text[:text.index(begin)] + block + text[text.index(end) + len(end):]
else:
    text = text.rstrip("\n") + "\n\n" + block + "\n"
open(doc, "w").write(text)
print("\n".join(f"{t}: {v} ({'met' if ok else 'NOT met'})" for t, v, ok in targets))
PY

# ------------------------------------------------- plots
mapfile -t SERIES <"$OUT/series.txt"
plot_cmd() {  # column
  local col=$1 cmds=() i=0
  for s in "${SERIES[@]}"; do
    local dash=1; [[ $s == 2x* ]] && dash=2
    cmds+=("'$OUT/slownet.dat' index $i using 1:$col with linespoints lw 2 dt $dash title '$s'")
    i=$((i + 1))
  done
  local IFS=,
  echo "${cmds[*]}"
}
common="set terminal pngcairo size 1000,620 font 'sans,11';
set logscale x; set grid; set key outside right;
set xrange [7:14000]; set xtics ('10' 10, '100' 100, '300' 300, '1000' 1000, '500' 500, 'unshaped' 10000);
set xlabel 'link bandwidth (Mbit/s, each direction)'"
gnuplot -e "$common; set output '$ROOT/docs/slownet_throughput.png';
  set ylabel 'samples/s'; set logscale y; set title 'aqswarm bench slownet: throughput vs link bandwidth';
  plot $(plot_cmd 2)"
gnuplot -e "$common; set output '$ROOT/docs/slownet_ratio.png';
  set ylabel 'ratio to unshaped fp32'; set yrange [0:*]; set title 'throughput / unshaped fp32 (paper Table 2 shape)';
  plot $(plot_cmd 3)"
echo "bench_slownet.sh: wrote $DOC (slownet section), docs/slownet_throughput.png, docs/slownet_ratio.png"
