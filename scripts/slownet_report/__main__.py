"""Command line of the slow-network report; see --help."""
import argparse
import os
import sys

from . import data, render

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def main(argv=None):
    ap = argparse.ArgumentParser(prog="python3 -m slownet_report",
                                 description="Slow-network benchmark report: collect a run into docs/data, render the docs.")
    sub = ap.add_subparsers(dest="cmd", required=True)
    c = sub.add_parser("collect", help="copy a run from the bench's work folder into docs/data (+ slownet_run.json)")
    c.add_argument("--out", required=True, help="the work folder ($OUT of scripts/bench_slownet.sh)")
    c.add_argument("--json", help="the table's cells (default OUT/slownet.jsonl)")
    c.add_argument("--data", default=os.path.join(ROOT, "docs", "data"))
    r = sub.add_parser("render", help="rewrite the docs from docs/data")
    r.add_argument("--data", default=os.path.join(ROOT, "docs", "data"))
    r.add_argument("--doc", default=os.path.join(ROOT, "docs", "BENCHMARKS.md"),
                   help="file whose <!-- slownet:begin/end --> block is rewritten")
    r.add_argument("--notebook", default=os.path.join(ROOT, "docs", "notebook", "slownet_run.md"))
    r.add_argument("--plot_data", help="folder for slownet.dat and series.txt (gnuplot input)")
    args = ap.parse_args(argv)

    if args.cmd == "collect":
        data.collect(args.out, args.json or os.path.join(args.out, "slownet.jsonl"), args.data)
        print(f"slownet_report: copied the run in {args.out} to {args.data}")
        return 0
    run = data.load(args.data)
    text = "# Benchmarks\n"
    if os.path.exists(args.doc):
        with open(args.doc) as fd:
            text = fd.read()
    with open(args.doc, "w") as fd:
        fd.write(render.replace_block(text, "slownet", render.benchmarks_section(run)))
    os.makedirs(os.path.dirname(os.path.abspath(args.notebook)), exist_ok=True)
    with open(args.notebook, "w") as fd:
        fd.write(render.run_page(run))
    if args.plot_data:
        os.makedirs(args.plot_data, exist_ok=True)
        render.plot_data(run, args.plot_data)
    print(render.targets_text(run))
    return 0


if __name__ == "__main__":
    sys.exit(main())
