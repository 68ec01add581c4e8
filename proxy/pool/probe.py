"""Learning a P's KV coordinates (engine id, side channel, tp size, modes) by probing it.

A push request needs P's coordinates before P answers, so the router learns them ahead:
a probe is a one-token prefill with `do_remote_decode`, whose answer names them. A probe
is itself a prefill that a stock vLLM P keeps the blocks of until its KV lease runs out
(no D ever reads them), so probes are rare and tiny: once per P, again only when the P
came back from a failed health check (a restart gives it a new engine id), and no more
often than `probe_retry_interval` after a failure. Coordinates in the config make
probes unnecessary. Every P answer also refreshes what is known (`observe`).

A data-parallel P (vLLM's `--data-parallel-size`: several engines behind one URL, engine
id `<id>_dp{rank}`, side channel and push ports offset by the rank) says so in its
answers (`dp_rank`, and `dp_size` where its engine knows it). Each probe is pinned to a
rank with vLLM's `X-data-parallel-rank` header, the first to rank 0; when that answer
says P has N ranks, ranks 1..N-1 are probed at once, and when it says P is
data-parallel but not how wide (a dense model's engines do not know), ranks 1, 2, ...
are probed one at a time until P answers that the rank is out of range (vLLM's 400).
Each rank's coordinates go to the P's `DataParallelRanks`; ranks a probe missed are
probed again when a push finds them missing (`complete_ranks`).

What a P says is not trusted to size the work: at most `limits.max_dp_ranks` ranks are
used (a P that says it has more is used through its first ones, and answers from ranks
beyond are not learned), and at most RANK_PROBES_AT_ONCE probes of one P run at once,
so a P claiming thousands of ranks costs a few probes at a time, never a burst that
fills the control lane.
"""

from __future__ import annotations

import asyncio
import enum
import logging
import time
from collections.abc import Iterator
from typing import cast

import msgspec
from prometheus_client.core import GaugeMetricFamily
from prometheus_client.registry import Collector

from connector.protocol import http_params as wire
from proxy.errors import Overloaded, UpstreamError, UpstreamStatusError
from proxy.metrics import RouterMetrics
from proxy.pool.endpoints import DataParallelRanks, Endpoint
from proxy.protocol import (
    PREFILL_KV_PARAMS,
    PrefillCoordinates,
    coordinates_from_answer,
    coordinates_from_params,
)
from proxy.task_scope import own_exception_state
from proxy.upstream.client import UpstreamClient

logger = logging.getLogger("pdproxy.probe")

PROBE_PROMPT = "ping"
# Probes of one data-parallel P's ranks running at once, at most.
RANK_PROBES_AT_ONCE = 4


class _Outcome(enum.Enum):
    FAILED = "failed"  # no coordinates now (logged and counted)
    OUT_OF_RANGE = "out_of_range"  # P has no such data-parallel rank (vLLM's 400)


