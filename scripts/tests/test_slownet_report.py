"""Tests of scripts/slownet_report (the slow-network benchmark's statistics and docs).

Run from the repository root:  python3 -m unittest discover -s scripts/tests
"""
import json
import math
import os
import shutil
import sys
import tempfile
import unittest

SCRIPTS = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
ROOT = os.path.dirname(SCRIPTS)
sys.path.insert(0, SCRIPTS)

from slownet_report import data, render, stats  # noqa: E402

DATA = os.path.join(ROOT, "docs", "data")


def cell(label, b, sps, grid="1x4", dp=1, mode=None, schedule="adaptive", passes=None, **kw):
    """A synthetic bench cell with every field the report reads."""
    c = {"grid": grid, "label": label, "mode": mode or label.split()[0], "schedule": schedule, "dp": dp,
         "stages": 4, "bandwidth_mbps": b, "samples_per_s": sps, "samples_per_s_passes": passes or [sps, sps],
         "steps_timed": 8, "ratio_vs_fp32_unshaped": 1.0, "compute_limit_samples_per_s": 1000.0,
         "compute_dp_limit_samples_per_s": 1000.0, "link_limit_samples_per_s": math.inf if b == 0 else 100.0 * b,
         "schedule_link_limit_samples_per_s": math.inf if b == 0 else 95.0 * b,
         "achieved_vs_min_limits": 1.0, "achieved_vs_min_schedule_limits": 1.0,
         "fw_bytes_per_sample": 8000, "bw_bytes_per_sample": 8000, "dp_bytes_per_step": 0,
         "cpu_ms_per_sample": 1.8, "cpu_limit_samples_per_s": 1100.0, "step_seconds": 1.0,
         "model": {"vocab": 256, "seq_len": 64, "d_model": 32, "n_layer": 4, "n_head": 2, "micro_batch": 8,
                   "micro_batches": 128, "threads": 1}}
    c.update(kw)
    return c


def by_key(targets):
    return {t["key"]: t for t in targets}


