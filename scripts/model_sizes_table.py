#!/usr/bin/env python3
"""Renders scripts/model_sizes.sh's runs as a markdown table (per stage:
parameters, peak RSS, median step and compute time over the steps after the
first) and, with --doc, puts it into docs/MODELS.md between the markers
<!-- model_sizes:DEVICE:begin --> and <!-- model_sizes:DEVICE:end --> (DEVICE
is "cpu" or "cuda"; appended at the end when the markers are missing).

    model_sizes_table.py --job J --device cpu --machine M --build B --command C \
        --load L --out table.md [--name examples/X.json] [--doc docs/MODELS.md] fp32=DIR bf16=DIR ...

Each DIR holds job.json, when.txt and run/events.jsonl (read with
scripts/aqswarm_events.py).
"""
import argparse
import json
import os
import re
import statistics
import sys

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
try:
    from aqswarm_events import read_events
except Exception as e:  # no python3-protobuf (a GPU machine's own Python), or one too new for the generated code
    print(f"model_sizes_table.py: {e}; reading the JSON lines without protobuf", file=sys.stderr)

    def read_events(path, kinds=None, strict=False):
        with open(path) as f:
            for line in f:
                if not line.startswith("{"):
                    continue
                try:
                    obj = json.loads(line)
                except json.JSONDecodeError:
                    continue
                kind, ev = next(iter(obj.items()))
                if kinds is None or kind in kinds:
                    ev.setdefault("stage", 0)  # proto3 JSON leaves zeros out
                    for k in ("tokens", "peak_rss_bytes", "num_parameters", "step"):
                        ev[k] = int(ev.get(k, 0))
                    for k in ("step_seconds", "compute_seconds"):
                        ev[k] = float(ev.get(k, 0))
                    yield kind, ev


def stage_blocks(n_layer, stage, stages):
    """StageRangeFor's split (pipeline/stage_model.h): earlier stages take the remainder."""
    base, extra = divmod(n_layer, stages)
    return base + (1 if stage < extra else 0)


def rows_of(precision, path):
    events = os.path.join(path, "run", "events.jsonl")
    if not os.path.exists(events):
        return [], f"{precision}: no {events} (the run failed; see {path}/pipeline.log)"
    steps, errors = {}, []
    for kind, ev in read_events(events, kinds={"step", "error"}, strict=False):
        if kind == "error":
            errors.append(f"stage {ev['stage']}: {ev['code']}: {ev['message']}")
        else:
            steps.setdefault(ev["stage"], []).append(ev)
    note = f"{precision}: " + "; ".join(errors) if errors else ""
    return steps, note


def median_after_first(evs, field):
    values = [e[field] for e in sorted(evs, key=lambda e: e["step"])[1:]]
    return statistics.median(values) if values else float("nan")


def render(args, runs):
    job = json.load(open(args.job))
    model = job["model"]
    stages = None
    lines, notes, when = [], [], []
    for spec in runs:
        precision, path = spec.split("=", 1)
        if os.path.exists(os.path.join(path, "when.txt")):
            stamp, secs = open(os.path.join(path, "when.txt")).read().split()
            when.append(f"{precision} {stamp}, {secs} s")
        steps, note = rows_of(precision, path)
        if note:
            notes.append(note)
        if not steps:
            continue
        stages = len(steps)
        for stage in sorted(steps):
            evs = steps[stage]
            last = max(evs, key=lambda e: e["step"])
            step_s = median_after_first(evs, "step_seconds")
            tokens = last["tokens"]
            lines.append(
                f"| {precision} | {stage} | {stage_blocks(model['nLayer'], stage, stages)} | "
                f"{last['num_parameters']:,} | {last['peak_rss_bytes'] / 2**20:,.0f} | {step_s:.2f} | "
                f"{median_after_first(evs, 'compute_seconds'):.2f} | {tokens / step_s:,.0f} |")
    tied = "tied" if model.get("tieEmbeddings") else "untied"
    out = [
        f"`{args.name or args.job}` ({model.get('family', 'gpt2')}, d {model['dModel']}, "
        f"{model['nLayer']} layers, {model['nHead']} heads, {tied} embeddings), on {stages or '?'} stages "
        f"(one process each), device `{args.device}`, with seq_len {model['seqLen']}, micro-batch "
        f"{job['microBatchSize']}, {job['microBatchesPerStep']} micro-batches per step "
        f"({job['microBatchSize'] * job['microBatchesPerStep'] * model['seqLen']} tokens), "
        f"{job['maxSteps']} steps, {job.get('threads', 1)} intra-op thread(s) per stage, links "
        f"`{job.get('compression', {}).get('mode', 'fp32')}`, schedule {job.get('schedule', 'adaptive')}, "
        + (f"stage states written every {job['checkpointEverySteps']} steps and at the end."
           if job.get("checkpointEverySteps") else
           "stage states written at the start and the end only (aqswarm pipeline with checkpointEverySteps unset)."),
        "",
        f"Measured {'; '.join(when)} (start, wall time) on {args.machine}; build {args.build}; "
        f"load average {args.load} at the end.",
        "",
        "| precision | stage | blocks | parameters | peak RSS (MiB) | median step (s) | median compute (s) | tokens/s |",
        "|---|---|---|---|---|---|---|---|",
        *lines,
        "",
        "Peak RSS is the stage process's `ru_maxrss` (host memory; on a GPU the tensors live in device memory, "
        "not counted here). Medians leave out the first step (allocation, warm-up). Compute = forward, backward "
        "and optimizer; the rest of a step is waiting on neighbours.",
        "",
        "```sh",
        args.command,
        "```",
    ]
    if notes:
        out += ["", "Errors: " + " | ".join(notes)]
    return "\n".join(out) + "\n"


def splice(doc, device, table):
    kind = "cpu" if device == "cpu" else "cuda"
    begin, end = f"<!-- model_sizes:{kind}:begin -->", f"<!-- model_sizes:{kind}:end -->"
    text = open(doc).read() if os.path.exists(doc) else ""
    block = f"{begin}\n{table}{end}"
    if begin in text and end in text:
        text = re.sub(re.escape(begin) + r".*?" + re.escape(end), lambda _: block, text, flags=re.S)
    else:
        text = text.rstrip("\n") + "\n\n" + block + "\n"
    with open(doc, "w") as f:
        f.write(text)


def main():
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    for flag in ("job", "device", "machine", "build", "command", "load", "out"):
        p.add_argument("--" + flag, required=True)
    p.add_argument("--doc")
    p.add_argument("--name", help="the job as the reader knows it (default: --job)")
    p.add_argument("runs", nargs="+", help="PRECISION=DIR")
    args = p.parse_args()
    table = render(args, args.runs)
    with open(args.out, "w") as f:
        f.write(table)
    print(table)
    if args.doc:
        splice(args.doc, args.device, table)
        print(f"wrote {args.doc}")


if __name__ == "__main__":
    main()
