"""Markdown and plot data for one slow-network run (a data.Run).

benchmarks_section(): the headline tables for docs/BENCHMARKS.md.
run_page(): the whole run for docs/notebook/slownet_run.md: every cell with
its limits, the targets in full, and the notes that read this run's numbers.
plot_data(): the gnuplot input of the two PNGs.
"""
import math
import os
import re

from . import stats
from .stats import AQ, DQ, FP32, bwname, cpu, get

NOTEBOOK = "docs/notebook/slownet_run.md"


def f(v, fmt="{:.1f}"):
    return "-" if v is None or (isinstance(v, float) and math.isinf(v)) else fmt.format(v)


def replace_block(text, name, body):
    """Puts body between <!-- name:begin --> and <!-- name:end --> in text
    (appending the block when the markers are missing)."""
    begin, end = f"<!-- {name}:begin -->", f"<!-- {name}:end -->"
    block = f"{begin}\n{body.rstrip()}\n{end}"
    if begin in text and end in text:
        return text[:text.index(begin)] + block + text[text.index(end) + len(end):]
    return text.rstrip("\n") + "\n\n" + block + "\n"


def pivot(cells, key="samples_per_s", fmt="{:.0f}"):
    labels = list(dict.fromkeys(c["label"] for c in cells))
    bws = stats.by_bandwidth_desc({c["bandwidth_mbps"] for c in cells})
    rows = ["| link | " + " | ".join(labels) + " |", "|---|" + "---:|" * len(labels)]
    for b in bws:
        vals = []
        for lab in labels:
            c = get(cells, lab, b)
            vals.append(f(c[key], fmt) if c else "")
        rows.append(f"| {bwname(b)} | " + " | ".join(vals) + " |")
    return "\n".join(rows)


def cells_table(cells):
    rows = ["| grid | mode | schedule | link Mbit/s | samples/s | ratio vs fp32 unshaped | compute-only limit | compute + DP limit | wire limit | schedule link limit | achieved / min(compute, wire) | achieved / min(compute + DP, schedule) | fw B/sample | bw B/sample | DP B/step | CPU ms/sample | CPU limit | samples/s of each pass (its own median) |",
            "|---|---|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---|"]
    for c in cells:
        rows.append("| {} | {} | {} | {} | {} | {} | {} | {} | {} | {} | {} | {} | {:.0f} | {:.0f} | {:.0f} | {} | {} | {} |".format(
            c["grid"], c["label"], c["schedule"], bwname(c["bandwidth_mbps"]), f(c["samples_per_s"]),
            f(c["ratio_vs_fp32_unshaped"], "{:.3f}"), f(c["compute_limit_samples_per_s"]),
            f(c["compute_dp_limit_samples_per_s"]) if c["dp"] > 1 and c["bandwidth_mbps"] > 0 else "-",
            f(c["link_limit_samples_per_s"]), f(c["schedule_link_limit_samples_per_s"]),
            f(c["achieved_vs_min_limits"], "{:.2f}"), f(c["achieved_vs_min_schedule_limits"], "{:.2f}"),
            c["fw_bytes_per_sample"], c["bw_bytes_per_sample"], c["dp_bytes_per_step"],
            f(c.get("cpu_ms_per_sample"), "{:.2f}"), f(c.get("cpu_limit_samples_per_s"), "{:.0f}"),
            " / ".join(f"{x:.0f}" for x in c.get("samples_per_s_passes") or [])))
    return "\n".join(rows)


def verdict(ok):
    return "-" if ok is None else "yes" if ok else "**no**"


def plot_data(run, out_dir):
    """Writes out_dir/slownet.dat (one block per series: x, samples/s, ratio)
    and out_dir/series.txt (the series' names, in block order)."""
    series = {}
    for c in run.cells:
        series.setdefault((c["grid"], c["label"]), []).append(c)
    names = []
    with open(os.path.join(out_dir, "slownet.dat"), "w") as d:
        for (grid, label), cs in series.items():
            names.append(f"{grid} {label}")
            d.write(f"# {grid} {label}\n")
            for c in sorted(cs, key=lambda c: -(c["bandwidth_mbps"] or stats.UNSHAPED_X)):
                x = c["bandwidth_mbps"] or stats.UNSHAPED_X
                r = c.get("ratio_vs_fp32_unshaped")  # none without an unshaped fp32 cell: "?" is missing to gnuplot
                d.write(f"{x} {c['samples_per_s']:.3f} {'?' if r is None else f'{r:.4f}'}\n")
            d.write("\n\n")
    with open(os.path.join(out_dir, "series.txt"), "w") as s:
        s.write("\n".join(names) + "\n")


def run_line(run):
    """One line: which build and run produced the table."""
    m = run.meta
    when = m.get("finished", "?")
    return (f"Run: build {m.get('build', '?')}, finished {when}, {m.get('wall_seconds', '?')} s on a shared 2-core "
            "machine; cells in `docs/data/slownet.jsonl`.")


def setup_sentence(run):
    c0 = run.cells[0]
    m = c0["model"]
    grid = [c for c in run.cells if c["dp"] > 1]
    return (f"{c0['stages']} stage processes on 127.0.0.1 (and a {grid[0]['grid'] if grid else '2x4'} grid with data "
            f"parallelism), GPT with vocab {m['vocab']}, seq_len {m['seq_len']}, d_model {m['d_model']}, "
            f"{m['n_layer']} layers, {m['micro_batches']} micro-batches of {m['micro_batch']} samples per step, "
            "links shaped in user space.")