class StatisticsTest(unittest.TestCase):
    def test_geo_mean(self):
        self.assertAlmostEqual(stats.geo_mean([2.0, 8.0]), 4.0)
        self.assertTrue(math.isnan(stats.geo_mean([])))

    def test_boot_interval_is_seeded_and_brackets_the_mean(self):
        r = [0.9, 1.0, 1.1, 0.95, 1.05, 1.02]
        lo, hi = stats.boot_interval(r)
        self.assertEqual((lo, hi), stats.boot_interval(r))
        self.assertLess(lo, stats.geo_mean(r))
        self.assertGreater(hi, stats.geo_mean(r))
        self.assertTrue(all(math.isnan(x) for x in stats.boot_interval([1.0])))

    def test_boot_interval_of_equal_ratios_is_a_point(self):
        self.assertEqual(stats.boot_interval([1.25] * 5), (1.25, 1.25))

    def test_pass_ratios(self):
        a, b = cell("x", 0, 1, passes=[10.0, 30.0]), cell("y", 0, 1, passes=[5.0, 10.0])
        self.assertEqual(stats.pass_ratios(a, b), [2.0, 3.0])

    def test_window_and_flush_bound(self):
        # adaptive: W_0 = 4K - 1 = 15 at stage 0, 11 at stage 1, 1 at the last (K = 4).
        self.assertEqual([stats.window(15, i, 4, 128) for i in range(4)], [15, 11, 6, 1])
        self.assertEqual(stats.window(15, 0, 4, 8), 8)
        self.assertAlmostEqual(stats.flush_bound(1, 1, 128, 4), 128 / 133)
        self.assertEqual(f"{stats.flush_bound(1, 1, 8, 4):.2f}", "0.62")

    def test_paired_by_bandwidth_orders_unshaped_first(self):
        cs = [cell("aqsgd fw3bw6", b, 1) for b in (100, 0, 1000)] + [cell("directq fw3bw6", b, 1) for b in (0, 100)]
        self.assertEqual(list(stats.paired_by_bandwidth(cs)), [0, 100])

    def test_pooled_paired_needs_two_runs(self):
        run = {0: (cell("aqsgd fw3bw6", 0, 1, passes=[9.0, 10.0]), cell("directq fw3bw6", 0, 1, passes=[10.0, 10.0]))}
        self.assertEqual(stats.pooled_paired([run]), {})
        g, lo, hi, n = stats.pooled_paired([run, run])[0]
        self.assertEqual(n, 2)
        self.assertAlmostEqual(g, math.sqrt(0.9) - 1)
        self.assertLessEqual(lo, g)
        self.assertGreaterEqual(hi, g)

    def test_runs_disagree_when_intervals_do_not_overlap(self):
        def run(x):
            return {0: (cell("aqsgd fw3bw6", 0, 1, passes=[x, x * 1.01, x * 0.99]),
                        cell("directq fw3bw6", 0, 1, passes=[1.0, 1.0, 1.0]))}
        self.assertEqual(stats.runs_disagree([run(0.8), run(1.0)]), [0])
        self.assertEqual(stats.runs_disagree([run(1.0), run(1.0)]), [])

    def test_targets_ratio_at_the_slowest_link(self):
        cs = [cell("fp32", 0, 1000), cell("fp32", 10, 100), cell("aqsgd fw3bw6", 0, 1000), cell("aqsgd fw3bw6", 10, 510),
              cell("aqsgd fw3bw6", 100, 800)]
        t = by_key(stats.targets(cs))
        self.assertEqual(t["aq_vs_fp32_slowest"]["value"], "5.10x")
        self.assertTrue(t["aq_vs_fp32_slowest"]["ok"])
        self.assertEqual(t["aqsgd fw3bw6 100 vs unshaped"]["value"], "80%")
        self.assertFalse(t["aqsgd fw3bw6 100 vs unshaped"]["ok"])
        cs[3]["samples_per_s"] = 490
        self.assertFalse(by_key(stats.targets(cs))["aq_vs_fp32_slowest"]["ok"])

    def test_targets_aq_vs_directq_is_two_sided(self):
        cs = [cell("aqsgd fw3bw6", 0, 1070), cell("directq fw3bw6", 0, 1000),
              cell("aqsgd fw3bw6", 100, 960), cell("directq fw3bw6", 100, 1000)]
        t = by_key(stats.targets(cs))["aq_vs_dq_table"]
        self.assertEqual(t["value"], "worst +7% at unshaped (furthest behind: -4% at 100)")
        self.assertFalse(t["ok"])

    def test_targets_count_limits_of_the_issue_cells_only(self):
        cs = [cell("fp32", 10, 100, achieved_vs_min_limits=0.89), cell("fp32", 100, 900),
              cell("fp32 gpipe", 10, 50, schedule="gpipe", achieved_vs_min_limits=0.5),
              cell("aqsgd fw3bw6 +dpu", 10, 50, grid="2x4", dp=2, dp_delayed_update=True, achieved_vs_min_limits=0.8)]
        t = by_key(stats.targets(cs))
        self.assertEqual(t["limits"]["value"], "1/2")
        self.assertFalse(t["limits"]["ok"])
        self.assertEqual(t["schedule_limits"]["value"], "2/2")
        self.assertIsNone(t["compared_limits"]["ok"])
        self.assertEqual(t["delayed_limits"]["value"], "0/1 (lowest 0.80: aqsgd fw3bw6 +dpu at 10)")

    def test_dp_wait_reads_new_style_step_events(self):
        c = cell("aqsgd fw3bw6", 10, 1, grid="2x4", dp=2, steps_timed=4, samples_per_s_passes=[1, 1])
        # 2 timed steps per pass x 2 bandwidths: the window is the 4 steps before the last one.
        events = [("step", {"stage": s, "step": i, "bandwidth_mbps": 10.0 if i % 2 else 0.0,
                            "dp": {"seconds": 0.1 * i, "bytes": 1000}}) for i in range(10) for s in (0, 1)]
        events += [("eval", {"stage": 0, "step": 9}), ("step", {"stage": 0, "step": 8, "bandwidth_mbps": 10.0})]
        mean, n = stats.dp_wait(events, c, 2)
        self.assertEqual(n, 2)  # steps 5 and 7 (step 9 is the run's final one)
        self.assertAlmostEqual(mean, 0.6)
        self.assertIsNone(stats.dp_wait([("step", {"stage": 0, "step": 1})], c, 2))


