"""What each vLLM server says about its own load, scraped from its /metrics.

The router's own count of requests in flight on a server only sees what this router sent.
vLLM's Prometheus gauges see the server itself: its queue of requests waiting for a slot
(other routers' requests included), the requests it is running, and how full its KV cache
is. Every `interval` seconds a `LoadScraper` GETs `/metrics` from every endpoint and puts
a `LoadReport` (or None, when the scrape failed) on `endpoint.load`; `load_score` folds a
report into the number a balancer compares.
"""

from __future__ import annotations

import asyncio
import logging
import math
import time
from collections.abc import Callable
from typing import TYPE_CHECKING

import msgspec
from prometheus_client.parser import text_string_to_metric_families

from proxy.errors import Overloaded, UpstreamError
from proxy.periodic import Periodic
from proxy.upstream import UpstreamClient

if TYPE_CHECKING:
    from proxy.endpoints import Endpoint

logger = logging.getLogger("pdproxy.load")

# vLLM's gauges by their name without the "vllm:" prefix. The parser keeps the prefix
# and its colon as they are; a name spelled "vllm_" (colon replaced) is taken too.
_WAITING = "num_requests_waiting"
_RUNNING = "num_requests_running"
_KV_CACHE = ("kv_cache_usage_perc", "gpu_cache_usage_perc")  # the second: older vLLM
_PREFIXES = ("vllm:", "vllm_")


class LoadReport(msgspec.Struct, frozen=True):
    """One scrape of a server's load; the counts are summed over its engines."""

    waiting: float  # requests queued on the server, waiting for a slot
    running: float  # requests the server is running
    kv_cache_usage: float  # 0..1: the fullest engine's KV cache
    at: float  # time.monotonic() when scraped


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
    except Exception:  # the parser raises ValueError and others on malformed text
        return None
    if waiting is None and running is None:
        return None
    return LoadReport(
        waiting=waiting or 0.0, running=running or 0.0, kv_cache_usage=kv_cache, at=at
    )


def load_score(
    in_flight: int,
    report: LoadReport | None,
    *,
    now: float,
    max_age: float,
    waiting_weight: float,
    kv_cache_weight: float,
) -> float:
    """How loaded a server is, lower is better: `in_flight + waiting_weight * waiting +
    kv_cache_weight * kv_cache_usage`.

    - `in_flight`: the requests this router has sent the server and not seen finish.
      Always current, but blind to everything else the server is doing.
    - `waiting`: the server's own queue, requests that got no slot yet, other routers'
      requests included. Another request sent there waits behind all of them.
    - `kv_cache_usage` (0..1): a nearly full KV cache means vLLM preempts running
      requests (and computes them again later), so the server slows down before its
      queue shows it.

    A missing report, or one older than `max_age` seconds (the server stopped answering
    /metrics), counts as nothing: the score is `in_flight` alone."""
    if report is None or now - report.at > max_age:
        return float(in_flight)
    return in_flight + waiting_weight * report.waiting + kv_cache_weight * report.kv_cache_usage


class LoadScraper:
    def __init__(
        self,
        endpoints: Callable[[], list[Endpoint]],  # the current ones, at each round
        client: UpstreamClient,
        *,
        interval: float,
        timeout: float,
    ) -> None:
        self._endpoints = endpoints
        self._client = client
        self._timeout = timeout
        self._rounds = Periodic("load-scraper", interval, self.scrape_all, at_once=True)
        self._failing: set[str] = set()  # urls whose last scrape failed (warned once)

    def start(self) -> None:
        self._rounds.start()

    async def aclose(self) -> None:
        await self._rounds.aclose()

    async def scrape_all(self) -> None:
        """One round: every current endpoint at once."""
        endpoints = self._endpoints()
        self._failing &= {e.url for e in endpoints}  # forget removed servers
        await asyncio.gather(*(self.scrape(e) for e in endpoints))

    async def scrape(self, endpoint: Endpoint) -> None:
        try:
            text = await self._client.get_text(
                f"{endpoint.url}/metrics",
                endpoint=endpoint.url,
                cluster=endpoint.cluster.value,
                timeout=self._timeout,
            )
        except (UpstreamError, Overloaded) as exc:  # Overloaded: the control lane is full
            self._failed(endpoint, str(exc))
            return
        report = parse_vllm_metrics(text, time.monotonic())
        if report is None:
            self._failed(endpoint, "its /metrics has no vLLM request gauges")
            return
        if endpoint.url in self._failing:
            self._failing.discard(endpoint.url)
            logger.info("%s %s: load metrics are back", endpoint.cluster.value, endpoint.url)
        endpoint.load = report

    def _failed(self, endpoint: Endpoint, why: str) -> None:
        endpoint.load = None
        level = logging.DEBUG if endpoint.url in self._failing else logging.WARNING
        self._failing.add(endpoint.url)
        logger.log(level, "%s %s: no load metrics: %s", endpoint.cluster.value, endpoint.url, why)
