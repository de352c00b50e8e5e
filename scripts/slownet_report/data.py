"""Reading and writing the slow-network run's files.

Two layouts hold one run:

* the bench's work folder, $OUT of scripts/bench_slownet.sh: slownet.jsonl,
  paired.jsonl, paired_repeat_K.jsonl (+ _command, _when), paired_command,
  paired_failures, link.jsonl, netns/summary.txt, uptime_start, uptime,
  probe_start, probe_end, wall_seconds, build, finished, runs/*/run/events.jsonl;
* the committed copy, docs/data/: slownet.jsonl, slownet_paired.jsonl,
  slownet_paired_repeat_K.jsonl, slownet_netns.txt and slownet_run.json
  (everything else the report needs, gathered by collect()).

collect() turns the first into the second; load() reads the second, which is
all the renderer needs.
"""
import datetime
import json
import os
import shutil
import subprocess
import sys

from . import stats


def _raw(path):
    if not os.path.exists(path):
        return None
    with open(path) as fd:
        return fd.read()


def read_jsonl(path):
    text = _raw(path)
    return [json.loads(x) for x in text.splitlines() if x.strip()] if text else []


def _text(path, default=None):
    text = _raw(path)
    return default if text is None else text.strip()


def _events(path):
    """(kind, dict) pairs of a pipeline run's events.jsonl (scripts/aqswarm_events.py)."""
    scripts = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    if scripts not in sys.path:
        sys.path.insert(0, scripts)
    from aqswarm_events import read_events
    return list(read_events(path))


def dp_waits(out, cells):
    """{cell key: [mean seconds, step events]} of stage 0's wait on the DP
    step, for every +dpu cell and its synchronous twin, from the last pass's
    events of their pipeline runs ($OUT/runs/slownet-GRID-LABEL-sweep)."""
    got = {}
    dpu = [c for c in cells if c.get("dp_delayed_update")]
    wanted = dpu + [t for c in dpu for t in [stats.get([x for x in cells if x["grid"] == c["grid"]],
                                                        c["label"].replace(" +dpu", ""), c["bandwidth_mbps"])] if t]
    for c in wanted:
        name = f"slownet-{c['grid']}-{c['label']}-sweep"
        for ch in " +/":
            name = name.replace(ch, "_")
        path = os.path.join(out, "runs", name, "run", "events.jsonl")
        if not os.path.exists(path):
            continue
        bws = len({x["bandwidth_mbps"] for x in cells if x["grid"] == c["grid"] and x["label"] == c["label"]})
        w = stats.dp_wait(_events(path), c, bws)
        if w:
            got[stats.cell_key(c)] = [w[0], w[1]]
    return got