class RenderTest(unittest.TestCase):
    def test_replace_block(self):
        text = "# T\n\n<!-- x:begin -->\nold\n<!-- x:end -->\ntail\n"
        self.assertEqual(render.replace_block(text, "x", "new\n"), "# T\n\n<!-- x:begin -->\nnew\n<!-- x:end -->\ntail\n")
        self.assertEqual(render.replace_block("# T\n", "y", "b"), "# T\n\n<!-- y:begin -->\nb\n<!-- y:end -->\n")

    def test_pivot(self):
        cs = [cell("fp32", 0, 1000.4), cell("fp32", 10, 99.6), cell("aqsgd fw3bw6", 0, 900)]
        self.assertEqual(render.pivot(cs).splitlines(),
                         ["| link | fp32 | aqsgd fw3bw6 |", "|---|---:|---:|", "| unshaped | 1000 | 900 |", "| 10 | 100 |  |"])

    def test_render_synthetic_run(self):
        cs = [cell("fp32", 0, 1000), cell("fp32", 10, 100), cell("aqsgd fw3bw6", 0, 1000), cell("aqsgd fw3bw6", 10, 520)]
        run = data.Run(cs, meta={"build": "abc1234", "finished": "2026-01-01T00:00Z", "wall_seconds": "10"})
        page = render.benchmarks_section(run)
        self.assertIn("| AQ-SGD fw3bw6 / fp32 samples/s at 10 Mbit/s (>= 5x) | 5.20x | yes |", page)
        self.assertIn("build abc1234", page)
        self.assertIn("## All cells, with limits", render.run_page(run))
        self.assertLessEqual(max(len(x) for x in page.splitlines()), 300)


class CollectTest(unittest.TestCase):
    def test_collect_then_load(self):
        tmp = tempfile.mkdtemp()
        self.addCleanup(shutil.rmtree, tmp)
        out, dd = os.path.join(tmp, "out"), os.path.join(tmp, "data")
        os.makedirs(os.path.join(out, "netns"))
        cs = [cell("aqsgd fw3bw6", 0, 1000), cell("directq fw3bw6", 0, 1010)]
        for name in ("slownet.jsonl", "paired.jsonl", "paired_repeat_2.jsonl"):
            with open(os.path.join(out, name), "w") as fd:
                fd.write("".join(json.dumps(c) + "\n" for c in cs))
        files = {"command": "build/aqswarm bench slownet --json", "wall_seconds": "12", "build": "abc1234",
                 "paired_repeat_2_command": "cmd2", "paired_repeat_2_when": "started X, build abc1234",
                 "paired_failures": "paired run 2, try 1: exit 1: boom\n", "probe_start": "[0.2, 0.1, 0.3]",
                 "netns/summary.txt": "mode ...\n"}
        for name, text in files.items():
            with open(os.path.join(out, name), "w") as fd:
                fd.write(text + "\n")
        os.makedirs(dd)
        with open(os.path.join(dd, "slownet_paired_repeat_5.jsonl"), "w") as fd:  # a stale repeat goes
            fd.write(json.dumps(cs[0]) + "\n")
        meta = data.collect(out, os.path.join(out, "slownet.jsonl"), dd)
        self.assertEqual(meta["build"], "abc1234")
        self.assertEqual(meta["probe_start"], [0.2, 0.1, 0.3])
        self.assertEqual(meta["paired_failures"], ["paired run 2, try 1: exit 1: boom"])
        self.assertFalse(os.path.exists(os.path.join(dd, "slownet_paired_repeat_5.jsonl")))
        run = data.load(dd)
        self.assertEqual([k for k, _ in run.repeats], [2])
        self.assertEqual(run.repeat_info(2), ("cmd2", "started X, build abc1234"))
        self.assertIn("0.10-0.30 s (median 0.20, slowest 200% above the fastest)", render.run_page(run))
        self.assertIn("`paired run 2, try 1: exit 1: boom`", render.run_page(run))


