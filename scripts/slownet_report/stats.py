"""The slow-network table's statistics: pure functions over bench cells.

A cell is one JSON line of `aqswarm bench slownet --json` (a dict: grid,
label, mode, schedule, bandwidth_mbps, samples_per_s, samples_per_s_passes,
the limits, bytes per sample, cpu_ms_per_sample, ...). Nothing here reads
files or formats markdown; docs/METHODOLOGY.md says what each figure means.
"""
import math
import random

# Where "unshaped" (bandwidth 0) sorts among the bandwidths: above them all.
UNSHAPED_X = 10000
# The issue's cells run the default schedule; other schedules are comparison columns.
DEFAULT_SCHEDULE = "adaptive"
AQ, DQ, FP32 = "aqsgd fw3bw6", "directq fw3bw6", "fp32"


def bwname(b):
    return "unshaped" if b == 0 else f"{b:g}"


def by_bandwidth_desc(bws):
    """Bandwidths from unshaped down to the slowest."""
    return sorted(bws, key=lambda b: -(b or UNSHAPED_X))


def get(cells, label, b):
    """The cell of `label` at bandwidth `b` (first match), or None."""
    for c in cells:
        if c["label"] == label and c["bandwidth_mbps"] == b:
            return c
    return None


def cpu(c):
    return c.get("cpu_ms_per_sample") if c else None


def pass_ratios(a, b):
    """Pass-by-pass ratios of two cells' samples/s (pass i of each ran in the same pass)."""
    return [x / y for x, y in zip(a.get("samples_per_s_passes") or [], b.get("samples_per_s_passes") or [])]


def geo_mean(v):
    return math.exp(sum(math.log(x) for x in v) / len(v)) if v else float("nan")


def boot_interval(ratios, n=4000):
    """95% interval of the geometric mean of `ratios`: bootstrap over them,
    seeded so that a redraw gives the same numbers."""
    if len(ratios) < 2:
        return (float("nan"), float("nan"))
    rng = random.Random(1)
    means = sorted(geo_mean([rng.choice(ratios) for _ in ratios]) for _ in range(n))
    return means[int(0.025 * n)], means[int(0.975 * n) - 1]


def pooled_interval(per_run, n=4000):
    """Geometric mean of every pass-by-pass ratio of every run, and its 95%
    interval resampling runs, then passes within each (the runs differ by more
    than their passes do). per_run: one list of ratios per run, >= 2 runs.
    Returns (mean, lo, hi) as ratios."""
    rng = random.Random(1)
    means = sorted(geo_mean([rng.choice(pr) for pr in [rng.choice(per_run) for _ in per_run] for _ in pr])
                   for _ in range(n))
    return geo_mean([x for pr in per_run for x in pr]), means[int(0.025 * n)], means[int(0.975 * n) - 1]


def paired_by_bandwidth(cells):
    """Paired-run cells -> {bandwidth: (AQ-SGD cell, DirectQ cell)}, unshaped first."""
    pc = {(c["label"], c["bandwidth_mbps"]): c for c in cells}
    got = {}
    for b in by_bandwidth_desc({b for _, b in pc}):
        if (AQ, b) in pc and (DQ, b) in pc:
            got[b] = (pc[(AQ, b)], pc[(DQ, b)])
    return got


def pooled_paired(runs):
    """runs: [{bandwidth: (AQ-SGD, DirectQ)}, ...] (the first run's bandwidths
    count). -> {bandwidth: (mean - 1, lo - 1, hi - 1, runs)} where >= 2 runs
    have pass-by-pass ratios."""
    pooled = {}
    for b in runs[0] if runs else {}:
        per_run = []
        for cells_k in runs:
            if b not in cells_k:
                continue
            a, d = cells_k[b]
            pa, pd = a.get("samples_per_s_passes") or [], d.get("samples_per_s_passes") or []
            if pa and len(pa) == len(pd):
                per_run.append([x / y for x, y in zip(pa, pd)])
        if len(per_run) < 2:
            continue
        g, lo, hi = pooled_interval(per_run)
        pooled[b] = (g - 1, lo - 1, hi - 1, len(per_run))
    return pooled


