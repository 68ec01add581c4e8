"""The router's Prometheus metrics, one registry per app (tests build many apps).

The metrics every request updates are `proxy.loop_metrics`' (`LoopCounter`,
`LoopHistogram`: plain numbers bumped on the event loop's thread, compiled with the
request path); the rest are prometheus_client's own, some of them updated from other
threads.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Iterator
from typing import Any

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest
from prometheus_client.core import GaugeMetricFamily
from prometheus_client.registry import Collector

from proxy.loop_metrics import LoopCounter, LoopHistogram

__all__ = ["LoopCounter", "LoopHistogram", "RouterMetrics"]

# Latency buckets from 1 ms to 2 minutes: P/D TTFTs span that range on CPU and GPU.
_LATENCY_BUCKETS = (
    0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0,
    120.0,
)  # fmt: skip


class RouterMetrics:
    def __init__(self) -> None:
        self.registry = CollectorRegistry()
        self._children: dict[tuple[int, tuple[str, ...]], Any] = {}
        r = self.registry
        self.requests = LoopCounter(
            "pdproxy_requests",
            "Client requests by route, KV transfer mode used and HTTP status",
            ["route", "mode", "status"],
            registry=r,
        )
        self.time_to_first_byte = LoopHistogram(
            "pdproxy_time_to_first_byte_seconds",
            "From the client's request to the first byte of the answer sent back",
            ["mode"],
            buckets=_LATENCY_BUCKETS,
            registry=r,
        )
        self.prefill_latency = LoopHistogram(
            "pdproxy_prefill_latency_seconds",
            "P's answer time (its prompt plus one token)",
            ["mode"],
            buckets=_LATENCY_BUCKETS,
            registry=r,
        )
        self.decode_first_token = LoopHistogram(
            "pdproxy_decode_time_to_first_token_seconds",
            "From sending D its request to D's first byte",
            ["mode"],
            buckets=_LATENCY_BUCKETS,
            registry=r,
        )
        self.upstream_errors = Counter(
            "pdproxy_upstream_errors",
            "Failed upstream calls by endpoint and kind (connect, timeout, protocol, status)",
            ["cluster", "endpoint", "kind"],
            registry=r,
        )
        self.retries = Counter(
            "pdproxy_retries",
            "Legs sent again to another endpoint before any byte reached the client",
            ["cluster", "reason"],
            registry=r,
        )
        self.retries_refused = Counter(
            "pdproxy_retries_refused",
            "Legs not retried because the retry budget (a share of recent traffic) was spent",
            ["cluster", "reason"],
            registry=r,
        )
        self.ejections = Counter(
            "pdproxy_ejections",
            "Servers taken out of their cluster after failures in a row (passive ejection)",
            ["cluster", "endpoint"],
            registry=r,
        )
        self.mode_fallbacks = Counter(
            "pdproxy_mode_fallbacks",
            "Requests that asked for a mode the chosen servers cannot do, and got another",
            ["requested", "used", "reason"],
            registry=r,
        )
        self.auto_decisions = LoopCounter(
            "pdproxy_auto_mode_decisions",
            "Requests in auto mode by the mode chosen and why (auto_learning, auto_explore, "
            "auto_faster_push, auto_faster_pull, auto_pair_can_push, auto_pair_cannot_push, ...)",
            ["mode", "reason"],
            registry=r,
        )
        self.push_layers_decisions = LoopCounter(
            "pdproxy_push_layers_decisions",
            "Pushes the router chose to have written layer by layer (layers=on), whole (off) "
            "or as P's connector decides (connector: not measured, before its bucket "
            "learned), learned per prompt length (auto.push_layers: learn), and why "
            "(layers_learning, layers_faster_on, layers_faster_off, layers_explore, "
            "layers_not_learned_yet)",
            ["layers", "reason"],
            registry=r,
        )
        self.missing_kv_params = Counter(
            "pdproxy_missing_kv_transfer_params",
            "P answers without usable kv_transfer_params, by what the router did",
            ["action"],
            registry=r,
        )
        self.probes = Counter(
            "pdproxy_prefill_probes",
            "Probes of a P's KV coordinates, by result",
            ["endpoint", "result"],
            registry=r,
        )
        self.cancelled_legs = Counter(
            "pdproxy_cancelled_legs",
            "Upstream legs cancelled by the router, by cluster and reason",
            ["cluster", "reason"],
            registry=r,
        )

        self.rejected = Counter(
            "pdproxy_rejected",
            "Requests refused by the router's own limits or checks, by reason (pool_timeout: "
            "no upstream connection free in time; max_in_flight; unauthorized)",
            ["reason"],
            registry=r,
        )
        self.client_cuts = Counter(
            "pdproxy_client_cuts",
            "Client connections the router cut, by reason (stall: accepted no bytes for "
            "timeouts.client_stall of waiting on it; slow_read: accepted fewer than "
            "limits.client_min_read_rate bytes per second of waiting on it; slow_request: "
            "head or body not in within timeouts.client_request)",
            ["reason"],
            registry=r,
        )
        self.push_recoveries = Counter(
            "pdproxy_push_recoveries",
            "Pushes whose P leg failed before D's first byte and were answered anyway, by "
            "how (pull: redone as a pull on another P; recompute: D computed the prompt)",
            ["how"],
            registry=r,
        )
        self.push_abandons = Counter(
            "pdproxy_push_abandons",
            "Pushes abandoned on P's side channel after D's leg failed or the client left, so "
            "P frees the prompt's blocks (sent; dropped: P's queue was full or unreachable)",
            ["result"],
            registry=r,
        )
        self.admin_auth_failures = Counter(
            "pdproxy_admin_auth_failures",
            "Admin API calls refused for a missing or wrong token",
            registry=r,
        )
        self.discovery_events = Counter(
            "pdproxy_discovery_events",
            "Kubernetes discovery, by cluster and kind (list, list_error, watch_closed, "
            "watch_error, gone: a 410 on the watch; joined, drained, undrained, left)",
            ["cluster", "kind"],
            registry=r,
        )

        # kv_aware balancing (proxy.pool.kv)
        self.kv_event_batches = Counter(
            "pdproxy_kv_event_batches",
            "KV event batches from each server's publisher, by outcome (applied, duplicate)",
            ["endpoint", "outcome"],
            registry=r,
        )
        self.kv_events_dropped = Counter(
            "pdproxy_kv_events_dropped",
            "KV event messages dropped as garbage, by reason (frames, malformed, sequence)",
            ["endpoint", "reason"],
            registry=r,
        )
        self.kv_replays = Counter(
            "pdproxy_kv_event_replays",
            "Replays asked of a server's publisher after a gap in its sequence numbers",
            ["endpoint"],
            registry=r,
        )
        self.kv_event_lag = Gauge(
            "pdproxy_kv_event_lag_seconds",
            "Age of the last KV event batch when it was applied (publisher's clock)",
            ["endpoint"],
            registry=r,
        )
        self.kv_fallbacks = Counter(
            "pdproxy_kv_fallbacks",
            "kv_aware picks made by load alone, by cluster and reason (no_publisher, "
            "not_synced, no_tokens: the prompt could not be tokenized or is not text)",
            ["cluster", "reason"],
            registry=r,
        )
        self.kv_predicted_hits = LoopHistogram(
            "pdproxy_kv_predicted_hit_ratio",
            "Share of the prompt's tokens the chosen server holds, by the KV index, per leg",
            ["cluster"],
            buckets=(0.0, 0.1, 0.25, 0.5, 0.75, 0.9, 0.99, 1.0),
            registry=r,
        )
        self.kv_actual_hits = LoopHistogram(
            "pdproxy_kv_actual_hit_ratio",
            "Share of the prompt P says it found in its prefix cache (its usage's "
            "prompt_tokens_details.cached_tokens: vLLM's --enable-prompt-tokens-details)",
            ["cluster"],
            buckets=(0.0, 0.1, 0.25, 0.5, 0.75, 0.9, 0.99, 1.0),
            registry=r,
        )
        self.kv_tokenize_seconds = Histogram(
            "pdproxy_kv_tokenize_seconds",
            "Time to get a prompt's token ids from a server's /tokenize (kv_aware)",
            buckets=_LATENCY_BUCKETS,
            registry=r,
        )
        self.kv_tokenize_cache = LoopCounter(
            "pdproxy_kv_tokenize_cache_total",
            "kv_aware prompts found in the cache of prompts seen lately (hit: no /tokenize "
            "call and no hashing) or not (miss)",
            ["result"],
            registry=r,
        )

        # The metrics with an `endpoint` label (a server's URL): `forget_endpoint`'s.
        self._per_endpoint: list[Counter | Gauge | Histogram] = [
            m for m in vars(self).values()
            if isinstance(m, Counter | Gauge | Histogram) and "endpoint" in m._labelnames]

    def watch_kv_index(self, sources: Callable[[], Iterable[Any]]) -> None:
        """Report each KV event source's indexed blocks and sync state, read when scraped."""
        self.registry.register(_KvIndexCollector(sources))

    def watch_in_flight(self, in_flight: Callable[[], int]) -> None:
        """Report the inference requests in flight (read when scraped)."""
        Gauge("pdproxy_requests_in_flight",
              "Inference requests the router is serving now (limits.max_in_flight caps them)",
              registry=self.registry).set_function(in_flight)

    def watch_endpoints(self, endpoints: Callable[[], Iterable[Any]]) -> None:
        """Report each endpoint's in-flight count and health, read when scraped (the
        endpoints keep the numbers; nothing is updated per request)."""
        self.registry.register(_EndpointCollector(endpoints))

    def forget_endpoint(self, url: str) -> None:
        """Drop every series labelled with the server `url` (it left its clusters), so
        that servers coming and going (Kubernetes pods) do not grow the exposition."""
        for metric in self._per_endpoint:
            names = metric._labelnames
            at = names.index("endpoint")
            for family in metric.collect():
                found = {tuple(s.labels[n] for n in names) for s in family.samples
                         if s.labels.get("endpoint") == url}
                for labels in found:
                    metric.remove(*labels)
            for key in [k for k in self._children if k[0] == id(metric) and k[1][at] == url]:
                del self._children[key]

    def child(self, metric: Counter | Gauge | Histogram, *labels: str) -> Any:
        """`metric.labels(*labels)`, remembered: resolving labels is costly per request."""
        key = (id(metric), labels)
        found = self._children.get(key)
        if found is None:
            found = self._children[key] = metric.labels(*labels)
        return found

    def render(self) -> bytes:
        return generate_latest(self.registry)


