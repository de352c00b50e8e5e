#!/usr/bin/env python3
"""Writes docs/BENCHMARKS.md from the committed runs in docs/data/.

Every section sits between <!-- NAME:begin --> / <!-- NAME:end --> markers.
This script renders intro, link, compression, store, allreduce, scheduler,
swarmsim, churn and coordinator from docs/data/NAME.jsonl (+ NAME.meta, one line: which run), as
scripts/bench_docs.sh writes them; the slownet section is rendered by
`python3 -m slownet_report render` (scripts/bench_slownet.sh) and kept here as
it is. Sections named on the command line are re-rendered, the others kept:

  scripts/render_benchmarks.py                 # all of this script's sections
  scripts/render_benchmarks.py link store      # only these
"""
import json
import os
import re
import sys
import textwrap

ROOT = os.path.join(os.path.dirname(os.path.abspath(__file__)), "..")
DATA = os.path.join(ROOT, "docs", "data")
DOC = os.path.join(ROOT, "docs", "BENCHMARKS.md")
ORDER = ["intro", "converge", "slownet", "link", "compression", "store", "allreduce", "scheduler", "swarmsim",
         "churn", "coordinator"]


def load(name):
    p = os.path.join(DATA, name + ".jsonl")
    if not os.path.exists(p):
        return []
    with open(p) as fd:
        return [json.loads(x) for x in fd if x.strip()]


def meta(name):
    p = os.path.join(DATA, name + ".meta")
    if not os.path.exists(p):
        return "(no run recorded)"
    with open(p) as fd:
        return fd.read().strip()


def pct(x, base):
    return f"{100 * x / base:.0f}%"


def intro():
    return [
        "# Benchmarks",
        "",
        "What aqswarm's benchmarks measure, the command that reproduces each table, and what to expect.",
        "Every figure compares against a baseline measured in the same run. Raw JSON lines: `docs/data/`.",
        "How the figures are computed: `docs/METHODOLOGY.md`. Dated runs and A/B history: `docs/notebook/`.",
        "",
        "Regenerate: `scripts/bench_docs.sh` (link, compression, store, allreduce, scheduler, coordinator; ~12 minutes)",
        "and `scripts/bench_slownet.sh` (slow networks; ~40 minutes). `scripts/render_benchmarks.py` redraws this page",
        "from `docs/data/` without running anything; so does `scripts/bench_slownet.sh --render` for its section.",
        "",
        "**On a 2-core machine** (where every table here ran, cores shared with other work): absolute numbers",
        "move by 10-30% from run to run with the machine's load, so read the ratios, which compare cells of one run.",
        "The slow-network table takes ~40 minutes; its compute-bound cells spread by up to ~30% between passes.",
        "",
        "**On a GPU:** none of these benchmarks has been run on one. The CUDA build and the pipeline and schedule",
        "integration tests have run on one NVIDIA H200 (`docs/CUDA.md`): stages train on `cuda:0`, but no throughput",
        "was recorded. The codecs, the message store and the link endpoints work on host memory in every build,",
        "so their tables describe the CPU side of a GPU machine too. A GPU makes each stage's compute much faster",
        "than here, so the same links become the bottleneck at higher bandwidths: the regime of the AQ-SGD paper",
        "(fp32 link-bound below a few hundred Mbit/s), to which the slow-network table scales its model down.",
    ]


