#!/usr/bin/env python3
"""Renders docs/data/*.jsonl (written by scripts/bench_docs.sh) into the
compression, store, link, scheduler and allreduce sections of docs/BENCHMARKS.md,
between <!-- NAME:begin --> / <!-- NAME:end --> markers (all of them, or those
named: `render_benchmarks.py link compression`). Other sections of the file
(e.g. slownet) are left alone."""
import json, os, re, sys

root = os.path.join(os.path.dirname(__file__), "..")
data = os.path.join(root, "docs", "data")
doc = os.path.join(root, "docs", "BENCHMARKS.md")


def load(name):
    p = os.path.join(data, name + ".jsonl")
    return [json.loads(l) for l in open(p)] if os.path.exists(p) else []


def meta(name):
    p = os.path.join(data, name + ".meta")
    return open(p).read().strip() if os.path.exists(p) else "(no run recorded)"


def compression():
    rows = load("compression")
    out = ["## Compression codecs (`aqswarm bench compression`)", "",
           f"Command: `build/aqswarm bench compression --json --repeats 5` (64 MiB of float32, activation-like "
           f"per-channel Laplace values, shape [21845, 768], one thread, best of 5). {meta('compression')}", "",
           "GB/s of float32 input; memcpy of the same buffer is measured in the same run, next to each cell. "
           "ratio = input bytes / (scales + payload bytes).", "",
           "| codec | levels | bits | rounding | encode GB/s | decode GB/s | memcpy GB/s | encode % memcpy | decode % memcpy | ratio |",
           "|---|---|---:|---|---:|---:|---:|---:|---:|---:|"]
    for j in rows:
        m = j["memcpy_gbps"]
        out.append(f"| {j['codec']} | {j.get('levels','') or ''} | {j['bits']} | {j['rounding']} | {j['encode_gbps']:.2f} | "
                   f"{j['decode_gbps']:.2f} | {m:.2f} | {100*j['encode_gbps']/m:.0f}% | {100*j['decode_gbps']/m:.0f}% | {j['ratio']:.2f} |")
    fp = {(j['bits'], j['rounding']): j for j in rows if j['codec'] == 'fixed_point'}
    if (4, 'nearest') in fp and (4, 'stochastic') in fp:
        n, s = fp[(4, 'nearest')], fp[(4, 'stochastic')]
        out += ["", f"Targets (issue 2): fixed-point 4-bit nearest encode and decode >= 25% of memcpy: "
                f"**{100*n['encode_gbps']/n['memcpy_gbps']:.0f}% / {100*n['decode_gbps']/n['memcpy_gbps']:.0f}%**; "
                f"stochastic >= 10%: **{100*s['encode_gbps']/s['memcpy_gbps']:.0f}% / {100*s['decode_gbps']/s['memcpy_gbps']:.0f}%**. "
                "Global-QSGD and min-max encoders are scalar loops (not tuned yet)."]
    if (3, 'nearest') in fp:
        t = fp[(3, 'nearest')]
        out += ["", f"3 and 6 bits (AQ-SGD's fw3bw6) pack 8 codes per b bytes with BMI2 PEXT/PDEP: 3-bit nearest decode "
                f"{100*t['decode_gbps']/t['memcpy_gbps']:.0f}% of memcpy here; with the portable shift-and-mask loops "
                "it was 15% (2.1 GB/s against memcpy's 13.7; `bench compression --mib=16 --codecs=fixed_point`, "
                "commit 1e85ddb's parent, 2026-11-21 ~17:30Z, load ~4)."]
    return out