class _EndpointCollector(Collector):
    def __init__(self, endpoints: Callable[[], Iterable[Any]]) -> None:
        self._endpoints = endpoints

    def collect(self) -> Iterator[GaugeMetricFamily]:
        in_flight = GaugeMetricFamily(
            "pdproxy_endpoint_in_flight",
            "Requests in flight per upstream endpoint",
            labels=["cluster", "endpoint"],
        )
        healthy = GaugeMetricFamily(
            "pdproxy_endpoint_healthy",
            "1 when the endpoint passes its health checks, else 0",
            labels=["cluster", "endpoint"],
        )
        for e in self._endpoints():
            in_flight.add_metric([e.cluster.value, e.url], e.in_flight)
            healthy.add_metric([e.cluster.value, e.url], 1 if e.healthy else 0)
        yield in_flight
        yield healthy


class _KvIndexCollector(Collector):
    def __init__(self, sources: Callable[[], Iterable[Any]]) -> None:
        self._sources = sources

    def collect(self) -> Iterator[GaugeMetricFamily]:
        blocks = GaugeMetricFamily(
            "pdproxy_kv_index_blocks",
            "Blocks the KV index holds per server and data-parallel rank",
            labels=["endpoint", "rank"],
        )
        synced = GaugeMetricFamily(
            "pdproxy_kv_index_synced",
            "1 when the server's KV events are applied without a gap, 0 while unknown",
            labels=["endpoint", "rank"],
        )
        for s in self._sources():
            labels = [s.url, str(s.rank)]
            blocks.add_metric(labels, len(s))
            synced.add_metric(labels, 1 if s.state.value == "synced" else 0)
        yield blocks
        yield synced