class CoordinateProber:
    def __init__(
        self,
        client: UpstreamClient,
        metrics: RouterMetrics,
        *,
        timeout: float,
        retry_interval: float,
        max_ranks: int = 64,
    ) -> None:
        self._client = client
        self._metrics = metrics
        self._max_ranks = max_ranks  # limits.max_dp_ranks
        self._too_wide: set[str] = set()  # P's said to have more ranks (warned once)
        self._timeout = timeout
        self._retry_interval = retry_interval
        # One probe at a time per endpoint URL; later callers await the same task.
        self._running: dict[str, asyncio.Task[PrefillCoordinates | None]] = {}
        self._last_failure: dict[str, float] = {}  # monotonic time of the last failed probe
        # Probes of a data-parallel P's missing ranks (`complete_ranks`), one per URL.
        self._completing: dict[str, asyncio.Task[None]] = {}
        # The data-parallel P's whose ranks were learned, for /metrics; out when forgotten.
        self._data_parallel: dict[str, Endpoint] = {}
        metrics.registry.register(cast(Collector, _RankCollector(self._data_parallel)))

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
                own_exception_state(self._probe(endpoint, model)), name=f"probe {endpoint.url}"
            )
            self._running[endpoint.url] = task
            task.add_done_callback(lambda _t: self._running.pop(endpoint.url, None))
        # shield: a caller's cancellation (its client left) must not kill a shared probe.
        return await asyncio.shield(task)

    def complete_ranks(self, endpoint: Endpoint, model: str) -> None:
        """Probe, in the background, the ranks of a data-parallel P whose coordinates are
        not known (a probe failed, or P's answers showed it data-parallel before any probe);
        no more often than `probe_retry_interval` after a failure. Never waits."""
        ranks = endpoint.learned_ranks
        if ranks is None or ranks.missing() == []:
            return
        url = endpoint.url
        if url in self._running or url in self._completing:
            return
        failed_at = self._last_failure.get(url)
        if failed_at is not None and time.monotonic() - failed_at < self._retry_interval:
            return
        task = asyncio.create_task(own_exception_state(self._probe_ranks(endpoint, model, ranks)),
                                   name=f"probe ranks {url}")
        self._completing[url] = task
        task.add_done_callback(lambda _t: self._completing.pop(url, None))

    def forget(self, endpoint: Endpoint) -> None:
        """The P restarted (or may have): its engine ids are stale."""
        endpoint.learned_coordinates = None
        endpoint.learned_ranks = None
        self._data_parallel.pop(endpoint.url, None)
        self._last_failure.pop(endpoint.url, None)
        self._too_wide.discard(endpoint.url)

    def observe(self, endpoint: Endpoint, params: wire.KVTransferParams | None) -> None:
        """Refresh a P's coordinates (for a data-parallel P, those of the rank that
        answered) from the kv_transfer_params of any of its answers, decoded."""
        if params is None:
            return
        rank = params.dp_rank
        ranks = endpoint.learned_ranks
        if ranks is None:
            known = endpoint.learned_coordinates
        else:
            known = ranks.get(rank) if rank is not None else None
        if (
            known is not None
            and params.remote_engine_id == known.engine_id
            and params.remote_port == known.port
            and rank == known.dp_rank
        ):
            return  # the usual case: the coordinates not built again
        seen = coordinates_from_params(params)
        if seen is None or seen == known:
            return
        self._learn(endpoint, seen)

    async def aclose(self) -> None:
        tasks = [*self._running.values(), *self._completing.values()]
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)

    def _learn(self, endpoint: Endpoint, seen: PrefillCoordinates) -> None:
        """Take `seen`, one engine's coordinates from a P answer, into what is known."""
        url = endpoint.url
        if not seen.data_parallel:
            if endpoint.learned_ranks is not None:
                logger.info("prefill %s is no longer data-parallel (restarted?)", url)
                endpoint.learned_ranks = None
                self._data_parallel.pop(url, None)
            known = endpoint.learned_coordinates
            if known is not None and known.engine_id != seen.engine_id:
                logger.info("prefill %s changed coordinates: engine %s -> %s (restarted?)",
                            url, known.engine_id, seen.engine_id)
            endpoint.learned_coordinates = seen
            return
        assert seen.dp_rank is not None  # data_parallel
        if seen.dp_size is not None and seen.dp_size > self._max_ranks:
            if url not in self._too_wide:
                self._too_wide.add(url)
                logger.warning("prefill %s says it has %d data-parallel ranks; the router uses "
                               "the first %d (limits.max_dp_ranks)", url, seen.dp_size,
                               self._max_ranks)
            seen = msgspec.structs.replace(seen, dp_size=self._max_ranks)
        assert seen.dp_rank is not None  # still
        if seen.dp_rank >= self._max_ranks:
            return  # a rank beyond those used: not learned
        ranks = endpoint.learned_ranks
        if ranks is None or (ranks.size is not None and (
                seen.dp_rank >= ranks.size or seen.dp_size not in (None, ranks.size))):
            if ranks is not None:
                logger.info("prefill %s changed its data-parallel size %s -> %s (restarted?)",
                            url, ranks.size, seen.dp_size)
            ranks = endpoint.learned_ranks = DataParallelRanks(seen.dp_size)
            self._data_parallel[url] = endpoint
        elif ranks.size is None and seen.dp_size is not None:
            ranks.size = seen.dp_size
        previous = ranks.learn(seen)
        if previous is not None and previous.engine_id != seen.engine_id:
            logger.info("prefill %s rank %d changed coordinates: engine %s -> %s (restarted?)",
                        url, seen.dp_rank, previous.engine_id, seen.engine_id)
        known = endpoint.learned_coordinates
        if known is None or known.dp_rank in (None, seen.dp_rank) or ranks.get(
                known.dp_rank) is None:
            endpoint.learned_coordinates = seen  # what P can do: any rank tells

    async def _probe(self, endpoint: Endpoint, model: str) -> PrefillCoordinates | None:
        seen = await self._probe_rank(endpoint, model, 0)
        if not isinstance(seen, PrefillCoordinates):
            if seen is _Outcome.OUT_OF_RANGE:
                self._failed(endpoint, "P has no data-parallel rank 0")
            return None
        self._learn(endpoint, seen)
        ranks = endpoint.learned_ranks
        if ranks is not None:
            await self._probe_ranks(endpoint, model, ranks)
        logger.info(
            "prefill %s: engine %s, side channel %s:%d, tp %d, modes %s%s",
            endpoint.url,
            seen.engine_id,
            seen.host,
            seen.port,
            seen.tp_size,
            ",".join(sorted(m.value for m in seen.transfer_modes)),
            "" if ranks is None else f"; data-parallel, {ranks.snapshot()}",
        )
        return endpoint.coordinates

    async def _probe_ranks(self, endpoint: Endpoint, model: str, ranks: DataParallelRanks) -> None:
        """Probe the ranks of `ranks` not known yet: RANK_PROBES_AT_ONCE at a time when P
        said how many it has, else one at a time from rank 1 until P has no such rank."""
        missing = ranks.missing()
        if missing is not None:
            gate = asyncio.Semaphore(RANK_PROBES_AT_ONCE)

            async def probe(rank: int) -> PrefillCoordinates | _Outcome:
                async with gate:
                    return await self._probe_rank(endpoint, model, rank)

            outcomes = await asyncio.gather(*(own_exception_state(probe(r)) for r in missing))
            for outcome in outcomes:
                if isinstance(outcome, PrefillCoordinates) and endpoint.learned_ranks is ranks:
                    self._learn(endpoint, outcome)
            return
        for rank in range(1, self._max_ranks):
            if ranks.get(rank) is not None:
                continue
            outcome = await self._probe_rank(endpoint, model, rank)
            if endpoint.learned_ranks is not ranks:
                return  # forgotten or replaced meanwhile
            if outcome is _Outcome.OUT_OF_RANGE:
                ranks.size = rank
                return
            if outcome is _Outcome.FAILED:
                return  # the rest when a push asks (complete_ranks)
            self._learn(endpoint, outcome)
            if ranks.size is not None:  # an answer said the size after all
                await self._probe_ranks(endpoint, model, ranks)
                return
        logger.warning("prefill %s: more than %d data-parallel ranks; pushes use the first %d "
                       "(limits.max_dp_ranks)", endpoint.url, self._max_ranks, self._max_ranks)
        ranks.size = self._max_ranks

    async def _probe_rank(
        self, endpoint: Endpoint, model: str, rank: int
    ) -> PrefillCoordinates | _Outcome:
        """One probe pinned to data-parallel rank `rank` (a P of one engine has rank 0)."""
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
                headers={wire.REQUEST_ID_HEADER: f"pdproxy-probe-{time.monotonic_ns()}",
                         wire.DATA_PARALLEL_RANK_HEADER: str(rank)},
                endpoint=endpoint.url,
                cluster=endpoint.cluster.value,
                timeout=self._timeout,
                control=True,  # never queued behind user traffic
            )
        except UpstreamStatusError as exc:
            if rank_out_of_range(exc):
                self._metrics.probes.labels(endpoint.url, "out_of_range").inc()
                return _Outcome.OUT_OF_RANGE
            self._failed(endpoint, f"{type(exc).__name__}: {exc}")
            return _Outcome.FAILED
        except (UpstreamError, Overloaded) as exc:  # Overloaded: the control lane is full
            self._failed(endpoint, f"{type(exc).__name__}: {exc}")
            return _Outcome.FAILED
        params = answer.get(wire.KV_TRANSFER_PARAMS) if isinstance(answer, dict) else None
        seen = coordinates_from_answer(params)
        if seen is None:
            self._failed(endpoint, f"answer has no usable kv_transfer_params: {params!r}")
            return _Outcome.FAILED
        if seen.data_parallel and seen.dp_rank != rank:
            logger.warning("prefill %s: a probe pinned to rank %d ran on rank %s (the %s "
                           "header is ignored?)", endpoint.url, rank, seen.dp_rank,
                           wire.DATA_PARALLEL_RANK_HEADER)
        self._metrics.probes.labels(endpoint.url, "ok").inc()
        return seen

    def _failed(self, endpoint: Endpoint, why: str) -> None:
        self._last_failure[endpoint.url] = time.monotonic()
        self._metrics.probes.labels(endpoint.url, "failed").inc()
        logger.warning(
            "probe of prefill %s failed (push falls back to pull for %.0f s): %s",
            endpoint.url,
            self._retry_interval,
            why,
        )


