#!/usr/bin/env python3
"""Writes the Grafana dashboards in this folder (run it after editing a panel here).

Every expression uses only metrics from `aqswarm metrics list`; the test
tests/integration/dashboards_test.sh checks that, and tests/integration/
prometheus_test.cc runs every expression against a real Prometheus scraping a
local swarm. Grafana variables used: $__rate_interval, $instance.
"""
import json
import os

DS = {"type": "prometheus", "uid": "aqswarm-prometheus"}
RI = "$__rate_interval"


def panel(pid, title, exprs, unit="short", x=0, y=0, w=12, h=8, kind="timeseries", legend=None):
    targets = []
    for i, e in enumerate(exprs):
        expr, fmt = e if isinstance(e, tuple) else (e, legend)
        t = {"datasource": DS, "expr": expr, "refId": chr(ord("A") + i)}
        if fmt:
            t["legendFormat"] = fmt
        targets.append(t)
    return {"id": pid, "type": kind, "title": title, "datasource": DS, "gridPos": {"x": x, "y": y, "w": w, "h": h},
            "fieldConfig": {"defaults": {"unit": unit}, "overrides": []}, "options": {}, "targets": targets}


def layout(panels):
    out = []
    for i, p in enumerate(panels):
        p = dict(p)
        p["id"] = i + 1
        p["gridPos"] = {"x": (i % 2) * 12, "y": (i // 2) * 8, "w": 12, "h": 8}
        out.append(p)
    return out


def dashboard(uid, title, panels, templating=()):
    return {"uid": uid, "title": title, "tags": ["aqswarm"], "timezone": "browser", "schemaVersion": 37,
            "version": 1, "editable": True, "refresh": "10s", "time": {"from": "now-30m", "to": "now"},
            "templating": {"list": list(templating)}, "annotations": {"list": []}, "panels": layout(panels)}


overview = dashboard("aqswarm-overview", "aqswarm: swarm overview", [
    panel(0, "Peers by state", [("aqswarm_coordinator_peers", "{{state}}")]),
    panel(0, "Assignment version, grid complete", [
        ("aqswarm_coordinator_assignment_version", "assignment version"),
        ("aqswarm_coordinator_grid_complete", "grid complete")]),
    panel(0, "Training loss", [("aqswarm_train_loss", "{{instance}}"), ("aqswarm_coordinator_loss", "coordinator")]),
    panel(0, "Tokens/s", [
        (f"rate(aqswarm_train_tokens_total[{RI}])", "{{instance}}"),
        ("aqswarm_coordinator_tokens_per_second", "swarm (coordinator)")]),
    panel(0, "Step time split (all stages)",
          [(f"sum by (phase) (rate(aqswarm_step_phase_seconds_total[{RI}]))", "{{phase}}")], unit="s"),
    panel(0, "Steps/s by stage", [(f"rate(aqswarm_steps_total[{RI}])", "{{instance}}")]),
    panel(0, "Lease expiries, heartbeats/s", [
        (f"increase(aqswarm_coordinator_lease_expiries_total[{RI}])", "lease expiries"),
        (f"rate(aqswarm_coordinator_heartbeats_total[{RI}])", "heartbeats/s")]),
    panel(0, "Rejected messages and requests by reason", [
        (f"sum by (reason) (rate(aqswarm_peer_rejected_messages_total[{RI}]))", "peer: {{reason}}"),
        (f"sum by (reason) (rate(aqswarm_coordinator_rejected_requests_total[{RI}]))", "coordinator: {{reason}}")]),
])

links = dashboard("aqswarm-links", "aqswarm: links and compression", [
    panel(0, "Bytes/s on the wire (sent)", [
        (f'sum by (link, kind) (rate(aqswarm_link_bytes_total{{direction="sent"}}[{RI}]))', "{{link}} {{kind}}")],
          unit="Bps"),
    panel(0, "Effective compression ratio (float32 bytes / wire bytes)", [
        (f'sum by (link, kind) (rate(aqswarm_link_raw_bytes_total[{RI}])) / '
         f'sum by (link, kind) (rate(aqswarm_link_bytes_total{{direction="sent"}}[{RI}]))', "{{link}} {{kind}}"),
        ("aqswarm_link_compression_ratio", "{{link}} {{kind}} (last step)")]),
    panel(0, "Relative quantization error ||x - x_hat|| / ||x||",
          [("aqswarm_link_quantization_error_ratio", "{{link}} {{kind}}")], unit="percentunit"),
    panel(0, "AQ-SGD rows/s by type", [
        (f"sum by (link, type) (rate(aqswarm_aqsgd_rows_sent_total[{RI}]))", "{{link}} {{type}}")]),
    panel(0, "AQ-SGD delta share of rows", [
        (f'sum by (link) (rate(aqswarm_aqsgd_rows_sent_total{{type="delta"}}[{RI}])) / '
         f'sum by (link) (rate(aqswarm_aqsgd_rows_sent_total[{RI}]))', "{{link}}")], unit="percentunit"),
    panel(0, "AQ-SGD resends (rows/s)", [
        (f"sum by (link, role) (rate(aqswarm_aqsgd_resent_rows_total[{RI}]))", "{{link}} {{role}}")]),
    panel(0, "Data-parallel exchange bytes/s", [
        (f'sum by (link) (rate(aqswarm_link_bytes_total{{kind="dp"}}[{RI}]))', "{{link}}")], unit="Bps"),
    panel(0, "Bytes/s received", [
        (f'sum by (link, kind) (rate(aqswarm_link_bytes_total{{direction="received"}}[{RI}]))', "{{link}} {{kind}}")],
          unit="Bps"),
])

instance_var = {"name": "instance", "type": "query", "datasource": DS, "label": "peer",
                "query": {"query": "label_values(aqswarm_peer_info, instance)", "refId": "instance"},
                "definition": "label_values(aqswarm_peer_info, instance)", "refresh": 2, "includeAll": True,
                "multi": True, "allValue": ".*", "current": {}}
I = 'instance=~"$instance"'
peer = dashboard("aqswarm-peer", "aqswarm: peer detail", [
    panel(0, "Stage and pipeline", [(f"aqswarm_peer_info{{{I}}}", "{{instance}} {{job}} stage {{stage}} pipeline {{pipeline}}")]),
    panel(0, "Step time split", [
        (f"rate(aqswarm_step_phase_seconds_total{{{I}}}[{RI}])", "{{instance}} {{phase}}")], unit="s"),
    panel(0, "Step duration p50 / p90", [
        (f"histogram_quantile(0.5, sum by (le, instance) (rate(aqswarm_step_duration_seconds_bucket{{{I}}}[{RI}])))",
         "{{instance}} p50"),
        (f"histogram_quantile(0.9, sum by (le, instance) (rate(aqswarm_step_duration_seconds_bucket{{{I}}}[{RI}])))",
         "{{instance}} p90")], unit="s"),
    panel(0, "Loss, tokens/s", [
        (f"aqswarm_train_loss{{{I}}}", "{{instance}} loss"),
        (f"aqswarm_train_tokens_per_second{{{I}}}", "{{instance}} tokens/s")]),
    panel(0, "Store reads: hits, misses, evictions, corrupt rows (rows/s)", [
        (f"rate(aqswarm_store_hits_total{{{I}}}[{RI}])", "{{instance}} hits"),
        (f"rate(aqswarm_store_misses_total{{{I}}}[{RI}])", "{{instance}} misses"),
        (f"rate(aqswarm_store_evictions_total{{{I}}}[{RI}])", "{{instance}} evictions"),
        (f"rate(aqswarm_store_corrupt_rows_total{{{I}}}[{RI}])", "{{instance}} corrupt")]),
    panel(0, "Store get/put latency (mean per batch)", [
        (f"rate(aqswarm_store_operation_seconds_total{{{I}}}[{RI}]) / rate(aqswarm_store_operations_total{{{I}}}[{RI}])",
         "{{instance}} {{op}}")], unit="s"),
    panel(0, "Store size", [
        (f"aqswarm_store_live_bytes{{{I}}}", "{{instance}} live"),
        (f"aqswarm_store_capacity_bytes{{{I}}}", "{{instance}} budget")], unit="bytes"),
    panel(0, "Prefetcher hits / misses (rows/s)", [
        (f"rate(aqswarm_prefetch_hits_total{{{I}}}[{RI}])", "{{instance}} {{role}} hits"),
        (f"rate(aqswarm_prefetch_misses_total{{{I}}}[{RI}])", "{{instance}} {{role}} misses")]),
    panel(0, "Link bytes/s", [
        (f"rate(aqswarm_link_bytes_total{{{I}}}[{RI}])", "{{link}} {{kind}} {{direction}}")], unit="Bps"),
    panel(0, "Rejected messages by reason", [
        (f"rate(aqswarm_peer_rejected_messages_total{{{I}}}[{RI}])", "{{instance}} {{reason}}")]),
], templating=[instance_var])

here = os.path.dirname(os.path.abspath(__file__))
for name, d in [("swarm_overview", overview), ("links_compression", links), ("peer_detail", peer)]:
    with open(os.path.join(here, name + ".json"), "w") as f:
        json.dump(d, f, indent=2)
        f.write("\n")
