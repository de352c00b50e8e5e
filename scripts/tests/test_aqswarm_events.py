"""Tests of scripts/aqswarm_events.py on lines shaped as proto/event_json.h
prints them (its own C++ test checks the printing)."""
import math
import os
import sys
import tempfile
import unittest

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
import aqswarm_events as ev  # noqa: E402


STEP = ('{"step":{"stage":0,"pipeline":1,"step":3,"epoch":0,"loss":5.5,"loss_not_finite":false,'
        '"grad_norm":1.5,"step_seconds":0.25,"compute_seconds":0.2,"wait_seconds":0.05,"cpu_seconds":0.3,'
        '"sys_seconds":0.01,"tokens":"2048","minor_faults":"10","ctx_switches":"3","invol_ctx_switches":"1",'
        '"fw_bytes":"1099511627776","bw_bytes":"12","bandwidth_mbps":10,'
        '"dp":{"seconds":0.1,"bytes":"100","raw_bytes":"400","param_hash":"00ff00ff00ff00ff"}}}')


class ParseTest(unittest.TestCase):
    def test_step_event_has_ints_and_groups(self):
        kind, e = ev.parse_stage_event(STEP)
        self.assertEqual(kind, "step")
        self.assertEqual(e["fw_bytes"], 1 << 40)
        self.assertIsInstance(e["tokens"], int)
        self.assertEqual(e["dp"]["bytes"], 100)
        self.assertEqual(e["stage"], 0)
        self.assertNotIn("sender", e)

    def test_nan_loss_is_a_float(self):
        kind, e = ev.parse_stage_event('{"step":{"loss":"NaN","loss_not_finite":true}}')
        self.assertTrue(math.isnan(e["loss"]))
        self.assertTrue(e["loss_not_finite"])

    def test_peer_line_passing_a_stage_event_on(self):
        kind, e = ev.parse_event('{"stage":{"eval":{"step":4,"val_loss":4.25}}}')
        self.assertEqual((kind, e["val_loss"], e["step"]), ("eval", 4.25, 4))
        kind, e = ev.parse_event('{"joined":{"peer_id":"7","lease_s":10,"state_port":4000}}')
        self.assertEqual((kind, e["peer_id"]), ("joined", 7))

    def test_bad_lines_raise(self):
        for bad in ["not json", "{}", '{"step":{"bogus":1}}', '{"event":"step","step":3}',
                    '{"step":{"loss":nan}}']:
            with self.assertRaises(ev.EventError, msg=bad):
                ev.parse_event(bad)

    def test_read_events_skips_log_text_and_filters(self):
        with tempfile.NamedTemporaryFile("w", suffix=".jsonl", delete=False) as f:
            f.write("a log line\n" + STEP + "\n" + '{"eval":{"step":3,"val_loss":4.0}}\n')
        try:
            self.assertEqual([k for k, _ in ev.read_events(f.name)], ["step", "eval"])
            self.assertEqual([k for k, _ in ev.read_events(f.name, kinds={"eval"})], ["eval"])
        finally:
            os.unlink(f.name)

    def test_fields_command_for_shell_scripts(self):
        import io
        from contextlib import redirect_stdout
        with tempfile.NamedTemporaryFile("w", suffix=".jsonl", delete=False) as f:
            f.write(STEP + "\n" + '{"listening":{"port":4100}}\n{"step":{"ste')  # a half-written last line
        try:
            buf = io.StringIO()
            with redirect_stdout(buf):
                self.assertEqual(ev._main(["fields", "step", "step", "fw_bytes", "dp.bytes", "--", f.name]), 0)
            self.assertEqual(buf.getvalue(), "3 1099511627776 100\n")
            with self.assertRaises(ev.EventError):
                list(ev.read_events(f.name))
        finally:
            os.unlink(f.name)


if __name__ == "__main__":
    unittest.main()