def runs_disagree(runs):
    """Bandwidths where the paired runs' pass-by-pass intervals do not overlap."""
    apart = []
    for b in runs[0] if runs else {}:
        iv = [boot_interval(pass_ratios(*c[b])) for c in runs if b in c]
        if max(lo for lo, _ in iv) > min(hi for _, hi in iv):
            apart.append(b)
    return apart


def issue_cells(cells):
    """Shaped cells of the issue's modes: default schedule, synchronous DP."""
    return [c for c in cells if c["bandwidth_mbps"] > 0 and c["schedule"] == DEFAULT_SCHEDULE
            and not c.get("dp_delayed_update")]


def count_at_least(cells, key, bound=0.9):
    return sum(1 for c in cells if c[key] >= bound)


def targets(cells, paired=None, repeats=()):
    """The table's targets. cells: the table's cells; paired: the first paired
    run by bandwidth (paired_by_bandwidth); repeats: the later paired runs, in
    order, as (run number, by bandwidth). Each target is a dict: key, short
    (a name for the headline table), text (the full definition), value (as
    shown) and ok (True/False; None: reported, not a target)."""
    paired = paired or {}
    one = [c for c in cells if c["dp"] == 1]
    out = []

    def add(key, short, text, value, ok):
        out.append({"key": key, "short": short, "text": text, "value": value, "ok": ok})

    bws = sorted({c["bandwidth_mbps"] for c in one if c["bandwidth_mbps"] > 0})
    if bws:
        slow = bws[0]
        a, p = get(one, AQ, slow), get(one, FP32, slow)
        if a and p:
            r = a["samples_per_s"] / p["samples_per_s"]
            add("aq_vs_fp32_slowest", f"AQ-SGD fw3bw6 / fp32 samples/s at {slow:g} Mbit/s (>= 5x)",
                f"At the slowest link ({slow:g} Mbit/s) AQ-SGD fw3bw6 >= 5x fp32 samples/s", f"{r:.2f}x", r >= 5)
    for lab in ("aqsgd fw3bw6", "aqsgd fw4bw8"):
        a, u = get(one, lab, 100), get(one, lab, 0)
        if a and u:
            r = a["samples_per_s"] / u["samples_per_s"]
            add(f"{lab} 100 vs unshaped", f"{lab} at 100 Mbit/s / its unshaped (>= 85%)",
                f"{lab} at 100 Mbit/s >= 85% of its own unshaped throughput", f"{100*r:.0f}%", r >= 0.85)
    worst = behind = None  # largest |AQ-SGD / DirectQ - 1|; most negative
    for b in by_bandwidth_desc({c["bandwidth_mbps"] for c in one}):
        a, d = get(one, AQ, b), get(one, DQ, b)
        if a and d:
            r = a["samples_per_s"] / d["samples_per_s"] - 1
            if worst is None or abs(r) > abs(worst[1]):
                worst = (b, r)
            if behind is None or r < behind[1]:
                behind = (b, r)
    if worst:
        # AQ-SGD ahead of DirectQ (it does strictly more work) is noise of the
        # same size: the verdict stays two-sided; how far it fell behind is shown too.
        add("aq_vs_dq_table", "AQ-SGD / DirectQ fw3bw6, table cells (within 5%)",
            "AQ-SGD fw3bw6 within 5% of DirectQ fw3bw6 at every bandwidth",
            f"worst {100*worst[1]:+.0f}% at {bwname(worst[0])}"
            + (f" (furthest behind: {100*behind[1]:+.0f}% at {bwname(behind[0])})" if behind[1] < 0 and behind != worst else ""),
            abs(worst[1]) <= 0.05)
    if paired:
        rel = {b: a["samples_per_s"] / d["samples_per_s"] - 1 for b, (a, d) in paired.items()}
        pw = max(rel, key=lambda b: abs(rel[b]))
        pb = min(rel, key=lambda b: rel[b])
        a0 = next(iter(paired.values()))[0]
        np_ = len(a0.get("samples_per_s_passes") or [1])
        add("aq_vs_dq_paired", "AQ-SGD / DirectQ fw3bw6, first paired run (within 5%)",
            f"(the same in paired cells: {np_} passes of {a0['steps_timed'] // np_} timed steps, the two back to back "
            f"at {', '.join(bwname(b) for b in paired)} Mbit/s) AQ-SGD fw3bw6 vs DirectQ fw3bw6",
            f"worst {100 * rel[pw]:+.1f}% at {bwname(pw)}"
            + (f" (furthest behind: {100 * rel[pb]:+.1f}% at {bwname(pb)})" if rel[pb] < 0 and pb != pw else ""),
            abs(rel[pw]) <= 0.05)
        if repeats:
            allrel = [(k, b, a["samples_per_s"] / d["samples_per_s"] - 1)
                      for k, cells_k in [(1, paired)] + list(repeats)
                      for b, (a, d) in cells_k.items()]
            wk, wb, wr = max(allrel, key=lambda x: abs(x[2]))
            add("aq_vs_dq_each_run", f"AQ-SGD / DirectQ fw3bw6, each of {1 + len(repeats)} paired runs (within 5%)",
                f"(the same over all {1 + len(repeats)} paired runs, each as above) AQ-SGD fw3bw6 vs DirectQ fw3bw6",
                f"worst {100 * wr:+.1f}% at {bwname(wb)} (run {wk})", abs(wr) <= 0.05)
            pooled = pooled_paired([paired] + [c for _, c in repeats])
            if pooled:
                pw = min(pooled, key=lambda b: pooled[b][0])
                g, lo, hi, nr = pooled[pw]
                add("aq_vs_dq_pooled", f"AQ-SGD / DirectQ fw3bw6, pooled over {nr} paired runs (within 5%)",
                    f"(the same pooled over the {nr} paired runs: geometric mean of every pass-by-pass ratio, "
                    f"by bandwidth; 95% interval resampling runs, then passes) AQ-SGD fw3bw6 vs DirectQ fw3bw6",
                    f"furthest behind {100 * g:+.1f}% at {bwname(pw)} (interval {100 * lo:+.1f}..{100 * hi:+.1f}%); "
                    + ", ".join(f"{bwname(b)} {100 * pooled[b][0]:+.1f}%" for b in pooled),
                    all(abs(v[0]) <= 0.05 for v in pooled.values()))
    shaped = issue_cells(cells)
    compared = [c for c in cells if c["bandwidth_mbps"] > 0 and c["schedule"] != DEFAULT_SCHEDULE]
    delayed = [c for c in cells if c["bandwidth_mbps"] > 0 and c.get("dp_delayed_update")]
    if shaped:
        ok_w = count_at_least(shaped, "achieved_vs_min_limits")
        ok_g = count_at_least(shaped, "achieved_vs_min_schedule_limits")
        add("limits", "achieved >= 0.9 x min(compute, wire), shaped cells of the issue's modes",
            "achieved >= 0.9 x min(compute, wire limit), shaped cells of the issue's modes",
            f"{ok_w}/{len(shaped)}", ok_w == len(shaped))
        add("schedule_limits", "achieved >= 0.9 x min(compute + DP, schedule link limit), same cells",
            "achieved >= 0.9 x min(compute + synchronous DP exchange, schedule link limit): the limits of "
            "what the schedule serialises (the flush, the DP exchange after it), same cells",
            f"{ok_g}/{len(shaped)}", ok_g == len(shaped))
    # The paired run's shaped cells (their compute-only limit is the paired
    # run's own unshaped cell of the mode).
    pshaped = [c for b, ad in paired.items() if b > 0 for c in ad]
    if pshaped:
        ok_p = count_at_least(pshaped, "achieved_vs_min_limits")
        lo = min(pshaped, key=lambda c: c["achieved_vs_min_limits"])
        add("paired_limits", "achieved >= 0.9 x min(compute, wire), shaped paired cells",
            f"(the same in the paired cells: AQ-SGD and DirectQ fw3bw6 at {', '.join(bwname(b) for b in paired if b > 0)} "
            "Mbit/s) achieved >= 0.9 x min(compute, wire limit)",
            f"{ok_p}/{len(pshaped)} (lowest {lo['achieved_vs_min_limits']:.2f}: {lo['label']} at {bwname(lo['bandwidth_mbps'])})",
            ok_p == len(pshaped))
    if delayed:
        ok_w = count_at_least(delayed, "achieved_vs_min_limits")
        lo = min(delayed, key=lambda c: c["achieved_vs_min_limits"])
        add("delayed_limits", "(not a target: delayed DP updates) achieved >= 0.9 x min(compute, wire)",
            f"(opt-in delayed DP updates, not the issue's synchronous cells: {', '.join(sorted({c['label'] for c in delayed}))}) "
            "achieved >= 0.9 x min(compute, wire limit)",
            f"{ok_w}/{len(delayed)} (lowest {lo['achieved_vs_min_limits']:.2f}: {lo['label']} at {bwname(lo['bandwidth_mbps'])})",
            None)
    if compared:
        ok_w = count_at_least(compared, "achieved_vs_min_limits")
        ok_g = count_at_least(compared, "achieved_vs_min_schedule_limits")
        names = ", ".join(sorted({c["label"] for c in compared}))
        add("compared_limits", f"(not a target: {names}) the same two limits",
            f"(comparison columns, not a target: {names}) achieved >= 0.9 x min(compute, wire limit) / "
            "min(compute + DP, schedule link limit)", f"{ok_w}/{len(compared)} / {ok_g}/{len(compared)}", None)
    return out


