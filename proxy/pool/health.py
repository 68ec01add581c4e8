"""Active health checks: every `health.interval` seconds, GET /health on each endpoint.

A server goes down after `unhealthy_threshold` failed checks in a row and comes back
after `healthy_threshold` passed ones, so one lost packet does not take it out and a
flapping server does not come back on its first good answer. A refused connection during
a request takes the endpoint down at once (passive check, in `Exchange`); checks then
bring it back. A P that comes back may be a restarted server with a new engine id, so its
learned coordinates are forgotten: the next push request probes it again.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Callable

from proxy.config import HealthChecks
from proxy.errors import Overloaded, UpstreamError
from proxy.pool.endpoints import ClusterName, Endpoint
from proxy.pool.periodic import Periodic
from proxy.pool.probe import CoordinateProber
from proxy.upstream.client import UpstreamClient

logger = logging.getLogger("pdproxy.health")


class HealthChecker:
    def __init__(
        self,
        endpoints: Callable[[], list[Endpoint]],  # the current ones, at each round
        client: UpstreamClient,
        prober: CoordinateProber,
        settings: HealthChecks,
        *,
        timeout: float,
    ) -> None:
        self._endpoints = endpoints
        self._client = client
        self._prober = prober
        self._settings = settings
        self._timeout = timeout
        self._rounds = Periodic("health-checker", settings.interval, self.check_all)

    def start(self) -> None:
        self._rounds.start()

    async def aclose(self) -> None:
        await self._rounds.aclose()

    async def check_all(self) -> None:
        await asyncio.gather(*(self.check(e) for e in self._endpoints()))

    async def check(self, endpoint: Endpoint) -> None:
        error = None
        try:
            await self._client.get_json(
                f"{endpoint.url}/health",
                endpoint=endpoint.url,
                cluster=endpoint.cluster.value,
                timeout=self._timeout,
                expect_json=False,
            )
        except Overloaded as exc:  # the control lane is full: no verdict on the server
            logger.warning("health check of %s skipped: %s", endpoint.url, exc)
            return
        except UpstreamError as exc:
            error = str(exc)
            endpoint.last_error = error
        changed = endpoint.record_check(
            error is None,
            healthy_after=self._settings.healthy_threshold,
            unhealthy_after=self._settings.unhealthy_threshold,
        )
        if not changed:
            return
        name = f"{endpoint.cluster.value} {endpoint.url}"
        if error is not None:
            logger.warning("%s is unhealthy after %d failed checks: %s", name,
                           self._settings.unhealthy_threshold, error)
            return
        logger.info("%s is healthy again", name)
        if endpoint.cluster is ClusterName.PREFILL:
            self._prober.forget(endpoint)

    def count_failure(self, endpoint: Endpoint, why: str) -> None:
        """A request's leg found the server failing (a lost connection): counted as one
        failed check, so `unhealthy_threshold` of them in a row (checks or legs) take it
        out (only when checks are running: without them nothing would bring it back)."""
        if self._settings.interval <= 0:
            return
        endpoint.last_error = why
        if endpoint.record_check(False, healthy_after=self._settings.healthy_threshold,
                                 unhealthy_after=self._settings.unhealthy_threshold):
            logger.warning("%s %s is unhealthy after %d failures in a row (last: %s)",
                           endpoint.cluster.value, endpoint.url,
                           self._settings.unhealthy_threshold, why)

    def mark_down(self, endpoint: Endpoint, why: str) -> None:
        """Take an endpoint out until checks pass again (only when checks are running:
        without them nothing would bring it back)."""
        if self._settings.interval <= 0:
            return
        if endpoint.mark_down(why):
            logger.warning("%s %s is unhealthy: %s", endpoint.cluster.value, endpoint.url, why)