def store():
    rows = load("store")
    out = ["## Message store (`aqswarm bench store`)", "",
           f"Command: `build/aqswarm bench store --json` (fp16 rows; 10,000 samples of 128x768 and 655 of 1024x1600 "
           f"-- the big shape is capped at 2 GiB of rows per workload to fit the run time; `--shapes 1024x1600:N` overrides; "
           f"page cache dropped before each epoch). {meta('store')}", "",
           "`direct`: get+put per micro-batch straight on the store; `prefetch`: through the prefetcher (epoch-permutation "
           "order known in advance); `file_seq`: a plain sequential file read+write of the same bytes (baseline); "
           "`hidden_Nx`: a consumer that spends N x the measured direct I/O time per micro-batch computing (a sleep: the "
           "CPU stays free, as with a GPU) reports the fraction of time blocked on the store.", "",
           "| shape | backend | mode | row bytes | rows/s | MB/s | p99 get us | stall (get / put) |",
           "|---|---|---|---:|---:|---:|---:|---|"]
    for j in rows:
        stall = (f"{100*j['stall_fraction']:.1f}% ({100*j.get('stall_get_fraction',0):.1f}% / "
                 f"{100*j.get('stall_put_fraction',0):.1f}%)") if 'stall_fraction' in j else ""
        p99 = f"{j['p99_get_us']:.0f}" if j.get('p99_get_us') else ""
        out.append(f"| {j['shape']} | {j['backend']} | {j['mode']} | {j.get('row_bytes','')} | {j['rows_per_s']:.0f} | "
                   f"{j.get('mb_per_s',0):.0f} | {p99} | {stall} |")
    hid = [j for j in rows if j['backend'] == 'rocksdb' and j['mode'].startswith('hidden')]
    if hid:
        get_max = max(100 * j.get('stall_get_fraction', 0) for j in hid)
        direct = {j['shape']: j for j in rows if j['mode'] == 'direct'}
        pre = {j['shape']: j for j in rows if j['mode'] == 'prefetch' and j['backend'] == 'memory'}
        mem = {j['shape']: j for j in rows if j['mode'] == 'direct' and j['backend'] == 'memory'}
        met = [j for j in hid if j['stall_fraction'] < 0.02]
        out += ["", "Target (issue 3): stall < 2% when compute >= I/O time. Measured on RocksDB: " +
                ", ".join(f"{j['shape']} {j['mode']} **{100*j['stall_fraction']:.1f}%**" for j in hid) +
                f" ({'met in ' + str(len(met)) + ' of ' + str(len(hid)) if met else 'not met'}). "
                f"The get share of the stall is at most {get_max:.1f}%; the rest is write-behind back-pressure. "
                "The prefetcher path costs more CPU than the direct path it is budgeted against: on the memory "
                "backend it moves " + ", ".join(f"{pre[k]['mb_per_s']:.0f} vs {mem[k]['mb_per_s']:.0f} MB/s ({k})"
                                                for k in pre if k in mem) +
                ", so at 1x compute its own copies and conversions cannot hide. Making the prefetch/write-behind path "
                "cheaper (fewer copies, conversions off the consumer's critical path) is the open work."]
    return out


def scheduler():
    rows = load("scheduler")
    out = ["## Placement scheduler (`aqswarm bench scheduler`)", "",
           f"Command: `build/aqswarm bench scheduler --json` (seed 1; 20 instances per size for N = 8, 3 otherwise). "
           f"{meta('scheduler')}", "",
           "`optimum_ratio` = solver cost / exhaustive optimum (N <= 8); `random_ratio` = solver cost / mean of random "
           "placements (lower is better); world = peers over Oregon / Virginia / Singapore (anchors_mission.md §1.2).", "",
           "| scenario | N | D_PP x D_DP | cost (s) | optimum ratio | random ratio | best-random ratio | solve s |",
           "|---|---:|---|---:|---:|---:|---:|---:|"]
    for j in rows:
        opt = f"{j['optimum_ratio']:.3f}" if j.get('optimum_ratio') is not None else "n/a"
        out.append(f"| {j['scenario']} | {j['n']} | {j['pp']} x {j['dp']} | {j['cost']:.3f} | {opt} | "
                   f"{j['random_ratio']:.3f} | {j['best_random_ratio']:.3f} | {j['solve_seconds']:.3f} |")
    out += ["", "Goals (issue 6): <= 1.05x the optimum (met: every N = 8 instance optimal); 256 peers in < 10 s (met)."]
    return out


def allreduce():
    rows = load("allreduce")
    out = ["## Data-parallel exchange (`aqswarm bench allreduce`)", "",
           f"Command: `build/aqswarm bench allreduce --json --repeats 2` (D worker processes on 127.0.0.1, 25 M floats, "
           f"scatter-reduce + all-gather of pipeline/dp_allreduce.h over the gRPC GradientExchange; compressed = min-max "
           f"buckets of 512 with worker and server error feedback; best of 2 after a warm-up). {meta('allreduce')}", "",
           "Each replica pair has its own emulated link (per-destination token bucket), so with D = 4 a replica "
           "sends to 3 peers at once: the shaped D = 4 exchange is faster than D = 2. `wire MB` = bytes this replica "
           "sent (scales + payload); speedup is against the fp32 exchange of the same D and link in the same run.", "",
           "| D | link | bits | codec | seconds | wire MB / replica | speedup vs fp32 |", "|---:|---|---:|---|---:|---:|---:|"]
    for j in rows:
        link = "unshaped" if j['bandwidth_mbps'] == 0 else f"{j['bandwidth_mbps']:.0f} Mbit/s"
        out.append(f"| {j['dp']} | {link} | {j['bits']} | {j['codec']} | {j['seconds']:.3f} | {j['wire_bytes']/1e6:.1f} | "
                   f"{j['speedup_vs_fp32']:.2f}x |")
    return out