def compression():
    rows = load("compression")
    out = ["## Compression codecs (`aqswarm bench compression`)", "",
           "Encode and decode speed of each codec on 64 MiB of activation-like float32 (one thread, best of 5),",
           "against memcpy of the same buffer in the same run; ratio = input bytes / (scales + payload bytes).", "",
           "Reproduce: `build/aqswarm bench compression --json --repeats 5`.",
           f"Run: {meta('compression')}", "",
           "| codec | levels | bits | rounding | encode GB/s | decode GB/s | memcpy GB/s | encode % memcpy | decode % memcpy | ratio |",
           "|---|---|---:|---|---:|---:|---:|---:|---:|---:|"]
    for j in rows:
        m = j["memcpy_gbps"]
        out.append(f"| {j['codec']} | {j.get('levels', '') or ''} | {j['bits']} | {j['rounding']} | {j['encode_gbps']:.2f} | "
                   f"{j['decode_gbps']:.2f} | {m:.2f} | {pct(j['encode_gbps'], m)} | {pct(j['decode_gbps'], m)} | {j['ratio']:.2f} |")
    fp = {(j['bits'], j['rounding']): j for j in rows if j['codec'] == 'fixed_point'}
    if (4, 'nearest') in fp and (4, 'stochastic') in fp:
        n, s = fp[(4, 'nearest')], fp[(4, 'stochastic')]
        out += ["", f"Targets: fixed-point 4-bit nearest encode and decode >= 25% of memcpy: "
                f"**{pct(n['encode_gbps'], n['memcpy_gbps'])} / {pct(n['decode_gbps'], n['memcpy_gbps'])}**;",
                f"stochastic >= 10%: **{pct(s['encode_gbps'], s['memcpy_gbps'])} / {pct(s['decode_gbps'], s['memcpy_gbps'])}**. "
                "Global-QSGD and min-max encoders are scalar loops (not tuned)."]
    out += ["", "Expect: on an x86-64 CPU with BMI2 (3- and 6-bit packing uses PEXT/PDEP) about these shares of memcpy;",
            "without BMI2 the portable 3- and 6-bit loops are several times slower (`docs/notebook/components.md`)."]
    return out


def store():
    rows = load("store")
    out = ["## Message store (`aqswarm bench store`)", "",
           "Reading and writing AQ-SGD's per-sample rows (fp16) through the store, directly and through the prefetcher,",
           "and the share of time a consumer that computes between micro-batches stays blocked on it.",
           "Modes and the stall definition: `docs/METHODOLOGY.md`.", "",
           "Reproduce: `build/aqswarm bench store --json` (needs several GB of free disk: see `disk GB`).",
           f"Run: {meta('store')}", "",
           "| shape | backend | mode | rows/s | MB/s | p99 get us | disk GB | stall (get / put / final flush) | stall by epoch |",
           "|---|---|---|---:|---:|---:|---:|---|---|"]
    for j in rows:
        stall = (f"{100 * j['stall_fraction']:.1f}% ({100 * j.get('stall_get_fraction', 0):.1f}% / "
                 f"{100 * j.get('stall_put_fraction', 0):.1f}% / {100 * j.get('stall_final_flush_fraction', 0):.1f}%)"
                 if 'stall_fraction' in j else "")
        epochs = " / ".join(f"{100 * x:.1f}%" for x in j.get("stall_by_epoch") or [])
        disk = f"{j['disk_bytes'] / 1e9:.2f}" if j.get("disk_bytes") else ""
        p99 = f"{j['p99_get_us']:.0f}" if j.get('p99_get_us') is not None else ""
        out.append(f"| {j['shape']} | {j['backend']} | {j['mode']} | {j['rows_per_s']:.0f} | {j.get('mb_per_s', 0):.0f} | "
                   f"{p99} | {disk} | {stall} | {epochs} |")
    hid = [j for j in rows if j['backend'] == 'rocksdb' and j['mode'] in ('hidden_1x', 'hidden_2x')]
    if hid:
        met = [j for j in hid if j['stall_fraction'] < 0.02]
        out += ["", "Target: stall < 2% when compute >= I/O time (hidden_1x, hidden_2x on RocksDB): " +
                ", ".join(f"{j['shape']} {j['mode']} **{100 * j['stall_fraction']:.1f}%**" for j in hid) +
                f" ({'met' if len(met) == len(hid) else f'met in {len(met)} of {len(hid)}'}).",
                "The memory backend's prefetch path is CPU-bound (its stalls are not a target). Other runs of this code",
                "and of the store before it: `docs/notebook/store.md`."]
    out += ["", "Expect: the RocksDB rows are disk-bound (here ~0.8-1.2 GB/s of mixed reads and writes); the stall",
            "target needs a disk that keeps up with the rows at the consumer's pace. Rows/s follow the disk, not the cores."]
    return out


