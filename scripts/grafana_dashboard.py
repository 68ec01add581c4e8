"""The Grafana dashboard for the router's /metrics, generated from the panel list below.

    python -m scripts.grafana_dashboard           # writes configs/grafana-dashboard.json
    python -m scripts.grafana_dashboard --check   # exit 1 if the file is not what it would write

Every query selects `job=~"$job", instance=~"$instance"`, so one dashboard shows one router
or several; `$datasource` picks the Prometheus data source.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import sys
from pathlib import Path
from typing import Any

OUTPUT = Path(__file__).resolve().parent.parent / "configs" / "grafana-dashboard.json"
DATASOURCE = {"type": "prometheus", "uid": "${datasource}"}
SELECT = 'job=~"$job", instance=~"$instance"'
WINDOW = "$__rate_interval"


def rate(metric: str, by: str, matchers: str = "") -> str:
    """Per-second rate of a counter, summed by the labels `by`."""
    return f"sum by ({by}) (rate({metric}{{{SELECT}{matchers}}}[{WINDOW}]))"


def quantile(q: float, histogram: str) -> str:
    return (f"histogram_quantile({q}, sum by (le, mode) "
            f"(rate({histogram}_bucket{{{SELECT}}}[{WINDOW}])))")


@dataclasses.dataclass
class Panel:
    title: str
    description: str
    targets: list[tuple[str, str]]  # (PromQL, legend)
    unit: str = "cps"
    kind: str = "timeseries"
    width: int = 8


ERRORS = (f'sum(rate(pdproxy_requests_total{{{SELECT}, status!~"2.."}}[{WINDOW}])) '
          f"/ sum(rate(pdproxy_requests_total{{{SELECT}}}[{WINDOW}]))")

ROWS: list[tuple[str, list[Panel]]] = [
    ("Traffic", [
        Panel("Requests by status", "Client requests per second by HTTP status "
              "(client_closed: the client left first).",
              [(rate("pdproxy_requests_total", "status"), "{{status}}")], "reqps"),
        Panel("Requests by mode", "Client requests per second by the KV transfer mode used "
              "(pull or push).",
              [(rate("pdproxy_requests_total", "mode"), "{{mode}}")], "reqps"),
        Panel("Error ratio", "Share of client requests that did not end in a 2xx "
              "(client disconnects included).",
              [(ERRORS, "non-2xx")], "percentunit"),
    ]),
    ("Latency", [
        Panel("Time to first byte by mode", "p50/p90/p99 from the client's request to the "
              "first byte of the answer, by mode.",
              [(quantile(q, "pdproxy_time_to_first_byte_seconds"), f"p{round(q * 100)} {{{{mode}}}}")
               for q in (0.5, 0.9, 0.99)], "s"),
        Panel("Prefill latency p99 by mode", "p99 of P's answer time (its prompt plus one "
              "token), by mode.",
              [(quantile(0.99, "pdproxy_prefill_latency_seconds"), "p99 {{mode}}")], "s"),
        Panel("Decode first token p99 by mode", "p99 from sending D its request to D's first "
              "byte, by mode.",
              [(quantile(0.99, "pdproxy_decode_time_to_first_token_seconds"), "p99 {{mode}}")],
              "s"),
    ]),
    ("Endpoints", [
        Panel("In flight per endpoint", "Requests in flight on each P and D server.",
              [(f"sum by (cluster, endpoint) (pdproxy_endpoint_in_flight{{{SELECT}}})",
                "{{cluster}} {{endpoint}}")], "short", width=12),
        Panel("In flight per cluster", "Requests in flight on all prefill and all decode "
              "servers.",
              [(f"sum by (cluster) (pdproxy_endpoint_in_flight{{{SELECT}}})", "{{cluster}}")],
              "short", width=12),
        Panel("Endpoint health", "Whether each server passes its health checks (down after "
              "failed checks or a refused connection; ejections are not shown here).",
              [(f"min by (cluster, endpoint) (pdproxy_endpoint_healthy{{{SELECT}}})",
                "{{cluster}} {{endpoint}}")], "short", "state-timeline", width=24),
        Panel("Upstream errors", "Failed calls to P and D per second, by server and kind "
              "(connect, timeout, protocol, status).",
              [(rate("pdproxy_upstream_errors_total", "cluster, endpoint, kind"),
                "{{kind}} {{cluster}} {{endpoint}}")], width=12),
        Panel("Ejections", "Servers taken out of their cluster after failures in a row, per "
              "interval.",
              [(f"sum by (cluster, endpoint) (increase(pdproxy_ejections_total{{{SELECT}}}"
                f"[{WINDOW}]))", "{{cluster}} {{endpoint}}")], "short", width=12),
        Panel("Kubernetes discovery", "Pods joining, drained and leaving, lists, watch ends "
              "and errors, by cluster and kind (discovery.kubernetes).",
              [(rate("pdproxy_discovery_events_total", "cluster, kind"),
                "{{kind}} {{cluster}}")], width=12),
    ]),
    ("Retries and failures", [
        Panel("Retries", "Legs sent again to another server before any byte reached the "
              "client, by cluster and reason.",
              [(rate("pdproxy_retries_total", "cluster, reason"), "{{cluster}} {{reason}}")]),
        Panel("Retries refused", "Legs not retried because the retry budget was spent, by "
              "cluster and reason.",
              [(rate("pdproxy_retries_refused_total", "cluster, reason"),
                "{{cluster}} {{reason}}")]),
        Panel("Cancelled legs", "Upstream legs the router cancelled, by cluster and reason.",
              [(rate("pdproxy_cancelled_legs_total", "cluster, reason"),
                "{{cluster}} {{reason}}")]),
    ]),
    ("Load and safety", [
        Panel("Requests in flight", "Inference requests the router serves now "
              "(limits.max_in_flight caps them).",
              [(f"sum(pdproxy_requests_in_flight{{{SELECT}}})", "in flight")], "short",
              width=6),
        Panel("Rejected", "Requests refused by the router's own limits or checks, by reason "
              "(pool_timeout, max_in_flight, unauthorized).",
              [(rate("pdproxy_rejected_total", "reason"), "{{reason}}")], width=6),
        Panel("Clients cut", "Client connections cut for accepting no bytes (stall) or too "
              "few (slow_read) while the router waited on them, or sending their request too "
              "slowly (slow_request).",
              [(rate("pdproxy_client_cuts_total", "reason"), "{{reason}}")], width=6),
        Panel("Admin auth failures", "Admin API calls refused for a missing or wrong token.",
              [(f"sum(rate(pdproxy_admin_auth_failures_total{{{SELECT}}}[{WINDOW}]))",
                "refused")], width=6),
    ]),
    ("KV transfer", [
        Panel("Push recoveries", "Pushes whose P failed before D's first byte and were "
              "answered anyway: redone as a pull, or computed by D.",
              [(rate("pdproxy_push_recoveries_total", "how"), "{{how}}")], width=12),
        Panel("Push abandons", "Pushes abandoned on P's side channel after D's leg failed "
              "or the client left, so P frees the prompt's blocks (sent or dropped).",
              [(rate("pdproxy_push_abandons_total", "result"), "{{result}}")], width=12),
        Panel("Mode fallbacks", "Requests that asked for a mode the chosen servers cannot do "
              "and got another, by reason.",
              [(rate("pdproxy_mode_fallbacks_total", "requested, used, reason"),
                "{{requested}} -> {{used}} {{reason}}")], width=12),
        Panel("Auto mode decisions", "Requests in auto mode by the mode chosen and why.",
              [(rate("pdproxy_auto_mode_decisions_total", "mode, reason"),
                "{{mode}} {{reason}}")], width=12),
        Panel("Push layers decisions", "Pushes the router asked P to write layer by layer "
              "(on) or whole (off), learned per prompt length (auto.push_layers: learn), "
              "and why.",
              [(rate("pdproxy_push_layers_decisions_total", "layers, reason"),
                "{{layers}} {{reason}}")], width=12),
        Panel("Prefill probes", "Probes of a P's KV coordinates, by server and result.",
              [(rate("pdproxy_prefill_probes_total", "endpoint, result"),
                "{{result}} {{endpoint}}")], width=12),
        Panel("Missing kv_transfer_params", "P answers without usable kv_transfer_params, by "
              "what the router did (error or recompute on D).",
              [(rate("pdproxy_missing_kv_transfer_params_total", "action"), "{{action}}")],
              width=12),
    ]),
    ("KV-aware routing", [
        Panel("Predicted prefix hits", "p50/p90 of the share of the prompt the chosen "
              "server held by the KV index, per leg (kv_aware).",
              [(f"histogram_quantile({q}, sum by (le, cluster) (rate("
                f"pdproxy_kv_predicted_hit_ratio_bucket{{{SELECT}}}[{WINDOW}])))",
                f"p{round(q * 100)} {{{{cluster}}}}") for q in (0.5, 0.9)],
              "percentunit"),
        Panel("Actual prefix hits", "p50/p90 of the share of the prompt P says it found in "
              "its prefix cache (vLLM's --enable-prompt-tokens-details).",
              [(f"histogram_quantile({q}, sum by (le, cluster) (rate("
                f"pdproxy_kv_actual_hit_ratio_bucket{{{SELECT}}}[{WINDOW}])))",
                f"p{round(q * 100)} {{{{cluster}}}}") for q in (0.5, 0.9)],
              "percentunit"),
        Panel("Index blocks per server", "Blocks of each server's prefix cache the KV index "
              "holds, per data-parallel rank.",
              [(f"sum by (endpoint, rank) (pdproxy_kv_index_blocks{{{SELECT}}})",
                "{{endpoint}} rank {{rank}}")], "short"),
        Panel("Index in sync", "1 while a server's KV events are applied without a gap; 0 "
              "while it is unknown (catching up or replaying).",
              [(f"min by (endpoint, rank) (pdproxy_kv_index_synced{{{SELECT}}})",
                "{{endpoint}} rank {{rank}}")], "short"),
        Panel("KV event batches", "Event batches per second per server, by outcome "
              "(applied, duplicate: already delivered by a replay).",
              [(rate("pdproxy_kv_event_batches_total", "endpoint, outcome"),
                "{{outcome}} {{endpoint}}")]),
        Panel("KV events dropped, replays", "Garbage dropped per server and reason, and "
              "replays asked after gaps.",
              [(rate("pdproxy_kv_events_dropped_total", "endpoint, reason"),
                "dropped {{reason}} {{endpoint}}"),
               (rate("pdproxy_kv_event_replays_total", "endpoint"), "replay {{endpoint}}")]),
        Panel("KV event lag", "Age of each server's last event batch when applied.",
              [(f"max by (endpoint) (pdproxy_kv_event_lag_seconds{{{SELECT}}})",
                "{{endpoint}}")], "s"),
        Panel("Picks by load alone", "kv_aware picks made without KV knowledge, by cluster "
              "and reason (no_publisher, not_synced, no_tokens).",
              [(rate("pdproxy_kv_fallbacks_total", "cluster, reason"),
                "{{cluster}} {{reason}}")], width=12),
        Panel("Tokenize time p99", "p99 of a prompt's POST /tokenize to a server (kv_aware).",
              [(f"histogram_quantile(0.99, sum by (le) (rate("
                f"pdproxy_kv_tokenize_seconds_bucket{{{SELECT}}}[{WINDOW}])))", "p99")], "s",
              width=12),
        Panel("Prompts seen lately", "kv_aware prompts found in the cache of prompts seen "
              "lately (hit: no /tokenize call, no hashing) or not (miss).",
              [(rate("pdproxy_kv_tokenize_cache_total", "result"), "{{result}}")], width=12),
    ]),
]

HEALTH_MAPPING = [{"type": "value", "options": {
    "0": {"text": "unhealthy", "color": "red", "index": 0},
    "1": {"text": "healthy", "color": "green", "index": 1},
}}]


def panel_json(panel: Panel, panel_id: int, x: int, y: int) -> dict[str, Any]:
    defaults: dict[str, Any] = {"unit": panel.unit}
    options: dict[str, Any] = {"legend": {"displayMode": "list", "placement": "bottom",
                                          "showLegend": True},
                               "tooltip": {"mode": "multi", "sort": "desc"}}
    if panel.kind == "state-timeline":
        defaults.update(mappings=HEALTH_MAPPING, color={"mode": "thresholds"},
                        thresholds={"mode": "absolute", "steps": [
                            {"color": "red", "value": None}, {"color": "green", "value": 1}]})
        options.update(showValue="never", mergeValues=True, rowHeight=0.9)
    else:
        defaults.update(min=0, custom={"fillOpacity": 10, "showPoints": "never"})
    return {
        "id": panel_id, "type": panel.kind, "title": panel.title,
        "description": panel.description, "datasource": DATASOURCE,
        "gridPos": {"h": 8, "w": panel.width, "x": x, "y": y},
        "fieldConfig": {"defaults": defaults, "overrides": []}, "options": options,
        "targets": [{"refId": chr(ord("A") + i), "datasource": DATASOURCE, "expr": expr,
                     "legendFormat": legend, "range": True}
                    for i, (expr, legend) in enumerate(panel.targets)],
    }


def variable(name: str, label: str, query: str) -> dict[str, Any]:
    return {"name": name, "label": label, "type": "query", "datasource": DATASOURCE,
            "query": query, "definition": query, "refresh": 2, "sort": 1, "multi": True,
            "includeAll": True, "allValue": ".*", "current": {}, "options": [], "hide": 0}


def dashboard() -> dict[str, Any]:
    panels: list[dict[str, Any]] = []
    y = 0
    for title, row in ROWS:
        panels.append({"id": len(panels) + 1, "type": "row", "title": title,
                       "collapsed": False, "gridPos": {"h": 1, "w": 24, "x": 0, "y": y},
                       "panels": []})
        y, x = y + 1, 0
        for panel in row:
            if x + panel.width > 24:
                y, x = y + 8, 0
            panels.append(panel_json(panel, len(panels) + 1, x, y))
            x += panel.width
        y += 8
    return {
        "id": None, "uid": "pdproxy-router", "title": "pd-proxy router",
        "description": "The prefill/decode router's Prometheus metrics (configs/"
                       "grafana-dashboard.json, generated by scripts/grafana_dashboard.py).",
        "tags": ["pd-proxy", "vllm"], "schemaVersion": 39, "version": 1, "editable": True,
        "graphTooltip": 1, "refresh": "30s", "time": {"from": "now-1h", "to": "now"},
        "timezone": "", "annotations": {"list": []}, "links": [],
        "templating": {"list": [
            {"name": "datasource", "label": "Data source", "type": "datasource",
             "query": "prometheus", "current": {}, "options": [], "refresh": 1, "hide": 0},
            variable("job", "Job", "label_values(pdproxy_endpoint_healthy, job)"),
            variable("instance", "Router",
                     'label_values(pdproxy_endpoint_healthy{job=~"$job"}, instance)'),
        ]},
        "panels": panels,
    }


def render() -> str:
    return json.dumps(dashboard(), indent=2) + "\n"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--check", action="store_true",
                        help="exit 1 if the file differs from what would be written")
    parser.add_argument("--output", type=Path, default=OUTPUT)
    args = parser.parse_args(argv)
    text = render()
    if args.check:
        current = args.output.read_text() if args.output.exists() else None
        if current != text:
            print(f"{args.output} is stale: run python -m scripts.grafana_dashboard",
                  file=sys.stderr)
            return 1
        return 0
    args.output.write_text(text)
    return 0


if __name__ == "__main__":
    sys.exit(main())