def benchmarks_section(run):
    """The slow-network section of docs/BENCHMARKS.md: headline tables."""
    cells = run.cells
    one = [c for c in cells if c["dp"] == 1]
    grid = [c for c in cells if c["dp"] > 1]
    tg = stats.targets(cells, run.paired, run.repeats)
    md = ["## Slow networks (`aqswarm bench slownet`)", "",
          "The AQ-SGD paper's Table 2 as ratios: samples/s of a pipeline over shaped links, fp32 against "
          "DirectQ and AQ-SGD compression.",
          "Setup: " + setup_sentence(run), "",
          "Reproduce: `scripts/bench_slownet.sh` (about 40 minutes on 2 cores: the table, then paired AQ-SGD vs "
          "DirectQ runs;",
          "`sudo RUN_NETNS=1` adds the kernel-shaping check). Redraw the docs from the committed data: "
          "`scripts/bench_slownet.sh --render`.", "",
          run_line(run),
          f"Every cell with its limits, and notes on this run: `{NOTEBOOK}`; how the figures are computed: "
          "`docs/METHODOLOGY.md`;",
          "earlier runs: `docs/notebook/slownet_history.md`.", "",
          "### samples/s (1 x 4 pipeline)", "", pivot(one), "",
          "### ratio to unshaped fp32", "",
          "The paper's ratios, for comparison: fp32 3.8 -> 0.5 samples/s = 0.13 at 100 Mbit/s, AQ-SGD fw3bw6 "
          "4.0 -> 3.4 = 0.89 of the fp32 10 Gbit/s baseline.", "",
          pivot(one, "ratio_vs_fp32_unshaped", "{:.3f}"), ""]
    if grid:
        md += [f"### {grid[0]['grid']} grid with QuantizedAdam and delayed DP updates (samples/s, all pipelines)", "",
               pivot(grid), ""]
    md += ["### Targets", "", "| target | measured | met |", "|---|---:|---|"]
    md += [f"| {t['short']} | {t['value']} | {verdict(t['ok'])} |" for t in tg]
    tc = netns_summary_line(run)
    if tc:
        md += ["", "Kernel shaping instead of user space (`deploy/netns/run_tc.sh`: veth + `tc tbf`, real TCP):",
               f"AQ-SGD fw3bw6 / fp32 samples/s at 10 Mbit/s by TCP congestion control: {tc}."]
    md += ["", "![samples/s vs link bandwidth](slownet_throughput.png)",
           "![ratio to unshaped fp32](slownet_ratio.png)"]
    return "\n".join(md) + "\n"


def _probe_text(v):
    lo, hi, med, slow = stats.probe_summary(v)
    return f"{lo:.2f}-{hi:.2f} s (median {med:.2f}, slowest {100 * slow:.0f}% above the fastest)"


def run_page(run):
    """docs/notebook/slownet_run.md: the latest run in full."""
    cells, meta = run.cells, run.meta
    one = [c for c in cells if c["dp"] == 1]
    grid = [c for c in cells if c["dp"] > 1]
    paired, repeats = run.paired, run.repeats
    c0 = cells[0]
    m = c0["model"]
    K, M = c0["stages"], m["micro_batches"]
    slowest = min((c["bandwidth_mbps"] for c in cells if c["bandwidth_mbps"] > 0), default=0)
    tg = stats.targets(cells, paired, repeats)

    md = ["# Slow networks: the latest run in full", "",
          f"Generated by `scripts/bench_slownet.sh` (`python3 -m slownet_report render`) from `docs/data/slownet*.jsonl` "
          "and `docs/data/slownet_run.json`; do not edit by hand. The headline tables are in `docs/BENCHMARKS.md`, "
          "the method in `docs/METHODOLOGY.md`, the A/B history behind the notes in `docs/notebook/slownet.md`.", ""]
    load0, load1 = meta.get("uptime_start"), meta.get("uptime_end", "")
    md.append(f"Build {meta.get('build', '?')}, finished {meta.get('finished', '?')}. Command: `{meta.get('command', '?')}`; "
              f"total wall time {meta.get('wall_seconds', '?')} s. Load "
              + (f"when it started: `{load0}`; " if load0 else "") + f"when it finished: `{load1}` "
              "(2 cores shared with other work: absolute numbers are noisy, the ratios compare cells of one run). "
              "Every cell's JSON: `docs/data/slownet.jsonl` (the paired AQ-SGD vs DirectQ cells: "
              "`docs/data/slownet_paired.jsonl`; the kernel-shaping check's table: `docs/data/slownet_netns.txt`).")
    md.append("")
    npass = len(c0.get("samples_per_s_passes") or [1])

    def skips(pred):
        v = sorted({c.get("skip_steps") for c in cells if pred(c)} - {None})
        return "/".join(str(x) for x in v) or "?"
    w0 = 4 * K - 1
    fp32u = get(one, FP32, 0)
    demand = fp32u["samples_per_s"] * fp32u["fw_bytes_per_sample"] * 8 / 1e6 if fp32u else float("nan")
    md.append("**This run's setup** (the rest of the setup and the estimator: `docs/METHODOLOGY.md`). " + setup_sentence(run)
              + f" {m['n_head']} heads, {m['threads']} intra-op thread per stage; schedule `adaptive` "
              f"(at most {stats.window(w0, 0, K, M)} micro-batches in flight at stage 0, {stats.window(w0, 1, K, M)} at stage 1, "
              "..., 1 at the last)"
              + "".join(f", `{x}` in the columns marked so" for x in sorted({c["schedule"] for c in cells}) if x != "adaptive")
              + f". {npass} passes, each cell timing {c0['steps_timed'] // npass} steps per pass; timed from step "
              f"{skips(lambda c: c['mode'] == 'aqsgd' and c['dp'] == 1)} (1x4 AQ-SGD), "
              f"{skips(lambda c: c['mode'] == 'aqsgd' and c['dp'] > 1)} (grid AQ-SGD), "
              f"{skips(lambda c: c['mode'] != 'aqsgd')} (fp32, DirectQ). "
              + ("Bandwidths interleaved step by step within each pipeline run. "
                 if c0.get("interleaved_bandwidths", 1) > 1 else "One pipeline run per cell. ")
              + f"OpenBLAS kernels: `{c0.get('blas_core', '?')}`. Unshaped fp32 pushes {demand:.0f} Mbit/s per link "
              f"direction (the paper's setup: 199), so this curve is the paper's shifted left by ~{199 / demand:.1f}x in "
              f"bandwidth (10 Mbit/s here is the paper's ~{10 * 199 / demand:.0f} Mbit/s). A link-bound step of M = {M} "
              f"reaches at most {stats.flush_bound(1, 1, M, K):.2f} of the wire limit (the flush per step: "
              f"{1 - stats.flush_bound(1, 1, M, K):.0%} of it); seq_len x d_model = {m['seq_len'] * m['d_model']} "
              "values per AQ-SGD row (rows under 1024 values go uncompressed).")
    md.append("")
    md += ["## Targets", "", "| target | measured | met |", "|---|---:|---|"]
    md += [f"| {t['text']} | {t['value']} | {verdict(t['ok'])} |" for t in tg]
    md += ["", "## All cells, with limits", "", cells_table(cells), "", "## Notes", ""]
    md += notes(run, one, grid, K, M, slowest)
    md += netns_section(run)
    return "\n".join(md) + "\n"