def link():
    rows = load("link")
    out = ["## Link endpoints (`aqswarm bench link`)", "",
           "CPU per sample of one pipeline link's two ends without model or transport: what AQ-SGD's per-sample",
           "state (delta coding, fp16 rounding, checksums, the store) costs over DirectQ, which sends the same bytes.", "",
           "Reproduce: `build/aqswarm bench link --json --repeats 5` (512 samples of 64x32 rows, 8 epochs, fw 3 bits).",
           f"Run: {meta('link')}", "",
           "| mode | store | CPU us / sample | wall us / sample | extra CPU us vs DirectQ |", "|---|---|---:|---:|---:|"]
    for j in rows:
        out.append(f"| {j['mode']} | {j['store']} | {j['cpu_us_per_sample']:.2f} | {j['wall_us_per_sample']:.2f} | "
                   f"{j['extra_cpu_us_per_sample_vs_directq']:+.2f} |")
    out += ["", "`resident`: the rows of an epoch kept in memory, as the stages do when they fit "
            "`compression.residentBytes` (64 MiB);",
            "`rocksdb`: streamed through RocksDbMessageStore every micro-batch (larger epochs); `rocksdb_prefetch`: the same",
            "through the prefetcher's loader threads; `rocksdb_skiplist`: RocksDB's default memtable; `memory`: MemoryMessageStore.",
            "", "Expect: a few microseconds per sample and link end on any recent x86-64 core; next to a model's compute",
            "per sample that is ~1-2% of a pipeline's CPU here (`docs/notebook/slownet_run.md`); on a GPU machine it runs",
            "on the host CPU beside the model."]
    return out


def allreduce():
    rows = load("allreduce")
    out = ["## Data-parallel exchange (`aqswarm bench allreduce`)", "",
           "One all-reduce of 25 M floats among D replica processes on 127.0.0.1 (scatter-reduce + all-gather over the",
           "gRPC GradientExchange), fp32 against min-max and Global-QSGD compression; each replica pair has its own",
           "emulated link, so a D = 4 replica sends to 3 peers at once. `wire MB`: bytes one replica sent.", "",
           "Reproduce: `build/aqswarm bench allreduce --json --repeats 2`.",
           f"Run: {meta('allreduce')}", "",
           "| D | link | bits | codec | seconds | wire MB / replica | speedup vs fp32 |", "|---:|---|---:|---|---:|---:|---:|"]
    for j in rows:
        lk = "unshaped" if j['bandwidth_mbps'] == 0 else f"{j['bandwidth_mbps']:.0f} Mbit/s"
        out.append(f"| {j['dp']} | {lk} | {j['bits']} | {j['codec']} | {j['seconds']:.3f} | {j['wire_bytes'] / 1e6:.1f} | "
                   f"{j['speedup_vs_fp32']:.2f}x |")
    out += ["", "Expect: on a shaped link the speedup follows the bytes (1-bit min-max ~19x at D = 2); unshaped, the",
            "gain is 1.2-2x, and Global-QSGD (a scalar loop) is slower than fp32. `dp.transport: nccl` is not benchmarked."]
    return out


def scheduler():
    rows = load("scheduler")
    out = ["## Placement scheduler (`aqswarm bench scheduler`)", "",
           "Cost of the coordinator's placement of N peers into D_PP stages x D_DP replicas, against the exhaustive",
           "optimum (N <= 8) and random placements (lower ratio is better); `world`: peers in Oregon, Virginia, Singapore.", "",
           "Reproduce: `build/aqswarm bench scheduler --json` (seed 1; 20 instances per size for N = 8, 3 otherwise).",
           f"Run: {meta('scheduler')}", "",
           "| scenario | N | D_PP x D_DP | cost (s) | optimum ratio | random ratio | best-random ratio | solve s |",
           "|---|---:|---|---:|---:|---:|---:|---:|"]
    for j in rows:
        opt = f"{j['optimum_ratio']:.3f}" if j.get('optimum_ratio') is not None else "n/a"
        out.append(f"| {j['scenario']} | {j['n']} | {j['pp']} x {j['dp']} | {j['cost']:.3f} | {opt} | "
                   f"{j['random_ratio']:.3f} | {j['best_random_ratio']:.3f} | {j['solve_seconds']:.3f} |")
    big = [j for j in rows if j['n'] == max(r['n'] for r in rows)] if rows else []
    out += ["", "Goals: <= 1.05x the optimum (met: every N = 8 instance optimal); 256 peers in < 10 s "
            f"({'met' if big and all(j['solve_seconds'] < 10 for j in big) else 'not met'}).",
            "Expect: solve time grows faster than linearly in N (seconds at 256 peers); it runs when membership changes."]
    return out


