"""Every `interval` seconds, GET `/metrics` from every endpoint and put the `LoadReport`
it gives (or None, when the scrape failed) on `endpoint.load`, for load_aware balancing
(see `proxy.pool.load`)."""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Callable

from proxy.errors import Overloaded, UpstreamError
from proxy.pool.endpoints import Endpoint
from proxy.pool.load import parse_vllm_metrics
from proxy.pool.periodic import Periodic
from proxy.upstream.client import UpstreamClient

logger = logging.getLogger("pdproxy.load")


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