def collect(out, json_path, data_dir):
    """Copies the run in $OUT (its table: json_path) to data_dir and writes
    data_dir/slownet_run.json. Returns the metadata."""
    os.makedirs(data_dir, exist_ok=True)
    cells = read_jsonl(json_path)
    meta = {}
    build = _text(os.path.join(out, "build"))
    if build:
        meta["build"] = build
    finished = _text(os.path.join(out, "finished"))
    if not finished and os.path.exists(json_path):
        finished = datetime.datetime.fromtimestamp(os.path.getmtime(json_path), datetime.timezone.utc).strftime("%Y-%m-%dT%H:%MZ")
    if finished:
        meta["finished"] = finished
    for key, name in (("command", "command"), ("wall_seconds", "wall_seconds"), ("uptime_start", "uptime_start"),
                      ("uptime_end", "uptime"), ("paired_command", "paired_command")):
        v = _text(os.path.join(out, name))
        if v is not None:
            meta[key] = v
    for key, name in (("probe_start", "probe_start"), ("probe_end", "probe_end")):
        v = _text(os.path.join(out, name))
        if v:
            meta[key] = json.loads(v)
    repeats = {}
    for k in range(2, 10):
        base = os.path.join(out, f"paired_repeat_{k}")
        if read_jsonl(base + ".jsonl"):
            repeats[str(k)] = {"command": _text(base + "_command", "?"), "when": _text(base + "_when", "")}
    if repeats:
        meta["paired_repeats"] = repeats
    fails = _text(os.path.join(out, "paired_failures"))
    meta["paired_failures"] = [x.strip() for x in fails.splitlines() if x.strip()] if fails else []
    netns = os.path.join(out, "netns", "summary.txt")
    if os.path.exists(netns):
        meta["netns_finished"] = datetime.datetime.fromtimestamp(
            os.path.getmtime(netns), datetime.timezone.utc).strftime("%Y-%m-%d %H:%M UTC")
    link = read_jsonl(os.path.join(out, "link.jsonl"))
    if link:
        meta["link_bench"] = link
    try:
        waits = dp_waits(out, cells)
    except ImportError as e:  # no build or no python3-protobuf: the note goes without the waits
        print(f"slownet_report: stage 0's DP waits left out: {e}", file=sys.stderr)
        waits = {}
    if waits:
        meta["dp_wait"] = waits
    # A kernel-shaping check from an earlier run stays (it needs root), marked as such.
    old_netns = os.path.join(data_dir, "slownet_netns.txt")
    if not os.path.exists(netns) and os.path.exists(old_netns):
        prev = os.path.join(data_dir, "slownet_run.json")
        when = (json.loads(_raw(prev)).get("netns_finished", "?") if os.path.exists(prev) else "?").split(" (")[0]
        meta["netns_finished"] = f"{when} (an earlier run than the table)"

    def copy(src, dst):
        if os.path.realpath(src) != os.path.realpath(dst):
            shutil.copy(src, dst)
    copy(json_path, os.path.join(data_dir, "slownet.jsonl"))
    for name in os.listdir(data_dir):
        if name.startswith("slownet_paired_repeat_"):
            os.remove(os.path.join(data_dir, name))
    if os.path.exists(os.path.join(out, "paired.jsonl")):
        copy(os.path.join(out, "paired.jsonl"), os.path.join(data_dir, "slownet_paired.jsonl"))
    elif os.path.exists(os.path.join(data_dir, "slownet_paired.jsonl")):
        os.remove(os.path.join(data_dir, "slownet_paired.jsonl"))  # an older run's: not this table's
    for k in repeats:
        copy(os.path.join(out, f"paired_repeat_{k}.jsonl"), os.path.join(data_dir, f"slownet_paired_repeat_{k}.jsonl"))
    if os.path.exists(netns):
        copy(netns, os.path.join(data_dir, "slownet_netns.txt"))
    with open(os.path.join(data_dir, "slownet_run.json"), "w") as f:
        json.dump(meta, f, indent=1)
        f.write("\n")
    return meta


def git_build(root):
    """The checkout's short commit, '+local changes' when tracked files differ."""
    try:
        rev = subprocess.run(["git", "-C", root, "rev-parse", "--short", "HEAD"], capture_output=True, text=True,
                             check=True).stdout.strip()
        dirty = subprocess.run(["git", "-C", root, "status", "--porcelain", "--untracked-files=no"],
                               capture_output=True, text=True).stdout.strip()
        return rev + ("+local changes" if dirty else "")
    except (OSError, subprocess.CalledProcessError):
        return "?"


class Run:
    """One published run, as committed in docs/data."""

    def __init__(self, cells, paired_cells=(), repeat_cells=None, meta=None, netns=None, data_dir=None):
        self.cells = list(cells)
        if not self.cells:
            raise ValueError("a run needs at least one cell")
        self.meta = meta or {}
        self.paired = stats.paired_by_bandwidth(list(paired_cells))
        # Later paired runs, in order: [(run number, {bandwidth: (AQ-SGD, DirectQ)})].
        self.repeats = []
        for k in sorted(repeat_cells or {}, key=int):
            by_bw = stats.paired_by_bandwidth(repeat_cells[k])
            if by_bw:
                self.repeats.append((int(k), by_bw))
        self.netns = netns
        self.data_dir = data_dir

    def repeat_info(self, k):
        r = (self.meta.get("paired_repeats") or {}).get(str(k), {})
        return r.get("command", "?"), r.get("when", "")


def load(data_dir):
    cells = read_jsonl(os.path.join(data_dir, "slownet.jsonl"))
    if not cells:
        raise FileNotFoundError(f"no cells in {os.path.join(data_dir, 'slownet.jsonl')}")
    meta_path = os.path.join(data_dir, "slownet_run.json")
    meta = json.loads(_raw(meta_path)) if os.path.exists(meta_path) else {}
    repeats = {}
    for k in range(2, 10):
        rc = read_jsonl(os.path.join(data_dir, f"slownet_paired_repeat_{k}.jsonl"))
        if rc:
            repeats[str(k)] = rc
    return Run(cells, read_jsonl(os.path.join(data_dir, "slownet_paired.jsonl")), repeats, meta,
               _raw(os.path.join(data_dir, "slownet_netns.txt")), data_dir)