def coordinator():
    rows = load("coordinator")
    out = ["## Coordinator (`aqswarm bench coordinator`)", "",
           "A real Coordinator gRPC server on loopback (state in RocksDB) with N simulated peers heartbeating at 1 Hz",
           "for 20 s from 8 client threads; client and server share the machine, so latencies are pessimistic.", "",
           "Reproduce: `build/aqswarm bench coordinator --json`.",
           f"Run: {meta('coordinator')}", "",
           "| peers | offered heartbeats/s | sustained heartbeats/s | p50 ms | p99 ms | p99.9 ms | max ms | errors | leases expired |",
           "|---:|---:|---:|---:|---:|---:|---:|---:|---:|"]
    for j in rows:
        out.append(f"| {j['peers']:,} | {j['offered_per_s']:,} | {j['heartbeats_per_s']:,.1f} | {j['p50_ms']:.3f} | "
                   f"{j['p99_ms']:.3f} | {j['p999_ms']:.1f} | {j['max_ms']:.1f} | {j['errors']} | {j['expired']} |")
    ok = rows and all(j['errors'] == 0 and j['expired'] == 0 and j['heartbeats_per_s'] >= 0.99 * j['offered_per_s'] for j in rows)
    out += ["", f"Every size {'sustains' if ok else 'does not sustain'} the offered rate with no errors and no lease lost "
            "(leases are 10 s).", "Expect: 10,000 peers per coordinator on 2 cores; p99 moves with the machine's load."]
    return out


def swarmsim():
    rows = load("swarmsim")
    out = ["## Swarm simulation (`aqswarm bench swarmsim`, issue 40)", "",
           "N simulated peers speak the real protocol to the real coordinator: its gRPC server on loopback with",
           "RocksDB state (fsync per membership change, as deployed). Each peer joins, keeps an assignment watch",
           "open, heartbeats every lease/3 (10 s leases), answers the probes heartbeats ask for with a seeded",
           "synthetic link (10-400 Mbit/s, 5-150 ms) and reports progress and held states while placed; the job's",
           "grid is 8 stages x 8 pipelines, the other peers are standbys. After the swarm forms (joins paced by the",
           "coordinator's 20/s join budget), peers depart at `churn` per peer-hour (half killed, half leaving) and",
           "arrive at the same rate. Time is virtual (leases, budgets, schedules) and advances by at least the real",
           "time each 0.5 s tick took, so a coordinator that fell behind would lose leases; latencies are real. A",
           "re-plan is timed from the call that changes the membership (Join, Leave, or the lease sweep that",
           "expires a killed peer) until every live peer's watch has delivered the new assignment version.", "",
           "Reproduce: `build/aqswarm bench swarmsim --swarmsim_sizes 100,300,1000 --swarmsim_seconds 600` (and",
           "`--swarmsim_sizes 1000 --swarmsim_seconds 1200 --swarmsim_churn 0.1` for the low-churn row).",
           *textwrap.wrap(f"Run: {meta('swarmsim')}", 110), "",
           "| peers | churn /peer-h | virtual s | events | joins / leaves / kills | re-plans on measurements | "
           "re-plan s p50 / p99 / max | placed peers moved per event (mean / max) | join to assignment s p99 | "
           "heartbeat ms p50 / p99 | honest leases lost | undelivered | RSS MB |",
           "|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|"]
    for j in rows:
        out.append(f"| {j['peers']:,} | {j['churn_per_peer_hour']:g} | {j['virtual_seconds']:g} | {j['events']} | "
                   f"{j['joins']} / {j['leaves']} / {j['kills']} | {j.get('replans_on_measurements', 0)} | "
                   f"{j['replan_seconds_p50']:.3f} / {j['replan_seconds_p99']:.3f} / {j['replan_seconds_max']:.3f} | "
                   f"{j['peers_moved_per_event']:.3f} / {j['peers_moved_max']} | "
                   f"{j['join_to_assignment_seconds_p99']:.3f} | {j['heartbeat_p50_ms']:.1f} / {j['heartbeat_p99_ms']:.1f} | "
                   f"{j['honest_leases_lost']} | {j['undelivered']} | {j['rss_mb']} |")
    big = [j for j in rows if j["peers"] >= 1000]
    if big:
        j = max(big, key=lambda r: r["events"])
        clean = all(r["honest_leases_lost"] == 0 and r["undelivered"] == 0 for r in big)
        out += ["", *textwrap.wrap(
            f"At {j['peers']:,} peers {'no' if clean else 'SOME'} honest lease was lost and "
            f"{'every' if clean else 'not every'} change reached every live peer: a re-plan reaches all watches in "
            f"{j['replan_seconds_p50']:.2f} s at the median and {j['replan_seconds_p99']:.2f} s at p99, a joiner has "
            f"its assignment within {j['join_to_assignment_seconds_p99']:.2f} s (p99), and placed peers rarely move "
            f"for someone else's departure ({j['peers_moved_per_event']:.2f} per event, at most "
            f"{j['peers_moved_max']}).", 110),
                "The cost grows with N because every membership change, even a standby joining, bumps the swarm-wide",
                "assignment version and wakes every watch (one server thread each): forming a swarm of N is N fan-outs.",
                "At 2 departures per peer-hour a placed peer leaves about every 30 s, so the 10-minute hold after a",
                "plan change never passes and nothing is re-planned on measurements; at 0.1 per peer-hour the hold",
                "passes and re-plans are considered (the run line above says how they went)."]
    return out


