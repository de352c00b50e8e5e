#!/usr/bin/env bash
# Link codecs ranked by time to target: runs `aqswarm bench converge`
# with AdamW and each link codec on two jobs, unshaped, 100 Mbit/s + 50 ms and
# 10 Mbit/s + 50 ms:
#   single pass   examples/converge_single_pass.json  (all 233 speeches, 1 epoch:
#                 every sample is seen once)
#   multi-epoch   examples/converge_multi_epoch.json  (10 speeches, ~9 epochs)
# then the baseline again with another seed (run-to-run noise), then a second
# run of each job (*_tokens: tiles along tokens, zstd) and a third (*_grid:
# the midtread grid, the per-token first-visit reference), and the unshaped
# runs after them (*_bits: fewer bits; *_fixed: fixed-point first visits;
# *_gradients: tiled gradients, compression.bwCodec; *_fewer: fewer
# gradient bits; *_ref: the reference with fewer bits; *_zstd: the zstd
# rows again after the codes' zstd parameters changed; *_seed8: the best
# rows again with seed 8). Writes
# docs/data/codecs_<run>.jsonl (+ _noise.jsonl) and docs/data/codecs.meta,
# and renders docs/notebook/convergence_codecs.md, section "Link codecs by time to target
#". About 100 minutes on 2 cores.
#
#   scripts/codecs_rank.sh            # run, then render
#   scripts/codecs_rank.sh --render   # only redraw the section from docs/data
#
# Environment: SINGLE_CONFIGS, MULTI_CONFIGS, SINGLE_TOKENS_CONFIGS,
# MULTI_TOKENS_CONFIGS, SINGLE_GRID_CONFIGS, MULTI_GRID_CONFIGS,
# MULTI_BITS_CONFIGS, SINGLE_FIXED_CONFIGS, MULTI_FIXED_CONFIGS,
# MULTI_GRADIENTS_CONFIGS, MULTI_FEWER_CONFIGS, MULTI_REF_CONFIGS,
# MULTI_ZSTD_CONFIGS, MULTI_SEED8_CONFIGS (each run's --configs), ONLY (run only these runs,
# e.g. "single_pass_tokens multi_epoch_tokens"), SHAPINGS, OUT (default
# runs/codecs), AQSWARM_BIN (default build/aqswarm). docs/data/codecs.meta
# gets a line per invocation.
set -euo pipefail
cd "$(dirname "$0")/.."
AQSWARM_BIN="${AQSWARM_BIN:-build/aqswarm}"
OUT="${OUT:-runs/codecs}"
SHAPINGS="${SHAPINGS:-0/0,100/50,10/50,1/50}"
# Each run: NAME JOB CONFIGS. A run has its own fp32 baseline (ratios are to
# it); the *_tokens runs came second: tiles along tokens, and zstd on DirectQ
# and AQ-SGD.
RUNS=(
  "single_pass examples/converge_single_pass.json ${SINGLE_CONFIGS:-adamw-fp32,adamw-directq,adamw-aqsgd,adamw-tiled3,adamw-tiled2,adamw-tiled2_ent,adamw-aqsgd_tiled3,adamw-aqsgd_tiled3_ent}"
  "multi_epoch examples/converge_multi_epoch.json ${MULTI_CONFIGS:-adamw-fp32,adamw-directq,adamw-aqsgd,adamw-tiled3,adamw-tiled2,adamw-aqsgd_tiled3,adamw-aqsgd_tiled3_ent}"
  "single_pass_tokens examples/converge_single_pass.json ${SINGLE_TOKENS_CONFIGS:-adamw-fp32,adamw-tiled3_tok,adamw-tiled2_tok,adamw-tiled2_tok_ent,adamw-directq_ent}"
  "multi_epoch_tokens examples/converge_multi_epoch.json ${MULTI_TOKENS_CONFIGS:-adamw-fp32,adamw-aqsgd_tiled3_tok,adamw-aqsgd_tiled3_tok_ent,adamw-aqsgd_ent}"
  "single_pass_grid examples/converge_single_pass.json ${SINGLE_GRID_CONFIGS:-adamw-fp32,adamw-tiled3_mt,adamw-tiled3_mt_tok,adamw-tiled2_mt_ent,adamw-aqsgd_tiled3_mt,adamw-aqsgd_tiled3_mt_ref,adamw-aqsgd_tiled3_mt_ref_ent}"
  "multi_epoch_grid examples/converge_multi_epoch.json ${MULTI_GRID_CONFIGS:-adamw-fp32,adamw-aqsgd_tiled3_mt,adamw-aqsgd_tiled3_mt_ent,adamw-aqsgd_tiled3_mt_ref_ent}"
  "multi_epoch_bits examples/converge_multi_epoch.json ${MULTI_BITS_CONFIGS:-adamw-fp32,adamw-tiled3_mt,adamw-tiled3_mt_tok,adamw-aqsgd_fw2_bw4,adamw-aqsgd_tiled3_mt_ent_bw4,adamw-aqsgd_tiled2_mt_ent_fw2_bw4}"
  "single_pass_fixed examples/converge_single_pass.json ${SINGLE_FIXED_CONFIGS:-adamw-fp32,adamw-aqsgd_fixed3,adamw-aqsgd_fixed3_ref}"
  "multi_epoch_fixed examples/converge_multi_epoch.json ${MULTI_FIXED_CONFIGS:-adamw-fp32,adamw-aqsgd_fixed3,adamw-aqsgd_fixed3_ent,adamw-aqsgd_fixed3_ref_ent}"
  "multi_epoch_gradients examples/converge_multi_epoch.json ${MULTI_GRADIENTS_CONFIGS:-adamw-fp32,adamw-aqsgd_fixed3_ent_bw4,adamw-aqsgd_fixed3_ent_gt,adamw-aqsgd_fixed3_ent_gt_bw4,adamw-aqsgd_fixed3_ref_ent_gt_bw4,adamw-aqsgd_fixed3_ent_gt_fw2_bw4}"
  "multi_epoch_fewer examples/converge_multi_epoch.json ${MULTI_FEWER_CONFIGS:-adamw-fp32,adamw-aqsgd_fixed3_ent_bw3,adamw-aqsgd_fixed4_ent_bw3,adamw-aqsgd_fixed4_ent_bw4,adamw-aqsgd_fixed3_ref_ent_bw3}"
  "multi_epoch_ref examples/converge_multi_epoch.json ${MULTI_REF_CONFIGS:-adamw-fp32,adamw-aqsgd_fixed2_ref_ent_bw3,adamw-aqsgd_fixed3_ref_ent_bw4}"
  "multi_epoch_zstd examples/converge_multi_epoch.json ${MULTI_ZSTD_CONFIGS:-adamw-fp32,adamw-aqsgd_ent,adamw-aqsgd_fixed3_ent,adamw-aqsgd_fixed3_ent_bw4,adamw-aqsgd_fixed4_ent_bw4,adamw-aqsgd_fixed3_ref_ent_bw3}"
  "multi_epoch_seed8 $OUT/multi_epoch-seed8.json ${MULTI_SEED8_CONFIGS:-adamw-fp32,adamw-aqsgd,adamw-aqsgd_fixed3_ref_ent_bw3,adamw-aqsgd_fixed3_ent_bw4}"
)
meta=docs/data/codecs.meta
if [[ "${1:-}" != --render ]]; then
  [[ -x "$AQSWARM_BIN" ]] || { [[ "$AQSWARM_BIN" == build/aqswarm ]] && scripts/setup.sh; }
  [[ -x "$AQSWARM_BIN" ]] || { echo "no binary at $AQSWARM_BIN" >&2; exit 1; }
  ls data/sotu/*.txt > /dev/null || { echo "no corpus: run scripts/fetch_data.sh" >&2; exit 1; }
  build=$(git rev-parse --short HEAD 2>/dev/null || echo "?")
  [[ -z $(git status --porcelain --untracked-files=no 2>/dev/null) ]] || build+="+local changes"
  mkdir -p docs/data "$OUT"
  cp "$AQSWARM_BIN" "$OUT/aqswarm"
  AQSWARM_BIN="$OUT/aqswarm"
  start=$(date +%s)
  # The multi-epoch job with another seed (multi_epoch_seed8: do its
  # rankings hold with another initialisation and data order?).
  python3 -c 'import json,sys; j=json.load(open(sys.argv[1])); j["seed"]=8; json.dump(j,open(sys.argv[2],"w"))' \
    examples/converge_multi_epoch.json "$OUT/multi_epoch-seed8.json"
  for run in "${RUNS[@]}"; do
    read -r name job configs <<< "$run"
    [[ -z ${ONLY:-} || " $ONLY " == *" $name "* ]] || continue
    data=docs/data/codecs_${name}.jsonl
    rc=0
    "$AQSWARM_BIN" bench converge --job "$job" --out_dir "$OUT/$name" --configs "$configs" \
      --shapings "$SHAPINGS" > "$data.tmp" || rc=$?
    [[ -s "$data.tmp" ]] || { echo "the $name bench printed nothing (exit $rc)" >&2; exit 1; }
    mv "$data.tmp" "$data"
    [[ $name == *_tokens || $name == *_grid || $name == *_bits || $name == *_fixed || $name == *_gradients || $name == *_fewer || $name == *_ref \
       || $name == *_zstd || $name == *_seed8 ]] && continue
    # Run-to-run noise: the baseline again with another seed.
    python3 -c 'import json,sys; j=json.load(open(sys.argv[1])); j["seed"]=int(sys.argv[2]); json.dump(j,open(sys.argv[3],"w"))' \
      "$job" "${NOISE_SEED:-8}" "$OUT/$name-noise-seed.json"
    "$AQSWARM_BIN" bench converge --job "$OUT/$name-noise-seed.json" --out_dir "$OUT/$name-noise" \
      --configs adamw-fp32 --shapings 0/0 > "docs/data/codecs_${name}_noise.jsonl.tmp"
    mv "docs/data/codecs_${name}_noise.jsonl.tmp" "docs/data/codecs_${name}_noise.jsonl"
  done
  echo "${ONLY:-all runs}: build $build, finished $(date -u +%Y-%m-%dT%H:%MZ), $(( $(date +%s) - start )) s, $(nproc) cores, load average $(cut -d' ' -f1-3 /proc/loadavg) at the end." >> "$meta"
fi
python3 - "$meta" docs/notebook/convergence_codecs.md <<'PY'
import json, os, sys
meta_file, doc = sys.argv[1:3]
meta = open(meta_file).read().strip()

def load(path):
    return [json.loads(l) for l in open(path) if l.strip()]

def pct(v):
    return "-" if v is None else f"{100 * v:+.2f}%"

def x(v):
    return "-" if v is None else f"{v:.1f}x"

def link_name(r):
    bits = f"fw{r['fw_bits']} bw{r['bw_bits']}"
    if r["link_mode"] == "tiled":
        name = f"tiled {bits}"
    elif r["link_mode"] == "aqsgd" and r.get("first_visit_bits"):
        kind = "fixed-point" if r.get("first_visit") == "fixed_point" else "tiled"
        name = f"AQ-SGD {bits}, {kind} first visits {r['first_visit_bits']}-bit"
    elif r["link_mode"] == "fp32":
        name = "fp32"
    else:
        name = {"directq": "DirectQ", "aqsgd": "AQ-SGD"}[r["link_mode"]] + " " + bits
    if r.get("tile_grid") == "midtread":
        name += ", midtread grid"
    if r.get("first_visit_reference"):
        name += ", per-token reference"
    if r.get("tile_along") == "tokens":
        name += ", tiles along tokens"
    if r.get("bw_codec") == "tiled" and r["link_mode"] != "tiled":
        name += ", tiled gradients"
    return name + (" + zstd" if r.get("entropy_coding") else "")

MULTI_TITLE = "Multi-epoch fine-tuning (10 speeches, an epoch every 50 steps: ~5 epochs)"
SHAPED = [100, 10, 1]  # Mbit/s, each with 50 ms one-way latency

def section(regime, title, noise_regime=None):
    if not os.path.exists(f"docs/data/codecs_{regime}.jsonl"):
        return [], {}, 0.0
    rows = load(f"docs/data/codecs_{regime}.jsonl")
    noise = load(f"docs/data/codecs_{noise_regime or regime.split('_')[0] + '_' + regime.split('_')[1]}_noise.jsonl")
    failures = [r for r in rows if "error" in r]
    rows = [r for r in rows if "error" not in r]
    by = {(r["config"], r["bandwidth_mbps"]): r for r in rows}
    base = by[("adamw-fp32", 0)]
    spread = abs(noise[0]["final_val_loss"] - base["final_val_loss"]) / base["final_val_loss"]
    configs = list(dict.fromkeys(r["config"] for r in rows))
    out = [f"### {title}", "",
           f"Target: {base['target_val_loss']:.4f} (fp32 links' final validation loss {base['final_val_loss']:.4f} + 1%); "
           f"run-to-run noise of the final loss (another seed): {100 * spread:.2f}%. Ratios are fp32 links' value / the row's "
           "in the same run (> 1 = fewer bytes, faster).", "",
           "| links | fw B/token/link | bw B/token/link | fw bytes vs fp32 | all link bytes vs fp32 | final val | vs fp32 | steps to target "
           "| s/step unshaped | " + " | ".join(f"time to target {b:g} Mbit/s | vs fp32" for b in SHAPED) + " |",
           "|---|---|---|---|---|---|---|---|---|" + "---|---|" * len(SHAPED)]
    def t(r):
        return None if r is None or r.get("seconds_to_target") is None else r["seconds_to_target"]
    for c in configs:
        u = by[(c, 0)]
        def cell(s, b):
            if s is None:
                return "not run", "-"
            if t(s) is None:
                return "not reached", "-"
            e = "~" if s.get("extrapolated") else ""
            return f"{e}{t(s):.0f} s", (x(t(b) / t(s)) if t(b) else "-")
        shaped = " | ".join(" | ".join(cell(by.get((c, b)), by.get(("adamw-fp32", b)))) for b in SHAPED)
        out.append(f"| {link_name(u)} | {u['fw_bytes_per_token_per_link']:.1f} | {u['bw_bytes_per_token_per_link']:.1f} "
                   f"| {x(u['fw_bytes_ratio_vs_fp32'])} | {x(u['link_bytes_ratio_vs_fp32'])} | {u['final_val_loss']:.4f} "
                   f"| {pct(u['val_loss_vs_baseline'])} | {u['steps_to_target'] or 'not reached'} | {u['seconds_per_step']:.2f} "
                   f"| {shaped} |")
    if failures:
        out += ["", "Failed (no measurement): " + "; ".join(f"`{r['run']}`: {r['error']}" for r in failures)]
    return out, by, spread

single, sby, s_spread = section("single_pass", "Single pass (each sample once)")
multi, mby, m_spread = section("multi_epoch", MULTI_TITLE)
single_t, sty, _ = section("single_pass_tokens", "Single pass, second run: tiles along tokens, zstd on DirectQ")
multi_t, mty, _ = section("multi_epoch_tokens", MULTI_TITLE + ", second run: tiles along tokens, zstd on AQ-SGD")
single_g, sgy, _ = section("single_pass_grid", "Single pass, third run: the midtread grid, a per-token first-visit reference")
multi_g, mgy, _ = section("multi_epoch_grid", MULTI_TITLE + ", third run: the midtread grid, a per-token first-visit reference")
multi_b, mbb, _ = section("multi_epoch_bits", MULTI_TITLE + ", fourth run (unshaped): the grids at low noise, fewer bits")
single_f, sfy, _ = section("single_pass_fixed", "Single pass, fifth run (unshaped): fixed-point first visits")
multi_f, mfy, _ = section("multi_epoch_fixed", MULTI_TITLE + ", fifth run (unshaped): fixed-point first visits")
multi_gr, mgr, _ = section("multi_epoch_gradients", MULTI_TITLE + ", sixth run (unshaped): tiled gradients")
multi_fw, mfw, _ = section("multi_epoch_fewer", MULTI_TITLE + ", seventh run (unshaped): fewer gradient bits")
multi_rf, mrf, _ = section("multi_epoch_ref", MULTI_TITLE + ", eighth run (unshaped): the reference with fewer bits")
multi_z, mz, _ = section("multi_epoch_zstd", MULTI_TITLE + ", ninth run (unshaped): zstd tuned for the codes")
multi_s8, ms8, _ = section("multi_epoch_seed8", MULTI_TITLE + ", tenth run (unshaped): seed 8 instead of 7")
runs = [sby, sty, sgy, sfy]

goals = []
# Single pass: forward bytes >= 12x below fp32 at final val within 1%; time to target at 10 Mbit/s >= 5x.
best = None
for run in runs:
  for (c, bw), r in run.items():
    if bw != 0 or c == "adamw-fp32":
        continue
    ok_bytes = r["fw_bytes_ratio_vs_fp32"] >= 12 and r["val_loss_vs_baseline"] <= 0.01
    s10, b10 = run.get((c, 10)), run.get(("adamw-fp32", 10))
    speed = (b10["seconds_to_target"] / s10["seconds_to_target"]) if s10 and b10 and s10.get("seconds_to_target") else None
    s1, b1 = run.get((c, 1)), run.get(("adamw-fp32", 1))
    speed1 = (b1["seconds_to_target"] / s1["seconds_to_target"]) if s1 and b1 and s1.get("seconds_to_target") else None
    desc = (f"`{c}`: fw {r['fw_bytes_ratio_vs_fp32']:.1f}x, final val {pct(r['val_loss_vs_baseline'])}, "
            f"time to target at 10 Mbit/s {x(speed)} (1 Mbit/s: {x(speed1)})")
    if best is None or (ok_bytes, speed or 0) > (best[0], best[1] or 0):
        best = (ok_bytes, speed, desc)
    goals.append(desc)
met1 = best and best[0] and (best[1] or 0) >= 5
lines = ["", "Goals:", "",
         f"- Single pass, forward bytes >= 12x below fp32 within 1% of its final loss and time to target at 10 Mbit/s >= 5x: "
         f"**{'met' if met1 else 'not met'}** (best: {best[2] if best else '-'}; noise {100 * s_spread:.2f}%). All rows: "
         + "; ".join(goals) + "."]
a = mby.get(("adamw-aqsgd", 0))
multi_rows = []  # (met, config, description) of every multi-epoch AQ-SGD row against AQ-SGD fw3 bw6
# Bytes and losses do not depend on timing (training is deterministic), so
# rows of the second run compare with the first run's AQ-SGD.
for e in (mby.get(("adamw-aqsgd_tiled3_ent", 0)), mty.get(("adamw-aqsgd_tiled3_tok_ent", 0)),
          mty.get(("adamw-aqsgd_ent", 0)), mgy.get(("adamw-aqsgd_tiled3_mt_ent", 0)),
          mgy.get(("adamw-aqsgd_tiled3_mt_ref_ent", 0)), mbb.get(("adamw-aqsgd_fw2_bw4", 0)),
          mbb.get(("adamw-aqsgd_tiled3_mt_ent_bw4", 0)), mbb.get(("adamw-aqsgd_tiled2_mt_ent_fw2_bw4", 0)),
          mfy.get(("adamw-aqsgd_fixed3_ent", 0)), mfy.get(("adamw-aqsgd_fixed3_ref_ent", 0)),
          *(r for run in (mgr, mfw, mrf, mz) for (c, bw), r in run.items() if bw == 0 and c != "adamw-fp32")):
    if not (a and e):
        continue
    ratio = a["link_bytes"] / e["link_bytes"]
    dl = (e["final_val_loss"] - a["final_val_loss"]) / a["final_val_loss"]
    met2 = ratio >= 2 and abs(dl) <= 0.005
    if e["link_mode"] != "aqsgd":
        continue
    multi_rows.append((met2, e["config"], f"{link_name(e)}: {ratio:.2f}x, {pct(dl)}" + (" (met)" if met2 else "")))
a8 = ms8.get(("adamw-aqsgd", 0))
seed8 = {}
for e in (r for (c, bw), r in ms8.items() if bw == 0 and a8 and c not in ("adamw-fp32", "adamw-aqsgd")):
    ratio = a8["link_bytes"] / e["link_bytes"]
    dl = (e["final_val_loss"] - a8["final_val_loss"]) / a8["final_val_loss"]
    seed8[e["config"]] = (ratio >= 2 and abs(dl) <= 0.005, f"{ratio:.2f}x at {pct(dl)}")
met_rows = [(c, d) for ok, c, d in multi_rows if ok]
# The latest measurement of each met configuration (later runs repeat earlier ones with retuned zstd).
met_last = dict(met_rows)
met_desc = "; ".join(f"{d}" + (f"; with seed 8 {seed8[c][1]} ({'met' if seed8[c][0] else 'not met'})" if c in seed8 else "")
                     for c, d in met_last.items())
lines.append(f"- Multi-epoch, >= 2x fewer link bytes than AQ-SGD fw3 bw6 over the run at equal loss (+-0.5%; run-to-run "
             f"noise of the final loss {100 * m_spread:.2f}%): **{'met' if met_last else 'not met'}**"
             + (f" by {met_desc}." if met_last else ".")
             + " Every AQ-SGD row (link bytes fewer than AQ-SGD's, final val vs AQ-SGD's): "
             + "; ".join(d for _, _, d in multi_rows) + ".")

# What the tables say, from the same rows.
def row(run, c):
    return run.get((c, 0))
reading = ["", "Reading:", ""]
d, t3, t3t = row(sby, "adamw-directq"), row(sby, "adamw-tiled3"), row(sty, "adamw-tiled3_tok")
if d and t3 and t3t:
    reading.append(f"- At 3 bits a first visit loses more with midrise tiles than with DirectQ's per-channel fixed point "
                   f"(single pass: tiles along channels {pct(t3['val_loss_vs_baseline'])}, along tokens "
                   f"{pct(t3t['val_loss_vs_baseline'])}, DirectQ {pct(d['val_loss_vs_baseline'])}, all at ~9.6x fewer "
                   "forward bytes). The grids at 3 bits: DirectQ 8 levels with one at zero, step scale/4, the top one clipped "
                   "at 3/4 of the scale; midrise tiles 8 levels, none at zero, step 2 scale/7; midtread tiles 7 levels "
                   "with one at zero, step scale/3. The midtread rows below show that a zero level alone does not "
                   "close the gap.")
for plain, coded, label in ((row(sby, "adamw-tiled2"), row(sby, "adamw-tiled2_ent"), "tiled fw2, tiles along channels"),
                            (row(sty, "adamw-tiled2_tok"), row(sty, "adamw-tiled2_tok_ent"), "tiled fw2, tiles along tokens"),
                            (row(sby, "adamw-directq"), row(sty, "adamw-directq_ent"), "DirectQ fw3"),
                            (row(mby, "adamw-aqsgd"), row(mty, "adamw-aqsgd_ent"), "AQ-SGD fw3 bw6 (multi-epoch)")):
    if plain and coded:
        reading.append(f"- zstd on the codes, {label}: forward {plain['fw_bytes_per_token_per_link']:.1f} -> "
                       f"{coded['fw_bytes_per_token_per_link']:.1f} B/token/link, backward "
                       f"{plain['bw_bytes_per_token_per_link']:.1f} -> {coded['bw_bytes_per_token_per_link']:.1f}; "
                       + ("the same final loss (lossless)." if plain["final_val_loss"] == coded["final_val_loss"]
                          else f"final loss {plain['final_val_loss']:.4f} -> {coded['final_val_loss']:.4f}."))
t3m, t3mt = row(sgy, "adamw-tiled3_mt"), row(sgy, "adamw-tiled3_mt_tok")
if d and t3 and t3m:
    reading.append(f"- The midtread grid (7 levels at 3 bits, one at zero) against the midrise one (8 levels, none at zero), "
                   f"single pass, tiled fw3: tiles along channels {pct(t3['val_loss_vs_baseline'])} -> "
                   f"{pct(t3m['val_loss_vs_baseline'])}"
                   + (f", along tokens {pct(t3t['val_loss_vs_baseline'])} -> {pct(t3mt['val_loss_vs_baseline'])}"
                      if t3t and t3mt else "")
                   + f" (DirectQ fw3: {pct(d['val_loss_vs_baseline'])}).")
m3, m3m, m3t = row(mby, "adamw-tiled3"), row(mbb, "adamw-tiled3_mt"), row(mbb, "adamw-tiled3_mt_tok")
if m3 and m3m:
    reading.append(f"- The same grids multi-epoch (run-to-run noise {100 * m_spread:.2f}%), tiled fw3: midrise along channels "
                   f"{pct(m3['val_loss_vs_baseline'])}, midtread along channels {pct(m3m['val_loss_vs_baseline'])}"
                   + (f", midtread along tokens {pct(m3t['val_loss_vs_baseline'])}" if m3t else "") + ".")
for run, label, plain_c, ref_c in ((sgy, "single pass", "adamw-aqsgd_tiled3_mt", "adamw-aqsgd_tiled3_mt_ref"),
                                   (mgy, "multi-epoch", "adamw-aqsgd_tiled3_mt_ent", "adamw-aqsgd_tiled3_mt_ref_ent"),
                                   (sfy, "single pass", "adamw-aqsgd_fixed3", "adamw-aqsgd_fixed3_ref"),
                                   (mfy, "multi-epoch", "adamw-aqsgd_fixed3_ent", "adamw-aqsgd_fixed3_ref_ent")):
    fm, fr = row(run, plain_c), row(run, ref_c)
    if fm and fr:
        kind = "fixed-point" if fm.get("first_visit") == "fixed_point" else "midtread tiled"
        reading.append(f"- The per-token first-visit reference, {label}, AQ-SGD with {kind} first visits at 3 bits"
                       + (" + zstd" if fm.get("entropy_coding") else "")
                       + f": final val {pct(fm['val_loss_vs_baseline'])} without it, {pct(fr['val_loss_vs_baseline'])} with it; "
                       f"forward {fm['fw_bytes_per_token_per_link']:.1f} -> {fr['fw_bytes_per_token_per_link']:.1f} B/token/link.")
f3, a3 = row(sfy, "adamw-aqsgd_fixed3"), row(mfy, "adamw-aqsgd_fixed3")
if f3 and a3 and f3.get("steps_to_target") and a3.get("steps_to_target"):
    reading.append(f"- Fixed-point first visits (the deltas' own per-channel codec at 3 bits, `firstVisit: fixed_point`) are the "
                   f"compressed first visits that reach the 1% targets: single pass at step {f3['steps_to_target']} "
                   f"({pct(f3['val_loss_vs_baseline'])}, {x(f3['fw_bytes_ratio_vs_fp32'])} fewer forward bytes), "
                   f"multi-epoch at step {a3['steps_to_target']} ({pct(a3['val_loss_vs_baseline'])}); no tiled first visit "
                   "reached either.")
a1, d1 = mby.get(("adamw-aqsgd", 1)), sby.get(("adamw-directq", 1))
if a1 and d1 and a1.get("seconds_to_target") and d1.get("seconds_to_target"):
    reading.append(f"- Where the links dominate (1 Mbit/s) the codecs that reach the target pay off: DirectQ reaches the "
                   f"single-pass target {sby[('adamw-fp32', 1)]['seconds_to_target'] / d1['seconds_to_target']:.1f}x "
                   f"sooner than fp32 links, AQ-SGD the multi-epoch one "
                   f"{mby[('adamw-fp32', 1)]['seconds_to_target'] / a1['seconds_to_target']:.1f}x sooner.")
g6, g4, t6, t4 = (row(mfy, "adamw-aqsgd_fixed3_ent"), row(mgr, "adamw-aqsgd_fixed3_ent_bw4"),
                  row(mgr, "adamw-aqsgd_fixed3_ent_gt"), row(mgr, "adamw-aqsgd_fixed3_ent_gt_bw4"))
if g6 and g4 and t6 and t4:
    reading.append(f"- Tiled gradients (`bwCodec: tiled`: one scale per token's 64 channels instead of one per channel over "
                   f"the micro-batch), multi-epoch, fixed-point first visits + zstd: at 6 bits "
                   f"{pct(g6['val_loss_vs_baseline'])} -> {pct(t6['val_loss_vs_baseline'])} "
                   f"({g6['bw_bytes_per_token_per_link']:.1f} -> {t6['bw_bytes_per_token_per_link']:.1f} backward B/token/link), "
                   f"at 4 bits {pct(g4['val_loss_vs_baseline'])} -> {pct(t4['val_loss_vs_baseline'])} "
                   f"({g4['bw_bytes_per_token_per_link']:.1f} -> {t4['bw_bytes_per_token_per_link']:.1f}).")
pairs = [(row(mty, "adamw-aqsgd_ent"), row(mz, "adamw-aqsgd_ent")),
         (row(mfy, "adamw-aqsgd_fixed3_ent"), row(mz, "adamw-aqsgd_fixed3_ent")),
         (row(mgr, "adamw-aqsgd_fixed3_ent_bw4"), row(mz, "adamw-aqsgd_fixed3_ent_bw4")),
         (row(mfw, "adamw-aqsgd_fixed3_ref_ent_bw3"), row(mz, "adamw-aqsgd_fixed3_ref_ent_bw3"))]
cells = [f"{link_name(b)}: forward {a['fw_bytes_per_token_per_link']:.1f} -> {b['fw_bytes_per_token_per_link']:.1f}, "
         f"backward {a['bw_bytes_per_token_per_link']:.1f} -> {b['bw_bytes_per_token_per_link']:.1f}"
         + ("" if a["final_val_loss"] == b["final_val_loss"] else " (the final loss changed!)")
         for a, b in pairs if a and b]
if cells:
    reading.append("- zstd tuned for the codes (ninth run) against zstd's level 1 (earlier runs), B/token/link, the same "
                   "training: " + "; ".join(cells) + ".")
lines += reading

body = ["## Link codecs by time to target (issue 41)", "",
        "AdamW on one pipeline of 2 stages, no data parallelism (`examples/converge_single_pass.json`, "
        "`examples/converge_multi_epoch.json`: GPT d64, 4 layers, seq 64, 256 steps), each link codec in turn, unshaped and "
        "shaped to 100, 10 and 1 Mbit/s with 50 ms one-way latency (FIFO per direction; on 2 CPU cores this model's compute "
        "takes ~0.3 s a step, so the links dominate only at 1 Mbit/s, the regime GPU peers are in at 10-100 Mbit/s). Time to target is stage 0's step time "
        "summed up to the first evaluation at or below the target; shaped runs train their first steps (AQ-SGD: past epoch 0) and "
        "extrapolate the rest at their own mean step time (\"~\"). Bytes per token per link count every byte of the "
        "messages' scales and codes. Runs before the ninth measured their zstd rows with zstd's level 1, which left "
        "3-bit codes nearly as large as packed; from the ninth on the codes' zstd is tuned (docs/BENCHMARKS.md, "
        "\"Entropy coding of the codes\"), so those rows' bytes shrank; losses are the same (lossless).", "",
        "    scripts/codecs_rank.sh            # ~100 min on 2 cores; --render redraws from docs/data/codecs_*.jsonl", "",
        "Measured:", ""] + ["    " + l for l in meta.splitlines()] + [""] + single + [""] + single_t + [""] + single_g + [""] + multi + [""] + multi_t + [""] + multi_g + [""] + multi_b + [""] + single_f + [""] + multi_f + [""] + multi_gr + [""] + multi_fw + [""] + multi_rf + [""] + multi_z + [""] + multi_s8 + lines + [""]
text = open(doc).read()
head = "## Link codecs by time to target (issue 41)"
if head in text:
    start = text.index(head)
    nxt = text.find("\n## ", start + len(head))
    text = text[:start] + "\n".join(body) + ("\n" + text[nxt + 1:] if nxt != -1 else "")
else:
    text = text.rstrip("\n") + "\n\n" + "\n".join(body)
open(doc, "w").write(text)
print("rendered", doc)
PY