def link():
    rows = load("link")
    out = ["## Link endpoints (`aqswarm bench link`)", "",
           f"Command: `build/aqswarm bench link --json --repeats 5` (one pipeline link's sender and receiver, each with "
           f"its own store, no model, no transport: 512 samples x 8 timed epochs after AQ-SGD's FULL epoch 0, "
           f"micro-batches of 8, 64x32 rows, fw 3 bits, fp16 m rows, each cell's lowest CPU time of 5 runs). "
           f"{meta('link')}", "",
           "CPU us per sample = process CPU time (every thread: the prefetchers' loaders and writers, RocksDB's "
           "background threads) / samples. What AQ-SGD adds over DirectQ (same quantizer, same bytes) is its "
           "per-sample state: at both ends add the decoded delta to m(xi), round it to fp16 and checksum it. "
           "`resident` is what the stages do when an epoch's rows fit LinkEndpointOptions::resident_bytes "
           "(default 64 MiB, as here): the endpoints keep the rows in memory, read from RocksDbMessageStore once "
           "and written back at Close. The other table rows stream each micro-batch's m rows through the store "
           "(resident_bytes = 0, what larger epochs do): read m(xi) through the prefetcher and write it back "
           "(rows this small: read from the memtable on the endpoint's own thread, puts written "
           "inline, rows overwritten in place in the memtable; storage/README.md); DELTA messages carry the "
           "store's own checksum of m(xi), so neither end hashes m on a read. `rocksdb` is RocksDbMessageStore as "
           "the stages open it (hash memtable); "
           "`rocksdb_prefetch` the same with every row loaded ahead by the prefetcher's loader threads "
           "(LinkEndpointOptions::inline_read_bytes = 0: the baseline of reading small rows inline); "
           "`rocksdb_skiplist` RocksDB's default skip-list memtable (the baseline of the hash memtable); "
           "`memory` MemoryMessageStore (the prefetcher and delta coding without a store). The slow-network bench "
           "compares this with the pipelines' extra CPU (its AQ-SGD vs DirectQ note).", "",
           "| mode | store | CPU us / sample | wall us / sample | extra CPU us vs DirectQ |", "|---|---|---:|---:|---:|"]
    for j in rows:
        out.append(f"| {j['mode']} | {j['store']} | {j['cpu_us_per_sample']:.2f} | {j['wall_us_per_sample']:.2f} | "
                   f"{j['extra_cpu_us_per_sample_vs_directq']:+.2f} |")
    return out


sections = {"compression": compression, "store": store, "link": link, "scheduler": scheduler, "allreduce": allreduce}
# Arguments name the sections to rewrite (default: all).
if len(sys.argv) > 1:
    unknown = [a for a in sys.argv[1:] if a not in sections]
    if unknown:
        sys.exit(f"render_benchmarks.py: unknown section(s) {unknown}; known: {list(sections)}")
    sections = {k: v for k, v in sections.items() if k in sys.argv[1:]}
text = open(doc).read() if os.path.exists(doc) else "# Benchmarks\n"
if not text.startswith("# Benchmarks"):
    text = "# Benchmarks\n\n" + text
intro = ("All figures come from the commands shown next to them, on this project's machines (2 cores, no GPU), and "
         "each compares against a baseline measured in the same run. Raw JSON lines: `docs/data/`. Regenerate: "
         "`scripts/bench_docs.sh` (compression, store, link, scheduler, allreduce) and `scripts/bench_slownet.sh`, then, "
         "once its table is committed, `scripts/slownet_history.py --write` (its targets run by run).")
if "<!-- intro:begin -->" not in text:
    text = text.replace("# Benchmarks\n", f"# Benchmarks\n\n<!-- intro:begin -->\n<!-- intro:end -->\n", 1)
for name in ["intro"] + list(sections):
    body = intro if name == "intro" else "\n".join(sections[name]())
    block = f"<!-- {name}:begin -->\n{body}\n<!-- {name}:end -->"
    pat = re.compile(rf"<!-- {name}:begin -->.*?<!-- {name}:end -->", re.S)
    if pat.search(text):
        text = pat.sub(lambda _: block, text)
    else:
        # New sections go before the slownet section (or at the end).
        i = text.find("<!-- slownet:begin -->")
        text = (text[:i] + block + "\n\n" + text[i:]) if i >= 0 else (text.rstrip() + "\n\n" + block + "\n")
open(doc, "w").write(text)
print("wrote", doc)