class DpWaitCollectTest(unittest.TestCase):
    """collect() reads stage 0's DP waits through aqswarm_events.read_events (here a stand-in)."""

    def test_dp_waits_of_a_delayed_cell_and_its_twin(self):
        import types
        fake = types.ModuleType("aqswarm_events")

        def read_events(path):
            with open(path) as fd:
                for line in fd:
                    (kind, ev), = json.loads(line).items()
                    yield kind, ev
        fake.read_events = read_events
        saved = sys.modules.get("aqswarm_events")
        sys.modules["aqswarm_events"] = fake
        self.addCleanup(lambda: sys.modules.pop("aqswarm_events") if saved is None
                        else sys.modules.__setitem__("aqswarm_events", saved))
        tmp = tempfile.mkdtemp()
        self.addCleanup(shutil.rmtree, tmp)
        cs = [cell(lab, b, 1, grid="2x4", dp=2, steps_timed=4, samples_per_s_passes=[1, 1], **extra)
              for lab, extra in (("aqsgd fw3bw6", {}), ("aqsgd fw3bw6 +dpu", {"dp_delayed_update": True}))
              for b in (0, 10)]
        for lab, wait in (("aqsgd fw3bw6", 0.05), ("aqsgd fw3bw6 +dpu", 0.002)):
            d = os.path.join(tmp, "runs", "slownet-2x4-" + lab.replace(" ", "_").replace("+", "_") + "-sweep", "run")
            os.makedirs(d)
            with open(os.path.join(d, "events.jsonl"), "w") as fd:
                for i in range(6):  # steps 1-4 are the window (2 timed steps x 2 bandwidths); 5 is the last
                    fd.write(json.dumps({"step": {"stage": 0, "step": i, "bandwidth_mbps": 10.0 * (i % 2),
                                                  "dp": {"seconds": wait * (1 + i % 2), "bytes": 10}}}) + "\n")
        waits = data.dp_waits(tmp, cs)
        self.assertEqual(sorted(waits), ["2x4 aqsgd fw3bw6 +dpu @ 10", "2x4 aqsgd fw3bw6 +dpu @ unshaped",
                                         "2x4 aqsgd fw3bw6 @ 10", "2x4 aqsgd fw3bw6 @ unshaped"])
        self.assertAlmostEqual(waits["2x4 aqsgd fw3bw6 @ 10"][0], 0.1)
        self.assertEqual(waits["2x4 aqsgd fw3bw6 @ 10"][1], 2)
        self.assertAlmostEqual(waits["2x4 aqsgd fw3bw6 +dpu @ unshaped"][0], 0.002)
        run = data.Run(cs, meta={"dp_wait": waits})
        self.assertIn("aqsgd fw3bw6 @ 10: 100.0 -> 4.0 ms (2 step lines, both pipelines)", render.run_page(run))