def churn():
    rows = load("churn")
    out = ["## Churn on a real swarm (`aqswarm bench churn`, issue 55)", "",
           "What peer losses cost a real swarm on this machine: a real coordinator and real peer daemons (each",
           "running its stage as a child process) on loopback train the same job twice, from scratch each time:",
           "undisturbed, then with a random placed peer SIGKILLed at Poisson times and a fresh peer arriving for",
           "each. Progress is the mean over pipelines of the steps their last stage completed on its current",
           "timeline (a rollback lowers it); seconds lost per kill are the seconds the undisturbed rate needs for",
           "the progress not made until the next kill; healthy steps redone are steps that pipelines a kill did",
           "not hit trained again; the hit pipeline's recovery runs until it reports a step from a stage started",
           "after the kill. Under fault domains (`--fault_domains`) a healing pipeline starts past the state it",
           "loads: those steps are skipped, not trained, and progress leaves them out. The loss is compared at",
           "equal steps (val loss at the newest eval both runs have).", "",
           "Reproduce: `build/aqswarm bench churn --job examples/churn.json --churn_seconds 300 --kill_every_s 30`",
           "(add `--fault_domains` for the fault-domain rows)",
           "(about 12 minutes; the job's corpus is the one `scripts/demo.sh` prepares).",
           *textwrap.wrap(f"Run: {meta('churn')}", 110), "",
           "| design | run | grid + standbys | lease s | seconds | kills | steps | steps/s | throughput vs undisturbed | "
           "s lost per kill p50 / p99 | healthy steps redone | steps skipped | hit pipeline trains again s p50 / p99 | "
           "loss at step | loss vs undisturbed |",
           "|---|---|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|"]
    for j in rows:
        lost, rec = j["swarm_seconds_lost_per_event"], j["affected_pipeline_recovery_s"]
        ratio = j["final_loss_vs_undisturbed"]
        out.append(f"| {j.get('design', '')} | {j['run']} | {j['grid']} + {j['standbys']} | {j['lease_s']:g} | {j['seconds']:.0f} | "
                   f"{j['events']} | {j['steps']:.1f} | {j['steps_per_s']:.3f} | "
                   f"{j['throughput_ratio_vs_undisturbed']:.2f} | {lost['p50']:.1f} / {lost['p99']:.1f} | "
                   f"{j['healthy_steps_redone']} | {j.get('steps_skipped', 0)} | {rec['p50']:.1f} / {rec['p99']:.1f} | "
                   f"{j['loss']:.3f} ({j['loss_kind']}, step {j['loss_at_step']}) | "
                   f"{'-' if ratio is None else format(ratio, '.4f')} |")
    hit = [j for j in rows if j["run"] == "churn"]
    if hit:
        j = hit[-1]
        runs = [r for r in hit if r.get("design") == j.get("design")]  # the last design's runs (seeds)

        def each(fmt, value):
            return " / ".join(fmt(value(r)) for r in runs)

        def loss_ratio(r):
            return r["final_loss_vs_undisturbed"]

        goals = [("healthy pipelines redo 0 steps", all(r["healthy_steps_redone"] == 0 for r in runs),
                  each(lambda v: f"{v} redone", lambda r: r["healthy_steps_redone"])),
                 ("swarm throughput >= 80% of undisturbed",
                  all(r["throughput_ratio_vs_undisturbed"] >= 0.8 for r in runs),
                  each(lambda v: f"{100 * v:.0f}%", lambda r: r["throughput_ratio_vs_undisturbed"])),
                 ("the hit pipeline trains again within lease + state transfer + 5 s",
                  all(r["affected_pipeline_recovery_s"]["p99"] <= r["lease_s"] + 5 for r in runs),
                  each(lambda v: f"p99 {v:.1f} s", lambda r: r["affected_pipeline_recovery_s"]["p99"]) +
                  f" against {j['lease_s'] + 5:g} s (state transfer not counted)"),
                 ("loss within 1% at equal steps",
                  all(loss_ratio(r) is not None and abs(loss_ratio(r) - 1) <= 0.01 for r in runs),
                  each(lambda v: "-" if v is None else f"{100 * (v - 1):+.2f}%", loss_ratio))]
        seeds = f"{len(runs)} runs, one per seed, values in that order" if len(runs) > 1 else \
            "one run, its spread is not measured"
        out += ["", f"Issue 55's goals for the last design's churn runs ({j.get('design', 'this build')}; {seeds}):",
                ""]
        out += [f"- {name}: {'met' if ok else 'NOT met'} ({what})" for name, ok, what in goals]
        base = [r["steps_per_s"] for r in rows if r["run"] == "undisturbed"]
        noise = (f"The undisturbed runs differ by {100 * (max(base) - min(base)) / min(base):.0f}% in steps/s "
                 "(run-to-run noise on this machine). " if len(base) > 1 and min(base) > 0 else "")
        cost = ("What a kill still costs under fault domains: the hit pipeline's restart (its peers' lease or "
                "the refused-connect probe, the state fetch, the link handshakes) and the steps it skips to "
                "rejoin; the other pipelines wait for it at their next outer step only. "
                if j.get("fault_domains") else
                "What still costs without fault domains: every kill re-plans the whole grid, so every pipeline "
                "restarts at one resume step (healthy ones roll back) and re-handshakes its links. ")
        out += ["", *textwrap.wrap(cost + noise +
            ("The losses at equal steps are training losses (no eval step reached by both runs). " if j["loss_kind"] == "train" else "") +
            ("Under fault domains the loss at equal steps is what the lost inner work costs: a kill drops the hit "
             "pipeline's progress since its last outer step (its stages restart from the anchor) and it skips "
             "steps to rejoin, so its next pseudo-gradient is smaller (docs/notebook/fault_domains.md)."
             if j.get("fault_domains") else "The runs saw different data after the rollbacks."), 110)]
    return out