def rank_out_of_range(exc: UpstreamStatusError) -> bool:
    """P refused the data-parallel rank a request was pinned to: vLLM answers 400 with
    "data_parallel_rank N is out of range [0, size)"."""
    return exc.status == 400 and b"data_parallel_rank" in exc.content


class _RankCollector:
    """Each data-parallel P's ranks, read when scraped: the pushes in flight on each,
    labelled with the rank's engine id. (A collector by its `collect`, which is all
    prometheus_client's registry asks: compiled, a class cannot subclass its `Collector`.)"""

    def __init__(self, endpoints: dict[str, Endpoint]) -> None:
        self._endpoints = endpoints

    def collect(self) -> Iterator[GaugeMetricFamily]:
        if not self._endpoints:
            return  # no data-parallel P: no family at all (an empty one reads as a bug)
        family = GaugeMetricFamily(
            "pdproxy_prefill_rank_pushes_in_flight",
            "Pushes in flight pinned to each data-parallel rank of a P, by its engine id",
            labels=["endpoint", "rank", "engine_id"],
        )
        for url, endpoint in list(self._endpoints.items()):
            ranks = endpoint.learned_ranks
            if ranks is None:
                continue
            for rank, coordinates, in_flight in ranks.rows():
                family.add_metric([url, str(rank), coordinates.engine_id], in_flight)
        yield family
