"""What each vLLM server says about its own load, scraped from its /metrics.

The router's own count of requests in flight on a server only sees what this router sent.
vLLM's Prometheus gauges see the server itself: its queue of requests waiting for a slot
(other routers' requests included), the requests it is running, and how full its KV cache
is. `parse_vllm_metrics` reads one /metrics answer into a `LoadReport`, and `LoadWeights`
folds a report into the number a balancer compares. `proxy.pool.scrape` fetches the
reports; this module knows nothing of endpoints, so `endpoints` can hold a report.
"""

from __future__ import annotations

import math
from typing import TYPE_CHECKING

import msgspec
from prometheus_client.parser import text_string_to_metric_families

# vLLM's gauges by their name without the "vllm:" prefix. The parser keeps the prefix
# and its colon as they are; a name spelled "vllm_" (colon replaced) is taken too.
_WAITING = "num_requests_waiting"
_RUNNING = "num_requests_running"
_KV_CACHE = ("kv_cache_usage_perc", "gpu_cache_usage_perc")  # the second: older vLLM
_CACHE_CONFIG = "cache_config_info"  # an info gauge: its num_gpu_blocks label
_PREFIXES = ("vllm:", "vllm_")
# A load report is ignored once older than this many scrape intervals, and at least
# STALE_AFTER_S (a busy router's scrapes may run late by a moment).
STALE_SCRAPES = 3
STALE_AFTER_S = 2.0

if TYPE_CHECKING:
    from proxy.config import Balance


class LoadReport(msgspec.Struct, frozen=True):
    """One scrape of a server's load; the counts are summed over its engines."""

    waiting: float  # requests queued on the server, waiting for a slot
    running: float  # requests the server is running
    kv_cache_usage: float  # 0..1: the fullest engine's KV cache
    at: float  # time.monotonic() when scraped
    # An engine's KV cache blocks (vllm:cache_config_info's num_gpu_blocks, the largest
    # engine's); None when not reported. kv_aware bounds its index of the server by it.
    num_blocks: int | None = None


def _vllm_name(name: str) -> str | None:
    for prefix in _PREFIXES:
        if name.startswith(prefix):
            return name[len(prefix) :]
    return None


def parse_vllm_metrics(text: str, at: float) -> LoadReport | None:
    """The load in a vLLM /metrics answer (Prometheus text format), or None when the text
    has neither the waiting nor the running gauge (not a vLLM) or does not parse.

    A server with several engines (data parallel) or models has one sample per label set:
    the counts are summed, the KV cache usage is the highest one. Never raises."""
    waiting: float | None = None
    running: float | None = None
    kv_cache = 0.0
    num_blocks: int | None = None
    try:
        for family in text_string_to_metric_families(text):
            for sample in family.samples:
                name = _vllm_name(sample.name)
                value = float(sample.value)
                if name is None or not math.isfinite(value):
                    continue
                if name == _WAITING:
                    waiting = (waiting or 0.0) + max(value, 0.0)
                elif name == _RUNNING:
                    running = (running or 0.0) + max(value, 0.0)
                elif name in _KV_CACHE:
                    kv_cache = max(kv_cache, min(value, 1.0))
                elif name == _CACHE_CONFIG:
                    blocks = sample.labels.get("num_gpu_blocks", "")
                    if blocks.isdigit():
                        num_blocks = max(num_blocks or 0, int(blocks))
    except Exception:  # the parser raises ValueError and others on malformed text
        return None
    if waiting is None and running is None:
        return None
    return LoadReport(waiting=waiting or 0.0, running=running or 0.0, kv_cache_usage=kv_cache,
                      at=at, num_blocks=num_blocks)


class LoadWeights:
    """How loaded a server is, lower is better: its load score is `in_flight +
    waiting_weight * waiting + kv_cache_weight * kv_cache_usage`, of which `reported`
    is the part its last report gives.

    - `in_flight`: the requests this router has sent the server and not seen finish.
      Always current, but blind to everything else the server is doing.
    - `waiting`: the server's own queue, requests that got no slot yet, other routers'
      requests included. Another request sent there waits behind all of them.
    - `kv_cache_usage` (0..1): a nearly full KV cache means vLLM preempts running
      requests (and computes them again later), so the server slows down before its
      queue shows it.

    A missing report, or one older than `max_age` seconds (the server stopped answering
    /metrics), counts as nothing: the score is `in_flight` alone. Built once per
    balancer from its settings (`of`): one call per candidate, where a closure calling
    a scoring function with keywords was two, on every kv_aware and load_aware pick."""

    __slots__ = ("max_age", "waiting_weight", "kv_cache_weight")

    def __init__(self, max_age: float, waiting_weight: float, kv_cache_weight: float) -> None:
        self.max_age = max_age
        self.waiting_weight = waiting_weight
        self.kv_cache_weight = kv_cache_weight

    @classmethod
    def of(cls, settings: Balance) -> LoadWeights:
        return cls(max(STALE_SCRAPES * settings.scrape_interval, STALE_AFTER_S),
                   settings.waiting_weight, settings.kv_cache_weight)

    def reported(self, report: LoadReport | None, now: float) -> float:
        """The report's share of the load score: 0.0 for none, or one too old."""
        if report is None or now - report.at > self.max_age:
            return 0.0
        return self.waiting_weight * report.waiting + self.kv_cache_weight * report.kv_cache_usage