SECTIONS = {"intro": intro, "link": link, "compression": compression, "store": store, "allreduce": allreduce,
            "scheduler": scheduler, "swarmsim": swarmsim, "churn": churn, "coordinator": coordinator}


def block(text, name):
    m = re.search(rf"<!-- {name}:begin -->\n(.*?)<!-- {name}:end -->", text, re.S)
    return m.group(1).rstrip("\n") if m else None


def main(argv):
    names = argv or list(SECTIONS)
    unknown = [a for a in names if a not in SECTIONS]
    if unknown:
        sys.exit(f"render_benchmarks.py: unknown section(s) {unknown}; known: {list(SECTIONS)} "
                 "(slownet: python3 -m slownet_report render)")
    old = ""
    if os.path.exists(DOC):
        with open(DOC) as fd:
            old = fd.read()
    parts = []
    for name in ORDER:
        body = "\n".join(SECTIONS[name]()) if name in names else block(old, name)
        if body is None:
            body = "\n".join(SECTIONS[name]()) if name in SECTIONS else "(not rendered yet: scripts/bench_slownet.sh --render)"
        parts.append(f"<!-- {name}:begin -->\n{body}\n<!-- {name}:end -->")
    with open(DOC, "w") as fd:
        fd.write("\n\n".join(parts) + "\n")
    print("wrote", os.path.normpath(DOC))


if __name__ == "__main__":
    main(sys.argv[1:])
