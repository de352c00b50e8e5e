"""The slow-network benchmark's report (scripts/bench_slownet.sh).

  stats   pure statistics over bench cells (ratios, limits, paired verdicts)
  data    the run's files: collect() from the bench's work folder into
          docs/data, load() from there
  render  markdown for docs/BENCHMARKS.md and docs/notebook/slownet_run.md,
          gnuplot input for the plots

Command line: `PYTHONPATH=scripts python3 -m slownet_report --help`.
"""