class CommittedRunTest(unittest.TestCase):
    """The committed run (docs/data/slownet*) renders to the published figures."""

    @classmethod
    def setUpClass(cls):
        cls.published = data.load(DATA)
        cls.targets = by_key(stats.targets(cls.published.cells, cls.published.paired, cls.published.repeats))

    def test_headline_targets(self):
        t = self.targets
        self.assertEqual(t["aq_vs_fp32_slowest"]["value"], "5.23x")
        self.assertEqual(t["aqsgd fw3bw6 100 vs unshaped"]["value"], "99%")
        self.assertEqual(t["aqsgd fw4bw8 100 vs unshaped"]["value"], "102%")
        self.assertEqual(t["aq_vs_dq_table"]["value"], "worst -6% at unshaped")
        self.assertFalse(t["aq_vs_dq_table"]["ok"])
        self.assertEqual(t["aq_vs_dq_paired"]["value"], "worst -2.7% at 100")
        self.assertEqual(t["aq_vs_dq_each_run"]["value"], "worst -7.7% at 100 (run 3)")
        self.assertEqual(t["aq_vs_dq_pooled"]["value"],
                         "furthest behind -2.3% at 500 (interval -6.4..+2.3%); "
                         "unshaped -1.6%, 1000 -1.3%, 500 -2.3%, 300 -1.7%, 100 -2.1%")
        self.assertTrue(t["aq_vs_dq_pooled"]["ok"])
        self.assertEqual(t["limits"]["value"], "28/28")
        self.assertEqual(t["schedule_limits"]["value"], "28/28")
        self.assertEqual(t["paired_limits"]["value"], "8/8 (lowest 0.97: aqsgd fw3bw6 at 100)")
        self.assertEqual(t["delayed_limits"]["value"], "4/4 (lowest 0.95: aqsgd fw3bw6 +qadam4 +dpu at 10)")
        self.assertEqual(t["compared_limits"]["value"], "7/10 / 9/10")

    def test_tables(self):
        page = render.benchmarks_section(self.published)
        self.assertIn("| 10 | 146 | 763 | 761 | 576 | 145 | 75 |", page)
        self.assertIn("| 100 | 0.927 | 1.084 | 1.054 | 1.020 | 0.821 | 0.667 |", page)
        self.assertIn("| 10 | 286 | 859 | 289 | 1002 | 990 | 878 |", page)
        self.assertIn("bbr 5.95x, cubic 5.39x", page)
        full = render.run_page(self.published)
        self.assertIn("| 1x4 | aqsgd fw3bw6 | adaptive | 10 | 760.7 | 0.722 | 1123.4 | - | 806.8 | 784.1 | 0.94 | 0.97 | "
                      "875 | 1549 | 0 | 1.90 | 1055 | 759 / 763 / 761 |", full)
        self.assertIn("**AQ-SGD vs fp32 at 10 Mbit/s: 5.23x** = the ratio of their schedule link limits, 5.36", full)
        self.assertIn("aqsgd fw3bw6 @ 10: 97.3 -> 3.0 ms", full)
        self.assertIn("at most 15 micro-batches in flight at stage 0, 11 at stage 1", full)

    def test_published_page_is_the_rendering(self):
        """docs/BENCHMARKS.md and docs/notebook/slownet_run.md hold what the committed data renders to."""
        with open(os.path.join(ROOT, "docs", "BENCHMARKS.md")) as fd:
            doc = fd.read()
        self.assertEqual(render.section_from(doc, "slownet"), render.benchmarks_section(self.published))
        with open(os.path.join(ROOT, "docs", "notebook", "slownet_run.md")) as fd:
            self.assertEqual(fd.read(), render.run_page(self.published))


class ComponentPagesTest(unittest.TestCase):
    """docs/BENCHMARKS.md's other sections are what scripts/render_benchmarks.py renders from docs/data."""

    def test_sections_are_the_rendering(self):
        import render_benchmarks
        with open(os.path.join(ROOT, "docs", "BENCHMARKS.md")) as fd:
            doc = fd.read()
        for name, section in render_benchmarks.SECTIONS.items():
            with self.subTest(section=name):
                self.assertEqual(render_benchmarks.block(doc, name), "\n".join(section()))

    def test_page_is_short(self):
        with open(os.path.join(ROOT, "docs", "BENCHMARKS.md")) as fd:
            doc = fd.read()
        self.assertLessEqual(len(doc.encode()), 30 * 1024)
        self.assertLessEqual(max(len(x) for x in doc.splitlines()), 300)


if __name__ == "__main__":
    unittest.main()