def _ach(c):
    return "-" if c is None else f"{c['samples_per_s']:.0f} samples/s = {c['achieved_vs_min_limits']:.2f} of min(compute, wire)"


def notes(run, one, grid, K, M, slowest):
    cells, meta, paired, repeats = run.cells, run.meta, run.paired, run.repeats
    m = cells[0]["model"]
    md = []
    fp32slow, fp32_100 = get(one, FP32, slowest), get(one, FP32, 100)
    gp = {b: get(one, "fp32 gpipe", b) for b in (slowest, 100)}
    fixed = {b: get(one, "fp32 1f1b", b) for b in (slowest, 100)}
    sched = f"- **Schedules.** fp32 at {slowest:g} Mbit/s: adaptive {_ach(fp32slow)}, 1f1b {_ach(fixed[slowest])}, gpipe {_ach(gp[slowest])}."
    if fixed[100] and fp32_100:
        sched += f" fp32 at 100 Mbit/s: adaptive {_ach(fp32_100)}, 1f1b {_ach(fixed[100])}."
    md.append(sched)

    # Noise: the speed probe and how far apart a cell's passes are.
    fast_cells = [c for c in cells if c["bandwidth_mbps"] == 0 or c["bandwidth_mbps"] >= 100]
    spread_fast = stats.spread(fast_cells)
    sf = stats.spreads(fast_cells)
    spread_fast_median = sf[len(sf) // 2] if sf else float("nan")
    spread_slow = stats.spread([c for c in cells if c["bandwidth_mbps"] == slowest and c["achieved_vs_min_schedule_limits"] < 1.5
                                and c["schedule_link_limit_samples_per_s"] < c["compute_limit_samples_per_s"]])
    own_pass = stats.own_pass_ratios(cells)
    probes = [(w, _probe_text(meta[k])) for w, k in (("before the table", "probe_start"), ("after it", "probe_end"))
              if meta.get(k)]
    own = ""
    if own_pass:
        lo_own, hi_own, med_own = min(own_pass), max(own_pass), sorted(own_pass)[len(own_pass) // 2]
        own = (f"With the bandwidths interleaved step by step the passes still differ, but a mode's cells move together: "
               f"pass by pass, its clearly compute-bound shaped cells (1x4, link time under half the compute time) ran at "
               f"{lo_own:.2f}-{hi_own:.2f} of its compute-only cell in the same pass (median {med_own:.2f}).")
    md.append("- **Noise.** The 2 cores are shared with other tenants of the host, and their speed moves from second to second: "
              + ("a fixed single-thread loop (`speed_probe` in scripts/bench_slownet.sh, 15 runs of the same work) took "
                 + "; ".join(f"{t} of CPU {w}" for w, t in probes) + ". " if probes else "")
              + f"Compute-bound cells (unshaped, >= 100 Mbit/s) have passes up to {100 * spread_fast:.0f}% apart (median "
              f"{100 * spread_fast_median:.0f}%; last column), link-bound ones ({slowest:g} Mbit/s) up to {100 * spread_slow:.0f}%. "
              "Each cell's median over all its timed steps of all passes puts both kinds of cell under the same, typical, "
              "machine. CPU ms/sample moves with the noise too (a slowed core takes more CPU time for the same work). " + own)

    a_s, p_s, d_s = get(one, AQ, slowest), get(one, FP32, slowest), get(one, DQ, slowest)
    if a_s and p_s:
        lim_ratio = a_s["schedule_link_limit_samples_per_s"] / p_s["schedule_link_limit_samples_per_s"]
        wire_ratio = a_s["link_limit_samples_per_s"] / p_s["link_limit_samples_per_s"]

        def eff(c):
            return c["samples_per_s"] / min(c["compute_limit_samples_per_s"], c["schedule_link_limit_samples_per_s"])
        line = (f"- **AQ-SGD vs fp32 at {slowest:g} Mbit/s: {a_s['samples_per_s'] / p_s['samples_per_s']:.2f}x** = the ratio of their "
                f"schedule link limits, {lim_ratio:.2f} (wire limits: {wire_ratio:.2f}, the bytes of the busiest direction: fp32 "
                f"{max(p_s['fw_bytes_per_sample'], p_s['bw_bytes_per_sample']):.0f} B/sample vs AQ-SGD's backward "
                f"{a_s['bw_bytes_per_sample']:.0f}), times the ratio of how close each gets to min(compute, schedule limit): "
                f"AQ-SGD {eff(a_s):.2f}, fp32 {eff(p_s):.2f}. So 5x needs both link-bound with AQ-SGD within "
                f"{100 * (1 - 5 / lim_ratio):.0f}% of fp32's efficiency: AQ-SGD's CPU limit there is "
                f"{a_s.get('cpu_limit_samples_per_s') or float('nan'):.0f} samples/s ({cpu(a_s) or float('nan'):.2f} CPU ms/sample) against "
                f"its schedule link limit {a_s['schedule_link_limit_samples_per_s']:.0f}")
        if gp[slowest]:
            line += f"; against fp32 under GPipe it is {a_s['samples_per_s'] / gp[slowest]['samples_per_s']:.2f}x"
        md.append(line + ". The paper's fp32 row (0.5 of 3.8 seq/s at 100 Mbit/s, 0.13) is below even a non-overlapping "
                  "schedule's link limit for its bytes (~0.25: 2 x 199 Mbit/s of demand), so it compares with the GPipe column "
                  "rather than the 1F1B one.")
    if a_s and d_s:
        gaps = []
        for b in stats.by_bandwidth_desc({c["bandwidth_mbps"] for c in one}):
            a, d = get(one, AQ, b), get(one, DQ, b)
            if a and d:
                pairs = stats.pass_ratios(a, d)
                gaps.append(f"{bwname(b)} {100 * (a['samples_per_s'] / d['samples_per_s'] - 1):+.0f}% "
                            f"(CPU {100 * ((cpu(a) or 0) / (cpu(d) or 1) - 1):+.0f}%"
                            + (f"; passes {' / '.join(f'{100 * (x - 1):+.0f}%' for x in pairs)}" if len(pairs) > 1 else "") + ")")
        md.append(f"- **AQ-SGD vs DirectQ.** Same bytes per sample (fw {a_s['fw_bytes_per_sample']:.0f} vs {d_s['fw_bytes_per_sample']:.0f}, "
                  f"bw {a_s['bw_bytes_per_sample']:.0f} vs {d_s['bw_bytes_per_sample']:.0f}). samples/s of AQ-SGD vs DirectQ, and "
                  f"(in brackets) AQ-SGD's extra CPU per sample and the pass-by-pass ratios (the two run back to back in a pass): "
                  f"{'; '.join(gaps)}. AQ-SGD's extra CPU is its per-sample state: delta coding and a checksum of each "
                  "updated m(xi) row at both ends of every link, and (the table's epochs fit in memory: each link end keeps "
                  "its rows resident, LinkEndpointOptions::resident_bytes) a store read per row at first use and a write "
                  "per row at the end; epochs too large for that read and write every row through RocksDB every "
                  "micro-batch. On a GPU machine it "
                  "runs beside the model, here it runs on the same 2 cores, so wherever a cell is CPU-bound (unshaped and fast "
                  "links) AQ-SGD can only be as far behind DirectQ as its extra CPU and the load noise put it; at the slowest "
                  "link both are link-bound.")
        md += links_alone(meta, one)
    md += paired_notes(run)
    md += misses(run, K, M)
    sh = [(c, get(one, c["label"], 0)) for c in one if c["bandwidth_mbps"] == slowest]
    sh = [(c, u) for c, u in sh if u and cpu(c) and cpu(u)]
    xover = [c["achieved_vs_min_schedule_limits"] for c in one if c["bandwidth_mbps"] == slowest and c["mode"] != "fp32"]
    if sh and xover:
        md.append("- **CPU at the slowest link.** The same work costs more CPU per sample on a shaped link than unshaped ("
                  + ", ".join(f"{c['label']} {cpu(c):.2f} vs {cpu(u):.2f} ms" for c, u in sh)
                  + "): the same work in more, shorter pieces (why: `docs/notebook/slownet.md`). Near the crossover "
                  f"({slowest:g} Mbit/s for the compressed modes) compute and link time then partly add up "
                  f"(achieved {min(xover):.2f}-{max(xover):.2f} of min(compute, schedule link limit) there).")
    md += delayed_note(run)
    return md


def links_alone(meta, one):
    lk = {l["store"]: l for l in meta.get("link_bench") or []}
    a0, d0 = get(one, AQ, 0), get(one, DQ, 0)
    if not ("-" in lk and "rocksdb" in lk and cpu(a0) and cpu(d0)):
        return []
    links = a0.get("stages", 4) - 1
    extra_ms = cpu(a0) - cpu(d0)
    per = lk["rocksdb"]["extra_cpu_us_per_sample_vs_directq"]
    mem = (f"; with an in-memory store instead of RocksDB +{lk['memory']['extra_cpu_us_per_sample_vs_directq']:.1f}"
           if "memory" in lk else "")
    if "rocksdb_prefetch" in lk:
        mem += (f"; with every row loaded ahead by the prefetcher's loader threads "
                f"+{lk['rocksdb_prefetch']['extra_cpu_us_per_sample_vs_directq']:.1f}")
    if "resident" in lk:
        mem += (f"; with the rows resident in the endpoints, as the stages of this table keep them, "
                f"+{lk['resident']['extra_cpu_us_per_sample_vs_directq']:.1f}")
    return [f"- **The links alone** (`aqswarm bench link`, right after the table: one link's sender and receiver, "
            f"no model, no transport, {lk['rocksdb']['rows']}x{lk['rocksdb']['cols']} fp16 rows): DirectQ costs "
            f"{lk['-']['cpu_us_per_sample']:.1f} CPU us per sample, AQ-SGD "
            f"{lk['rocksdb']['cpu_us_per_sample']:.1f} (+{per:.1f}: "
            f"streamed: RocksDB get + put on the endpoint's own thread every micro-batch, fp16 rounding, delta coding{mem}). "
            f"Times {links} links that is +{links * per / 1000:.3f} "
            f"ms per sample, against {extra_ms:+.3f} ms measured between the unshaped pipelines"
            + (": in a pipeline the same work costs more (its threads wake among 4 busy processes on 2 cores, and "
               "the model's working set evicts the rows from the caches)."
               if extra_ms > links * per / 1000 else
               ", a difference the noise of two short cells hides (see the paired cells below).")]


def paired_notes(run):
    paired, repeats, meta = run.paired, run.repeats, run.meta
    if not paired:
        return []
    md = []
    a0 = next(iter(paired.values()))[0]

    def pair_text(b, a, d):
        pr = stats.pass_ratios(a, d)
        lo, hi = stats.boot_interval(pr)
        return (f"{bwname(b)}: {d['samples_per_s']:.0f} vs {a['samples_per_s']:.0f}, "
                f"**{100 * (a['samples_per_s'] / d['samples_per_s'] - 1):+.1f}%** (geometric mean of the pass-by-pass ratios "
                f"{100 * (stats.geo_mean(pr) - 1):+.1f}%, 95% interval {100 * (lo - 1):+.1f}..{100 * (hi - 1):+.1f}%; CPU per sample "
                f"{100 * ((cpu(a) or 0) / (cpu(d) or 1) - 1):+.0f}%)")
    ach = "; ".join(f"{bwname(b)} {a['achieved_vs_min_limits']:.2f} / {d['achieved_vs_min_limits']:.2f}"
                    for b, (a, d) in paired.items() if b > 0)
    md.append(f"- **AQ-SGD vs DirectQ in paired cells** (`{meta.get('paired_command', '?')}`, right after the table: "
              + ("in every pass the two run back to back, in turns, each one pipeline run with the bandwidths interleaved "
                 "step by step as in the table"
                 if a0.get("interleaved_bandwidths", 1) > 1 else
                 "at each bandwidth the two run back to back, in turns, and every other pass runs the bandwidths in reverse")
              + "; both are CPU-bound at all of them). samples/s of DirectQ vs AQ-SGD (pooled medians, as in the table) and AQ-SGD's difference: "
              + "; ".join(pair_text(b, a, d) for b, (a, d) in paired.items())
              + (f". Achieved / min(compute, wire limit) of the shaped ones against the paired run's own unshaped cells, "
                 f"AQ-SGD / DirectQ: {ach}." if ach else "."))
    apart = []
    if repeats:
        runs = [(1, paired)] + list(repeats)

        def run_text(k, cells_k):
            parts = []
            for b, (a, d) in cells_k.items():
                lo, hi = stats.boot_interval(stats.pass_ratios(a, d))
                parts.append(f"{bwname(b)} {100 * (a['samples_per_s'] / d['samples_per_s'] - 1):+.1f}% "
                             f"(interval {100 * (lo - 1):+.1f}..{100 * (hi - 1):+.1f}%, CPU per sample "
                             f"{100 * ((cpu(a) or 0) / (cpu(d) or 1) - 1):+.0f}%)")
            return f"run {k}: " + "; ".join(parts)
        u = [(k, c[0]) for k, c in runs if 0 in c]
        apart = [bwname(b) for b in stats.runs_disagree([c for _, c in runs])]

        def swing(xs):
            return max(xs) / min(xs) - 1 if xs and min(xs) > 0 else 0.0
        sw_a, sw_d = swing([cpu(c[0]) for _, c in u if cpu(c[0])]), swing([cpu(c[1]) for _, c in u if cpu(c[1])])
        moves = (f"it is AQ-SGD's CPU per sample that moves from run to run (unshaped, lowest to highest run: +{100 * sw_a:.0f}%) "
                 f"while DirectQ's stays put (+{100 * sw_d:.0f}%; presumably AQ-SGD's per-sample state, rows read and written "
                 "in memory that the model and the host's other tenants share, is the part of this machine's noise one mode "
                 "feels and the other does not)" if sw_a > 2 * sw_d else
                 f"CPU per sample moves from run to run in both modes (unshaped, lowest to highest run: DirectQ "
                 f"+{100 * sw_d:.0f}%, AQ-SGD +{100 * sw_a:.0f}%): the machine's phases, which one run's passes do not "
                 "average out")
        verdict_ = (". The runs disagree by more than their own intervals allow (at " + ", ".join(apart) + "), and "
                    + moves + ", so a single paired run's verdict on the 5% target is not a measurement of it"
                    + ("; the estimate pooled over the runs (targets above) is." if len(runs) > 2 else ".") if apart else
                    ". The runs' intervals overlap at every bandwidth.")
        info = [(k,) + run.repeat_info(k) for k, _ in repeats]
        md.append(f"- **The paired run, repeated** ({'; '.join(f'run {k}: `{c}`' + (f' ({w})' if w else '') for k, c, w in info)}: the "
                  "same command again later, same build unless noted): AQ-SGD's difference from DirectQ, its 95% interval and its extra "
                  "CPU per sample, " + " | ".join(run_text(k, c) for k, c in runs) + "."
                  + (" Unshaped CPU ms per sample, DirectQ / AQ-SGD, run by run: "
                     + ", ".join(f"{cpu(c[1]):.2f} / {cpu(c[0]):.2f}" for _, c in u)
                     + verdict_ if len(u) > 1 else ""))
    fails = meta.get("paired_failures") or []
    if fails:
        md.append("- **Paired tries that failed** (each was run once more into its own directory; the cells above are "
                  "from the tries that finished, and a run that failed twice stopped the bench and is not in them): "
                  + "; ".join("`" + x.replace("`", "'") + "`" for x in fails) + ".")
    la, ld = paired.get(0, (None, None))
    if la and ld:
        rel = {b: a["samples_per_s"] / d["samples_per_s"] - 1 for b, (a, d) in paired.items()}

        def by(c):
            return " / ".join(f"{x:.2f}" for x in c.get("cpu_ms_per_sample_by_stage") or [])
        first = "first " if repeats else ""
        all_in = all(lo <= 1 <= hi for lo, hi in (stats.boot_interval(stats.pass_ratios(a, d)) for a, d in paired.values()))
        md.append(f"- **AQ-SGD's extra CPU** (the {first}paired run's unshaped cells): {cpu(la):.2f} vs {cpu(ld):.2f} CPU ms per sample "
                  f"({100 * (cpu(la) / cpu(ld) - 1):+.0f}%; by stage {by(la)} vs {by(ld)})"
                  + (": every link end adds about the same." if cpu(la) > 1.02 * cpu(ld) else ".")
                  + f" This {first}paired run put AQ-SGD "
                  f"{100 * min(rel.values()):+.1f}..{100 * max(rel.values()):+.1f}% from DirectQ across the bandwidths, "
                  f"the unshaped one ({100 * rel[0]:+.1f}%) included, with {cpu(la) - cpu(ld):+.2f} ms of CPU per sample "
                  "between the unshaped pipelines: whatever gap remains is CPU work on the 2 cores the model runs on, not "
                  "waiting on links"
                  + (", and the 95% intervals of the pass-by-pass ratios above include no difference at every bandwidth."
                     if all_in else ".")
                  + (f" The {'repeats' if len(repeats) > 1 else 'repeat'} (above) " + ("did not agree." if apart else "agreed.")
                     if repeats else "")
                  + " Where that CPU goes (perf profiles, store and resident-row A/Bs): `docs/notebook/slownet.md`.")
    return md


def misses(run, K, M):
    cells = run.cells
    m = cells[0]["model"]

    def own0(c):
        for x in cells:
            if x["grid"] == c["grid"] and x["label"] == c["label"] and x["bandwidth_mbps"] == 0:
                return x
        return None
    miss = [c for c in cells if c["bandwidth_mbps"] > 0 and c["achieved_vs_min_limits"] < 0.9]
    if not miss:
        return []

    def same_grid(c):
        return [x for x in cells if x["grid"] == c["grid"]]

    def why(c):
        u = own0(c)
        link_bound = c["schedule_link_limit_samples_per_s"] < c["compute_limit_samples_per_s"]
        per_step = m["micro_batch"] * M * c["dp"]  # samples per step, all pipelines
        txt = (f"{c['grid']} {c['label']} @ {c['bandwidth_mbps']:g}: {c['achieved_vs_min_limits']:.2f} of min(compute, wire), "
               f"{c['achieved_vs_min_schedule_limits']:.2f} of min(compute + DP, schedule)")
        if link_bound:
            txt += f", link-bound (CPU limit {c.get('cpu_limit_samples_per_s') or float('nan'):.0f} vs schedule limit {c['schedule_link_limit_samples_per_s']:.0f})"
        elif u and cpu(c) and cpu(u):
            txt += (f", compute-bound: {cpu(c):.2f} CPU ms/sample vs {cpu(u):.2f} unshaped, passes "
                    f"{' / '.join(f'{x:.0f}' for x in c['samples_per_s_passes'])} vs the compute-only cell's "
                    f"{' / '.join(f'{x:.0f}' for x in u['samples_per_s_passes'])}")
        # The flush per step: the step's first activations cross K - 1 links
        # before the last stage has work, its last gradients cross them back
        # before stage 0 can finish: link time the compute-only cell did not
        # pay. An estimate, not a bound (the fill can overlap upstream forwards).
        if not link_bound:
            flush_s = (K - 1) * (c["fw_bytes_per_sample"] + c["bw_bytes_per_sample"]) * m["micro_batch"] * 8 / (c["bandwidth_mbps"] * 1e6)
            cdp = c["compute_dp_limit_samples_per_s"]
            est = per_step / (per_step / cdp + flush_s)
            txt += (f"; the flush's link time ({K - 1} links down for the first micro-batch, {K - 1} up for the last: "
                    f"{1e3 * flush_s:.0f} ms, {flush_s / c['step_seconds']:.0%} of its step) adds to compute-only"
                    + (" and the DP exchange below" if cdp < c["compute_limit_samples_per_s"] else "")
                    + f": {est:.0f} samples/s, of which it reached {c['samples_per_s'] / est:.2f} (an estimate, not a "
                    "bound: the fill can overlap upstream forwards)")
        if c.get("dp_delayed_update"):
            txt += "; delayed DP updates: its exchange runs behind the next step's compute"
        elif c["dp"] > 1 and c["dp_bytes_per_step"] > 0 and not link_bound:
            # The DP exchange starts after the step's flush (it needs the global
            # norm) and the next step's first forward needs stage 0's result.
            dp0 = c["dp_stage0_bytes_per_step"]
            dp_s = dp0 * 8 / (c["bandwidth_mbps"] * 1e6)
            serial = c["compute_dp_limit_samples_per_s"]
            txt += (f"; stage 0's DP exchange ({dp0 / 1e3:.0f} kB, {1e3 * dp_s:.0f} ms "
                    f"at {c['bandwidth_mbps']:g} Mbit/s, {dp_s / c['step_seconds']:.0%} of its step) runs after the step's last backward, so compute-only "
                    f"plus that exchange (the compute + DP limit) allows {serial:.0f} samples/s ({c['samples_per_s'] / serial:.2f} of it)")
            # The CPU limit plus the part of stage 0's exchange during which no
            # stage has any work: 1/(D-1) of what a replica sends derives from
            # the last replica's final gradient (docs/METHODOLOGY.md).
            cpu_lim = c.get("cpu_limit_samples_per_s")
            if cpu_lim:
                tail = dp_s / (c["dp"] - 1)
                ceiling = per_step / (per_step / cpu_lim + tail)
                frac = ceiling / c["compute_limit_samples_per_s"]
                txt += (f"; at the CPU it spends per sample (CPU limit {cpu_lim:.0f}) no schedule gets past "
                        f"{ceiling:.0f} samples/s on average = {frac:.2f} of the compute-only limit (the last "
                        f"replica to finish must still send {1e3 * tail:.0f} ms of it, all computed from its final "
                        f"gradient, before any stage has work other than the exchange's and the optimizer step's own)"
                        + (" -- below 0.9: at this CPU cost the target is out of reach in this cell with a "
                           "synchronous DP exchange" if frac < 0.9 else "")
                        + f"; it reached {c['samples_per_s'] / ceiling:.2f} of that")
            twin = get(same_grid(c), c["label"] + " +dpu", c["bandwidth_mbps"])
            if twin:
                txt += (f"; with delayed DP updates (+dpu, next note) the same mode reached "
                        f"{twin['achieved_vs_min_limits']:.2f} of its min(compute, wire)")
        return txt
    return [f"- **Cells below 0.9 x min(compute, wire)** ({len(miss)}): " + "; ".join(why(c) for c in miss) + ". "
            "A compute-bound cell that does about the same CPU work per sample as its compute-only cell but runs slower "
            "lost the difference to the other jobs on the 2 cores (its compute-only cell had a quieter slot; with the "
            "bandwidths interleaved step by step that is rare, and a cell near its crossover, e.g. fp32 at 100 Mbit/s "
            "with the wire at ~80% of the compute time, loses to compute and transfers partly adding up instead: "
            "mostly the flush's link time, during which the cores wait for the first activations or the last "
            "gradients); a "
            "link-bound one at 0.9-0.95 of its schedule limit lost it to the flush per step (the wire limit ignores it) "
            "and to compute and transfers adding up where the CPU limit is not far above the link limit."]


def delayed_note(run):
    cells = run.cells

    def same_grid(c):
        return [x for x in cells if x["grid"] == c["grid"]]
    dpu = [(c, get(same_grid(c), c["label"].replace(" +dpu", ""), c["bandwidth_mbps"]))
           for c in cells if c.get("dp_delayed_update")]
    dpu = [(c, t) for c, t in dpu if t]
    if not dpu:
        return []
    waits = run.meta.get("dp_wait") or {}
    parts = []
    for c, t in dpu:
        a, b = waits.get(stats.cell_key(t)), waits.get(stats.cell_key(c))
        if a and b:
            parts.append(f"{t['label']} @ {bwname(c['bandwidth_mbps'])}: {1e3 * a[0]:.1f} -> {1e3 * b[0]:.1f} ms ({b[1]} step lines, both pipelines)")
    wait_note = ("" if not parts else
                 " Stage 0's wait on the DP step per step (its step events' `dp.seconds`, the last pass's timed steps but "
                 "the run's final one; with +dpu that is the wait for the previous step's update, the checkpoint step's "
                 "join and nothing else), synchronous -> +dpu: " + "; ".join(parts) + ".")
    return ["- **Delayed DP updates (+dpu, the job's `dp.delayedUpdate`).** Step t's DP exchange and optimizer step run "
            "on a background thread while step t+1 computes on the parameters from before them; the model takes the "
            "result at the end of step t+1. This removes the synchronous cells' bound above (no stage waits for the "
            "exchange) at the price of one step of staleness (what that costs in loss: docs/CONVERGENCE.md); the "
            "table's target rows keep them out. Each +dpu cell against the synchronous cell of the same "
            "mode, same run (achieved / min(compute, wire), then samples/s +dpu / synchronous): "
            + "; ".join(f"{c['grid']} {t['label']} @ {bwname(c['bandwidth_mbps'])}: "
                        f"{t['achieved_vs_min_limits']:.2f} -> {c['achieved_vs_min_limits']:.2f}, "
                        f"{c['samples_per_s'] / t['samples_per_s']:.2f}x"
                        for c, t in dpu)
            + ". Each cell's compute-only limit is its own mode's unshaped cell, so the +dpu and synchronous ratios "
            "are each against their own unshaped run." + wait_note]


def parse_netns(text):
    """deploy/netns/run_tc.sh's summary -> {(mode, Mbit/s, cc): columns}."""
    rows = {}
    for line in text.splitlines()[1:]:
        fs = line.split()
        if len(fs) == 10:
            rows[(fs[0], fs[1], fs[2])] = {"tc": float(fs[3]), "user": float(fs[4]), "ratio": float(fs[5]),
                                           "by_pass": fs[6].replace(",", ", "), "tc_cpu": float(fs[7]),
                                           "user_cpu": float(fs[8]), "wire": float(fs[9])}
    return rows


def netns_section(run):
    if not run.netns:
        return []
    text = run.netns
    rows = parse_netns(text)
    passes = max((len(x["by_pass"].split(", ")) for x in rows.values()), default=1)
    ccs_run = " ".join(dict.fromkeys(k[2] for k in rows))
    md = ["", "## Kernel shaping (`deploy/netns/run_tc.sh`: namespaces + veth + `tc tbf`) vs user-space shaping", "",
          f"Command: `sudo TCP_CCS=\"{ccs_run}\" PASSES={passes} deploy/netns/run_tc.sh` (what "
          f"`sudo RUN_NETNS=1 scripts/bench_slownet.sh` runs after the table); finished {run.meta.get('netns_finished', '?')}.", "",
          f"Same job, stage 0's step_seconds over the same window; {passes} pass(es), each running every cell once "
          "(the user-space job, then the tc job under each TCP congestion control, `tcp cc`: the namespaces' "
          "`net.ipv4.tcp_congestion_control`); samples/s at the median step time of all passes' timed steps, and "
          "`tc/user by pass` the same ratio pass by pass. `tc CPU/st`, "
          "`user CPU/st`: CPU seconds per step of all 4 stages (their processes' own time, which includes the kernel's "
          "TCP/IP work done in their context); `wire/app`: bytes link 0's forward qdisc sent per byte the application "
          "sent (TCP/IP and Ethernet headers, the ACKs of the other direction's data, retransmissions).", "",
          "```", text.rstrip(), "```", ""]

    def r(mode, bw, cc):
        return rows.get((mode, bw, cc))
    ccs = sorted({k[2] for k in rows})
    c10, b10 = r("fp32", "10", "cubic"), r("fp32", "10", "bbr")
    if c10 and b10:
        md.append(f"- **fp32 at 10 Mbit/s: TCP congestion control.** Both shapings are link-bound here. Under CUBIC "
                  f"the kernel-shaped runs get {c10['ratio']:.2f} of the user-space ones (pass by pass {c10['by_pass']}), and headers and ACKs take "
                  f"{(c10['wire'] - 1) * 100:.1f}% of the wire (wire/app {c10['wire']:.3f}): {c10['ratio'] * c10['wire']:.2f} "
                  f"of the user-space wire's rate in wire bytes, so the user-space wire models a CUBIC link well. Under "
                  f"BBR they get {b10['ratio']:.2f} (pass by pass {b10['by_pass']}) with the same overhead "
                  f"({b10['ratio'] * b10['wire']:.2f} in wire bytes): BBR paces at its own estimate of the bottleneck "
                  "rate, which wanders on a token-bucket link (`docs/notebook/slownet.md`). A user on a shaped slow link who "
                  "ships fp32 activations loses that much to BBR; AQ-SGD's links carry ~5-10x fewer bytes and come out the "
                  "same under both (" + ", ".join(f"{cc} {r('aqsgd:3:6', '10', cc)['ratio']:.2f}" for cc in ccs
                                                   if r('aqsgd:3:6', '10', cc)) + " at 10 Mbit/s).")
    ratios10 = [(cc, r("aqsgd:3:6", "10", cc)["tc"] / r("fp32", "10", cc)["tc"]) for cc in ccs
                if r("aqsgd:3:6", "10", cc) and r("fp32", "10", cc)]
    if ratios10:
        u = r("aqsgd:3:6", "10", ratios10[0][0])["user"] / r("fp32", "10", ratios10[0][0])["user"]
        md.append("- **The 10 Mbit/s target under kernel shaping.** AQ-SGD fw3bw6 over fp32 samples/s in this check: " +
                  ", ".join(f"{cc} {x:.2f}x" for cc, x in ratios10) + f" (user space, same runs: {u:.2f}x).")
    c100 = [(mode, cc, r(mode, "100", cc)) for mode in ("fp32", "aqsgd:3:6") for cc in ccs if r(mode, "100", cc)]
    if c100:
        costly = [f"{mode} {cc}" for mode, cc, x in c100 if x["tc_cpu"] > 1.1 * x["user_cpu"]]
        md.append("- **100 Mbit/s: CPU.** Both modes are CPU-bound here under both shapings, on the 2 cores the model "
                  "runs on. tc/user and, in brackets, tc CPU/st over user CPU/st: " +
                  "; ".join(f"{mode} {cc} {x['ratio']:.2f} ({x['tc_cpu'] / x['user_cpu']:.2f})" for mode, cc, x in c100) +
                  ". tc/user follows the CPU ratio: where the real TCP/IP path over veth (1500-byte MTU; fp32 moves "
                  "25 MB per step across the 3 links) costs the stages more CPU than loopback with 64 KiB segments, the "
                  "kernel-shaped run is slower by about as much. So the user-space figures at 100 Mbit/s are an upper "
                  "bound for real TCP links on a CPU-starved machine where that CPU ratio is above 1.1 here (" +
                  (", ".join(costly) if costly else "none") + ").")
    return md


def netns_summary_line(run):
    """One line for BENCHMARKS.md: AQ-SGD / fp32 at 10 Mbit/s under tc, per congestion control."""
    if not run.netns:
        return None
    rows = parse_netns(run.netns)
    ccs = sorted({k[2] for k in rows})
    got = [(cc, rows[("aqsgd:3:6", "10", cc)]["tc"] / rows[("fp32", "10", cc)]["tc"]) for cc in ccs
           if ("aqsgd:3:6", "10", cc) in rows and ("fp32", "10", cc) in rows]
    if not got:
        return None
    return ", ".join(f"{cc} {x:.2f}x" for cc, x in got)


def targets_text(run):
    """The targets as plain text lines (what the script prints)."""
    return "\n".join(f"{t['text']}: {t['value']} ({'-' if t['ok'] is None else 'met' if t['ok'] else 'NOT met'})"
                     for t in stats.targets(run.cells, run.paired, run.repeats))


def section_from(text, name):
    m = re.search(rf"<!-- {name}:begin -->\n(.*?)<!-- {name}:end -->", text, re.S)
    return m.group(1) if m else None