def window(w0, i, k, m):
    """Micro-batches in flight at stage i of k, for W_0 = w0 at stage 0 (at most m)."""
    return min(m, 1 + -(-(w0 - 1) * (k - 1 - i) // (k - 1)))


def flush_bound(tf, tb, m, k):
    """The fraction of the wire limit a link-bound step of m micro-batches over
    k stages can reach when every step ends with a flush."""
    return m * max(tf, tb) / ((m - 1) * max(tf, tb) + (k - 1) * (tf + tb))


def spreads(cells):
    """max/min - 1 of each cell's pass-by-pass samples/s, sorted."""
    return sorted(max(c["samples_per_s_passes"]) / min(c["samples_per_s_passes"]) - 1
                  for c in cells if len(c.get("samples_per_s_passes") or []) > 1)


def spread(cells):
    v = spreads(cells)
    return max(v) if v else float("nan")


def own_pass_ratios(cells):
    """Pass by pass, each clearly compute-bound shaped 1x4 cell (schedule link
    limit >= 2x its compute-only limit) against its own compute-only cell."""
    out = []
    for c in cells:
        if c["grid"] != "1x4" or not (c["bandwidth_mbps"] > 0):
            continue
        if not (c["schedule_link_limit_samples_per_s"] >= 2 * c["compute_limit_samples_per_s"]):
            continue
        u = next((x for x in cells if x["grid"] == c["grid"] and x["label"] == c["label"] and x["bandwidth_mbps"] == 0), None)
        if u:
            out += [a / b for a, b in zip(c.get("samples_per_s_passes") or [], u.get("samples_per_s_passes") or [])]
    return out


def dp_wait(events, cell, bandwidths):
    """Stage 0's mean wait on the DP step per step (its step events' dp.seconds)
    at the cell's bandwidth, over the last pass's timed steps but the run's
    final one, and how many step events that is. events: the (kind, dict)
    pairs of the cell's pipeline run (aqswarm_events.read_events);
    bandwidths: how many bandwidths that run interleaves. None if no data."""
    ev = [e for kind, e in events if kind == "step" and e.get("stage") == 0 and "dp" in e]
    if not ev:
        return None
    last = max(e["step"] for e in ev)
    n = cell["steps_timed"] // max(1, len(cell.get("samples_per_s_passes", [1]))) * bandwidths
    w = [e["dp"].get("seconds", 0.0) for e in ev
         if last - n <= e["step"] < last and e.get("bandwidth_mbps", 0) == cell["bandwidth_mbps"]]
    return (sum(w) / len(w), len(w)) if w else None


def cell_key(c):
    """A cell's name in the run metadata (dp_wait)."""
    return f"{c['grid']} {c['label']} @ {bwname(c['bandwidth_mbps'])}"


def probe_summary(v):
    """The speed probe's times (s) -> (min, max, median, slowest over fastest - 1)."""
    v = sorted(v)
    return v[0], v[-1], v[len(v) // 2], v[-1] / v[0] - 1
