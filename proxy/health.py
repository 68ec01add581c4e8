"""Active health checks: every `health_interval` seconds, GET /health on each endpoint.

A failed connection during a request also marks an endpoint unhealthy at once (passive
check, in the flows); the next passing check brings it back. A P that comes back may be
a restarted server with a new engine id, so its learned coordinates are forgotten and
the next push request probes it again.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Callable

from proxy.endpoints import ClusterName, Endpoint
from proxy.errors import UpstreamError
from proxy.probe import CoordinateProber
from proxy.upstream import UpstreamClient

logger = logging.getLogger("pdproxy.health")


class HealthChecker:
    def __init__(
        self,
        endpoints: Callable[[], list[Endpoint]],  # the current ones, at each round
        client: UpstreamClient,
        prober: CoordinateProber,
        *,
        interval: float,
        timeout: float,
    ) -> None:
        self._endpoints = endpoints
        self._client = client
        self._prober = prober
        self._interval = interval
        self._timeout = timeout
        self._task: asyncio.Task[None] | None = None

    def start(self) -> None:
        if self._interval > 0 and self._task is None:
            self._task = asyncio.create_task(self._run(), name="health-checker")

    async def aclose(self) -> None:
        if self._task is not None:
            self._task.cancel()
            await asyncio.gather(self._task, return_exceptions=True)
            self._task = None

    async def check_all(self) -> None:
        await asyncio.gather(*(self.check(e) for e in self._endpoints()))

    async def check(self, endpoint: Endpoint) -> None:
        try:
            await self._client.get_json(
                f"{endpoint.url}/health",
                endpoint=endpoint.url,
                cluster=endpoint.cluster.value,
                timeout=self._timeout,
                expect_json=False,
            )
        except UpstreamError as exc:
            self.mark_down(endpoint, str(exc))
            return
        if endpoint.set_healthy(True):
            logger.info("%s %s is healthy again", endpoint.cluster.value, endpoint.url)
            if endpoint.cluster is ClusterName.PREFILL:
                self._prober.forget(endpoint)

    def mark_down(self, endpoint: Endpoint, why: str) -> None:
        """Take an endpoint out until a check passes (only when checks are running)."""
        if self._interval <= 0:
            return
        if endpoint.healthy:
            logger.warning("%s %s is unhealthy: %s", endpoint.cluster.value, endpoint.url, why)
        endpoint.set_healthy(False)

    async def _run(self) -> None:
        while True:
            await asyncio.sleep(self._interval)
            try:
                await self.check_all()
            except Exception:  # one bad round must not end the checks
                logger.exception("health check round failed")
