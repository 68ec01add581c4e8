"""Learning a P's KV coordinates (engine id, side channel, tp size, modes) by probing it.

A push request needs P's coordinates before P answers, so the router learns them ahead:
a probe is a one-token prefill with `do_remote_decode`, whose answer names them. A probe
is itself a prefill that a stock vLLM P keeps the blocks of until its KV lease runs out
(no D ever reads them), so probes are rare and tiny: once per P, again only when the P
came back from a failed health check (a restart gives it a new engine id), and no more
often than `probe_retry_interval` after a failure. Coordinates in the config make
probes unnecessary. Every P answer also refreshes what is known (`observe`).
"""

from __future__ import annotations

import asyncio
import logging
import time
from typing import Any

from connector import wire
from proxy.endpoints import Endpoint
from proxy.errors import Overloaded, UpstreamError
from proxy.metrics import RouterMetrics
from proxy.protocol import PREFILL_KV_PARAMS, PrefillCoordinates, coordinates_from_answer
from proxy.upstream import UpstreamClient

logger = logging.getLogger("pdproxy.probe")

PROBE_PROMPT = "ping"


class CoordinateProber:
    def __init__(
        self,
        client: UpstreamClient,
        metrics: RouterMetrics,
        *,
        timeout: float,
        retry_interval: float,
    ) -> None:
        self._client = client
        self._metrics = metrics
        self._timeout = timeout
        self._retry_interval = retry_interval
        # One probe at a time per endpoint URL; later callers await the same task.
        self._running: dict[str, asyncio.Task[PrefillCoordinates | None]] = {}
        self._last_failure: dict[str, float] = {}  # monotonic time of the last failed probe

    async def coordinates(self, endpoint: Endpoint, model: str) -> PrefillCoordinates | None:
        """The P's coordinates, probing it once if they are not known yet. None when
        they cannot be learned now (the caller falls back to pull)."""
        known = endpoint.coordinates
        if known is not None:
            return known
        failed_at = self._last_failure.get(endpoint.url)
        if failed_at is not None and time.monotonic() - failed_at < self._retry_interval:
            return None
        task = self._running.get(endpoint.url)
        if task is None:
            task = asyncio.create_task(
                self._probe(endpoint, model), name=f"probe {endpoint.url}"
            )
            self._running[endpoint.url] = task
            task.add_done_callback(lambda _t: self._running.pop(endpoint.url, None))
        # shield: a caller's cancellation (its client left) must not kill a shared probe.
        return await asyncio.shield(task)

    def forget(self, endpoint: Endpoint) -> None:
        """The P restarted (or may have): its engine id is stale."""
        endpoint.learned_coordinates = None
        self._last_failure.pop(endpoint.url, None)

    def observe(self, endpoint: Endpoint, p_params: Any) -> None:
        """Refresh a P's coordinates from the kv_transfer_params of any of its answers."""
        known = endpoint.learned_coordinates
        if (
            known is not None
            and isinstance(p_params, dict)
            and p_params.get(wire.REMOTE_ENGINE_ID) == known.engine_id
            and p_params.get(wire.REMOTE_PORT) == known.port
        ):
            return  # the usual case, checked without decoding the whole object
        seen = coordinates_from_answer(p_params)
        if seen is None or seen == known:
            return
        if endpoint.learned_coordinates is not None:
            logger.info(
                "prefill %s changed coordinates: engine %s -> %s (restarted?)",
                endpoint.url,
                endpoint.learned_coordinates.engine_id,
                seen.engine_id,
            )
        endpoint.learned_coordinates = seen

    async def aclose(self) -> None:
        for task in list(self._running.values()):
            task.cancel()
        await asyncio.gather(*self._running.values(), return_exceptions=True)

    async def _probe(self, endpoint: Endpoint, model: str) -> PrefillCoordinates | None:
        body = {
            "model": model,
            "prompt": PROBE_PROMPT,
            "max_tokens": 1,
            "stream": False,
            # `probe`: our connector frees a probe's blocks at once (stock ones ignore it).
            wire.KV_TRANSFER_PARAMS: {**PREFILL_KV_PARAMS, wire.PROBE: True},
        }
        try:
            answer = await self._client.post_json(
                f"{endpoint.url}/v1/completions",
                body,
                headers={wire.REQUEST_ID_HEADER: f"pdproxy-probe-{time.monotonic_ns()}"},
                endpoint=endpoint.url,
                cluster=endpoint.cluster.value,
                timeout=self._timeout,
                control=True,  # never queued behind user traffic
            )
        except (UpstreamError, Overloaded) as exc:  # Overloaded: the control lane is full
            self._failed(endpoint, f"{type(exc).__name__}: {exc}")
            return None
        params = answer.get(wire.KV_TRANSFER_PARAMS) if isinstance(answer, dict) else None
        seen = coordinates_from_answer(params)
        if seen is None:
            self._failed(endpoint, f"answer has no usable kv_transfer_params: {params!r}")
            return None
        endpoint.learned_coordinates = seen
        self._metrics.probes.labels(endpoint.url, "ok").inc()
        logger.info(
            "prefill %s: engine %s, side channel %s:%d, tp %d, modes %s",
            endpoint.url,
            seen.engine_id,
            seen.host,
            seen.port,
            seen.tp_size,
            ",".join(sorted(m.value for m in seen.transfer_modes)),
        )
        return endpoint.coordinates

    def _failed(self, endpoint: Endpoint, why: str) -> None:
        self._last_failure[endpoint.url] = time.monotonic()
        self._metrics.probes.labels(endpoint.url, "failed").inc()
        logger.warning(
            "probe of prefill %s failed (push falls back to pull for %.0f s): %s",
            endpoint.url,
            self._retry_interval,
            why,
        )
