#!/usr/bin/env python3
"""Follows the demo swarm's peers (their event lines in RUN_DIR/peerN.out,
read with aqswarm_events.py),
prints one progress line per completed training step, and at the end a
summary: the loss curve (RUN_DIR/loss.png, gnuplot) and the bytes sent on the
wire against what fp32 links and an fp32 all-reduce would have sent.

usage: swarm_demo.py RUN_DIR N_PEERS D_MODEL"""
import os, subprocess, sys, time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from aqswarm_events import EventError, parse_peer_event  # noqa: E402

run, n, d_model = sys.argv[1], int(sys.argv[2]), int(sys.argv[3])
files = [open(os.path.join(run, f"peer{i}.out")) for i in range(1, n + 1)]
pending = [""] * n
finished = set()
steps = {}                      # step -> {(stage, pipeline): event}
links = {}                      # name -> [wire bytes, fp32 bytes]
losses, next_step = [], 0


def count(name, wire, fp32):
    l = links.setdefault(name, [0, 0])
    l[0] += wire
    l[1] += fp32


while len(finished) < n:
    idle = True
    for i, f in enumerate(files):
        chunk = f.read()
        if not chunk:
            continue
        idle = False
        pending[i] += chunk
        *lines, pending[i] = pending[i].split("\n")
        for line in lines:
            if not line.startswith("{"):
                continue
            try:
                kind, e = parse_peer_event(line)
            except EventError:
                continue
            if kind in ("job_done", "left"):
                finished.add(i)
            if kind != "step":
                continue
            st, p, dense = e["stage"], e["pipeline"], e["tokens"] * d_model * 4
            steps.setdefault(e["step"], {})[(st, p)] = e
            if e["fw_bytes"]:
                count(f"pipeline {p} stage {st}->{st + 1} activations", e["fw_bytes"], dense)
            if e["bw_bytes"]:
                count(f"pipeline {p} stage {st}->{st - 1} gradients", e["bw_bytes"], dense)
            dp = e.get("dp", {})
            if dp.get("bytes") or dp.get("raw_bytes"):  # a diloco inner step sends nothing
                count(f"stage {st} all-reduce, pipeline {p}'s sends", dp.get("bytes", 0), dp.get("raw_bytes", 0))
    while len(steps.get(next_step, {})) == 4 or (next_step in steps and len(finished) == n):
        rows = steps.pop(next_step)
        last = max(k[0] for k in rows)
        tail = [r for k, r in rows.items() if k[0] == last]
        loss = sum(r["loss"] for r in tail) / len(tail)
        secs = max(r["step_seconds"] for r in rows.values())
        tokens = sum(r["tokens"] for r in tail)
        wire = sum(l[0] for l in links.values())
        fp32 = sum(l[1] for l in links.values())
        losses.append((next_step, loss))
        print(f"step {next_step:4d}  loss {loss:7.4f}  {tokens / secs if secs else 0:7.0f} tokens/s  "
              f"wire {wire / 1e6:7.2f} MB  (fp32 would be {fp32 / 1e6:7.2f} MB, {fp32 / max(wire, 1):4.1f}x)",
              flush=True)
        next_step += 1
    if idle:
        time.sleep(0.2)  # follow the growing files, like tail -f

print("\nbytes on the wire per link (whole run)      sent MB   fp32 MB   ratio")
for name in sorted(links):
    w, f = links[name]
    print(f"  {name:42s} {w / 1e6:8.2f}  {f / 1e6:8.2f}  {f / max(w, 1):5.1f}x")
if losses:
    with open(os.path.join(run, "loss.dat"), "w") as out:
        out.writelines(f"{s} {l}\n" for s, l in losses)
    png = os.path.join(run, "loss.png")
    subprocess.run(["gnuplot", "-e",
                    f"set terminal pngcairo size 800,480; set output '{png}'; set xlabel 'step'; "
                    f"set ylabel 'training loss'; set title 'aqswarm demo: 2 stages x 2 pipelines, "
                    f"AQ-SGD + DiLoCo, links at 100 Mbit/s'; "
                    f"plot '{run}/loss.dat' with lines lw 2 title 'loss'"],
                   check=False, stderr=subprocess.DEVNULL)
    print(f"\nloss {losses[0][1]:.4f} (step {losses[0][0]}) -> {losses[-1][1]:.4f} (step {losses[-1][0]}); "
          f"curve: {png}")
